"""The builder: checked page pairs (``checks.Request``) become a transfer's ranges and call offsets.

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
it and never refuses a transfer of its own: the front end (``checks``) has checked the pages, and the one
check that needs byte ranges (overlaps) is the front end's, called on what is built here.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import numpy as np

from .checks import Request, check_overlaps
from .column_pool import ColumnPool
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
from .layout_cache import LayoutCache, Rows, SideColumns, Strategy
from .runs import Ranges, Runs
from .target import PlanOptions


class Part(Protocol):
    """Ranges of some regions, written straight into the plan's columns when they are assembled."""

    def counts(self, regs: np.ndarray) -> np.ndarray | list[int]:
        """Ranges per region of ``regs``."""

    def uniform_nbytes(self, regs: np.ndarray) -> np.ndarray | list[int] | None:
        """Per region of ``regs``: the one size all its ranges have; None when some region's sizes vary."""

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the ranges of ``regs`` (region-major) into ``so``, ``do`` and, unless None, ``nb``."""


class RunsPart:
    """Page runs applied to regions whose offsets are linear in the page id: each run is one range of its
    length in pages in each region, in destination order."""

    def __init__(self, runs: PageRuns, src: SideColumns, dst: SideColumns, page: np.ndarray):
        self.runs, self.S, self.D, self.page = runs, src, dst, page

    def counts(self, regs: np.ndarray) -> np.ndarray:
        """Ranges per region: the number of runs, the same for every region of ``regs``."""
        return np.full(len(regs), len(self.runs.rs), dtype=np.int64)

    def uniform_nbytes(self, regs: np.ndarray) -> np.ndarray | None:
        """Per region of ``regs``: page bytes times the run length when every run has one length, else None."""
        runs = self.runs
        if not runs.uniform:
            return None
        out: np.ndarray = self.page[regs] * (int(runs.rl[0]) if len(runs.rl) else 0)
        return out

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the runs' offsets (and, unless ``nb`` is None, sizes) for each region of ``regs``, region-major."""
        runs = self.runs
        shape = (len(regs), len(runs.rs))
        S, D = self.S, self.D
        affine_rows(S.base[regs], S.linear_stride[regs], runs.rs, so.reshape(shape))
        affine_rows(D.base[regs], D.linear_stride[regs], runs.rd, do.reshape(shape))
        if nb is not None:
            affine_rows(np.zeros(len(regs), np.int64), self.page[regs], runs.rl, nb.reshape(shape))


class Pieces:
    """Pages x pieces of one region (a fragment table, or pages whose offsets are not linear in the id).

    ``sp`` and ``dp`` are the pages in destination order; the table's pieces are in destination order already."""

    def __init__(self, src: SideColumns, dst: SideColumns, r: int, sp: np.ndarray, dp: np.ndarray,
                 table: tuple[np.ndarray, np.ndarray, np.ndarray]):
        self.so, self.do = src.offsets(r, sp), dst.offsets(r, dp)
        self.table = table
        self.count = len(sp) * len(table[2])
        self.size = int(table[2][0]) if len(table[2]) == 1 else None

    def counts(self, regs: np.ndarray) -> list[int]:
        """Ranges per region: pages times pieces, the same for every region of ``regs``."""
        return [self.count] * len(regs)

    def uniform_nbytes(self, regs: np.ndarray) -> list[int] | None:
        """The piece size per region of ``regs`` when the table has one piece per page, else None."""
        return None if self.size is None else [self.size] * len(regs)

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
    call groups). Raises LayoutError only for overlapping copies (``checks.check_overlaps``)."""
    t = cache.unique
    facts = cache.facts(request.direction)
    coalesce = options.coalesce
    chained = strategy.chained  # regions whose ranges go through the general merge
    sets = request.sets
    if strategy.rows is not None and len(sets) == 1:  # a paged layout: every region takes the same runs
        r = _assemble_rows(strategy.rows, sets[0].runs(strategy.joined), cache.pool)
    else:
        r, chained = _assemble_parts(cache, facts.src, facts.dst, request, strategy, coalesce)
    cg = strategy.call_group
    # Regions in (call group, destination) order, each in destination order: canonical already when the
    # transfer keeps regions' destinations apart and no buffer is both read and written.
    if request.top_dst > facts.disjoint_top or facts.shared:
        r = sort_canonical(r, cg)
        check_overlaps(t, request.direction, facts.shared, r, cg)
    if coalesce and (strategy.any_chained or chained is not strategy.chained or len(facts.links.a)) and len(r["nbytes"]):
        mergeable = chained | facts.linked(t.nregions, request.top_src, request.top_dst)
        if mergeable.any():
            r = sort_canonical(merge_where(r, mergeable, cg), cg)
    r = split_large(r, options.max_range_bytes)
    if not options.regions_per_call:
        return r, chunk_calls(len(r["nbytes"]), cap)
    return r, calls_by_group(r["region"], cg, cap)


def _assemble_parts(cache: LayoutCache, S: SideColumns, D: SideColumns, request: Request, strategy: Strategy,
                    coalesce: bool) -> tuple[Ranges, np.ndarray]:
    """The ranges of every page set, each region's from its part (page runs or pieces), region-major in the
    strategy's order; and the regions to merge (the strategy's, plus pieces that chain in this transfer)."""
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
    return assemble(S, D, _consecutive(strategy.order, part_of, parts), cache.pool), chained


def _consecutive(order: np.ndarray, part_of: np.ndarray, parts: list[Part]) -> list[tuple[np.ndarray, Part]]:
    """Regions in ``order`` that have ranges, as (regions, part) with consecutive regions sharing a part joined."""
    regs = order[part_of[order] >= 0]
    ids = part_of[regs]
    if not len(ids):
        return []
    cut = np.flatnonzero(np.concatenate(([True], ids[1:] != ids[:-1], [True])))
    return [(regs[a:b], parts[int(ids[a])]) for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())]


def assemble(src: SideColumns, dst: SideColumns, parts: Sequence[tuple[np.ndarray, Part]], pool: ColumnPool) -> Ranges:
    """One set of columns from parts (regions, their ranges), region-major in the given order. Offsets are
    written once, in place (pooled ones are then handed on frozen: nothing writes them afterwards); buffer and
    region columns (and ``nbytes`` when each region's ranges share one size) stay run-length encoded."""
    if not parts:
        return empty_ranges()
    regs = np.concatenate([g for g, _ in parts]).astype(np.int32)
    counts = [p.counts(g) for g, p in parts]
    lengths = np.concatenate(counts).astype(np.int64, copy=False)
    sizes = [p.uniform_nbytes(g) for g, p in parts]
    total = int(lengths.sum())
    (so, so_frozen), (do, do_frozen) = pool.take(total), pool.take(total)  # reused once no plan views them
    nb = None if all(s is not None for s in sizes) else np.empty(total, dtype=np.int64)
    ends = np.cumsum(lengths)[np.cumsum([len(g) for g, _ in parts]) - 1].tolist()
    at = 0
    for (g, p), end in zip(parts, ends):
        p.fill(g, so[at:end], do[at:end], None if nb is None else nb[at:end])
        at = end
    nbytes: np.ndarray | Runs = nb if nb is not None else Runs(np.concatenate(sizes), lengths)  # type: ignore[arg-type]
    return {"src_buf": Runs(src.buf[regs], lengths), "src_offset": so if so_frozen is None else so_frozen,
            "dst_buf": Runs(dst.buf[regs], lengths), "dst_offset": do if do_frozen is None else do_frozen,
            "nbytes": nbytes, "region": Runs(regs, lengths)}


def _assemble_rows(rows: Rows, runs: PageRuns, pool: ColumnPool) -> Ranges:
    """The ranges of ``runs`` in every region of ``rows`` (all regions alike), region-major: offsets by one
    broadcast addition per side, other columns run-length encoded."""
    m, n_rows = len(runs.rs), len(rows.regs)
    out = []
    for (base, stride, one), ids in zip((rows.src, rows.dst), (runs.rs, runs.rd)):
        if m == 1:  # one run (a contiguous job): one range per region
            out.append(base + int(ids[0]) * (stride if one is None else one))
            continue
        col, frozen = pool.take(n_rows * m)
        if one is not None:  # one stride for all regions: one product over the ids, one broadcast sum
            np.add(base[:, None], ids * one, out=col.reshape(n_rows, m))
        else:
            affine_rows(base, stride, ids, col.reshape(n_rows, m))
        out.append(col if frozen is None else frozen)
    lengths = rows.single if m == 1 else np.full(n_rows, m, dtype=np.int64)
    n = n_rows * m
    if runs.uniform:
        nbytes: np.ndarray | Runs = Runs.of(rows.page * int(runs.rl[0]), lengths, n)
    else:
        sizes, frozen = pool.take(n)
        affine_rows(np.zeros(n_rows, np.int64), rows.page, runs.rl, sizes.reshape(n_rows, m))
        nbytes = sizes if frozen is None else frozen
    return {"src_buf": Runs.of(rows.src_buf, lengths, n), "src_offset": out[0],
            "dst_buf": Runs.of(rows.dst_buf, lengths, n), "dst_offset": out[1], "nbytes": nbytes,
            "region": Runs.of(rows.regs, lengths, n)}
