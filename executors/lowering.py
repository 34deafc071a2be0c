"""Lowering a plan onto bound memory: each column read once, the values used bounded, bases added.

A plan's content is validated once, by ``TransferPlan.check``: the one validator, whose verdict stays with the
plan (plans from the planner hold by construction). What lowering does on every run is what depends on things
a caller can change after that check:

* Each column is read once, into arrays the executor owns: the runs (value, length) of the buffer, size and
  attribute columns, the call offsets, and the offsets themselves as the addresses (``ADDRESSES``) or offsets
  (``OFFSETS``) the executor goes on to use. A plan's columns are read-only to numpy but not to everyone
  (``torch.from_numpy`` shares a read-only array's memory and writes it), so no value is read twice: the value
  bounded is the value used.
* Exactly those values are bounded: buffer and attribute indices inside their tables, runs covering the ranges,
  call offsets rising from 0 to the range count, sizes non-empty and below 2^63, every range inside its bound
  buffer's declared size (a wrapped base + offset included), every buffer read bound and every buffer written
  writable; and the bound owners the plan touches are asked where their memory is (``BoundMemory`` probes).

A value that fails these bounds on a plan that passed ``check`` was written after the check (or the planner
built a bad plan): the run is refused before anything moves, with a PlanError naming the column, the range and
the value.

Per run the cost is a few passes over the plan's columns: run-length columns are read as runs (one comparison
per run, not per range); per side, one addition writes the addresses (one 2-D broadcast when every run has the
same length, as when each region has as many ranges) and one or two reductions per run bound them.
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvxfer.planner import MAX_RANGE_BYTES, Buffer, PlanError, TransferPlan, freeze

from .memory import Memory

ADDRESSES, OFFSETS, CHECK = "addresses", "offsets", "check"  # what ``lower`` keeps: addresses, offsets, nothing
LONG_RUN = 8192  # runs at least this long (on average) get their base added per run, without a per-range array
FILL_RUNS = 256  # sizes in at most this many runs are written run by run into a reused array
FRESH_RANGES = 16384  # below this many ranges, sizes go into a fresh array (no page faults at that size)
FREEZE_COPY_BYTES = 1 << 16  # offsets below this size are copied straight into bytes (one read, immutable)
AFTER_CHECK = ("does not match the plan that was checked: a column was written after the check (a plan's columns "
               "must never be written) or the planner built it wrong")


@dataclass(frozen=True, eq=False)
class Lowered:
    """One plan's ranges as lowering read and bounded them, each column read from the plan once: what an executor
    uses, instead of reading the plan's columns again. Every array is the executor's (never the plan's) and
    read-only.

    ``src``/``dst``: uint64 absolute addresses (``descriptors``) or offsets within the buffers (``offsets``);
    ``nbytes``: uint64 sizes; ``src_runs``/``dst_runs``: (buffer index, run length) of each run of ranges with
    one buffer; ``attr_runs``: the same for attribute ids; ``call_offsets``: int64, one more than the calls;
    ``total_bytes``: the sum of the sizes. ``memo``: room for an executor to keep what it derives from these
    arrays during one run (every run lowers afresh: nothing read from a plan outlives its run).
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    src_runs: tuple[np.ndarray, np.ndarray]
    dst_runs: tuple[np.ndarray, np.ndarray]
    attr_runs: tuple[np.ndarray, np.ndarray]
    call_offsets: np.ndarray
    total_bytes: int
    memo: dict[str, Any] = field(default_factory=dict, repr=False)

    @property
    def num_ranges(self) -> int:
        """The number of ranges."""
        return int(self.call_offsets[-1])

    @property
    def num_calls(self) -> int:
        """The number of calls."""
        return len(self.call_offsets) - 1

    @property
    def call_sizes(self) -> np.ndarray:
        """Ranges per call (int64)."""
        return np.diff(self.call_offsets)

    def calls(self) -> Iterator[tuple[int, int]]:
        """``(first, end)`` range indices of each call, in order."""
        co = self.call_offsets.tolist()
        return zip(co[:-1], co[1:])

    def call_attrs(self, call: int) -> tuple[np.ndarray, np.ndarray]:
        """For call ``call``: (attribute ids, first descriptor of each within the call), as ``TransferPlan.attr_runs``."""
        lo, hi = int(self.call_offsets[call]), int(self.call_offsets[call + 1])
        values, lengths = self.attr_runs
        ends = np.cumsum(lengths)
        first, last = np.searchsorted(ends, [lo, hi - 1], side="right").tolist()
        ids = values[first:last + 1].astype(np.int64)
        starts = np.maximum(ends[first:last + 1] - lengths[first:last + 1], lo) - lo
        keep = np.concatenate(([True], ids[1:] != ids[:-1])) if len(ids) else np.zeros(0, bool)
        return ids[keep], starts[keep].astype(np.int64)

    def buffer_column(self, side: str) -> np.ndarray:
        """The buffer index (int64) of every range on ``side`` ("src" or "dst")."""
        values, lengths = self.src_runs if side == "src" else self.dst_runs
        return np.repeat(values, lengths)


class Bounds(Protocol):
    """What lowering needs of bound memory (``kvxfer.executors.BoundMemory`` is one): per buffer of the bound
    table, its base address, declared size (0 where unbound), whether it may be read and written; the last
    start offsets at which ranges of a given size fit; and the per-run owner probes."""

    buffers: tuple[Buffer, ...]
    memory: tuple[Memory | None, ...]
    base: np.ndarray
    size: np.ndarray
    readable: np.ndarray
    writable: np.ndarray

    def check_table(self, plan: TransferPlan) -> None:
        """Raise BindingError when the binding is closed or ``plan``'s buffer table is not the bound one."""
        ...

    def last_starts(self, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(last start offset, the same as an address, fits at all, fits in every buffer) for ``nbytes``."""
        ...

    def refuse_access(self, buffer: int, write: bool) -> None:
        """Raise BindingError: ``buffer`` is not bound, or is read-only and ``write``."""
        ...

    def check_owners(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Raise BindingError when a bound owner among buffers ``src``/``dst`` no longer points at its memory."""
        ...


def lowering_strategy(lengths: np.ndarray, n: int) -> str:
    """How bases are added to ``n`` offsets that come in runs of ``lengths`` (one buffer per run): ``"grid"``
    when every run has one length (rows of a 2-D view: one broadcast addition), ``"long runs"`` when runs are
    long (each run's base added in place: no per-range base array), else ``"repeat"`` (one per-range base array)."""
    rows = len(lengths)
    if rows and int(lengths[0]) * rows == n and int(lengths.max()) == int(lengths[0]):  # the largest is the mean
        return "grid"
    return "long runs" if n >= LONG_RUN * rows else "repeat"


def lower(plan: TransferPlan, bound: Bounds, mode: str, out: Sequence[np.ndarray] | None = None) -> Lowered:
    """``plan`` checked (``TransferPlan.check``, once per plan) and lowered onto ``bound``, keeping ``mode``'s
    arrays (ADDRESSES: absolute addresses, written into ``out[0]``/``out[1]`` and sizes into ``out[2]`` when
    given; OFFSETS: offsets within the buffers; CHECK: nothing). Raises PlanError (the plan's check, or a value
    read now that fails its bound) or BindingError (a buffer unbound, read-only where written, or moved)
    before anything is copied."""
    plan.check()
    bound.check_table(plan)
    n = plan.num_ranges
    co = _call_offsets(plan, n)
    nb_values, nb_lengths = _read_runs(plan, "nbytes", n, None)
    nb_values = nb_values.astype(np.uint64, copy=False)
    nb_max = _check_sizes(nb_values, nb_lengths)
    attr_runs = _read_runs(plan, "attr", n, len(plan.attrs))
    src_runs = _read_runs(plan, "src_buf", n, len(bound.buffers))
    dst_runs = _read_runs(plan, "dst_buf", n, len(bound.buffers))
    _check_access(bound, src_runs[0], dst_runs[0])
    bound.check_owners(src_runs[0], dst_runs[0])
    sizes = _sizes(nb_values, nb_lengths, n, mode, out[2] if out is not None and len(out) > 2 else None)
    last = bound.last_starts(nb_max)
    sides = []
    for k, (side, (values, lengths)) in enumerate(zip(("src", "dst"), (src_runs, dst_runs))):
        target = out[k][:n] if out is not None and mode == ADDRESSES else None
        sides.append(_place(plan, bound, side, n, (values, lengths), (nb_values, nb_lengths), last, mode, target))
    for a in (co, *src_runs, *dst_runs, *attr_runs, *sides):
        a.flags.writeable = False
    total = int((nb_values * nb_lengths.astype(np.uint64)).sum(dtype=np.uint64))
    return Lowered(sides[0], sides[1], sizes, src_runs, dst_runs, attr_runs, co, total)


def _tampered(field: str, value: Any, index: int | None = None) -> PlanError:
    return PlanError(field, value, AFTER_CHECK, index)


def _call_offsets(plan: TransferPlan, n: int) -> np.ndarray:
    """A copy of the plan's call offsets, bounded: rising strictly from 0 to ``n``."""
    co = np.array(plan.call_offsets, dtype=np.int64)
    if co.ndim != 1 or len(co) < 2 or co[0] != 0 or co[-1] != n or bool((co[1:] <= co[:-1]).any()):
        if not (len(co) == 1 and n == 0 and co[0] == 0):  # a plan of no ranges has no call
            raise _tampered("call_offsets", co.tolist()[:8])
    return co


def _read_runs(plan: TransferPlan, name: str, n: int, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Column ``name``'s runs (values, int64 lengths), copied from the plan and bounded: positive lengths
    covering ``n`` ranges and, with ``limit``, values in [0, limit)."""
    values, lengths = plan.column_runs(name)  # both are new arrays (fancy indexing and diff copy)
    lengths = lengths.astype(np.int64, copy=False)
    if len(lengths) and (int(lengths.min()) <= 0 or int(lengths.sum()) != n) or (not len(lengths) and n):
        raise _tampered(name, f"runs covering {int(lengths.sum())} ranges of {n}")
    if limit is not None and len(values) and (int(values.min()) < 0 or int(values.max()) >= limit):
        i = int(np.argmax((values < 0) | (values >= limit)))
        raise _tampered(name, int(values[i]), int(lengths[:i].sum()))
    return values, lengths


def _check_sizes(values: np.ndarray, lengths: np.ndarray) -> int:
    """The largest size of the runs ``values``/``lengths``, after refusing an empty range or one of 2^63 bytes or
    more (offset + size cannot wrap once offsets are bounded)."""
    if not len(values):
        return 0
    lo, hi = int(values.min()), int(values.max())
    if lo == 0 or hi >= MAX_RANGE_BYTES:
        j = int(np.argmax((values == 0) | (values >= MAX_RANGE_BYTES)))
        raise _tampered("nbytes", int(values[j]), int(lengths[:j].sum()))
    return hi


def _check_access(bound: Bounds, src: np.ndarray, dst: np.ndarray) -> None:
    """Refuse a run that reads a buffer not bound or writes one not writable (BindingError naming it)."""
    for values, usable, write in ((src, bound.readable, False), (dst, bound.writable, True)):
        ok = usable[values]
        if not ok.all():
            bound.refuse_access(int(values[int(np.argmin(ok))]), write)


def _sizes(values: np.ndarray, lengths: np.ndarray, n: int, mode: str, out: np.ndarray | None) -> np.ndarray:
    """The size of every range, from the runs read (``values``, ``lengths``): a uint64 array (drivers read it as
    memory), written into ``out`` when given; for OFFSETS a single size as a read-only broadcast; for CHECK an
    empty array (nothing is kept)."""
    if mode == CHECK:
        return np.empty(0, np.uint64)
    if mode == OFFSETS and len(values) == 1:
        return np.broadcast_to(np.frombuffer(values[:1].astype(np.uint64).tobytes(), np.uint64), (n,))
    if out is None or n < FRESH_RANGES:  # small: a fresh array comes from the allocator's free lists
        return np.full(n, values[0], np.uint64) if len(values) == 1 else np.repeat(values, lengths)
    sizes = out[:n]  # large: reused memory, never page-faulting afresh
    if len(values) == n:
        np.copyto(sizes, values)
    elif len(values) <= FILL_RUNS:
        at = 0
        for v, m in zip(values.tolist(), lengths.tolist()):
            sizes[at:at + m] = v
            at += m
    else:
        np.copyto(sizes, np.repeat(values, lengths))
    return sizes


Runs = tuple[np.ndarray, np.ndarray]  # (values, int64 lengths) of a column's runs, as read


def _place(plan: TransferPlan, bound: Bounds, side: str, n: int, buffers: Runs, sizes: Runs,
           last: tuple[np.ndarray, np.ndarray, np.ndarray, bool], mode: str, out: np.ndarray | None) -> np.ndarray:
    """One side's ``n`` offsets, read once: as addresses (ADDRESSES, into ``out`` when given), as a private copy
    of the offsets (OFFSETS), or bounded where they are and dropped (CHECK: nothing is used afterwards); then
    the values kept are bounded. ``buffers``/``sizes``: the side's buffer runs and the size runs, as read."""
    offs = plan.column(f"{side}_offset")
    if offs.dtype != np.uint64 or len(offs) != n:
        raise _tampered(f"{side}_offset", f"{offs.dtype} column of {len(offs)}")
    if not n:
        return np.zeros(0, np.uint64)
    if mode == ADDRESSES:
        used = _add_bases(offs, bound.base[buffers[0]], buffers[1], out if out is not None else np.empty(n, np.uint64))
    else:
        used = _private(offs) if mode == OFFSETS else offs
    _bound(bound, side, used, buffers, sizes, last, mode == ADDRESSES)
    return used if mode != CHECK else np.zeros(0, np.uint64)


def _private(col: np.ndarray) -> np.ndarray:
    """A frozen copy of ``col``, read once: small ones straight into ``bytes``, large ones copied and wrapped
    (``kvxfer.planner.frozen``), so no holder of the Lowered can make them writeable."""
    if col.nbytes < FREEZE_COPY_BYTES:
        return np.frombuffer(col.tobytes(), col.dtype)
    return freeze(np.array(col))


def _add_bases(offs: np.ndarray, bases: np.ndarray, lengths: np.ndarray, addr: np.ndarray) -> np.ndarray:
    """``addr`` = each run's base + its offsets (modulo 2^64), reading every offset once."""
    rows = len(lengths)
    strategy = lowering_strategy(lengths, len(addr))
    if strategy == "grid":
        np.add(bases[:, None], offs.reshape(rows, -1), out=addr.reshape(rows, -1))  # scalar-per-row operand first
    elif strategy == "long runs":
        at = 0
        for b, m in zip(bases.tolist(), lengths.tolist()):
            np.add(offs[at:at + m], np.uint64(b), out=addr[at:at + m])
            at += m
    else:
        np.add(offs, np.repeat(bases, lengths), out=addr)
    return addr


def _bound(bound: Bounds, side: str, used: np.ndarray, buffers: Runs, sizes: Runs,
           last: tuple[np.ndarray, np.ndarray, np.ndarray, bool], addresses: bool) -> None:
    """Refuse a range of ``used`` (addresses with ``addresses``, else offsets) that is not inside its buffer's
    declared size, a wrapped sum included.

    Buffers come in runs: per run, the largest value at most the last start at which the plan's largest range
    fits proves every range of the run inside (one reduction per run), and with bases added the smallest
    address at least the base proves no sum wrapped; only where that fails is every range compared exactly."""
    (values, lengths), (nb_values, nb_lengths) = buffers, sizes
    last_off, last_addr, fits, all_fit = last
    n, rows = len(used), len(values)
    if lowering_strategy(lengths, n) == "grid":
        grid = used.reshape(rows, -1)
        ok = grid.max(axis=1) <= (last_addr if addresses else last_off)[values]
        if addresses:
            ok &= grid.min(axis=1) >= bound.base[values]  # an offset that wrapped the sum lands below its base
    else:
        starts = np.cumsum(lengths) - lengths
        ok = np.maximum.reduceat(used, starts) <= (last_addr if addresses else last_off)[values]
        if addresses:
            ok &= np.minimum.reduceat(used, starts) >= bound.base[values]
    if ok.all() and (all_fit or fits[values].all()):
        return
    base_of = np.repeat(bound.base[values] if addresses else np.zeros(rows, np.uint64), lengths)
    rel = used - base_of  # the offset used, modulo 2^64
    lim = np.repeat(bound.size[values], lengths)
    size = np.repeat(nb_values, nb_lengths)
    bad = (rel > lim) | (size > lim - rel)  # the second term is only read where the first is False
    if bad.any():
        i = int(np.argmax(bad))
        b = int(np.repeat(values, lengths)[i])
        raise PlanError(f"{side}_offset", int(rel[i]), f"range of {int(size[i])} bytes runs past buffer "
                        f"{bound.buffers[b].name!r} of {int(bound.size[b])} bytes: this {AFTER_CHECK}", i)
