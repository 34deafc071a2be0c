"""The checking front end: a mapping in any form becomes checked page ids per group and side, or one refusal.

Every refusal of a transfer is raised here, worded once, in one order:
1. the mapping's form (``Ids.of``): a ``BlockMapping`` was checked when it was made; a dict of integer numpy
   arrays is borrowed (not copied) and checked in the same order and words (``kvxfer.planner.ids``);
   anything else becomes a ``BlockMapping``. A negative id is always named first: every later refusal goes
   through ``Ids.refuse``, which names one before raising anything else;
2. the target and options (``read_settings``);
3. the groups against the layout, per group: the id lists long enough, every chunk (or block) id inside
   every buffer of the group's regions, the writer settings; then every page each writer set uses inside
   its buffers (``check``);
4. the groups consuming the id lists exactly, then no destination page written twice;
5. and, on the ranges the builder expands (the only refusal that needs them; ``plan_transfer`` calls it on the
   builder's result where the request says regions could touch), no two regions writing one byte and no write
   over bytes the transfer reads (``refuse_overlaps``).

The checked transfer is a ``request.Request`` (page sets per group and writer set), which the builder reads.

Where the ids are the pages (one group of whole pages, one block per chunk on both sides) they are checked on
their runs: the runs give the non-negativity, the largest ids and the repeats almost for free, and the
builder takes the same runs. Nothing is retried elsewhere: the front end's result is what the builder builds.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NoReturn

import numpy as np

from .columns import PageRuns, id_runs, run_holds_negative
from .errors import LayoutError, MappingError, PlanError
from .ids import MAPPING_KEYS, REQUIRED_KEYS, borrow_ids, check_lengths, plain_ints, refuse_negative
from .layout_cache import Group, LayoutCache, RegionTable, Strategy
from .request import IdsAt, PageSet, Request
from .runs import Ranges, dense_all
from .spec import BlockMapping, Direction, Location
from .target import PlanOptions, Target

_DIRECTIONS = {d.value: d for d in Direction}
_DEFAULT_TARGET, _DEFAULT_OPTIONS = Target(), PlanOptions()  # frozen values: built once, not per plan
_INT64_TOP = 1 << 63


class Ids:
    """A mapping's fields in their checked form: direction, int64 id lists, group sizes and starts.

    ``checked`` says whether the ids are known to be non-negative (a BlockMapping's are; borrowed arrays are
    checked on their way, see ``check_negatives``). The arrays must not change while a plan is made."""

    __slots__ = ("direction", "src", "dst", "sizes", "starts", "checked")

    def __init__(self, direction: Direction, src: np.ndarray, dst: np.ndarray, sizes: tuple[int, ...] | None,
                 starts: tuple[int, ...] | None, checked: bool):
        self.direction, self.src, self.dst, self.sizes, self.starts = direction, src, dst, sizes, starts
        self.checked = checked

    @classmethod
    def of(cls, value: Any) -> Ids:
        """The checked fields of ``value``: a BlockMapping, a dict of its fields (integer numpy id arrays are
        borrowed, not copied) or a JSON path. Raises MappingError naming the field, index and value."""
        if isinstance(value, BlockMapping):
            return cls(value.direction, value.src_ids, value.dst_ids, value.group_sizes, value.group_starts, True)
        borrowed = cls._borrow(value) if isinstance(value, dict) else None
        if borrowed is not None:
            return borrowed
        m = BlockMapping.coerce(value, "mapping")
        return cls(m.direction, m.src_ids, m.dst_ids, m.group_sizes, m.group_starts, True)

    @classmethod
    def _borrow(cls, data: dict[str, Any]) -> Ids | None:
        """Integer numpy id arrays, a Direction (or its value) and group lists of non-negative plain integers,
        checked as BlockMapping checks them; None for anything else (BlockMapping then names what is wrong)."""
        if not (data.keys() <= MAPPING_KEYS and REQUIRED_KEYS <= data.keys()):
            return None
        src, dst, direction = data["src_ids"], data["dst_ids"], data["direction"]
        if not (isinstance(src, np.ndarray) and isinstance(dst, np.ndarray) and src.dtype.kind in "iu"
                and dst.dtype.kind in "iu"):
            return None
        if not isinstance(direction, Direction):
            direction = _DIRECTIONS.get(direction) if isinstance(direction, str) else None
            if direction is None:
                return None
        groups = []
        for name in ("group_sizes", "group_starts"):
            v = data.get(name)
            if v is not None:
                v = plain_ints(v)
                if v is None or any(x < 0 for x in v):
                    return None
            groups.append(v)
        ids = cls(direction, borrow_ids(src, "src_ids"), dst, groups[0], groups[1], False)
        try:
            ids.dst = borrow_ids(dst, "dst_ids")
        except MappingError as e:
            ids.dst = np.zeros(0, np.int64)
            ids.refuse(e)
        try:
            check_lengths(ids.src, ids.dst, ids.sizes, ids.starts)
        except MappingError as e:
            ids.refuse(e)
        return ids

    def check_negatives(self) -> None:
        """Refuse a negative id, naming field, value and index (source list first), unless known not to hold any."""
        if not self.checked:
            for field, ids in (("src_ids", self.src), ("dst_ids", self.dst)):
                if len(ids) and int(np.minimum.reduce(ids)) < 0:
                    refuse_negative(ids, field)
            self.checked = True

    def refuse(self, err: PlanError) -> NoReturn:
        """Raise ``err``, or first the refusal of a negative id (named before anything else, in every form)."""
        try:
            self.check_negatives()
            raise err
        finally:
            del err  # no cycle error -> traceback -> this frame: the caller's arrays are freed with the error


def read_settings(ids: Ids, target: Any, options: Any) -> tuple[Target, PlanOptions]:
    """The target and options (models, dicts or JSON paths; None: the defaults). Raises TargetError, after
    naming a negative id first."""
    if type(target) is Target and (options is None or type(options) is PlanOptions):  # models: nothing to read
        return target, _DEFAULT_OPTIONS if options is None else options
    try:
        t = _DEFAULT_TARGET if target is None else Target.coerce(target, "target")
        o = _DEFAULT_OPTIONS if options is None else PlanOptions.coerce(options, "options")
    except PlanError as e:
        ids.refuse(e)
    return t, o


def check(cache: LayoutCache, ids: Ids, strategy: Strategy, coalesce: bool) -> Request:
    """The page pairs of every group and writer set of ``ids`` on ``cache``'s layout, checked (steps 3 and 4 of
    the module docstring). Raises MappingError or LayoutError naming the field, index and value."""
    t = cache.unique
    sizes = ids.sizes if ids.sizes is not None else (len(ids.src),)
    if len(sizes) != t.num_groups:
        ids.refuse(MappingError("group_sizes", list(sizes), f"the layout has {t.num_groups} KV-cache groups"))
    if not t.nregions:  # nothing moves whatever the chunks: a rank whose tensors all map nothing
        ids.check_negatives()
        return Request(ids.direction, [], 0)
    if strategy.ids_are_pages and sizes[0] == len(ids.src) == len(ids.dst):
        request = _check_ids_as_pages(t, ids, strategy, coalesce)
    else:
        starts = ids.starts if ids.starts is not None else (0,) * len(sizes)
        request = _check_groups(cache, ids, strategy, coalesce, sizes, starts)
    request.touch = request.top_dst > strategy.touch_above  # step 5 needs the ranges: whether it must run is known now
    return request


def _check_ids_as_pages(t: RegionTable, ids: Ids, strategy: Strategy, coalesce: bool) -> Request:
    """One group of whole pages with one block per chunk on both sides: the ids are the pages, checked on
    their runs (non-negative, inside every buffer, no destination repeated)."""
    ws = strategy.writer_sets[0][0]  # linear: one set of every region
    s, d = ids.src, ids.dst
    n = len(d)
    if not n:
        return Request(ids.direction, [], 0)
    joined = coalesce and len(ws.page_dense) > 0
    rs, rd, rl = id_runs(s, d, joined)
    if len(rl) == 1:  # one run (a contiguous job): Python integers cannot wrap
        top_s, top_d = int(rs[0]) + n - 1, int(rd[0]) + n - 1
        if not ids.checked and (int(rs[0]) < 0 or int(rd[0]) < 0 or max(top_s, top_d) >= _INT64_TOP):
            ids.check_negatives()
    else:
        last = rl - 1
        last_s, last_d = rs + last, rd + last
        if not ids.checked and (run_holds_negative(rs, last_s) or run_holds_negative(rd, last_d)):
            ids.check_negatives()
        top_s, top_d = int(np.maximum.reduce(last_s)), int(np.maximum.reduce(last_d))
    ids.checked = True  # the runs cover every id
    if top_s > ws.max_src:
        _refuse_past_ids(ids, t, ids.direction.src_side, ws.regs, "src_ids")
    if top_d > ws.max_dst:
        _refuse_past_ids(ids, t, ids.direction.dst_side, ws.regs, "dst_ids")
    runs = PageRuns(rs, rd, rl, n, joined)
    if runs.repeated:
        _refuse_repeated(ids, d, None)
    page = PageSet(ws, s, d, runs=(joined, runs))
    page.top_src, page.top_dst = top_s, top_d
    return Request(ids.direction, [page], n * ws.pieces, top_s, top_d)


def _refuse_past_ids(ids: Ids, t: RegionTable, side: Location, regs: np.ndarray, field: str) -> NoReturn:
    """``_refuse_past`` where the ids are the pages."""
    pages = ids.src if field == "src_ids" else ids.dst
    _refuse_past(ids, t, side, regs, pages, t.side[side].max_page[regs], field, 0)


def _check_groups(cache: LayoutCache, ids: Ids, strategy: Strategy, coalesce: bool, sizes: Sequence[int],
                  starts: Sequence[int]) -> Request:
    """Groups, chunks of k blocks, writer sets: each group's ids become its pages on each side, checked."""
    ids.check_negatives()
    t = cache.unique
    src_side, dst_side = ids.direction.src_side, ids.direction.dst_side
    used_s = used_d = requested = 0
    sets: list[PageSet] = []
    for g, (count, start) in enumerate(zip(sizes, starts)):
        group = cache.groups[g]
        regs = group.regions
        if count == 0 and not len(regs):  # a group with no regions and no ids consumes nothing, whatever its chunks
            continue
        first_s, first_d = used_s, used_d
        sp, used_s = _group_pages(ids, t, group, src_side, "src_ids", ids.src, used_s, count, start, g)
        dp, used_d = _group_pages(ids, t, group, dst_side, "dst_ids", ids.dst, used_d, count, start, g)
        if not len(regs):
            continue
        refusal = strategy.writer_refusals[g]
        if refusal is not None:
            ids.refuse(LayoutError(*refusal))
        for ws in strategy.writer_sets[g]:
            keep = None
            ps, pd = sp, dp
            if ws.writers > 1:  # replicated data: this rank writes only its share of the canonical pages
                keep = dp % ws.writers == ws.rank
                ps, pd = sp[keep], dp[keep]
            requested += len(ps) * ws.pieces
            if not len(ps):
                continue
            at = IdsAt(first_s, first_d, start, count, group.side[src_side].k, group.side[dst_side].k, keep)
            page = PageSet(ws, ps, pd, at)
            page.measure(coalesce)
            if page.top_src > ws.max_src:
                _refuse_past(ids, t, src_side, ws.regs, ps, t.side[src_side].max_page[ws.regs], "src_ids",
                             at.positions(False))
            if page.top_dst > ws.max_dst:
                _refuse_past(ids, t, dst_side, ws.regs, pd, t.side[dst_side].max_page[ws.regs], "dst_ids",
                             at.positions(True))
            sets.append(page)
    for field, id_list, used in (("src_ids", ids.src, used_s), ("dst_ids", ids.dst, used_d)):
        if used != len(id_list):
            ids.refuse(MappingError(field, f"length {len(id_list)}", f"the groups (sizes {list(sizes)}, starts "
                                    f"{list(starts)}) consume {used} ids; the lists must add up exactly"))
    for page in sets:
        if page.repeated(coalesce) and page.ids_at is not None:
            _refuse_repeated(ids, page.dst, page.ids_at.positions(True))
    return Request(ids.direction, sets, requested, max((p.top_src for p in sets), default=-1),
                   max((p.top_dst for p in sets), default=-1))


def _group_pages(ids: Ids, t: RegionTable, group: Group, side: Location, field: str, id_list: np.ndarray, used: int,
                 count: int, start: int, g: int) -> tuple[np.ndarray, int]:
    """The group's pages on one side and the ids consumed after it: chunk c of k pages enumerates pages c*k ..
    c*k + k - 1, and the group's pages are that list from ``start % k`` on, ``count`` long. Refuses a list too
    short, and a chunk whose first page ends past the buffer of a region of the group (bounding every later
    product of ids)."""
    gs = group.side[side]
    if gs.refusal is not None:
        ids.refuse(LayoutError(*gs.refusal))
    k = gs.k
    skip = start % k
    need = -(-(skip + count) // k) if count else 0
    if used + need > len(id_list):
        ids.refuse(MappingError(field, f"length {len(id_list)}", f"group {g} (size {count}, start {start}, {k} blocks "
                                f"per chunk) needs {field}[{used}:{used + need}], past the end of the list"))
    chunks = id_list[used:used + need]
    regs = group.regions
    if need and len(regs) and int(np.maximum.reduce(chunks)) > gs.lowest_chunk:
        _refuse_past(ids, t, side, regs, chunks, t.side[side].chunk_limit[regs], field, used, k, skip)
    return (chunks if k == 1 else np.add.outer(chunks * k, gs.within).ravel()[skip:skip + count]), used + need


def _refuse_past(ids: Ids, t: RegionTable, side: Location, regs: np.ndarray, values: np.ndarray, limits: np.ndarray,
                 field: str, positions: np.ndarray | int, k: int = 1, skip: int = 0) -> NoReturn:
    """Refuse the earliest value past its limit in some region of ``regs`` (``limits`` per region, the smallest
    exceeded), naming the id it came from (``positions[i]``, or ``positions + i``) and the first block of it the
    transfer uses (values are pages, or with ``k`` > 1 chunk ids whose first one skips ``skip`` pages)."""
    i = int(np.argmax(values > limits.min()))
    r = int(regs[np.argmax(limits < values[i])])
    at = positions + i if isinstance(positions, int) else int(positions[i])
    page = int(values[i]) * k + (skip if i == 0 else 0)
    id_list = ids.src if field == "src_ids" else ids.dst
    ids.refuse(MappingError(field, int(id_list[at]), _past(t, side, r, page), at))


def _past(t: RegionTable, side: Location, r: int, page: int) -> str:
    """Why page ``page`` of region ``r`` is refused: past the blocks its placement states (when it states them:
    they fit its buffer, so theirs is the bound), else past its buffer."""
    col = t.side[side]
    name, buf = t.regions[r].name, t.buffers[int(col.buf[r])]
    n, k = int(col.count[r]), int(col.k[r])
    where = f"of region {name!r} ({side} side, buffer {buf.name!r})"
    if n < 0:
        return (f"block of region {name!r} ({side} side) ends at byte {col.page_end(r, page)}, past buffer "
                f"{buf.name!r} of {buf.nbytes} bytes (last block that fits: {int(col.max_page[r])})")
    if k == 1:
        return f"past the {n} blocks {where}"
    if n % k == 0:
        return f"past the {n // k} chunks of {k} blocks {where}"
    return f"its block {page} is past the {n} blocks ({k} per chunk) {where}"


def _refuse_repeated(ids: Ids, pages: np.ndarray, positions: np.ndarray | None) -> NoReturn:
    """Refuse the first destination page that repeats an earlier one, naming the id it came from."""
    first: dict[int, int] = {}
    at = positions.tolist() if positions is not None else range(len(pages))
    for j, v in zip(at, pages.tolist()):
        if v in first:
            ids.refuse(MappingError("dst_ids", int(ids.dst[j]), f"destination block is written twice (also "
                                    f"dst_ids[{first[v]}])", j))
        first[v] = j
    raise AssertionError("no repeated destination page")  # pragma: no cover  (callers found one)


def refuse_overlaps(cache: LayoutCache, request: Request, r: Ranges, call_group: np.ndarray | None = None) -> None:
    """Step 5, where ``request.touch`` says ranges of two regions could overlap: no destination byte written by
    two regions, no destination range over a source range in one buffer.

    ``r``: the ranges built for ``request`` (``build``), in canonical order; with one call group that is
    destination order, so one pass over neighbours finds any overlap (merging joins only ranges that meet end
    to start, so merged ranges overlap where their pieces do). Raises LayoutError naming the region and the
    bytes."""
    t, direction = cache.unique, request.direction
    shared = cache.facts(direction).shared
    d = dense_all(r)
    o: Any = slice(None) if call_group is None or not call_group.any() else np.lexsort((d["dst_offset"], d["dst_buf"]))
    db, do, nb, reg = d["dst_buf"][o], d["dst_offset"][o], d["nbytes"][o], d["region"][o]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        i = int(bad[0])
        ra, rb = int(reg[i]), int(reg[i + 1])
        name = t.buffers[int(db[i])].name
        a, b = t.regions[ra].name, t.regions[rb].name
        raise LayoutError(f"regions[{int(t.origin[rb])}]", b, f"writes bytes at offset {int(do[i + 1])} of buffer "
                          f"{name!r} that region {a!r} also writes")
    for buf in shared:
        sm, dm = d["src_buf"] == buf, np.flatnonzero(d["dst_buf"] == buf)
        if not sm.any() or not len(dm):
            continue
        ss, se = d["src_offset"][sm], d["src_offset"][sm] + d["nbytes"][sm]
        so = np.argsort(ss, kind="stable")
        ss, se = ss[so], np.maximum.accumulate(se[so])  # a long earlier source range covers what follows it
        dst_lo, dst_hi = d["dst_offset"][dm], d["dst_offset"][dm] + d["nbytes"][dm]
        last = np.searchsorted(ss, dst_hi, side="left") - 1  # last source range starting before the destination ends
        hit = (last >= 0) & (se[np.maximum(last, 0)] > dst_lo)
        if hit.any():
            j = int(np.argmax(hit))
            name = t.buffers[buf].name
            region = int(t.origin[int(d["region"][dm[j]])])
            raise LayoutError(f"regions[{region}].{direction.dst_side}", name,
                              f"destination bytes [{int(dst_lo[j])}, {int(dst_hi[j])}) of buffer {name!r} overlap "
                              f"source bytes of the same transfer")
