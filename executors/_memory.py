"""Resolving memory: what a binding (numpy array, torch tensor, ``__cuda_array_interface__`` object, RawMemory
or ``(address, nbytes)`` pair) is, as one ``Memory``: address, size, where it lives, and how to keep it (what
owns it, ``_owners``: held, probed, or refused here when nobody can say).

``resolve`` is the one place bindings are read; ``_binding`` keeps resolved memory bound.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Location

from ._owners import Kept, Owner, is_tensor, owner_of
from ._owners import over_immutable_bytes as over_immutable_bytes  # where torch.frombuffer(bytes) is recognised

U64 = 1 << 64


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
    it is only called by executors that copy with numpy. ``keep`` is called once by ``bind``: it holds what owns
    the memory (``_owners``: the chain of views to the owner, a tensor's storage, a weak reference or a buffer
    export that stops the owner resizing or closing it) and returns that with the probes each run reads (data
    pointers; a mapping's presence) to refuse an owner that moved its memory. Memory given by address
    (RawMemory, pairs, ``__cuda_array_interface__``, remote buffers) has none: the caller keeps it.
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
    keep: Callable[[], Kept] | None = field(repr=False, default=None, compare=False)


def _torch_memory(obj: Any, name: str) -> Memory:
    if not obj.is_contiguous():
        raise BindingError(name, describe(obj), "tensor is not contiguous")
    dev = obj.device
    if dev.type not in ("cpu", "cuda"):
        raise BindingError(name, describe(obj), f"tensor on {dev.type}: expected cpu or cuda")
    nbytes, address = obj.numel() * obj.element_size(), int(obj.data_ptr())
    owner = _owner(obj, name, address, nbytes)
    if dev.type == "cuda":
        return Memory(address, nbytes, Location.DEVICE, dev.index if dev.index is not None else 0, None, True, obj,
                      keep=owner.keep)
    writable = not owner.readonly

    def view() -> np.ndarray:
        v = obj.detach().reshape(-1).view(__import__("torch").uint8).numpy() if nbytes else np.zeros(0, np.uint8)
        v = v.view()
        v.flags.writeable = writable
        return v
    return Memory(address, nbytes, Location.HOST, None, bool(obj.is_pinned()) if nbytes else False, writable, obj,
                  view, keep=owner.keep)


def _numpy_memory(obj: np.ndarray, name: str) -> Memory:
    if obj.dtype.hasobject:
        raise BindingError(name, f"{describe(obj)} of dtype {obj.dtype}", "an array of Python objects holds pointers, not bytes")
    if not obj.flags.c_contiguous:
        raise BindingError(name, describe(obj), "array is not C-contiguous")
    arr = np.asarray(obj)  # a subclass such as np.matrix stays 2-D under reshape; the base class flattens
    view = arr.reshape(-1).view(np.uint8)
    address = int(arr.__array_interface__["data"][0])
    owner = _owner(obj, name, address, int(arr.nbytes))
    return Memory(address, int(arr.nbytes), Location.HOST, None, None, bool(arr.flags.writeable) and not owner.readonly,
                  obj, lambda: view, keep=owner.keep)


def _owner(obj: Any, name: str, address: int, nbytes: int) -> Owner:
    """What owns the memory ``obj`` shows (``_owners.owner_of``); BindingError where it cannot be named."""
    owner = owner_of(obj, address, nbytes)
    if owner.refusal is not None:
        raise BindingError(name, describe(obj), owner.refusal)
    return owner


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
    elif is_tensor(obj):
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

