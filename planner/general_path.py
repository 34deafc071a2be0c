"""The general planning path: sub-block chunks, KV-cache groups (declared, possibly empty), canonical
fragments, writer rotation per region and per-layer call boundaries.

Each group's ids become page ids; each region's pages become ranges (id runs where offsets are linear in the
page id, pages x fragment pieces otherwise), written straight into the plan's columns. Only regions whose
ranges can still join (pieces that chain across pages, regions whose extents touch) go through the general
merge. Cost grows with the elementary copies and output ranges.
"""
from __future__ import annotations

from enum import IntEnum
from typing import NamedTuple

import numpy as np

from .columns import (
    PageRuns,
    Part,
    Pieces,
    assemble,
    calls_by_group,
    check_overlaps,
    check_pages_fit,
    chunk_calls,
    merge,
    merge_where,
    sort_by,
    sort_canonical,
    split_large,
)
from .errors import LayoutError, MappingError
from .layout_info import LayoutInfo, SideColumns
from .runs import Ranges
from .spec import BlockMapping, BorrowedMapping, Direction, Location
from .target import PlanOptions

Table = tuple[np.ndarray, np.ndarray, np.ndarray]  # src piece offsets, dst piece offsets, sizes (dst order)


class RegionKind(IntEnum):
    """How a region's pages become ranges (see ``region_kinds``)."""

    PAGE = 0  # whole pages, offsets linear in the page id: id runs give the ranges, as for plain layouts
    PIECES = 1  # fragments whose table cannot join across pages: pages x pieces are the ranges
    GENERAL = 2  # anything else (padded chunk rows, pieces that chain across pages): expanded, then merged
    REPEATS = 3  # PIECES, except that a piece chains into the next destination page's when both pages read the
    #              same source page: GENERAL for a transfer that repeats a source page there, PIECES otherwise


def group_chunk_size(info: LayoutInfo, regs: np.ndarray, side: Location, group: int) -> int:
    """The group's blocks per chunk on ``side``; a group without regions takes the one all regions share."""
    col = info.side[side]
    ks = np.unique(col.k[regs] if len(regs) else col.k)
    if len(ks) > 1 and len(regs):
        r = int(regs[np.argmax(col.k[regs] != ks[0])])
        raise LayoutError(f"regions[{int(info.origin[r])}].{side}.blocks_per_chunk", int(col.k[r]),
                          f"regions of group {group} must share blocks_per_chunk on the {side} side ({int(ks[0])})")
    if len(ks) > 1:
        raise LayoutError("num_groups", info.num_groups, f"group {group} has no regions and the regions disagree on "
                          f"blocks_per_chunk on the {side} side, so its ids cannot be counted")
    return int(ks[0]) if len(ks) else 1


def group_pages(info: LayoutInfo, regs: np.ndarray, ids: np.ndarray, used: int, count: int, start: int,
                side: Location, field: str, group: int,
                want_index: bool = True) -> tuple[np.ndarray, np.ndarray | None, int]:
    """Canonical page ids of one group on one side, the index into ``ids`` each came from (None unless
    ``want_index``), and ids consumed.

    Chunk c with k pages enumerates pages c*k .. c*k+k-1; the group's pages are that flattened list from
    ``start % k`` on, ``count`` long (the first and last chunks may be partial).
    """
    if count == 0 and len(regs) == 0:  # a group with no regions and no ids consumes nothing, whatever its chunks
        return np.zeros(0, np.int64), np.zeros(0, np.int64), used
    k = info.cached(("chunk_size", group, side.value), lambda: group_chunk_size(info, regs, side, group))
    skip = start % k
    need = -(-(skip + count) // k) if count else 0
    if used + need > len(ids):
        raise MappingError(field, f"length {len(ids)}", f"group {group} (size {count}, start {start}, {k} blocks per "
                           f"chunk) needs {field}[{used}:{used + need}], past the end of the list")
    chunks = ids[used:used + need]
    col = info.side[side]
    # the last chunk whose first page fits, per region: bounding ids here keeps every later product in int64
    limit, lowest = info.cached(("chunk_limit", group, side.value), lambda: _chunk_limits(col, regs))
    if len(chunks) and len(regs) and int(chunks.max()) > lowest:
        r = int(regs[np.argmin(limit)])
        i = used + int(np.argmax(chunks > lowest))
        buf = info.buffers[int(col.buf[r])]
        raise MappingError(field, int(ids[i]), f"chunk of region {info.regions[r].name!r} ({side} side) starts past "
                           f"buffer {buf.name!r} of {buf.nbytes} bytes (last chunk that fits: {lowest})", i)
    if k == 1:
        pages = chunks
    else:
        pages = np.add.outer(chunks * k, np.arange(k)).ravel()[skip:skip + count]
    index = used + (np.arange(count) + skip) // k if want_index else None
    return pages, index, used + need


def _chunk_limits(col: SideColumns, regs: np.ndarray) -> tuple[np.ndarray, int]:
    """Per region of ``regs``, the last chunk whose first page fits its buffer; and the smallest of them."""
    limit: np.ndarray = (col.cap[regs] - col.base[regs] - col.page[regs]) // col.stride[regs]
    return limit, int(limit.min()) if len(limit) else -1


def _fragment_table(info: LayoutInfo, r: int, direction: Direction) -> Table:
    """(src piece offsets, dst piece offsets, piece sizes) within a page; loads read canonical, write local."""
    reg = info.regions[r]
    if not reg.fragments:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([reg.page_bytes], np.int64)
    local = np.concatenate([f.local_offset + np.arange(f.count) * f.local_stride for f in reg.fragments])
    canon = np.concatenate([f.canonical_offset + np.arange(f.count) * f.canonical_stride for f in reg.fragments])
    size = np.concatenate([np.full(f.count, f.fragment_bytes) for f in reg.fragments]).astype(np.int64)
    return (canon, local, size) if direction is Direction.H2D else (local, canon, size)


def region_kinds(info: LayoutInfo, direction: Direction, coalesce: bool) -> tuple[np.ndarray, list[Table]]:
    """Per region: its RegionKind and its fragment table (in destination order).

    With ``coalesce`` the table's touching pieces are merged first; without it every declared piece stays.
    Depends on the layout alone, so it is computed once per layout, direction and coalesce flag.
    """
    return info.cached(("kinds", direction.value, coalesce), lambda: _classify(info, direction, coalesce))


def _classify(info: LayoutInfo, direction: Direction, coalesce: bool) -> tuple[np.ndarray, list[Table]]:
    kinds = np.zeros(info.nregions, dtype=np.int64)
    tables = []
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    for r in range(info.nregions):
        fs, fd, fb = _fragment_table(info, r, direction)
        if coalesce:
            zero = np.zeros(len(fb), np.int32)
            t = merge({"src_buf": zero, "dst_buf": zero, "src_offset": fs, "dst_offset": fd, "nbytes": fb, "region": zero})
            fs, fd, fb = t["src_offset"], t["dst_offset"], t["nbytes"]
        o = np.argsort(fd, kind="stable")
        fs, fd, fb = fs[o], fd[o], fb[o]
        tables.append((fs, fd, fb))
        linear = all(int(c.k[r]) == 1 or bool(c.dense[r]) for c in (S, D))
        pages_chain = bool(coalesce and S.dense[r] and D.dense[r])
        ps, pd = int(S.page[r]), int(D.page[r])
        whole = len(fb) == 1 and fs[0] == 0 and fd[0] == 0 and fb[0] == ps == pd
        if linear and whole:
            kinds[r] = RegionKind.PAGE
        elif not linear or (pages_chain and _chains(fs, fd, fb, ps, pd)):
            kinds[r] = RegionKind.GENERAL
        elif coalesce and D.dense[r] and _chains(fs, fd, fb, 0, pd):
            kinds[r] = RegionKind.REPEATS
        else:
            kinds[r] = RegionKind.PIECES
    return kinds, tables


def _chains(fs: np.ndarray, fd: np.ndarray, fb: np.ndarray, src_step: int, dst_step: int) -> bool:
    """Whether some piece ends where a piece starts on both sides once the source moves ``src_step`` bytes and
    the destination ``dst_step`` bytes (the next page: ``dst_step`` is its page; ``src_step`` is 0 when both
    pages read one source page, its page when the next source page follows in bytes).

    Pages are disjoint (stride >= page), so a piece can end where another page's piece starts only when the
    two pages are the same page or neighbours in bytes; these two steps are the only ways pieces chain."""
    starts = set(zip(fs.tolist(), fd.tolist()))  # once per layout: a set keeps large tables linear
    return any(e in starts for e in zip((fs + fb - src_step).tolist(), (fd + fb - dst_step).tolist()))


class WriterSet(NamedTuple):
    """Regions of one group sharing (writers, this rank's index), with what planning needs of them (made once
    per layout, direction and writer options)."""

    regs: np.ndarray
    writers: int
    rank: int  # this rank's index among the writers
    pieces: int  # fragment pieces per page, summed over the regions
    page_dense: np.ndarray  # whole-page regions dense on both sides: id runs are byte runs
    page_sparse: np.ndarray  # other whole-page regions: one range per page
    piece_regs: list[int]  # regions whose pages become pieces
    repeats: np.ndarray  # of those, RegionKind.REPEATS


def writer_sets(info: LayoutInfo, group: int, regs: np.ndarray, direction: Direction,
                options: PlanOptions) -> list[WriterSet]:
    """The group's regions split by (writers, this rank's index), loads into one set (1, 0); cached per layout."""
    key = ("writer_sets", group, direction.value, options.num_writers, options.writer_index, options.coalesce)
    return info.cached(key, lambda: _make_writer_sets(info, regs, direction, options))


def _make_writer_sets(info: LayoutInfo, regs: np.ndarray, direction: Direction, options: PlanOptions) -> list[WriterSet]:
    kinds, _ = region_kinds(info, direction, options.coalesce)
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    out = []
    for r, w, x in _writer_sets(info, regs, direction, options):
        page = r[kinds[r] == RegionKind.PAGE]
        dense = S.dense[page] & D.dense[page]
        piece = r[kinds[r] != RegionKind.PAGE]
        out.append(WriterSet(r, w, x, int(info.pieces[r].sum()), page[dense], page[~dense], piece.tolist(),
                             piece[kinds[piece] == RegionKind.REPEATS]))
    return out


def _writer_sets(info: LayoutInfo, regs: np.ndarray, direction: Direction,
                 options: PlanOptions) -> list[tuple[np.ndarray, int, int]]:
    """The group's regions split by (writers, this rank's index); loads read everything: one set, (1, 0)."""
    if direction is Direction.H2D:
        return [(regs, 1, 0)]
    nw, wi = info.writers(options.num_writers, options.writer_index)
    pairs = np.unique(np.stack((nw[regs], wi[regs]), axis=1), axis=0)
    for w, x in pairs.tolist():
        if x >= w:
            r = int(regs[np.argmax((nw[regs] == w) & (wi[regs] == x))])
            raise LayoutError(f"regions[{int(info.origin[r])}].writer_index", x,
                              f"must be below num_writers {w} (the region's or the plan's)")
    return [(regs[(nw[regs] == w) & (wi[regs] == x)], w, x) for w, x in pairs.tolist()]


def plan_general(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, options: PlanOptions,
                 cap: int | None) -> tuple[Ranges, int, np.ndarray]:
    """Ranges (canonical order within each call), the number of elementary copies requested, call offsets.

    Raises MappingError when the groups do not fit the id lists or an id addresses bytes past a buffer,
    LayoutError for regions of one group with different chunk sizes or whose destinations overlap.
    """
    direction = mapping.direction
    src_side, dst_side = direction.src_side, direction.dst_side
    s_ids, d_ids = mapping.src_ids, mapping.dst_ids
    sizes = mapping.group_sizes if mapping.group_sizes is not None else (len(s_ids),)
    starts = mapping.group_starts if mapping.group_starts is not None else (0,) * len(sizes)
    if len(sizes) != info.num_groups:
        raise MappingError("group_sizes", list(sizes), f"the layout has {info.num_groups} KV-cache groups")
    call_group = info.call_group(options.regions_per_call)
    kinds, tables = region_kinds(info, direction, options.coalesce)
    parts: list[Part] = []  # each region's ranges: parts[part_of[r]] (-1: none)
    part_of = np.full(info.nregions, -1, dtype=np.int64)
    chained = kinds == RegionKind.GENERAL  # regions whose ranges go through the general merge
    repeated_page = False
    top_s = top_d = requested = used_s = used_d = 0
    for g, (count, start) in enumerate(zip(sizes, starts)):
        group_regs = info.group_regions(g)
        sp_all, si_all, used_s = group_pages(info, group_regs, s_ids, used_s, count, start, src_side, "src_ids", g)
        dp_all, di_all, used_d = group_pages(info, group_regs, d_ids, used_d, count, start, dst_side, "dst_ids", g)
        sets = writer_sets(info, g, group_regs, direction, options) if len(group_regs) else ()
        for ws in sets:
            sp, si, dp, di = sp_all, si_all, dp_all, di_all
            if ws.writers > 1:  # replicated data: this rank writes only its share of the canonical pages
                keep = dp % ws.writers == ws.rank
                sp, dp = sp[keep], dp[keep]
                si, di = (None if x is None else x[keep] for x in (si, di))
            check_pages_fit(info, src_side, ws.regs, sp, si, s_ids, "src_ids")
            check_pages_fit(info, dst_side, ws.regs, dp, di, d_ids, "dst_ids")
            requested += len(sp) * ws.pieces
            if not len(sp):
                continue
            sd, o = sort_by(dp, np.arange(len(dp)))  # pages in destination order
            repeated_page |= bool((sd[1:] == sd[:-1]).any())
            top_s, top_d = max(top_s, int(sp.max())), max(top_d, int(sd[-1]))
            for sel, joins in ((ws.page_dense, options.coalesce), (ws.page_sparse, False)):
                if len(sel):
                    part_of[sel] = len(parts)
                    parts.append(PageRuns(info, direction, sp, dp, joins))
            if ws.piece_regs:
                S, D, sp_o, dp_o = info.side[src_side], info.side[dst_side], sp[o], sd
                part_of[ws.piece_regs] = np.arange(len(parts), len(parts) + len(ws.piece_regs))
                parts += [Pieces(S, D, r, sp_o, dp_o, tables[r]) for r in ws.piece_regs]
                if len(ws.repeats) and bool(((dp_o[1:] == dp_o[:-1] + 1) & (sp_o[1:] == sp_o[:-1])).any()):
                    chained[ws.repeats] = True  # neighbouring destination pages read one source page: pieces chain
    for field, used, ids in (("src_ids", used_s, s_ids), ("dst_ids", used_d, d_ids)):
        if used != len(ids):
            raise MappingError(field, f"length {len(ids)}", f"the groups (sizes {list(sizes)}, starts {list(starts)}) "
                               f"consume {used} ids; the lists must add up exactly")
    order, disjoint = info.dst_order(direction, top_d, options.regions_per_call)
    r = assemble(info, direction, _consecutive(order, part_of, parts))
    # Regions in (call group, destination) order, each in destination order: canonical already when the
    # transfer keeps regions' destinations apart; then only a repeated page could write a byte twice.
    if not (disjoint and not info.shared_buffers(direction) and not repeated_page):
        r = sort_canonical(r, call_group)
        check_overlaps(info, direction, r, d_ids if len(sizes) == 1 else None, call_group)
    mergeable = chained | info.linked_regions(direction, top_s, top_d)
    if options.coalesce and len(r["nbytes"]) and mergeable.any():
        r = sort_canonical(merge_where(r, mergeable, call_group), call_group)
    r = split_large(r, options.max_range_bytes)
    if not options.regions_per_call:
        return r, requested, chunk_calls(len(r["nbytes"]), cap)
    return r, requested, calls_by_group(r["region"], call_group, cap)


def _consecutive(order: np.ndarray, part_of: np.ndarray, parts: list[Part]) -> list[tuple[np.ndarray, Part]]:
    """Regions in ``order`` that have ranges, as (regions, part) with consecutive regions sharing a part joined."""
    regs = order[part_of[order] >= 0]
    ids = part_of[regs]
    if not len(ids):
        return []
    cut = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1], [True])))
    return [(regs[a:b], parts[int(ids[a])]) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]
