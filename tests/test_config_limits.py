"""Executor settings that bound nothing are refused naming the field: an infinite NIXL wait, a descriptor cap past
any call, a NUL in the agent's name (a C string), from a config file and from the CLI."""
from __future__ import annotations

import json

import pytest

from kvxfer.executors import ExecutorConfig
from tests.test_exec_cli import _run, case_file  # noqa: F401  (the fixture)


@pytest.mark.parametrize("config,field", [
    ({"kind": "nixl", "nixl": {"poll_timeout_s": float("inf")}}, "nixl.poll_timeout_s"),
    ({"kind": "nixl", "nixl": {"drain_timeout_s": float("nan")}}, "nixl.drain_timeout_s"),
    ({"kind": "numpy", "max_descriptors": 2**64}, "max_descriptors"),
    ({"kind": "numpy", "cuda": {"max_descriptors": 2**64}}, "cuda.max_descriptors"),
    ({"kind": "numpy", "hip": {"max_descriptors": 2**64}}, "hip.max_descriptors"),
    ({"kind": "nixl", "nixl": {"name": "agent\0x"}}, "nixl.name"),
])
def test_settings_that_bound_nothing_are_refused_naming_the_field(config, field):
    with pytest.raises(ValueError) as e:
        ExecutorConfig.load(config)
    assert getattr(e.value, "field", None) == field and "\n" not in str(e.value)


def test_the_cli_refuses_a_descriptor_cap_past_any_call_and_an_infinite_wait(case_file, tmp_path, capsys):  # noqa: F811
    code, _, err = _run([case_file, "--executor", "numpy", "--max-descriptors", str(2**64)], capsys)
    assert code != 0 and "max_descriptors" in err
    cfg = tmp_path / "ex.json"
    cfg.write_text(json.dumps({"kind": "numpy", "nixl": {"poll_timeout_s": 1e999}}).replace("1e999", "Infinity"))
    code, _, err = _run([case_file, "--config", str(cfg)], capsys)
    assert code != 0 and "poll_timeout_s" in err
