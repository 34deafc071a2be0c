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

from .binding import BindingError, Memory, bind, resolve

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
        """Whether ``other`` lies entirely inside this segment (same memory type and device)."""
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

    def __kvxfer_memory__(self) -> Memory:
        """The remote segment as a binding: its address and size (in the peer's address space), location unknown."""
        return Memory(self.addr, self.nbytes, None, self.dev, None, True, self, file_offsets=self.mem == "FILE")


def segment_of(mem: Memory, name: str) -> Segment:
    """The NIXL view of resolved local memory: host memory numpy can reach is DRAM, device memory VRAM.

    Raises BindingError for memory NIXL cannot describe here (raw addresses of unknown kind, remote buffers).
    """
    if isinstance(mem.owner, RemoteBuffer):
        raise BindingError(name, mem.owner, "a RemoteBuffer is not local memory")
    if mem.location is not None and mem.location.value == "device":
        return Segment(mem.address, mem.nbytes, int(mem.device or 0), "VRAM", mem.writable)
    if mem.view is None:
        raise BindingError(name, type(mem.owner).__name__, "expected a numpy array, CPU or CUDA tensor")
    return Segment(mem.address, mem.nbytes, 0, "DRAM", mem.writable)


def _describable(buf: Any, mem: Memory) -> None:
    segment_of(mem, buf.name)


def local_segment(obj: Any, name: str) -> Segment:
    """The memory behind one local binding (numpy array, CPU or CUDA tensor). Raises BindingError."""
    return segment_of(resolve(obj, name), name)


class Registration:
    """Memory registered with one agent under buffer names. ``deregister()`` (or ``with``) undoes it."""

    def __init__(self, agent: Any, segments: dict[str, Segment], handles: list[Any], keep: list[Any]):
        self.agent, self.segments, self._handles, self._keep = agent, segments, handles, keep
        self.usable = True  # False once a transfer over it outlived its drain: never used or deregistered again

    def covers(self, seg: Segment) -> bool:
        """Whether one registered segment contains all of ``seg``."""
        return any(s.covers(seg) for s in self.segments.values())

    def mark_unusable(self) -> None:
        """A transfer may still touch this memory: refuse new runs over it and keep it registered (and referenced)."""
        self.usable = False

    @property
    def names(self) -> tuple[str, ...]:
        """The buffer names registered."""
        return tuple(self.segments)

    def deregister(self) -> None:
        """Deregister every segment; afterwards the registration covers nothing. An unusable registration
        (a transfer over it may still be in flight) stays registered and its memory referenced."""
        if not self.usable:
            return
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
    if buffers is not None:  # the one binding check: every buffer bound, large enough, describable by NIXL
        bound = bind(tuple(buffers), bindings, check=_describable)
        segments = {b.name: segment_of(m, b.name) for b, m in zip(bound.buffers, bound.memory) if m is not None}
    else:
        segments = {n: local_segment(bindings[n], n) for n in bindings}
    names = list(segments)
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
