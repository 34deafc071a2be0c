"""Binding buffer names to memory: the one place bindings are resolved and checked, for every executor.

``resolve`` turns one binding (numpy array, torch tensor, ``__cuda_array_interface__`` object, RawMemory or
``(address, nbytes)`` pair) into a ``Memory``. ``bind`` resolves and checks each buffer of a layout once and
returns a ``BoundMemory``, which keeps the memory itself alive (for a torch tensor its storage, whose size is
then fixed where torch allows it) and refuses a run whose bound object no longer points at the bound memory.
``BoundMemory.descriptors(plan)`` then checks every range of a plan against the bound sizes and turns
``(buffer, offset)`` pairs into absolute addresses, vectorized, before anything is copied
(``BoundMemory.offsets(plan)``: the same checks, keeping offsets, for executors that copy through views).

Each column of the plan is read once: sizes, buffer runs, attribute runs and call offsets are copied, and the
offsets are read only by the addition that writes the addresses into arrays the executor owns. The bounds are
then checked on those arrays, so the values checked are the values the executor uses, even if a caller
changes a plan's columns meanwhile. Offsets handed on as offsets (``offsets``, ``check``) are the plan's
own columns where they are frozen (``kvxfer.planner.is_frozen``: no holder can write them), as a plan's
columns are, and a copy otherwise.

Per run the cost is a few passes over the plan's columns: buffer and size columns are read as runs (one
comparison per run, not per range); per side, one addition writes the addresses (one 2-D broadcast when every
run has the same length, as when each region has as many ranges) and one reduction per bound bounds every
run's addresses; the bound objects the plan touches are asked where they point (one attribute read each).
"""
from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location, PlanError, TransferPlan, is_frozen

U64 = 1 << 64
MAX_OFFSET = 1 << 63  # buffers and ranges above this could wrap uint64 sums; none is that large
PAGE_BYTES = 4096  # the smallest page size of the platforms supported: a header on the data's page is mapped
LONG_RUN = 8192  # runs at least this long (on average) get their base added per run, without a per-range array


class BindingError(ValueError):
    """A binding does not fit the plan: missing, too small, not contiguous, or read-only where written."""

    def __init__(self, buffer: str, value: Any, reason: str):
        self.buffer, self.value, self.reason = buffer, value, reason
        super().__init__(f"bindings[{buffer!r}] = {value}: {reason}")


def describe(obj: Any) -> str:
    """A short description of a binding for messages: its type and shape."""
    shape = getattr(obj, "shape", None)
    return f"{type(obj).__name__}{tuple(shape) if shape is not None else ''}"


@dataclass(frozen=True)
class RawMemory:
    """Memory given by address: ``nbytes`` bytes at ``address``. ``location`` None means unknown (not checked)."""

    address: int
    nbytes: int
    location: Location | None = None
    device: int | None = None
    pinned: bool | None = None
    readonly: bool = False


@dataclass(frozen=True)
class Memory:
    """One binding resolved: absolute address, size, where it lives (None = unknown), and its owner.

    ``view`` makes a flat uint8 numpy view for host memory numpy can reach (arrays, CPU tensors), else None;
    it is only called by executors that copy with numpy. ``hold`` is called once by ``bind``: it returns what
    keeps the memory itself alive while bound (a tensor's storage; for a CPU tensor it also fixes the
    storage's size, as ``Tensor.numpy()`` does), whatever later happens to the owner. ``probe`` is one cheap
    call whose value changes when the owner no longer points at the memory (a tensor's ``data_ptr``, an array's
    size), so each run can refuse an owner that moved; ``bind`` records its value. Memory given by address
    (RawMemory, pairs, ``__cuda_array_interface__``, remote buffers) has neither: it cannot move.
    """

    address: int
    nbytes: int
    location: Location | None
    device: int | None
    pinned: bool | None
    writable: bool
    owner: Any = field(repr=False, default=None)
    view: Callable[[], np.ndarray] | None = field(repr=False, default=None, compare=False)
    file_offsets: bool = False  # ``address`` is an offset in a file (0 is valid), not a pointer
    hold: Callable[[], Any] | None = field(repr=False, default=None, compare=False)
    probe: Callable[[], int] | None = field(repr=False, default=None, compare=False)


def _read_memory(address: int, nbytes: int) -> bytes | None:
    """``nbytes`` bytes of this process's memory at ``address``, or None where any of them is unmapped.

    Read through /proc/self/mem, which fails with an error (EIO) on an unmapped page instead of faulting."""
    try:
        fd = os.open("/proc/self/mem", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        data = os.pread(fd, nbytes, address)
    except OSError:
        return None
    finally:
        os.close(fd)
    return data if len(data) == nbytes else None


def _over_immutable_bytes(address: int, nbytes: int) -> bool:
    """Whether ``address`` is the start of a ``bytes`` object's data (torch.frombuffer over bytes does this).

    CPython lays a bytes object out as its object header (refcount, type), size, hash, then the data: the
    type and size are read from just before ``address``. A header on the data's own page is mapped and read
    directly; one on the page before is read through /proc/self/mem, which cannot fault (an unmapped page there
    means no bytes object)."""
    header = bytes.__basicsize__ - bytes.__itemsize__  # the data starts after the header (the last byte is NUL)
    start = address - header + object.__basicsize__ - 8  # ob_type ends the object header; ob_size follows it
    if start < 0:
        return False
    raw = ctypes.string_at(start, 16) if address % PAGE_BYTES >= address - start else _read_memory(start, 16)
    if raw is None:
        return False
    ob_type, ob_size = (int(v) for v in np.frombuffer(raw, dtype=np.uint64))
    return ob_type == id(bytes) and ob_size >= nbytes


def _torch_hold(obj: Any) -> Callable[[], Any]:
    """What keeps a tensor's memory alive: its storage (so ``set_`` or ``.data =`` cannot free it). On the CPU, a
    numpy view over the storage too, which makes torch refuse to resize that storage (``resize_``,
    ``untyped_storage().resize_``): there is no other way from Python, and none back."""
    def hold() -> Any:
        storage = obj.untyped_storage()
        if obj.device.type != "cpu":
            return storage
        import torch
        alias = torch.empty(0, dtype=torch.uint8).set_(storage)
        return storage, alias.numpy()
    return hold


def _torch_memory(obj: Any, name: str) -> Memory:
    if not obj.is_contiguous():
        raise BindingError(name, describe(obj), "tensor is not contiguous")
    dev = obj.device
    nbytes, address = obj.numel() * obj.element_size(), int(obj.data_ptr())
    probe = obj.data_ptr  # the memory is held, so only pointing elsewhere (set_, .data =, a reallocation) matters
    if dev.type == "cpu":
        writable = not (nbytes and _over_immutable_bytes(address, nbytes))

        def view() -> np.ndarray:
            v = obj.detach().reshape(-1).view(__import__("torch").uint8).numpy() if nbytes else np.zeros(0, np.uint8)
            v = v.view()
            v.flags.writeable = writable
            return v
        return Memory(address, nbytes, Location.HOST, None, bool(obj.is_pinned()) if nbytes else False, writable, obj,
                      view, hold=_torch_hold(obj), probe=probe)
    if dev.type == "cuda":
        return Memory(address, nbytes, Location.DEVICE, dev.index if dev.index is not None else 0, None, True, obj,
                      hold=_torch_hold(obj), probe=probe)
    raise BindingError(name, describe(obj), f"tensor on {dev.type}: expected cpu or cuda")


def _numpy_hold(arr: np.ndarray) -> Callable[[], Any]:
    """What keeps an array's memory alive: the array, and the storage of a torch tensor it views
    (``Tensor.numpy()`` keeps the tensor, not its storage, which the tensor's ``set_`` could free)."""
    def hold() -> Any:
        keep: list[Any] = [arr]
        base = arr.base
        while base is not None:
            if type(base).__module__.startswith("torch") and hasattr(base, "untyped_storage"):
                keep.append(base.untyped_storage())
            base = getattr(base, "base", None) if isinstance(base, np.ndarray) else None
        return tuple(keep)
    return hold


def _numpy_memory(obj: np.ndarray, name: str) -> Memory:
    if obj.dtype.hasobject:
        raise BindingError(name, f"{describe(obj)} of dtype {obj.dtype}", "an array of Python objects holds pointers, not bytes")
    if not obj.flags.c_contiguous:
        raise BindingError(name, describe(obj), "array is not C-contiguous")
    arr = np.asarray(obj)  # a subclass such as np.matrix stays 2-D under reshape; the base class flattens
    view = arr.reshape(-1).view(np.uint8)
    address = int(arr.__array_interface__["data"][0])

    def probe() -> int:  # an array holding its memory only moves if resized (refcheck=False): its size changes
        return arr.nbytes
    return Memory(address, int(arr.nbytes), Location.HOST, None, None, bool(arr.flags.writeable), obj, lambda: view,
                  hold=_numpy_hold(arr), probe=probe)


def resolve(obj: Any, name: str) -> Memory:
    """Address and size of one binding. Raises BindingError for non-contiguous, null, object-dtype or
    unsupported memory, and for memory that does not fit the 64-bit address space."""
    if isinstance(obj, Memory):
        m = obj
    elif hasattr(obj, "__kvxfer_memory__"):  # memory described by its owner (a NIXL RemoteBuffer)
        m = obj.__kvxfer_memory__()
    elif isinstance(obj, RawMemory):
        m = Memory(int(obj.address), int(obj.nbytes), obj.location, obj.device, obj.pinned, not obj.readonly, obj)
    elif isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, (int, np.integer)) for v in obj):
        m = Memory(int(obj[0]), int(obj[1]), None, None, None, True, obj)
    elif type(obj).__module__.startswith("torch") and hasattr(obj, "data_ptr"):
        m = _torch_memory(obj, name)
    elif isinstance(obj, np.ndarray):
        m = _numpy_memory(obj, name)
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        if cai.get("strides") is not None:
            raise BindingError(name, describe(obj), "__cuda_array_interface__ with strides: pass contiguous memory")
        nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize
        m = Memory(int(cai["data"][0]), nbytes, Location.DEVICE, None, None, not cai["data"][1], obj)
    else:
        raise BindingError(name, type(obj).__name__, "expected a torch tensor, numpy array, RawMemory or "
                           "(address, nbytes) pair")
    if m.nbytes > 0 and m.address == 0 and not m.file_offsets:
        raise BindingError(name, "address 0", "null address")
    if m.address < 0 or m.nbytes < 0 or m.address + m.nbytes > U64:
        raise BindingError(name, f"[{m.address:#x}, +{m.nbytes})", "does not fit the 64-bit address space")
    return m


def check_location(buf: Buffer, mem: Memory) -> None:
    """Raise BindingError when memory sits where the plan's buffer does not (unknown locations pass)."""
    if mem.location is None:
        return
    if mem.location is not buf.location:
        raise BindingError(buf.name, f"{mem.location.value} memory",
                           f"the plan places this buffer in {buf.location.value} memory")
    if buf.location is Location.DEVICE and mem.device is not None and mem.device != buf.device:
        raise BindingError(buf.name, f"device {mem.device}", f"the plan places this buffer on device {buf.device}")


def check_host_view(buf: Buffer, mem: Memory) -> None:
    """For executors that copy with numpy: the memory must be host memory numpy can address."""
    if mem.view is None:
        raise BindingError(buf.name, describe(mem.owner), "expected a numpy array or CPU torch tensor (host memory)")


Check = Callable[[Buffer, Memory], None]


@dataclass(frozen=True, eq=False)
class Lowered:
    """One plan's ranges as ``BoundMemory`` checked them, each column read from the plan once: what an executor
    uses, instead of reading the plan's columns again.

    ``src``/``dst``: uint64 absolute addresses (``descriptors``) or offsets within the buffers (``offsets``);
    ``nbytes``: uint64 sizes; ``src_runs``/``dst_runs``: (buffer index, run length) of each run of ranges with
    one buffer; ``attr_runs``: the same for attribute ids; ``call_offsets``: int64, one more than the calls.
    """

    src: np.ndarray
    dst: np.ndarray
    nbytes: np.ndarray
    src_runs: tuple[np.ndarray, np.ndarray]
    dst_runs: tuple[np.ndarray, np.ndarray]
    attr_runs: tuple[np.ndarray, np.ndarray]
    call_offsets: np.ndarray

    @property
    def num_calls(self) -> int:
        """The number of calls."""
        return len(self.call_offsets) - 1

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


ADDRESSES, OFFSETS, CHECK = "addresses", "offsets", "check"  # what BoundMemory._lower keeps
FILL_RUNS = 256  # sizes in at most this many runs are written run by run into a reused array
FRESH_RANGES = 16384  # below this many ranges, sizes go into a fresh array (no page faults at that size)
OWNER_SETS = 64  # buffer sets whose owner probes a BoundMemory keeps


def lowering_strategy(lengths: np.ndarray, n: int) -> str:
    """How bases are added to ``n`` offsets that come in runs of ``lengths`` (one buffer per run): ``"grid"``
    when every run has one length (rows of a 2-D view: one broadcast addition), ``"long runs"`` when runs are
    long (each run's base added in place: no per-range base array), else ``"repeat"`` (one per-range base array)."""
    rows = len(lengths)
    if rows and int(lengths[0]) * rows == n and int(lengths.max()) == int(lengths[0]):  # the largest is the mean
        return "grid"
    return "long runs" if n >= LONG_RUN * rows else "repeat"


class BoundMemory:
    """Memory bound once to a table of buffers; ``descriptors(plan)`` turns a plan's ranges into addresses.

    ``buffers`` is the table bound (a Layout's buffers); ``memory[i]`` is buffer i's Memory (None where the
    buffer was not bound). Keeps each memory alive itself (``Memory.hold``: a tensor's storage), and refuses a
    run (BindingError naming the buffer) when a bound owner the plan touches no longer points at the bound
    memory (``Memory.probe``: a tensor after ``set_``, ``.data = ...`` or a resize). ``close()`` runs the
    executor's release hooks (deregistration) once; a closed BoundMemory refuses to lower.

    Threads: runs may lower plans on one BoundMemory from several threads; ``close`` must not race them.
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
        self.extra: dict[str, Any] = {}  # executor-specific state made at bind time (registrations)
        self._on_close: list[Callable[[], None]] = []
        self._tables: list[tuple[Buffer, ...]] = [buffers]  # buffer tables already found equal (kept alive)
        self.held: tuple[Any, ...] = tuple(m.hold() if m.hold is not None else m.owner for m in memory if m is not None)
        self._probes: list[tuple[Callable[[], int], int] | None] = [None] * len(buffers)
        for i, m in enumerate(memory):
            if m is not None and m.probe is not None:
                value = m.probe()  # read after ``hold``: the value of the memory held
                self._probes[i] = (m.probe, value)
                if value not in (m.address, m.nbytes):
                    self._moved(i)
        self.probed = np.array([p is not None for p in self._probes], dtype=bool)
        self._any_probed = bool(self.probed.any())
        self._last: tuple[int, tuple[np.ndarray, np.ndarray, np.ndarray, bool]] | None = None
        self._owner_checks: dict[tuple[bytes, bytes], tuple[list[int], list[Callable[[], int]], list[int]]] = {}

    def __repr__(self) -> str:
        n = sum(m is not None for m in self.memory)
        return f"BoundMemory({n} of {len(self.buffers)} buffers, by {self.bound_by}{', closed' if self.closed else ''})"

    def on_close(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` to run on ``close()``; hooks run once, last registered first."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Release what binding made (registrations) and the memory held; afterwards runs with this BoundMemory are
        refused. Transfers still in flight keep their own references to the memory."""
        if self.closed:
            return
        self.closed = True
        while self._on_close:
            self._on_close.pop()()
        self.held = ()

    def __enter__(self) -> BoundMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def verify(self) -> None:
        """Re-resolve every binding and refuse, naming the buffer, one whose memory moved or changed size since
        bind (a tensor re-allocated or resized): such memory must be bound again. Costs one resolve per buffer;
        runs check the owners they touch more cheaply (``Memory.probe``)."""
        for buf, m in zip(self.buffers, self.memory):
            if m is None or isinstance(m.owner, (RawMemory, tuple)) or hasattr(m.owner, "__kvxfer_memory__"):
                continue  # memory given by address cannot move
            now = resolve(m.owner, buf.name)
            if (now.address, now.nbytes) != (m.address, m.nbytes):
                raise BindingError(buf.name, f"[{now.address:#x}, +{now.nbytes})",
                                   f"changed since bind (was [{m.address:#x}, +{m.nbytes})); bind it again")

    def owners(self) -> list[Any]:
        """The objects bound (arrays, tensors, ...) and the memory held for them, for keeping them alive while
        copies are in flight."""
        return [*(m.owner for m in self.memory if m is not None), *self.held]

    def _moved(self, i: int) -> None:
        """Raise BindingError: buffer ``i``'s owner no longer points at the memory bound."""
        m = self.memory[i]
        owner = m.owner if m is not None else None
        try:
            now = resolve(owner, self.buffers[i].name)
            where = f"{describe(owner)} at [{now.address:#x}, +{now.nbytes})"
        except BindingError as e:
            where = f"{describe(owner)} ({e.reason})"
        bound = f"[{m.address:#x}, +{m.nbytes})" if m is not None else "?"
        raise BindingError(self.buffers[i].name, where, f"no longer the memory bound, {bound} (set_, .data = or a "
                           "reallocation since bind); bind it again")

    def _check_owners(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Refuse a run that touches (``src``, ``dst``: the buffer indices of its runs) a bound owner that moved.
        The probes a set of buffers needs are found once per set (a serving loop's plans touch few sets)."""
        key = (src.tobytes(), dst.tobytes())
        checks = self._owner_checks.get(key)
        if checks is None:
            todo = np.zeros(len(self.buffers), dtype=bool)
            todo[src] = True
            todo[dst] = True
            todo &= self.probed
            index = np.flatnonzero(todo).tolist()
            probes = [self._probes[i] for i in index]
            checks = (index, [p[0] for p in probes if p is not None], [p[1] for p in probes if p is not None])
            if len(self._owner_checks) < OWNER_SETS:
                self._owner_checks[key] = checks  # one assignment: threads that race here store equal entries
        index, calls, want = checks
        if [probe() for probe in calls] != want:
            for i, probe, value in zip(index, calls, want):
                if probe() != value:
                    self._moved(i)

    def check_table(self, plan: TransferPlan) -> None:
        """Refuse a plan whose buffer table differs from the bound one, naming the first buffer that differs."""
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

    def descriptors(self, plan: TransferPlan, out: Sequence[np.ndarray] | None = None) -> Lowered:
        """Check every range of ``plan`` and return it lowered: absolute uint64 addresses, sizes, buffer and
        attribute runs and call offsets, each read from the plan once (see ``Lowered``).

        Refuses, before anything is copied: a closed binding or another buffer table (BindingError); columns
        of different lengths or malformed call offsets, an index out of its table or a zero-byte range
        (PlanError naming column and range); a range that leaves its buffer's declared size, wrapping uint64
        included (PlanError naming side, range and buffer); a buffer read but not bound, written but
        read-only, or whose bound owner no longer points at the bound memory (BindingError naming the buffer).
        Writes the addresses into ``out`` (two uint64 arrays of at least ``plan.num_ranges``; a third, when there
        is one, takes the sizes) when given.
        """
        return self._lower(plan, out, ADDRESSES)

    def offsets(self, plan: TransferPlan) -> Lowered:
        """Every check of ``descriptors``, keeping offsets within the buffers instead of addresses: for executors
        that copy through views. The plan's own (frozen, so unchanging) offset columns are handed on as they are,
        with no copy, and sizes of one value as a read-only broadcast."""
        return self._lower(plan, None, OFFSETS)

    def lower(self, plan: TransferPlan, out: Sequence[np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """``descriptors(plan, out)``'s (src, dst) addresses (uint64 arrays; views of ``out`` when given)."""
        low = self._lower(plan, out, ADDRESSES)
        return low.src, low.dst

    def check(self, plan: TransferPlan) -> None:
        """Every check of ``descriptors``, keeping nothing."""
        self._lower(plan, None, CHECK)

    def _lower(self, plan: TransferPlan, out: Sequence[np.ndarray] | None, mode: str) -> Lowered:
        addresses = mode == ADDRESSES
        if self.closed:
            raise BindingError(self.bound_by, repr(self), "this BoundMemory was closed; bind again")
        self.check_table(plan)
        plan.check_shape()  # equal column lengths and well-formed calls, whichever way the plan was made
        n = plan.num_ranges
        co = _call_offsets(plan, n)
        _check_index(plan, "region", len(plan.regions))
        attr_runs = _check_index(plan, "attr", len(plan.attrs))
        nb_values, nb_lengths = _runs(plan, "nbytes", n)  # sizes are bounded through their runs, then expanded
        nb_values = nb_values.astype(np.uint64, copy=False)
        nb_max = np.uint64(0)
        if n:
            nb_min, nb_max = nb_values.min(), nb_values.max()
            for bad, reason in ((nb_min == 0, "empty range"), (nb_max >= MAX_OFFSET, "range too large")):
                if bad:  # no range is empty, and offset + nbytes cannot wrap once offsets are bounded
                    j = int(np.argmax(nb_values == 0 if reason == "empty range" else nb_values >= MAX_OFFSET))
                    raise PlanError("nbytes", int(nb_values[j]), reason, int(nb_lengths[:j].sum()))
        sizes = _sizes(nb_values, nb_lengths, n, mode, out[2] if out is not None and len(out) > 2 else None)
        last_off, last_addr, fits, all_fit = self._last_starts(nb_max)
        runs = []
        for side in ("src", "dst"):
            values, lengths = _runs(plan, f"{side}_buf", n)
            if len(values) and (int(values.min()) < 0 or int(values.max()) >= len(self.buffers)):
                i = int(np.argmax((values < 0) | (values >= len(self.buffers))))
                raise PlanError(f"{side}_buf", int(values[i]), f"out of range (the plan has {len(self.buffers)})",
                                int(lengths[:i].sum()))
            usable = (self.writable if side == "dst" else self.readable)[values]
            if not usable.all():
                i = int(np.argmin(usable))
                b = int(values[i])
                m = self.memory[b]
                if m is None:
                    raise BindingError(self.buffers[b].name, "missing", "not bound, but the plan reads or writes it")
                raise BindingError(self.buffers[b].name, describe(m.owner), "read-only, but the plan writes to it")
            runs.append((values, lengths))
        if self._any_probed:
            self._check_owners(runs[0][0], runs[1][0])
        sides = []
        for k, (side, (values, lengths)) in enumerate(zip(("src", "dst"), runs)):
            offs = plan.column(f"{side}_offset")
            if len(offs) != n:
                raise PlanError(f"{side}_offset", len(offs), f"column length differs from nbytes ({n})")
            # a frozen column cannot change: its values are checked where they are, before or without a copy
            frozen = offs.dtype == np.uint64 and is_frozen(offs)
            if frozen and not addresses:
                addr = offs  # the values checked are the values used, with no copy
            else:
                addr = out[k][:n] if out is not None else np.empty(n, dtype=np.uint64)
            if n:
                self._place(offs, frozen, side, values, lengths, nb_values, nb_lengths, last_off, last_addr,
                            None if all_fit else fits, addr, addresses)
            sides.append((addr, (values, lengths)))
        (src, src_runs), (dst, dst_runs) = sides
        return Lowered(src, dst, sizes, src_runs, dst_runs, attr_runs, co)

    def _last_starts(self, nb_max: np.uint64) -> tuple[np.ndarray, np.ndarray, np.ndarray, bool]:
        """Per buffer: the last start offset at which a range of ``nb_max`` bytes still fits, the same as an
        address, whether it fits at all, and whether it fits in every buffer. A run whose ranges all start at or
        before it is inside, with no range checked alone. Kept for the last size asked (plans of one layout share
        their largest range)."""
        key = int(nb_max)
        cached = self._last
        if cached is not None and cached[0] == key:
            return cached[1]
        fits = self.size >= nb_max
        last_off = np.where(fits, self.size - np.where(fits, nb_max, 0), 0).astype(np.uint64)
        last_addr = last_off + self.base  # no wrap: a bound memory ends at or below 2^64
        for a in (last_off, last_addr, fits):
            a.flags.writeable = False
        entry = (key, (last_off, last_addr, fits, bool(fits.all())))
        self._last = entry  # one tuple: threads that race here each see a consistent entry
        return entry[1]

    def _place(self, offs: np.ndarray, frozen: bool, side: str, values: np.ndarray, lengths: np.ndarray,
               nb_values: np.ndarray, nb_lengths: np.ndarray, last_off: np.ndarray, last_addr: np.ndarray,
               fits: np.ndarray | None, addr: np.ndarray, addresses: bool) -> None:
        """addr = base + offset (offset alone unless ``addresses``; ``addr`` may be ``offs`` itself, a frozen
        column), reading each offset once; then refuse a range of ``addr`` that is not inside its buffer's
        declared size (a wrapped sum included). Sizes come as their runs (``nb_values``, ``nb_lengths``).
        A ``frozen`` column cannot change between reads, so its offsets are bounded as they are (no sum can wrap
        once an offset is at most its buffer's size: bound memory ends at or below 2^64); any other column's
        values are bounded only as they were added, in ``addr``.

        Buffers come in runs (a region's ranges share one buffer): per run, the largest address at most ``last``
        (the last start at which the plan's largest range fits in the buffer) proves every range of the run
        inside (one reduction per run, in one call), and with bases added the smallest address at least the
        base proves no sum wrapped; only when that bound fails somewhere is the exact end of every range
        compared."""
        n = len(addr)
        rows = len(values)
        strategy = lowering_strategy(lengths, n)
        bases = self.base[values] if addresses else None
        starts = None if strategy == "grid" else np.cumsum(lengths) - lengths
        on_offsets = frozen or bases is None  # bound the offsets (no base added), else the sums in ``addr``
        checked = offs if frozen else addr
        if bases is None:
            if addr is not offs:
                np.copyto(addr, offs)
        elif strategy == "grid":
            np.add(bases[:, None], offs.reshape(rows, -1), out=addr.reshape(rows, -1))  # scalar-per-row operand first
        elif strategy == "long runs":
            for b, lo, m in zip(bases.tolist(), starts.tolist(), lengths.tolist()):  # type: ignore[union-attr]
                np.add(offs[lo:lo + m], np.uint64(b), out=addr[lo:lo + m])
        else:
            np.add(offs, np.repeat(bases, lengths), out=addr)
        # from here on only ``addr`` (or the frozen column) is read: the values checked are the values used
        if starts is None:
            starts = np.arange(0, n, n // rows)
        ok = np.maximum.reduceat(checked, starts) <= (last_off if on_offsets else last_addr)[values]
        if not on_offsets:
            ok &= np.minimum.reduceat(addr, starts) >= bases  # an offset that wrapped the sum lands below its base
        if ok.all() and (fits is None or fits[values].all()):  # None: the largest range fits in every buffer
            return
        base_of = np.repeat(bases if bases is not None else np.zeros(rows, np.uint64), lengths)
        rel = addr - base_of  # the offset used, modulo 2^64
        lim = np.repeat(self.size[values], lengths)
        sizes = np.repeat(nb_values, nb_lengths)
        bad = (rel > lim) | (sizes > lim - rel)  # the second term is only read where the first is False
        if bad.any():
            i = int(np.argmax(bad))
            b = int(np.repeat(values, lengths)[i])
            raise PlanError(f"{side}_offset", int(rel[i]), f"range of {int(sizes[i])} bytes runs past buffer "
                            f"{self.buffers[b].name!r} of {int(self.size[b])} bytes (malformed plan)", i)


def hold_for_stream(bound: BoundMemory, stream: int) -> None:
    """Tell torch's caching allocator that the CUDA tensors bound in ``bound`` are used by copies on ``stream``
    (a raw handle): memory freed while copies queued there are pending (a resize of a storage, whose size torch
    cannot fix on a GPU) is then reused only after them. Nothing for other memory."""
    torch = sys.modules.get("torch")
    if torch is None:
        return
    for m in bound.memory:
        owner = m.owner if m is not None else None
        if isinstance(owner, torch.Tensor) and owner.device.type == "cuda" and owner.numel():
            alias = torch.empty(0, dtype=torch.uint8, device=owner.device).set_(owner.untyped_storage())
            alias.record_stream(torch.cuda.ExternalStream(stream, device=owner.device))


def _sizes(values: np.ndarray, lengths: np.ndarray, n: int, mode: str, out: np.ndarray | None) -> np.ndarray:
    """The size of every range, from the runs checked (``values``, ``lengths``): a uint64 array (drivers read it as
    memory), written into ``out`` when given; for ``offsets`` a single size as a read-only broadcast; for
    ``check`` an empty array (nothing is kept)."""
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


def _runs(plan: TransferPlan, name: str, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of column ``name``'s runs, copied from the plan (int64 lengths); PlanError unless they
    cover ``n`` ranges."""
    values, lengths = plan.column_runs(name)
    lengths = lengths.astype(np.int64, copy=False)
    total = int(lengths.sum())
    if total != n:
        raise PlanError(name, total, f"column length differs from nbytes ({n})")
    return values, lengths


def _check_index(plan: TransferPlan, name: str, limit: int) -> tuple[np.ndarray, np.ndarray]:
    """The runs of index column ``name``, every value checked to be in [0, ``limit``) (PlanError naming the first
    range of the first run that is not). Their total length is not rechecked: nothing is addressed through them."""
    values, lengths = plan.column_runs(name)
    if len(values) and (int(values.max()) >= limit or int(values.min()) < 0):
        i = int(np.argmax((values >= limit) | (values < 0)))
        raise PlanError(name, int(values[i]), f"out of range (the plan has {limit})", int(lengths[:i].sum()))
    return values, lengths


def _call_offsets(plan: TransferPlan, n: int) -> np.ndarray:
    """A copy of the plan's call offsets, checked to rise strictly from 0 to ``n``."""
    co = np.array(plan.call_offsets, dtype=np.int64)
    bad = co.ndim != 1 or len(co) < 1 or co[0] != 0 or co[-1] != n
    if not bad and len(co) > 2:
        bad = bool((co[1:] <= co[:-1]).any())
    elif not bad and len(co) == 2:
        bad = n == 0
    if bad:
        raise PlanError("call_offsets", co.tolist()[:8], f"must rise strictly from 0 to {n}")
    return co


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
