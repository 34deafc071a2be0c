"""The storage tier's KV-cache events and metrics, driven as vLLM's tiering manager drives them.

Events: the contract vLLM 0.32's own ``fs`` tier keeps (one stored event per durable store job, with the job's keys,
its medium and locality; none for loads, for failed jobs, without ``enable_kv_events``, or without the engine's
KV-cache events), plus what kvxfer's tier adds because it evicts and refuses chunks: removed events. Metrics: the
names declared to vLLM, and increments that add up (milliseconds, not seconds). The tests that need vLLM's classes
run in .venv-vllm (``make test-vllm``); the pure parts everywhere.
"""
from __future__ import annotations

import os
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.offload.files.chunk_store import StoreConfigError
from kvxfer.offload.vllm.events import TierEvents, events_wanted
from kvxfer.offload.vllm.metrics import METRICS, PREFIX, TierMeter
from tests.test_vllm_spec import V

needs_vllm = pytest.mark.skipif(not V.real, reason="needs vLLM's classes: run with `make test-vllm` (.venv-vllm)")
ROW = 4096


def _spec(events: bool = True, tp: int = 1, rank: int = 0, replicated: bool = False, model: str = "org/model") -> Any:
    from vllm.v1.kv_offload.base import OffloadingKVEventsConfig
    from vllm.v1.kv_offload.config import (
        OffloadingCacheConfig,
        OffloadingConfig,
        OffloadingModelConfig,
        OffloadingParallelConfig,
    )

    parallel = OffloadingParallelConfig(rank=rank, world_size=tp, tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1,
                                        data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
                                        is_parallelism_agnostic=False)
    config = OffloadingConfig(groups=(), worker_kv_bytes_per_block=0, enable_kv_cache_events=events, extra_config={},
                              engine_id="e", model=OffloadingModelConfig(name=model, dtype="float32"),
                              cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1), parallel=parallel,
                              replicated_layout=replicated)
    return SimpleNamespace(config=config, blocks_per_chunk=1, replicated_layout=replicated,
                           kv_events_config=OffloadingKVEventsConfig(enable_kv_cache_events=events,
                                                                     self_describing_kv_events=False))


def _tier(root: Any, rows: np.ndarray, spec: Any = None, **kw: Any) -> Any:
    from kvxfer.offload.vllm import KvxferFileTier

    config = {"root_dir": str(root), "capacity_bytes": 4 * ROW, **kw}
    return KvxferFileTier(spec if spec is not None else _spec(), memoryview(rows), "KvxferFileTier", None, **config)


def _key(n: int) -> bytes:
    return n.to_bytes(8, "big") + bytes(4)


def _job(job_id: int, keys: list[bytes], chunks: list[int], promotion: bool = False) -> Any:
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    return TransferJob(job_id, keys, np.array(chunks, dtype=np.int64), promotion, ReqContext(req_id="r"))


def _drain(tier: Any) -> list[Any]:
    tier.drain_jobs()
    return list(tier.get_finished_jobs())


@pytest.fixture
def rows() -> np.ndarray:
    return np.random.default_rng(1).integers(-128, 127, (8, ROW), dtype=np.int8)


# ---- pure parts ---------------------------------------------------------------------------------------------------
def test_events_are_handed_over_once_in_order_and_never_for_no_keys():
    ev = TierEvents(lambda **kw: kw, "STORAGE", None, "KvxferFileTier")
    ev.stored([b"a", b"b"])
    ev.stored([])
    ev.removed([b"a"])
    out = ev.take()
    assert [(e["keys"], e["removed"]) for e in out] == [([b"a", b"b"], False), ([b"a"], True)]
    assert all(e["ownership"] == "KvxferFileTier" and e["removal_expected"] for e in out)
    assert ev.take() == []


def test_events_need_the_engines_kv_events_and_a_bool(caplog):
    on = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=True))
    off = SimpleNamespace(kv_events_config=SimpleNamespace(enable_kv_cache_events=False))
    assert events_wanted(on, True, "t") and not events_wanted(on, False, "t")
    assert not events_wanted(off, True, "t") and "publishes no KV cache events" in caplog.text
    with pytest.raises(StoreConfigError) as e:
        events_wanted(on, "yes", "t")
    assert e.value.field == "secondary_tiers[t].enable_kv_events"


def test_the_meter_reports_increments_in_milliseconds_and_misses_by_cause():
    meter = TierMeter("KvxferFileTier")
    meter.job("load", success=True, chunks=2, nbytes=8192, seconds=0.0004)
    meter.misses("integrity", 1)
    seen = {"lookups": 5, "hits": 3, "evictions": 1, "integrity_misses": 1, "discarded": 2}
    first = meter.take(seen, 4, 16)
    got = {(n, lab): v for n, _, lab, v in first if not n.endswith("job_ms")}
    t = "KvxferFileTier"
    assert got[(PREFIX + "io_ms", (t, "load"))] == pytest.approx(0.4)  # sub-millisecond, not rounded to 0 s
    assert got[(PREFIX + "misses", (t, "absent"))] == 2 and got[(PREFIX + "misses", (t, "integrity"))] == 1
    assert got[(PREFIX + "integrity_refusals", (t,))] == 3 and got[(PREFIX + "stored_chunks", (t,))] == 4
    assert [v for n, k, _, v in first if k == "histogram"] == [pytest.approx(0.4)]
    again = {(n, lab): v for n, k, lab, v in meter.take({**seen, "lookups": 6}, 4, 16) if k == "counter"}
    assert again == {(PREFIX + "lookups", (t,)): 1, (PREFIX + "misses", (t, "absent")): 1}  # increments only
    with pytest.raises(ValueError, match="cause"):
        meter.misses("bogus", 1)


# ---- against vLLM's classes -----------------------------------------------------------------------------------------
@needs_vllm
def test_a_durable_store_is_one_stored_event_with_the_jobs_keys_medium_and_locality(tmp_path, rows):
    from vllm.v1.kv_offload.base import Locality, Medium

    tier = _tier(tmp_path, rows, enable_kv_events=True, locality="LOCAL")
    try:
        keys = [_key(2), _key(1)]
        tier.submit_store(_job(1, keys, [1, 0]))
        assert all(r.success for r in _drain(tier))
        (ev,) = tier.take_events()
        assert ev.keys == keys and ev.medium == Medium.STORAGE and ev.locality is Locality.LOCAL and not ev.removed
        assert list(tier.take_events()) == []
        tier.submit_load(_job(2, keys, [5, 6], promotion=True))  # a load is no event
        assert all(r.success for r in _drain(tier)) and list(tier.take_events()) == []
    finally:
        tier.shutdown()


@needs_vllm
@pytest.mark.parametrize("events,flag", [(True, False), (False, True)])
def test_no_events_without_the_tiers_opt_in_or_the_engines_kv_events(tmp_path, rows, events, flag):
    tier = _tier(tmp_path, rows, _spec(events=events), enable_kv_events=flag)
    try:
        tier.submit_store(_job(1, [_key(1)], [0]))
        assert all(r.success for r in _drain(tier))
        assert tier.events is None and list(tier.take_events()) == []
    finally:
        tier.shutdown()


@needs_vllm
def test_a_failed_store_is_no_event_and_a_full_store_reports_what_it_evicted(tmp_path, rows):
    tier = _tier(tmp_path, rows, enable_kv_events=True)
    try:
        tier.store.tier.spill = lambda plan: (_ for _ in ()).throw(OSError(5, "injected"))  # every spill fails
        tier.submit_store(_job(1, [_key(1)], [0]))
        assert [r.success for r in _drain(tier)] == [False] and list(tier.take_events()) == []
    finally:
        tier.shutdown()
    tier = _tier(tmp_path, rows, enable_kv_events=True)  # 4 slots
    try:
        tier.submit_store(_job(1, [_key(i) for i in range(4)], [0, 1, 2, 3]))
        _drain(tier)
        tier.submit_store(_job(2, [_key(9)], [4]))  # evicts the least recently used key
        _drain(tier)
        got = [(e.removed, e.keys) for e in tier.take_events()]
        assert got == [(False, [_key(i) for i in range(4)]), (True, [_key(0)]), (False, [_key(9)])]
    finally:
        tier.shutdown()


@needs_vllm
def test_a_warm_restart_announces_the_chunks_found_and_a_refused_chunk_is_removed(tmp_path, rows):
    tier = _tier(tmp_path, rows)
    tier.submit_store(_job(1, [_key(1), _key(2)], [0, 1]))
    _drain(tier)
    tier.shutdown()
    data = next(tmp_path.glob("kvxfer-*/chunks.kvx"))
    with open(data, "r+b") as f:  # damage the chunk of _key(2), slot 1
        f.seek(ROW + 10)
        f.write(b"\xff" * 16)
    tier = _tier(tmp_path, rows, enable_kv_events=True)
    try:
        (found,) = tier.take_events()
        assert sorted(found.keys) == [_key(1), _key(2)] and not found.removed
        tier.submit_load(_job(2, [_key(1), _key(2)], [4, 5], promotion=True))
        (r,) = _drain(tier)
        assert not r.success and list(r.successful_keys) == [_key(1)]
        assert [(e.removed, e.keys) for e in tier.take_events()] == [(True, [_key(2)])]
        stats = tier.get_stats().data["data"]
        assert stats[PREFIX + "misses"][("KvxferFileTier", "integrity")] == 1
        assert ("KvxferFileTier", "unavailable") not in stats[PREFIX + "misses"]
    finally:
        tier.shutdown()


@needs_vllm
def test_a_cascade_through_vllms_tiering_manager_surfaces_the_stored_event(tmp_path):
    from unittest.mock import MagicMock

    from vllm.v1.kv_offload.base import Medium, ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    memory = np.zeros((4, ROW), np.int8)
    region = MagicMock()
    region.create_kv_memoryview.return_value = memoryview(memory)
    primary = CPUPrimaryTierOffloadingManager(num_chunks=4, mmap_region=region)
    from kvxfer.offload.vllm import KvxferFileTier

    tier = KvxferFileTier(_spec(), primary.get_kv_memoryview(), "KvxferFileTier", None, root_dir=str(tmp_path),
                          capacity_bytes=4 * ROW, enable_kv_events=True)
    manager = TieringOffloadingManager(primary_tier=primary, secondary_tiers=[tier])
    try:
        ctx, keys = ReqContext(req_id="r"), [_key(1), _key(2)]
        manager.on_new_request(ctx)
        assert manager.prepare_store(keys, ctx) is not None
        manager.complete_store(keys, ctx)
        events: list[Any] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not any(e.medium == Medium.STORAGE for e in events):
            manager.on_schedule_end(ScheduleEndContext(new_req_ids=[], preempted_req_ids=()))
            events += manager.take_events()
            time.sleep(0.01)
        (stored,) = [e for e in events if e.medium == Medium.STORAGE]
        assert set(stored.keys) == set(keys) and not stored.removed
    finally:
        tier.shutdown()


@needs_vllm
def test_the_metrics_reach_vllms_prometheus_metrics_under_the_declared_names(tmp_path, rows):
    from kvxfer.offload.vllm import KvxferFileTier

    defs = KvxferFileTier.build_metric_definitions({})
    assert sorted(defs) == sorted(m.name for m in METRICS)
    assert all(d.labelnames[0] == "tier" for d in defs.values())
    tier = _tier(tmp_path, rows)
    try:
        ctx = _job(0, [], []).req_context
        assert tier.lookup(_key(1), ctx).name == "MISS"
        tier.submit_store(_job(1, [_key(1)], [0]))
        _drain(tier)
        tier.submit_load(_job(2, [_key(1), _key(7)], [2, 3], promotion=True))  # _key(7) was never stored
        _drain(tier)
        data = tier.get_stats().data
        kinds, values = data["types"], data["data"]
        assert set(kinds) <= set(defs) and kinds[PREFIX + "job_ms"] == "histogram"
        t = "KvxferFileTier"
        assert values[PREFIX + "bytes"] == {(t, "store"): ROW, (t, "load"): ROW}
        assert values[PREFIX + "misses"] == {(t, "absent"): 1, (t, "unavailable"): 1}
        assert values[PREFIX + "failed_jobs"] == {(t, "load"): 1} and len(values[PREFIX + "job_ms"][(t, "store")]) == 1
        assert values[PREFIX + "capacity_chunks"][(t,)] == 4 and values[PREFIX + "stored_chunks"][(t,)] == 1
        assert PREFIX + "bytes" not in tier.get_stats().data["data"]  # counted once
    finally:
        tier.shutdown()
    assert os.path.isdir(tmp_path)


def test_the_metrics_page_lists_every_metric_the_tier_declares():
    from pathlib import Path

    page = (Path(__file__).resolve().parents[1] / "docs" / "reference" / "metrics.md").read_text()
    missing = [m.name for m in METRICS if f"| `{m.name}` | {m.kind} |" not in page]
    assert not missing, f"docs/reference/metrics.md lacks {missing}"
