"""One host region mapped by several processes (TP ranks): a file in /dev/shm holding a header and the rows.

Lifecycle. One process ``create``s the region (written under a temporary name, then linked to its name, so
no one attaches to a half-written header); the others ``attach`` by name. Each attach is counted under a
file lock; the attach that reaches the expected count unlinks the name. From then on the memory belongs to
the processes that map it and goes away with the last of them, however they end (SIGKILL included). A
region whose name is still there but whose recorded processes are all dead is stale: ``find_stale`` lists
such regions and ``remove_stale`` unlinks them.

Header (``data_offset`` bytes, a multiple of 4 KiB): magic, sizes, the attach count and table of
(pid, start time) pairs, then the Geometry as JSON. Rows start at ``data_offset``.
"""
from __future__ import annotations

import fcntl
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .tier import Geometry

MAGIC = b"KVXFER01"
PREFIX = "kvxfer-"
MAX_PIDS = 64
_FIXED = struct.Struct("<8sqqqq")  # magic, data_offset, json_bytes, expected attachers, attached count
_PID = struct.Struct("<qq")  # pid, process start time (clock ticks since boot; 0 = unknown)
_PIDS_AT = 64
_JSON_AT = _PIDS_AT + MAX_PIDS * _PID.size
PAGE = 4096


class SharedRegionError(RuntimeError):
    """A shared host region cannot be created, attached or read; names the region and the reason."""

    def __init__(self, name: str, reason: str):
        self.name, self.reason = name, reason
        super().__init__(f"shared host region {name!r}: {reason}")


def _start_time(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return int(stat.rsplit(")", 1)[1].split()[19])  # field 22: starttime


def _alive(pid: int, start: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start == 0 or _start_time(pid) in (0, start)  # a reused pid has another start time


def path_of(name: str, directory: str | os.PathLike = "/dev/shm") -> Path:
    """The path of the shared region ``name`` in ``directory`` (the name gets the kvxfer prefix)."""
    return Path(directory) / f"{PREFIX}{name}"


@dataclass
class SharedRegion:
    """A mapped shared region. ``data`` is a writable uint8 view of the rows; ``close()`` unmaps (and
    unregisters a pinning); the memory stays while another process maps it."""

    name: str
    path: Path
    geometry: Geometry
    data: np.ndarray
    _mmap: mmap.mmap = field(repr=False)
    _pinned: Any = field(default=None, repr=False)

    @classmethod
    def create(cls, name: str, geometry: Geometry, *, attachers: int = 0, directory: str | os.PathLike = "/dev/shm",
               fill: int | None = 0) -> SharedRegion:
        """Create and map the region; ``attachers`` other processes will attach (0: the name is unlinked now).
        ``fill`` None leaves the rows as the file system gives them (zeros on tmpfs)."""
        path = path_of(name, directory)
        body = geometry.model_dump_json().encode()
        data_offset = -(-(_JSON_AT + len(body)) // PAGE) * PAGE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, data_offset + geometry.nbytes)
            os.pwrite(fd, _FIXED.pack(MAGIC, data_offset, len(body), attachers, 0), 0)
            os.pwrite(fd, _PID.pack(os.getpid(), _start_time(os.getpid())), _PIDS_AT)
            os.pwrite(fd, body, _JSON_AT)
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise SharedRegionError(name, f"{path} exists (another live region, or a stale one: remove_stale)") from None
            finally:
                os.unlink(tmp)
            if attachers == 0:
                os.unlink(path)
            region = cls._map(name, path, fd, data_offset, geometry)
        finally:
            os.close(fd)
        if fill is not None and fill != 0:
            region.data[:] = fill
        return region

    @classmethod
    def attach(cls, name: str, directory: str | os.PathLike = "/dev/shm") -> SharedRegion:
        """Map the region created under ``name``; the last expected attach unlinks the name."""
        path = path_of(name, directory)
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise SharedRegionError(name, f"no such region at {path} (not created yet, or every rank already "
                                    "attached and the name was unlinked)") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            magic, data_offset, json_bytes, expected, count = _FIXED.unpack(os.pread(fd, _FIXED.size, 0))
            if magic != MAGIC:
                raise SharedRegionError(name, f"{path} is not a kvxfer region (magic {magic!r})")
            geometry = Geometry.model_validate_json(os.pread(fd, json_bytes, _JSON_AT))
            if count >= expected:
                raise SharedRegionError(name, f"all {expected} expected attachers already attached")
            count += 1
            os.pwrite(fd, _FIXED.pack(magic, data_offset, json_bytes, expected, count), 0)
            if count < MAX_PIDS:
                os.pwrite(fd, _PID.pack(os.getpid(), _start_time(os.getpid())), _PIDS_AT + count * _PID.size)
            if count == expected:
                os.unlink(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return cls._map(name, path, fd, data_offset, geometry)
        finally:
            os.close(fd)

    @classmethod
    def _map(cls, name: str, path: Path, fd: int, data_offset: int, geometry: Geometry) -> SharedRegion:
        mm = mmap.mmap(fd, data_offset + geometry.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = np.frombuffer(mm, dtype=np.uint8, count=geometry.nbytes, offset=data_offset)
        return cls(name, path, geometry, data, mm)

    def pin(self, registrar: Any = None, max_chunk_bytes: int | None = None) -> Any:
        """Register the rows with the GPU driver in row-aligned chunks (at most 64 GiB each; on a failed
        chunk the earlier ones are unregistered and the region stays pageable). Returns the PinnedRegion."""
        from kvxfer.executors import pin_host_memory

        kw = {} if max_chunk_bytes is None else {"max_chunk_bytes": max_chunk_bytes}
        self._pinned = pin_host_memory(self.data, self.geometry.row_stride_bytes, registrar, **kw)
        return self._pinned

    def close(self) -> None:
        """Unregister (if pinned) and unmap. Views of ``data`` must be gone first."""
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        if self._mmap is not None:
            self.data = np.zeros(0, np.uint8)
            try:
                self._mmap.close()
            except BufferError:  # a view is still exported; the mapping goes when it does
                pass
            self._mmap = None


def _owners(path: Path) -> list[tuple[int, int]] | None:
    """The (pid, start time) pairs recorded in a region file, or None when it is not a region."""
    try:
        with open(path, "rb") as f:
            head = f.read(_JSON_AT)
    except OSError:
        return None
    if len(head) < _JSON_AT or head[:8] != MAGIC:
        return None
    count = _FIXED.unpack(head[:_FIXED.size])[4]
    return [_PID.unpack_from(head, _PIDS_AT + i * _PID.size) for i in range(min(count, MAX_PIDS - 1) + 1)]


def find_stale(directory: str | os.PathLike = "/dev/shm") -> list[Path]:
    """Region files (and leftover temporary files) whose every recorded process is dead."""
    out = []
    for p in sorted(Path(directory).glob(f"{PREFIX}*")) + sorted(Path(directory).glob(f".{PREFIX}*.tmp")):
        if p.name.endswith(".tmp"):
            pid = int(p.name.rsplit(".", 2)[1]) if p.name.rsplit(".", 2)[1].isdigit() else 0
            if pid and not _alive(pid, 0):
                out.append(p)
            continue
        owners = _owners(p)
        if owners is not None and not any(_alive(pid, start) for pid, start in owners if pid):
            out.append(p)
    return out


def remove_stale(directory: str | os.PathLike = "/dev/shm") -> list[Path]:
    """Unlink every stale region in ``directory``; returns what was removed."""
    removed = []
    for p in find_stale(directory):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
