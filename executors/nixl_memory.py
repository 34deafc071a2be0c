"""Memory as NIXL sees it: local segments (numpy arrays, CPU or CUDA tensors), remote descriptors, peer
descriptions, registrations, and files.

A binding for the NIXL executor maps a plan buffer's name either to local memory (anything
``local_segment`` accepts) or to a ``RemoteBuffer``: a segment another agent registered and described
to us. A peer describes itself in ``PeerInfo``, a data format (JSON: no pickle, so a peer cannot make us run
code), and a malformed description is refused with one PeerInfoError naming the field. Nothing here imports
nixl; the agent is passed in.

Files: a plan buffer with ``location="file"`` is bound to a ``FileBinding`` (``file_trust``: an open file
descriptor, opened and trusted, or refused, as every file kvxfer opens). NIXL's storage backends (POSIX here;
GDS and GDS_MT on GPU machines) address a file as ``(file_offset, length, fd)`` descriptors of memory type FILE
(``file_segment``), registered by the agent that reads or writes it: the "remote" side of such a transfer is
the agent itself (``file_remote``). ``FileBinding`` is still importable from here.
"""
from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from kvxfer.planner import Buffer

from ._binding import bind
from ._memory import BindingError, Memory, resolve
from .file_trust import FileBinding as FileBinding  # its old path, kept: kvxfer.executors.nixl_memory.FileBinding

MEM_TYPES = ("DRAM", "VRAM")
REMOTE_MEM_TYPES = (*MEM_TYPES, "FILE")  # FILE: (file offset, length, fd), addressed by the agent's own name
PEER_FORMAT, PEER_VERSION = "kvxfer.nixl-peer", 1
MAX_PEER_INFO_BYTES = 64 << 20  # NIXL's agent metadata is kilobytes; anything near this is not a peer's description
MAX_PEER_BUFFERS = 1 << 16
MAX_NAME_CHARS = 1024


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


class PeerInfoError(ValueError):
    """A peer's description (``PeerInfo.decode``) is malformed: names the field (with the buffer's index where
    there is one), the value and why it is refused."""

    def __init__(self, field: str, value: Any, reason: str, index: int | None = None):
        self.field, self.index, self.value, self.reason = field, index, value, reason
        text = repr(value)
        super().__init__(f"peer info {field} = {text if len(text) <= 80 else text[:77] + '...'}: {reason}")


@dataclass(frozen=True)
class PeerInfo:
    """What a peer tells us to address its memory: its agent name, its NIXL agent metadata (opaque bytes, which
    NIXL itself parses), and its registered buffers by name.

    ``encode()`` gives JSON bytes: ``{"format": "kvxfer.nixl-peer", "version": 1, "agent": str, "metadata":
    base64 str, "buffers": [[name, mem, addr, nbytes, dev], ...]}``; ``decode(blob)`` checks every field."""

    agent: str
    metadata: bytes
    buffers: tuple[tuple[str, Segment], ...]

    def encode(self) -> bytes:
        """The description as JSON bytes (see the class docstring)."""
        rows = [[name, seg.mem, seg.addr, seg.nbytes, seg.dev] for name, seg in self.buffers]
        return json.dumps({"format": PEER_FORMAT, "version": PEER_VERSION, "agent": self.agent,
                           "metadata": base64.b64encode(self.metadata).decode(), "buffers": rows}).encode()

    @classmethod
    def decode(cls, blob: object) -> PeerInfo:
        """Parse and check a peer's description; PeerInfoError naming the first field that is malformed (not
        bytes, too large, a pickle or other non-JSON, missing or unknown keys, wrong types, counts or values)."""
        if not isinstance(blob, (bytes, bytearray, memoryview)):
            raise PeerInfoError("blob", type(blob).__name__, "expected bytes (PeerInfo.encode, NixlExecutor.describe)")
        blob = bytes(blob)
        if len(blob) > MAX_PEER_INFO_BYTES:
            raise PeerInfoError("blob", f"{len(blob)} bytes", f"larger than {MAX_PEER_INFO_BYTES} bytes")
        if blob[:1] == b"\x80":
            raise PeerInfoError("blob", blob[:16], "a pickle: peer descriptions are JSON data and are never unpickled")
        try:
            doc = json.loads(blob.decode("utf-8"), parse_constant=_no_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as e:
            raise PeerInfoError("blob", blob[:32], f"not JSON: {e}") from None
        _check_keys(doc)
        if doc["format"] != PEER_FORMAT:
            raise PeerInfoError("format", doc["format"], f"expected {PEER_FORMAT!r}")
        if _int(doc["version"]) != PEER_VERSION:
            raise PeerInfoError("version", doc["version"], f"this kvxfer reads version {PEER_VERSION}")
        agent = _name(doc["agent"], "agent")
        metadata = _metadata(doc["metadata"])
        buffers = _buffers(doc["buffers"])
        return cls(agent, metadata, buffers)


def _check_keys(doc: Any) -> None:
    """A peer description is a JSON object with exactly the five keys; PeerInfoError names the first missing or
    unknown one."""
    if not isinstance(doc, dict):
        raise PeerInfoError("blob", type(doc).__name__, "expected a JSON object")
    keys = ("format", "version", "agent", "metadata", "buffers")
    for k in keys:
        if k not in doc:
            raise PeerInfoError(k, "missing", f"a peer description has {list(keys)}")
    extra = sorted(set(doc) - set(keys))
    if extra:
        raise PeerInfoError(extra[0], doc[extra[0]], f"unknown key (a peer description has {list(keys)})")


def _metadata(value: Any) -> bytes:
    """The peer's NIXL agent metadata from its base64 text; PeerInfoError when it is not base64 or empty."""
    if not isinstance(value, str):
        raise PeerInfoError("metadata", type(value).__name__, "expected a base64 string")
    try:
        metadata = base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as e:
        raise PeerInfoError("metadata", value[:32], f"not base64: {e}") from None
    if not metadata:
        raise PeerInfoError("metadata", "", "empty: the peer's NIXL agent metadata is needed")
    return metadata


def _buffers(rows: Any) -> tuple[tuple[str, Segment], ...]:
    """Every ``[name, mem, addr, nbytes, dev]`` row of a description, checked (PeerInfoError names the row)."""
    if not isinstance(rows, list):
        raise PeerInfoError("buffers", type(rows).__name__, "expected a list of [name, mem, addr, nbytes, dev]")
    if len(rows) > MAX_PEER_BUFFERS:
        raise PeerInfoError("buffers", f"{len(rows)} entries", f"more than {MAX_PEER_BUFFERS}")
    seen: set[str] = set()
    return tuple(_buffer_row(row, i, seen) for i, row in enumerate(rows))


def _no_constant(text: str) -> Any:
    raise ValueError(f"{text} is not a number here")


def _int(value: Any) -> int | None:
    """``value`` if it is a JSON integer (not a bool, not a float), else None."""
    return value if type(value) is int else None


def _name(value: Any, field: str, index: int | None = None) -> str:
    if not isinstance(value, str) or not value:
        raise PeerInfoError(field, value, "expected a non-empty string", index)
    if len(value) > MAX_NAME_CHARS:
        raise PeerInfoError(field, value, f"longer than {MAX_NAME_CHARS} characters", index)
    return value


def _buffer_row(row: Any, i: int, seen: set[str]) -> tuple[str, Segment]:
    """One ``[name, mem, addr, nbytes, dev]`` entry of a peer description, checked."""
    where = f"buffers[{i}]"
    if not isinstance(row, list) or len(row) != 5:
        got = f"{len(row)} entries" if isinstance(row, list) else type(row).__name__
        raise PeerInfoError(where, got, "expected [name, mem, addr, nbytes, dev]: a name and its whole descriptor", i)
    name, mem, addr, nbytes, dev = row
    name = _name(name, f"{where}.name", i)
    if name in seen:
        raise PeerInfoError(f"{where}.name", name, "named twice", i)
    seen.add(name)
    if mem not in MEM_TYPES:
        raise PeerInfoError(f"{where}.mem", mem, f"expected one of {MEM_TYPES}", i)
    limits = (("addr", addr, 0, (1 << 64) - 1), ("nbytes", nbytes, 1, 1 << 63), ("dev", dev, 0, (1 << 31) - 1))
    for key, value, low, high in limits:
        v = _int(value)
        if v is None:
            raise PeerInfoError(f"{where}.{key}", value, "expected an integer", i)
        if not low <= v <= high:
            raise PeerInfoError(f"{where}.{key}", value, f"outside [{low}, {high}]", i)
    if addr + nbytes > 1 << 64:
        raise PeerInfoError(f"{where}.nbytes", nbytes, f"the segment at {addr:#x} would end past the 64-bit address space", i)
    return name, Segment(addr, nbytes, dev, mem)


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


def file_segment(fb: FileBinding) -> Segment:
    """An opened file binding as one of this agent's FILE segments (file offset, length, fd); BindingError if it
    is not open."""
    fd, buf = fb.opened()
    return Segment(fb.offset, buf.nbytes, fd, "FILE", not fb.readonly)


def file_remote(fb: FileBinding, agent_name: str) -> RemoteBuffer:
    """An opened file binding as the other side of a transfer posted by ``agent_name`` itself (file offset, length,
    fd)."""
    fd, buf = fb.opened()
    return RemoteBuffer(agent_name, fb.offset, buf.nbytes, fd, "FILE")


def register_files(agent: Any, files: Mapping[str, FileBinding], buffers: Iterable[Buffer] | None) -> Registration:
    """Open each file for its buffer and register it with ``agent`` as FILE memory (one call for all).

    ``buffers`` (the plan's or layout's) give each file buffer's size and alignment; without them a binding
    must already be open. Raises BindingError before anything is registered.
    """
    table = {b.name: b for b in buffers} if buffers is not None else {}
    for name, fb in files.items():
        if name in table:
            fb.open(table[name])
        elif fb.fd is None:
            raise BindingError(name, repr(fb), "unknown buffer: pass the layout's buffers to open the file")
    segments = {name: file_segment(fb) for name, fb in files.items()}
    rows = [(s.addr, s.nbytes, s.dev, name) for name, s in segments.items()]
    handles = [agent.register_memory(rows, "FILE")] if rows else []
    return Registration(agent, segments, handles, list(files.values()))
