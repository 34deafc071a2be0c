"""Files as NIXL sees them: a plan buffer with ``location="file"`` bound to an open file descriptor.

The plan says only which bytes of the buffer move and how they must be aligned (``Buffer.align_bytes``);
where the file lives, whether it is created, and whether it is opened with O_DIRECT belong here, so plans
and goldens stay machine-independent. NIXL's storage backends (POSIX here; GDS and GDS_MT on GPU machines)
address a file as ``(file_offset, length, fd)`` descriptors of memory type FILE, registered by the agent
that reads or writes it: the "remote" side of such a transfer is the agent itself. Nothing here imports nixl.

Trust. A file the process did not create may have been planted: a symbolic link at the path (its target would be
overwritten), a file of another user (who could read the spilled KV and forge chunks: CRC-32 is not a MAC), or
one others may write. ``open_file`` never follows a link at the last path component and creates files private to
their owner (0600, O_EXCL); ``untrusted`` says why an existing file must be refused unless the caller opts in;
``lock_file`` takes an exclusive advisory lock with a bounded wait. The offload layer's shared regions and
integrity records use the same three.
"""
from __future__ import annotations

import errno
import fcntl
import os
import stat
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from kvxfer.planner import Buffer, Location

from .memory import BindingError
from .nixl_memory import Registration, RemoteBuffer, Segment


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
    owned by another user, or writable by its group or others (``allow_foreign`` accepts the last two)."""
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        return f"not a regular file (mode {stat.filemode(st.st_mode)})"
    if allow_foreign:
        return None
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not by this process's user (uid {os.geteuid()}): another user could read or forge it"
    if st.st_mode & 0o022:
        return f"writable by {'others' if st.st_mode & 0o002 else 'its group'} (mode {stat.filemode(st.st_mode)})"
    return None


def lock_file(fd: int, timeout_s: float) -> bool:
    """Take an exclusive advisory lock (flock) on ``fd``, waiting at most ``timeout_s`` seconds; False if another
    open file description still holds it then (another process, or another open of the file in this one)."""
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
    BindingError naming the buffer and the path. A link at the path is never followed, a file it creates is
    private to its owner (0600), and an existing file owned by another user or writable by others is refused
    unless ``allow_foreign`` (a file that is not regular is always refused). ``created`` says whether ``open``
    made the file. ``close()`` closes the descriptor.
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
        name = buffer.name
        if buffer.location is not Location.FILE:
            raise BindingError(name, repr(self), f"the plan places this buffer in {buffer.location.value} memory, "
                               "not in a file (Buffer(location='file'))")
        if self.o_direct:
            for what, value in (("buffer's align_bytes", buffer.align_bytes), ("file offset", self.offset)):
                if value % self.block_bytes:
                    raise BindingError(name, f"{what} {value}", f"O_DIRECT needs multiples of the block size "
                                       f"{self.block_bytes} (declare Buffer(align_bytes={self.block_bytes}))")
        flags = (os.O_RDONLY if self.readonly else os.O_RDWR) | (os.O_DIRECT if self.o_direct else 0)
        try:
            fd, created = open_file(self.path, flags, create=self.create)
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
        want = self.offset + (self.size if self.size is not None else buffer.nbytes)
        try:
            st = os.fstat(fd)
            why = None if created else untrusted(st, self.allow_foreign)
            if why is not None:
                raise BindingError(name, str(self.path), f"{why}; refused (FileBinding(allow_foreign=True) accepts a "
                                   "file you trust)")
            if self.create and st.st_size < want:
                os.ftruncate(fd, want)
        except OSError as e:
            os.close(fd)
            raise BindingError(name, str(self.path), f"cannot size the file to {want} bytes: {e.strerror}") from None
        except BindingError:
            os.close(fd)
            raise
        self.fd, self.buffer, self._identity, self.created = fd, buffer, (st.st_dev, st.st_ino), created
        return self

    def _opened(self) -> tuple[int, Buffer]:
        if self.fd is None or self.buffer is None:
            raise BindingError(str(self.path), "not open", "open(buffer) the binding first")
        return self.fd, self.buffer

    # ---- checks --------------------------------------------------------------------------------------------
    def file_size(self) -> int:
        """The file's size now; BindingError when the descriptor was closed or now refers to another file."""
        fd, buf = self._opened()
        try:
            st = os.fstat(fd)
        except OSError as e:
            raise BindingError(buf.name, f"fd {fd} of {str(self.path)!r}", f"descriptor unusable: {e.strerror}") from None
        if (st.st_dev, st.st_ino) != self._identity:
            raise BindingError(buf.name, f"fd {fd} of {str(self.path)!r}", "the descriptor was closed and now refers "
                               "to another file")
        return st.st_size

    def check_extent(self, end: int) -> None:
        """Raise BindingError unless the file holds buffer bytes up to ``end`` (a READ must not come up short)."""
        _, buf = self._opened()
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

    # ---- NIXL ----------------------------------------------------------------------------------------------
    @property
    def segment(self) -> Segment:
        """The opened file as one of this agent's FILE segments (file offset, length, fd); BindingError if it is not open."""
        fd, buf = self._opened()
        return Segment(self.offset, buf.nbytes, fd, "FILE", not self.readonly)

    def remote(self, agent_name: str) -> RemoteBuffer:
        """The file as the other side of a transfer posted by ``agent_name`` itself (file offset, length, fd)."""
        fd, buf = self._opened()
        return RemoteBuffer(agent_name, self.offset, buf.nbytes, fd, "FILE")

    def close(self) -> None:
        """Close the descriptor (deregister it from every agent first)."""
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


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
    segments = {name: fb.segment for name, fb in files.items()}
    rows = [(s.addr, s.nbytes, s.dev, name) for name, s in segments.items()]
    handles = [agent.register_memory(rows, "FILE")] if rows else []
    return Registration(agent, segments, handles, list(files.values()))
