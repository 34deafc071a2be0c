"""The version-independent logic of kvxfer's vLLM backend for 0.32 to 0.34, without an engine: the version range
and its traits, 0.34's DevicePointers mapped back to block ids, expedited loads handed on, the connector hooks'
answers. With vLLM 0.34 on the path (``make test-vllm-versions``) the pointers are vLLM's own
(``resolve_device_pointers`` over its CanonicalKVCaches); otherwise a stand-in with the same canonical order."""
from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.offload import HostTier
from kvxfer.offload.vllm import WorkerCore, build_worker, hooks, read_caches
from kvxfer.offload.vllm.pointers import PointerError, PointerMap, RefGeometry
from kvxfer.offload.vllm.version import SUPPORTED_VLLM, UnsupportedVllmError, traits

from .vllm.doubles import vllm_types

torch = pytest.importorskip("torch")
V = vllm_types()
NUM_BLOCKS = 16


@dataclass
class _Pointers:  # 0.34's DevicePointers fields
    ptrs: np.ndarray
    sizes: np.ndarray
    group_block_counts: tuple[int, ...]
    group_data_ref_counts: tuple[int, ...]
    block_indices: tuple[int, ...]


def _resolve(gpu: Any, kv: Any) -> Any:
    """vLLM 0.34's resolve_device_pointers where it imports, else the same canonical order computed here."""
    try:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers  # type: ignore[import-not-found]
    except ImportError:
        pass
    else:
        return resolve_device_pointers(gpu, kv)
    ptrs, sizes, at = [], [], 0
    for size, refs in zip(gpu.group_sizes, kv.group_data_refs):
        ids = np.asarray(gpu.block_ids[at:at + size], dtype=np.uint64)
        for r in refs if size else ():
            t = kv.tensors[r.tensor_idx].tensor
            ptrs.append(np.uint64(t.data_ptr()) + ids * np.uint64(t.stride(0)))
            sizes.append(np.full(size, r.page_size_bytes, np.uint64))
        at += size
    return _Pointers(_cat(ptrs), _cat(sizes), tuple(gpu.group_sizes), tuple(len(r) for r in kv.group_data_refs),
                     tuple(gpu.block_indices))


def _cat(xs: list[Any]) -> np.ndarray:
    return np.concatenate(xs) if xs else np.zeros(0, np.uint64)


def _tensors(pages: list[int], seed: int = 0) -> list[Any]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (NUM_BLOCKS, p), dtype=torch.int8, generator=g) for p in pages]


def _kv(tensors: list[Any], groups: list[list[int]]) -> Any:
    return V.Caches([V.Tensor(t, t.shape[1]) for t in tensors],
                    [[V.Ref(i, tensors[i].shape[1]) for i in refs] for refs in groups])


# ---- the version range ------------------------------------------------------------------------------------------

def test_every_supported_release_has_traits_and_a_release_outside_is_refused_in_one_line_naming_both() -> None:
    assert SUPPORTED_VLLM == ("0.32", "0.33", "0.34")
    assert traits("0.32.0").device_pointers is False and traits("0.34.0rc2").device_pointers is True
    assert traits("0.33.1").expedited and not traits("0.32.0").expedited
    for bad in ("0.31.2", "0.35.0", "1.0.0", "unknown"):
        with pytest.raises(UnsupportedVllmError) as e:
            traits(bad)
        msg = str(e.value)
        assert "\n" not in msg and bad in msg and "0.32 to 0.34" in msg
        assert isinstance(e.value, ImportError)


def test_the_store_identity_is_shared_by_the_releases_whose_keys_mean_the_same() -> None:
    assert len({traits(v).key_family for v in SUPPORTED_VLLM}) == 1


# ---- DevicePointers -> block ids --------------------------------------------------------------------------------

def test_pointers_of_every_group_and_ref_map_back_to_the_block_ids_they_were_resolved_from() -> None:
    tensors = _tensors([64, 64, 128, 32])
    kv = _kv(tensors, [[0, 1], [2], [3]])
    gpu = V.GPU([3, 9, 4, 11, 2, 0, 7], [3, 0, 4], [1, 0, 6])
    out = PointerMap.from_kv_caches(kv).blocks(_resolve(gpu, kv))
    assert out.block_ids.tolist() == [3, 9, 4, 11, 2, 0, 7]
    assert out.group_sizes == (3, 0, 4) and out.block_indices == (1, 0, 6)


def test_a_strided_view_maps_by_its_row_stride_not_its_page() -> None:
    base = torch.zeros((NUM_BLOCKS, 2, 64), dtype=torch.int8)
    view = base[:, 1, :]  # page 64 bytes, row stride 128: packed K/V layers hand such views
    kv = V.Caches([V.Tensor(view, 64)], [[V.Ref(0, 64)]])
    out = PointerMap.from_kv_caches(kv).blocks(_resolve(V.GPU([5, 6], [2], [0]), kv))
    assert out.block_ids.tolist() == [5, 6]


def _pm() -> PointerMap:
    return PointerMap([[RefGeometry(0x10000, 16 * 256, 256, 256), RefGeometry(0x90000, 16 * 256, 256, 256)]])


def _p(ptrs: list[int], sizes: list[int] | None = None, counts: tuple[int, ...] = (2,), refs: tuple[int, ...] = (2,)) -> Any:
    return _Pointers(np.array(ptrs, np.uint64), np.array(sizes or [256] * len(ptrs), np.uint64), counts, refs, (0,))


@pytest.mark.parametrize(("job", "field", "index"), [
    (_p([0x10000 + 256, 0x10000 + 512, 0x90000 + 256, 0x90000 + 512], [256, 256, 256, 128]), "sizes", 3),
    (_p([0x10000 + 256, 0x10000 + 16 * 256, 0x90000 + 256, 0x90000 + 512]), "ptrs", 1),  # past the tensor
    (_p([0x10000 + 256, 0x10000 - 256, 0x90000 + 256, 0x90000 + 512]), "ptrs", 1),  # before it
    (_p([0x10000 + 256, 0x10000 + 300, 0x90000 + 256, 0x90000 + 512]), "ptrs", 1),  # off a row
    (_p([0x10000 + 256, 0x10000 + 512, 0x90000 + 256, 0x90000 + 768]), "ptrs", 3),  # refs disagree
    (_p([0x10000 + 256, 0x10000 + 512, 0x90000 + 256]), "ptrs", 3),  # too few pointers
    (_p([0x10000], counts=(1,), refs=(1,)), "group_data_ref_counts", 0),  # the group has 2 refs
    (_p([0x10000, 0x90000], counts=(1, 0), refs=(2, 0)), "group_block_counts", 2),  # the caches have 1 group
])
def test_pointers_that_do_not_fit_the_bound_caches_raise_naming_the_field_and_index(job: Any, field: str,
                                                                                   index: int) -> None:
    with pytest.raises(PointerError) as e:
        _pm().blocks(job)
    assert (e.value.field, e.value.index) == (field, index)
    assert isinstance(e.value, ValueError) and f"DevicePointers.{field}[{index}]" in str(e.value)


def _core(kv: Any, k: int = 2, *, pointers: bool = True) -> WorkerCore:
    cmap = read_caches(kv)
    worker = build_worker(cmap, HostTier(num_chunks=8, blocks_per_chunk=k, layout=cmap.layout), NumpyExecutor(),
                          pin=False, barrier=None, creator=True)
    return WorkerCore(worker, V.Result, pointers=PointerMap.from_kv_caches(kv) if pointers else None)


def test_jobs_given_as_pointers_move_the_same_bytes_as_jobs_given_as_block_ids() -> None:
    tensors = _tensors([64, 64, 128])
    before = [t.clone() for t in tensors]
    kv = _kv(tensors, [[0, 1], [2]])
    core = _core(kv)
    store = V.GPU([1, 2, 3, 5, 6], [3, 2], [1, 0])  # group 0 skips 1 block of its first chunk
    assert core.submit_store(1, _resolve(store, kv), V.CPU([4, 5, 6]))
    core.wait({1})
    assert core.submit_load(2, V.CPU([4, 5, 6]), _resolve(V.GPU([10, 11, 12, 13, 14], [3, 2], [1, 0]), kv))
    core.wait({2})
    assert [(r.job_id, r.success) for r in core.get_finished()] == [(1, True), (2, True)]
    for t, b in zip(tensors[:2], before[:2]):
        assert torch.equal(t[10:13], b[1:4]) and torch.equal(t[:10], b[:10]) and torch.equal(t[13:], b[13:])
    assert torch.equal(tensors[2][13:15], before[2][5:7])
    core.shutdown()


def test_a_pointer_job_without_a_pointer_map_is_refused_not_misread() -> None:
    kv = _kv(_tensors([64]), [[0]])
    core = _core(kv, pointers=False)
    with pytest.raises(PointerError):
        core.submit_store(1, _resolve(V.GPU([1], [1], [0]), kv), V.CPU([0]))
    core.shutdown()


# ---- expedited --------------------------------------------------------------------------------------------------

class _Recording:
    """An OffloadWorker's submit calls, recorded."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, dict[str, Any]]] = []

    def submit_load(self, job_id: int, *args: Any, **kw: Any) -> bool:
        self.calls.append(("load", job_id, kw))
        return True

    def submit_store(self, job_id: int, *args: Any, **kw: Any) -> bool:
        self.calls.append(("store", job_id, kw))
        return True


def test_an_expedited_load_reaches_the_offload_worker_as_expedited_and_a_plain_one_does_not() -> None:
    rec = _Recording()
    core = WorkerCore(rec, V.Result)  # type: ignore[arg-type]
    core.submit_load(1, V.CPU([0]), V.GPU([1], [1], [0]), expedited=True)
    core.submit_load(2, V.CPU([0]), V.GPU([1], [1], [0]))
    assert [(c[1], c[2].get("expedited", False)) for c in rec.calls] == [(1, True), (2, False)]


def test_the_connectors_failure_wrapper_hands_expedited_on() -> None:
    pytest.importorskip("vllm")
    from kvxfer.offload.vllm.connector import FailureReports

    inner = SimpleNamespace(calls=[])
    inner.submit_load = lambda *a, **kw: inner.calls.append(kw.get("expedited", False)) or True
    wrapper = FailureReports(inner, lambda job, ok: None)
    wrapper.submit_load(1, None, None, expedited=True)
    wrapper.submit_load(2, None, None)
    assert inner.calls == [True, False]


def test_an_expedited_load_runs_ahead_of_queued_loads_but_never_ahead_of_a_store_it_conflicts_with() -> None:
    """Through the real OffloadWorker: the graph starts an expedited load before earlier queued work it does not
    conflict with; a load of chunks a queued store writes still sees the stored bytes."""
    tensors = _tensors([64])
    before = tensors[0].clone()
    kv = _kv(tensors, [[0]])
    core = _core(kv, k=1)
    assert core.submit_store(1, _resolve(V.GPU([1, 2], [2], [0]), kv), V.CPU([3, 4]))
    assert core.submit_load(2, V.CPU([3, 4]), _resolve(V.GPU([8, 9], [2], [0]), kv), expedited=True)
    core.wait({1, 2})
    assert sorted((r.job_id, r.success) for r in core.get_finished()) == [(1, True), (2, True)]
    assert torch.equal(tensors[0][8:10], before[1:3])  # the load did not overtake the store it reads from
    core.shutdown()


# ---- the connector hooks ----------------------------------------------------------------------------------------

def test_kv_cache_access_asks_for_one_allocation_per_segment_only_for_a_nixl_executor() -> None:
    assert hooks.kv_cache_access(None) == frozenset()
    assert hooks.kv_cache_access({"kvxfer_executor": {"kind": "numpy"}}) == frozenset()
    assert hooks.kv_cache_access({"kvxfer_executor": {"kind": "nixl"}}) == {"REGISTERS"}
    assert hooks.supports_sleep_mode({"kvxfer_executor": {"kind": "nixl"}}) is False
    assert hooks.supports_sleep_mode({"kvxfer_executor": {"kind": "auto"}}) is True


def test_may_load_async_says_yes_for_requests_with_blocks_to_look_up_and_no_for_those_that_skip_external_kv() -> None:
    r = SimpleNamespace(block_hashes=[b"a"], skip_reading_external_kv=False)
    assert hooks.may_load_async(r, False) is True
    assert hooks.may_load_async(SimpleNamespace(block_hashes=[], skip_reading_external_kv=False), False) is False
    assert hooks.may_load_async(SimpleNamespace(block_hashes=[b"a"], skip_reading_external_kv=True), False) is False
    assert hooks.may_load_async(SimpleNamespace(block_hashes=[]), True) is True  # vLLM's own answer stands
