"""One host region mapped by several processes (TP ranks): a file in /dev/shm holding a header and the rows.

Lifecycle. One process ``create``s the region (written under a temporary name, then linked to its name, so
no one attaches to a half-written header); the others ``attach`` by name. Each attach is recorded under a file
lock, and ``close`` marks the record detached; the attach that brings the counted attachers to the expected
count unlinks the name. From then on the memory belongs to the processes that map it and goes away with the
last of them, however they end (SIGKILL included). An attacher counts while its process lives or once it
detached; one that died attached (killed, or gone without ``close``) is not counted, so a rank restarted after a
crash still gets in. A region whose name is still there but whose recorded processes are all dead or detached
is stale: ``find_stale`` lists such regions and ``remove_stale`` unlinks them.

Trust. A region file is created private to its owner (0600) without following links; ``attach`` never follows a
link either, waits at most ``lock_timeout_s`` (a finite number) for the attach lock, refuses a region owned by
another user, writable by others or reachable by another name (a hard link) unless ``allow_foreign`` (the checks
of ``kvxfer.executors.file_trust``), and checks every header field before mapping anything: a bad field raises
one SharedRegionError naming the field and its value. Names are checked in one place (``tier.region_name``) for
the SharedSpec model and this class alike. ``find_stale`` looks only at regular files with a region's header, and
opens nothing in a way that could block; a name taken by anything else is reported as such by ``create``.

Header (``data_offset`` bytes, a multiple of 4 KiB): magic, sizes, the attach count and table of (pid, start
time) pairs (slot 0: the creator; a negative pid: detached), then the Geometry as JSON. Rows start at
``data_offset``.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import stat
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import file_trust  # open without links, refuse foreign or linked files, bounded locks

from .tier import Geometry, region_name

MAGIC = b"KVXFER01"
PREFIX = "kvxfer-"
MAX_PIDS = 64
MAX_JSON_BYTES = 1 << 20
_FIXED = struct.Struct("<8sqqqq")  # magic, data_offset, json_bytes, expected attachers, attached count
_PID = struct.Struct("<qq")  # pid, process start time (clock ticks since boot; 0 = unknown)
_PIDS_AT = 64
_JSON_AT = _PIDS_AT + MAX_PIDS * _PID.size
PAGE = 4096
LOCK_TIMEOUT_S = 10.0
PID_MAX = 2**31 - 1  # pid_t is 32 bits: a recorded pid past it names no process (and os.kill refuses it)

StrPath = str | os.PathLike[str]


class SharedRegionError(RuntimeError, ValueError):
    """A shared host region cannot be created, attached or read; names the region, the reason and, for a bad
    header or argument, the ``field`` and its ``value``."""

    def __init__(self, name: str, reason: str, field: str | None = None, value: Any = None):
        self.name, self.reason, self.field, self.value = name, reason, field, value
        where = "" if field is None else f"{field} = {value!r}: "
        super().__init__(f"shared host region {name!r}: {where}{reason}")


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


def path_of(name: str, directory: StrPath = "/dev/shm") -> Path:
    """The path of the shared region ``name`` in ``directory`` (the name gets the kvxfer prefix). Raises
    SharedRegionError for a name that could leave the directory or is not a plain file name."""
    why = region_name(name)
    if why is not None:
        raise SharedRegionError(str(name), why, "name", name)
    return Path(directory) / f"{PREFIX}{name}"


def _open(name: str, path: Path, flags: int) -> int:
    try:
        return file_trust.open_file(path, flags, create=False)[0]
    except FileNotFoundError:
        raise SharedRegionError(name, f"no such region at {path} (not created yet, or every rank already attached "
                                "and the name was unlinked)") from None
    except OSError as e:
        why = "is a symbolic link: refused" if e.errno == errno.ELOOP else f"cannot open: {e.strerror}"
        raise SharedRegionError(name, f"{path} {why}") from None


def _trusted(name: str, path: Path, fd: int, allow_foreign: bool, lock_timeout_s: float) -> os.stat_result:
    """Take the attach lock on region file ``fd`` (at most ``lock_timeout_s``), then its status once trusted
    (``file_trust.untrusted``): checked under the lock, since a creator holds it while its file has two names.
    SharedRegionError otherwise."""
    if not file_trust.lock_file(fd, lock_timeout_s):
        raise SharedRegionError(name, f"the attach lock on {path} is held by another process for more than "
                                f"{lock_timeout_s} s (a stopped or hung attacher)")
    st = os.fstat(fd)
    why = file_trust.untrusted(st, allow_foreign)
    if why is not None:
        raise SharedRegionError(name, f"{path} is {why}; refused (attach(..., allow_foreign=True) accepts a region "
                                "you trust)")
    return st


def _new_file(name: str, tmp: Path) -> int:
    """A new private file at ``tmp`` (never one already there: it could be planted). SharedRegionError otherwise."""
    try:
        fd, created = file_trust.open_file(tmp, os.O_RDWR, create=True)
    except OSError as e:
        raise SharedRegionError(name, f"cannot create {tmp}: {e.strerror}") from None
    if not created:  # never write through a file someone else put there
        os.close(fd)
        raise SharedRegionError(name, f"{tmp} exists already (a planted file, or one left by an earlier process with "
                                "this pid; remove it if nothing uses it)")
    return fd


def _publish(name: str, tmp: Path, path: Path) -> None:
    """Give the finished file at ``tmp`` the region's name, never over a file already there; ``tmp`` goes either
    way. SharedRegionError says what holds the name."""
    try:
        os.link(tmp, path, follow_symlinks=False)
    except FileExistsError:
        raise SharedRegionError(name, f"{path} exists ({_holder(path)})") from None
    finally:
        os.unlink(tmp)


def _holder(path: Path) -> str:
    """What holds a region's name, with what to do about it: a live region, a stale one, or another file."""
    owners = _owners(path)
    if owners is None:
        return ("not a kvxfer region: remove_stale leaves it alone; remove it if nothing uses it, or choose another "
                "name")
    live = [pid for pid, start in owners if pid > 0 and _alive(pid, start)]
    if live:
        return f"another live region, of processes {live[:8]}"
    return "a stale region whose processes are all gone: remove_stale() removes it"


@dataclass(frozen=True)
class _Header:
    data_offset: int
    json_bytes: int
    expected: int
    pids: tuple[tuple[int, int], ...]  # the recorded attachers (slot 0, the creator, excluded)
    geometry: Geometry


def _header(name: str, fd: int, size: int) -> _Header:
    """Every header field of region file ``fd`` (of ``size`` bytes), each checked: SharedRegionError names the first
    bad one."""
    raw = os.pread(fd, _JSON_AT, 0)
    if len(raw) < _JSON_AT:
        raise SharedRegionError(name, f"the file ends inside the header (it needs {_JSON_AT} bytes)", "size", size)
    magic, data_offset, json_bytes, expected, count = _FIXED.unpack_from(raw)
    if magic != MAGIC:
        raise SharedRegionError(name, "not a kvxfer region", "magic", magic)
    if not 0 < json_bytes <= min(MAX_JSON_BYTES, size - _JSON_AT):
        raise SharedRegionError(name, f"must be 1 ..{min(MAX_JSON_BYTES, size - _JSON_AT)} (the geometry fits in the file)",
                                "json_bytes", json_bytes)
    if data_offset % PAGE or data_offset < _JSON_AT + json_bytes or data_offset > size:
        raise SharedRegionError(name, f"must be a multiple of {PAGE} past the header's {_JSON_AT + json_bytes} bytes "
                                f"and inside the file of {size} bytes (rows never overlap the header)", "data_offset",
                                data_offset)
    if not 0 <= expected < MAX_PIDS:
        raise SharedRegionError(name, f"must be 0 ..{MAX_PIDS - 1}", "expected attachers", expected)
    if not 0 <= count <= expected:
        raise SharedRegionError(name, f"must be 0 ..{expected} (the expected attachers)", "attached count", count)
    pids = tuple(_PID.unpack_from(raw, _PIDS_AT + i * _PID.size) for i in range(1, count + 1))
    for i, (pid, start) in enumerate(pids, start=1):
        if pid == 0 or start < 0:
            raise SharedRegionError(name, "must hold a process id and a start time", f"pids[{i}]", (pid, start))
        if abs(pid) > PID_MAX:
            raise SharedRegionError(name, f"the process id is past pid_t (at most {PID_MAX}): no process has it",
                                    f"pids[{i}]", (pid, start))
    try:
        geometry = Geometry.model_validate_json(os.pread(fd, json_bytes, _JSON_AT))
    except ValueError as e:
        text = str(e)
        raise SharedRegionError(name, f"not a valid Geometry: {text[:200]}", "geometry", f"{json_bytes} bytes of JSON") from None
    if data_offset + geometry.nbytes > size:
        raise SharedRegionError(name, f"the rows need {data_offset + geometry.nbytes} bytes, the file holds {size}",
                                "size", size)
    return _Header(data_offset, json_bytes, expected, pids, geometry)


@dataclass
class SharedRegion:
    """A mapped shared region. ``data`` is a writable uint8 view of the rows; ``close()`` unmaps (and
    unregisters a pinning); the memory stays while another process maps it."""

    name: str
    path: Path
    geometry: Geometry
    data: np.ndarray
    _mmap: mmap.mmap | None = field(repr=False)
    _pinned: Any = field(default=None, repr=False)
    _fd: int | None = field(default=None, repr=False)  # kept to mark this process detached at close

    @classmethod
    def create(cls, name: str, geometry: Geometry, *, attachers: int = 0, directory: StrPath = "/dev/shm",
               fill: int | None = 0) -> SharedRegion:
        """Create and map the region, private to this user; ``attachers`` other processes will attach (0: the name
        is unlinked now). ``fill`` None leaves the rows as the file system gives them (zeros on tmpfs). Raises
        SharedRegionError for a bad name or count, or when the name is taken (saying by what)."""
        path = path_of(name, directory)
        if isinstance(attachers, bool) or not isinstance(attachers, int) or not 0 <= attachers < MAX_PIDS:
            raise SharedRegionError(name, f"must be an integer 0 ..{MAX_PIDS - 1}", "attachers", attachers)
        body = geometry.model_dump_json().encode()
        data_offset = -(-(_JSON_AT + len(body)) // PAGE) * PAGE
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = _new_file(name, tmp)
        try:
            # held until the name stands alone: an attacher checks the file's links under this lock, and between
            # the link and the unlink below the file has two names
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, data_offset + geometry.nbytes)
            os.pwrite(fd, _FIXED.pack(MAGIC, data_offset, len(body), attachers, 0), 0)
            os.pwrite(fd, _PID.pack(os.getpid(), _start_time(os.getpid())), _PIDS_AT)
            os.pwrite(fd, body, _JSON_AT)
            _publish(name, tmp, path)
            if attachers == 0:
                os.unlink(path)
            fcntl.flock(fd, fcntl.LOCK_UN)
            region = cls._map(name, path, fd, data_offset, geometry)
        except BaseException:
            os.close(fd)
            raise
        if fill is not None and fill != 0:
            region.data[:] = fill
        return region

    @classmethod
    def attach(cls, name: str, directory: StrPath = "/dev/shm", *, allow_foreign: bool = False,
               lock_timeout_s: float = LOCK_TIMEOUT_S) -> SharedRegion:
        """Map the region created under ``name``; the attach that brings the live attachers to the expected count
        unlinks the name. Raises SharedRegionError: a ``lock_timeout_s`` that is not a finite number, no such
        region, a symbolic link, a region of another user, writable by others or with another name (a hard link)
        unless ``allow_foreign``, the lock held past ``lock_timeout_s``, a bad header field, or every expected
        attacher already attached and alive."""
        path = path_of(name, directory)
        why = file_trust.timeout_refusal(lock_timeout_s)
        if why is not None:
            raise SharedRegionError(name, why, "lock_timeout_s", lock_timeout_s)
        fd = _open(name, path, os.O_RDWR)
        try:
            st = _trusted(name, path, fd, allow_foreign, lock_timeout_s)
            h = _header(name, fd, st.st_size)
            counted = [p for p in h.pids if p[0] < 0 or _alive(*p)]  # detached, or alive: not killed
            if len(counted) >= h.expected:
                raise SharedRegionError(name, f"all {h.expected} expected attachers already attached (pids: "
                                        f"{[abs(pid) for pid, _ in counted][:8]})")
            counted.append((os.getpid(), _start_time(os.getpid())))
            os.pwrite(fd, b"".join(_PID.pack(*p) for p in counted), _PIDS_AT + _PID.size)
            os.pwrite(fd, _FIXED.pack(MAGIC, h.data_offset, h.json_bytes, h.expected, len(counted)), 0)
            if len(counted) == h.expected:
                _unlink_if_same(path, st)
            fcntl.flock(fd, fcntl.LOCK_UN)  # now: the mapping keeps a duplicate of fd, which would keep the lock
            return cls._map(name, path, fd, h.data_offset, h.geometry)
        except BaseException:
            os.close(fd)
            raise

    @classmethod
    def _map(cls, name: str, path: Path, fd: int, data_offset: int, geometry: Geometry) -> SharedRegion:
        mm = mmap.mmap(fd, data_offset + geometry.nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        data = np.frombuffer(mm, dtype=np.uint8, count=geometry.nbytes, offset=data_offset)
        return cls(name, path, geometry, data, mm, _fd=fd)

    def pin(self, registrar: Any = None, max_chunk_bytes: int | None = None) -> Any:
        """Register the rows with the GPU driver in row-aligned chunks (at most 64 GiB each; on a failed
        chunk the earlier ones are unregistered and the region stays pageable). Returns the PinnedRegion."""
        from kvxfer.executors import pin_host_memory

        kw = {} if max_chunk_bytes is None else {"max_chunk_bytes": max_chunk_bytes}
        self._pinned = pin_host_memory(self.data, self.geometry.row_stride_bytes, registrar, **kw)
        return self._pinned

    def close(self) -> None:
        """Unregister (if pinned), mark this process detached (it keeps counting as an attacher), and unmap. Views
        of ``data`` must be gone first."""
        if self._pinned is not None:
            self._pinned.close()
            self._pinned = None
        if self._fd is not None:
            fd, self._fd = self._fd, None
            try:
                _detach(fd)
            finally:
                os.close(fd)
        if self._mmap is not None:
            self.data = np.zeros(0, np.uint8)
            try:
                self._mmap.close()
            except BufferError:  # a view is still exported; the mapping goes when it does
                pass
            self._mmap = None


def _detach(fd: int) -> None:
    """Mark this process's first attached record detached (best effort: a header no one can lock or read is left)."""
    me = (os.getpid(), _start_time(os.getpid()))
    try:
        if not file_trust.lock_file(fd, LOCK_TIMEOUT_S):
            return
        raw = os.pread(fd, _JSON_AT, 0)
        count = min(max(_FIXED.unpack_from(raw)[4], 0), MAX_PIDS - 1)
        for i in range(count + 1):  # slot 0: the creator
            if _PID.unpack_from(raw, _PIDS_AT + i * _PID.size) == me:
                os.pwrite(fd, _PID.pack(-me[0], me[1]), _PIDS_AT + i * _PID.size)
                return
    except (OSError, struct.error):
        return
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)


def _unlink_if_same(path: Path, st: os.stat_result) -> None:
    """Unlink ``path`` if it still names the file ``st`` describes (not one put in its place since)."""
    try:
        now = os.stat(path, follow_symlinks=False)
        if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
            os.unlink(path)
    except FileNotFoundError:
        pass


def _open_regular(path: Path) -> int | None:
    """A read-only descriptor of ``path`` if it is a regular file, else None (a link, a FIFO, a directory, a
    device, or gone). Never blocks: O_NONBLOCK, so a FIFO does not wait for a writer."""
    try:
        fd = file_trust.open_file(path, os.O_RDONLY | os.O_NONBLOCK, create=False)[0]
    except OSError:
        return None
    if stat.S_ISREG(os.fstat(fd).st_mode):
        return fd
    os.close(fd)
    return None


def _owners(path: Path) -> list[tuple[int, int]] | None:
    """The (pid, start time) pairs recorded in a region file (creator first), or None when it is not a region (not
    a regular file, no kvxfer magic, or a recorded pid past pid_t)."""
    fd = _open_regular(path)
    if fd is None:
        return None
    try:
        head = os.pread(fd, _JSON_AT, 0)
    finally:
        os.close(fd)
    if len(head) < _JSON_AT or head[:8] != MAGIC:
        return None
    count = _FIXED.unpack(head[:_FIXED.size])[4]
    owners = [_PID.unpack_from(head, _PIDS_AT + i * _PID.size) for i in range(min(max(count, 0), MAX_PIDS - 1) + 1)]
    return None if any(abs(pid) > PID_MAX for pid, _ in owners) else owners


def _stale_tmp(path: Path) -> bool:
    """Whether ``path`` is a temporary region file (a regular file) left by a process that is gone; a name whose
    pid no process could have is not one of kvxfer's."""
    pid_text = path.name.rsplit(".", 2)[1]
    pid = int(pid_text) if pid_text.isdigit() else 0
    if not 0 < pid <= PID_MAX:
        return False
    fd = _open_regular(path)
    if fd is None:
        return False
    os.close(fd)
    return not _alive(pid, 0)


def find_stale(directory: StrPath = "/dev/shm") -> list[Path]:
    """Region files (and leftover temporary files) whose every recorded process is dead. Only regular files
    with a kvxfer region's header count: anything else under a kvxfer name (a FIFO, a directory, a link, another
    program's file, a header naming impossible pids) is skipped, never opened in a way that could block."""
    out = []
    for p in sorted(Path(directory).glob(f"{PREFIX}*")):
        owners = _owners(p)
        if owners is not None and not any(_alive(pid, start) for pid, start in owners if pid > 0):
            out.append(p)
    return out + [p for p in sorted(Path(directory).glob(f".{PREFIX}*.tmp")) if _stale_tmp(p)]


def remove_stale(directory: StrPath = "/dev/shm") -> list[Path]:
    """Unlink every stale region in ``directory``; returns what was removed."""
    removed = []
    for p in find_stale(directory):
        try:
            p.unlink()
            removed.append(p)
        except FileNotFoundError:
            pass
    return removed
