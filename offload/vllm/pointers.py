"""vLLM 0.34's ``DevicePointers`` mapped back onto the blocks of kvxfer's bound layout, without vLLM.

0.34's workers take, per job, flat ``ptrs``/``sizes`` arrays in vLLM's canonical order (per group, per data ref,
per block: ``base(ref) + block * row_stride(ref)``, ``page_size(ref)`` bytes). kvxfer binds each device tensor
once, as a buffer with regions, and plans by (buffer, offset): raw addresses never enter a plan. ``PointerMap``,
made once from the engine's KV caches (each ref's tensor base address, row stride and page size), turns a job's
pointers back into block ids per group (``DeviceBlocks``, what 0.32's ``GPULoadStoreSpec`` carried), checking
every pointer: one outside its ref's tensor, off a row boundary, of another size, or disagreeing between the refs
of a group raises PointerError (a ValueError) naming the index and value. Vectorized per (group, ref).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

__all__ = ["DeviceBlocks", "PointerError", "PointerMap", "RefGeometry"]


class PointerError(ValueError):
    """A DevicePointers job that does not fit the bound KV caches; names the field, index and value."""

    def __init__(self, field: str, index: int, value: Any, reason: str):
        self.field, self.index, self.value = field, index, value
        super().__init__(f"DevicePointers.{field}[{index}] = {value!r}: {reason}")


@dataclass(frozen=True)
class RefGeometry:
    """One data ref of a group: its tensor's base address, bytes, row stride (bytes per block) and page size."""

    base: int
    nbytes: int
    row_stride: int
    page_size: int


@dataclass(frozen=True)
class DeviceBlocks:
    """A job's device side as block ids: what ``WorkerCore`` plans from (0.32's GPULoadStoreSpec fields)."""

    block_ids: np.ndarray  # int64, per group concatenated
    group_sizes: tuple[int, ...]
    block_indices: tuple[int, ...]


class PointerMap:
    """The bound KV caches' refs per group (``RefGeometry``), made once; ``blocks`` maps a job's pointers."""

    def __init__(self, groups: Sequence[Sequence[RefGeometry]]):
        self.groups = tuple(tuple(g) for g in groups)
        for g, refs in enumerate(self.groups):
            for i, r in enumerate(refs):
                if r.row_stride <= 0 or r.page_size <= 0 or r.page_size > r.row_stride or r.nbytes < 0:
                    raise PointerError(f"group[{g}].ref", i, r, "a ref needs 0 < page_size <= row_stride")

    @classmethod
    def from_kv_caches(cls, kv_caches: Any) -> PointerMap:
        """From vLLM's ``CanonicalKVCaches`` (``tensors[i].tensor``, ``group_data_refs[g][j].tensor_idx`` and
        ``.page_size_bytes``): the same addresses 0.34's ``resolve_device_pointers`` computes from."""
        geo = [(int(t.data_ptr()), int(t.numel()) * int(t.element_size()), int(t.stride(0)) * int(t.element_size()))
               for t in (c.tensor for c in kv_caches.tensors)]
        groups = [[RefGeometry(geo[r.tensor_idx][0], geo[r.tensor_idx][1], geo[r.tensor_idx][2], int(r.page_size_bytes))
                   for r in refs]
                  for refs in kv_caches.group_data_refs]
        return cls(groups)

    def blocks(self, device_ptrs: Any) -> DeviceBlocks:
        """The block ids of a ``DevicePointers`` job (``ptrs``, ``sizes``, ``group_block_counts``,
        ``group_data_ref_counts``, ``block_indices``); PointerError when any pointer does not fit."""
        ptrs = np.asarray(device_ptrs.ptrs, dtype=np.uint64)
        sizes = np.asarray(device_ptrs.sizes, dtype=np.uint64)
        counts = tuple(int(c) for c in device_ptrs.group_block_counts)
        nrefs = tuple(int(c) for c in device_ptrs.group_data_ref_counts)
        starts = tuple(int(c) for c in device_ptrs.block_indices)
        if len(counts) != len(self.groups):
            raise PointerError("group_block_counts", len(counts), counts, f"the caches have {len(self.groups)} groups")
        if len(nrefs) != len(counts) or len(starts) != len(counts):
            raise PointerError("group_data_ref_counts", len(nrefs), nrefs, "one entry per group is needed")
        if ptrs.shape != sizes.shape or ptrs.ndim != 1:
            raise PointerError("sizes", 0, sizes.shape, f"must match ptrs {ptrs.shape}")
        total = sum(c * r for c, r in zip(counts, nrefs) if c)
        if total != len(ptrs):
            raise PointerError("ptrs", len(ptrs), len(ptrs), f"the group counts name {total} pointers")
        out, at = [], 0
        for g, (count, n, refs) in enumerate(zip(counts, nrefs, self.groups)):
            if count == 0:
                continue
            if n != len(refs) or not refs:
                raise PointerError("group_data_ref_counts", g, n, f"group {g} has {len(refs)} refs")
            ids: np.ndarray | None = None
            for r in refs:
                ids = self._ref_blocks(ptrs, sizes, at, count, r, ids)
                at += count
            if ids is not None:  # a group without refs moves nothing
                out.append(ids)
        block_ids = np.concatenate(out) if out else np.zeros(0, np.int64)
        return DeviceBlocks(block_ids, counts, starts)

    @staticmethod
    def _ref_blocks(ptrs: np.ndarray, sizes: np.ndarray, at: int, count: int, r: RefGeometry,
                    first: np.ndarray | None) -> np.ndarray:
        p, s = ptrs[at:at + count], sizes[at:at + count]
        bad = np.flatnonzero(s != np.uint64(r.page_size))
        if bad.size:
            raise PointerError("sizes", at + int(bad[0]), int(s[bad[0]]), f"the ref's page is {r.page_size} bytes")
        off = p.astype(np.int64) - np.int64(r.base)  # addresses fit in 63 bits
        bad = np.flatnonzero((off < 0) | (off + r.page_size > r.nbytes) | (off % r.row_stride != 0))
        if bad.size:
            i = at + int(bad[0])
            raise PointerError("ptrs", i, hex(int(ptrs[i])), "outside the ref's tensor or off a block boundary")
        ids = off // r.row_stride
        if first is not None:
            bad = np.flatnonzero(ids != first)
            if bad.size:
                i = at + int(bad[0])
                raise PointerError("ptrs", i, hex(int(ptrs[i])), f"block {int(ids[bad[0]])} where the group's first "
                                   f"ref has block {int(first[bad[0]])}")
            return first
        return ids
