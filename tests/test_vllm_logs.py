"""kvxfer's lines reach the engine's log: vLLM configures its own logger only, so kvxfer's logger takes vLLM's
handlers and level (and leaves a user's own logging config alone); the start-up line says which config is active."""
from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import pytest

from kvxfer.offload.vllm.logs import config_summary, log_through_vllm


@pytest.fixture
def loggers() -> Iterator[tuple[logging.Logger, logging.Logger, io.StringIO]]:
    engine, ours = logging.getLogger("test-engine"), logging.getLogger("test-kvxfer")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(logging.Formatter("ENGINE %(levelname)s %(name)s %(message)s"))
    engine.addHandler(handler)
    engine.setLevel(logging.INFO)
    engine.propagate = False
    yield engine, ours, out
    for lg in (engine, ours):
        lg.handlers.clear()
        lg.setLevel(logging.NOTSET)
        lg.propagate = True


def test_kvxfers_info_lines_appear_in_the_engines_log_in_its_format(loggers) -> None:
    engine, ours, out = loggers
    child = logging.getLogger("test-kvxfer.offload.vllm")
    child.info("before: lost (no handler, and the last-resort handler shows warnings only)")
    assert log_through_vllm("test-engine", "test-kvxfer")
    child.info("kvxfer is active")
    child.debug("below the engine's level")
    assert out.getvalue() == "ENGINE INFO test-kvxfer.offload.vllm kvxfer is active\n"


def test_a_users_own_config_and_an_unconfigured_engine_are_left_alone(loggers) -> None:
    engine, ours, out = loggers
    mine = logging.StreamHandler(io.StringIO())
    ours.addHandler(mine)
    assert not log_through_vllm("test-engine", "test-kvxfer")
    assert ours.handlers == [mine] and ours.propagate
    ours.handlers.clear()
    assert not log_through_vllm("test-unconfigured-engine", "test-kvxfer")  # VLLM_CONFIGURE_LOGGING=0
    assert not ours.handlers
    assert log_through_vllm("test-engine", "test-kvxfer")
    assert not log_through_vllm("test-engine", "test-kvxfer")  # once: no line written twice
    logging.getLogger("test-kvxfer").warning("once")
    assert out.getvalue().count("once") == 1


def test_the_start_up_line_names_the_host_tier_and_every_kvxfer_key_given() -> None:
    extra = {"spec_name": "KvxferOffloadingSpec", "cpu_bytes_to_use": 64 << 20, "kvxfer_executor": {"kind": "numpy"},
             "kvxfer_stats_path": "/tmp/s.json", "eviction_policy": "lru"}
    assert config_summary(extra) == ("cpu_bytes_to_use=67108864, kvxfer_executor={'kind': 'numpy'}, "
                                     "kvxfer_stats_path='/tmp/s.json'")
    assert config_summary({"spec_name": "x"}) == "defaults"
