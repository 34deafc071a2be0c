"""A store can cost the cache, never the engine: the vLLM wing's start-up checks, its counters file and its tier's
job refusals, without an engine (the tier's own test needs vLLM's classes and runs under ``make test-vllm``)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from kvxfer.offload.vllm.checks import ExtraConfigError, check_extra
from kvxfer.offload.vllm.stats import StatsFile
from tests.test_vllm_tiers import _finished, _tier, needs_vllm


def _deep(n: int) -> dict:
    out: dict = {}
    cur = out
    for _ in range(n):
        cur["a"] = {}
        cur = cur["a"]
    return out


@pytest.mark.parametrize("extra,key", [
    ({"kvxfer_stats_path": "/tmp/stats\0.json"}, "kvxfer_stats_path"),
    ({"kvxfer_stats_path": "/tmp/" + "x" * 5000}, "kvxfer_stats_path"),
    ({"kvxfer_stats_path": "/tmp/" + "d/" * 2500 + "s.json"}, "kvxfer_stats_path"),
    ({"kvxfer_stats_path": "/tmp/\ud800.json"}, "kvxfer_stats_path"),
    ({"cpu_bytes_to_use": 10**400}, "cpu_bytes_to_use"),
    ({"kvxfer_executor": _deep(5000)}, "kvxfer_executor"),
    ({"secondary_tiers": [_deep(5000)]}, "secondary_tiers"),
])
def test_start_up_refuses_every_bad_value_in_one_line_naming_the_key(extra, key):
    with pytest.raises(ExtraConfigError) as e:
        check_extra(extra)
    assert e.value.field == key and "\n" not in str(e.value)


def test_the_counters_file_never_follows_a_link_planted_at_its_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    path = tmp_path / "counters.json"
    os.symlink(victim, tmp_path / f".{path.name}.{os.getpid()}.tmp")
    stats = StatsFile(path)
    stats.close({"stores": 1})
    assert victim.read_text() == "keep" and json.loads(path.read_text()) == {"stores": 1}


@needs_vllm
def test_a_job_the_store_refuses_fails_as_a_job_and_the_scheduler_thread_goes_on(tmp_path):
    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    rows = np.zeros((8, 4096), np.int8)
    tier = _tier(tmp_path, rows, capacity_bytes=8 * 4096)
    ctx = ReqContext(req_id="r")
    keys = [bytes([i]) * 32 for i in range(3)]
    tier.submit_store(TransferJob(1, keys[:2], np.array([0, 99]), False, ctx))  # chunk 99 of 8
    tier.submit_load(TransferJob(2, [keys[2], keys[2]], np.array([3, 4]), True, ctx))  # a key twice
    tier.submit_store(TransferJob(3, keys[:1], np.array([0]), False, ctx))
    done = {r.job_id: r.success for r in _finished(tier, 3)}
    assert done == {1: False, 2: False, 3: True} and tier.lookup(keys[0], ctx) is LookupResult.HIT
    assert not tier.has_pending_work()
    tier.shutdown()


# ---- the failure ledger and the worker's failure record, without vLLM ------------------------------------------
def _step(ledger, store_jobs=None, load_jobs=None):
    from types import SimpleNamespace as NS

    for spec, keys in {**(store_jobs or {}), **(load_jobs or {})}.values():
        ledger.handed[id(spec)] = (spec, frozenset(keys))
    ledger.name_jobs(NS(store_jobs={j: NS(dst_spec=s) for j, (s, _) in (store_jobs or {}).items()},
                        load_jobs={j: NS(src_spec=s) for j, (s, _) in (load_jobs or {}).items()}))


def test_the_keys_of_a_failed_load_miss_until_stored_anew_and_a_failed_stores_keys_are_dropped():
    from kvxfer.offload.vllm.ledger import FailureLedger

    ledger, load_spec, store_spec = FailureLedger(), object(), object()
    _step(ledger, store_jobs={1: (store_spec, [b"s1"])}, load_jobs={2: (load_spec, [b"a", b"b"])})
    ledger.fail([2, 1])
    assert ledger.hides(b"a") and ledger.hides(b"b") and not ledger.hides(b"c")
    assert ledger.store_failed(frozenset([b"s1"])) and not ledger.store_failed(frozenset([b"s1"]))
    ledger.missing.difference_update([b"a"])  # what FailedTransfers.prepare_store does for a new store of it
    assert not ledger.hides(b"a") and ledger.hides(b"b")


@pytest.mark.parametrize("groups", [1, 2])
def test_a_failed_load_is_reported_as_load_error_blocks_with_one_group_and_as_a_failed_receive_with_more(groups):
    from kvxfer.offload.vllm.ledger import WorkerFailures

    w = WorkerFailures(groups)
    w.started(7, "req-a", np.array([3, 4], np.int32))
    w.started(8, "req-b", [5])
    w.on_result(7, False)
    w.on_result(8, True)
    w.on_result(9, False)  # a store
    assert w.failed_jobs == {7, 9} and not w.loads
    if groups == 1:
        assert (w.load_errors, w.failed_recving) == ({3, 4}, set())
    else:
        assert (w.load_errors, w.failed_recving) == (set(), {"req-a"})
