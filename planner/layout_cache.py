"""LayoutCache: everything planning derives from a layout alone, made once per layout (and per plan setting).

One cache per layout (``Layout.info``), with named fields: the per-region numpy columns of the layout and of
its alias-free view, each KV-cache group's chunk sizes and limits, and per direction (``DirectionFacts``) the
thresholds at which regions could touch, the attribute tables and the strategies. A strategy (``Strategy``)
holds what one plan setting (direction, coalescing, writers, call boundaries) implies: each region's kind, the
writer sets of each group, the region order and, for paged layouts, the gathered rows the builder writes id
runs into. Nothing here depends on one transfer's ids, so the cache stays small.

Threads may plan on one layout at once: a value is only ever added, never replaced under a reader, and two
threads making the same value make equal values.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any, NamedTuple

import numpy as np

from ._model import IntTuple
from .column_pool import ColumnPool
from .columns import merge
from .frozen import freeze
from .spec import Buffer, Direction, Location, Region
from .target import AccessOrder, CopyApi, CopyAttributes, LocationHint, PlanOptions, Target

Table = tuple[np.ndarray, np.ndarray, np.ndarray]  # src piece offsets, dst piece offsets, sizes (dst order)


class Refusal(NamedTuple):
    """A LayoutError's (field, value, reason), kept per layout and made into a fresh error each time it is raised
    (an error object raised again would carry the traceback, and the caller's arrays, of every earlier raise)."""

    field: str
    value: Any
    reason: str



@dataclass(frozen=True)
class SideColumns:
    """One side (device or host) of every region, one entry per region; arrays are read-only."""

    buf: np.ndarray  # int32 buffer index
    base: np.ndarray  # byte offset of block 0
    stride: np.ndarray  # bytes between chunks (blocks when k == 1)
    page: np.ndarray  # page bytes on this side
    k: np.ndarray  # blocks per chunk
    cap: np.ndarray  # the buffer's size
    count: np.ndarray  # the blocks the placement states it holds (-1: not stated, the buffer bounds them)
    max_page: np.ndarray  # last page id inside the placement: its bytes end inside the buffer, below count (-1: none)
    dense: np.ndarray  # stride == k * page: consecutive pages are consecutive bytes
    linear_stride: np.ndarray  # bytes between consecutive page ids where offsets are linear in the page id
    chunk_limit: np.ndarray  # last chunk whose first page is inside the placement (-1: none)

    @classmethod
    def of(cls, buffers: tuple[Buffer, ...], regions: tuple[Region, ...], index: dict[str, int],
           side: Location) -> SideColumns:
        """The columns of ``side`` (host or device placement) for ``regions``; ``index`` maps buffer names to indices. The
        arrays are read-only."""
        places = [r.placement(side) for r in regions]
        buf = np.array([index[p.buffer] for p in places], dtype=np.int32)
        base = np.array([p.byte_offset for p in places], dtype=np.int64)
        stride = np.array([r.stride(side) for r in regions], dtype=np.int64)
        page = np.array([r.side_page(side) for r in regions], dtype=np.int64)
        k = np.array([p.blocks_per_chunk for p in places], dtype=np.int64)
        cap = np.array([buffers[i].nbytes for i in buf.tolist()], dtype=np.int64)
        last_chunk = (cap - base - page) // stride  # the last chunk whose first page fits
        last_in_chunk = np.minimum(k - 1, (cap - base - np.maximum(last_chunk, 0) * stride - page) // page)
        max_page = np.where(last_chunk < 0, -1, last_chunk * k + last_in_chunk)
        count = np.array([-1 if p.num_blocks is None else p.num_blocks for p in places], dtype=np.int64)
        stated = count > 0  # the layout checked that they fit the buffer: the count is the tighter bound
        max_page = np.where(stated, count - 1, max_page)
        last_chunk = np.where(stated, (count - 1) // k, last_chunk)
        dense = stride == page * k
        cols = cls(buf=buf, base=base, stride=stride, page=page, k=k, cap=cap, count=count, max_page=max_page,
                   dense=dense, linear_stride=np.where(k == 1, stride, page), chunk_limit=last_chunk)
        for a in vars(cols).values():
            a.flags.writeable = False
        return cols

    def offsets(self, r: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets of ``pages`` (page ids) of region ``r``."""
        k = int(self.k[r])
        out: np.ndarray = (self.base[r] + pages * self.stride[r] if k == 1
                           else self.base[r] + (pages // k) * self.stride[r] + (pages % k) * self.page[r])
        return out

    def page_end(self, r: int, page: int) -> int:
        """End byte of page ``page`` of region ``r`` (Python integers: no overflow)."""
        k = int(self.k[r])
        return int(self.base[r]) + page // k * int(self.stride[r]) + page % k * int(self.page[r]) + int(self.page[r])


class RegionTable:
    """Per-region numpy columns of a set of regions; pure, made once and then read-only.

    ``origin[i]`` is region i's index in the layout it came from (an alias-free view keeps the first region of
    each set of aliases). ``num_writers`` / ``writer_index`` are -1 where the plan's options decide.
    """

    def __init__(self, buffers: tuple[Buffer, ...], regions: tuple[Region, ...], num_groups: int | None = None,
                 origin: np.ndarray | None = None):
        self.buffers, self.regions = buffers, regions
        self.buffer_index = {b.name: i for i, b in enumerate(buffers)}
        self.nregions = len(regions)
        self.origin = np.arange(self.nregions, dtype=np.int64) if origin is None else origin
        self.names = tuple(r.name for r in regions)
        self.page = np.array([r.page_bytes for r in regions], dtype=np.int64)
        self.group = np.array([r.group for r in regions], dtype=np.int64)
        self.pieces = np.array([max(sum(f.count for f in r.fragments), 1) for r in regions], dtype=np.int64)
        self.num_groups = num_groups if num_groups is not None else int(self.group.max()) + 1 if regions else 1
        self.num_writers = np.array([-1 if r.num_writers is None else r.num_writers for r in regions], dtype=np.int64)
        self.writer_index = np.array([-1 if r.writer_index is None else r.writer_index for r in regions], dtype=np.int64)
        self.sets_writers = bool(np.any((self.num_writers >= 0) | (self.writer_index >= 0)))  # some region does
        self.side = {s: SideColumns.of(buffers, regions, self.buffer_index, s) for s in (Location.DEVICE, Location.HOST)}

    def writers(self, num_writers: int, writer_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Per region: (writers, this rank's index) for stores; the region's own values, else the plan's. One writer
        means every rank writes the region (rank-private), whatever the index."""
        nw = np.where(self.num_writers < 0, num_writers, self.num_writers)
        wi = np.where(nw == 1, 0, np.where(self.writer_index < 0, writer_index, self.writer_index))
        return nw, wi

    def call_group(self, regions_per_call: int | None) -> np.ndarray:
        """Per region: its call group (one per ``regions_per_call`` regions of the original layout; 0 when None)."""
        if not regions_per_call:
            return np.zeros(self.nregions, np.int64)
        return self.origin // regions_per_call

    def last_page_before(self, side: Location, regs: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Per region of ``regs``: the largest page id whose bytes end at or before byte ``limit`` (-1: none).

        Page ends grow with the page id, so ``top <= last_page_before(limit)`` exactly when page ``top`` ends by
        ``limit``: per-transfer extent tests become thresholds made once per layout."""
        c = self.side[side]
        base, stride, page, k = c.base[regs], c.stride[regs], c.page[regs], c.k[regs]
        chunk = (limit - base - page) // stride  # the last chunk whose first page ends by ``limit``
        within = np.minimum(k - 1, (limit - base - np.maximum(chunk, 0) * stride - page) // page)
        out: np.ndarray = np.where(chunk < 0, -1, chunk * k + within)
        return out


@dataclass(frozen=True)
class GroupSide:
    """One KV-cache group on one side: how its ids become pages, and the bound every id must keep."""

    k: int  # blocks per chunk: chunk c holds pages c*k .. c*k + k - 1
    refusal: Refusal | None  # raised when the group's ids must be counted but its regions disagree on k
    lowest_chunk: int  # the smallest chunk limit of the group's regions: chunk ids up to it fit every one
    within: np.ndarray  # 0 .. k - 1: a page's place in its chunk (read-only)


@dataclass(frozen=True)
class Group:
    """One KV-cache group: its regions (indices into the alias-free table) and its two sides."""

    regions: np.ndarray
    side: dict[Location, GroupSide]


def _groups(table: RegionTable) -> tuple[Group, ...]:
    out = []
    for g in range(table.num_groups):
        regs = np.flatnonzero(table.group == g)
        regs.flags.writeable = False
        sides = {}
        for side in (Location.DEVICE, Location.HOST):
            col = table.side[side]
            ks = np.unique(col.k[regs] if len(regs) else col.k)
            refusal: Refusal | None = None
            if len(ks) > 1 and len(regs):
                r = int(regs[np.argmax(col.k[regs] != ks[0])])
                refusal = Refusal(f"regions[{int(table.origin[r])}].{side}.blocks_per_chunk", int(col.k[r]),
                                  f"regions of group {g} must share blocks_per_chunk on the {side} side ({int(ks[0])})")
            elif len(ks) > 1:
                refusal = Refusal("num_groups", table.num_groups, f"group {g} has no regions and the regions disagree "
                                  f"on blocks_per_chunk on the {side} side, so its ids cannot be counted")
            lowest = int(col.chunk_limit[regs].min()) if len(regs) else -1
            k = int(ks[0]) if len(ks) and refusal is None else 1
            within = np.arange(k, dtype=np.int64)
            within.flags.writeable = False
            sides[side] = GroupSide(k, refusal, lowest, within)
        out.append(Group(regs, sides))
    return tuple(out)


class RegionKind(IntEnum):
    """How a region's pages become ranges."""

    PAGE = 0  # whole pages, offsets linear in the page id: id runs give the ranges
    PIECES = 1  # fragments whose table cannot join across pages: pages x pieces are the ranges
    GENERAL = 2  # anything else (padded chunk rows, pieces that chain across pages): expanded, then merged
    REPEATS = 3  # PIECES, except that a piece chains into the next destination page's when both pages read the
    #              same source page: GENERAL for a transfer that repeats a source page there, PIECES otherwise


class WriterSet(NamedTuple):
    """Regions of one group sharing (writers, this rank's index), with what planning needs of them."""

    regs: np.ndarray
    writers: int
    rank: int  # this rank's index among the writers
    pieces: int  # fragment pieces per page, summed over the regions
    page_dense: np.ndarray  # whole-page regions dense on both sides: id runs are byte runs
    page_sparse: np.ndarray  # other whole-page regions: one range per page
    piece_regs: list[int]  # regions whose pages become pieces
    repeats: np.ndarray  # of those, RegionKind.REPEATS
    max_src: int  # the smallest last page that fits, over the regions, on the source side
    max_dst: int  # and on the destination side


@dataclass(frozen=True)
class Rows:
    """All regions in one order as rows of id runs (paged layouts): the regions' columns gathered once, so a
    plan's offsets are one broadcast addition per side. Frozen arrays (``kvxfer.planner.frozen``): plans keep
    ``regs``, the buffers and ``single`` as their run-length columns."""

    regs: np.ndarray  # int32 region indices, in order
    src_buf: np.ndarray
    dst_buf: np.ndarray
    page: np.ndarray
    src: tuple[np.ndarray, np.ndarray, int | None]  # (base, stride, the one stride of all rows or None)
    dst: tuple[np.ndarray, np.ndarray, int | None]
    single: np.ndarray  # run lengths of a one-run job: one range per region
    one_page: int | None  # the page size of every row, when they share one


class Setting(NamedTuple):
    """The plan options a strategy depends on (the rest, caps and flags, apply after building)."""

    coalesce: bool
    num_writers: int
    writer_index: int
    regions_per_call: int | None

    @classmethod
    def of(cls, options: PlanOptions) -> Setting:
        """The setting of ``options``."""
        return cls(options.coalesce, options.num_writers, options.writer_index, options.regions_per_call)


@dataclass(frozen=True)
class Strategy:
    """What one plan setting implies for one direction of a layout: the builder's and the front end's recipe.

    ``linear``: one group, one writer set of every region, whole pages with offsets linear in the page id on
    both sides (a paged layout): the group's pages pair up as id runs and every range is a run in a region.
    ``ids_are_pages``: linear with one block per chunk on both sides, so the ids themselves are the pages.
    ``rows``: for a linear strategy whose regions all take one flavour of runs (``joined``: runs of pages that
    advance together, else one run per page), every region as one block of rows.
    """

    order: np.ndarray  # regions by (call group, destination buffer, base), int32
    call_group: np.ndarray
    kinds: np.ndarray
    tables: list[Table]
    chained: np.ndarray  # regions whose ranges go through the general merge (RegionKind.GENERAL)
    any_chained: bool
    writer_sets: tuple[tuple[WriterSet, ...], ...]  # per group
    writer_refusals: tuple[Refusal | None, ...]  # per group: a LayoutError where a region's writers conflict
    linear: bool
    ids_are_pages: bool
    rows: Rows | None
    joined: bool  # the runs flavour of ``rows``
    touch_above: int  # destination page id past which two regions' ranges could overlap (-1 always: a buffer is
    #                   both read and written, or destinations that meet from the start)


@dataclass(frozen=True)
class Links:
    """Pairs (a, b) of regions sharing their source and their destination buffer, with the smallest largest
    source and destination page ids at which their extents touch on both sides."""

    a: np.ndarray
    b: np.ndarray
    need_src: np.ndarray
    need_dst: np.ndarray


@dataclass(frozen=True)
class Prepared:
    """What one (direction, target, options) implies for a plan: the strategy, the attribute table and each
    region's entry in it, the target's API, the regions' writers for the plan header, the call size cap and,
    for a paged layout, each row's attribute (the run-length column its plans keep)."""

    strategy: Strategy
    attrs: tuple[CopyAttributes, ...]
    region_attr: np.ndarray
    api: CopyApi
    passes_attrs: bool
    region_writers: tuple[tuple[int, int], ...]
    cap: int | None
    rows_attr: np.ndarray | None  # paged layouts without aliases: the attribute of each row (frozen), else None


@dataclass
class DirectionFacts:
    """Per direction of a layout: what regions share, where they could touch, attributes and strategies."""

    src: SideColumns
    dst: SideColumns
    shared: tuple[int, ...]  # buffers some region reads and some region writes (rare; needs overlap checks)
    links: Links
    disjoint_top: int  # destination page id up to which regions' destination extents stay apart
    attrs: dict[int, tuple[tuple[CopyAttributes, ...], np.ndarray]] = field(default_factory=dict)  # per flags
    kinds: dict[bool, tuple[np.ndarray, list[Table]]] = field(default_factory=dict)  # per coalesce
    strategies: dict[Setting, Strategy] = field(default_factory=dict)
    recent: tuple[Target, PlanOptions, Prepared] | None = None  # the last target and options planned with

    def linked(self, nregions: int, top_src: int, top_dst: int) -> np.ndarray:
        """Mask of regions whose ranges might merge with another region's for a transfer whose largest page ids
        are ``top_src`` and ``top_dst``."""
        mask = np.zeros(nregions, dtype=bool)
        if len(self.links.a):
            hit = (self.links.need_src <= top_src) & (self.links.need_dst <= top_dst)
            mask[self.links.a[hit]] = True
            mask[self.links.b[hit]] = True
        return mask


class LayoutCache(RegionTable):
    """The cache of one layout: its region columns (this table), the alias-free view planning works on
    (``unique``), the groups, per direction the facts (made on first use or by ``prepare``), the target APIs
    and the pool for offset columns."""

    def __init__(self, buffers: tuple[Buffer, ...], regions: tuple[Region, ...], num_groups: int | None = None):
        super().__init__(buffers, regions, num_groups)
        first: dict[tuple[Any, ...], int] = {}
        self.alias_of = np.array([first.setdefault(r.alias_key(), i) for i, r in enumerate(regions)], dtype=np.int64)
        # (alias, region it repeats) name pairs, in region order
        self.aliases = tuple((regions[i].name, regions[a].name) for i, a in enumerate(self.alias_of.tolist()) if a != i)
        keep = np.flatnonzero(self.alias_of == np.arange(self.nregions))
        self.unique: RegionTable = self if not self.aliases else RegionTable(
            buffers, _bounded(regions, self.alias_of, keep), self.num_groups, keep)
        self.groups = _groups(self.unique)
        self.chunked = any(bool((c.k > 1).any()) for c in self.side.values())
        self.page_bytes = IntTuple(int(r.page_bytes) for r in regions)  # plans take it without converting it
        self.align_bytes = np.array([b.align_bytes for b in buffers] or [1], dtype=np.uint64)  # see alignment
        self.align_bytes.flags.writeable = False
        self.aligned = bool(np.any(self.align_bytes > 1))  # some buffer declares an alignment: plans are checked
        dev, host = self.unique.side[Location.DEVICE], self.unique.side[Location.HOST]
        # paged: one group, whole pages of one size on both sides, offsets linear in the page id on both sides
        self.paged = self.num_groups == 1 and not any(r.fragments for r in self.unique.regions) and bool(np.all(
            ((dev.k == 1) | dev.dense) & ((host.k == 1) | host.dense) & (dev.page == self.unique.page)
            & (host.page == self.unique.page)))
        self.directions: dict[Direction, DirectionFacts] = {}
        self.apis: dict[tuple[str, int], tuple[CopyApi, bool]] = {}  # (platform, runtime version) -> api, attrs
        self.pool = ColumnPool()  # memory for the offset columns of this layout's plans (see column_pool)

    # ---- per direction and setting ---------------------------------------------------------------------------
    def facts(self, direction: Direction) -> DirectionFacts:
        """The per-direction facts of the alias-free view, made once."""
        made = self.directions.get(direction)
        if made is None:
            made = self.directions.setdefault(direction, _direction_facts(self.unique, direction))
        return made

    def prepared(self, direction: Direction, target: Target, options: PlanOptions) -> Prepared:
        """What ``direction``, ``target`` and ``options`` imply (made once per setting; the last one used is kept
        by identity, so a serving loop planning with the same values pays one comparison)."""
        facts = self.directions.get(direction) or self.facts(direction)
        recent = facts.recent
        if recent is not None and recent[0] is target and recent[1] is options:
            return recent[2]
        strategy = self.strategy(direction, options)
        attrs, region_attr = self.attributes(direction, target, options)
        rows_attr = None if strategy.rows is None or self.unique is not self else freeze(region_attr[strategy.rows.regs])
        made = Prepared(strategy, attrs, region_attr, *self.api(target), self.region_writers(direction, options),
                        options.descriptor_cap(target), rows_attr)
        facts.recent = (target, options, made)
        return made

    def strategy(self, direction: Direction, options: PlanOptions) -> Strategy:
        """The strategy of ``direction`` under ``options``, made once per setting."""
        facts = self.facts(direction)
        key = Setting.of(options)
        made = facts.strategies.get(key)
        if made is None:
            made = facts.strategies.setdefault(key, _strategy(self, facts, direction, key))
        return made

    def attributes(self, direction: Direction, target: Target,
                   options: PlanOptions) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
        """The attribute table and each region's entry in it (location hints follow the region's buffers)."""
        flags = target.flags(options.prefer_overlap_with_compute)
        table = self.facts(direction).attrs
        made = table.get(flags)
        if made is None:
            made = table.setdefault(flags, _attribute_table(self, direction, flags))
        return made

    def api(self, target: Target) -> tuple[CopyApi, bool]:
        """(copy API, whether calls pass attributes) of ``target``."""
        key = (target.platform.value, target.runtime_version)
        made = self.apis.get(key)
        if made is None:
            made = self.apis.setdefault(key, (target.copy_api, target.passes_attrs))
        return made

    def region_writers(self, direction: Direction, options: PlanOptions) -> tuple[tuple[int, int], ...]:
        """Each region's (writers, index) on a store where some region sets its own; () when the options say it all."""
        if direction is Direction.H2D or not self.sets_writers:
            return ()
        nw, wi = self.writers(options.num_writers, options.writer_index)
        return tuple(zip(nw.tolist(), wi.tolist()))

    def prepare(self) -> None:
        """Make both directions' facts and their default strategies now."""
        for direction in Direction:
            self.strategy(direction, PlanOptions())


def _bounded(regions: tuple[Region, ...], alias_of: np.ndarray, keep: np.ndarray) -> tuple[Region, ...]:
    """The first region of each set of aliases, holding on each side the fewest blocks any of them states (a
    plan copies the set once, so its ids must fit every one)."""
    out = []
    for i in keep.tolist():
        region = regions[i]
        for side in (Location.DEVICE, Location.HOST):
            counts = [n for a in np.flatnonzero(alias_of == i).tolist()
                      if (n := regions[a].placement(side).num_blocks) is not None]
            fewest = min(counts, default=None)
            if fewest != region.placement(side).num_blocks:
                place = region.placement(side).model_copy(update={"num_blocks": fewest})
                region = region.model_copy(update={str(side): place})
        out.append(region)
    return tuple(out)


def _direction_facts(t: RegionTable, direction: Direction) -> DirectionFacts:
    S, D = t.side[direction.src_side], t.side[direction.dst_side]
    shared = tuple(np.intersect1d(S.buf, D.buf).tolist())
    return DirectionFacts(S, D, shared, _links(t, direction), _disjoint_top(t, direction))


def _links(t: RegionTable, direction: Direction) -> Links:
    S, D = t.side[direction.src_side], t.side[direction.dst_side]
    key = S.buf.astype(np.int64) * (len(t.buffers) + 1) + D.buf
    o = np.argsort(key, kind="stable")
    k = key[o]
    cut = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1], [True])))
    pairs = [np.stack(np.triu_indices(hi - lo, 1)) + lo for lo, hi in zip(cut[:-1].tolist(), cut[1:].tolist())
             if hi - lo > 1]
    if not pairs:
        empty = np.zeros(0, dtype=np.int64)
        return Links(empty, empty, empty, empty)
    ab = o[np.concatenate(pairs, axis=1)]
    a, b = ab[0], ab[1]
    need = []
    for side, col in ((direction.src_side, S), (direction.dst_side, D)):
        # extent of b reaches a's first byte once b's top passes the last page of b ending before it; and back
        ab_ = t.last_page_before(side, b, col.base[a] - 1) + 1
        ba_ = t.last_page_before(side, a, col.base[b] - 1) + 1
        need.append(np.maximum(ab_, ba_))
    return Links(a, b, need[0], need[1])


def _disjoint_top(t: RegionTable, direction: Direction) -> int:
    """The largest destination page id up to which every two regions' destination extents stay apart (-1:
    never; a very large number: always). Regions sorted by (buffer, base) are apart when each ends before the
    next one in its buffer starts."""
    d = t.side[direction.dst_side]
    o = np.lexsort((d.base, d.buf))
    b, lo = d.buf[o], d.base[o]
    same = np.flatnonzero(b[1:] == b[:-1])
    if not len(same):
        return int(np.iinfo(np.int64).max)
    return int(t.last_page_before(direction.dst_side, o[same], lo[same + 1]).min())


def _strategy(cache: LayoutCache, facts: DirectionFacts, direction: Direction, key: Setting) -> Strategy:
    t = cache.unique
    kinds, tables = facts.kinds.get(key.coalesce) or facts.kinds.setdefault(
        key.coalesce, _classify(t, direction, key.coalesce))
    call_group = t.call_group(key.regions_per_call)
    d = facts.dst
    order = np.lexsort((d.base, d.buf, call_group)).astype(np.int32)  # int32: the plans' region column's type
    split = [_writer_sets(t, facts, g.regions, direction, key, kinds) for g in cache.groups]
    sets = tuple(() if isinstance(x, Refusal) else x for x in split)
    refusals = tuple(x if isinstance(x, Refusal) else None for x in split)
    ws = sets[0][0] if len(sets) == 1 and len(sets[0]) == 1 else None
    linear = cache.paged and ws is not None and ws.writers == 1 and len(ws.regs) == t.nregions
    chained = kinds == RegionKind.GENERAL
    chained.flags.writeable = False
    group = cache.groups[0]
    ids_are_pages = linear and group.side[Location.DEVICE].k == 1 == group.side[Location.HOST].k
    joined = key.coalesce and ws is not None and len(ws.page_dense) > 0
    one_flavour = ws is not None and (len(ws.page_dense) == t.nregions if joined else True)
    rows = _rows(t, facts, order) if linear and one_flavour else None
    return Strategy(order, call_group, kinds, tables, chained, bool(chained.any()), sets, refusals, linear,
                    ids_are_pages, rows, joined, -1 if facts.shared else facts.disjoint_top)


def _rows(t: RegionTable, facts: DirectionFacts, o: np.ndarray) -> Rows:
    """The rows of a paged layout in order ``o``: every array frozen, since plans keep the run-length ones."""
    S, D = facts.src, facts.dst

    def side(c: SideColumns) -> tuple[np.ndarray, np.ndarray, int | None]:
        stride = c.linear_stride[o]
        return freeze(c.base[o]), freeze(stride), int(stride[0]) if len(stride) and bool((stride == stride[0]).all()) else None

    page = t.page[o]
    one_page = int(page[0]) if len(page) and bool((page == page[0]).all()) else None
    return Rows(freeze(o.astype(np.int32)), freeze(S.buf[o]), freeze(D.buf[o]), freeze(page), side(S), side(D),
                freeze(np.ones(len(o), dtype=np.int64)), one_page)


def _fragment_table(t: RegionTable, r: int, direction: Direction) -> Table:
    """(src piece offsets, dst piece offsets, piece sizes) within a page; loads read canonical, write local."""
    reg = t.regions[r]
    if not reg.fragments:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([reg.page_bytes], np.int64)
    local = np.concatenate([f.local_offset + np.arange(f.count) * f.local_stride for f in reg.fragments])
    canon = np.concatenate([f.canonical_offset + np.arange(f.count) * f.canonical_stride for f in reg.fragments])
    size = np.concatenate([np.full(f.count, f.fragment_bytes) for f in reg.fragments]).astype(np.int64)
    return (canon, local, size) if direction is Direction.H2D else (local, canon, size)


def _classify(t: RegionTable, direction: Direction, coalesce: bool) -> tuple[np.ndarray, list[Table]]:
    """Per region: its RegionKind and its fragment table (pieces in destination order; with ``coalesce``
    touching pieces merged first, without it every declared piece kept)."""
    kinds = np.zeros(t.nregions, dtype=np.int64)
    tables = []
    S, D = t.side[direction.src_side], t.side[direction.dst_side]
    for r in range(t.nregions):
        fs, fd, fb = _fragment_table(t, r, direction)
        if coalesce:
            zero = np.zeros(len(fb), np.int32)
            m = merge({"src_buf": zero, "dst_buf": zero, "src_offset": fs, "dst_offset": fd, "nbytes": fb, "region": zero})
            fs, fd, fb = m["src_offset"], m["dst_offset"], m["nbytes"]
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


def _writer_sets(t: RegionTable, facts: DirectionFacts, regs: np.ndarray, direction: Direction, key: Setting,
                 kinds: np.ndarray) -> tuple[WriterSet, ...] | Refusal:
    """The group's regions split by (writers, this rank's index), loads into one set (1, 0); a refusal (a
    LayoutError, raised when the group is planned) where a region's writer index is not below its writers."""
    if not len(regs):
        return ()
    if direction is Direction.H2D:
        split = [(regs, 1, 0)]
    else:
        nw, wi = t.writers(key.num_writers, key.writer_index)
        pairs = np.unique(np.stack((nw[regs], wi[regs]), axis=1), axis=0).tolist()
        for w, x in pairs:
            if x >= w:
                r = int(regs[np.argmax((nw[regs] == w) & (wi[regs] == x))])
                return Refusal(f"regions[{int(t.origin[r])}].writer_index", x,
                               f"must be below num_writers {w} (the region's or the plan's)")
        split = [(regs[(nw[regs] == w) & (wi[regs] == x)], w, x) for w, x in pairs]
    S, D = facts.src, facts.dst
    out = []
    for rs, w, x in split:
        page = rs[kinds[rs] == RegionKind.PAGE]
        dense = S.dense[page] & D.dense[page]
        piece = rs[kinds[rs] != RegionKind.PAGE]
        out.append(WriterSet(rs, w, x, int(t.pieces[rs].sum()), page[dense], page[~dense], piece.tolist(),
                             piece[kinds[piece] == RegionKind.REPEATS],
                             int(S.max_page[rs].min()), int(D.max_page[rs].min())))
    return tuple(out)


def _attribute_table(t: RegionTable, direction: Direction, flags: int) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    order = AccessOrder.ANY if direction is Direction.H2D else AccessOrder.STREAM
    table: dict[CopyAttributes, int] = {}
    idx = np.zeros(max(t.nregions, 1), dtype=np.uint16)
    for i, reg in enumerate(t.regions):
        hints = []
        for side in (direction.src_side, direction.dst_side):
            b = t.buffers[t.buffer_index[reg.placement(side).buffer]]
            hints.append(LocationHint(location=b.location, id=b.device if b.location is Location.DEVICE else 0))
        a = CopyAttributes(src_access_order=order, src_location=hints[0], dst_location=hints[1], flags=flags)
        idx[i] = table.setdefault(a, len(table))
    idx.flags.writeable = False
    return tuple(table), idx
