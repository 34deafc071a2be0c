"""The KV caches vLLM hands over (``CanonicalKVCaches``) read as kvxfer tensors: ``read_caches`` -> ``CacheMap``.

No vLLM import: duck-typed on the fields of vLLM 0.32's CanonicalKVCaches, CanonicalKVCacheRef and
CanonicalPageMapping, so the mapping is tested without vLLM too.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.planner import LayoutError

from ..tier import DeviceKV, HostLayout, KVTensor, Sharing, TPRank, device_from_tensors
from .checks import UnsupportedFeatureError

__all__ = ["CacheMap", "read_caches"]


@dataclass(frozen=True)
class CacheMap:
    """What ``read_caches`` made of vLLM's CanonicalKVCaches.

    ``device``: the device buffers and one KVTensor per vLLM tensor that some ref uses (``t<index>``; its host
    cell is shared by every ref to that tensor, as vLLM keeps one host tensor per KV tensor). ``refs``: per
    (group, ref), the tensor's KVTensor with the ref's group (``g<group>.<ref>``), one kvxfer region each.
    ``tp``: the rank the host cells are laid out for (rank 0 of 1 for the replicated single-copy layout).
    """

    device: DeviceKV
    refs: tuple[tuple[str, KVTensor], ...]
    num_groups: int
    tp: TPRank
    layout: HostLayout


def _ref_sharing(g: int, i: int, ref: Any, tp: TPRank) -> tuple[Sharing, int]:
    """(sharing, shard_rows) of a canonical ref, when its page mapping is one kvxfer's host tier lays out the
    same way: rank r's slice i of the page at ``(i * tp + r) * slice`` (head-sharded) or the whole page
    written by rotating ranks (replicated). Anything else is refused."""
    m, page, n, r = ref.mapping, int(ref.page_size_bytes), tp.size, tp.rank
    where = f"group {g} ref {i} (tensor {ref.tensor_idx})"
    if m is None:
        raise UnsupportedFeatureError("canonical_layout for a layer without a canonical page mapping", where)
    runs = tuple(m.runs)
    if int(m.local_page_size_bytes) != page:
        raise UnsupportedFeatureError("a canonical mapping whose local page differs from the layer's page",
                                      f"{where}: mapping {m.local_page_size_bytes} B, page {page} B")
    if len(runs) == 1:
        run = runs[0]
        whole = (run.local_offset, run.canonical_offset, run.fragment_size, run.num_fragments) == (0, 0, page, 1)
        if whole and n > 1 and m.num_writers == n and m.writer_index == r and m.canonical_page_size_bytes == page:
            return Sharing.REPLICATED, 1
        piece, count = int(run.fragment_size), int(run.num_fragments)
        strided = count == 1 or (run.local_stride == piece and run.canonical_stride == piece * n)
        if (m.num_writers == 1 and m.canonical_page_size_bytes == n * page and piece * count == page
                and run.local_offset == 0 and run.canonical_offset == r * piece and strided):
            return Sharing.SHARDED, count
    raise UnsupportedFeatureError(
        "this canonical page mapping", f"{where}: runs {runs}, {m.num_writers} writer(s), writer index "
        f"{m.writer_index}, canonical page {m.canonical_page_size_bytes} B at TP rank {r} of {n}; kvxfer's host tier "
        "lays out head-sharded slices and rotating replicated pages only")


def read_caches(kv_caches: Any, *, rank: int = 0, world_size: int = 1, canonical: bool = False,
                replicated: bool = False) -> CacheMap:
    """Map vLLM's CanonicalKVCaches onto kvxfer tensors.

    Supported: per-layer tensors shaped (num_blocks, page bytes) with any block stride (vLLM hands K/V
    packed or split layers, and packed multi-layer blocks, as such views); several KV-cache groups; one tensor
    referenced by several refs, groups or layers (one host cell, aliased regions); the direct layout (each
    rank's own cells); ``canonical`` page mappings that are head-sharded slices or replicated pages (kvxfer's
    fragments and per-region writers); the ``replicated`` single-copy layout (every rank loads the one copy).
    Refused with UnsupportedFeatureError naming the feature: refs of one tensor with different page sizes or
    mappings, a ref page larger than its tensor's page, other canonical mappings, canonical and replicated
    together. Shapes the tensors cannot be read as raise LayoutError naming the dimension.
    """
    if canonical and replicated:
        raise UnsupportedFeatureError("canonical_layout with the replicated single-copy layout", "pick one")
    tp = TPRank() if replicated else TPRank(size=world_size, rank=rank)
    tensors = {f"t{i}": ct.tensor for i, ct in enumerate(kv_caches.tensors)}
    for i, ct in enumerate(kv_caches.tensors):
        t = ct.tensor
        if t.dim() != 2 or int(ct.page_size_bytes) != int(t.shape[1]) * t.element_size():
            raise LayoutError(f"kv_caches.tensors[{i}].shape", tuple(t.shape),
                              f"expected (num_blocks, page) with a {ct.page_size_bytes}-byte page")
    device = device_from_tensors(tensors, kv_split=False)
    by_name = {t.name: t for t in device.tensors}
    cells: dict[str, KVTensor] = {}
    refs: list[tuple[str, KVTensor]] = []
    for g, group in enumerate(kv_caches.group_data_refs):
        for i, ref in enumerate(group):
            name = f"t{ref.tensor_idx}"
            if name not in by_name:
                raise LayoutError(f"kv_caches.group_data_refs[{g}][{i}].tensor_idx", ref.tensor_idx,
                                  f"there are {len(tensors)} tensors")
            base, page = by_name[name], int(ref.page_size_bytes)
            if page > base.page_bytes:
                raise UnsupportedFeatureError("a layer page larger than its tensor's page",
                                              f"group {g} ref {i}: {page} B > {base.page_bytes} B")
            sharing, rows = _ref_sharing(g, i, ref, tp) if canonical else (Sharing.PRIVATE, 1)
            cell = base.model_copy(update={"page_bytes": page, "sharing": sharing, "shard_rows": rows})
            seen = cells.setdefault(name, cell)
            if (seen.page_bytes, seen.sharing, seen.shard_rows) != (page, sharing, rows):
                raise UnsupportedFeatureError(
                    "one KV tensor referenced with different page sizes or page mappings",
                    f"tensor {ref.tensor_idx}: {seen.page_bytes} B {seen.sharing.value}/{seen.shard_rows} and, in group "
                    f"{g} ref {i}, {page} B {sharing.value}/{rows}")
            refs.append((f"g{g}.{i}", cell.model_copy(update={"group": g})))
    used = DeviceKV(device.buffers, tuple(cells.values()), device.bindings)
    return CacheMap(used, tuple(refs), max(len(kv_caches.group_data_refs), 1), tp,
                    HostLayout.CANONICAL if canonical else HostLayout.DIRECT)
