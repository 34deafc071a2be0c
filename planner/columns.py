"""Column operations of planning: page-id runs, take, concat, merge, split, canonical order and call chunking.

Everything here works on ``Ranges`` (a dict of columns, dense arrays or ``Runs``) or on id arrays, with numpy;
nothing loops over ranges in Python, and nothing knows a layout: the checking front end (``checks``) and the
builder (``build``) pass in what they read from the layout's cache. Work grows with block pairs and output
ranges; a loop over regions appears only over blocks of regions that differ in stride (``affine_rows``).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .runs import DenseRanges, Ranges, Runs, dense, dense_all, runs_of

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

    Differences of non-negative int64 ids cannot overflow; for unchecked ids see ``run_holds_negative``."""
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


def run_holds_negative(first: np.ndarray, last: np.ndarray) -> bool:
    """Whether runs from ``first`` to ``last`` ids (each run's last id computed as ``first + length - 1`` in
    int64) hold a negative id, for ids not yet checked.

    Every id lies in its run between the first and the last id, so both non-negative proves every id
    non-negative. A run can only hide a negative id by wrapping past the int64 maximum, and then its last
    id, computed the same way, is negative too."""
    return bool(len(first)) and int(np.minimum.reduce(np.bitwise_or(first, last))) < 0  # sign bit of either


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


def packed_limit(n: int) -> int:
    """The documented id limit of ``sort_by``'s packed key for ``n`` ids: ids below it (and non-negative) sort
    as ``id << bits | position`` in an int64, ``bits`` being the bit length of ``n - 1`` (at least 1)."""
    return 1 << (62 - max(n - 1, 1).bit_length())


def sort_by(d: np.ndarray, s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``d`` sorted, and ``s`` in the same order. Equal ``d`` keep their order (a repeated destination is
    an error found later, named by its first repeat in the caller's order).

    Non-negative ids below ``packed_limit(len(d))`` are sorted as one packed key ``d << bits | position`` (a
    value sort, about three times faster than an index sort); others take a stable index sort."""
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


# ---- pages to byte ranges ---------------------------------------------------------------------------------
class PageRuns:
    """Runs of page pairs (src page, dst page, length) in destination order, where both pages advance together:
    run i copies pages ``rs[i] .. rs[i] + rl[i] - 1`` to ``rd[i] .. rd[i] + rl[i] - 1``. Made from pages checked
    to fit their buffers (so ``rd + rl`` cannot wrap); ``pairs`` is the number of page pairs."""

    __slots__ = ("rs", "rd", "rl", "singles", "uniform")

    def __init__(self, rs: np.ndarray, rd: np.ndarray, rl: np.ndarray, pairs: int, coalesce: bool):
        self.rs, self.rd, self.rl = order_runs(rs, rd, rl, coalesce)
        self.singles = len(self.rl) == pairs  # every run one page long
        self.uniform = self.singles or len(self.rl) == 1 or bool((self.rl == self.rl[0]).all())

    @property
    def repeated(self) -> bool:
        """Whether some destination page repeats (runs are in destination order: a repeat overlaps the next run)."""
        return len(self.rd) > 1 and bool((self.rd[:-1] + self.rl[:-1] > self.rd[1:]).any())


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
