"""Who owns a binding's memory, and how a binding keeps it (``owner_of``, ``Owner.keep``).

A binding reaches the memory's owner through a chain of views and wrappers: a numpy view's ``base``, a
memoryview's ``obj``, a ctypes object's ``_b_base_``, the tensor a ``Tensor.numpy()`` array views, the array
``torch.from_numpy`` was given or the buffer ``torch.frombuffer`` was given (which torch keeps without saying:
read from the storage's deleter context, ``_context_object``). The owner, not the object bound, decides when the
memory is freed or moved, so a binding keeps every object of the chain and, per kind of owner (``KINDS``):

* **held**, the owner cannot free or move the memory while bound: memory torch allocated (its storage, on the CPU
  its size fixed, as ``Tensor.numpy()`` fixes it; pinned and shared memory too); GPU memory torch did not
  allocate (the storage keeps its producer, as DLPack promises); an array that owns its data (a weak reference:
  numpy refuses to resize it, ``refcheck=False`` too); a ``bytearray``, ``array.array``, ``mmap`` or any other
  buffer (an export of the binding's own: growing or closing it raises BufferError, whatever becomes of the
  exports of numpy or of torch); a ``bytes`` object (immutable).
* **probed**, each run reads one value per owner and refuses the run (BindingError) when it changed: the data
  pointer of the object bound (a tensor's ``set_``, ``.data =``; an array's ``__setstate__``), of the array that
  owns the memory (``__setstate__`` frees it whatever views it), and a ctypes buffer's address
  (``ctypes.resize`` ignores exports).
* **refused** at bind time, saying how to bind it: memory whose owner cannot be named. An array over a raw
  pointer (``np.ctypeslib.as_array`` of an address, ctypes ``from_address``: bind ``RawMemory``), a CPU tensor
  over memory torch did not allocate whose owner is not found (DLPack, a buffer of another kind: bind the owner).

Read-only memory is found on the way (a read-only array or buffer, ``bytes``) and refused where a plan writes it.
``Kept.release`` lets go of all of it: a binding closed keeps nothing (an owner may then close its mmap).
"""
from __future__ import annotations

import array
import ctypes
import functools
import mmap
import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

PAGE_BYTES = 4096  # the smallest page size of the platforms supported: a header on the data's page is mapped
MAX_CHAIN = 64  # views of views: a longer chain is refused (no real binding comes near it)
_CDATA: Any = ctypes.c_char.__mro__[-2]  # ctypes' common base class (_ctypes._CData)
RAW = "bind it as RawMemory(address, nbytes) if you keep that memory alive while it is bound"
HOLD_OWNER = "bind the memory's owner instead (a numpy array, np.frombuffer of a buffer), or a tensor torch allocated"

# kinds of owner
NUMPY = "numpy array"  # owns its data: held (weak reference), probed (its data pointer)
BUFFER = "buffer"  # bytearray, array.array, mmap, any buffer: held (an export)
BYTES = "bytes"  # immutable: held, read-only (torch.frombuffer over bytes: the storage keeps them)
CTYPES = "ctypes buffer"  # owns its memory: probed (its address)
TORCH = "torch storage"  # memory torch allocated (CPU, pinned, shared, GPU): held (the storage; CPU: its size fixed)
TORCH_DEVICE = "device storage"  # GPU memory torch did not allocate (DLPack, IPC): held (the storage)
UNKNOWN = "unknown"  # refused
KINDS = (NUMPY, BUFFER, BYTES, CTYPES, TORCH, TORCH_DEVICE, UNKNOWN)


@dataclass(frozen=True, eq=False)
class Probe:
    """One value a run reads to tell whether an owner moved its memory: ``read()`` returns it; ``field``, where it
    is one, is the ctypes value ``read`` reads (runs read those in bulk). ``what`` names it in messages; ``want``,
    where given, is the value it must read when bound."""

    what: str
    read: Callable[[], int]
    field: Any = None
    want: int | None = None


@dataclass(eq=False)
class Kept:
    """What a binding keeps of one memory while bound: ``objects`` (the chain from the object bound to the owner,
    tensors' storages, a weak reference), ``exports`` (memoryviews pinning a buffer against growing or closing)
    and the ``probes`` a run reads. ``release()`` lets go of all of them."""

    objects: tuple[Any, ...]
    exports: tuple[memoryview, ...] = ()
    probes: tuple[Probe, ...] = ()

    def release(self) -> None:
        """Drop every object, release every export (the owner may grow or close it again), forget the probes."""
        exports, self.exports = self.exports, ()
        for e in exports:
            e.release()
        self.objects, self.probes = (), ()


@dataclass(frozen=True, eq=False)
class Owner:
    """What owns one binding's memory (``owner_of``): ``kind`` (one of ``KINDS``), the ``chain`` of objects from
    the object bound to the owner (last), the ``address`` bound, whether the owner's memory is read-only
    (``readonly``), and ``refusal``: why it is refused, or None."""

    kind: str
    chain: tuple[Any, ...]
    address: int = 0
    readonly: bool = False
    refusal: str | None = None

    def keep(self) -> Kept:
        """Hold what can be held, then make the probes (the caller reads their values, after this)."""
        obj, root = self.chain[0], self.chain[-1]
        objects: list[Any] = list(self.chain)
        objects += [t.untyped_storage() for t in self.chain if is_tensor(t)]  # set_ on a tensor cannot free it
        if self.kind == TORCH and root.device.type == "cpu":
            import torch  # a numpy view over the storage: torch then refuses to resize it (no other way from Python)
            objects.append(torch.empty(0, dtype=torch.uint8).set_(root.untyped_storage()).numpy())
        exports: tuple[memoryview, ...] = ()
        probes = [_pointer_probe(obj, "the data pointer of the object bound", self.address)]
        if self.kind == NUMPY:
            objects.append(weakref.ref(root))  # numpy refuses to resize an array that has a weak reference
            if root is not obj:
                probes.append(_pointer_probe(root, "the data pointer of the array that owns the memory"))
        elif self.kind == BUFFER:
            exports = (memoryview(root),)
        elif self.kind == CTYPES:
            probes.append(Probe("the address of the ctypes buffer that owns the memory", partial(ctypes.addressof, root)))
        return Kept(tuple(objects), exports, tuple(p for p in probes if p is not None))


def owner_of(obj: Any, address: int, nbytes: int) -> Owner:
    """What owns the memory ``[address, +nbytes)`` that ``obj`` (a numpy array or torch tensor) shows, found by
    walking from ``obj`` to the end of its chain of views and wrappers. Never raises: an owner that cannot be
    named comes back with its ``refusal``."""
    chain = [obj]
    x = obj
    while len(chain) < MAX_CHAIN:
        if is_tensor(x):
            kind, x = _tensor_step(x, nbytes)
            if kind is not None:
                return _owner(kind, chain, address, f"a CPU tensor over memory torch did not allocate, whose owner is "
                              f"not found (torch.from_dlpack, a buffer of another kind); {HOLD_OWNER}")
        elif isinstance(x, np.ndarray):
            if x.base is None:
                return _owner(NUMPY if x.flags.owndata else UNKNOWN, chain, address,
                              f"an array over memory no object owns; {RAW}")
            x = x.base
        elif isinstance(x, memoryview):
            try:
                x = x.obj
            except ValueError:  # released
                x = None
            if x is None:
                return _owner(UNKNOWN, chain, address, f"a memoryview whose owner is gone or unknown; {RAW}")
        elif isinstance(x, bytes):
            return _owner(BYTES, chain, address)
        elif isinstance(x, _CDATA):
            if x._b_base_ is not None:  # a field or element of another ctypes object, or a pointer's contents
                base = x._b_base_
                if not _inside(x, base):
                    return _owner(UNKNOWN, chain, address, f"a ctypes object over memory it does not own (a "
                                  f"pointer's contents); {RAW}")
                x = base
            elif x._b_needsfree_:
                return _owner(CTYPES, chain, address)
            else:  # from_buffer keeps the buffer's memoryview; from_address keeps nothing
                found = [v for v in (x._objects or {}).values() if isinstance(v, memoryview)]
                if not found:
                    return _owner(UNKNOWN, chain, address, f"a ctypes object over memory it does not own; {RAW}")
                x = found[0]
        else:
            try:
                memoryview(x).release()
            except (TypeError, ValueError) as e:  # no buffer; a closed mmap
                return _owner(UNKNOWN, chain, address, f"memory owned by a {type(x).__name__}, which kvxfer cannot "
                              f"hold ({e}); {RAW}")
            return _owner(BUFFER, chain, address)
        chain.append(x)
    return _owner(UNKNOWN, chain, address, f"a chain of more than {MAX_CHAIN} views; bind the array itself")


def _owner(kind: str, chain: list[Any], address: int, refusal: str = "") -> Owner:
    """The Owner ending ``chain``; read-only where the owner or a view after the object bound is (the bound
    array's own flag is its caller's)."""
    root = chain[-1]
    # bytes are immutable, except under the array numpy's unpickling made over them (its own, writeable: its flags say)
    readonly = (kind == BYTES and not isinstance(chain[-2] if len(chain) > 1 else None, np.ndarray)) or any(
        (isinstance(x, np.ndarray) and not x.flags.writeable) or (isinstance(x, memoryview) and x.readonly)
        for x in chain[1:])
    if kind == BUFFER:
        with memoryview(root) as view:
            readonly |= view.readonly
    return Owner(kind, tuple(chain), address, readonly, refusal if kind == UNKNOWN else None)


def _inside(part: Any, whole: Any) -> bool:
    """Whether ctypes object ``part`` lies inside ``whole``'s memory."""
    at, lo = ctypes.addressof(part), ctypes.addressof(whole)
    return lo <= at and at + ctypes.sizeof(part) <= lo + ctypes.sizeof(whole)


def is_tensor(x: Any) -> bool:
    """Whether ``x`` is a torch tensor (torch is not imported for this)."""
    return (type(x).__module__ or "").startswith("torch") and hasattr(x, "untyped_storage")


def _tensor_step(t: Any, nbytes: int) -> tuple[str | None, Any]:
    """Where the walk goes from tensor ``t``: (a kind, None) where its storage ends it, or (None, the object that
    owns its memory) to walk on from (torch.from_numpy's array, torch.frombuffer's buffer)."""
    storage = t.untyped_storage()
    if t.device.type != "cpu":
        return (TORCH if _allocated_by_torch(storage) else TORCH_DEVICE), None
    if nbytes == 0 or _allocated_by_torch(storage):
        return TORCH, None
    found = _context_object(storage)
    if found is not None:
        return None, found
    if storage.is_shared() or storage.is_pinned():  # torch's shared-memory mappings, its pinned host memory
        return TORCH, None
    if over_immutable_bytes(int(storage.data_ptr()), int(storage.nbytes())):  # bytes the storage keeps
        return BYTES, None
    return UNKNOWN, None


def _allocated_by_torch(storage: Any) -> bool:
    """Whether torch's allocator gave ``storage`` its memory (the storage then owns it: holding it keeps the
    memory) rather than another owner (``torch.from_numpy``, ``torch.frombuffer``, DLPack: memory torch only
    points at). ``resizable()`` does not tell (``Tensor.numpy()`` clears it for good); the data pointer's context
    does: torch's CPU allocator makes it the data pointer itself, while memory torch did not allocate has another
    (its deleter's). Read from the storage's C++ object (``_context_word``); where that is not found,
    ``resizable()``."""
    k = _context_word()
    at, data = int(storage._cdata), int(storage.data_ptr())
    if k is None or not at or ctypes.c_uint64.from_address(at + 8 * k).value != data:
        return bool(storage.resizable())
    return bool(ctypes.c_uint64.from_address(at + 8 * (k + 2)).value == data)


def _context_object(storage: Any) -> Any:
    """The Python object a storage over memory torch did not allocate keeps as its owner (``torch.from_numpy``'s
    array, ``torch.frombuffer``'s buffer: torch releases it when the storage goes), or None where there is none
    or it cannot be read. torch gives such a storage a deleter context holding the data pointer, then the object;
    both are read through /proc/self/mem (never faults), and the object is taken only when its type is one whose
    memory kvxfer knows how to keep (``_owner_types``)."""
    k = _context_word()
    at, data = int(storage._cdata), int(storage.data_ptr())
    if k is None or not at or ctypes.c_uint64.from_address(at + 8 * k).value != data:
        return None
    context = ctypes.c_uint64.from_address(at + 8 * (k + 2)).value
    raw = _read_memory(context, 16) if context else None
    if raw is None:
        return None
    pointer, obj = (int(v) for v in np.frombuffer(raw, np.uint64))
    head = _read_memory(obj, 16) if pointer == data and obj else None  # the object's refcount and type
    if head is None or int(np.frombuffer(head, np.uint64)[1]) not in _owner_types():
        return None
    return ctypes.cast(obj, ctypes.py_object).value  # alive: the storage, which the caller holds, keeps it


def _owner_types() -> set[int]:
    """The ids of the types an owner found behind a storage may have: numpy arrays (subclasses too) and the
    buffers kvxfer holds by an export."""
    types: list[type] = [memoryview, bytearray, bytes, mmap.mmap, array.array]
    todo: list[type] = [np.ndarray]
    while todo:
        t = todo.pop()
        types.append(t)
        todo += t.__subclasses__()
    return {id(t) for t in types}


@functools.cache
def _context_word() -> int | None:
    """The 8-byte word of a torch storage's C++ object (``StorageImpl``) holding its data pointer, which the
    deleter and the context follow, found on a fresh CPU storage (whose context is its data pointer); None when no
    word fits (another layout: ``_allocated_by_torch`` falls back, ``_context_object`` finds nothing)."""
    import torch
    storage = torch.empty(64, dtype=torch.uint8).untyped_storage()
    data, at = int(storage.data_ptr()), int(storage._cdata)
    words = [ctypes.c_uint64.from_address(at + 8 * i).value for i in range(8)]
    return next((k for k in range(1, 6) if words[k] == data and words[k + 2] == data), None)


def _pointer_probe(obj: Any, what: str, want: int | None = None) -> Probe | None:
    """A probe of ``obj``'s data pointer (a tensor's ``data_ptr``, an array's), None for anything else."""
    if is_tensor(obj):
        return Probe(what, obj.data_ptr, want=want)
    if not isinstance(obj, np.ndarray):
        return None
    read, where = data_pointer(obj)
    return Probe(what, read, where, want)


def data_pointer(arr: np.ndarray) -> tuple[Callable[[], int], Any]:
    """(a call returning ``arr``'s data pointer now, the ctypes value it reads or None). Cheaply: the array
    object's ``data`` field (numpy's ``PyArrayObject_fields`` starts with the object header, then
    ``char *data``), read through a ctypes view of the object, which the binding keeps alive with the array. Where
    that field does not hold the pointer numpy reports (another object layout), the slower
    ``__array_interface__`` read."""
    where = ctypes.c_uint64.from_address(id(arr) + object.__basicsize__)
    if where.value == arr.__array_interface__["data"][0]:
        return (lambda: where.value), where
    return (lambda: int(arr.__array_interface__["data"][0])), None


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
