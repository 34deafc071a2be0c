"""Resolving memory: what a binding (numpy array, torch tensor, ``__cuda_array_interface__`` object, RawMemory
or ``(address, nbytes)`` pair) is, as one ``Memory``: address, size, where it lives, and how to keep it alive
and to tell whether its owner still points at it.

``resolve`` is the one place bindings are read; ``_binding`` keeps resolved memory bound.
"""
from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Location

U64 = 1 << 64
PAGE_BYTES = 4096  # the smallest page size of the platforms supported: a header on the data's page is mapped


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
    storage's size, as ``Tensor.numpy()`` does; for a numpy array, a weak reference, which makes numpy refuse
    to resize the array), whatever later happens to the owner. ``probe`` is one cheap call that returns where
    the owner's data is now (a tensor's ``data_ptr``; an array's data pointer, read from the array object),
    so each run can refuse an owner that moved (``set_``, ``.data =``, ``ndarray.__setstate__``); ``bind``
    records its value, which must be ``address``. Memory given by address (RawMemory, pairs,
    ``__cuda_array_interface__``, remote buffers) has neither: it cannot move.
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
    probe_field: Any = field(repr=False, default=None, compare=False)  # a ctypes value ``probe`` reads (numpy)


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


def over_immutable_bytes(address: int, nbytes: int) -> bool:
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
        writable = not (nbytes and over_immutable_bytes(address, nbytes))

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


def _numpy_hold(obj: np.ndarray, arr: np.ndarray) -> Callable[[], Any]:
    """What keeps an array's memory alive: the array bound (``obj``) and its base-class view (``arr``), a weak
    reference to ``obj`` (numpy refuses to resize an array that has one, ``refcheck=False`` or not), and the
    storage of a torch tensor it views (``Tensor.numpy()`` keeps the tensor, not its storage, which the
    tensor's ``set_`` could free)."""
    def hold() -> Any:
        keep: list[Any] = [obj, arr, weakref.ref(obj)]
        base = arr.base
        while base is not None:
            if type(base).__module__.startswith("torch") and hasattr(base, "untyped_storage"):
                keep.append(base.untyped_storage())
            base = getattr(base, "base", None) if isinstance(base, np.ndarray) else None
        return tuple(keep)
    return hold


def _data_pointer(arr: np.ndarray) -> tuple[Callable[[], int], Any]:
    """(a call returning ``arr``'s data pointer now, the ctypes value it reads or None). Cheaply: the array
    object's ``data`` field (numpy's ``PyArrayObject_fields`` starts with the object header, then
    ``char *data``), read through a ctypes view of the object, which ``bind`` keeps alive. Where that field does
    not hold the pointer numpy reports (another object layout), the slower ``__array_interface__`` read."""
    where = ctypes.c_uint64.from_address(id(arr) + object.__basicsize__)
    if where.value == arr.__array_interface__["data"][0]:
        return (lambda: where.value), where
    return (lambda: int(arr.__array_interface__["data"][0])), None


def _numpy_memory(obj: np.ndarray, name: str) -> Memory:
    if obj.dtype.hasobject:
        raise BindingError(name, f"{describe(obj)} of dtype {obj.dtype}", "an array of Python objects holds pointers, not bytes")
    if not obj.flags.c_contiguous:
        raise BindingError(name, describe(obj), "array is not C-contiguous")
    arr = np.asarray(obj)  # a subclass such as np.matrix stays 2-D under reshape; the base class flattens
    view = arr.reshape(-1).view(np.uint8)
    address = int(arr.__array_interface__["data"][0])
    # an array moves its memory on resize (refcheck=False, which the weak reference held blocks) and on
    # __setstate__ (which nothing blocks): each run compares the data pointer, never the size
    probe, probe_field = _data_pointer(obj)
    return Memory(address, int(arr.nbytes), Location.HOST, None, None, bool(arr.flags.writeable), obj, lambda: view,
                  hold=_numpy_hold(obj, arr), probe=probe, probe_field=probe_field)


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

