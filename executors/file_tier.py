"""The storage tier: spill host memory to files and restore it, through a NixlExecutor with a storage backend
(POSIX here; GDS or GDS_MT on GPU machines), with stated durability and per-chunk integrity.

A tier layout places each region's blocks twice: the ``device`` placement in memory, the ``host`` placement
in a file buffer (``Buffer(location="file")``). A spill is then a d2h plan (memory -> file) and a restore an
h2d plan (file -> memory); merged plans make one I/O request per merged range.

What a result promises:
- a spill is reported done only when its data is durable under ``durability`` (``none``: written to the
  page cache; ``fdatasync``: every touched file and its integrity records synced before the result);
- a failed write is reported failed, naming the files and the call (NIXL call, fdatasync, record write);
- a restore checks file extents before reading and every chunk's record and checksum after, so a short,
  torn, stale or corrupted spill is refused and never reported done.

Integrity: each file is cut into chunks of ``chunk_bytes`` (file-side ranges must be whole chunks). Beside the
file, ``<path>.kvxsum`` holds one 16-byte record per chunk: the epoch of the spill that wrote it (a counter
that grows with every spill of the tier), the CRC-32 of its bytes, and a check over both. The tier keeps the
epoch it expects per chunk; a record holding another epoch is stale, a mismatching checksum a torn or
corrupted chunk. Records are written only after the data (and, under fdatasync, after the data is synced).

For an offload worker: build one FileTier per engine over the host region and its spill files, then run
each spill or restore job as ``tier.spill(plan)`` / ``tier.restore(plan)``; a TierResult maps one to one onto
a job result (success, ``nbytes``, ``seconds``). Jobs block the calling thread and run one at a time.
"""
from __future__ import annotations

import os
import struct
import threading
import time
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, Location, Placement, PlanError, Region, TransferPlan
from kvxfer.planner.alignment import check_alignment

from .base import ExecutorError
from .binding import BindingError, resolve
from .nixl_files import FileBinding

MAGIC = b"KVXSUM01"
HEADER = struct.Struct("<8sQQQ")  # magic, chunk_bytes, chunks, buffer nbytes
HEADER_BYTES = 64
RECORD = np.dtype([("epoch", "<u8"), ("crc", "<u4"), ("check", "<u4")])
FAILED = np.uint64(2**64 - 1)  # expected epoch of a chunk whose last spill failed


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
    return Layout(buffers=buffers, regions=regions)


def _record_check(chunks: np.ndarray, epochs: np.ndarray, crcs: np.ndarray) -> np.ndarray:
    """A check word per record: a record torn or written for another chunk does not verify."""
    mix = (chunks.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ epochs ^ (crcs.astype(np.uint64) << np.uint64(17))
    return ((mix ^ (mix >> np.uint64(32))) & np.uint64(0xFFFFFFFF)).astype(np.uint32) ^ np.uint32(0xA5A5A5A5)


class _Sums:
    """The integrity records of one file, in ``<path>.kvxsum``, and the epochs the tier expects."""

    def __init__(self, path: Path, chunk_bytes: int, buffer: Buffer):
        self.path = path
        self.chunks = -(-buffer.nbytes // chunk_bytes)
        header = HEADER.pack(MAGIC, chunk_bytes, self.chunks, buffer.nbytes).ljust(HEADER_BYTES, b"\0")
        try:
            self.fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise BindingError(buffer.name, str(path), f"cannot open the integrity records: {e.strerror}") from None
        size = os.fstat(self.fd).st_size
        if size == 0:
            os.pwrite(self.fd, header, 0)
            os.ftruncate(self.fd, HEADER_BYTES + self.chunks * RECORD.itemsize)
        elif os.pread(self.fd, HEADER_BYTES, 0) != header:
            os.close(self.fd)
            raise BindingError(buffer.name, str(path), f"integrity records of another layout (want {chunk_bytes}-byte "
                               f"chunks of a {buffer.nbytes}-byte buffer); remove the file to start over")
        self.expected = self.read(0, self.chunks)["epoch"].copy()  # what this tier trusts: the records at open

    def read(self, lo: int, hi: int) -> np.ndarray:
        """Records of chunks [lo, hi) as stored now (zeros past a short file)."""
        raw = os.pread(self.fd, (hi - lo) * RECORD.itemsize, HEADER_BYTES + lo * RECORD.itemsize)
        out = np.zeros(hi - lo, dtype=RECORD)
        out.view(np.uint8)[:len(raw)] = np.frombuffer(raw, dtype=np.uint8)
        return out

    def write(self, chunks: np.ndarray, epoch: int, crcs: np.ndarray) -> None:
        """Store records for ``chunks`` (one pwrite over their span, merged with the records around them)."""
        lo, hi = int(chunks.min()), int(chunks.max()) + 1
        span = self.read(lo, hi)
        span["epoch"][chunks - lo] = epoch
        span["crc"][chunks - lo] = crcs
        span["check"][chunks - lo] = _record_check(chunks, np.full(len(chunks), epoch, np.uint64), crcs)
        data = span.tobytes()
        if os.pwrite(self.fd, data, HEADER_BYTES + lo * RECORD.itemsize) != len(data):
            raise OSError(0, "short write of the integrity records")

    def close(self) -> None:
        os.close(self.fd)


@dataclass
class _Job:
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

    ``buffers``: the layout (or its buffers) the plans are made from. ``files``: a FileBinding per file buffer.
    ``memory``: host memory per memory buffer (numpy arrays or CPU tensors), registered once here.
    ``chunk_bytes``: the integrity unit (default: the largest ``align_bytes`` of the file buffers).
    ``verify``: checksum chunks (needs host memory; a VRAM tier through GDS passes False and keeps epochs).
    Raises BindingError for bindings that do not fit. Use from one thread at a time or share it: jobs
    of one tier run one after another.
    """

    def __init__(self, executor: Any, buffers: Any, files: Mapping[str, FileBinding], memory: Mapping[str, Any], *,
                 durability: Durability | str = Durability.FDATASYNC, chunk_bytes: int | None = None, verify: bool = True):
        self.executor, self.durability, self.verify = executor, Durability(durability), verify
        self.buffers = {b.name: b for b in getattr(buffers, "buffers", buffers)}
        for name in list(files) + list(memory):
            if name not in self.buffers:
                raise BindingError(name, "unknown buffer", f"the layout has {sorted(self.buffers)}")
            is_file = self.buffers[name].location is Location.FILE
            if is_file != (name in files):
                raise BindingError(name, "file" if name in files else "memory",
                                   f"the layout places this buffer in {self.buffers[name].location.value}")
        self.chunk_bytes = chunk_bytes or max([self.buffers[n].align_bytes for n in files] or [1])
        self.files = dict(files)
        self.views = {}
        for name, obj in memory.items():
            buf = self.buffers[name]
            if verify:
                self.views[name] = _host_view(obj, name)  # BindingError for device memory: checksums read host bytes
            addr = int(self.views[name].ctypes.data) if verify else _address(obj)
            for fb in self.files.values():
                fb.check_memory(name, addr, buf.align_bytes)
        self._lock = threading.Lock()
        self._registrations: list[Any] = []
        self._sums: dict[str, _Sums] = {}
        try:
            self._registrations.append(executor.register(dict(memory), [self.buffers[n] for n in memory]))
            self._registrations.append(executor.register(self.files, [self.buffers[n] for n in files]))
            for name, fb in self.files.items():
                self._sums[name] = _Sums(Path(f"{fb.path}.kvxsum"), self.chunk_bytes, self.buffers[name])
        except Exception:
            self.close()
            raise
        self.memory = dict(memory)
        top = max([int(s.expected[s.expected != FAILED].max(initial=0)) for s in self._sums.values()] or [0])
        self._epoch = top + 1

    # ---- checks -----------------------------------------------------------------------------------------------
    def _job(self, plan: TransferPlan, op: str) -> _Job:
        """Check ``plan`` for ``op`` before anything moves: shape, buffers, alignment, chunks, O_DIRECT."""
        plan.check()
        check_alignment(plan)
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
                if buf != self.buffers[buf.name]:
                    raise BindingError(buf.name, repr(buf), f"differs from the tier's buffer {self.buffers[buf.name]!r}")
                if pool is self.files:
                    names[i] = buf.name
        job = _Job(plan, getattr(plan, f"{file_col}_buf"), getattr(plan, f"{file_col}_offset"),
                   getattr(plan, f"{mem_col}_buf"), getattr(plan, f"{mem_col}_offset"), names)
        nb, chunk = plan.nbytes, np.uint64(self.chunk_bytes)
        for field, col in ((f"{file_col}_offset", job.file_off), ("nbytes", nb)):
            bad = col % chunk != 0
            if bad.any():
                i = int(np.argmax(bad))
                raise BindingError(names[int(job.file_buf[i])], f"{field}[{i}] = {int(col[i])}",
                                   f"file ranges must be whole integrity chunks of {self.chunk_bytes} bytes")
        for i, name in names.items():
            fb = self.files[name]
            if not fb.o_direct:
                continue
            m = job.file_buf == i
            addr = np.array([_address(self.memory[plan.buffers[j].name]) if plan.buffers[j].name in self.memory else 0
                             for j in range(len(plan.buffers))], dtype=np.uint64)
            bad = ((job.file_off[m] + np.uint64(fb.offset)) | nb[m] | (addr[job.mem_buf[m]] + job.mem_off[m])) \
                % np.uint64(fb.block_bytes) != 0
            if bad.any():
                k = int(np.flatnonzero(m)[np.argmax(bad)])
                raise BindingError(name, f"range {k}", f"O_DIRECT I/O on {str(fb.path)!r} needs file offset, size and "
                                   f"memory address aligned to {fb.block_bytes} bytes")
        return job

    def _chunks(self, job: _Job, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For file buffer ``i``: chunk ids, and each chunk's memory buffer and offset (vectorized)."""
        m = job.file_buf == i
        count = (job.plan.nbytes[m] // np.uint64(self.chunk_bytes)).astype(np.int64)
        first = (job.file_off[m] // np.uint64(self.chunk_bytes)).astype(np.int64)
        within = np.arange(int(count.sum()), dtype=np.int64) - np.repeat(np.cumsum(count) - count, count)
        chunks = np.repeat(first, count) + within
        mem_off = np.repeat(job.mem_off[m].astype(np.int64), count) + within * self.chunk_bytes
        return chunks, np.repeat(job.mem_buf[m], count), mem_off

    def _crcs(self, plan: TransferPlan, mem_buf: np.ndarray, mem_off: np.ndarray) -> np.ndarray:
        out = np.zeros(len(mem_off), dtype=np.uint32)
        if not self.verify:
            return out
        n = self.chunk_bytes
        views = [self.views.get(b.name) for b in plan.buffers]
        for k, (b, o) in enumerate(zip(mem_buf.tolist(), mem_off.tolist())):
            out[k] = zlib.crc32(views[b][o:o + n])
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

    def _guarded(self, op: str, plan: TransferPlan, body: Any) -> TierResult:
        t0 = time.perf_counter()
        with self._lock:
            try:
                chunks, epoch = body(plan)
            except (TierError, BindingError, PlanError) as e:
                return TierResult(op, False, 0, time.perf_counter() - t0, error=e)
        return TierResult(op, True, plan.total_bytes, time.perf_counter() - t0, chunks, epoch)

    def _io(self, op: str, job: _Job, before_wait: Any = None) -> None:
        """Run the plan through the executor; a NIXL failure becomes a TierError naming the call's files."""
        bindings = {**self.memory, **self.files}
        try:
            t = self.executor.run(job.plan, bindings)
            if before_wait is not None:
                before_wait()
            t.wait()
        except ExecutorError as e:
            raise TierError(op, e.call, job.files_of_call(self.files, e.chunk), e.reason, e.chunk) from e

    def _spill(self, plan: TransferPlan) -> tuple[int, int]:
        job = self._job(plan, "spill")
        for name in job.names.values():
            self._alive("spill", name)
        epoch, self._epoch = self._epoch, self._epoch + 1
        parts = {i: self._chunks(job, i) for i in job.names}
        crcs: dict[int, np.ndarray] = {}

        def checksum() -> None:  # while the writes are in flight: the memory does not change under a spill
            for i, (_, mb, mo) in parts.items():
                crcs[i] = self._crcs(plan, mb, mo)

        try:
            self._io("spill", job, checksum)
            if self.durability is Durability.FDATASYNC:
                for name in job.names.values():
                    self._sync("spill", name, self.files[name].fd, str(self.files[name].path))
            for i, name in job.names.items():
                sums = self._sums[name]
                try:
                    sums.write(parts[i][0], epoch, crcs[i])
                except OSError as e:
                    raise TierError("spill", "integrity record write", [str(sums.path)], e.strerror or str(e)) from None
                if self.durability is Durability.FDATASYNC:
                    self._sync("spill", name, sums.fd, str(sums.path))
        except TierError:
            for i, name in job.names.items():  # the chunks may be torn: never restore them as the old ones
                self._sums[name].expected[parts[i][0]] = FAILED
            raise
        for i, name in job.names.items():
            self._sums[name].expected[parts[i][0]] = epoch
        return sum(len(p[0]) for p in parts.values()), epoch

    def _restore(self, plan: TransferPlan) -> tuple[int, None]:
        job = self._job(plan, "restore")
        parts = {i: self._chunks(job, i) for i in job.names}
        records, ends = {}, {}
        for i, name in job.names.items():
            ends[i] = int((job.file_off[job.file_buf == i] + plan.nbytes[job.file_buf == i]).max())
            self._extent(name, ends[i], "extent check")
            records[i] = self._check_records(name, parts[i][0])
        self._io("restore", job)
        for i, name in job.names.items():
            self._extent(name, ends[i], "extent check after reading")  # a file cut short under the read
            chunks, mb, mo = parts[i]
            if not self.verify:
                continue
            got = self._crcs(plan, mb, mo)
            bad = np.flatnonzero(got != records[i]["crc"])
            if bad.size:
                k = int(bad[0])
                raise IntegrityError("restore", str(self.files[name].path), int(chunks[k]),
                                     f"checksum {int(got[k]):#010x} != {int(records[i]['crc'][k]):#010x} recorded by "
                                     f"epoch {int(records[i]['epoch'][k])}: torn or corrupted spill "
                                     f"({bad.size} of {len(chunks)} chunks differ)")
        return sum(len(p[0]) for p in parts.values()), None

    def _check_records(self, name: str, chunks: np.ndarray) -> np.ndarray:
        """The stored records of ``chunks``, refused unless each is intact and holds the epoch expected."""
        sums, path = self._sums[name], str(self.files[name].path)
        lo, hi = int(chunks.min()), int(chunks.max()) + 1
        rec = sums.read(lo, hi)[chunks - lo]
        expect = sums.expected[chunks]
        problems = (
            (expect == FAILED, lambda k: "its last spill failed; the bytes may be torn"),
            (rec["epoch"] == 0, lambda k: "never spilled (no integrity record)"),
            (rec["check"] != _record_check(chunks, rec["epoch"], rec["crc"]), lambda k: "integrity record is corrupted"),
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

    def _sync(self, op: str, name: str, fd: int | None, path: str) -> None:
        try:
            os.fdatasync(fd if fd is not None else -1)
        except OSError as e:
            raise TierError(op, "fdatasync", [path], f"{e.strerror} (errno {e.errno})") from None

    def close(self) -> None:
        """Deregister memory and files, close the records and the files this tier opened."""
        while self._registrations:
            self._registrations.pop().deregister()
        for s in self._sums.values():
            s.close()
        self._sums = {}
        for fb in self.files.values():
            fb.close()

    def __enter__(self) -> FileTier:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _host_view(obj: Any, name: str) -> np.ndarray:
    """A flat uint8 view of host memory numpy can reach; BindingError for anything else (device memory)."""
    mem = resolve(obj, name)
    if mem.view is None:
        raise BindingError(name, type(obj).__name__, "expected a numpy array or CPU torch tensor (host memory)")
    return mem.view()


def _address(obj: Any) -> int:
    """Start address of memory bound to a buffer (host arrays, CPU or CUDA tensors)."""
    return resolve(obj, "memory").address
