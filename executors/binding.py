"""Binding buffer names to memory: the one place bindings are resolved and checked, for every executor.

``resolve`` turns one binding (numpy array, torch tensor, ``__cuda_array_interface__`` object, RawMemory or
``(address, nbytes)`` pair) into a ``Memory``. ``bind`` resolves and checks each buffer of a layout once and
returns a ``BoundMemory``; ``BoundMemory.lower(plan)`` then checks every range of a plan against the bound
sizes and turns ``(buffer, offset)`` pairs into absolute addresses, vectorized, before anything is copied
(``BoundMemory.check(plan)``: the same checks, for executors that copy through views).

Per run the cost is a few passes over the plan's columns: buffer and size columns are read as runs (one
comparison per run, not per range); per side, one reduction bounds every run's offsets and one addition
writes the addresses (one 2-D broadcast when every run has the same length, as when each region has as
many ranges).
"""
from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location, PlanError, TransferPlan

U64 = 1 << 64
MAX_OFFSET = 1 << 63  # buffers and ranges above this could wrap uint64 sums; none is that large


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
    it is only called by executors that copy with numpy (a numpy view makes a torch storage non-resizable).
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


def _over_immutable_bytes(address: int, nbytes: int) -> bool:
    """Whether ``address`` is the start of a ``bytes`` object's data (torch.frombuffer over bytes does this).

    CPython lays a bytes object out as refcount, type, size, hash, then the data: 32 bytes before the data.
    The header is read only when it lies on the data's own page, which is mapped.
    """
    header = 32
    if address % 4096 < header:
        return False
    ob_type, ob_size = np.frombuffer(ctypes.string_at(address - header + 8, 16), dtype=np.uint64).tolist()
    return ob_type == id(bytes) and ob_size >= nbytes


def _torch_memory(obj: Any, name: str) -> Memory:
    if not obj.is_contiguous():
        raise BindingError(name, describe(obj), "tensor is not contiguous")
    dev = obj.device
    nbytes, address = obj.numel() * obj.element_size(), int(obj.data_ptr())
    if dev.type == "cpu":
        writable = not (nbytes and _over_immutable_bytes(address, nbytes))

        def view() -> np.ndarray:
            v = obj.detach().reshape(-1).view(__import__("torch").uint8).numpy() if nbytes else np.zeros(0, np.uint8)
            v = v.view()
            v.flags.writeable = writable
            return v
        return Memory(address, nbytes, Location.HOST, None, bool(obj.is_pinned()) if nbytes else False, writable, obj, view)
    if dev.type == "cuda":
        return Memory(address, nbytes, Location.DEVICE, dev.index if dev.index is not None else 0, None, True, obj)
    raise BindingError(name, describe(obj), f"tensor on {dev.type}: expected cpu or cuda")


def _numpy_memory(obj: np.ndarray, name: str) -> Memory:
    if obj.dtype.hasobject:
        raise BindingError(name, f"{describe(obj)} of dtype {obj.dtype}", "an array of Python objects holds pointers, not bytes")
    if not obj.flags.c_contiguous:
        raise BindingError(name, describe(obj), "array is not C-contiguous")
    arr = np.asarray(obj)  # a subclass such as np.matrix stays 2-D under reshape; the base class flattens
    view = arr.reshape(-1).view(np.uint8)
    return Memory(int(arr.__array_interface__["data"][0]), int(arr.nbytes), Location.HOST, None, None,
                  bool(arr.flags.writeable), obj, lambda: view)


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


class BoundMemory:
    """Memory bound once to a table of buffers; ``lower(plan)`` turns a plan's ranges into addresses.

    ``buffers`` is the table bound (a Layout's buffers); ``memory[i]`` is buffer i's Memory (None where the
    buffer was not bound). Holds a reference to every binding, so memory stays alive while bound. ``close()``
    runs the executor's release hooks (deregistration) once; a closed BoundMemory refuses to lower.
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

    def __repr__(self) -> str:
        n = sum(m is not None for m in self.memory)
        return f"BoundMemory({n} of {len(self.buffers)} buffers, by {self.bound_by}{', closed' if self.closed else ''})"

    def on_close(self, fn: Callable[[], None]) -> None:
        """Register ``fn`` to run on ``close()``; hooks run once, last registered first."""
        self._on_close.append(fn)

    def close(self) -> None:
        """Release what binding made (registrations); afterwards runs with this BoundMemory are refused."""
        if self.closed:
            return
        self.closed = True
        while self._on_close:
            self._on_close.pop()()

    def __enter__(self) -> BoundMemory:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def verify(self) -> None:
        """Re-resolve every binding and refuse, naming the buffer, one whose memory moved or changed size since
        bind (a tensor re-allocated or resized): such memory must be bound again. Costs one resolve per buffer,
        so call it when memory may have changed, not per run."""
        for buf, m in zip(self.buffers, self.memory):
            if m is None or isinstance(m.owner, (RawMemory, tuple)) or hasattr(m.owner, "__kvxfer_memory__"):
                continue  # memory given by address cannot move
            now = resolve(m.owner, buf.name)
            if (now.address, now.nbytes) != (m.address, m.nbytes):
                raise BindingError(buf.name, f"[{now.address:#x}, +{now.nbytes})",
                                   f"changed since bind (was [{m.address:#x}, +{m.nbytes})); bind it again")

    def owners(self) -> list[Any]:
        """The objects bound (arrays, tensors, ...), for keeping them alive while copies are in flight."""
        return [m.owner for m in self.memory if m is not None]

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

    def lower(self, plan: TransferPlan, out: tuple[np.ndarray, np.ndarray] | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Check every range of ``plan`` and return its (src, dst) absolute addresses as uint64 arrays.

        Refuses, before anything is copied: a closed binding or another buffer table (BindingError); columns
        of different lengths or malformed call offsets, an index out of its table or a zero-byte range
        (PlanError naming column and range); a range that leaves
        its buffer, wrapping uint64 included (PlanError naming side, range and buffer), or a buffer read but
        not bound or written but read-only (BindingError naming the buffer). Writes into ``out`` (two uint64
        arrays of at least ``plan.num_ranges``) when given.
        """
        addrs = self._lower(plan, out, True)
        return addrs[0], addrs[1]

    def check(self, plan: TransferPlan) -> None:
        """Every check of ``lower``, without computing addresses: for executors that copy through views."""
        self._lower(plan, None, False)

    def _lower(self, plan: TransferPlan, out: tuple[np.ndarray, np.ndarray] | None, addresses: bool) -> list[np.ndarray]:
        if self.closed:
            raise BindingError(self.bound_by, repr(self), "this BoundMemory was closed; bind again")
        self.check_table(plan)
        plan.check_shape()  # equal column lengths and well-formed calls, whichever way the plan was made
        for col, limit in (("region", len(plan.regions)), ("attr", len(plan.attrs))):
            values, lengths = plan.column_runs(col)
            bad = values >= limit  # unsigned or checked non-negative by the plan's dtype
            if len(values) and (bad.any() or values.min() < 0):
                i = int(np.argmax(bad | (values < 0)))
                raise PlanError(col, int(values[i]), f"out of range (the plan has {limit})", int(lengths[:i].sum()))
        n = plan.num_ranges
        nb_values, _ = plan.column_runs("nbytes")  # sizes are bounded through their runs: no dense column needed
        if n and int(nb_values.min()) == 0:
            nb = plan.nbytes
            raise PlanError("nbytes", 0, "empty range", int(np.argmin(nb)))
        nb_max = int(nb_values.max()) if n else 0
        if nb_max >= MAX_OFFSET:  # so that offset + nbytes cannot wrap once offsets are below 2^63
            nb = plan.nbytes
            i = int(np.argmax(nb >= MAX_OFFSET))
            raise PlanError("nbytes", int(nb[i]), "range too large", i)
        addrs = []
        for k, side in enumerate(("src", "dst")):
            offs = getattr(plan, f"{side}_offset")
            values, lengths = plan.column_runs(f"{side}_buf")
            values = values.astype(np.int64)
            starts = np.cumsum(lengths) - lengths
            if len(values) and (values.min() < 0 or values.max() >= len(self.buffers)):
                i = int(np.argmax((values < 0) | (values >= len(self.buffers))))
                raise PlanError(f"{side}_buf", int(values[i]), f"out of range (the plan has {len(self.buffers)})",
                                int(starts[i]))
            usable = (self.writable if side == "dst" else self.readable)[values]
            if not usable.all():
                i = int(np.argmin(usable))
                b = int(values[i])
                m = self.memory[b]
                if m is None:
                    raise BindingError(self.buffers[b].name, "missing", "not bound, but the plan reads or writes it")
                raise BindingError(self.buffers[b].name, describe(m.owner), "read-only, but the plan writes to it")
            addr = (out[k][:n] if out is not None else np.empty(n, dtype=np.uint64)) if addresses else None
            if n:
                self._add_bases(plan, side, offs, nb_max, values, starts, lengths, addr)
            if addr is not None:
                addrs.append(addr)
        return addrs

    def _add_bases(self, plan: TransferPlan, side: str, offs: np.ndarray, nb_max: int, values: np.ndarray,
                   starts: np.ndarray, lengths: np.ndarray, addr: np.ndarray | None) -> None:
        """addr = base + offset (unless ``addr`` is None: checks only), after checking offset + nbytes <= size
        for every range (offsets of 2^63 or more, which could wrap, are refused; nbytes was checked below 2^63).

        Buffers come in runs (a region's ranges share one buffer): per run, the largest offset plus the plan's
        largest size within the buffer proves every range of the run inside (one reduction per run, in one
        call); only when that bound fails somewhere is the exact end of every range compared. Runs of one
        length (each region has as many ranges) are rows of a 2-D view: one reduction and one broadcast
        addition, with no per-range temporary."""
        rows = len(values)
        uniform = int(lengths[0]) * rows == len(offs) and int(lengths.min()) == int(lengths.max())
        grid = offs.reshape(rows, -1) if uniform else None
        tops = grid.max(axis=1) if grid is not None else np.maximum.reduceat(offs, starts)  # largest offset per run
        if int(tops.max()) >= MAX_OFFSET:
            self._past_end(plan, side, int(np.argmax(offs >= MAX_OFFSET)))
        limits = self.size[values]
        if bool((tops + np.uint64(nb_max) > limits).any()):
            bad = offs + plan.nbytes > np.repeat(limits, lengths)
            if bad.any():
                self._past_end(plan, side, int(np.argmax(bad)))
        if addr is None:
            return
        bases = self.base[values]
        if grid is not None:
            np.add(bases[:, None], grid, out=addr.reshape(grid.shape))  # scalar-per-row operand first: fast loop
        elif len(offs) >= 8192 * rows:  # long runs: add each run's base in place (no per-range base array)
            for b, lo, n in zip(bases.tolist(), starts.tolist(), lengths.tolist()):
                np.add(offs[lo:lo + n], np.uint64(b), out=addr[lo:lo + n])
        else:
            np.add(offs, np.repeat(bases, lengths), out=addr)

    def _past_end(self, plan: TransferPlan, side: str, i: int) -> None:
        col, ranges = getattr(plan, f"{side}_buf"), getattr(plan, f"{side}_offset")
        b = int(col[i])
        raise PlanError(f"{side}_offset", int(ranges[i]), f"range of {int(plan.nbytes[i])} bytes runs past buffer "
                        f"{self.buffers[b].name!r} of {int(self.size[b])} bytes (malformed plan)", i)


def _buffers_of(buffers: Layout | TransferPlan | Iterable[Buffer]) -> tuple[Buffer, ...]:
    table = getattr(buffers, "buffers", buffers)
    table = table if isinstance(table, tuple) else tuple(table)
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
