"""The builder: checked page pairs (``request.Request``) become a transfer's ranges and call offsets.

How the work stays proportional to block pairs and output ranges:
1. Runs are found once in page-id space (pages advancing together on both sides), independent of regions.
2. Regions whose offsets are linear in the page id turn each run into one byte range when they are dense on
   both sides (stride == page), one range per page otherwise; other regions turn pages into pages x fragment
   pieces. Expansion to regions is a numpy broadcast, written straight into the plan's offset columns; a
   paged layout takes every region as one block of rows (``Rows``), gathered once per layout.
3. Ranges of different regions can only merge when their byte extents (up to the transfer's largest pages)
   touch on both sides within the same buffer pair; pieces can only merge when they chain across pages. Only
   such regions go through the general (sort-based) merge.
4. When those extents keep regions' destinations apart, region order already is canonical order and no
   cross-region overlap is possible, so no global sort or overlap check is needed.

The strategy (``layout_cache.Strategy``) is a property of the layout and the plan setting; the builder reads
it and never refuses a transfer: the front end (``checks``) has checked the pages, and runs the one check that
needs byte ranges (overlaps) on what is built here, where the request says regions could touch. Every kind of
region's ranges is a part (``Part``: page runs in some regions, pages x pieces of one region, or the rows of a
paged layout), and one assembler (``assemble``) writes the parts into the plan's columns.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .column_pool import POOL_MIN, ColumnPool
from .columns import (
    PageRuns,
    affine_rows,
    calls_by_group,
    chunk_calls,
    empty_ranges,
    merge_where,
    sort_canonical,
    split_large,
)
from .frozen import freeze
from .layout_cache import LayoutCache, Rows, SideColumns, Strategy
from .request import Request
from .runs import Ranges, Runs
from .target import PlanOptions

PerRegion = tuple["int | np.ndarray", "int | np.ndarray | None", "tuple[np.ndarray, np.ndarray] | None"]


class Part(Protocol):
    """Ranges of some regions, written straight into the plan's columns when they are assembled. Every region
    of a part has as many ranges."""

    def per_region(self, regs: np.ndarray) -> PerRegion:
        """The run-length columns of ``regs``: the ranges in each region (an int, or the same as a frozen int64
        array with one entry per region); their size (an int for every range, an int64 array with one per region,
        or None when sizes vary); and each region's (source, destination) buffer when the part holds them
        gathered (frozen int32 arrays), else None (the layout's columns give them)."""

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the ranges of ``regs`` (region-major) into ``so``, ``do`` and, unless None, ``nb``."""


class RunsPart:
    """Page runs applied to regions whose offsets are linear in the page id: each run is one range of its
    length in pages in each region, in destination order."""

    def __init__(self, runs: PageRuns, src: SideColumns, dst: SideColumns, page: np.ndarray):
        self.runs, self.S, self.D, self.page = runs, src, dst, page

    def per_region(self, regs: np.ndarray) -> PerRegion:
        """One range per run in every region; page bytes times the run length when every run has one length."""
        runs = self.runs
        return len(runs.rs), self.page[regs] * (int(runs.rl[0]) if len(runs.rl) else 0) if runs.uniform else None, None

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the runs' offsets (and, unless ``nb`` is None, sizes) for each region of ``regs``, region-major."""
        runs = self.runs
        shape = (len(regs), len(runs.rs))
        S, D = self.S, self.D
        affine_rows(S.base[regs], S.linear_stride[regs], runs.rs, so.reshape(shape))
        affine_rows(D.base[regs], D.linear_stride[regs], runs.rd, do.reshape(shape))
        if nb is not None:
            affine_rows(np.zeros(len(regs), np.int64), self.page[regs], runs.rl, nb.reshape(shape))


class RowsPart:
    """Page runs applied to every region of a paged layout, whose columns are gathered once per layout
    (``Rows``, in the strategy's order; ``regs`` is ``rows.regs``): offsets by one broadcast addition per
    side, and the run-length columns are frozen arrays (the layout's own where the runs leave them unchanged)."""

    def __init__(self, rows: Rows, runs: PageRuns):
        self.rows, self.runs = rows, runs

    def per_region(self, regs: np.ndarray) -> PerRegion:
        """One range per run in every row (the layout's column of ones for a one-run job); page bytes times the
        run length when every run has one length; the rows' buffers."""
        rows, runs = self.rows, self.runs
        m = len(runs.rs)
        sizes = None
        if runs.uniform:
            size = int(runs.rl[0])
            sizes = filled(rows.one_page * size, len(regs)) if rows.one_page is not None else freeze(rows.page * size)
        return rows.single if m == 1 else m, sizes, (rows.src_buf, rows.dst_buf)

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write every row's runs: one product over the ids and one broadcast sum per side where all rows share
        one stride, else per stride (``affine_rows``)."""
        rows, runs = self.rows, self.runs
        (sbase, sstride, sone), (dbase, dstride, done) = rows.src, rows.dst
        if len(runs.rs) == 1:  # one run (a contiguous job): one range per region, of one size
            np.add(sbase, int(runs.rs[0]) * (sstride if sone is None else sone), out=so)
            np.add(dbase, int(runs.rd[0]) * (dstride if done is None else done), out=do)
            return
        shape = (len(rows.regs), len(runs.rs))
        for base, stride, one, ids, out in ((sbase, sstride, sone, runs.rs, so), (dbase, dstride, done, runs.rd, do)):
            if one is not None:
                np.add(base[:, None], ids * one, out=out.reshape(shape))
            else:
                affine_rows(base, stride, ids, out.reshape(shape))
        if nb is not None:
            affine_rows(np.zeros(shape[0], np.int64), rows.page, runs.rl, nb.reshape(shape))


class Pieces:
    """Pages x pieces of one region (a fragment table, or pages whose offsets are not linear in the id).

    ``sp`` and ``dp`` are the pages in destination order; the table's pieces are in destination order already."""

    def __init__(self, src: SideColumns, dst: SideColumns, r: int, sp: np.ndarray, dp: np.ndarray,
                 table: tuple[np.ndarray, np.ndarray, np.ndarray]):
        self.so, self.do = src.offsets(r, sp), dst.offsets(r, dp)
        self.table = table
        self.count = len(sp) * len(table[2])
        self.size = int(table[2][0]) if len(table[2]) == 1 else None

    def per_region(self, regs: np.ndarray) -> PerRegion:
        """Pages times pieces in every region of ``regs``; the piece size when the table has one piece per page."""
        return self.count, self.size, None

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write every page's pieces (offsets, and sizes unless ``nb`` is None) into the output columns, page-major."""
        fs, fd, fb = self.table
        shape = (len(self.so), len(fb))
        np.add(self.so[:, None], fs, out=so.reshape(shape))
        np.add(self.do[:, None], fd, out=do.reshape(shape))
        if nb is not None:
            nb.reshape(shape)[:] = fb


def build(cache: LayoutCache, request: Request, strategy: Strategy, options: PlanOptions,
          cap: int | None) -> tuple[Ranges, np.ndarray]:
    """The ranges of ``request`` (canonical order within each call, merged maximally unless ``options.coalesce``
    is off, split at ``options.max_range_bytes``) and the call offsets (calls of at most ``cap`` ranges, cut at
    call groups); run-length columns in frozen arrays. Never raises for a checked request: overlaps are the front
    end's (``request.touch``)."""
    t = cache.unique
    facts = cache.facts(request.direction)
    coalesce = options.coalesce
    sets = request.sets
    if strategy.rows is not None and len(sets) == 1:  # a paged layout: every region takes the same runs
        parts: list[tuple[np.ndarray, Part]] = [(strategy.rows.regs, RowsPart(strategy.rows, sets[0].runs(strategy.joined)))]
        chained = strategy.chained  # regions whose ranges go through the general merge
    else:
        parts, chained = _parts(cache, facts.src, facts.dst, request, strategy, coalesce)
    r = assemble(parts, facts.src, facts.dst, cache.pool)
    cg = strategy.call_group
    # Regions in (call group, destination) order, each in destination order: canonical already when the
    # transfer keeps regions' destinations apart and no buffer is both read and written.
    if request.touch:
        r = sort_canonical(r, cg)
    if coalesce and (strategy.any_chained or chained is not strategy.chained or len(facts.links.a)) and len(r["nbytes"]):
        mergeable = chained | facts.linked(t.nregions, request.top_src, request.top_dst)
        if mergeable.any():
            r = sort_canonical(merge_where(r, mergeable, cg), cg)
    split = split_large(r, options.max_range_bytes)
    r = r if split is r else _frozen_runs(split)  # splitting gives run-length columns new lengths
    if not options.regions_per_call:
        return r, chunk_calls(len(r["nbytes"]), cap)
    return r, calls_by_group(r["region"], cg, cap)


def _parts(cache: LayoutCache, S: SideColumns, D: SideColumns, request: Request, strategy: Strategy,
           coalesce: bool) -> tuple[list[tuple[np.ndarray, Part]], np.ndarray]:
    """The parts of every page set (page runs or pieces), as (regions, part) region-major in the strategy's
    order; and the regions to merge (the strategy's, plus pieces that chain in this transfer)."""
    t = cache.unique
    parts: list[Part] = []  # each region's ranges: parts[part_of[r]] (-1: none)
    part_of = np.full(t.nregions, -1, dtype=np.int64)
    chained = strategy.chained
    for ps in request.sets:
        ws = ps.ws
        made: dict[bool, int] = {}  # one part per runs flavour: regions sharing it assemble as one block
        for sel, joins in ((ws.page_dense, coalesce), (ws.page_sparse, False)):
            if len(sel):
                if joins not in made:
                    made[joins] = len(parts)
                    parts.append(RunsPart(ps.runs(joins), S, D, t.page))
                part_of[sel] = made[joins]
        if ws.piece_regs:
            dp_o, o = ps.dst_order()
            sp_o = ps.src[o]
            part_of[ws.piece_regs] = np.arange(len(parts), len(parts) + len(ws.piece_regs))
            parts += [Pieces(S, D, r, sp_o, dp_o, strategy.tables[r]) for r in ws.piece_regs]
            if len(ws.repeats) and bool(((dp_o[1:] == dp_o[:-1] + 1) & (sp_o[1:] == sp_o[:-1])).any()):
                chained = chained.copy() if chained is strategy.chained else chained
                chained[ws.repeats] = True  # neighbouring destination pages read one source page: pieces chain
    return _consecutive(strategy.order, part_of, parts), chained


def _consecutive(order: np.ndarray, part_of: np.ndarray, parts: list[Part]) -> list[tuple[np.ndarray, Part]]:
    """Regions in ``order`` that have ranges, as (regions, part) with consecutive regions sharing a part joined."""
    regs = order[part_of[order] >= 0]
    ids = part_of[regs]
    if not len(ids):
        return []
    cut = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1], [True])))
    return [(regs[a:b], parts[int(ids[a])]) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]


def assemble(parts: Sequence[tuple[np.ndarray, Part]], src: SideColumns, dst: SideColumns, pool: ColumnPool) -> Ranges:
    """One set of columns from parts (regions as int32 indices, their ranges), region-major in the given
    order: the one assembler. Offsets are written once, in place (pooled ones are then handed on frozen:
    nothing writes them afterwards); buffer and region columns (and ``nbytes`` when each region's ranges share
    one size) stay run-length encoded, in frozen arrays (``kvxfer.planner.frozen``): a plan keeps them.
    ``src``/``dst``: the layout's columns of each side, for the buffers of parts that do not hold them."""
    if not parts:
        return empty_ranges()
    if len(parts) == 1:  # one block of regions (a paged layout's rows): its columns as the part gives them
        regions, p = parts[0]
        count, size, bufs = p.per_region(regions)
        n = len(regions)
        lengths, total = (count, n * int(count[0])) if isinstance(count, np.ndarray) else (filled(count, n), n * count)
        sizes = filled(size, n) if isinstance(size, int) else None if size is None else size if over_bytes(size) else freeze(size)
        sb, db = bufs if bufs is not None else (freeze(src.buf[regions]), freeze(dst.buf[regions]))
        regions = regions if over_bytes(regions) else freeze(regions)
        if total < POOL_MIN and sizes is not None:  # small offset columns (no pool), sizes one per region
            so, do = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
            p.fill(regions, so, do, None)
            return _ranges(sb, db, regions, lengths, sizes, total, so, do, None)
        ends = [total]
    else:
        lengths, sizes, regions = _joined(parts)
        sb, db = freeze(src.buf[regions]), freeze(dst.buf[regions])  # the general route's parts hold none
        total = int(lengths.sum())
        ends = np.cumsum(lengths)[np.cumsum([len(g) for g, _ in parts]) - 1].tolist()
    so, do, nb, so_frozen, do_frozen = _offsets(total, sizes is None, pool)
    at = 0
    for (g, p), end in zip(parts, ends):
        p.fill(g, so[at:end], do[at:end], None if nb is None else nb[at:end])
        at = end
    return _ranges(sb, db, regions, lengths, sizes, total, so if so_frozen is None else so_frozen,
                   do if do_frozen is None else do_frozen, nb)


def _joined(parts: Sequence[tuple[np.ndarray, Part]]) -> tuple[np.ndarray, np.ndarray | None, np.ndarray]:
    """(ranges per region, their size per region or None, the regions) of several parts, frozen: a few numpy
    calls whatever the number of parts (a fragment layout has one part per region)."""
    shapes = [p.per_region(g) for g, p in parts]
    nregs = np.array([len(g) for g, _ in parts], dtype=np.int64)
    counts = np.array([c if isinstance(c, int) else int(c[0]) for c, _, _ in shapes], dtype=np.int64)
    each = [s for _, s, _ in shapes]
    sizes = None
    if all(isinstance(s, int) for s in each):
        sizes = freeze(np.repeat(np.array(each, dtype=np.int64), nregs))
    elif not any(s is None for s in each):
        sizes = freeze(np.concatenate([np.full(len(g), s, dtype=np.int64) if isinstance(s, int) else s
                                       for (g, _), s in zip(parts, each)]))
    return freeze(np.repeat(counts, nregs)), sizes, freeze(np.concatenate([g for g, _ in parts]))


def _offsets(total: int, sized: bool, pool: ColumnPool) -> tuple[np.ndarray, np.ndarray, np.ndarray | None,
                                                                    np.ndarray | None, np.ndarray | None]:
    """The columns to write ``total`` ranges into: source and destination offsets (pooled when large enough,
    with their frozen twins, else fresh and None) and, when ``sized``, their sizes (else None)."""
    if total < POOL_MIN:  # small: fresh arrays (the pool would hand out fresh ones too)
        so, do, so_frozen, do_frozen = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64), None, None
    else:
        (so, so_frozen), (do, do_frozen) = pool.take(total), pool.take(total)  # reused once no plan views them
    return so, do, np.empty(total, dtype=np.int64) if sized else None, so_frozen, do_frozen


def _ranges(sb: np.ndarray, db: np.ndarray, regions: np.ndarray, lengths: np.ndarray, sizes: np.ndarray | None,
            total: int, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> Ranges:
    """The assembled columns: per-region ones run-length encoded over ``lengths`` (``nbytes`` too when sized per
    region), offsets (and ``nb``, when sizes vary) dense."""
    nbytes: np.ndarray | Runs = Runs.of(sizes, lengths, total) if nb is None else nb  # type: ignore[arg-type]
    return {"src_buf": Runs.of(sb, lengths, total), "src_offset": so, "dst_buf": Runs.of(db, lengths, total),
            "dst_offset": do, "nbytes": nbytes, "region": Runs.of(regions, lengths, total)}


def _frozen_runs(r: Ranges) -> Ranges:
    """``r`` with every run-length column's arrays frozen (each array once: columns share their lengths)."""
    seen: dict[int, np.ndarray] = {}

    def held(a: np.ndarray) -> np.ndarray:
        if over_bytes(a):
            return a
        made = seen.get(id(a))
        if made is None:
            made = seen[id(a)] = freeze(a)
        return made

    return {name: Runs.of(held(col.values), held(col.lengths), len(col)) if isinstance(col, Runs) else col
            for name, col in r.items()}


def over_bytes(a: np.ndarray) -> bool:
    """Whether ``a`` is an array straight over an immutable ``bytes`` object: frozen already (numpy cannot make
    it writeable, nor any view of it), as small frozen arrays and ``filled`` ones are."""
    base: object = a.base
    return type(base) is bytes


def filled(value: int, n: int) -> np.ndarray:
    """A frozen int64 array of ``n`` copies of ``value``, made straight into immutable memory (no copy to freeze)."""
    return np.frombuffer(int(value).to_bytes(8, "little", signed=True) * n, dtype=np.int64)

