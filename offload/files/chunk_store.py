"""A persistent, bounded store of fixed-size chunks under keys, in files: the storage tier below host memory.

``ChunkStore`` keeps rows of a host memory region (row r: bytes ``[r * row_bytes, (r + 1) * row_bytes)``) under
opaque keys, in one data file of ``capacity_bytes // row_bytes`` slots, through a ``FileTier`` (one integrity
record per slot: epoch, CRC-32, file identity; durability before success). Stores and loads are jobs: submitted
without blocking, run in order on the store's own thread (loads before queued stores), each one plan whose
merged ranges are one I/O each (rows contiguous in memory and in the file move together), and collected with
``poll``.

Files, in ``root_dir/kvxfer-<label>-<digest>/`` (the namespace: a digest of ``identity``, what the bytes mean, so
another identity never reads them), all private to their owner, opened without following links and refused
when foreign: ``identity.json`` (the identity, written once); ``chunks.kvx`` (the slots, sparse until written),
``chunks.kvx.kvxsum`` (FileTier's records) and ``chunks.kvx.index`` (a header and one entry per slot: the key
stored there, the epoch of the spill that wrote it, a CRC over both and the slot). One store holds the files at
a time (an exclusive lock, bounded wait).

Consistency. A store's data and records are a FileTier spill, which clears the slots' records before writing
data; its index entries are written after it (synced first, under fdatasync), and the job is reported done only
then. On opening, an entry counts only when its CRC holds and its epoch equals the one the slot's intact record
holds: an entry of a store interrupted anywhere (a crash included) or of a slot reused since never counts. A
load reads what the index names and FileTier checks every chunk (record, epoch, CRC): a chunk that fails is
dropped from the index and reported among the failed keys (logged once), never returned as loaded.

Capacity: slots are reused least recently used first (``touch`` and hits refresh a key); a slot being loaded is
never reused meanwhile. A store that finds no free slot stores fewer keys (counted as ``skipped``).
"""
from __future__ import annotations

import collections
import errno
import hashlib
import json
import logging
import os
import re
import stat
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator

from kvxfer.executors import BindingError, FileBinding, file_trust  # the trust helpers: open without links, locks
from kvxfer.planner import BlockMapping, Buffer, Layout, Location, Placement, PlanError, Region, plan_transfer
from kvxfer.planner import Spec as _PlannerSpec

from ..checksums import crc32  # ISA-L where installed, else zlib: the same values
from .atomic import create_file, path_refusal, replace_file, set_aside
from .file_tier import Durability, FileTier, IntegrityError, StorageExecutor, TierError, check_timeout
from .job_queue import QueuedJobs

_log = logging.getLogger(__name__)

__all__ = ["ENTRY", "INDEX_HEADER_BYTES", "MAX_KEY_BYTES", "ChunkStore", "StoreConfig", "StoreConfigError", "StoreError",
           "StoreJobError", "StoreResult", "StoreStats", "entry_check", "namespace"]

INDEX_MAGIC = b"KVXIDX01"
INDEX_HEADER = struct.Struct("<8sQQ")  # magic, slots, row bytes
INDEX_HEADER_BYTES = 4096
MAX_KEY_BYTES = 112
ENTRY = np.dtype([("epoch", "<u8"), ("key_len", "<u2"), ("pad", "<u2"), ("check", "<u4"), ("key", "u1", (MAX_KEY_BYTES,))])
DATA, ROWS = "file", "rows"  # the layout's buffers: the data file, the host rows
STORE, LOAD = "store", "load"
_LABEL = re.compile(r"[^A-Za-z0-9_.-]+")


class StoreConfigError(PlanError):
    """A ChunkStore setting is refused: names the key (``field``) and its value."""


class StoreJobError(PlanError):
    """A job is refused at submission (its rows, keys or id): names the field, the index and the value."""


class StoreError(RuntimeError):
    """The store cannot start on its files (another identity at the digest, a store holding them, ...)."""


class StoreConfig(_PlannerSpec):
    """The file tier's settings (frozen; unknown keys refused, naming the key).

    ``root_dir``: an existing, writable directory; ``capacity_bytes``: bytes of data on disk (at least one row);
    ``durability``: FileTier's (``fdatasync``: data, records and index synced before a store is done; ``none``);
    ``verify``: CRC-32 per chunk (False: epochs and extents only); ``o_direct``: bypass the page cache;
    ``io_threads``: threads one job's reads or writes run on (None: 4 with O_DIRECT, where the device takes
    requests in parallel, else 1: copies through the page cache into one file do not scale, they contend on the
    file); ``lock_timeout_s``: how long to wait for another
    store to release the files; ``stats_path``: where the counters are written as JSON after each job;
    ``shared``: several engines share ``root_dir`` (no lock; see ``shared_store``)."""

    _error: ClassVar = StoreConfigError

    root_dir: str = Field(min_length=1)
    capacity_bytes: int = Field(gt=0)
    durability: Durability = Durability.FDATASYNC
    verify: bool = True
    o_direct: bool = False
    io_threads: int | None = Field(default=None, ge=1, le=64)
    lock_timeout_s: float = 5.0
    stats_path: str | None = None
    shared: bool = False  # several engines on one root_dir: a SharedChunkStore (offload/files/shared_store.py)

    @field_validator("stats_path")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        why = None if v is None else path_refusal(v)
        if why is not None:
            raise StoreConfigError("stats_path", v, why)
        return v

    @field_validator("lock_timeout_s")
    @classmethod
    def _finite(cls, v: float) -> float:
        try:
            return check_timeout("lock_timeout_s", v)
        except ValueError as e:
            raise StoreConfigError("lock_timeout_s", v, str(e).split(": ", 1)[-1]) from None


@dataclass(frozen=True)
class StoreResult:
    """One finished job: ``keys`` asked, ``done_keys`` stored or loaded (a failed load lists the keys that did
    load), bytes moved, seconds on the store's thread, and the error of a failure."""

    job_id: int
    op: str
    success: bool
    keys: tuple[bytes, ...]
    done_keys: tuple[bytes, ...]
    nbytes: int = 0
    seconds: float = 0.0
    error: Exception | None = None


@dataclass
class StoreStats:
    """The store's counters. ``found``/``discarded``: entries counted and refused when the store opened;
    ``integrity_misses``: chunks refused by a load (torn, stale, corrupted); ``skipped``: keys a store could not
    place; ``io_calls``: data reads and writes issued; ``syncs``: fdatasync calls; ``load_timeline``: for the
    last loads, wall-clock times of submission, start and end on the store's thread, and of the poll that
    reported it."""

    slots: int = 0
    row_bytes: int = 0
    files: int = 4
    found: int = 0
    discarded: int = 0
    lookups: int = 0
    hits: int = 0
    stores: int = 0
    chunks_stored: int = 0
    bytes_stored: int = 0
    store_s: float = 0.0
    loads: int = 0
    chunks_loaded: int = 0
    bytes_loaded: int = 0
    load_s: float = 0.0
    integrity_misses: int = 0
    failed_jobs: int = 0
    evictions: int = 0
    skipped: int = 0
    io_calls: int = 0
    syncs: int = 0
    load_timeline: list[dict[str, float]] = field(default_factory=list)


@dataclass
class _Job:
    job_id: int
    op: str
    keys: tuple[bytes, ...]
    rows: np.ndarray
    slots: np.ndarray
    asked: tuple[bytes, ...]
    submitted: float = field(default_factory=time.time)


def namespace(identity: Mapping[str, Any]) -> str:
    """The folder name for ``identity``: ``kvxfer-<label>-<16 hex digits of its SHA-256>`` (label: the ``model``
    entry, reduced to file-name characters). TypeError for an identity JSON cannot write."""
    text = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    label = _LABEL.sub("_", str(identity.get("model", "kv")))[-48:].strip("._-") or "kv"
    return f"kvxfer-{label}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def _entry_check(slots: np.ndarray, entries: np.ndarray) -> np.ndarray:
    """CRC-32 of each entry's slot, epoch and key: an entry torn, or moved to another slot, does not verify."""
    out = np.zeros(len(entries), np.uint32)
    keys = entries["key"]
    for i, (s, epoch, n) in enumerate(zip(slots.tolist(), entries["epoch"].tolist(), entries["key_len"].tolist())):
        out[i] = crc32(struct.pack("<QQH", s, epoch, n) + keys[i, :n].tobytes())
    return out


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or accept it if it is a directory of this user no one else may write; StoreError."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{path}: not a directory (a link or a file at the tier's namespace): refused")
    if st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StoreError(f"{path}: owned by uid {st.st_uid} or writable by others (mode {stat.filemode(st.st_mode)}): "
                         "another user could plant or forge chunks; refused")


class _Index:
    """The slot table ``<data>.index``: opened without links, locked; entries per slot. What cannot be this
    store's index (a link, a folder, a FIFO, a foreign file, bytes that are not an index) is set aside and a new
    index started (``found``, ``aside``: what was found and where it went); one of another capacity or row size
    starts over in place (``regeometry``). ``fresh``: the slots start over (no entry of the files counts)."""

    def __init__(self, path: Path, slots: int, row_bytes: int, lock_timeout_s: float):
        self.path, self.slots = path, slots
        self.found: list[str] = []
        self.aside: list[Path] = []
        self.regeometry = False
        head = INDEX_HEADER.pack(INDEX_MAGIC, slots, row_bytes)
        for _ in range(3):  # a damaged index set aside, or replaced under the lock wait: opened again
            why, old = self._open(lock_timeout_s)
            if why is None:
                break
            self._set_aside(why)
        else:
            raise StoreError(f"{path}: the index keeps changing under this store ({why}): refused")
        try:
            self.fresh = old != head
            if self.fresh and old.strip(b"\0"):  # slots of another capacity or row size: they start over
                _, was_slots, was_row = INDEX_HEADER.unpack(old)
                self.regeometry = True
                self.found.append(f"an index of {was_slots} slots of {was_row} bytes, now {slots} slots of {row_bytes}")
            if self.fresh:
                os.ftruncate(self.fd, 0)
                os.pwrite(self.fd, head.ljust(INDEX_HEADER_BYTES, b"\0"), 0)
            os.ftruncate(self.fd, INDEX_HEADER_BYTES + slots * ENTRY.itemsize)
        except OSError as e:
            os.close(self.fd)
            raise StoreError(f"{path}: cannot write the index ({e.strerror}): refused") from None

    def _open(self, lock_timeout_s: float) -> tuple[str | None, bytes]:
        """Open and lock the index: (None, its header bytes), or (why it is not this store's index, b"") with
        nothing left open. StoreError when another store holds it past ``lock_timeout_s``."""
        path = self.path
        try:
            self.fd, created = file_trust.open_file(path, os.O_RDWR, create=True)
        except OSError as e:
            if e.errno in (errno.ELOOP, errno.EISDIR, errno.ENXIO, errno.EACCES, errno.EPERM):
                return f"cannot be opened as the index ({e.strerror})", b""
            raise StoreError(f"{path}: cannot open the index ({e.strerror}): refused") from None
        try:
            why = None if created else file_trust.untrusted(os.fstat(self.fd))
            if why is not None:
                os.close(self.fd)
                return f"is {why}", b""
            if not file_trust.lock_file(self.fd, lock_timeout_s):
                raise StoreError(f"{path}: held by another store for more than {lock_timeout_s} s (another engine on "
                                 "this directory and identity): one store uses the files at a time")
            st = os.fstat(self.fd)
            try:
                at = os.lstat(path)
                now: tuple[int, int] | None = (at.st_dev, at.st_ino)
            except FileNotFoundError:
                now = None
            if (st.st_dev, st.st_ino) != now:  # set aside or replaced while this store waited
                os.close(self.fd)
                return "replaced while this store waited for it", b""
            old = os.pread(self.fd, INDEX_HEADER.size, 0)
            if old.strip(b"\0") and (len(old) < INDEX_HEADER.size or old[:8] != INDEX_MAGIC):
                os.close(self.fd)
                return f"not a kvxfer index (it begins {old[:8]!r})", b""
            return None, old
        except OSError as e:
            os.close(self.fd)
            raise StoreError(f"{path}: cannot read the index ({e.strerror}): refused") from None
        except BaseException:
            os.close(self.fd)
            raise

    def _set_aside(self, why: str) -> None:
        if why.startswith("replaced"):
            return
        try:
            self.aside.append(set_aside(self.path))
        except OSError as e:
            raise StoreError(f"{self.path}: the index {why}, and it cannot be set aside ({e.strerror}): refused") from None
        self.found.append(f"the index {why}")

    def read(self) -> np.ndarray:
        raw = os.pread(self.fd, self.slots * ENTRY.itemsize, INDEX_HEADER_BYTES)
        out = np.zeros(self.slots, ENTRY)
        out.view(np.uint8)[:len(raw)] = np.frombuffer(raw, np.uint8)
        return out

    def write(self, slots: np.ndarray, keys: Sequence[bytes], epoch: int) -> int:
        """Write the entries of ``slots`` (one pwrite per run of adjacent slots); returns the calls made."""
        order = np.argsort(slots, kind="stable")
        slots = slots[order]
        entries = np.zeros(len(slots), ENTRY)
        entries["epoch"] = epoch
        entries["key_len"] = [len(keys[i]) for i in order.tolist()]
        for j, i in enumerate(order.tolist()):
            entries["key"][j, :len(keys[i])] = np.frombuffer(keys[i], np.uint8)
        entries["check"] = _entry_check(slots, entries)
        cuts = np.flatnonzero(np.diff(slots) != 1) + 1
        calls = 0
        for lo, hi in zip([0, *cuts.tolist()], [*cuts.tolist(), len(slots)]):
            data = entries[lo:hi].tobytes()
            if os.pwrite(self.fd, data, INDEX_HEADER_BYTES + int(slots[lo]) * ENTRY.itemsize) != len(data):
                raise OSError(0, "short write of the index")
            calls += 1
        return calls

    def close(self) -> None:
        os.close(self.fd)


class ChunkStore(QueuedJobs):
    """Rows of ``memory`` (uint8, ``row_bytes`` each) stored under keys in files; see the module docstring.

    ``config``: a StoreConfig (or its dict); ``identity``: JSON-able values saying what the bytes mean (the
    namespace); ``executor``: the storage executor (default: kvxfer's POSIX executor on ``io_threads`` threads,
    closed with the store). Raises StoreConfigError (a ValueError naming the key) for bad settings, StoreError or
    BindingError when the files cannot be used.

    Threads: one owner thread calls ``lookup``, ``touch``, ``submit_store``, ``submit_load``, ``poll``,
    ``pending`` and ``close`` (vLLM's scheduler thread); none of them blocks but ``drain`` and ``close``. The
    store's thread runs the jobs; the two share only the job queue and the result queue (each under its lock)
    and the counters (under their lock). The key index and slot state belong to the owner thread.
    """

    def __init__(self, config: StoreConfig | Mapping[str, Any], memory: np.ndarray, row_bytes: int,
                 identity: Mapping[str, Any], *, executor: StorageExecutor | None = None):
        self.config = config if isinstance(config, StoreConfig) else StoreConfig.model_validate(dict(config))
        self.row_bytes, self.slots = int(row_bytes), self.config.capacity_bytes // int(row_bytes)
        self.io_threads = self.config.io_threads or (4 if self.config.o_direct else 1)
        if self.slots < 1:
            raise StoreConfigError("capacity_bytes", self.config.capacity_bytes,
                                   f"smaller than one chunk ({row_bytes} bytes): nothing could be stored")
        if not isinstance(memory, np.ndarray) or not memory.flags.c_contiguous:
            raise StoreConfigError("memory", f"{type(memory).__name__} of strides {getattr(memory, 'strides', None)}",
                                   "must be one C-contiguous numpy array: the store reads and writes it in place, and "
                                   "any other would be a private copy the caller never sees")
        self.memory = memory.reshape(-1).view(np.uint8)
        self.num_rows = self.memory.nbytes // self.row_bytes
        self.stats = StoreStats(slots=self.slots, row_bytes=self.row_bytes)
        self.folder = self._folder(identity)
        self._own: Any = None  # the executor this store made, closed with it
        if executor is None:
            from kvxfer.executors import PosixFileExecutor

            executor = self._own = PosixFileExecutor(threads=self.io_threads, piece_bytes=max(self.row_bytes, 8 << 20))
        self.executor: StorageExecutor = executor
        self._cond = threading.Condition()
        self._queue: collections.deque[_Job] = collections.deque()
        self._results: list[tuple[StoreResult, tuple[bytes, ...]]] = []
        self._counters = threading.Lock()
        self._running = 0
        self._stop = False
        self._died = None  # why the store's thread stopped, if it ever does
        self.index: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # durable keys, LRU first
        self._storing: dict[bytes, int] = {}
        self._free = np.ones(self.slots, dtype=bool)
        self._nfree = self.slots  # the count of True in _free
        self._pins = np.zeros(self.slots, dtype=np.int32)
        self._logged: set[bytes] = set()
        self._logged_paths: set[str] = set()
        self._jobs: dict[int, _Job] = {}
        # called on the owner thread with the keys that left the store and why ("evicted", "integrity")
        self.on_removed: Callable[[Sequence[bytes], str], None] | None = None
        self._open()
        self._thread = threading.Thread(target=self._serve, name="kvxfer-chunk-store", daemon=True)
        self._thread.start()

    # ---- opening ---------------------------------------------------------------------------------------------
    def _folder(self, identity: Mapping[str, Any]) -> Path:
        root = Path(self.config.root_dir)
        if not root.is_dir():
            raise StoreConfigError("root_dir", self.config.root_dir, "no such directory (create it first)")
        if not os.access(root, os.W_OK | os.X_OK):
            raise StoreConfigError("root_dir", self.config.root_dir, "not writable by this process")
        folder = root / namespace(identity)
        try:
            _private_dir(folder)
        except OSError as e:
            raise StoreConfigError("root_dir", self.config.root_dir, f"not writable: cannot create {folder.name} in it "
                                   f"({e.strerror})") from None
        self._identity(folder / "identity.json", json.dumps(identity, sort_keys=True, indent=1))
        return folder

    @staticmethod
    def _identity(path: Path, text: str) -> None:
        """Write the identity at ``path`` whole (a failed first open leaves nothing), or check the one there;
        StoreError for another identity or for something that is not a private regular file."""
        refused = "refused (remove the folder to start over)"
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            st = None
        except OSError as e:
            raise StoreError(f"{path}: cannot be read ({e.strerror}); {refused}") from None
        try:
            if st is None or (stat.S_ISREG(st.st_mode) and st.st_size == 0 and file_trust.untrusted(st) is None):
                # none yet, or an empty one an interrupted first open of an older release left
                if st is None and create_file(path, text.encode()):
                    return
                if st is not None:
                    replace_file(path, text.encode(), sync=True)
                    return
            fd, _ = file_trust.open_file(path, os.O_RDONLY | os.O_NONBLOCK, create=False)
        except OSError as e:
            raise StoreError(f"{path}: cannot be written or opened ({e.strerror}); {refused}") from None
        try:
            why = file_trust.untrusted(os.fstat(fd))
            found = None if why is not None else os.pread(fd, 1 << 20, 0).decode(errors="replace")
        except OSError as e:
            raise StoreError(f"{path}: cannot be read ({e.strerror}); {refused}") from None
        finally:
            os.close(fd)
        if why is not None or found != text:
            raise StoreError(f"{path}: {why or 'another identity under this digest'}; {refused}")

    def _layout(self) -> Layout:
        align = 4096 if self.config.o_direct else 1
        rows = Buffer(name=ROWS, nbytes=self.num_rows * self.row_bytes, location=Location.HOST, align_bytes=align)
        data = Buffer(name=DATA, nbytes=self.slots * self.row_bytes, location=Location.FILE, align_bytes=align)
        region = Region(name="chunk", page_bytes=self.row_bytes,
                        device=Placement(buffer=ROWS, byte_offset=0, stride_bytes=self.row_bytes),
                        host=Placement(buffer=DATA, byte_offset=0, stride_bytes=self.row_bytes))
        return Layout(buffers=(rows, data), regions=(region,))

    def _open(self) -> None:
        data = self.folder / "chunks.kvx"
        sums = Path(f"{data}.kvxsum")
        self._index = _Index(Path(f"{data}.index"), self.slots, self.row_bytes, self.config.lock_timeout_s)
        found, aside = self._index.found, self._index.aside
        try:
            if self._index.fresh:  # the slots start over: what the old index vouched for goes (the files behind it)
                for old in (data, sums):
                    if not os.path.lexists(old):
                        continue
                    if self._index.regeometry and old.is_file() and not old.is_symlink():
                        old.unlink()  # slots of another capacity or row size: the store was reconfigured
                    else:
                        aside.append(self._set_aside(old, "with no index naming its chunks"))
            self.layout = self._layout()
            self.tier = self._tier(data, sums, found, aside)
        except BaseException:
            self._index.close()
            if self._own is not None:
                self._own.close()
            raise
        if found:
            _log.warning("kvxfer file tier %s: found %s; %s; the store starts over beside it (its chunks are misses, "
                         "recomputed)", self.folder, "; ".join(found),
                         f"set aside as {', '.join(p.name for p in aside)}" if aside else "nothing set aside")
        self._load_index()

    def _set_aside(self, path: Path, why: str) -> Path:
        try:
            return set_aside(path)
        except OSError as e:
            raise StoreError(f"{path}: {why}, and it cannot be set aside ({e.strerror}): refused") from None

    def _tier(self, data: Path, sums: Path, found: list[str], aside: list[Path]) -> FileTier:
        """The FileTier over the data file and its records; a file that cannot be trusted (a link, a copy under
        another inode, records that are not this file's) is set aside once and the files start over. This store
        holds the index's lock, which guards these files; another FileTier holding them is refused, not damage."""
        for attempt in (0, 1):
            binding = FileBinding(data, create=True, o_direct=self.config.o_direct)
            try:
                return FileTier(self.executor, self.layout, {DATA: binding}, {ROWS: self.memory},
                                durability=self.config.durability, chunk_bytes=self.row_bytes,
                                verify=self.config.verify, lock_timeout_s=self.config.lock_timeout_s)
            except BindingError as e:
                binding.close()
                if attempt or "locked by another" in str(e.reason) or str(e.value) not in (str(data), str(sums)):
                    raise
                found.append(f"{e.value}: {e.reason}")
                aside.extend(self._set_aside(p, str(e.reason)) for p in (data, sums) if os.path.lexists(p))
        raise AssertionError("unreachable")  # the loop returns or raises

    def _load_index(self) -> None:
        """Count the entries that hold: CRC intact, epoch equal to the slot's trusted record, newest per key."""
        entries = self._index.read()
        slots = np.arange(self.slots, dtype=np.uint64)
        used = entries["epoch"] != 0
        trusted = self.tier.epochs(DATA)
        ok = used & (entries["epoch"] == trusted) & (entries["key_len"] <= MAX_KEY_BYTES)
        ok[ok] = entries["check"][ok] == _entry_check(slots[ok], entries[ok])  # CRCs of the candidates only
        order = np.flatnonzero(ok)[np.argsort(entries["epoch"][ok], kind="stable")]  # oldest first: LRU order
        for s in order.tolist():
            key = entries["key"][s][:int(entries["key_len"][s])].tobytes()
            old = self.index.pop(key, None)
            if old is not None:
                self._free[old] = True
            self.index[key] = s
            self._free[s] = False
        self._nfree = int(self._free.sum())
        self.stats.found, self.stats.discarded = len(self.index), int(used.sum()) - len(self.index)
        if self.stats.found or self.stats.discarded:
            _log.info("kvxfer file tier %s: %d chunks found, %d discarded (a store interrupted or a slot reused: never "
                      "read)", self.folder, self.stats.found, self.stats.discarded)

    # ---- the owner thread ------------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> bool:
        """Whether ``key`` is stored (durably: its store was reported done); refreshes it. Never blocks."""
        hit = key in self.index
        if hit:
            self.index.move_to_end(key)
        with self._counters:
            self.stats.lookups += 1
            self.stats.hits += hit
        return hit

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark the stored ones of ``keys`` most recently used."""
        for k in keys:
            if k in self.index:
                self.index.move_to_end(k)

    def submit_store(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> None:
        """Store row ``rows[i]`` of the memory under ``keys[i]`` (keys already stored or being stored are left
        as they are); the rows must not change until the job is reported. Never blocks. StoreJobError (nothing
        queued) for a job id in use, a key given twice, rows that are not row numbers of the memory."""
        rows = self._check(job_id, keys, rows)
        # in row order: rows adjacent in memory get adjacent slots, so the store is one I/O per run of rows
        # (vLLM hands a job's keys in no particular order)
        new = [i for i in np.argsort(rows, kind="stable").tolist()
               if keys[i] not in self.index and keys[i] not in self._storing and len(keys[i]) <= MAX_KEY_BYTES]
        slots = self._allocate(len(new))
        new = new[:len(slots)]
        chosen = tuple(keys[i] for i in new)
        for k, s in zip(chosen, slots.tolist()):
            self._storing[k] = s
        with self._counters:
            self.stats.skipped += len(keys) - len(new)
        self._enqueue(_Job(job_id, STORE, chosen, rows[new], slots, tuple(keys)))

    def submit_load(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> None:
        """Load the chunk stored under ``keys[i]`` into row ``rows[i]``; keys not stored fail the job (reported
        among its failed keys). Never blocks. StoreJobError as ``submit_store``."""
        rows = self._check(job_id, keys, rows)
        have = [i for i, k in enumerate(keys) if k in self.index]
        slots = np.array([self.index[keys[i]] for i in have], dtype=np.int64)
        self._pins[slots] += 1
        job = _Job(job_id, LOAD, tuple(keys[i] for i in have), rows[have], slots, tuple(keys))
        self._enqueue(job, first=True)

    def _check(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> np.ndarray:
        """The job's rows as int64, after refusing (StoreJobError naming the field, index and value) a job id in
        use, a key given twice, rows that are not integers or not rows of the memory, as many rows as keys."""
        if job_id in self._jobs:
            raise StoreJobError("job_id", job_id, "already in use by a job not yet reported by poll()")
        seen: dict[bytes, int] = {}
        for i, k in enumerate(keys):
            if seen.setdefault(k, i) != i:
                raise StoreJobError("keys", k, f"job {job_id}: the key of keys[{seen[k]}] again", index=i)
        raw = np.asarray(rows).reshape(-1)
        if raw.dtype.kind not in "iu":  # floats (1.7, nan), objects (2**70), bools: refused, never rounded
            i = next((j for j, v in enumerate(raw.tolist()) if isinstance(v, bool) or not isinstance(v, (int, float))
                      or not float(v).is_integer() or not 0 <= v < self.num_rows), 0)
            raise StoreJobError("rows", raw.tolist()[i] if len(raw) else rows,
                                f"job {job_id}: rows are integers from 0 to {self.num_rows - 1}", index=i)
        bad = np.flatnonzero((raw < 0) | (raw >= self.num_rows)) if len(raw) else np.zeros(0, np.int64)
        if len(bad):
            i = int(bad[0])
            raise StoreJobError("rows", int(raw[i]), f"job {job_id}: rows go from 0 to {self.num_rows - 1}", index=i)
        if len(keys) != len(raw):
            raise StoreJobError("rows", len(raw), f"job {job_id}: {len(keys)} keys need as many rows")
        return raw.astype(np.int64)

    def _allocate(self, n: int) -> np.ndarray:
        """``n`` free slots (fewer if too many are pinned), evicting least recently used keys; a run of adjacent
        slots when there is one, so the store is one I/O."""
        if n == 0:
            return np.zeros(0, np.int64)
        need = n - self._nfree
        victims: list[bytes] = []
        for key, s in self.index.items():  # least recently used first; a slot being loaded stays
            if len(victims) >= need:
                break
            if not self._pins[s]:
                victims.append(key)
        for key in victims:
            self._free[self.index.pop(key)] = True
        free = np.flatnonzero(self._free)
        if len(free) > n:
            cuts = np.flatnonzero(np.diff(free) != 1) + 1
            starts, ends = np.concatenate(([0], cuts)), np.concatenate((cuts, [len(free)]))
            fit = np.flatnonzero(ends - starts >= n)
            free = free[starts[fit[0]]:starts[fit[0]] + n] if len(fit) else free[:n]
        self._free[free] = False
        self._nfree = int(self._nfree + len(victims) - len(free))
        with self._counters:
            self.stats.evictions += len(victims)
        if victims and self.on_removed is not None:
            self.on_removed(victims, "evicted")
        return free.astype(np.int64)

    def poll(self) -> list[StoreResult]:
        """The jobs finished since the last call, each once; applies them (stored keys become hits, chunks a load
        refused leave the index). Never blocks."""
        with self._cond:
            done, self._results = self._results, []
        now = time.time()
        for r, bad in done:
            self._apply(r, bad, now)
        return [r for r, _ in done]

    def _apply(self, r: StoreResult, bad: tuple[bytes, ...], now: float) -> None:
        job = self._jobs.pop(r.job_id, None)
        if job is None:  # refused when it was submitted: nothing was taken for it
            return
        if job.op == STORE:
            for k in job.keys:
                s = self._storing.pop(k)
                if r.success:
                    self.index[k] = s
                else:
                    self._free[s] = True
                    self._nfree += 1
            return
        self._pins[job.slots] -= 1
        slot_of = dict(zip(job.keys, job.slots.tolist()))
        dropped = [k for k in bad if self.index.get(k) == slot_of[k]]
        for k in dropped:
            del self.index[k]
            self._free[slot_of[k]] = True
            self._nfree += 1
        if dropped and self.on_removed is not None:
            self.on_removed(dropped, "integrity")
        new = [k for k in bad if k not in self._logged]
        if new:  # one line per job, each chunk in one line only
            self._logged.update(new)
            _log.warning("kvxfer file tier %s: %d stored chunk(s) refused and dropped (misses, recomputed); the last: %s",
                         self.folder, len(new), r.error)
        with self._counters:
            for t in self.stats.load_timeline:
                if t.get("job") == r.job_id:
                    t["polled"] = now

    def close(self) -> None:
        """Finish the jobs submitted, stop the thread, write the counters and close the files (and the executor the
        store made). Results not polled are dropped."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        try:
            self.tier.close()
        finally:
            self._index.close()
            if self._own is not None:
                self._own.close()
            self._write_stats()
            self.memory = np.zeros(0, np.uint8)  # no view of the caller's rows is kept (vLLM unmaps them)

    # ---- the store's thread ------------------------------------------------------------------------------------
    def _enqueue(self, job: _Job, first: bool = False) -> None:
        with self._cond:
            if self._stop:
                raise StoreError("the store is closed")
            self._jobs[job.job_id] = job
            if self._died is not None:  # no thread runs it: it fails as a job, reported by poll()
                self._results.append(self._failed(job, self._died))
            else:
                (self._queue.appendleft if first else self._queue.append)(job)
            self._cond.notify_all()

    @staticmethod
    def _failed(job: _Job, why: BaseException) -> tuple[StoreResult, tuple[bytes, ...]]:
        error = why if isinstance(why, Exception) else StoreError(f"the store's thread stopped: {why!r}")
        return StoreResult(job.job_id, job.op, False, job.asked, (), error=error), ()

    def _serve(self) -> None:
        """Run the jobs until closed. A side task (the counters) never stops it; should anything stop it anyway,
        the job it ran and every queued one fail as jobs, later ones fail at submission, ``drain`` returns."""
        job: _Job | None = None
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stop:
                        self._cond.wait()
                    if not self._queue:
                        return
                    job = self._queue.popleft()
                    self._running += 1
                try:
                    out = self._store(job) if job.op == STORE else self._load(job)
                except Exception as e:  # a job never disappears: its failure is its result
                    out = self._failed(job, e)
                self._finished(out)
                job = None
                self._write_stats()
        except BaseException as e:
            self._stopped(_log, f"file tier {self.folder}", job, e)

    def _calls(self) -> int:
        return int(getattr(self.executor, "calls", 0))

    def _store(self, job: _Job) -> tuple[StoreResult, tuple[bytes, ...]]:
        """Spill the job's rows into its slots, then write and sync their index entries."""
        if not job.keys:
            return StoreResult(job.job_id, STORE, True, job.asked, ()), ()
        t0, calls = time.perf_counter(), self._calls()
        plan = plan_transfer(self.layout, BlockMapping(direction="d2h", src_ids=job.rows, dst_ids=job.slots))
        r = self.tier.spill(plan)
        syncs = 3 if self.config.durability is Durability.FDATASYNC else 0
        if r.success and r.epoch is not None:
            try:
                self._index.write(job.slots, job.keys, r.epoch)
                if self.config.durability is Durability.FDATASYNC:
                    os.fdatasync(self._index.fd)
                    syncs += 1
            except OSError as e:
                r = r.__class__(STORE, False, 0, r.seconds, error=TierError(STORE, "index write", [str(self._index.path)],
                                                                              e.strerror or str(e)))
        seconds = time.perf_counter() - t0
        with self._counters:
            self.stats.io_calls += self._calls() - calls
            self.stats.syncs += syncs
            if r.success:
                self.stats.stores += 1
                self.stats.chunks_stored += len(job.keys)
                self.stats.bytes_stored += plan.total_bytes
                self.stats.store_s += seconds
            else:
                self.stats.failed_jobs += 1
        done = job.keys if r.success else ()
        return StoreResult(job.job_id, STORE, r.success, job.asked, done, plan.total_bytes if r.success else 0,
                           seconds, r.error), ()

    def _load(self, job: _Job) -> tuple[StoreResult, tuple[bytes, ...]]:
        """Restore the job's slots into its rows. A chunk FileTier refuses is dropped and the rest read again; a
        read that fails otherwise (a hole, a short file, EIO) is retried chunk by chunk, and each chunk that cannot
        be read alone is dropped too: a chunk that cannot be read and checked is a miss from then on."""
        started, t0, calls = time.time(), time.perf_counter(), self._calls()
        left = dict(zip(job.slots.tolist(), zip(job.keys, job.rows.tolist())))
        bad: list[bytes] = []
        error: Exception | None = None
        nbytes = 0

        def restore(slots: list[int]) -> Any:
            rows = [left[s][1] for s in slots]
            return self.tier.restore(plan_transfer(self.layout, BlockMapping(
                direction="h2d", src_ids=np.array(slots, np.int64), dst_ids=np.array(rows, np.int64))))

        while left:
            r = restore(list(left))
            if r.success:
                nbytes += r.nbytes
                break
            error = r.error
            if isinstance(r.error, IntegrityError) and r.error.chunk in left:
                bad.append(left.pop(r.error.chunk)[0])
                continue
            if len(left) == 1:  # read alone already
                bad.append(left.popitem()[1][0])
                break
            for s in list(left):  # which chunks cannot be read: each alone
                one = restore([s])
                if one.success:
                    nbytes += one.nbytes
                else:
                    error = one.error
                    bad.append(left.pop(s)[0])
            break
        dropped = set(bad)
        done = tuple(k for k in job.keys if k not in dropped)
        seconds = time.perf_counter() - t0
        ok = len(done) == len(job.asked)
        with self._counters:
            self.stats.io_calls += self._calls() - calls
            self.stats.integrity_misses += len(bad)
            self.stats.loads += 1
            self.stats.chunks_loaded += len(done)
            self.stats.bytes_loaded += nbytes
            self.stats.load_s += seconds
            self.stats.failed_jobs += not ok
            self.stats.load_timeline = [*self.stats.load_timeline[-31:], {
                "job": job.job_id, "chunks": len(done), "bytes": nbytes, "submitted": job.submitted,
                "started": started, "done": time.time()}]
        if ok:
            error = None
        elif not bad:
            missing = [k for k in job.asked if k not in job.keys]
            error = StoreError(f"{len(missing)} of the {len(job.asked)} keys asked are not stored (the first: "
                               f"{missing[0] if missing else b''!r})")
        return StoreResult(job.job_id, LOAD, ok, job.asked, done, nbytes, seconds, error), tuple(bad)

    def _write_stats(self) -> None:
        """Replace the counters file whole (a reader never sees half of one; no link is followed); a failure of
        any kind is logged once and never stops the store's thread."""
        path = self.config.stats_path
        if path is None:
            return
        try:
            with self._counters:
                text = json.dumps({**vars(self.stats), "folder": str(self.folder)}, indent=1)
            replace_file(path, text.encode())
        except Exception as e:
            if "stats" not in self._logged_paths:
                self._logged_paths.add("stats")
                _log.warning("kvxfer file tier: cannot write the counters to %s: %s", path, e)


entry_check = _entry_check  # public for ``admin`` (kvxfer store show), which counts entries the way the store does
