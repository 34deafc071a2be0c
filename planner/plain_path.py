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

import numpy as np

from .columns import (
    PageRuns,
    Part,
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
from .runs import Ranges
from .spec import BlockMapping
from .target import PlanOptions


def plan_plain(info: LayoutInfo, mapping: BlockMapping, options: PlanOptions,
               cap: int | None) -> tuple[Ranges, int, np.ndarray]:
    """Ranges in canonical order, the number of block copies requested, and call offsets.

    The caller has checked that the layout and mapping are plain (see ``planning.plan_transfer``).
    Raises MappingError for ids past a buffer or a repeated destination id, LayoutError for regions whose
    destinations overlap or that write bytes the transfer reads.
    """
    direction = mapping.direction
    s, d = mapping.src_ids, mapping.dst_ids
    if len(s) == 0 or info.nregions == 0:
        r: Ranges = dict(empty_ranges())
    else:
        top_s, top_d = int(s.max()), int(d.max())  # once: every step below needs them
        check_pages_fit(info, direction.src_side, None, s, None, s, "src_ids", top_s)
        check_pages_fit(info, direction.dst_side, None, d, None, d, "dst_ids", top_d)
        r = _ranges(info, mapping, options.coalesce, top_s, top_d)
    r = split_large(r, options.max_range_bytes)
    return r, len(s) * info.nregions, chunk_calls(len(r["nbytes"]), cap)


def _ranges(info: LayoutInfo, mapping: BlockMapping, coalesce: bool, top_s: int, top_d: int) -> Ranges:
    """All ranges in canonical order, checked for overlaps; ``top_s``, ``top_d``: the largest ids."""
    direction = mapping.direction
    s, d = mapping.src_ids, mapping.dst_ids
    order, disjoint = info.dst_order(direction, top_d)
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    merges = (S.dense & D.dense)[order]  # stride == page on both sides: id runs are byte runs
    runs = PageRuns(info, direction, s, d, True) if coalesce and merges.any() else None
    singles = PageRuns(info, direction, s, d, False) if not (coalesce and merges.all()) else None
    some = runs or singles
    if some is not None and some.repeated:
        raise_repeated_id(d)
    parts: list[tuple[np.ndarray, Part]]
    if runs is None or singles is None:
        parts = [(order, runs or singles)]  # type: ignore[list-item]
    else:  # mixed: regions keep their destination order
        cut = np.flatnonzero(np.concatenate(([True], merges[1:] != merges[:-1], [True])))
        parts = [(order[a:b], runs if merges[a] else singles) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]
    r = assemble(info, direction, parts)
    linked = info.linked_regions(direction, top_s, top_d) if coalesce else None
    if linked is not None and linked.any():
        r = merge_where(r, linked, np.zeros(info.nregions, np.int64))
        disjoint = False
    if not disjoint:
        r = sort_canonical(r)
    if not disjoint or info.shared_buffers(direction):
        check_overlaps(info, direction, r, d)
    return r
