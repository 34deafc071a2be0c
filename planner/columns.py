"""Column operations shared by both planning paths: page-id runs, expansion of pages to byte ranges, take,
concat, merge, split, canonical order, call chunking, block-fits checks and overlap checks.

Everything here works on ``Ranges`` (a dict of columns, dense arrays or ``Runs``) with numpy; nothing loops
over ranges in Python. Work grows with block pairs and output ranges; a loop over regions appears only over
blocks of regions that differ in stride (``affine_rows``) or on an error path that names the culprit.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from .errors import LayoutError, MappingError
from .layout_info import LayoutInfo, SideColumns
from .plan import CopyAttributes, LocationHint
from .runs import DenseRanges, Ranges, Runs, dense, dense_all, runs_of
from .spec import Direction, Location, refuse_negative
from .target import AccessOrder, PlanOptions, Target

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
    """Runs (src id, dst id, length) where both ids advance by one, in the order of the lists (see
    ``order_runs`` for destination order). Without ``coalesce`` every pair is a run of one.

    Differences of non-negative int64 ids cannot overflow; for unchecked ids see ``check_runs``."""
    n = len(d)
    if not coalesce or n < 2:
        return s, d, np.ones(n, dtype=np.int64)
    if (int(d[-1]) - int(d[0]) == n - 1 and int(s[-1]) - int(s[0]) == n - 1 and bool((d[1:] > d[:-1]).all())
            and bool((s[1:] > s[:-1]).all())):  # one run (a contiguous job): n - 1 rising steps that add up to
        return s[:1], d[:1], np.array([n], dtype=np.int64)  # n - 1 are all steps of one
    step = d[1:] - d[:-1]
    brk = step != 1  # one pass per side, arrays reused: this runs on every plan
    brk |= np.subtract(s[1:], s[:-1], out=step) != 1
    cut = brk.nonzero()[0]
    if len(cut) == n - 1:  # no two pairs run on: every pair is its own run
        return s, d, np.ones(n, dtype=np.int64)
    if not len(cut):  # one run (a contiguous job)
        return s[:1], d[:1], np.array([n], dtype=np.int64)
    starts = np.empty(len(cut) + 1, dtype=np.int64)
    starts[0] = 0
    np.add(cut, 1, out=starts[1:])
    lengths = np.empty_like(starts)
    np.subtract(starts[1:], starts[:-1], out=lengths[:-1])
    lengths[-1] = n - starts[-1]
    return s[starts], d[starts], lengths


def check_runs(rs: np.ndarray, rl: np.ndarray, ids: np.ndarray, field: str) -> np.ndarray:
    """Refuse negative ids (MappingError naming the first), checked on the runs of unchecked ids; return
    each run's last id.

    Every id lies in its run between the first and the last id, so both non-negative proves the list
    non-negative. A run can only hide a negative id by wrapping past the int64 maximum, and then its last
    id, computed the same way, is negative too."""
    last: np.ndarray = rs + (rl - 1)
    if len(rs) and int(np.bitwise_or(rs, last).min()) < 0:  # sign bit of either
        refuse_negative(ids, field)
    return last


def order_runs(rs: np.ndarray, rd: np.ndarray, rl: np.ndarray,
               coalesce: bool = True) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs in destination order, runs that continue each other joined unless ``coalesce`` is off (ids
    checked to fit: no overflow).

    Ids listed in destination order (the common case) are recognised in one pass over the runs; a
    descending list is reversed; anything else is sorted, and runs that meet after sorting are joined."""
    if len(rd) < 2 or bool((rd[1:] >= rd[:-1] + rl[:-1]).all()):
        return rs, rd, rl
    if bool((rd[1:] < rd[:-1]).all()):
        rs, rd, rl = rs[::-1], rd[::-1], rl[::-1]
    else:
        rd, o = sort_by(rd, np.arange(len(rd)))
        rs, rl = rs[o], rl[o]
    if not coalesce:
        return rs, rd, rl
    ends = rd + rl
    link = (ends[:-1] == rd[1:]) & (rs[:-1] + rl[:-1] == rs[1:])
    if not link.any():
        return rs, rd, rl
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    return rs[starts], rd[starts], np.add.reduceat(rl, starts)


def sort_by(d: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``d`` sorted, and ``s`` in the same order. Equal ``d`` keep their order (a repeated destination is
    an error found later, named by its first repeat in the caller's order).

    Non-negative ids that leave room for the position are sorted as one packed key ``d << bits | position``
    (a value sort, about three times faster than an index sort); others take a stable index sort."""
    n = len(d)
    bits = max(n - 1, 1).bit_length()
    if n and int(d.min()) >= 0 and int(d.max()) < 1 << (62 - bits):
        key = np.left_shift(d, bits)
        key |= np.arange(n, dtype=np.int64)
        key.sort()
        o = key & ((1 << bits) - 1)
        key >>= bits
        return key, s[o]
    o = np.argsort(d, kind="stable")
    return d[o], s[o]


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
        lowest = col.lowest_max_page
        if top is not None and top <= lowest:  # the common case, first: no arrays made
            return
        regs = np.arange(info.nregions)
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

    def __init__(self, info: LayoutInfo, direction: Direction, sp: np.ndarray, dp: np.ndarray, coalesce: bool,
                 check_ids: bool = False):
        """``check_ids``: ``sp`` and ``dp`` are the mapping's ``src_ids`` and ``dst_ids``, not yet known to be
        non-negative: they are checked here, on the runs, and ``top_s`` / ``top_d`` (the largest ids, -1
        otherwise) are set for the caller's fit check, which comes before anything else uses them."""
        self.S, self.D, self.page = info.side[direction.src_side], info.side[direction.dst_side], info.page
        rs, rd, rl = id_runs(sp, dp, coalesce)
        self.top_s = self.top_d = -1
        if check_ids and len(rl) == 1:  # one run (a contiguous job): Python integers cannot wrap
            first_s, first_d, n = int(rs[0]), int(rd[0]), int(rl[0])
            if first_s < 0 or first_s + n > 1 << 63:
                check_runs(rs, rl, sp, "src_ids")
            if first_d < 0 or first_d + n > 1 << 63:
                check_runs(rd, rl, dp, "dst_ids")
            self.top_s, self.top_d = first_s + n - 1, first_d + n - 1
        elif check_ids and len(rl):
            self.top_s = int(check_runs(rs, rl, sp, "src_ids").max())
            self.top_d = int(check_runs(rd, rl, dp, "dst_ids").max())
        if max(self.top_s, self.top_d) >= (1 << 63) - 1:  # fits no buffer (under 2^63 bytes): the
            self.rs, self.rd, self.rl = rs, rd, rl  # fit check refuses it; ordering (id + length) could wrap
            self.singles, self.uniform = False, False
            return
        self.rs, self.rd, self.rl = order_runs(rs, rd, rl, coalesce)
        self.singles = len(self.rl) == len(sp)  # every run one page long
        self.uniform = self.singles or len(self.rl) == 1 or bool((self.rl == self.rl[0]).all())

    @property
    def repeated(self) -> bool:
        """Whether some destination page repeats (runs are sorted by destination; ids checked to fit first)."""
        return len(self.rd) > 1 and bool((self.rd[:-1] + self.rl[:-1] > self.rd[1:]).any())

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
        S, D = self.S, self.D
        affine_rows(S.base[regs], S.linear_stride[regs], self.rs, so.reshape(shape))
        affine_rows(D.base[regs], D.linear_stride[regs], self.rd, do.reshape(shape))
        if nb is not None:
            affine_rows(np.zeros(len(regs), np.int64), self.page[regs], self.rl, nb.reshape(shape))


def affine_rows(base: np.ndarray, stride: np.ndarray, ids: np.ndarray, out: np.ndarray) -> None:
    """``out[i, j] = base[i] + stride[i] * ids[j]``.

    Products are taken over ``ids`` once per distinct stride (int64 multiplication has no SIMD form on most
    x86 CPUs, so a product per output element would cost several times an addition); each block of rows
    sharing a stride then takes one broadcast addition (scalar-per-row operand first: numpy's fast loop)."""
    if not len(stride):
        return
    cut = np.flatnonzero(stride[1:] != stride[:-1])
    if not len(cut):
        np.add(base[:, None], ids * stride[0], out=out)
        return
    bounds = [0, *(cut + 1).tolist(), len(stride)]
    products: dict[int, np.ndarray] = {}
    for a, b in zip(bounds[:-1], bounds[1:]):
        u = int(stride[a])
        p = products.get(u)
        if p is None:
            p = products[u] = ids * u
        np.add(base[a:b, None], p, out=out[a:b])


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
    so, do = info.pool.empty(total), info.pool.empty(total)  # reused once no plan views them (see scratch)
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
    if not n:
        return np.zeros(1, np.int64)
    if cap is None or n <= cap:
        return np.array((0, n), dtype=np.int64)
    return np.append(np.arange(0, n, cap, dtype=np.int64), n)


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
