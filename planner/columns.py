"""Column operations shared by both planning paths: page-id runs, expansion of pages to byte ranges, take,
concat, merge, split, canonical order, call chunking, block-fits checks and overlap checks.

Everything here works on ``Ranges`` (a dict of columns, dense arrays or ``Runs``) with numpy; nothing loops
over ranges in Python. Work grows with block pairs and output ranges; a loop over regions appears only where
it keeps a large region's rows in cache (``ROW_WISE_MIN``) or on an error path that names the culprit.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .errors import LayoutError, MappingError
from .layout_info import LayoutInfo, SideColumns
from .plan import CopyAttributes, LocationHint
from .runs import DenseRanges, Ranges, Runs, dense, dense_all, runs_of
from .spec import Direction, Location
from .target import AccessOrder, PlanOptions, Target

ROW_WISE_MIN = 2048  # ranges per region from which offsets are computed row by row (cache-resident)
INT_COLUMNS = ("src_buf", "dst_buf", "region")


def empty_ranges() -> DenseRanges:
    """A column set with no ranges (int64 offsets and sizes, int32 buffer and region ids)."""
    r = {k: np.zeros(0, dtype=np.int64) for k in ("src_offset", "dst_offset", "nbytes")}
    return r | {k: np.zeros(0, dtype=np.int32) for k in INT_COLUMNS}


def take(r: Ranges, sel: Any) -> DenseRanges:
    """The ranges ``sel`` (an index, mask or slice) of ``r``, every column dense."""
    return {k: dense(v)[sel] for k, v in r.items()}


def concat(parts: Sequence[Ranges]) -> DenseRanges:
    """The column sets ``parts`` one after another, every column dense (``parts`` must not be empty)."""
    return {k: np.concatenate([dense(p[k]) for p in parts]) for k in parts[0]}


# ---- page ids ---------------------------------------------------------------------------------------------
def id_runs(s: np.ndarray, d: np.ndarray, coalesce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs (src id, dst id, length) where both ids advance by one, sorted by dst id.

    Destination ids are distinct (repeats are found by ``PageRuns.repeated``), so the only possible successor
    of a pair (s, d) is the pair with destination d+1, which sits right after it in destination order.
    Ascending and descending destinations are recognised in O(n) and not sorted.
    """
    if len(d) < 2:
        return s, d, np.ones(len(s), dtype=np.int64)
    step = d[1:] - d[:-1]
    if int(step.min()) < 0:  # not ascending (rare in practice): sort, or reverse a descending list
        o = slice(None, None, -1) if int(step.max()) < 0 else np.argsort(d, kind="stable")
        s, d = s[o], d[o]
        step = d[1:] - d[:-1]
    if not coalesce:
        return s, d, np.ones(len(s), dtype=np.int64)
    brk = step != 1  # one pass per side, arrays reused: this runs on every plan
    brk |= np.subtract(s[1:], s[:-1], out=step) != 1
    starts = np.empty(1 + int(np.count_nonzero(brk)), dtype=np.int64)
    starts[0] = 0
    starts[1:] = np.flatnonzero(brk)
    starts[1:] += 1
    ends = np.empty_like(starts)
    ends[:-1] = starts[1:]
    ends[-1] = len(s)
    return s[starts], d[starts], ends - starts


def raise_repeated_id(dst_ids: np.ndarray) -> None:
    """Raise MappingError naming the first destination id that repeats an earlier one (slow path, errors only)."""
    first: dict[int, int] = {}
    for j, v in enumerate(dst_ids.tolist()):
        if v in first:
            raise MappingError("dst_ids", v, f"destination block is written twice (also dst_ids[{first[v]}])", j)
        first[v] = j


def check_pages_fit(info: LayoutInfo, side: Location, regs: np.ndarray | None, pages: np.ndarray,
                    index: np.ndarray | None, ids: np.ndarray, field: str, top: int | None = None) -> None:
    """Every page of every region in ``regs`` (None: all) must end inside its buffer. Page ends grow with the
    page id, so the largest page decides (``top``: ``pages.max()`` where the caller has it already);
    ``index[i]`` (default i) is the position in ``ids`` of page i."""
    col = info.side[side]
    if regs is None:
        regs = np.arange(info.nregions)
        lowest = col.lowest_max_page
    else:
        lowest = int(col.max_page[regs].min()) if len(regs) else 0
    if not len(pages) or not len(regs):
        return
    limit = col.max_page[regs]
    top = int(pages.max()) if top is None else top
    if top <= lowest:
        return
    r = int(regs[np.argmax(limit < top)])
    i = int(np.argmax(pages > col.max_page[r]))
    at = i if index is None else int(index[i])
    buf = info.buffers[int(col.buf[r])]
    raise MappingError(field, int(ids[at]), f"block of region {info.regions[r].name!r} ({side} side) ends at byte "
                       f"{col.page_end(r, int(pages[i]))}, past buffer {buf.name!r} of {buf.nbytes} bytes "
                       f"(last block that fits: {int(col.max_page[r])})", at)


# ---- pages to byte ranges ---------------------------------------------------------------------------------
class Part(Protocol):
    """Ranges of some regions, written straight into the plan's columns when they are assembled."""

    def counts(self, regs: np.ndarray) -> np.ndarray | list[int]:
        """Ranges per region of ``regs``."""

    def uniform_nbytes(self, regs: np.ndarray) -> np.ndarray | list[int] | None:
        """Per region of ``regs``: the one size all its ranges have; None when some region's sizes vary."""

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the ranges of ``regs`` (region-major) into ``so``, ``do`` and, unless None, ``nb``."""


class PageRuns:
    """Runs of page ids (src, dst, length) applied to regions whose offsets are linear in the page id: each
    run is one range of ``length`` pages in each region, in destination order."""

    def __init__(self, info: LayoutInfo, direction: Direction, sp: np.ndarray, dp: np.ndarray, coalesce: bool):
        self.S, self.D, self.page = info.side[direction.src_side], info.side[direction.dst_side], info.page
        self.rs, self.rd, self.rl = id_runs(sp, dp, coalesce)
        self.uniform = len(self.rl) == 0 or bool(np.all(self.rl == self.rl[0]))

    @property
    def repeated(self) -> bool:
        """Whether some destination page repeats (runs are sorted by destination)."""
        return bool(np.any(self.rd[:-1] + self.rl[:-1] > self.rd[1:]))

    def counts(self, regs: np.ndarray) -> np.ndarray:
        """Ranges per region: the number of runs, the same for every region of ``regs``."""
        return np.full(len(regs), len(self.rs), dtype=np.int64)

    def uniform_nbytes(self, regs: np.ndarray) -> np.ndarray | None:
        """Per region of ``regs``: page bytes times the run length when every run has one length, else None."""
        if not self.uniform:
            return None
        out: np.ndarray = self.page[regs] * (int(self.rl[0]) if len(self.rl) else 0)
        return out

    def fill(self, regs: np.ndarray, so: np.ndarray, do: np.ndarray, nb: np.ndarray | None) -> None:
        """Write the runs' offsets (and, unless ``nb`` is None, sizes) for each region of ``regs``, region-major."""
        shape = (len(regs), len(self.rs))
        so2, do2 = so.reshape(shape), do.reshape(shape)
        S, D = self.S, self.D
        if shape[1] < ROW_WISE_MIN:
            np.multiply(S.linear_stride[regs][:, None], self.rs, out=so2)
            so2 += S.base[regs][:, None]
            np.multiply(D.linear_stride[regs][:, None], self.rd, out=do2)
            do2 += D.base[regs][:, None]
        else:
            for i, r in enumerate(regs.tolist()):  # a loop over regions, not ranges: each row stays in cache
                np.multiply(self.rs, S.linear_stride[r], out=so2[i])
                so2[i] += S.base[r]
                np.multiply(self.rd, D.linear_stride[r], out=do2[i])
                do2[i] += D.base[r]
        if nb is not None:
            np.multiply(self.page[regs][:, None], self.rl, out=nb.reshape(shape))


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


def assemble(info: LayoutInfo, direction: Direction, parts: Sequence[tuple[np.ndarray, Part]]) -> Ranges:
    """One set of columns from parts (regions, their ranges), region-major in the given order. Offsets are
    written once, in place; buffer and region columns (and ``nbytes`` when each region's ranges share one
    size) stay run-length encoded."""
    if not parts:
        return empty_ranges()
    regs = np.concatenate([g for g, _ in parts]).astype(np.int32)
    counts = [p.counts(g) for g, p in parts]
    lengths = np.concatenate(counts).astype(np.int64, copy=False)
    sizes = [p.uniform_nbytes(g) for g, p in parts]
    total = int(lengths.sum())
    so, do = np.empty(total, dtype=np.int64), np.empty(total, dtype=np.int64)
    nb = None if all(s is not None for s in sizes) else np.empty(total, dtype=np.int64)
    ends = np.cumsum(lengths)[np.cumsum([len(g) for g, _ in parts]) - 1].tolist()
    at = 0
    for (g, p), end in zip(parts, ends):
        p.fill(g, so[at:end], do[at:end], None if nb is None else nb[at:end])
        at = end
    nbytes: np.ndarray | Runs = nb if nb is not None else Runs(np.concatenate(sizes), lengths)  # type: ignore[arg-type]
    return {"src_buf": Runs(info.side[direction.src_side].buf[regs], lengths), "src_offset": so,
            "dst_buf": Runs(info.side[direction.dst_side].buf[regs], lengths), "dst_offset": do,
            "nbytes": nbytes, "region": Runs(regs, lengths)}


# ---- merging, splitting, order ----------------------------------------------------------------------------
def merge(r: Ranges, key: np.ndarray | None = None) -> DenseRanges:
    """General maximal merge of byte ranges: same buffers, contiguous on both sides.

    Two ranges chain only if they share (``key``, src buffer, dst buffer, dst - src); within that class the
    destinations are disjoint, so each range has at most one successor and sorting by destination
    offset finds every chain. Region of a merged range = region of its first byte.
    """
    d = dense_all(r)
    if len(d["nbytes"]) < 2:
        return d
    diag = d["dst_offset"] - d["src_offset"]
    key = np.zeros(len(diag), dtype=np.int64) if key is None else key
    o = np.lexsort((d["dst_offset"], diag, d["dst_buf"], d["src_buf"], key))
    d = take(d, o)
    diag, key = diag[o], key[o]
    do, nb = d["dst_offset"], d["nbytes"]
    link = ((d["src_buf"][1:] == d["src_buf"][:-1]) & (d["dst_buf"][1:] == d["dst_buf"][:-1])
            & (diag[1:] == diag[:-1]) & (do[:-1] + nb[:-1] == do[1:]) & (key[1:] == key[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    out = take(d, starts)
    out["nbytes"] = np.add.reduceat(nb, starts)
    return out


def merge_where(r: Ranges, mergeable: np.ndarray, call_group: np.ndarray) -> Ranges:
    """Merge the ranges of the regions marked ``mergeable`` (within call groups); others stay as they are.
    The result needs sorting into canonical order."""
    d = dense_all(r)
    m = mergeable[d["region"]]
    if not m.any():
        return r
    merged = merge(take(d, m), call_group[d["region"][m]])
    return concat([take(d, ~m), merged])


def split_large(r: Ranges, cap: int | None) -> Ranges:
    """Cut ranges longer than ``cap`` bytes into cap-sized pieces plus a remainder, in place order.

    Run-length columns stay run-length (their runs grow by the pieces added); offsets are written once."""
    nb = r["nbytes"]
    if cap is None or len(nb) == 0 or int(runs_of(nb)[0].max()) <= cap:
        return r
    values = runs_of(nb)[0]
    if len(np.unique(-(-values // cap))) == 1:
        return _split_uniform(r, cap, int(-(-values[0] // cap)))
    nbd = dense(nb)
    pieces = -(-nbd // cap)
    ends = np.cumsum(pieces)
    k = np.arange(int(ends[-1]), dtype=np.int64)  # piece index within its range, times cap
    k -= np.repeat(ends - pieces, pieces)
    k *= cap
    out: dict[str, np.ndarray | Runs] = {}
    for name, col in r.items():
        if isinstance(col, Runs):
            new_ends = ends[np.cumsum(col.lengths) - 1] if len(col.lengths) else col.lengths
            out[name] = Runs(col.values, np.diff(new_ends, prepend=0))
        else:
            out[name] = np.repeat(col, pieces)
    for name in ("src_offset", "dst_offset"):
        col = out[name]
        out[name] = dense(col) + k if isinstance(col, Runs) else np.add(col, k, out=col)
    size = np.repeat(nbd, pieces)
    size -= k
    out["nbytes"] = np.minimum(size, cap, out=size)
    return out


def _split_uniform(r: Ranges, cap: int, pieces: int) -> Ranges:
    """``split_large`` where every range becomes ``pieces`` pieces: broadcasts, no per-piece index arrays."""
    step = np.arange(pieces, dtype=np.int64) * cap
    out: dict[str, np.ndarray | Runs] = {}
    for name, col in r.items():
        out[name] = Runs(col.values, col.lengths * pieces) if isinstance(col, Runs) else np.repeat(col, pieces)
    for name in ("src_offset", "dst_offset"):
        offsets = dense(out[name])
        offsets.reshape(-1, pieces)[:] += step
        out[name] = offsets
    nb = r["nbytes"]
    if isinstance(nb, Runs) and not np.any(nb.values % cap):
        out["nbytes"] = Runs(np.full(len(nb.values), cap, dtype=np.int64), nb.lengths * pieces)
    else:
        size = np.repeat(dense(nb), pieces).reshape(-1, pieces)
        size -= step
        out["nbytes"] = np.minimum(size, cap, out=size).ravel()
    return out


def in_canonical_order(r: Ranges, call_group: np.ndarray | None = None) -> bool:
    """Whether ``r`` is already sorted by (call group of its region, when ``call_group`` marks any, destination buffer,
    destination offset)."""
    d = dense_all({k: r[k] for k in ("dst_buf", "dst_offset", "region")})
    db, do = d["dst_buf"], d["dst_offset"]
    up = (db[1:] > db[:-1]) | ((db[1:] == db[:-1]) & (do[1:] >= do[:-1]))
    if call_group is not None and call_group.any():
        cg = call_group[d["region"]]
        up = (cg[1:] > cg[:-1]) | ((cg[1:] == cg[:-1]) & up)
    return bool(up.all())


def sort_canonical(r: Ranges, call_group: np.ndarray | None = None) -> Ranges:
    """Sort by (call group, destination buffer, destination offset), skipping the sort when already in order."""
    if len(r["nbytes"]) < 2 or in_canonical_order(r, call_group):
        return r
    d = dense_all(r)
    keys = [d["dst_offset"], d["dst_buf"]]
    if call_group is not None and call_group.any():
        keys.append(call_group[d["region"]])
    return take(d, np.lexsort(keys))


def chunk_calls(n: int, cap: int | None) -> np.ndarray:
    """Call offsets cutting ``n`` ranges into calls of at most ``cap`` (None: one call; no ranges: no calls)."""
    return np.append(np.arange(0, n, cap or max(n, 1), dtype=np.int64), n) if n else np.zeros(1, np.int64)


def calls_by_group(region: Runs | np.ndarray, call_group: np.ndarray, cap: int | None) -> np.ndarray:
    """Calls end where the call group changes and every ``cap`` ranges within a group (ranges are grouped by
    call group already). Reads the region column's runs only."""
    values, lengths = runs_of(region)
    n = int(lengths.sum())
    if n == 0:
        return chunk_calls(0, cap)
    cg = call_group[values]
    first = np.concatenate(([True], cg[1:] != cg[:-1]))
    ends = np.cumsum(lengths)
    bounds = np.append((ends - lengths)[first], n)
    out = [chunk_calls(b - a, cap)[:-1] + a for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    return np.append(np.concatenate(out), n)


# ---- overlap checks ---------------------------------------------------------------------------------------
def check_overlaps(info: LayoutInfo, direction: Direction, r: Ranges, dst_ids: np.ndarray | None,
                   call_group: np.ndarray | None = None) -> None:
    """No destination byte written twice; no range reading bytes another range writes in the same buffer.

    ``r`` is in canonical order; with one call group that is destination order, so one pass over neighbours
    finds any overlap. ``dst_ids``, when given, lets a region's repeated page be named by its repeated id.
    """
    d = dense_all(r)
    o: Any = slice(None) if call_group is None or not call_group.any() else np.lexsort((d["dst_offset"], d["dst_buf"]))
    db, do, nb, reg = d["dst_buf"][o], d["dst_offset"][o], d["nbytes"][o], d["region"][o]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        i = int(bad[0])
        ra, rb = int(reg[i]), int(reg[i + 1])
        name = info.buffers[int(db[i])].name
        a, b = info.regions[ra].name, info.regions[rb].name
        if ra == rb and dst_ids is not None:
            raise_repeated_id(dst_ids)
        if ra == rb:
            raise MappingError("dst_ids", f"{name}[{int(do[i + 1])}:{int(do[i + 1] + nb[i + 1])}]",
                               f"destination bytes of region {b!r} are written twice")
        raise LayoutError(f"regions[{int(info.origin[rb])}]", b, f"writes bytes at offset {int(do[i + 1])} of buffer "
                          f"{name!r} that region {a!r} also writes")
    check_reads_vs_writes(info, direction, d)


def check_reads_vs_writes(info: LayoutInfo, direction: Direction, r: DenseRanges) -> None:
    """In a buffer that is both read and written, no destination range may overlap any source range."""
    for b in info.shared_buffers(direction):
        sm, dm = r["src_buf"] == b, np.flatnonzero(r["dst_buf"] == b)
        if not sm.any() or not len(dm):
            continue
        ss, se = r["src_offset"][sm], r["src_offset"][sm] + r["nbytes"][sm]
        o = np.argsort(ss, kind="stable")
        ss, se = ss[o], np.maximum.accumulate(se[o])
        do, de = r["dst_offset"][dm], r["dst_offset"][dm] + r["nbytes"][dm]
        k = np.searchsorted(ss, de, side="left") - 1  # last source range starting before the destination ends
        hit = (k >= 0) & (se[np.maximum(k, 0)] > do)
        if hit.any():
            j = int(np.argmax(hit))
            name = info.buffers[b].name
            region = int(info.origin[int(r["region"][dm[j]])])
            raise LayoutError(f"regions[{region}].{direction.dst_side}", name,
                              f"destination bytes [{int(do[j])}, {int(de[j])}) of buffer {name!r} overlap "
                              f"source bytes of the same transfer")


# ---- attributes -------------------------------------------------------------------------------------------
def attributes(info: LayoutInfo, direction: Direction, target: Target,
               options: PlanOptions) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    """The attribute table and each region's entry in it (location hints follow the region's buffers)."""
    flags = target.flags(options.prefer_overlap_with_compute)
    return info.cached(("attrs", direction.value, flags), lambda: _attribute_table(info, direction, flags))


def _attribute_table(info: LayoutInfo, direction: Direction, flags: int) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    order = AccessOrder.ANY if direction is Direction.H2D else AccessOrder.STREAM
    table: dict[CopyAttributes, int] = {}
    idx = np.zeros(max(info.nregions, 1), dtype=np.uint16)
    for i, reg in enumerate(info.regions):
        hints = []
        for side in (direction.src_side, direction.dst_side):
            b = info.buffers[info.buffer_index[reg.placement(side).buffer]]
            hints.append(LocationHint(location=b.location, id=b.device if b.location is Location.DEVICE else 0))
        a = CopyAttributes(src_access_order=order, src_location=hints[0], dst_location=hints[1], flags=flags)
        idx[i] = table.setdefault(a, len(table))
    idx.flags.writeable = False
    return tuple(table), idx
