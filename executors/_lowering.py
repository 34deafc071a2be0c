"""Lowering a plan onto bound memory: each column read once, the values used bounded, bases added.

A plan's content is validated once, by ``TransferPlan.check``: the one validator, whose verdict stays with the
plan (plans from the planner hold by construction). What lowering does on every run is what depends on things
a caller can change after that check:

* Each column is read once, into arrays the executor owns: the runs (value, length) of the buffer, size and
  attribute columns, the call offsets, and the offsets themselves as the addresses (``ADDRESSES``) or offsets
  (``OFFSETS``) the executor goes on to use. A plan's columns are read-only to numpy but not to everyone
  (``torch.from_numpy`` shares a read-only array's memory and writes it), so no value is read twice: the value
  bounded is the value used.
* Exactly those values are bounded, by the plan's own rules (``kvxfer.planner.bounds``, which
  ``TransferPlan.check`` applies to the plan): buffer and attribute indices inside their tables, runs covering
  the ranges, call offsets rising from 0 to the range count, sizes non-empty and below 2^63, every range inside
  its bound buffer's declared size (a wrapped base + offset included); then every buffer read bound and every
  buffer written writable; and the bound owners the plan touches are asked where their memory is
  (``BoundMemory`` probes). Lowering adds only proofs that let it skip the per-range rule (one reduction per run
  where the largest range fits); where a proof fails, the rule itself decides.

A value that fails these bounds on a plan that passed ``check`` was written after the check (or the planner
built a bad plan): the run is refused before anything moves, with a PlanError naming the column, the range and
the value, in the rule's words followed by ``AFTER_CHECK``.

Per run the cost is a few passes over the plan's columns: run-length columns are read as runs (one comparison
per run, not per range); per side, one addition writes the addresses (one 2-D broadcast when every run has the
same length, as when each region has as many ranges) and one or two reductions per run bound them.
"""
from __future__ import annotations

import functools
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvxfer.planner import COLUMNS, Buffer, TransferPlan, bounds

from ._memory import Memory

ADDRESSES, OFFSETS, CHECK = "addresses", "offsets", "check"  # what ``lower`` keeps: addresses, offsets, nothing
LONG_RUN = 8192  # runs at least this long (on average) get their base added per run, without a per-range array
FILL_RUNS = 16  # sizes in at most this many runs are written run by run into a reused array
FRESH_RANGES = 16384  # below this many ranges, sizes go into a fresh array (no page faults at that size)
TWO_THREADS = 1 << 19  # plans of at least this many ranges lower their two sides on two threads (compiled pass)
BLOCK = 1 << 18  # ranges lowered per block on large plans (offsets and addresses of a block stay in cache)
AFTER_CHECK = ("this does not match the plan that was checked: a column was written after the check (a plan's "
               "columns must never be written) or the planner built it wrong")


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


class DescriptorArrays:
    """Reused address and size arrays (uint64) for the descriptors of one plan at a time, which executors that
    hand descriptors to a driver keep: they grow, never shrink. As ``out`` of ``lower``, addresses go into
    ``src``/``dst`` and sizes into ``sizes``; sizes of one value stay written while that value is asked again
    (the plans of one layout share their page size), so a run of a large plan does not write them afresh.
    Not thread-safe: its executor uses it under its lock."""

    def __init__(self) -> None:
        self.src = self.dst = self.sizes = np.zeros(0, dtype=np.uint64)
        self._uniform: tuple[int, int] = (0, 0)  # (value, count): sizes[:count] all hold value

    def reserve(self, n: int) -> DescriptorArrays:
        """Itself, each array at least ``n`` long (reallocated, not copied, when too short)."""
        if len(self.src) < n:
            size = max(n, 2 * len(self.src), 1024)
            self.src, self.dst, self.sizes = (np.empty(size, dtype=np.uint64) for _ in range(3))
            self._uniform = (0, 0)
        return self

    def __getitem__(self, i: int) -> np.ndarray:
        return (self.src, self.dst, self.sizes)[i]

    def __len__(self) -> int:
        return 3

    def fill_sizes(self, values: np.ndarray, lengths: np.ndarray, n: int) -> np.ndarray:
        """``sizes[:n]`` holding the sizes of runs ``values``/``lengths`` (written only where they are not already)."""
        sizes = self.sizes[:n]
        if len(values) == 1:
            v = int(values[0])
            held, count = self._uniform
            if held != v:
                count = 0
            if count < n:
                sizes[count:] = v
                self._uniform = (v, n)
            return sizes
        self._uniform = (0, 0)
        if n < FRESH_RANGES:  # small: a fresh array comes from the allocator's free lists
            return np.repeat(values, lengths)
        _fill(sizes, values, lengths)
        return sizes


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
    add_bounded: Any  # ``_lower_kernel``'s compiled pass, or None (numpy's passes)

    def check_table(self, plan: TransferPlan) -> None:
        """Raise BindingError when the binding is closed or ``plan``'s buffer table is not the bound one."""
        ...

    def last_starts(self, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """(last start offset, the same as an address, fits at all, fits in every buffer) for ``nbytes``."""
        ...

    def private(self, n: int) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """(a uint64 array of ``n`` to write, a call returning it frozen once written): memory the executor owns
        for offsets read once."""
        ...

    def refuse_access(self, buffer: int, write: bool) -> None:
        """Raise BindingError: ``buffer`` is not bound, or is read-only and ``write``."""
        ...

    def buffer_runs(self, src: np.ndarray, dst: np.ndarray, check: Callable[[], None]) -> Any:
        """For buffer runs ``src``/``dst``: an object with ``src_bases``/``dst_bases`` (each run's base) and
        ``repeated(side, length)`` (a side's bases, each repeated ``length`` times), after the owner probes
        (BindingError when one moved); ``check`` runs first the first time a set is seen."""
        ...


def lowering_strategy(lengths: np.ndarray, n: int) -> str:
    """How bases are added to ``n`` offsets that come in runs of ``lengths`` (one buffer per run): ``"long runs"``
    when runs are long (each run's base added in place by a scalar addition, numpy's fastest loop: no per-range
    base array), else ``"grid"`` when every run has one length (rows of a 2-D view: one broadcast addition), else
    ``"repeat"`` (one per-range base array)."""
    rows = len(lengths)
    if rows and n >= LONG_RUN * rows:
        return "long runs"
    if rows and int(lengths[0]) * rows == n and int(np.maximum.reduce(lengths)) == int(lengths[0]):  # max = mean
        return "grid"
    return "repeat"


def lower(plan: TransferPlan, bound: Bounds, mode: str, out: DescriptorArrays | Sequence[np.ndarray] | None = None) -> Lowered:
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
    nb_min, nb_max = bounds.check_sizes(nb_values, nb_lengths, AFTER_CHECK)
    attr_runs = _read_runs(plan, "attr", n, len(plan.attrs))
    src_runs = _read_runs(plan, "src_buf", n, None)
    dst_runs = _read_runs(plan, "dst_buf", n, None)
    found = bound.buffer_runs(src_runs[0], dst_runs[0], lambda: _check_buffers(bound, src_runs, dst_runs))
    sizes_out = out if isinstance(out, DescriptorArrays) else out[2] if out is not None and len(out) > 2 else None
    if nb_min == nb_max:  # one size, in however many runs the column has it
        sizes = _sizes(nb_values[:1], np.array([n], np.int64), n, mode, sizes_out)
    else:
        sizes = _sizes(nb_values, nb_lengths, n, mode, sizes_out)
    last = bound.last_starts(nb_max)
    places = [functools.partial(_place, plan, bound, side, n, runs, found, (nb_values, nb_lengths), last, mode,
                                out[k][:n] if out is not None and mode == ADDRESSES else None)
              for k, (side, runs) in enumerate((("src", src_runs), ("dst", dst_runs)))]
    if mode == ADDRESSES and bound.add_bounded is not None and n >= TWO_THREADS:
        sides = _both(*places)
    else:
        sides = [place() for place in places]
    for a in (co, *src_runs, *dst_runs, *attr_runs, *sides, sizes):
        if a.flags.writeable:
            a.flags.writeable = False
    total = int((nb_values * nb_lengths.astype(np.uint64)).sum(dtype=np.uint64))
    return Lowered(sides[0], sides[1], sizes, src_runs, dst_runs, attr_runs, co, total)


def _both(first: Callable[[], np.ndarray], second: Callable[[], np.ndarray]) -> list[np.ndarray]:
    """``[first(), second()]``, ``first`` on a thread of its own (the compiled pass releases the GIL, so the two
    sides' memory traffic overlaps); an error of ``first`` is raised before one of ``second``, as in turn."""
    box: dict[str, Any] = {}

    def work() -> None:
        try:
            box["value"] = first()
        except BaseException as e:  # handed to the caller, which raises it
            box["error"] = e

    thread = threading.Thread(target=work, name="kvxfer-lower", daemon=True)
    thread.start()
    try:
        value = second()
    finally:
        thread.join()
        if "error" in box:
            raise box["error"]
    return [box["value"], value]


def _call_offsets(plan: TransferPlan, n: int) -> np.ndarray:
    """A copy of the plan's call offsets, bounded: int64, rising strictly from 0 to ``n``."""
    co = np.array(plan.call_offsets)
    bounds.check_call_offsets(co, n, AFTER_CHECK)
    return co


def _read_runs(plan: TransferPlan, name: str, n: int, limit: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Column ``name``'s runs (values of the column's dtype, int64 lengths), copied from the plan and bounded:
    the shape rule (lengths covering ``n`` ranges) and, with ``limit``, the index rule (values in [0, limit))."""
    values, lengths = plan.column_runs(name)  # both are new arrays (fancy indexing and diff copy)
    bounds.check_runs(name, values, lengths, COLUMNS[name], n, AFTER_CHECK)
    if limit is not None:
        bounds.check_indices(name, values, lengths, limit, AFTER_CHECK)
    return values, lengths


def _check_buffers(bound: Bounds, src: Runs, dst: Runs) -> None:
    """Refuse buffer runs with an index outside the bound table (PlanError: the index rule), or that read a buffer
    not bound or write one not writable (BindingError naming it)."""
    limit = len(bound.buffers)
    for name, (values, lengths), usable, write in (("src_buf", src, bound.readable, False),
                                                   ("dst_buf", dst, bound.writable, True)):
        if not len(values):
            continue
        bounds.check_indices(name, values, lengths, limit, AFTER_CHECK)
        ok = usable[values]
        if not ok.all():
            bound.refuse_access(int(values[int(np.argmin(ok))]), write)


def _sizes(values: np.ndarray, lengths: np.ndarray, n: int, mode: str, out: DescriptorArrays | np.ndarray | None) -> np.ndarray:
    """The size of every range, from the runs read (``values``, ``lengths``): a uint64 array (drivers read it as
    memory), written into ``out`` when given; for OFFSETS a single size as a read-only broadcast; for CHECK an
    empty array (nothing is kept)."""
    if mode == CHECK:
        return np.empty(0, np.uint64)
    if mode == OFFSETS and len(values) == 1:
        return np.broadcast_to(np.frombuffer(values[:1].astype(np.uint64).tobytes(), np.uint64), (n,))
    if isinstance(out, DescriptorArrays):
        return out.fill_sizes(values, lengths, n)
    if out is None or n < FRESH_RANGES:  # small: a fresh array comes from the allocator's free lists
        return np.full(n, values[0], np.uint64) if len(values) == 1 else np.repeat(values, lengths)
    sizes = out[:n]  # large: reused memory, never page-faulting afresh
    _fill(sizes, values, lengths)
    return sizes


def _fill(sizes: np.ndarray, values: np.ndarray, lengths: np.ndarray) -> None:
    """Write the runs ``values``/``lengths`` into ``sizes`` (run by run when they are few)."""
    if len(values) == len(sizes):
        np.copyto(sizes, values)
    elif len(values) <= FILL_RUNS:
        at = 0
        for v, m in zip(values.tolist(), lengths.tolist()):
            sizes[at:at + m] = v
            at += m
    else:
        np.copyto(sizes, np.repeat(values, lengths))


Runs = tuple[np.ndarray, np.ndarray]  # (values, int64 lengths) of a column's runs, as read


def _place(plan: TransferPlan, bound: Bounds, side: str, n: int, buffers: Runs, found: Any, sizes: Runs,
           last: tuple[np.ndarray, np.ndarray, np.ndarray, bool], mode: str, out: np.ndarray | None) -> np.ndarray:
    """One side's ``n`` offsets, read once: as addresses (ADDRESSES, into ``out`` when given), as a private copy
    of the offsets (OFFSETS), or bounded where they are and dropped (CHECK: nothing is used afterwards); then
    the values kept are bounded. ``buffers``/``sizes``: the side's buffer runs and the size runs, as read;
    ``found``: ``Bounds.buffer_runs``' answer (each buffer run's base address). Large plans go in blocks of
    whole buffer runs of about BLOCK ranges, each bounded while it is in cache, so the offsets and the addresses
    cross memory once."""
    offs = plan.column(f"{side}_offset")
    bounds.check_dtype(f"{side}_offset", offs, COLUMNS[f"{side}_offset"], AFTER_CHECK)
    bounds.check_length(f"{side}_offset", len(offs), n, AFTER_CHECK)
    if not n:
        return np.zeros(0, np.uint64)
    if mode == ADDRESSES:
        used = out if out is not None else np.empty(n, np.uint64)
    elif mode == OFFSETS:
        used, frozen = bound.private(n)
    else:
        used = offs
    per_range = _PerRange(sizes)
    values, lengths = buffers
    bases = found.src_bases if side == "src" else found.dst_bases
    fused = bound.add_bounded if mode == ADDRESSES else None
    if fused is not None:  # the addition and the per-run bound in one compiled pass (``_lower_kernel``)
        inside = last[3] or bool(np.logical_and.reduce(last[2][values]))  # the largest range fits every buffer
        if not (fused(offs, bases, lengths, last[1][values], used) and inside):
            _exact(bound, side, used, 0, buffers, bases, per_range)
        return used
    for (r0, r1), (lo, hi) in _blocks(lengths, n):
        runs = (values[r0:r1], lengths[r0:r1])
        strategy = lowering_strategy(runs[1], hi - lo)
        if mode == ADDRESSES and strategy == "grid" and (lo, hi) == (0, n):  # one contiguous addition
            np.add(offs, found.repeated(side, int(lengths[0])), out=used)
        elif mode == ADDRESSES:
            _add_bases(offs[lo:hi], bases[r0:r1], runs[1], used[lo:hi], strategy)
        elif mode == OFFSETS:
            np.copyto(used[lo:hi], offs[lo:hi])
        _bound(bound, side, used[lo:hi], lo, runs, bases[r0:r1] if mode == ADDRESSES else None, per_range, last,
               strategy == "grid")
    if mode == OFFSETS:
        return frozen()
    return used if mode == ADDRESSES else np.zeros(0, np.uint64)


def _blocks(lengths: np.ndarray, n: int) -> Iterator[tuple[tuple[int, int], tuple[int, int]]]:
    """((first run, end run), (first range, end range)) of consecutive groups of whole runs of about BLOCK
    ranges each (one group for a plan under BLOCK ranges, or one run longer than BLOCK)."""
    if n <= BLOCK:
        yield (0, len(lengths)), (0, n)
        return
    ends = np.cumsum(lengths)
    cuts = np.unique(np.searchsorted(ends, np.arange(BLOCK, n, BLOCK), side="left") + 1).tolist()
    r0, lo = 0, 0
    for r1 in [c for c in cuts if c < len(lengths)] + [len(lengths)]:
        hi = int(ends[r1 - 1])
        yield (r0, r1), (lo, hi)
        r0, lo = r1, hi


class _PerRange:
    """The size of every range, expanded from its runs only if an exact bound needs it, once."""

    def __init__(self, runs: Runs):
        self.runs = runs
        self._all: np.ndarray | None = None

    def __call__(self, lo: int, hi: int) -> np.ndarray:
        if self._all is None:
            self._all = np.repeat(self.runs[0], self.runs[1])
        return self._all[lo:hi]


def _add_bases(offs: np.ndarray, bases: np.ndarray, lengths: np.ndarray, addr: np.ndarray, strategy: str) -> np.ndarray:
    """``addr`` = each run's base + its offsets (modulo 2^64), reading every offset once, in ``strategy``
    (``lowering_strategy``)."""
    rows = len(lengths)
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


def _bound(bound: Bounds, side: str, used: np.ndarray, first: int, buffers: Runs, bases: np.ndarray | None,
           sizes: _PerRange, last: tuple[np.ndarray, np.ndarray, np.ndarray, bool], grid: bool) -> None:
    """Refuse a range of ``used`` (ranges ``first`` onwards; addresses, with ``bases`` the base of each buffer
    run, else offsets) that is not inside its buffer's declared size, a wrapped sum included (the inside rule,
    ``bounds.check_inside``).

    Buffers come in runs: per run, the largest value at most the last start at which the plan's largest range
    fits proves every range of the run inside (one reduction per run; for offsets, one reduction over all of
    them when that holds for the tightest buffer), and with bases added the smallest address at least the base
    proves no sum wrapped; only where that fails does the rule itself compare every range."""
    values, lengths = buffers
    last_off, last_addr, fits, all_fit = last
    rows = len(values)
    inside = all_fit or bool(np.logical_and.reduce(fits[values]))  # the largest range fits every buffer used
    limit = (last_off if bases is None else last_addr)[values]
    if bases is None and inside and int(np.maximum.reduce(used)) <= bounds.span(limit)[0]:
        return  # offsets: one reduction proves them all inside when the tightest buffer holds the largest
    starts = np.arange(0, len(used), len(used) // rows) if grid else np.cumsum(lengths) - lengths
    ok = np.maximum.reduceat(used, starts) <= limit  # reduceat: faster than a reduction along a 2-D axis
    if bases is not None:  # an offset that wrapped the sum lands below its base
        ok &= np.minimum.reduceat(used, starts) >= bases
    if inside and np.logical_and.reduce(ok):
        return
    _exact(bound, side, used, first, buffers, bases, sizes)


def _exact(bound: Bounds, side: str, used: np.ndarray, first: int, buffers: Runs, bases: np.ndarray | None,
           sizes: _PerRange) -> None:
    """The inside rule itself over every range of ``used`` (as ``_bound``): refuses the first range outside."""
    values, lengths = buffers
    rel = used if bases is None else used - np.repeat(bases, lengths)  # the offsets used, modulo 2^64
    bounds.check_inside(side, rel, sizes(first, first + len(used)), np.repeat(values, lengths), bound.size,
                        [b.name for b in bound.buffers], first, AFTER_CHECK)
