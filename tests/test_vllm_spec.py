"""kvxfer.offload.vllm without an engine: vLLM's KV caches and load/store specs mapped onto kvxfer jobs.

The tests use vLLM's own classes (CanonicalKVCaches, GPULoadStoreSpec, TransferResult...) when vLLM is
installed (``make test-vllm`` runs this file in .venv-vllm), and small stand-ins with the same fields
otherwise, so the mapping is checked in the main suite too and against the real classes in CI.
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.offload import HostLayout, HostTier, SharedSpec, Sharing
from kvxfer.offload.vllm import (
    JobFailedError,
    UnsupportedFeatureError,
    WorkerCore,
    build_worker,
    read_caches,
)
from kvxfer.offload.vllm.checks import check_extra

from .vllm.doubles import vllm_types

torch = pytest.importorskip("torch")


V = vllm_types()
NUM_BLOCKS, PAGE = 12, 256


def _layers(n: int, page: int = PAGE, seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (NUM_BLOCKS, page), dtype=torch.int8, generator=g) for _ in range(n)]


def _caches(tensors: list[Any], groups: list[list[int]], mappings: dict[tuple[int, int], Any] | None = None) -> Any:
    mappings = mappings or {}
    return V.Caches([V.Tensor(t, t.shape[1]) for t in tensors],
                    [[V.Ref(i, tensors[i].shape[1], mappings.get((g, j))) for j, i in enumerate(refs)]
                     for g, refs in enumerate(groups)])


def _core(caches: Any, *, k: int = 1, chunks: int = 8, **kw: Any) -> WorkerCore:
    cmap = read_caches(caches, **kw)
    worker = build_worker(cmap, HostTier(num_chunks=chunks, blocks_per_chunk=k, layout=cmap.layout),
                          NumpyExecutor(), pin=False, barrier=None, creator=True)
    return WorkerCore(worker, V.Result)


def test_stores_and_loads_map_vllm_specs_with_skips_and_report_bytes_and_seconds() -> None:
    tensors = _layers(2)
    before = [t.clone() for t in tensors]
    core = _core(_caches(tensors, [[0, 1]]), k=2)
    # logical blocks 1..3 of a request (skip 1 in its first chunk): device [1, 2, 3] -> chunks [5, 6]
    assert core.submit_store(1, V.GPU([1, 2, 3], [3], [1]), V.CPU([5, 6]))
    core.wait({1})
    assert core.submit_load(2, V.CPU([5, 6]), V.GPU([7, 8, 9], [3], [1]))
    core.wait({2})
    results = core.get_finished()
    assert [(r.job_id, r.success, r.transfer_size) for r in results] == [(1, True, 3 * 2 * PAGE), (2, True, 3 * 2 * PAGE)]
    assert all(isinstance(r.transfer_time, float) and r.transfer_time >= 0 for r in results)
    for t, b in zip(tensors, before):
        assert torch.equal(t[7:10], b[1:4]) and torch.equal(t[:7], b[:7]) and torch.equal(t[10:], b[10:])
    assert core.get_finished() == []  # each job reported once
    s = core.stats
    assert (s.stores, s.loads, s.blocks_stored, s.blocks_loaded, s.bytes_loaded) == (1, 1, 3, 3, 3 * 2 * PAGE)
    core.shutdown()


def test_a_chunk_stored_from_its_first_block_loads_from_the_logical_block_asked_for() -> None:
    """block_indices is each group's first logical block: the offset inside the first chunk. Stored from logical
    block 0 and loaded from logical block 1, a worker that dropped it on both sides would hand back blocks 0-2."""
    tensors = _layers(2)
    before = [t.clone() for t in tensors]
    core = _core(_caches(tensors, [[0, 1]]), k=4)
    assert core.submit_store(1, V.GPU([1, 2, 3, 4], [4], [0]), V.CPU([3]))  # logical blocks 0-3 -> chunk 3
    core.wait({1})
    assert core.submit_load(2, V.CPU([3]), V.GPU([9, 10, 11], [3], [1]))  # logical blocks 1-3 of chunk 3
    core.wait({2})
    assert [(r.job_id, r.success) for r in core.get_finished()] == [(1, True), (2, True)]
    for t, b in zip(tensors, before):
        assert torch.equal(t[9:12], b[2:5])
        assert torch.equal(t[:9], b[:9]) and torch.equal(t[12:], b[12:])
    core.shutdown()


def test_block_ids_arrive_as_vllms_int32_arrays() -> None:
    spec, host = V.GPU([4, 5], [2], [0]), V.CPU([3])
    assert spec.block_ids.dtype == np.int32
    handed: list[Any] = []

    class Recording:  # an OffloadWorker's submit_store, recording what it is handed
        def submit_store(self, job_id: int, device_ids: Any, host_ids: Any, *groups: Any, stream: Any = None) -> bool:
            handed.extend((device_ids, host_ids))
            return True

    assert WorkerCore(Recording(), V.Result).submit_store(1, spec, host)  # type: ignore[arg-type]
    assert handed[0] is spec.block_ids and handed[1] is host.block_ids  # handed on as they are, not copied


def test_two_groups_over_one_tensor_share_its_host_cell() -> None:
    (t,) = _layers(1)
    before = t.clone()
    caches = _caches([t], [[0], [0]])  # a sliding and a full group, both over the one tensor
    cmap = read_caches(caches)
    assert [c.name for c in cmap.device.tensors] == ["t0"] and [n for n, _ in cmap.refs] == ["g0.0", "g1.0"]
    core = _core(caches, k=1)
    assert core.worker.host.nbytes <= 8 * PAGE + 4096  # one cell of 8 chunks, not one per group
    # group 0 blocks [1, 2] -> chunks [0, 1]; group 1 block [3] -> chunk [2]
    core.submit_store(1, V.GPU([1, 2, 3], [2, 1], [0, 0]), V.CPU([0, 1, 2]))
    core.submit_load(2, V.CPU([0, 1, 2]), V.GPU([8, 9, 10], [2, 1], [0, 0]))
    core.wait({1, 2})
    core.get_finished()
    assert torch.equal(t[8:11], before[1:4]) and torch.equal(t[:8], before[:8])
    assert core.stats.blocks_loaded_by_group == [2, 1]
    core.shutdown()


def test_a_failed_job_is_raised_with_its_id_and_cause_never_reported_as_success() -> None:
    class Broken(NumpyExecutor):
        def run(self, plan: Any, memory: Any, stream: Any = None, after: Any = None) -> Any:
            raise RuntimeError("host tier unplugged")

    cmap = read_caches(_caches(_layers(1), [[0]]))
    worker = build_worker(cmap, HostTier(num_chunks=4), Broken(), pin=False, barrier=None, creator=True)
    core = WorkerCore(worker, V.Result)
    core.submit_load(7, V.CPU([1]), V.GPU([2], [1], [0]))
    core.wait({7})
    with pytest.raises(JobFailedError, match=r"job 7 \(load\) failed: RuntimeError\('host tier unplugged'\)") as e:
        core.get_finished()
    assert isinstance(e.value.__cause__, RuntimeError)
    worker.shutdown()


def test_shutdown_drains_and_writes_the_counters(tmp_path: Any) -> None:
    tensors = _layers(1)
    cmap = read_caches(_caches(tensors, [[0]]))
    worker = build_worker(cmap, HostTier(num_chunks=4), NumpyExecutor(), pin=False, barrier=None, creator=True)
    core = WorkerCore(worker, V.Result, stats_path=tmp_path / "stats.json")
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    host = worker.host
    core.shutdown()
    assert np.array_equal(host[2 * PAGE:3 * PAGE], tensors[0][3].numpy().view(np.uint8))
    assert json.loads((tmp_path / "stats.json").read_text())["steps"] == 0


def _counters_when(path: Any, ready: Any, timeout_s: float = 10.0) -> dict[str, Any]:
    """The counters file once ``ready(counters)`` holds (it is written by a thread of its own), or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        counters = json.loads(path.read_text()) if path.exists() else None
        if counters is not None and ready(counters):
            return dict(counters)
        assert time.monotonic() < deadline, f"{path}: {counters}"
        time.sleep(0.01)


def test_the_counters_file_is_current_after_each_step_that_finished_jobs(tmp_path: Any) -> None:
    """vLLM kills an engine process that takes over 5 s to stop, before the connector shuts down: the counters
    are on disk from the step that reported the job, whole (a reader never sees half a file)."""
    tensors = _layers(1)
    cmap = read_caches(_caches(tensors, [[0]]))
    worker = build_worker(cmap, HostTier(num_chunks=4), NumpyExecutor(), pin=False, barrier=None, creator=True)
    path = tmp_path / "stats.json"
    core = WorkerCore(worker, V.Result, stats_path=path)
    assert core.get_finished() == [] and not path.exists()  # nothing finished: nothing written
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    core.wait([1])
    assert [r.job_id for r in core.get_finished()] == [1]
    written = _counters_when(path, lambda c: c["stores"] == 1)  # written off the step, by the counters' thread
    assert (written["stores"], written["blocks_stored"], written["bytes_stored"]) == (1, 1, PAGE)
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary left beside it
    core.shutdown()
    assert json.loads(path.read_text())["steps"] == 2


def _run(local: int, canonical: int, size: int, count: int, local_stride: int, canonical_stride: int) -> Any:
    return V.Run(local, canonical, size, count, local_stride, canonical_stride)


def _mapping(canonical_page: int, runs: tuple[Any, ...], writers: int = 1, index: int = 0, page: int = PAGE) -> Any:
    return V.Mapping(canonical_page, page, runs, writers, index, True)


def test_canonical_head_sharded_and_replicated_mappings_become_kvxfer_sharing() -> None:
    # rank 1 of 2: its page at 1 x page in a 2-page canonical page (vLLM's mapping for split heads)
    whole = _mapping(2 * PAGE, (_run(0, PAGE, PAGE, 1, PAGE, PAGE),))
    rows = _mapping(2 * PAGE, (_run(0, 32, 32, PAGE // 32, 32, 64),))  # per token: (i * 2 + 1) * 32
    replicated = _mapping(PAGE, (_run(0, 0, PAGE, 1, PAGE, PAGE),), writers=2, index=1)
    cmap = read_caches(_caches(_layers(3), [[0, 1, 2]], {(0, 0): whole, (0, 1): rows, (0, 2): replicated}),
                       rank=1, world_size=2, canonical=True)
    got = [(t.sharing, t.shard_rows) for _, t in cmap.refs]
    assert got == [(Sharing.SHARDED, 1), (Sharing.SHARDED, PAGE // 32), (Sharing.REPLICATED, 1)]
    assert cmap.layout is HostLayout.CANONICAL


@pytest.mark.parametrize("mapping, feature", [
    (None, "a layer without a canonical page mapping"),
    (_mapping(2 * PAGE, (_run(0, 0, PAGE // 2, 1, 1, 1), _run(PAGE // 2, PAGE, PAGE // 2, 1, 1, 1))), "this canonical page mapping"),
    (_mapping(4 * PAGE, (_run(0, PAGE, PAGE, 1, PAGE, PAGE),), writers=2, index=1), "this canonical page mapping"),
])
def test_canonical_mappings_kvxfer_cannot_lay_out_are_refused_naming_the_feature(mapping: Any, feature: str) -> None:
    with pytest.raises(UnsupportedFeatureError, match=feature):
        read_caches(_caches(_layers(1), [[0]], {(0, 0): mapping}), rank=1, world_size=2, canonical=True)


@pytest.mark.parametrize("mapping", [
    _mapping(2 * PAGE, (_run(0, 0, PAGE, 1, PAGE, PAGE),)),  # rank 0's half of the canonical page
    _mapping(2 * PAGE, (_run(0, 0, 32, PAGE // 32, 32, 64),)),  # rank 0's slice of every token
], ids=["whole page", "per token"])
def test_a_head_sharded_mapping_placed_at_another_ranks_offset_is_refused(mapping: Any) -> None:
    # rank 1 of 2 whose one run starts where rank 0's slice sits: laid out as rank 1's, both ranks would store
    # into the same bytes and load each other's heads
    with pytest.raises(UnsupportedFeatureError, match="this canonical page mapping.*at TP rank 1 of 2"):
        read_caches(_caches(_layers(1), [[0]], {(0, 0): mapping}), rank=1, world_size=2, canonical=True)


def test_one_tensor_with_two_page_sizes_is_refused() -> None:
    tensors = _layers(1)
    caches = V.Caches([V.Tensor(tensors[0], PAGE)], [[V.Ref(0, PAGE)], [V.Ref(0, PAGE // 2)]])
    with pytest.raises(UnsupportedFeatureError, match="one KV tensor referenced with different page sizes"):
        read_caches(caches)


def test_a_ref_page_larger_than_its_tensor_page_is_refused() -> None:
    tensors = _layers(1)
    caches = V.Caches([V.Tensor(tensors[0], PAGE)], [[V.Ref(0, 2 * PAGE)]])
    with pytest.raises(UnsupportedFeatureError, match="a layer page larger than its tensor's page"):
        read_caches(caches)


def test_the_replicated_single_copy_layout_lets_every_rank_load_what_rank_0_stored(tmp_path: Any) -> None:
    # vLLM's connector sends stores to rank 0 only; every rank loads the one copy from the shared region
    ranks = [_layers(1, seed=0), _layers(1, seed=1)]
    name = f"test-{uuid.uuid4().hex[:12]}"
    cores = []
    for rank, tensors in enumerate(ranks):
        cmap = read_caches(_caches(tensors, [[0]]), rank=rank, world_size=2, replicated=True)
        assert cmap.tp.size == 1
        tier = HostTier(num_chunks=4, shared=SharedSpec(name=name, directory=str(tmp_path), create=rank == 0,
                                                        attachers=1 if rank == 0 else 0))
        cores.append(WorkerCore(build_worker(cmap, tier, NumpyExecutor(), pin=False, barrier=None, creator=rank == 0),
                                V.Result))
    cores[0].submit_store(1, V.GPU([2, 3], [2], [0]), V.CPU([0, 1]))
    cores[0].wait({1})
    cores[1].submit_load(2, V.CPU([0, 1]), V.GPU([5, 6], [2], [0]))
    cores[1].wait({2})
    assert torch.equal(ranks[1][0][5:7], ranks[0][0][2:4])
    for c in cores:
        c.get_finished()
        c.shutdown()


def test_unknown_kvxfer_keys_and_bad_executor_configs_are_refused_at_start_up() -> None:
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['kvxfer_exector'\] = \{'kind': 'numpy'\}: unknown kvxfer key"):
        check_extra({"kvxfer_exector": {"kind": "numpy"}})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config\['kvxfer_executor'\]"):
        check_extra({"kvxfer_executor": {"kind": "warp-drive"}})
    with pytest.raises(ValueError, match="must be true or false"):
        check_extra({"kvxfer_shared_region": "yes"})
    check_extra({"kvxfer_executor": {"kind": "numpy"}, "cpu_bytes_to_use": 1 << 20, "eviction_policy": "lru"})


def test_keys_neither_vllm_nor_kvxfer_reads_are_reported_with_the_closest_known_key() -> None:
    warnings = check_extra({"blocks_per_chunks": 4, "cpu_bytes_to_use": 1 << 20, "my_spec_key": 1}, known=("my_spec_key",))
    assert warnings == ["kv_connector_extra_config['blocks_per_chunks']: neither vLLM's offloading nor kvxfer reads "
                        "this key, so it is ignored; did you mean 'blocks_per_chunk'?"]
    assert check_extra({"spec_name": "KvxferOffloadingSpec", "secondary_tiers": [], "kvxfer_verify": True}) == []
