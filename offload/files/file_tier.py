"""The storage tier: spill host memory to files and restore it, through a NixlExecutor with a storage backend
(POSIX here; GDS or GDS_MT on GPU machines), with stated durability and per-chunk integrity.

A tier layout places each region's blocks twice: the ``device`` placement in memory, the ``host`` placement
in a file buffer (``Buffer(location="file")``). A spill is then a d2h plan (memory -> file) and a restore an
h2d plan (file -> memory); merged plans make one I/O request per merged range. The tier binds its memory and
files once, through the executor's one binding path (``executor.bind``), and runs every job on that binding.

What a result promises:
- a spill is reported done only when its data is durable under ``durability`` (``none``: written to the
  page cache; ``fdatasync``: every touched file and its integrity records synced before the result);
- a failed write is reported failed, naming the files and the call (NIXL call, fdatasync, record write);
- a restore checks file extents before reading and after, that the file did not change under the read (its size,
  change time and holes: a file truncated and extended again reads as zeros), and every chunk's record and
  checksum after, so a short, torn, stale, corrupted or foreign spill is refused and never reported done.

Each job reads its plan once, into a copy only the tier holds (``TransferPlan.copy``): the chunks it checks, the
records it writes and the I/O it runs come from the same values, whatever a holder of the plan writes meanwhile.

Integrity: each file is cut into chunks of ``chunk_bytes`` (file-side ranges must be whole chunks). Beside the
file, ``<path>.kvxsum`` holds a header and one 16-byte record per chunk: the epoch of the spill that wrote it,
the CRC-32 of its bytes, and a check word over chunk, epoch, CRC and the file's identity. The identity is 16
random bytes written into the header when the records are created; the header also names the data file (its
resolved path, device and inode), so records that travel to another file (swapped, renamed into each other's
place, copied into another chunk's slot) are refused. The tier keeps the epoch it expects per chunk; a record
holding another epoch is stale, a mismatching checksum a torn or corrupted chunk. Epochs never repeat: each
tier starts above both the records it finds and the wall clock in microseconds, and a tier holds an exclusive
lock on its files (bounded wait, then BindingError), so two tiers never write one file. A spill first
invalidates the records of the chunks it writes (synced, under fdatasync, before any data is written), and
writes their new records only after the data (synced first, under fdatasync): a spill interrupted anywhere, a
crash included, leaves those chunks without a record, so they are refused, with ``verify=False`` too (which
skips only the CRC, never these checks). Epochs stay below ``EPOCH_LIMIT``: a record holding a larger one is
forged or corrupted and never trusted. Files are created private (0600).

For an offload worker: build one FileTier per engine over the host region and its spill files, then run
each spill or restore job as ``tier.spill(plan)`` / ``tier.restore(plan)``; a TierResult maps one to one onto
a job result (success, ``nbytes``, ``seconds``). Jobs block the calling thread and run one at a time.
"""
from __future__ import annotations

import errno
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from kvxfer.executors import BindingError, BoundMemory, ExecutorError, FileBinding, Stream, Transfer, file_trust
from kvxfer.planner import Buffer, Layout, Location, Placement, PlanError, Region, TransferPlan

from ..checksums import crc32  # ISA-L where installed, else zlib: the same values

MAGIC = b"KVXSUM02"
OLD_MAGICS = (b"KVXSUM01",)
# magic, chunk_bytes, chunks, buffer nbytes, identity, data file device, inode and offset, path length
HEADER = struct.Struct("<8sQQQ16sQQQI")
HEADER_BYTES = 4096  # the header and the data file's path; records follow
RECORD = np.dtype([("epoch", "<u8"), ("crc", "<u4"), ("check", "<u4")])
FAILED = np.uint64(2**64 - 1)  # expected epoch of a chunk whose last spill failed (or whose record is not trusted)
EPOCH_LIMIT = 1 << 62  # epochs a tier writes stay below this (the clock in microseconds is near 2^51)
LOCK_TIMEOUT_S = 5.0
PARALLEL_CRC_BYTES = 8 << 20  # a job checksumming at least this many bytes spreads its chunks over threads


class TierConfigError(ValueError):
    """A FileTier argument out of range; names the ``field`` and its ``value``."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value, self.reason = field, value, reason
        super().__init__(f"{field} = {value!r}: {reason}")


def check_timeout(field: str, value: Any) -> float:
    """``value`` as seconds to wait: a finite number >= 0 (TierConfigError naming ``field`` otherwise: NaN or
    infinity would wait forever)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise TierConfigError(field, value, "must be a finite number of seconds >= 0")
    return float(value)


class StorageExecutor(Protocol):
    """What a tier needs of its executor (a NixlExecutor with a storage backend): FILE registration, the one
    binding path, and runs on the binding."""

    def register(self, bindings: Mapping[str, Any], buffers: Layout | Sequence[Buffer] | None = None) -> Any:
        """Register ``bindings`` (here: FileBindings, opened for their buffers) with the agent; the result deregisters."""

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Mapping[str, Any]) -> BoundMemory:
        """Resolve and check every buffer's memory once (registering local memory)."""

    def run(self, plan: TransferPlan, memory: BoundMemory, stream: Stream = None) -> Transfer:
        """Post ``plan`` on ``memory``; the Transfer's ``wait`` raises ExecutorError when it failed."""


class Durability(StrEnum):
    """When a spill counts as done: ``none`` once NIXL reports the writes complete, ``fdatasync`` once files and records are
    synced."""

    NONE = "none"  # done once NIXL reports the writes complete (page cache; O_DIRECT: the device)
    FDATASYNC = "fdatasync"  # done once each touched file and its records are fdatasync'ed


class TierError(RuntimeError):
    """A spill or restore failed: names the operation, the step (NIXL call, fdatasync, ...) and the files."""

    def __init__(self, op: str, step: str, files: Sequence[str], reason: str, call: int | None = None):
        self.op, self.step, self.files, self.reason, self.call = op, step, tuple(files), reason, call
        where = f"{step} (call {call})" if call is not None else step
        super().__init__(f"{op} failed at {where} on {', '.join(self.files) or '-'}: {reason}")


class IntegrityError(TierError):
    """A chunk read back is not the one written: never spilled, stale, torn or corrupted. Names the chunk."""

    def __init__(self, op: str, file: str, chunk: int, reason: str):
        self.chunk = chunk
        super().__init__(op, "integrity check", [file], f"chunk {chunk}: {reason}")


@dataclass(frozen=True)
class TierResult:
    """One spill or restore: ``success``, bytes moved, seconds (through durability), chunks, the spill epoch."""

    op: str
    success: bool
    nbytes: int
    seconds: float
    chunks: int = 0
    epoch: int | None = None
    error: Exception | None = None

    def raise_for_error(self) -> TierResult:
        """Raise the recorded error, if any; otherwise return self."""
        if self.error is not None:
            raise self.error
        return self


def aligned_empty(nbytes: int, align: int = 4096) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose first byte sits on an ``align`` boundary (O_DIRECT memory)."""
    raw = np.empty(nbytes + align, dtype=np.uint8)
    start = (-raw.ctypes.data) % align
    return raw[start:start + nbytes]


def tier_layout(num_regions: int, num_blocks: int, page_bytes: int, *, files: int = 1, file_blocks: int | None = None,
                align_bytes: int = 1) -> Layout:
    """A spill layout: memory buffer ``mem`` (host; ``device`` placements, region-major) and file buffers
    ``file0..`` (``host`` placements; region r in file ``r % files``, region-major, ``file_blocks`` slots each).
    ``align_bytes`` goes on every buffer (4096 for O_DIRECT). Spills are d2h plans, restores h2d."""
    slots = num_blocks if file_blocks is None else file_blocks
    per_file = [len(range(f, num_regions, files)) for f in range(files)]
    buffers = [Buffer(name="mem", nbytes=num_regions * num_blocks * page_bytes, location=Location.HOST,
                      align_bytes=align_bytes)]
    buffers += [Buffer(name=f"file{f}", nbytes=max(n, 1) * slots * page_bytes, location=Location.FILE,
                       align_bytes=align_bytes) for f, n in enumerate(per_file)]
    regions = [Region(name=f"kv{r}", page_bytes=page_bytes,
                      device=Placement(buffer="mem", byte_offset=r * num_blocks * page_bytes),
                      host=Placement(buffer=f"file{r % files}", byte_offset=(r // files) * slots * page_bytes))
               for r in range(num_regions)]
    return Layout(buffers=tuple(buffers), regions=tuple(regions))


class _LandedCrcs:
    """A restore's chunk CRC-32s, computed as the POSIX executor's pieces land: ``on_read`` (on an I/O thread)
    hands each piece to the tier's CRC threads, which checksum its whole chunks while they are in the cache and
    the next piece is read; ``wait`` (on the job's thread) returns them per file buffer, in ``_chunks`` order."""

    def __init__(self, pool: ThreadPoolExecutor, chunk_bytes: int, first: np.ndarray, owner: np.ndarray,
                 counts: dict[int, int]):
        self.pool, self.chunk_bytes = pool, chunk_bytes
        self.first, self.owner = first.tolist(), owner.tolist()
        self.got = {i: np.zeros(n, np.uint32) for i, n in counts.items()}
        self.futures: list[Any] = []  # appended by I/O threads (list.append is atomic)

    def on_read(self, k: int, at: int, view: memoryview) -> None:
        self.futures.append(self.pool.submit(self._crc, k, at, view))

    def _crc(self, k: int, at: int, view: memoryview) -> None:
        n = self.chunk_bytes
        got, j = self.got[self.owner[k]], self.first[k] + at // n
        for q in range(len(view) // n):
            got[j + q] = crc32(view[q * n:(q + 1) * n])

    def wait(self) -> dict[int, np.ndarray] | None:
        """Every piece's CRCs once every task has finished; None when a task failed (the caller checksums the
        chunks itself)."""
        failed = [f for f in self.futures if f.exception() is not None]
        return None if failed else self.got


def _crc_each(pieces: Sequence[np.ndarray]) -> list[int]:
    """The CRC-32 of each piece, in order."""
    return [crc32(p) for p in pieces]


def _record_check(chunks: np.ndarray, epochs: np.ndarray, crcs: np.ndarray, identity: np.uint64) -> np.ndarray:
    """A check word per record: a record torn, written for another chunk or for another file does not verify."""
    mix = (chunks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ epochs ^ (crcs.astype(np.uint64) << np.uint64(17))
    mix = (mix ^ identity) * np.uint64(0xBF58476D1CE4E5B9)
    word: np.ndarray = ((mix ^ (mix >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    return word ^ np.uint32(0xA5A5A5A5)


class _Records:
    """The integrity records of one data file, in ``<path>.kvxsum``, and the epochs the tier expects.

    Opened without following a link and refused when foreign (the data file's FileBinding policy). A new (or
    reset) record file gets a fresh random identity and the data file's resolved path, device and inode; an
    existing one must name this very file at this path, with this layout, or it is refused (BindingError)."""

    def __init__(self, fb: FileBinding, chunk_bytes: int, buffer: Buffer):
        self.path = Path(f"{fb.path}.kvxsum")
        self.chunks = -(-buffer.nbytes // chunk_bytes)
        name, where = buffer.name, str(self.path)
        try:
            self.fd, created = file_trust.open_file(self.path, os.O_RDWR, create=True)
        except OSError as e:
            why = "is a symbolic link: refused" if e.errno == errno.ELOOP else f"cannot open: {e.strerror}"
            raise BindingError(name, where, f"integrity records {why}") from None
        try:
            data = os.fstat(self._data_fd(fb))
            st = os.fstat(self.fd)
            distrust = None if created else file_trust.untrusted(st, fb.allow_foreign)
            if distrust is not None:
                raise BindingError(name, where, f"integrity records {distrust}; refused")
            fields = (chunk_bytes, self.chunks, buffer.nbytes)
            target = os.path.realpath(fb.path).encode()
            if len(target) > HEADER_BYTES - HEADER.size:
                raise BindingError(name, str(fb.path), f"path longer than {HEADER_BYTES - HEADER.size} bytes")
            if created or st.st_size == 0 or fb.created:  # nothing on disk can be trusted: start over
                identity = os.urandom(16)
                head = HEADER.pack(MAGIC, *fields, identity, data.st_dev, data.st_ino, fb.offset, len(target))
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, (head + target).ljust(HEADER_BYTES, b"\0"), 0)
                os.ftruncate(self.fd, HEADER_BYTES + self.chunks * RECORD.itemsize)
            else:
                identity = self._check_header(name, fields, target, data, fb.offset)
        except BaseException:
            os.close(self.fd)
            raise
        self.identity: np.uint64 = np.frombuffer(identity[:8], "<u8")[0] ^ np.frombuffer(identity[8:], "<u8")[0]
        # what this tier trusts: the records at open, except epochs no tier writes (forged or corrupted)
        self.expected: np.ndarray = self.read(0, self.chunks)["epoch"].copy()
        self.expected[self.expected >= np.uint64(EPOCH_LIMIT)] = FAILED

    @staticmethod
    def _data_fd(fb: FileBinding) -> int:
        if fb.fd is None:
            raise BindingError(str(fb.path), "not open", "the data file must be open before its records")
        return int(fb.fd)

    def _check_header(self, name: str, fields: tuple[int, int, int], target: bytes, data: os.stat_result,
                      offset: int) -> bytes:
        raw = os.pread(self.fd, HEADER_BYTES, 0)
        start_over = "; remove them and the data file to start over"
        if raw[:8] in OLD_MAGICS:
            raise BindingError(name, str(self.path), f"integrity records of an older format (magic {raw[:8]!r}){start_over}")
        if len(raw) < HEADER.size or raw[:8] != MAGIC:
            raise BindingError(name, str(self.path), f"not kvxfer integrity records (magic {raw[:8]!r}){start_over}")
        magic, chunk_bytes, chunks, nbytes, identity, dev, ino, at, length = HEADER.unpack_from(raw)
        if (chunk_bytes, chunks, nbytes) != fields:
            raise BindingError(name, str(self.path), f"integrity records of another layout (want {fields[0]}-byte chunks "
                               f"of a {fields[2]}-byte buffer, found {chunk_bytes}-byte chunks of {nbytes}){start_over}")
        path = raw[HEADER.size:HEADER.size + length]
        if path != target:
            raise BindingError(name, str(self.path), f"the records were written for {path.decode(errors='replace')!r}, "
                               f"not for the file beside them: files moved or swapped{start_over}")
        if (dev, ino, at) != (data.st_dev, data.st_ino, offset):
            raise BindingError(name, str(self.path), f"the records were written for another file at this path (device "
                               f"{dev}, inode {ino}, offset {at}; found {data.st_dev}, {data.st_ino}, {offset}){start_over}")
        return bytes(identity)

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Records of chunks [lo, hi) as stored now (zeros past a short file)."""
        raw = os.pread(self.fd, (hi - lo) * RECORD.itemsize, HEADER_BYTES + lo * RECORD.itemsize)
        out = np.zeros(hi - lo, dtype=RECORD)
        out.view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return out

    def check(self, chunks: np.ndarray, epochs: np.ndarray, crcs: np.ndarray) -> np.ndarray:
        """The check words records of ``chunks`` with these epochs and CRCs must hold in this file."""
        return _record_check(chunks, epochs, crcs, self.identity)

    def write(self, chunks: np.ndarray, epoch: int, crcs: np.ndarray) -> None:
        """Store records for ``chunks`` (one pwrite over their span, merged with the records around them);
        ``epoch`` 0 clears them (no record: the chunk is refused until a spill completes)."""
        lo, hi = int(chunks.min()), int(chunks.max()) + 1
        span = self.read(lo, hi)
        if epoch:
            span["epoch"][chunks - lo] = epoch
            span["crc"][chunks - lo] = crcs
            span["check"][chunks - lo] = self.check(chunks, np.full(len(chunks), epoch, np.uint64), crcs)
        else:
            span[chunks - lo] = np.zeros(1, dtype=RECORD)
        data = span.tobytes()
        if os.pwrite(self.fd, data, HEADER_BYTES + lo * RECORD.itemsize) != len(data):
            raise OSError(0, "short write of the integrity records")

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class _Checked:
    """A plan checked against the tier: per range, the file side and the memory side."""

    plan: TransferPlan
    file_buf: np.ndarray  # plan buffer index of each range's file
    file_off: np.ndarray
    mem_buf: np.ndarray
    mem_off: np.ndarray
    names: dict[int, str]  # plan buffer index -> file buffer name, for the files touched

    def files_of_call(self, files: Mapping[str, FileBinding], call: int | None) -> list[str]:
        sl = slice(None) if call is None or call >= self.plan.num_calls else list(self.plan.calls())[call]
        return [str(files[self.names[i]].path) for i in np.unique(self.file_buf[sl]).tolist()]


class FileTier:
    """Spill and restore plans between host memory and files through ``executor`` (a NixlExecutor built with a
    storage backend, e.g. ``NixlExecutor(backends=["POSIX"])`` or ``get_executor({"kind": "nixl", "nixl":
    {"backends": ["POSIX"]}})``).

    ``buffers``: the layout (or its buffer table, in order) the plans are made from. ``files``: a FileBinding per
    file buffer. ``memory``: host memory per memory buffer (numpy arrays or CPU tensors). Every buffer of the table
    is bound once, here, with ``executor.bind``. ``chunk_bytes``: the integrity unit (default: the largest
    ``align_bytes`` of the file buffers; it must be a multiple of each). ``verify``: checksum chunks (needs host
    memory; a VRAM tier through GDS passes False and keeps epochs). ``lock_timeout_s``: how long to wait for
    another tier to release a file (a finite number of seconds, else TierConfigError). Raises BindingError for
    bindings that do not fit, files or records that cannot be trusted, and files another tier holds. Use from one
    thread at a time or share it: jobs of one tier run one after another.
    """

    def __init__(self, executor: StorageExecutor, buffers: Layout | Sequence[Buffer], files: Mapping[str, FileBinding],
                 memory: Mapping[str, Any], *, durability: Durability | str = Durability.FDATASYNC,
                 chunk_bytes: int | None = None, verify: bool = True, lock_timeout_s: float = LOCK_TIMEOUT_S):
        lock_timeout_s = check_timeout("lock_timeout_s", lock_timeout_s)
        self.executor, self.durability, self.verify = executor, Durability(durability), verify
        table = tuple(buffers.buffers if isinstance(buffers, Layout) else buffers)
        self.buffers = {b.name: b for b in table}
        for name in list(files) + list(memory):
            if name not in self.buffers:
                raise BindingError(name, "unknown buffer", f"the layout has {sorted(self.buffers)}")
            if (self.buffers[name].location is Location.FILE) != (name in files):
                raise BindingError(name, "file" if name in files else "memory",
                                   f"the layout places this buffer in {self.buffers[name].location.value}")
        self.chunk_bytes = chunk_bytes or max([self.buffers[n].align_bytes for n in files] or [1])
        for name in files:  # whole chunks on the file side then honour every file's alignment
            if self.chunk_bytes % self.buffers[name].align_bytes:
                raise BindingError(name, f"chunk_bytes {self.chunk_bytes}", f"not a multiple of the buffer's align_bytes "
                                   f"{self.buffers[name].align_bytes}")
        self.files, self.memory = dict(files), dict(memory)
        self._lock = threading.Lock()
        self._crc_threads = min(4, os.cpu_count() or 1)
        self._crc_pool: ThreadPoolExecutor | None = None
        self._registrations: list[Any] = []
        self._records: dict[str, _Records] = {}
        self.bound: BoundMemory | None = None
        self.views: dict[str, np.ndarray] = {}
        try:
            self._registrations.append(executor.register(self.files, table))  # opens the files: NIXL FILE memory
            self.bound = executor.bind(table, {**self.memory, **self.files})
            self._check_memory(self.bound)
            for name, fb in self.files.items():
                if fb.fd is None or not file_trust.lock_file(fb.fd, lock_timeout_s):
                    raise BindingError(name, str(fb.path), f"locked by another FileTier for more than {lock_timeout_s} s "
                                       "(another process, or another tier in this one): one tier writes a file at a time")
                self._records[name] = _Records(fb, self.chunk_bytes, self.buffers[name])
        except BaseException:
            self.close()
            raise
        top = max([int(r.expected[r.expected != FAILED].max(initial=0)) for r in self._records.values()] or [0])
        self._epoch = max(top + 1, time.time_ns() // 1000)  # never an epoch a file may already hold

    def _check_memory(self, bound: BoundMemory) -> None:
        """Host views for checksums (BindingError for device memory when verifying) and O_DIRECT addresses."""
        for name in self.memory:
            mem = bound.memory[bound.index[name]]
            if mem is None:
                continue
            if self.verify:
                if mem.view is None:
                    raise BindingError(name, type(mem.owner).__name__, "expected a numpy array or CPU torch tensor "
                                       "(host memory: checksums read host bytes)")
                self.views[name] = mem.view()
            for fb in self.files.values():
                fb.check_memory(name, mem.address, self.buffers[name].align_bytes)

    # ---- checks -----------------------------------------------------------------------------------------------
    def _job(self, plan: TransferPlan, op: str) -> _Checked:
        """Check ``plan`` for ``op`` before anything moves: the binding's checks (buffer table, shape, ranges), the
        sides, whole chunks, O_DIRECT."""
        self._bound().check(plan)
        spill = op == "spill"
        file_col, mem_col = ("dst", "src") if spill else ("src", "dst")
        names: dict[int, str] = {}
        for side, pool in ((file_col, self.files), (mem_col, self.memory)):
            for i in plan.buffers_used(side).tolist():
                buf = plan.buffers[i]
                if buf.name not in pool:
                    what = "file" if pool is self.files else "memory"
                    raise BindingError(buf.name, "not bound", f"a {op} {'writes' if spill == (what == 'file') else 'reads'}"
                                       f" this buffer as {what}; the tier binds {what} {sorted(pool)}")
                if pool is self.files:
                    names[i] = buf.name
        job = _Checked(plan, getattr(plan, f"{file_col}_buf"), getattr(plan, f"{file_col}_offset"),
                       getattr(plan, f"{mem_col}_buf"), getattr(plan, f"{mem_col}_offset"), names)
        nb, chunk = plan.nbytes, np.uint64(self.chunk_bytes)
        for field, col in ((f"{file_col}_offset", job.file_off), ("nbytes", nb)):
            bad = col % chunk != 0
            if bad.any():
                i = int(np.argmax(bad))
                raise BindingError(names[int(job.file_buf[i])], f"{field}[{i}] = {int(col[i])}",
                                   f"file ranges must be whole integrity chunks of {self.chunk_bytes} bytes")
        self._check_o_direct(job)
        return job

    def _bound(self) -> BoundMemory:
        if self.bound is None:
            raise BindingError("tier", "closed", "the tier was closed")
        return self.bound

    def _check_o_direct(self, job: _Checked) -> None:
        nb, addr = job.plan.nbytes, self._bound().base  # per buffer: its bound address (0 where unbound)
        for i, name in job.names.items():
            fb = self.files[name]
            if not fb.o_direct:
                continue
            m = job.file_buf == i
            bad = ((job.file_off[m] + np.uint64(fb.offset)) | nb[m] | (addr[job.mem_buf[m]] + job.mem_off[m])) \
                % np.uint64(fb.block_bytes) != 0
            if bad.any():
                k = int(np.flatnonzero(m)[np.argmax(bad)])
                raise BindingError(name, f"range {k}", f"O_DIRECT I/O on {str(fb.path)!r} needs file offset, size and "
                                   f"memory address aligned to {fb.block_bytes} bytes")

    def _chunks(self, job: _Checked, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For file buffer ``i``: chunk ids, and each chunk's memory buffer and offset (vectorized)."""
        m = job.file_buf == i
        count = (job.plan.nbytes[m] // np.uint64(self.chunk_bytes)).astype(np.int64)
        first = (job.file_off[m] // np.uint64(self.chunk_bytes)).astype(np.int64)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        chunks = np.repeat(first, count) + within
        mem_off = np.repeat(job.mem_off[m].astype(np.int64), count) + within * self.chunk_bytes
        return chunks, np.repeat(job.mem_buf[m], count), mem_off

    def _landed(self, job: _Checked) -> _LandedCrcs | None:
        """For a verified restore of at least PARALLEL_CRC_BYTES on the POSIX executor whose pieces hold whole
        chunks: the chunks' CRC-32s, computed on the CRC threads as each piece lands (``on_read``) while the next
        is read, instead of a pass over every chunk after the read; else None (that pass)."""
        from kvxfer.executors import PosixFileExecutor

        ex = self.executor
        if (not self.verify or not isinstance(ex, PosixFileExecutor) or ex.piece_bytes % self.chunk_bytes
                or int(job.plan.nbytes.sum()) < PARALLEL_CRC_BYTES):
            return None
        if self._crc_pool is None:
            self._crc_pool = ThreadPoolExecutor(self._crc_threads, thread_name_prefix="kvxfer-crc")
        n = len(job.plan.nbytes)
        first, owner, counts = np.zeros(n, np.int64), np.zeros(n, np.int64), {}
        for i in job.names:  # range k's first chunk: its place in file i's chunk list (as ``_chunks`` orders them)
            m = np.flatnonzero(job.file_buf == i)
            count = (job.plan.nbytes[m] // np.uint64(self.chunk_bytes)).astype(np.int64)
            first[m], owner[m], counts[i] = np.cumsum(count) - count, i, int(count.sum())
        return _LandedCrcs(self._crc_pool, self.chunk_bytes, first, owner, counts)

    def _crcs(self, plan: TransferPlan, mem_buf: np.ndarray, mem_off: np.ndarray) -> np.ndarray:
        out = np.zeros(len(mem_off), dtype=np.uint32)
        if not self.verify:
            return out
        n = self.chunk_bytes
        views = [self.views.get(b.name, np.zeros(0, np.uint8)) for b in plan.buffers]  # memory buffers all have one
        pieces = [views[b][o:o + n] for b, o in zip(mem_buf.tolist(), mem_off.tolist())]
        if len(pieces) * n < PARALLEL_CRC_BYTES or self._crc_threads < 2:
            out[:] = [crc32(p) for p in pieces]
            return out
        if self._crc_pool is None:  # both CRCs release the GIL over large buffers: chunks are summed in parallel
            self._crc_pool = ThreadPoolExecutor(self._crc_threads, thread_name_prefix="kvxfer-crc")
        per = -(-len(pieces) // self._crc_threads)  # one task per thread: a task per chunk cost 8x the CRCs
        groups = self._crc_pool.map(_crc_each, [pieces[i:i + per] for i in range(0, len(pieces), per)])
        out[:] = [c for group in groups for c in group]
        return out

    # ---- jobs -------------------------------------------------------------------------------------------------
    def spill(self, plan: TransferPlan) -> TierResult:
        """Write memory to files (a plan whose destinations are file buffers). Never raises for a failed job:
        the result carries the error (TierError, BindingError, PlanError)."""
        return self._guarded("spill", plan, self._spill)

    def restore(self, plan: TransferPlan) -> TierResult:
        """Read files into memory (a plan whose sources are file buffers); refuses short files and chunks that
        are not the ones last spilled. The memory may be partly written when the result is a failure."""
        return self._guarded("restore", plan, self._restore)

    def _guarded(self, op: str, plan: TransferPlan, body: Callable[[TransferPlan], tuple[int, int | None]]) -> TierResult:
        """Run ``body`` on the tier's own copy of ``plan`` (each column read once: the chunks checked, the records
        written and the I/O run all come from the same values, whatever a holder of ``plan`` writes meanwhile)."""
        t0 = time.perf_counter()
        with self._lock:
            try:
                plan = TransferPlan.copy(plan)
                chunks, epoch = body(plan)
            except (TierError, BindingError, PlanError) as e:
                return TierResult(op, False, 0, time.perf_counter() - t0, error=e)
            except Exception as e:  # never raised out of spill() or restore(): the result says what happened
                err = TierError(op, "unexpected error", [str(fb.path) for fb in self.files.values()],
                                f"{type(e).__name__}: {e}")
                err.__cause__ = e
                return TierResult(op, False, 0, time.perf_counter() - t0, error=err)
        return TierResult(op, True, plan.total_bytes, time.perf_counter() - t0, chunks, epoch)

    def _io(self, op: str, job: _Checked, before_wait: Callable[[], None] | None = None,
            landed: _LandedCrcs | None = None) -> None:
        """Run the plan through the executor on the tier's binding; a NIXL failure becomes a TierError naming the
        call's files. ``landed``: checksum a restore's pieces as they land (POSIX executor only)."""
        try:
            if landed is not None:
                t = self.executor.run(job.plan, self._bound(), on_read=landed.on_read)  # type: ignore[call-arg]
            else:
                t = self.executor.run(job.plan, self._bound())
            if before_wait is not None:
                before_wait()
            t.wait()
        except ExecutorError as e:
            raise TierError(op, e.call, job.files_of_call(self.files, e.chunk), e.reason, e.chunk) from e

    def _spill(self, plan: TransferPlan) -> tuple[int, int | None]:
        job = self._job(plan, "spill")
        for name in job.names.values():
            self._alive("spill", name)
        if self._epoch >= EPOCH_LIMIT:
            raise TierError("spill", "epoch", [str(self.files[n].path) for n in job.names.values()],
                            f"epochs are exhausted (next {self._epoch}, limit {EPOCH_LIMIT}): start the files over")
        epoch, self._epoch = self._epoch, self._epoch + 1
        parts = {i: self._chunks(job, i) for i in job.names}
        crcs: dict[int, np.ndarray] = {}

        def checksum() -> None:  # while the writes are in flight: the memory does not change under a spill
            for i, (_, mb, mo) in parts.items():
                crcs[i] = self._crcs(plan, mb, mo)

        try:
            for i, name in job.names.items():  # no record may vouch for the old bytes once new ones may land
                self._records[name].expected[parts[i][0]] = FAILED
                self._write_records(name, parts[i][0], 0, np.zeros(0, np.uint32))
            self._io("spill", job, checksum)
            if self.durability is Durability.FDATASYNC:
                for name in job.names.values():
                    self._sync("spill", self.files[name].fd, str(self.files[name].path))
            for i, name in job.names.items():
                self._write_records(name, parts[i][0], epoch, crcs[i])
        except TierError:
            for i, name in job.names.items():  # the chunks may be torn: never restore them as the old ones
                self._records[name].expected[parts[i][0]] = FAILED
            raise
        for i, name in job.names.items():
            self._records[name].expected[parts[i][0]] = epoch
        return sum(len(p[0]) for p in parts.values()), epoch

    def _write_records(self, name: str, chunks: np.ndarray, epoch: int, crcs: np.ndarray) -> None:
        """Write the records of ``chunks`` (``epoch`` 0: clear them), synced under fdatasync; TierError names the file."""
        records = self._records[name]
        try:
            records.write(chunks, epoch, crcs)
        except OSError as e:
            raise TierError("spill", "integrity record write", [str(records.path)], e.strerror or str(e)) from None
        if self.durability is Durability.FDATASYNC:
            self._sync("spill", records.fd, str(records.path))

    def _restore(self, plan: TransferPlan) -> tuple[int, int | None]:
        job = self._job(plan, "restore")
        parts = {i: self._chunks(job, i) for i in job.names}
        records, ends, before = {}, {}, {}
        for i, name in job.names.items():
            ends[i] = int((job.file_off[job.file_buf == i] + plan.nbytes[job.file_buf == i]).max())
            self._extent(name, ends[i], "extent check")
            records[i] = self._check_records(name, parts[i][0])
            before[i] = self._file_state(name)
        landed = self._landed(job)
        try:
            self._io("restore", job, landed=landed)
        finally:  # every task done before the memory is reused; a task that failed leaves the pass below to do it
            crcs = landed.wait() if landed is not None else None
        for i, name in job.names.items():
            self._extent(name, ends[i], "extent check after reading")  # a file cut short under the read
            self._unchanged(name, before[i], job, i)
            chunks, mb, mo = parts[i]
            if not self.verify:
                continue
            got = crcs[i] if crcs is not None else self._crcs(plan, mb, mo)
            bad = np.flatnonzero(got != records[i]["crc"])
            if bad.size:
                k = int(bad[0])
                raise IntegrityError("restore", str(self.files[name].path), int(chunks[k]),
                                     f"checksum {int(got[k]):#010x} != {int(records[i]['crc'][k]):#010x} recorded by "
                                     f"epoch {int(records[i]['epoch'][k])}: torn or corrupted spill "
                                     f"({bad.size} of {len(chunks)} chunks differ)")
        return sum(len(p[0]) for p in parts.values()), None

    def _file_state(self, name: str) -> tuple[int, int, int, int]:
        """(size, change time, mtime, allocated blocks) of the data file: what any write or truncation changes."""
        fd = self.files[name].fd
        try:
            st = os.fstat(fd if fd is not None else -1)
        except OSError as e:
            raise TierError("restore", "descriptor check", [str(self.files[name].path)], e.strerror or str(e)) from None
        return st.st_size, st.st_ctime_ns, st.st_mtime_ns, st.st_blocks

    def _unchanged(self, name: str, before: tuple[int, int, int, int], job: _Checked, i: int) -> None:
        """Refuse a read of file buffer ``i`` when the file changed under it (written, or truncated and extended:
        the bytes read may be zeros or another spill's) or when a range read holds a hole (bytes never written)."""
        fb, path = self.files[name], str(self.files[name].path)
        if self._file_state(name) != before:
            raise TierError("restore", "file check after reading", [path], "the file was written or truncated while "
                            "it was read (another writer than this tier): the bytes read cannot be trusted")
        m = job.file_buf == i
        starts = (job.file_off[m] + np.uint64(fb.offset)).tolist()
        for start, n in zip(starts, job.plan.nbytes[m].tolist()):
            try:
                hole = os.lseek(fb.fd if fb.fd is not None else -1, start, os.SEEK_HOLE)
            except OSError:  # no SEEK_HOLE on this filesystem: the size and change time above are the check
                return
            if hole < start + n:
                raise TierError("restore", "file check after reading", [path], f"a hole at file offset {hole} inside "
                                f"the range read [{start}, {start + n}): bytes never written (the file was cut and "
                                "extended again)")

    def _check_records(self, name: str, chunks: np.ndarray) -> np.ndarray:
        """The stored records of ``chunks``, refused unless each is intact, names this file and holds the epoch
        expected."""
        records, path = self._records[name], str(self.files[name].path)
        lo, hi = int(chunks.min()), int(chunks.max()) + 1
        rec: np.ndarray = records.read(lo, hi)[chunks - lo]
        expect = records.expected[chunks]
        problems: tuple[tuple[np.ndarray, Callable[[int], str]], ...] = (
            (rec["epoch"] >= np.uint64(EPOCH_LIMIT), lambda k: f"the record holds epoch {int(rec['epoch'][k])}, beyond "
                                                                f"any epoch a tier writes: forged or corrupted"),
            (expect == FAILED, lambda k: "its last spill failed, or its record is not trusted; the bytes may be torn"),
            (rec["epoch"] == 0, lambda k: "never spilled, or its last spill did not finish (no integrity record)"),
            (rec["check"] != records.check(chunks, rec["epoch"], rec["crc"]),
             lambda k: "integrity record is corrupted, or belongs to another chunk or file"),
            (rec["epoch"] != expect, lambda k: f"stale: the file holds epoch {int(rec['epoch'][k])}, the last spill "
                                               f"of this chunk wrote epoch {int(expect[k])}"),
        )
        for bad, why in problems:
            if bad.any():
                k = int(np.argmax(bad))
                raise IntegrityError("restore", path, int(chunks[k]), why(k))
        return rec

    def _extent(self, name: str, end: int, step: str) -> None:
        try:
            self.files[name].check_extent(end)
        except BindingError as e:
            raise TierError("restore", step, [str(self.files[name].path)], e.reason) from None

    def _alive(self, op: str, name: str) -> None:
        fb = self.files[name]
        try:
            fb.file_size()
        except BindingError as e:
            raise TierError(op, "descriptor check", [str(fb.path)], e.reason) from None

    def _sync(self, op: str, fd: int | None, path: str) -> None:
        try:
            os.fdatasync(fd if fd is not None else -1)
        except OSError as e:
            raise TierError(op, "fdatasync", [path], f"{e.strerror} (errno {e.errno})") from None

    def epochs(self, name: str) -> np.ndarray:
        """A copy of the epoch this tier trusts for each chunk of file buffer ``name``: the one its last spill
        wrote, or the one recorded when the tier opened; 0 where no chunk is trusted (never spilled, a spill that
        failed or did not finish, a record beyond ``EPOCH_LIMIT``, or a stored record that does not verify now:
        torn, copied from another chunk or file). Reads the records once. KeyError for a name that is not a file."""
        records = self._records[name]
        with self._lock:
            out: np.ndarray = records.expected.copy()
            stored = records.read(0, records.chunks)
        ids = np.arange(records.chunks, dtype=np.uint64)
        intact = stored["check"] == records.check(ids, stored["epoch"], stored["crc"])
        out[(out == FAILED) | ~intact | (stored["epoch"] != out)] = 0
        return out

    def close(self) -> None:
        """Release the binding (memory registrations), deregister the files, close the records and the files this
        tier opened (which drops the locks)."""
        if self.bound is not None:
            self.bound.close()
            self.bound = None
        while self._registrations:
            self._registrations.pop().deregister()
        for r in self._records.values():
            r.close()
        self._records = {}
        for fb in self.files.values():
            fb.close()
        self.memory, self.views = {}, {}  # the memory is the caller's again: nothing here views it
        if self._crc_pool is not None:
            self._crc_pool.shutdown(wait=True)
            self._crc_pool = None

    def __enter__(self) -> FileTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


record_check = _record_check  # public for ``admin`` (kvxfer store show), which trusts records the way a tier does
