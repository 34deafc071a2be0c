"""Memory as NIXL sees it: local segments (numpy arrays, CPU or CUDA tensors), remote descriptors, registrations.

A binding for the NIXL executor maps a plan buffer's name either to local memory (anything
``local_segment`` accepts) or to a ``RemoteBuffer``: a segment another agent registered and described
to us. Nothing here imports nixl; the agent is passed in.
"""
from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from .base import BindingError, _describe, as_byte_view

MEM_TYPES = ("DRAM", "VRAM")
REMOTE_MEM_TYPES = (*MEM_TYPES, "FILE")  # FILE: (file offset, length, fd), addressed by the agent's own name


@dataclass(frozen=True)
class Segment:
    """One contiguous piece of memory: absolute address, size, device ordinal, NIXL memory type."""

    addr: int
    nbytes: int
    dev: int = 0
    mem: str = "DRAM"
    writeable: bool = True

    def covers(self, other: Segment) -> bool:
        return (self.mem == other.mem and self.dev == other.dev and self.addr <= other.addr
                and other.addr + other.nbytes <= self.addr + self.nbytes)


@dataclass(frozen=True)
class RemoteBuffer:
    """A segment registered by agent ``agent`` in another process or node, bound to a plan buffer by name."""

    agent: str
    addr: int
    nbytes: int
    dev: int = 0
    mem: str = "DRAM"

    def __post_init__(self) -> None:
        if self.mem not in REMOTE_MEM_TYPES:
            raise BindingError(self.agent, f"mem={self.mem!r}", f"memory type must be one of {REMOTE_MEM_TYPES}")
        if self.addr < 0 or self.nbytes <= 0 or self.dev < 0:
            raise BindingError(self.agent, f"addr={self.addr}, nbytes={self.nbytes}, dev={self.dev}",
                               "a remote segment needs addr >= 0, nbytes > 0, dev >= 0")


def local_segment(obj: Any, name: str) -> Segment:
    """The memory behind a binding: host memory (numpy array, CPU tensor) is DRAM, a CUDA tensor VRAM.

    Raises BindingError when the object is not contiguous or not a supported type.
    """
    if type(obj).__module__.startswith("torch") and getattr(obj, "is_cuda", False):
        if not obj.is_contiguous():
            raise BindingError(name, _describe(obj), "tensor is not contiguous")
        return Segment(int(obj.data_ptr()), obj.numel() * obj.element_size(), int(obj.device.index or 0), "VRAM")
    v = as_byte_view(obj, name)
    return Segment(int(v.ctypes.data), int(v.nbytes), 0, "DRAM", bool(v.flags.writeable))


class Registration:
    """Memory registered with one agent under buffer names. ``deregister()`` (or ``with``) undoes it."""

    def __init__(self, agent: Any, segments: dict[str, Segment], handles: list[Any], keep: list[Any]):
        self.agent, self.segments, self._handles, self._keep = agent, segments, handles, keep

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.segments)

    def deregister(self) -> None:
        """Deregister every segment; afterwards the registration covers nothing."""
        while self._handles:
            self.agent.deregister_memory(self._handles.pop())
        self._keep = []
        self.segments = {}

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.deregister()


def register(agent: Any, bindings: Mapping[str, Any], buffers: Iterable[Any] | None = None) -> Registration:
    """Register each binding's memory with ``agent`` (one registration call per memory type).

    ``buffers`` (a Layout's or TransferPlan's buffers, optional) restricts registration to the names the
    layout lists and checks every binding is at least that buffer's size. Returns the Registration; raises
    BindingError for a missing, undersized or unsupported binding, before anything is registered.
    """
    wanted = {b.name: b.nbytes for b in buffers} if buffers is not None else None
    names = [n for n in bindings if wanted is None or n in wanted]
    if wanted is not None:
        missing = sorted(set(wanted) - set(bindings))
        if missing:
            raise BindingError(missing[0], "missing", f"the layout names this buffer (bound: {sorted(bindings)})")
    segments = {n: local_segment(bindings[n], n) for n in names}
    for n, seg in segments.items():
        if wanted is not None and seg.nbytes < wanted[n]:
            raise BindingError(n, f"{seg.nbytes} bytes", f"smaller than the layout's buffer of {wanted[n]} bytes")
    handles = []
    try:
        for mem in MEM_TYPES:
            rows = [(s.addr, s.nbytes, s.dev, "") for s in segments.values() if s.mem == mem]
            if rows:
                handles.append(agent.register_memory(rows, mem))
    except Exception:
        for h in handles:
            agent.deregister_memory(h)
        raise
    return Registration(agent, segments, handles, [bindings[n] for n in names])


def descriptor_rows(segments: Iterable[Segment]) -> np.ndarray:
    """An Nx3 uint64 array (address, nbytes, device) for a NIXL descriptor list."""
    return np.array([(s.addr, s.nbytes, s.dev) for s in segments], dtype=np.uint64).reshape(-1, 3)
