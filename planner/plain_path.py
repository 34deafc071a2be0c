"""The fast planning path, for plain layouts and mappings: one group, whole pages, k == 1, no writer rotation,
no per-layer calls. Merges byte-contiguous copies maximally.

How the work stays proportional to block pairs and output ranges:
1. Runs are found once in block-id space (ids advancing together on both sides), independent of regions.
2. Regions that are dense on both sides (stride == page) turn each id run into one byte range; other
   regions keep one range per pair. Expansion to regions is a numpy broadcast.
3. Ranges of different regions can only merge when their byte extents (up to the transfer's largest ids)
   touch on both sides within the same buffer pair. Only such regions go through the general (sort-based)
   merge.
4. When those extents keep regions' destinations apart, region order already is canonical order and no
   cross-region overlap is possible, so no global sort or check is needed.
"""
from __future__ import annotations

from typing import cast

import numpy as np

from .columns import (
    PageRuns,
    Part,
    affine_rows,
    assemble,
    check_overlaps,
    check_pages_fit,
    chunk_calls,
    empty_ranges,
    merge_where,
    raise_repeated_id,
    sort_canonical,
    split_large,
)
from .layout_info import LayoutInfo
from .runs import Ranges, Runs
from .spec import BlockMapping, BorrowedMapping, Direction
from .target import PlanOptions


def plan_plain(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, options: PlanOptions,
               cap: int | None) -> tuple[Ranges, int, np.ndarray]:
    """Ranges in canonical order, the number of block copies requested, and call offsets.

    The caller has checked that the layout and mapping are plain (see ``planning.plan_transfer``).
    Raises MappingError for ids past a buffer or a repeated destination id, LayoutError for regions whose
    destinations overlap or that write bytes the transfer reads.
    """
    s = mapping.src_ids
    if len(s) == 0 or info.nregions == 0:
        if isinstance(mapping, BorrowedMapping):  # no runs to check them on
            mapping.check_values()
        r: Ranges = dict(empty_ranges())
    else:
        r = _ranges(info, mapping, options.coalesce)
    r = split_large(r, options.max_range_bytes)
    return r, len(s) * info.nregions, chunk_calls(len(r["nbytes"]), cap)


class PlainKit:
    """What the fast path needs of a layout in one direction, made once: regions in destination order, which
    of them merge id runs into byte runs (dense on both sides), and the blocks of regions alike in that."""

    def __init__(self, info: LayoutInfo, direction: Direction):
        self.order, _ = info.dst_order(direction, 0)
        S, D = info.side[direction.src_side], info.side[direction.dst_side]
        merges = (S.dense & D.dense)[self.order]  # stride == page on both sides: id runs are byte runs
        self.merges = merges.tolist()
        self.all_dense, self.any_dense = bool(merges.all()), bool(merges.any())
        cut = np.flatnonzero(np.concatenate(([True], merges[1:] != merges[:-1], [True]))).tolist()
        self.blocks = list(zip(cut[:-1], cut[1:]))
        self.shared = bool(info.shared_buffers(direction))
        self.may_link = len(info.link_thresholds(direction)[0]) > 0
        o = self.order
        self.regs = o.astype(np.int32)
        self.src_buf, self.dst_buf, self.page = S.buf[o], D.buf[o], info.page[o]
        self.rows = [(c.base[o], c.linear_stride[o], _one(c.linear_stride[o])) for c in (S, D)]
        self.pool = info.pool
        self.single = np.ones(len(o), dtype=np.int64)  # run lengths of a one-run job (shared, read-only)
        self.single.flags.writeable = False

    def assemble(self, runs: PageRuns) -> Ranges:
        """The ranges of ``runs`` in every region (all regions alike: one part), region-major in destination
        order: offsets by one broadcast addition per side, other columns run-length encoded."""
        m, rows = len(runs.rs), len(self.regs)
        out = []
        for (base, stride, one), ids in zip(self.rows, (runs.rs, runs.rd)):
            if m == 1:  # one run (a contiguous job): one range per region
                out.append(base + int(ids[0]) * (stride if one is None else one))
                continue
            col = self.pool.empty(rows * m)
            if one is not None:  # one stride for all regions: one product over the ids, one broadcast sum
                np.add(base[:, None], ids * one, out=col.reshape(rows, m))
            else:
                affine_rows(base, stride, ids, col.reshape(rows, m))
            out.append(col)
        lengths = self.single if m == 1 else np.full(rows, m, dtype=np.int64)
        n = rows * m
        if runs.uniform:
            nbytes: np.ndarray | Runs = Runs.of(self.page * int(runs.rl[0]), lengths, n)
        else:
            nbytes = self.pool.empty(n)
            affine_rows(np.zeros(rows, np.int64), self.page, runs.rl, nbytes.reshape(rows, m))
        return {"src_buf": Runs.of(self.src_buf, lengths, n), "src_offset": out[0],
                "dst_buf": Runs.of(self.dst_buf, lengths, n), "dst_offset": out[1], "nbytes": nbytes,
                "region": Runs.of(self.regs, lengths, n)}


def _one(values: np.ndarray) -> int | None:
    """The value every entry of ``values`` has, or None."""
    return int(values[0]) if len(values) and bool((values == values[0]).all()) else None


def _ranges(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, coalesce: bool) -> Ranges:
    """All ranges in canonical order, checked for overlaps. Ids are checked non-negative on their runs (a
    borrowed mapping's were not checked before) and to fit their buffers before any sum or product of ids."""
    direction = mapping.direction
    s, d = mapping.src_ids, mapping.dst_ids
    kit: PlainKit = info.cached(("plain", direction.value), lambda: PlainKit(info, direction))
    # ids checked on the runs (again, for a BlockMapping), which also give the largest ids
    runs = PageRuns(info, direction, s, d, True, check_ids=True) if coalesce and kit.any_dense else None
    singles = PageRuns(info, direction, s, d, False, check_ids=True) if not (coalesce and kit.all_dense) else None
    some = runs if runs is not None else cast(PageRuns, singles)  # one of the two always exists
    top_s, top_d = some.top_s, some.top_d  # checked to fit before any product of ids is taken
    check_pages_fit(info, direction.src_side, None, s, None, s, "src_ids", top_s)
    check_pages_fit(info, direction.dst_side, None, d, None, d, "dst_ids", top_d)
    if some.repeated:
        raise_repeated_id(d)
    if runs is None or singles is None:
        r = kit.assemble(some)
    else:  # mixed: regions keep their destination order
        parts: list[tuple[np.ndarray, Part]] = [(kit.order[a:b], runs if kit.merges[a] else singles)
                                               for a, b in kit.blocks]
        r = assemble(info, direction, parts)
    disjoint = top_d <= info.disjoint_top(direction)
    if coalesce and kit.may_link:
        linked = info.linked_regions(direction, top_s, top_d)
        if linked.any():
            r = merge_where(r, linked, np.zeros(info.nregions, np.int64))
            disjoint = False
    if not disjoint:
        r = sort_canonical(r)
    if not disjoint or kit.shared:
        check_overlaps(info, direction, r, d)
    return r
