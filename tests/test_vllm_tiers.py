"""kvxfer under vLLM's tiering without an engine: the file tier's identity and settings, the primary tier's cells
where vLLM's own region puts them, and ``KvxferFileTier`` driven as vLLM's tiering manager drives it.

The identity and settings tests run in the main suite; those that need vLLM's classes (its SharedOffloadRegion,
SecondaryTierManager, TransferJob) run in .venv-vllm (``make test-vllm``) and are skipped, saying so, elsewhere.
"""
from __future__ import annotations

import time
import uuid
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.offload.files.chunk_store import StoreConfigError, namespace
from kvxfer.offload.vllm import read_caches
from kvxfer.offload.vllm.tiering import tier_config, tier_identity, tiering_geometry
from tests.test_vllm_spec import PAGE, V, _caches, _layers, _mapping, _run

needs_vllm = pytest.mark.skipif(not V.real, reason="needs vLLM's classes: run with `make test-vllm` (.venv-vllm)")


def _spec(canonical: bool = False, agnostic: bool = False, tp: int = 1, dtype: str = "float32", k: int = 1) -> Any:
    parallel = SimpleNamespace(tp_size=tp, pp_size=1, pcp_size=1, dcp_size=1, world_size=tp, rank=0,
                               is_parallelism_agnostic=agnostic)
    config = SimpleNamespace(model=SimpleNamespace(name="org/model", dtype=dtype),
                             cache=SimpleNamespace(tokens_per_hash=32), parallel=parallel, canonical_layout=canonical,
                             kv_cache_layout="LBNHC", replicated_layout=False,
                             groups=(SimpleNamespace(tokens_per_block=32, layer_names=("l0", "l1")),))
    return SimpleNamespace(config=config, blocks_per_chunk=k, replicated_layout=False)


def test_the_identity_keeps_tp_apart_in_the_direct_layout_and_every_meaning_of_the_bytes():
    base = namespace(tier_identity(_spec(), 32768, "0.32.0"))
    others = [_spec(tp=2), _spec(dtype="bfloat16"), _spec(k=2), _spec(agnostic=True)]
    assert tier_identity(_spec(agnostic=True), 32768, "0.32.0")["parallel"] != "portable"  # direct: never portable
    assert base not in {namespace(tier_identity(s, 32768, "0.32.0")) for s in others[:3]}
    assert namespace(tier_identity(_spec(), 65536, "0.32.0")) != base  # another row size
    # 0.32 to 0.34 hash blocks and lay out keys alike (tests/vllm_versions checks their sources): one namespace
    assert namespace(tier_identity(_spec(), 32768, "0.34.0")) == base
    assert namespace(tier_identity(_spec(), 32768, "0.32.5")) == base


@needs_vllm
def test_the_canonical_layout_of_portable_layers_shares_one_namespace_across_tp_sizes():
    tp1 = tier_identity(_spec(canonical=True, agnostic=True), 32768, "0.32.0")
    tp2 = tier_identity(_spec(canonical=True, agnostic=True, tp=2), 32768, "0.32.0")
    fixed = tier_identity(_spec(canonical=True, agnostic=False, tp=2), 32768, "0.32.0")
    assert tp1 == tp2 and tp1["parallel"] == "portable" and tp1["canonical_format"]
    assert namespace(fixed) != namespace(tp1) and namespace(tp1) != namespace(tier_identity(_spec(), 32768, "0.32.0"))


@pytest.mark.parametrize("config,field", [
    ({"capacity_bytes": 1 << 20}, "root_dir"),
    ({"root_dir": "/tmp"}, "capacity_bytes"),
    ({"root_dir": "/tmp", "capacity_bytes": 1 << 20, "blocks_per_file": 4}, "blocks_per_file"),
    ({"root_dir": "/tmp", "capacity_bytes": 1 << 20, "io_threads": 0}, "io_threads"),
    ({"root_dir": "/tmp", "capacity_bytes": 1 << 20, "lock_timeout_s": float("inf")}, "lock_timeout_s"),
])
def test_bad_tier_settings_are_refused_in_one_line_naming_the_key(config, field):
    with pytest.raises(StoreConfigError) as e:
        tier_config(config)
    assert e.value.field == f"secondary_tiers[KvxferFileTier].{field}"
    assert str(e.value).startswith(f"secondary_tiers[KvxferFileTier].{field}") and "\n" not in str(e.value)


def _region_views(rank: int, world: int, pages: list[int], k: int, chunks: int, canonical: bool) -> list[int]:
    """Where vLLM's own SharedOffloadRegion puts each tensor's cell (byte offset in a row)."""
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

    per_rank = sum(pages) * k // (world if canonical else 1)
    row = -(-per_rank * (1 if canonical else world) // 4096) * 4096
    region = SharedOffloadRegion(engine_id=f"kvxfer-test-{uuid.uuid4().hex[:8]}", num_chunks=chunks, rank=rank,
                                 kv_bytes_per_chunk=row, cpu_page_size=per_rank)
    try:
        make = region.create_next_canonical_view if canonical else region.create_next_worker_view
        return [make(p * k).storage_offset() for p in pages]
    finally:
        region.cleanup()


@needs_vllm
@pytest.mark.parametrize("rank", [0, 1])
def test_kvxfer_cells_sit_where_vllms_region_puts_them_in_the_direct_layout(rank):
    caches = _caches(_layers(3), [[0, 1], [2]])
    cmap = read_caches(caches, rank=rank, world_size=2)
    per_rank = 3 * PAGE * 2
    g = tiering_geometry(caches, cmap, num_chunks=4, blocks_per_chunk=2, row_bytes=4096 * 2, rank_offset=rank * per_rank)
    want = _region_views(rank, 2, [PAGE] * 3, 2, 4, canonical=False)
    assert [c.offset_bytes for c in g.cells] == want and {c.rank for c in g.cells} == {rank}


@needs_vllm
def test_kvxfer_cells_sit_where_vllms_region_puts_them_in_the_canonical_layout():
    whole = _mapping(2 * PAGE, (_run(0, PAGE, PAGE, 1, PAGE, PAGE),))
    caches = _caches(_layers(2), [[0, 1]], {(0, 0): whole, (0, 1): whole})
    cmap = read_caches(caches, rank=1, world_size=2, canonical=True)
    g = tiering_geometry(caches, cmap, num_chunks=4, blocks_per_chunk=1, row_bytes=4096, rank_offset=PAGE * 2)
    want = _region_views(1, 2, [2 * PAGE] * 2, 1, 4, canonical=True)
    assert [c.offset_bytes for c in g.cells] == want and [c.page_bytes for c in g.cells] == [2 * PAGE] * 2


def _tier(tmp_path, rows: np.ndarray, **kw: Any) -> Any:
    from kvxfer.offload.vllm import KvxferFileTier

    return KvxferFileTier(_spec(), memoryview(rows), "KvxferFileTier", None, **{"root_dir": str(tmp_path), **kw})


def _finished(tier: Any, n: int = 1) -> list[Any]:
    out, deadline = [], time.monotonic() + 30
    while len(out) < n and time.monotonic() < deadline:
        out += tier.get_finished_jobs()
        time.sleep(0.005)
    assert len(out) == n
    return out


@needs_vllm
def test_the_file_tier_stores_and_promotes_chunks_as_vllms_tiering_manager_asks():
    import tempfile

    from vllm.v1.kv_offload.base import LookupResult, ReqContext
    from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TransferJob

    rows = np.random.default_rng(0).integers(-128, 127, (8, 4096), dtype=np.int8)
    with tempfile.TemporaryDirectory() as root:
        tier = _tier(root, rows, capacity_bytes=8 * 4096)
        assert isinstance(tier, SecondaryTierManager) and tier.medium.value == "STORAGE"
        ctx = ReqContext(req_id="r")
        keys = [bytes([i]) * 32 + bytes(4) for i in range(3)]
        assert tier.lookup(keys[0], ctx) is LookupResult.MISS
        tier.submit_store(TransferJob(1, keys, np.array([0, 1, 2]), False, ctx))
        assert tier.has_pending_work()
        (done,) = _finished(tier)
        assert done.job_id == 1 and done.success and done.transfer_bytes == 3 * 4096
        assert all(tier.lookup(k, ctx) is LookupResult.HIT for k in keys)
        want = rows[:3].copy()
        tier.submit_load(TransferJob(2, keys, np.array([5, 6, 7]), True, ctx))
        (done,) = _finished(tier)
        assert done.success and np.array_equal(rows[5:], want) and not tier.has_pending_work()
        tier.shutdown()


@needs_vllm
@pytest.mark.parametrize("config,field", [
    ({"capacity_bytes": 4095}, "capacity_bytes"),
    ({"capacity_bytes": 1 << 20, "root_dir": "/no/such/dir"}, "root_dir"),
    ({"capacity_bytes": 1 << 20, "root_dir": "/sys"}, "root_dir"),
    ({"capacity_bytes": 1 << 20, "n_read_threads": 16}, "n_read_threads"),
])
def test_bad_configuration_stops_the_tier_at_start_up_in_one_line_naming_the_key(tmp_path, config, field):
    rows = np.zeros((4, 4096), np.int8)
    with pytest.raises(StoreConfigError) as e:
        _tier(tmp_path, rows, **{"root_dir": str(tmp_path), **config})
    assert "\n" not in str(e.value) and (e.value.field.endswith(f".{field}") or e.value.field == field)


class _GatedWrites:
    """kvxfer's POSIX executor whose writes (stores) wait for ``gate``: a file tier still storing, on demand."""

    def __init__(self, gate: Any):
        from kvxfer.executors import PosixFileExecutor

        self.inner, self.gate = PosixFileExecutor(threads=1), gate

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def run(self, plan: Any, memory: Any, stream: Any = None, after: Any = None) -> Any:
        if plan.direction.value == "d2h":  # host rows -> file
            assert self.gate.wait(30)
        return self.inner.run(plan, memory)


@needs_vllm
def test_a_host_tier_full_of_chunks_still_being_stored_to_files_refuses_the_next_requests_chunks(tmp_path):
    # why a storage tier can store only the first of several prompts (seen at TP=2 with three 9-chunk prompts in one
    # batch and a 16-chunk host tier): vLLM's tiering pins a host chunk until every secondary tier's store of it is
    # reported done (kvxfer's: once durable), and its host tier refuses a store it cannot make room for; the
    # scheduler retries it while the request runs and drops it once the request has finished ("cannot store
    # chunks", vllm:kv_offload_allocation_failure). Room comes back the step after the file tier's store finishes.
    import threading

    from vllm.v1.kv_offload.base import ReqContext, ScheduleEndContext
    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.manager import CPUPrimaryTierOffloadingManager, TieringOffloadingManager

    from kvxfer.offload.vllm import KvxferFileTier

    gate = threading.Event()

    class Gated(KvxferFileTier):  # type: ignore[misc, valid-type]
        def storage_executor(self, settings: Any) -> Any:
            return _GatedWrites(gate)

    region = SharedOffloadRegion(engine_id=f"kvxfer-test-{uuid.uuid4().hex[:8]}", num_chunks=16, rank=0,
                                 kv_bytes_per_chunk=4096, cpu_page_size=4096)
    primary = CPUPrimaryTierOffloadingManager(16, region)
    tier = Gated(_spec(), primary.get_kv_memoryview(), "KvxferFileTier", None, root_dir=str(tmp_path),
                 capacity_bytes=64 * 4096)
    manager = TieringOffloadingManager(primary, [tier])
    step = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
    ctx = [ReqContext(req_id=str(i)) for i in range(2)]
    keys = [[bytes([i, j]) * 16 + bytes(4) for j in range(9)] for i in range(2)]
    try:
        for c in ctx:
            manager.on_new_request(c)
        first = manager.prepare_store(keys[0], ctx[0])
        assert first is not None and len(first.keys_to_store) == 9
        manager.complete_store(keys[0], ctx[0])  # in host memory: cascaded to the file tier, which is still writing
        manager.on_schedule_end(step)
        for _ in range(3):  # the next request's 9 chunks: 7 free, the other 9 pinned; a step later, the same
            assert manager.prepare_store(keys[1], ctx[1]) is None
            manager.on_schedule_end(step)
        assert tier.store.stats.stores == 0 and tier.has_pending_work()
        gate.set()  # the file tier's store finishes (durable); the next step takes its result and unpins the chunks
        tier.drain_jobs()
        manager.on_schedule_end(step)
        second = manager.prepare_store(keys[1], ctx[1])
        assert second is not None and len(second.keys_to_store) == 9 and len(second.evicted_keys) == 2
        assert tier.store.stats.chunks_stored == 9
    finally:
        gate.set()
        manager.shutdown()
