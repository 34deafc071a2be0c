"""Files: where a file buffer lives (``FileBinding``), and opening files a process may not have made itself: no
links followed, nothing foreign trusted, bounded locks.

A file the process did not create may have been planted: a symbolic link at the path (its target would be
overwritten), a hard link to a file elsewhere (a write through this name changes that file: a spill overwrites
it, records truncate it), a file of another user (who could read the spilled KV and forge chunks: CRC-32 is not a
MAC), or one others may write. ``open_file`` never follows a symbolic link at the last path component and creates
files private to their owner (0600, O_EXCL); ``untrusted`` says why an existing file must be refused unless the
caller opts in; ``lock_file`` takes an exclusive advisory lock with a bounded wait (``timeout_refusal`` says why a
wait bound bounds nothing). The file binding (``FileBinding``, which the POSIX and NIXL executors and the offload
layer's file tiers bind file buffers to), the offload layer's integrity records and its shared host regions all
use these, so one file gets one verdict wherever it is opened.

One opt-in, ``allow_foreign``, accepts a file whose provenance the caller vouches for: another user's, one others
may write, or one with more than one name (hard links). These are the same question (could someone else reach
these bytes by another route?), and one flag keeps one key per file in every configuration that names a file.
"""
from __future__ import annotations

import errno
import fcntl
import math
import os
import stat
import time
from pathlib import Path
from typing import Any

from kvxfer.planner import Buffer, Location

from ._memory import BindingError


class TimeoutValueError(ValueError):
    """A wait bound that bounds nothing (nan, infinite, not a number): names the field, the value and why."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r}: {reason}")


def open_file(path: str | os.PathLike[str], flags: int, *, create: bool, mode: int = 0o600) -> tuple[int, bool]:
    """Open ``path`` with ``flags`` without following a symbolic link at its last component (openat on the
    parent directory with O_NOFOLLOW). With ``create``, a missing file is created with O_EXCL and ``mode``
    (private to the owner by default). Returns ``(fd, created)``; raises OSError (ELOOP for a link,
    FileNotFoundError for a missing file)."""
    p = Path(path)
    parent = os.open(p.parent if str(p.parent) else ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        flags |= os.O_NOFOLLOW | os.O_CLOEXEC
        if create:
            try:
                return os.open(p.name, flags | os.O_CREAT | os.O_EXCL, mode, dir_fd=parent), True
            except FileExistsError:  # there already: opened below, without following a link, then checked
                pass
        return os.open(p.name, flags, dir_fd=parent), False
    finally:
        os.close(parent)


def untrusted(st: os.stat_result, allow_foreign: bool = False) -> str | None:
    """Why an existing file with status ``st`` must not be trusted, or None: not a regular file (or block device),
    owned by another user, writable by its group or others, or reachable by more than one name (``st_nlink`` > 1:
    hard links); ``allow_foreign`` accepts the last three."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    if allow_foreign:
        return None
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's user (uid {os.geteuid()}): another user could read or forge it"
    if st.st_mode & 0o022:
        return f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.filemode(st.st_mode)})"
    if st.st_nlink > 1:
        return f"a file with {st.st_nlink} names (hard links): a write here changes the file under its other names"
    return None


def timeout_refusal(timeout_s: object) -> str | None:
    """Why ``timeout_s`` cannot bound a wait, or None: it must be a real number (not a bool) and finite (nan never
    compares past a deadline, and an infinite one is no bound). Zero and negative numbers mean "do not wait"."""
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)):
        return f"expected a number of seconds, got {type(timeout_s).__name__}"
    if not math.isfinite(timeout_s):
        return "must be a finite number of seconds (nan or infinity would wait forever)"
    return None


def lock_file(fd: int, timeout_s: float) -> bool:
    """Take an exclusive advisory lock (flock) on ``fd``, waiting at most ``timeout_s`` seconds; False if another
    open file description still holds it then (another process, or another open of the file in this one).
    Raises TimeoutValueError (field ``timeout_s``) for a bound that bounds nothing, before trying the lock."""
    why = timeout_refusal(timeout_s)
    if why is not None:
        raise TimeoutValueError("timeout_s", timeout_s, why)
    deadline, pause = time.monotonic() + max(timeout_s, 0.0), 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(min(pause, max(deadline - time.monotonic(), 0.0)))
            pause = min(pause * 2, 0.05)


class FileBinding:
    """Where a file buffer lives: ``path``; ``create`` it if missing (extended, sparse, to ``size`` bytes or the
    buffer's extent); ``o_direct`` to bypass the page cache, which needs offsets, sizes and memory addresses
    aligned to ``block_bytes`` (the device's logical block size; 4 KiB is safe); buffer byte 0 sits at file
    offset ``offset``; ``readonly`` opens it for reading only.

    ``open(buffer)`` opens the descriptor once and checks what can be checked without I/O; every error is a
    BindingError naming the buffer and the path. A symbolic link at the path is never followed, a file it creates
    is private to its owner (0600), and an existing file owned by another user, writable by others or with more
    than one name (a hard link) is refused unless ``allow_foreign`` (a file that is not regular is always refused;
    see ``file_trust``). ``created`` says whether ``open`` made the file. ``close()`` closes the descriptor.
    """

    def __init__(self, path: str | os.PathLike[str], *, create: bool = False, size: int | None = None,
                 o_direct: bool = False, block_bytes: int = 4096, offset: int = 0, readonly: bool = False,
                 allow_foreign: bool = False):
        if block_bytes <= 0 or block_bytes & (block_bytes - 1):
            raise BindingError(str(path), f"block_bytes={block_bytes}", "must be a power of two")
        if offset < 0 or (size is not None and size < 0):
            raise BindingError(str(path), f"offset={offset}, size={size}", "must be non-negative")
        if create and readonly:
            raise BindingError(str(path), "create=True, readonly=True", "a read-only binding cannot create the file")
        self.path, self.create, self.size = Path(path), create, size
        self.o_direct, self.block_bytes, self.offset, self.readonly = o_direct, block_bytes, offset, readonly
        self.allow_foreign, self.created = allow_foreign, False
        self.fd: int | None = None
        self.buffer: Buffer | None = None
        self._identity: tuple[int, int] | None = None

    def __repr__(self) -> str:
        mode = "r" if self.readonly else "rw"
        return (f"FileBinding({str(self.path)!r}, {mode}{', O_DIRECT' if self.o_direct else ''}, offset={self.offset}"
                f"{f', fd={self.fd}' if self.fd is not None else ''})")

    # ---- opening ---------------------------------------------------------------------------------------------
    def open(self, buffer: Buffer) -> FileBinding:
        """Open the file for ``buffer`` (a plan Buffer with location "file"); returns self. Idempotent."""
        if self.fd is not None:
            if self.buffer is not None and self.buffer != buffer:
                raise BindingError(buffer.name, repr(self), f"already bound to buffer {self.buffer.name!r}")
            return self
        self._check_buffer(buffer)
        fd, created = self._open_fd(buffer.name)
        want = self.offset + (self.size if self.size is not None else buffer.nbytes)
        try:
            st = self._trusted(buffer.name, fd, created, want)
        except BaseException:
            os.close(fd)
            raise
        self.fd, self.buffer, self._identity, self.created = fd, buffer, (st.st_dev, st.st_ino), created
        return self

    def _check_buffer(self, buffer: Buffer) -> None:
        """The buffer must be a file buffer, aligned for O_DIRECT when that is asked for (BindingError)."""
        if buffer.location is not Location.FILE:
            raise BindingError(buffer.name, repr(self), f"the plan places this buffer in {buffer.location.value} memory, "
                               "not in a file (Buffer(location='file'))")
        if self.o_direct:
            for what, value in (("buffer's align_bytes", buffer.align_bytes), ("file offset", self.offset)):
                if value % self.block_bytes:
                    raise BindingError(buffer.name, f"{what} {value}", f"O_DIRECT needs multiples of the block size "
                                       f"{self.block_bytes} (declare Buffer(align_bytes={self.block_bytes}))")

    def _open_fd(self, name: str) -> tuple[int, bool]:
        """``(fd, created)`` for the path, never through a link; each OSError becomes a BindingError saying why."""
        flags = (os.O_RDONLY if self.readonly else os.O_RDWR) | (os.O_DIRECT if self.o_direct else 0)
        try:
            return open_file(self.path, flags, create=self.create)
        except FileNotFoundError:
            raise BindingError(name, str(self.path), "no such file (FileBinding(create=True) creates it)") from None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise BindingError(name, str(self.path), "is a symbolic link: refused (it could point anywhere); "
                                   "bind the file itself") from None
            if self.o_direct and e.errno == errno.EINVAL:
                raise BindingError(name, str(self.path), "the filesystem refuses O_DIRECT (tmpfs such as /dev/shm "
                                   "does): use a disk-backed directory or o_direct=False") from None
            raise BindingError(name, str(self.path), f"cannot open: {e.strerror} (errno {e.errno})") from None

    def _trusted(self, name: str, fd: int, created: bool, want: int) -> os.stat_result:
        """The status of the opened file once it is trusted (one it did not create passes ``untrusted``) and, with
        ``create``, extended to ``want`` bytes. BindingError otherwise; the caller closes ``fd``."""
        try:
            st = os.fstat(fd)
            why = None if created else untrusted(st, self.allow_foreign)
            if why is not None:
                raise BindingError(name, str(self.path), f"{why}; refused (FileBinding(allow_foreign=True) accepts a "
                                   "file you trust)")
            if self.create and st.st_size < want:
                os.ftruncate(fd, want)
        except OSError as e:
            raise BindingError(name, str(self.path), f"cannot size the file to {want} bytes: {e.strerror}") from None
        return st

    def opened(self) -> tuple[int, Buffer]:
        """``(descriptor, buffer)`` of the open binding; BindingError if ``open`` has not run (or ``close`` has)."""
        if self.fd is None or self.buffer is None:
            raise BindingError(str(self.path), "not open", "open(buffer) the binding first")
        return self.fd, self.buffer

    # ---- checks --------------------------------------------------------------------------------------------
    def file_size(self) -> int:
        """The file's size now; BindingError when the descriptor was closed or now refers to another file."""
        fd, _ = self.opened()
        return self._checked(fd, fd).st_size

    def duplicate(self) -> int:
        """A new descriptor of the file opened (``os.dup``), for I/O that must reach this file and no other: checked
        to be the file opened (st_dev, st_ino) after it is made, so it stays this file whatever later happens to
        ``fd``. BindingError when the descriptor was closed or now refers to another file (closed behind the
        binding and reused). The caller closes it."""
        fd, buf = self.opened()
        try:
            dup = os.dup(fd)
        except OSError as e:
            raise BindingError(buf.name, f"fd {fd} of {str(self.path)!r}", f"descriptor unusable: {e.strerror}") from None
        try:
            self._checked(dup, fd)
        except BaseException:
            os.close(dup)
            raise
        return dup

    def _checked(self, fd: int, shown: int) -> os.stat_result:
        """The status of ``fd``, which must be the file opened; BindingError naming descriptor ``shown`` otherwise."""
        _, buf = self.opened()
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise BindingError(buf.name, f"fd {shown} of {str(self.path)!r}", f"descriptor unusable: {e.strerror}") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise BindingError(buf.name, f"fd {shown} of {str(self.path)!r}", "the descriptor was closed and now refers "
                               "to another file")
        return st

    def check_extent(self, end: int) -> None:
        """Raise BindingError unless the file holds buffer bytes up to ``end`` (a READ must not come up short)."""
        _, buf = self.opened()
        size = self.file_size()
        if self.offset + end > size:
            raise BindingError(buf.name, str(self.path), f"short file: reading buffer bytes up to {end} needs "
                               f"{self.offset + end} bytes, the file has {size}")

    def check_memory(self, name: str, address: int, align_bytes: int) -> None:
        """For O_DIRECT: memory bound to buffer ``name`` must start on a block and declare block-aligned ranges."""
        if not self.o_direct:
            return
        if address % self.block_bytes:
            raise BindingError(name, f"address {address:#x}", f"O_DIRECT I/O with {str(self.path)!r} needs memory "
                               f"aligned to {self.block_bytes} bytes (kvxfer.offload.aligned_empty)")
        if align_bytes % self.block_bytes:
            raise BindingError(name, f"align_bytes {align_bytes}", f"O_DIRECT I/O with {str(self.path)!r} needs the "
                               f"memory buffer's ranges aligned too: Buffer(align_bytes={self.block_bytes})")

    def close(self) -> None:
        """Close the descriptor (deregister it from every agent first)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)
