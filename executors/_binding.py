"""Keeping memory bound: ``bind`` resolves (``_memory``) and checks each buffer of a layout once
and returns a ``BoundMemory``, which holds what owns each memory (``_owners``: the chain of views to the owner,
a tensor's storage with its size fixed where torch allows it, a weak reference that stops numpy resizing an
array, a buffer export that stops a bytearray growing or an mmap closing), refuses a run whose owner moved or
freed the memory (its probes), and lets go of all of it at ``close``.

``BoundMemory.descriptors(plan)`` lowers a plan onto it (``_lowering``): the plan checked once
(``TransferPlan.check``), each of its columns read once, the values used bounded against the bound sizes, and
``(buffer, offset)`` pairs turned into absolute addresses, vectorized, before anything is copied
(``BoundMemory.offsets(plan)``: the same, keeping offsets, for executors that copy through views; ``check``:
the same, keeping nothing).
"""
from __future__ import annotations

import operator
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, ColumnPool, Layout, TransferPlan, freeze

from ._lower_kernel import load as load_add_bounded
from ._lowering import ADDRESSES, CHECK, OFFSETS, DescriptorArrays, Lowered, lower
from ._memory import BindingError, Check, Memory, RawMemory, check_location, describe, resolve
from ._owners import Kept, Probe

OWNER_SETS = 64  # sets of buffer runs whose bases and owner probes a BoundMemory keeps
REPEAT_RANGES = 1 << 18  # bases repeated per range are kept up to this many ranges per side
_VALUE = operator.attrgetter("value")


@dataclass(frozen=True, eq=False)
class BufferRuns:
    """What runs over one set of buffer runs share (``BoundMemory.buffer_runs``): the base address of each run's
    buffer on each side, and the owner probes of those buffers (indices, ctypes fields such as numpy data
    pointers, probe calls, and the values bound: fields' then calls'). ``repeated`` keeps, per side, the bases
    repeated for the last run length asked (a grid of equal runs adds them in one contiguous addition, faster
    than a broadcast)."""

    src_bases: np.ndarray
    dst_bases: np.ndarray
    index: list[int]
    fields: list[Any]
    calls: list[Callable[[], int]]
    want: list[int]
    _repeats: dict[str, tuple[int, np.ndarray]] = field(default_factory=dict)

    def repeated(self, side: str, length: int) -> np.ndarray:
        """``side``'s bases ("src" or "dst"), each repeated ``length`` times (read-only; kept for the last length
        of each side while it fits REPEAT_RANGES)."""
        held = self._repeats.get(side)
        if held is not None and held[0] == length:
            return held[1]
        out = np.repeat(self.src_bases if side == "src" else self.dst_bases, length)
        out.flags.writeable = False
        if len(out) <= REPEAT_RANGES:
            self._repeats[side] = (length, out)  # one assignment: a racing reader sees the old entry or this one
        return out


class BoundMemory:
    """Memory bound once to a table of buffers; ``descriptors(plan)`` turns a plan's ranges into addresses.

    ``buffers`` is the table bound (a Layout's buffers); ``memory[i]`` is buffer i's Memory (None where the
    buffer was not bound). Holds what owns each memory (``Memory.keep``, see ``_owners``), and refuses a run
    (BindingError naming the buffer) when an owner the plan touches moved or freed its memory since bind (its
    probes: a tensor after ``set_`` or ``.data = ...``, an array or the array owning its memory after
    ``__setstate__``, a ctypes buffer after ``ctypes.resize``). ``close()`` runs the
    executor's release hooks (deregistration) once, then lets go of every memory (``memory`` is then all None);
    a closed BoundMemory refuses to lower.

    What stays the same from run to run is found once: buffer tables found equal to the bound one, the probes a
    set of buffers needs, and the last start offsets for the largest range size last asked (a plan keeps its own
    verdict, ``TransferPlan.check``). Nothing read from a plan is kept from one run to the next: a column
    written in between is read, and bounded, as it is then.

    Threads: runs may lower plans on one BoundMemory from several threads (each cache is replaced by one
    assignment, so a racing reader sees an old entry or a new one, both valid); ``close`` must not race them.
    """

    def __init__(self, buffers: tuple[Buffer, ...], memory: tuple[Memory | None, ...], bound_by: str):
        self.buffers, self.memory, self.bound_by = buffers, memory, bound_by
        self.index = {b.name: i for i, b in enumerate(buffers)}
        bound = [m is not None for m in memory]
        self.base = np.array([m.address if m else 0 for m in memory], dtype=np.uint64)
        self.size = np.array([b.nbytes if ok else 0 for b, ok in zip(buffers, bound)], dtype=np.uint64)
        self.writable = np.array([bool(m and m.writable) for m in memory], dtype=bool)
        self.readable = np.array(bound, dtype=bool)
        self.closed = False
        self.add_bounded = load_add_bounded()  # lowering's compiled pass where numba is installed (loaded now)
        self.extra: dict[str, Any] = {}  # executor-specific state made at bind time (registrations)
        self._on_close: list[Callable[[], None]] = []
        self._tables: list[tuple[Buffer, ...]] = [buffers]  # buffer tables already found equal (kept alive)
        self._kept: list[Kept | None] = [m.keep() if m is not None and m.keep is not None else None for m in memory]
        self.held: tuple[Any, ...] = tuple(k.objects if k is not None else m.owner
                                           for m, k in zip(memory, self._kept) if m is not None)
        self._probes: list[tuple[tuple[Probe, int], ...]] = [()] * len(buffers)
        for i, k in enumerate(self._kept):
            if k is not None and k.probes:
                self._probes[i] = tuple((p, p.read()) for p in k.probes)  # read after ``keep``: the memory held
                for p, value in self._probes[i]:
                    if p.want is not None and value != p.want:
                        self._moved(i, p)
        self.probed = np.array([bool(p) for p in self._probes], dtype=bool)
        self._last: tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] | None = None  # see last_starts
        self._buffer_runs: dict[tuple[str, bytes, bytes], BufferRuns] = {}  # see buffer_runs
        self._pool = ColumnPool()  # memory for offsets read once (see private)

    def __repr__(self) -> str:
        if self.closed:
            return f"BoundMemory({len(self.buffers)} buffers, by {self.bound_by}, closed)"
        n = sum(m is not None for m in self.memory)
        return f"BoundMemory({n} of {len(self.buffers)} buffers, by {self.bound_by})"

    def on_close(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` to run on ``close()``; hooks run once, last registered first."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Release what binding made (registrations), then let go of every memory: nothing bound is referred to
        afterwards (the object bound, its views, what owns it, exports: an owner may resize it or close its
        mmap again), and runs with this BoundMemory are refused. Transfers still in flight keep their own
        references to the memory."""
        if self.closed:
            return
        self.closed = True
        try:
            while self._on_close:
                self._on_close.pop()()
        finally:
            for k in self._kept:
                if k is not None:
                    k.release()
            self._kept = [None] * len(self.buffers)
            self.memory = (None,) * len(self.buffers)
            self.held, self.extra = (), {}
            self._probes = [()] * len(self.buffers)
            self._buffer_runs = {}

    def __enter__(self) -> BoundMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def verify(self) -> None:
        """Re-resolve every binding and refuse, naming the buffer, one whose memory moved or changed size since
        bind (a tensor re-allocated or resized), or whose owner moved its memory (every probe read): such memory
        must be bound again. Costs one resolve per buffer; runs check the owners they touch more cheaply (the
        probes alone)."""
        if self.closed:
            raise BindingError(self.bound_by, repr(self), "this BoundMemory was closed; bind again")
        for i, (buf, m) in enumerate(zip(self.buffers, self.memory)):
            if m is None or isinstance(m.owner, (RawMemory, tuple)) or hasattr(m.owner, "__kvxfer_memory__"):
                continue  # memory given by address cannot move
            now = resolve(m.owner, buf.name)
            if (now.address, now.nbytes) != (m.address, m.nbytes):
                raise BindingError(buf.name, f"[{now.address:#x}, +{now.nbytes})",
                                   f"changed since bind (was [{m.address:#x}, +{m.nbytes})); bind it again")
            self._probe(i)

    def owners(self) -> list[Any]:
        """The objects bound (arrays, tensors, ...) and the memory held for them, for keeping them alive while
        copies are in flight: exports of their own for buffers the binding holds by an export, so a buffer stays
        pinned until the copies finish even when the binding is closed first."""
        exports = [memoryview(e.obj) for k in self._kept if k is not None for e in k.exports]
        return [*(m.owner for m in self.memory if m is not None), *self.held, *exports]

    def _probe(self, i: int) -> None:
        """Read every probe of buffer ``i``; BindingError (``_moved``) for the first that changed since bind."""
        for p, value in self._probes[i]:
            if p.read() != value:
                self._moved(i, p)

    def _moved(self, i: int, probe: Probe) -> None:
        """Raise BindingError: ``probe`` of buffer ``i`` changed: its owner moved or freed the memory bound."""
        m = self.memory[i]
        owner = m.owner if m is not None else None
        try:
            now = resolve(owner, self.buffers[i].name)
            where = f"{describe(owner)} at [{now.address:#x}, +{now.nbytes})"
        except BindingError as e:
            where = f"{describe(owner)} ({e.reason})"
        bound = f"[{m.address:#x}, +{m.nbytes})" if m is not None else "?"
        raise BindingError(self.buffers[i].name, where, f"no longer the memory bound, {bound}: {probe.what} changed "
                           "since bind (set_, .data =, __setstate__, a resize or a reallocation); bind it again")

    def buffer_runs(self, src: np.ndarray, dst: np.ndarray, check: Callable[[], None]) -> BufferRuns:
        """What a run needs of the buffers its ranges touch (``src``, ``dst``: the buffer index of each run of ranges
        on each side, as lowering read them), after asking each bound owner among them where its memory is now
        (BindingError naming a buffer whose owner moved). The first time a set is seen, ``check`` (lowering's
        bounds on those indices) runs before anything is looked up; the set's bases and probes are then kept for
        the next runs (a serving loop's plans touch few sets), found again by the indices' bytes."""
        key = (src.dtype.str, src.tobytes(), dst.tobytes())
        entry = self._buffer_runs.get(key)
        if entry is None:
            check()
            entry = BufferRuns(self.base[src], self.base[dst], *self._probes_for(src, dst))
            for a in (entry.src_bases, entry.dst_bases):
                a.flags.writeable = False
            if len(self._buffer_runs) < OWNER_SETS:
                self._buffer_runs[key] = entry  # one assignment: threads that race here store equal entries
        if entry.want and list(map(_VALUE, entry.fields)) + list(map(operator.call, entry.calls)) != entry.want:
            for i in entry.index:
                self._probe(i)
        return entry

    def _probes_for(self, src: np.ndarray, dst: np.ndarray) -> tuple[list[int], list[Any], list[Callable[[], int]], list[int]]:
        """(buffer indices, ctypes fields, probe calls, values bound: fields' then calls') for the owners of
        buffers ``src`` and ``dst`` that have probes."""
        todo = np.zeros(len(self.buffers), dtype=bool)
        todo[src] = True
        todo[dst] = True
        todo &= self.probed
        index = np.flatnonzero(todo).tolist()
        probes = [pv for i in index for pv in self._probes[i]]
        by_field = [(p, v) for p, v in probes if p.field is not None]
        by_call = [(p, v) for p, v in probes if p.field is None]
        return index, [p.field for p, _ in by_field], [p.read for p, _ in by_call], [v for _, v in by_field + by_call]

    def private(self, n: int) -> tuple[np.ndarray, Callable[[], np.ndarray]]:
        """(a uint64 array of ``n`` elements to write, a call returning it frozen once written): memory for
        offsets lowering reads once (``offsets``). Large arrays come from a pool (``kvxfer.planner.ColumnPool``:
        reused once nothing refers to them, so they never page-fault afresh) with a frozen twin; small ones are
        fresh, and frozen by a copy into ``bytes``."""
        arr, twin = self._pool.take(n)
        out = arr.view(np.uint64)
        if twin is None:
            return out, lambda: freeze(out)
        frozen = twin.view(np.uint64)
        return out, lambda: frozen

    def refuse_access(self, buffer: int, write: bool) -> None:
        """Raise BindingError for buffer index ``buffer``: not bound (the plan reads or writes it), or read-only
        (``write``: the plan writes it)."""
        m = self.memory[buffer]
        if m is None:
            raise BindingError(self.buffers[buffer].name, "missing", "not bound, but the plan reads or writes it")
        raise BindingError(self.buffers[buffer].name, describe(m.owner), "read-only, but the plan writes to it")

    def last_starts(self, nbytes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Per buffer: the last start offset at which a range of ``nbytes`` still fits, the same as an address,
        whether it fits at all, and whether it fits in every buffer. A run whose ranges all start at or before
        it is inside, with no range checked alone. Kept for the last size asked (plans of one layout share their
        largest range), keyed by that size."""
        cached = self._last
        if cached is not None and cached[0] == nbytes:
            return cached[1]
        nb = np.uint64(nbytes)
        fits = self.size >= nb
        last_off = np.where(fits, self.size - np.where(fits, nb, np.uint64(0)), 0).astype(np.uint64)
        last_addr = last_off + self.base  # no wrap: a bound memory ends at or below 2^64
        for a in (last_off, last_addr, fits):
            a.flags.writeable = False
        entry = (nbytes, (last_off, last_addr, fits, bool(fits.all())))
        self._last = entry  # one tuple: threads that race here each see a consistent entry
        return entry[1]

    def check_table(self, plan: TransferPlan) -> None:
        """Refuse a closed binding, and a plan whose buffer table differs from the bound one, naming the first
        buffer that differs (a table found equal once is known by identity afterwards)."""
        if self.closed:
            raise BindingError(self.bound_by, repr(self), "this BoundMemory was closed; bind again")
        table = plan.buffers
        if any(table is t for t in self._tables):
            return
        for i in range(max(len(table), len(self.buffers))):
            have = self.buffers[i] if i < len(self.buffers) else None
            want = table[i] if i < len(table) else None
            if have != want:
                name = (want or have).name  # type: ignore[union-attr]
                raise BindingError(name, f"buffer {i} of the plan: {want!r}" if want else "not in the plan",
                                   f"the bound buffer table has {have!r} there; bind the plan's layout")
        self._tables.append(table)

    def descriptors(self, plan: TransferPlan, out: DescriptorArrays | Sequence[np.ndarray] | None = None) -> Lowered:
        """Check ``plan`` (``TransferPlan.check``, once per plan) and return it lowered: absolute uint64 addresses,
        sizes, buffer and attribute runs and call offsets, each read from the plan once and bounded as read
        (see ``Lowered`` and ``_lowering``).

        Refuses, before anything is copied: a closed binding or another buffer table (BindingError); a plan that
        fails its check (PlanError naming column, range and value); a value read now that fails its bound (a
        column written after the check: PlanError naming column, range and value); a buffer read but not bound,
        written but read-only, or whose bound owner no longer points at the bound memory (BindingError naming
        the buffer). Writes the addresses into ``out`` (two uint64 arrays of at least ``plan.num_ranges``; a
        third, when there is one, takes the sizes) when given.
        """
        return lower(plan, self, ADDRESSES, out)

    def offsets(self, plan: TransferPlan) -> Lowered:
        """Every check of ``descriptors``, keeping offsets within the buffers (read once into the executor's own
        frozen arrays) instead of addresses: for executors that copy through views. Sizes of one value come as a
        read-only broadcast."""
        return lower(plan, self, OFFSETS)

    def lower(self, plan: TransferPlan,
              out: DescriptorArrays | Sequence[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``descriptors(plan, out)``'s (src, dst) addresses (uint64 arrays; views of ``out`` when given)."""
        low = lower(plan, self, ADDRESSES, out)
        return low.src, low.dst

    def check(self, plan: TransferPlan) -> None:
        """Every check of ``descriptors``, keeping nothing (the offsets are bounded where they are)."""
        lower(plan, self, CHECK)

def hold_for_stream(bound: BoundMemory, stream: int) -> bool:
    """Tell torch's caching allocator that the CUDA tensors bound in ``bound`` are used by copies on ``stream``
    (a raw handle): memory freed while copies queued there are pending (a resize of a storage, whose size torch
    cannot fix on a GPU) is then reused only after them. Nothing for other memory. Returns whether torch was
    told: from then on torch records an event on ``stream`` whenever such memory is freed, so the stream must
    outlive it (DmaExecutor.close then leaves the stream to the process)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    told = False
    for m in bound.memory:
        owner = m.owner if m is not None else None
        if isinstance(owner, torch.Tensor) and owner.device.type == "cuda" and owner.numel():
            alias = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(owner.untyped_storage())
            alias.record_stream(torch.cuda.ExternalStream(stream, device=owner.device))
            told = True
    return told


def _buffers_of(buffers: Layout | TransferPlan | Iterable[Buffer]) -> tuple[Buffer, ...]:
    found: Iterable[Any] = buffers.buffers if isinstance(buffers, (Layout, TransferPlan)) else buffers
    table = found if isinstance(found, tuple) else tuple(found)
    for i, b in enumerate(table):
        if not isinstance(b, Buffer):
            raise BindingError(f"buffers[{i}]", type(b).__name__, "expected a kvxfer.planner.Buffer")
    return table


def bind(buffers: Layout | TransferPlan | Sequence[Buffer], bindings: Mapping[str, Any], *, check: Check = check_location,
         required: Iterable[int] | None = None, bound_by: str = "executor") -> BoundMemory:
    """Resolve and check each buffer's binding once.

    ``buffers``: a Layout (or plan) or its buffers. ``bindings``: buffer name -> memory. Every buffer in
    ``required`` (default: all) must be bound; others are bound when present. Each memory must be at least
    its buffer's size and pass ``check`` (location, pinning, ...). Read-only memory is recorded and refused
    at run time only where a plan writes to it. Raises BindingError naming the buffer.
    """
    if not isinstance(bindings, Mapping):
        raise BindingError("bindings", type(bindings).__name__, "expected a mapping of buffer name -> memory")
    table = _buffers_of(buffers)
    need = set(range(len(table))) if required is None else set(required)
    memory: list[Memory | None] = []
    for i, buf in enumerate(table):
        if buf.name not in bindings:
            if i in need:
                raise BindingError(buf.name, "missing", f"the plan reads or writes this buffer (known: {sorted(bindings)})")
            memory.append(None)
            continue
        m = resolve(bindings[buf.name], buf.name)
        if m.nbytes < buf.nbytes:
            raise BindingError(buf.name, f"{m.nbytes} bytes", f"smaller than the plan's buffer of {buf.nbytes} bytes")
        check(buf, m)
        memory.append(m)
    return BoundMemory(table, tuple(memory), bound_by)


def plan_buffers(plan: TransferPlan) -> set[int]:
    """Indices of the buffers a plan reads or writes."""
    return set(plan.buffers_used("src").tolist()) | set(plan.buffers_used("dst").tolist())
