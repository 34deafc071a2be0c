"""A chunk store several engines share: one ``root_dir``, no lock on the store or load path.

``SharedChunkStore`` has ``ChunkStore``'s face (``lookup``, ``touch``, ``submit_store``, ``submit_load``,
``poll``, ``pending``, ``drain``, ``close``) and is chosen by ``StoreConfig.shared``. Files, in
``root_dir/kvxfer-<label>-<digest>/shared/`` (the identity's namespace, private to its user, as ChunkStore's):

- ``<key hex>.<writer>.kvc``: one chunk, written by one writer only: a 256-byte header (magic, key, row bytes,
  epoch, writer, the namespace digest, CRC-32 of the data, CRC-32 of the header) and the row. Written under
  ``.tmp.<writer>.<n>`` (O_EXCL, 0600), synced under ``fdatasync``, then renamed into place: a reader sees
  the old file whole or the new one whole, never a mix;
- ``writers/<writer>.lease``: the writer's heartbeat (its mtime, refreshed every ``SCAN_S``).

The writer id is ``<host>-<pid>-<8 random hex>``: one per open store, so an engine writes only files it owns
and needs no lock another engine could wait on. Readers trust nothing they do not validate: each file is opened
without following a link, refused unless it is a regular file of this user not writable by others, read whole
into a private buffer, and used only if magic, key, row size, namespace digest and both CRCs hold; only then is
the row copied into memory. A chunk that fails (gone, torn, foreign, rewritten) is a miss, never wrong bytes;
a file that fails a check is logged once and not offered again until it changes (another inode, size or
time). It is never renamed or removed for it: it may be another live engine's, and only its writer (or
eviction, once that writer is dead) removes it.

Eviction: a writer removes only its own files, or files (and temporaries) of writers proven dead (a lease older
than ``dead_after_s``, or on this host a pid that no longer exists). Removing or replacing a file never harms a
read in flight: the reader holds the open inode (POSIX; on NFS see docs/vllm/sharing.md). Capacity: each writer
keeps its estimate of the store's bytes (the last scan plus its own changes since) at most ``capacity_bytes``,
evicting its own least recently used files first and skipping the store when it cannot; the store as a whole
stays within ``capacity_bytes`` plus what other writers stored since this writer's last scan (at most one
``SCAN_S`` interval of their stores) plus files of writers that died less than ``dead_after_s`` ago.
"""
from __future__ import annotations

import collections
import hashlib
import json
import logging
import os
import re
import socket
import stat
import struct
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import file_trust

from ..checksums import crc32  # ISA-L where installed, else zlib: the same values
from .chunk_store import (
    LOAD,
    MAX_KEY_BYTES,
    STORE,
    StoreConfig,
    StoreConfigError,
    StoreError,
    StoreResult,
    StoreStats,
    namespace,
)
from .file_tier import Durability
from .job_queue import QueuedJobs

_log = logging.getLogger(__name__)

__all__ = ["CHUNK_HEADER", "HEADER_BYTES", "SharedChunkStore", "chunk_file", "encode_chunk", "read_chunk", "writer_id"]

MAGIC = b"KVXSHR01"
# magic, key length, pad, row bytes, epoch, writer (32 bytes), namespace digest (16), data CRC, header CRC
CHUNK_HEADER = struct.Struct("<8sHHQQ32s16sII")
HEADER_BYTES = 256  # the header, then the key; the row follows
SCAN_S = 1.0
DEAD_AFTER_S = 60.0
_WRITER = re.compile(r"^[A-Za-z0-9-]{1,32}$")


def _private_dir(path: Path) -> None:
    """Create ``path`` (0700) or accept it if it is a directory of this user no one else may write; StoreError."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
        raise StoreError(f"{path}: not a directory of this user that only it may write (uid {st.st_uid}, mode "
                         f"{stat.filemode(st.st_mode)}): another user could plant or forge chunks; refused")


def writer_id() -> str:
    """A fresh writer id: ``<host>-<pid>-<8 hex>`` (file-name characters, no dots, at most 32)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname())[:12] or "host"
    return f"{host}-{os.getpid()}-{os.urandom(4).hex()}"


def chunk_file(key: bytes, writer: str) -> str:
    """The file name of ``key`` written by ``writer``."""
    return f"{key.hex()}.{writer}.kvc"


def _parse(name: str) -> tuple[bytes, str] | None:
    parts = name.split(".")
    if len(parts) != 3 or parts[2] != "kvc" or not _WRITER.match(parts[1]):
        return None
    try:
        return bytes.fromhex(parts[0]), parts[1]
    except ValueError:
        return None


def encode_chunk(key: bytes, row: np.ndarray | bytes, writer: str, digest: bytes, epoch: int) -> bytes:
    """Header, key and row of one chunk file."""
    data = np.ascontiguousarray(row).reshape(-1).view(np.uint8).tobytes() if isinstance(row, np.ndarray) else bytes(row)
    body = CHUNK_HEADER.pack(MAGIC, len(key), 0, len(data), epoch, writer.encode(), digest, crc32(data), 0)
    head = body[:-4] + struct.pack("<I", crc32(body[:-4] + key))
    return (head + key).ljust(HEADER_BYTES, b"\0") + data


def _stat_id(st: os.stat_result) -> tuple[int, ...]:
    """What changes when a file is replaced or rewritten: device, inode, size, modification and change times."""
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns


def _file_id(path: Path) -> tuple[int, ...] | None:
    """``_stat_id`` of ``path`` (not followed if a link), or None when it cannot be looked at."""
    try:
        return _stat_id(os.lstat(path))
    except OSError:
        return None


def read_chunk(path: Path, key: bytes, row_bytes: int, digest: bytes) -> tuple[bytes | None, str]:
    """The row stored in ``path`` for ``key``, or None and why: every check holds or nothing is returned."""
    try:
        fd, _ = file_trust.open_file(path, os.O_RDONLY, create=False)
    except OSError as e:
        return None, f"cannot open ({e.strerror})"
    try:
        why = file_trust.untrusted(os.fstat(fd))
        if why is not None:
            return None, f"{why}; not trusted"
        raw = os.pread(fd, HEADER_BYTES + row_bytes + 1, 0)
    except OSError as e:
        return None, f"cannot read ({e.strerror})"
    finally:
        os.close(fd)
    if len(raw) != HEADER_BYTES + row_bytes:
        return None, f"{len(raw)} bytes, want {HEADER_BYTES + row_bytes}: short, long or cut"
    magic, klen, _, nbytes, _, _, dig, dcrc, hcrc = CHUNK_HEADER.unpack_from(raw)
    if magic != MAGIC:
        return None, f"not a kvxfer shared chunk (magic {magic!r})"
    if klen > MAX_KEY_BYTES or crc32(raw[:CHUNK_HEADER.size - 4] + raw[CHUNK_HEADER.size:CHUNK_HEADER.size + klen]) != hcrc:
        return None, "header corrupted"
    if raw[CHUNK_HEADER.size:CHUNK_HEADER.size + klen] != key or nbytes != row_bytes or dig != digest:
        return None, "another key, row size or identity: not this chunk"
    data = raw[HEADER_BYTES:]
    if crc32(data) != dcrc:
        return None, "data checksum mismatch: torn or corrupted"
    return data, ""


# StoreConfig's settings the shared store does not carry out, and why: set to anything but their default, refused
UNSHARED = {
    "verify": "every chunk's CRC-32 is always checked (a file another engine wrote is trusted only when it holds)",
    "o_direct": "each chunk is its own file, read whole through the page cache",
    "io_threads": "one job's files are read and written on the store's thread",
    "lock_timeout_s": "a shared store takes no lock",
}


class SharedChunkStore(QueuedJobs):
    """Rows of ``memory`` stored under keys in files several engines share; see the module docstring.

    Same threads as ChunkStore: one owner thread calls the methods (none blocks but ``drain`` and ``close``);
    the store's thread runs jobs and scans the folder every ``scan_s`` seconds."""

    def __init__(self, config: StoreConfig | Mapping[str, Any], memory: np.ndarray, row_bytes: int,
                 identity: Mapping[str, Any], *, executor: Any = None, scan_s: float = SCAN_S,
                 dead_after_s: float = DEAD_AFTER_S):
        self.config = config if isinstance(config, StoreConfig) else StoreConfig.model_validate(dict(config))
        self.row_bytes = int(row_bytes)
        self.file_bytes = HEADER_BYTES + self.row_bytes
        self.slots = self.config.capacity_bytes // self.file_bytes
        if self.slots < 1:
            raise StoreConfigError("capacity_bytes", self.config.capacity_bytes,
                                   f"smaller than one chunk file ({self.file_bytes} bytes): nothing could be stored")
        root = Path(self.config.root_dir)
        if not root.is_dir():
            raise StoreConfigError("root_dir", self.config.root_dir, "no such directory (create it first)")
        if not isinstance(memory, np.ndarray) or not memory.flags.c_contiguous:
            raise StoreConfigError("memory", f"{type(memory).__name__} of strides {getattr(memory, 'strides', None)}",
                                   "must be one C-contiguous numpy array: the store reads and writes it in place, and "
                                   "any other would be a private copy the caller never sees")
        for key, why in UNSHARED.items():  # settings this store does not carry out are refused, never ignored
            if key in self.config.model_fields_set and getattr(self.config, key) != StoreConfig.model_fields[key].default:
                raise StoreConfigError(key, getattr(self.config, key), f"not with shared: {why}")
        self.memory = memory.reshape(-1).view(np.uint8)
        self.num_rows = self.memory.nbytes // self.row_bytes
        self.scan_s, self.dead_after_s = float(scan_s), float(dead_after_s)
        self.stats = StoreStats(slots=self.slots, row_bytes=self.row_bytes, files=0)
        ns = namespace(identity)
        self.digest = hashlib.sha256(ns.encode()).digest()[:16]
        _private_dir(root / ns)
        self.folder = root / ns / "shared"
        _private_dir(self.folder)
        _private_dir(self.folder / "writers")
        identity_file = root / ns / "identity.json"
        if not identity_file.exists():
            tmp = root / ns / f".identity.{os.getpid()}.{os.urandom(4).hex()}"
            tmp.write_text(json.dumps(dict(identity), sort_keys=True, indent=1))
            os.replace(tmp, identity_file)
        self.writer = writer_id()
        self._lease = self.folder / "writers" / f"{self.writer}.lease"
        self._lease.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        self._seq = 0
        self._stats_logged = False
        self._cond = threading.Condition()
        self._queue: collections.deque[tuple[int, str, tuple[bytes, ...], np.ndarray]] = collections.deque()
        self._results: list[StoreResult] = []
        self._running = 0
        self._stop = False
        self._died: BaseException | None = None  # why the store's thread stopped, if it ever does
        self._known_lock = threading.Lock()
        self._known: dict[bytes, set[str]] = {}  # key -> file names holding it (any writer)
        self._refused: dict[str, tuple[int, ...]] = {}  # file name -> what it was when a load refused it
        self._own: collections.OrderedDict[bytes, str] = collections.OrderedDict()  # own files, LRU first
        self._estimate = 0  # bytes in the folder: the last scan plus this writer's changes since
        self._last_scan = 0.0
        self._reapable: list[str] = []  # dead writers' files at the last scan, oldest first
        self.on_removed: Any = None  # the tier's hook; this store reports no removals (another writer's evictions are unseen)
        self._scan()
        self.stats.found = len(self._known)
        self._thread = threading.Thread(target=self._serve, name="kvxfer-shared-store", daemon=True)
        self._thread.start()

    # ---- the owner thread ------------------------------------------------------------------------------------
    def lookup(self, key: bytes) -> bool:
        """Whether some writer stored ``key`` (as of the last scan or this writer's own stores). Never blocks."""
        with self._known_lock:
            hit = bool(self._known.get(key))
            if key in self._own:
                self._own.move_to_end(key)
        self.stats.lookups += 1
        self.stats.hits += hit
        return hit

    def owns(self, key: bytes) -> bool:
        """Whether this writer holds a file of ``key`` (stored by it and not evicted by it since)."""
        with self._known_lock:
            return key in self._own

    def touch(self, keys: Iterable[bytes]) -> None:
        """Mark this writer's files of ``keys`` most recently used."""
        with self._known_lock:
            for k in keys:
                if k in self._own:
                    self._own.move_to_end(k)

    def _rows(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> np.ndarray:
        out = np.asarray(rows, dtype=np.int64).reshape(-1)
        if len(keys) != len(out):
            raise StoreConfigError("rows", len(out), f"job {job_id}: {len(keys)} keys need as many rows")
        if len(out) and (int(out.min()) < 0 or int(out.max()) >= self.num_rows):
            raise StoreConfigError("rows", out.tolist()[:8], f"job {job_id}: rows go from 0 to {self.num_rows - 1}")
        return out

    def submit_store(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> None:
        """Store row ``rows[i]`` under ``keys[i]`` (keys some writer holds are left as they are). Never blocks."""
        self._enqueue(job_id, STORE, tuple(keys), self._rows(job_id, keys, rows))

    def submit_load(self, job_id: int, keys: Sequence[bytes], rows: Sequence[int] | np.ndarray) -> None:
        """Load ``keys[i]`` into row ``rows[i]``; a key missing or refused fails the job (listed). Never blocks."""
        self._enqueue(job_id, LOAD, tuple(keys), self._rows(job_id, keys, rows), first=True)

    def poll(self) -> list[StoreResult]:
        """The jobs finished since the last call, each once. Never blocks."""
        with self._cond:
            done, self._results = self._results, []
        return done

    @property
    def index(self) -> list[bytes]:
        """The keys some writer's file holds, as of the last folder listing (for a tier's gauges and events)."""
        with self._known_lock:
            return [k for k, names in self._known.items() if names]

    def close(self) -> None:
        """Finish the jobs submitted and stop. The files stay: other writers (and a restart) read them, and once
        this writer's lease is old they may evict them."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
        self.memory = self.memory[:0]

    def _enqueue(self, job_id: int, op: str, keys: tuple[bytes, ...], rows: np.ndarray, first: bool = False) -> None:
        with self._cond:
            if self._stop:
                raise StoreError("the store is closed")
            if self._died is not None:  # no thread runs it: it fails as a job, reported by poll()
                self._results.append(self._failed((job_id, op, keys, rows), self._died))
            else:
                (self._queue.appendleft if first else self._queue.append)((job_id, op, keys, rows))
            self._cond.notify_all()

    @staticmethod
    def _failed(job: tuple[int, str, tuple[bytes, ...], np.ndarray], why: BaseException) -> StoreResult:
        error = why if isinstance(why, Exception) else StoreError(f"the store's thread stopped: {why!r}")
        return StoreResult(job[0], job[1], False, job[2], (), error=error)

    # ---- the store's thread ----------------------------------------------------------------------------------
    def _serve(self) -> None:
        """Run the jobs and the folder scans until closed. A side task (a scan, the counters) never stops it; should
        anything stop it anyway, the job it ran and every queued one fail as jobs, later ones fail at submission,
        ``drain`` returns."""
        job: tuple[int, str, tuple[bytes, ...], np.ndarray] | None = None
        try:
            while True:
                with self._cond:
                    while not self._queue and not self._stop:
                        if not self._cond.wait(max(0.0, self._last_scan + self.scan_s - time.monotonic())):
                            break
                    if not self._queue and self._stop:
                        return
                    job = self._queue.popleft() if self._queue else None
                    self._running += job is not None
                if job is None or time.monotonic() - self._last_scan >= self.scan_s:
                    try:
                        self._scan()
                    except Exception as e:  # a side task never kills the thread that serves jobs
                        _log.warning("kvxfer shared store %s: scan failed: %s", self.folder, e)
                if job is None:
                    continue
                job_id, op, keys, rows = job
                t0 = time.perf_counter()
                try:
                    r = self._store(job_id, keys, rows) if op == STORE else self._load(job_id, keys, rows)
                except Exception as e:  # a job never disappears: its failure is its result
                    r = StoreResult(job_id, op, False, keys, (), error=e)
                r = StoreResult(r.job_id, r.op, r.success, r.keys, r.done_keys, r.nbytes, time.perf_counter() - t0,
                                r.error)
                self._finished(r)
                job = None
                self._write_stats()
        except BaseException as e:
            self._stopped(_log, f"shared store {self.folder}", job, e)

    def _write_stats(self) -> None:
        """Replace the counters file (``stats_path``) whole; a failure is logged once."""
        path = self.config.stats_path
        if path is None:
            return
        text = json.dumps({**vars(self.stats), "folder": str(self.folder), "writer": self.writer}, indent=1)
        tmp = Path(f"{path}.{os.getpid()}.tmp")
        try:
            tmp.write_text(text)
            os.replace(tmp, path)
        except OSError as e:
            if not self._stats_logged:
                self._stats_logged = True
                _log.warning("kvxfer shared store: cannot write the counters to %s: %s", path, e)

    def _store(self, job_id: int, keys: tuple[bytes, ...], rows: np.ndarray) -> StoreResult:
        done: list[bytes] = []
        for key, row in zip(keys, rows.tolist()):
            with self._known_lock:
                held = bool(self._known.get(key))
                if key in self._own:
                    self._own.move_to_end(key)
            if held or len(key) > MAX_KEY_BYTES:
                self.stats.skipped += not held
                if held:
                    done.append(key)
                continue
            if not self._make_room(set(done)):
                self.stats.skipped += 1
                continue
            name = chunk_file(key, self.writer)
            self._seq += 1
            tmp = self.folder / f".tmp.{self.writer}.{self._seq}"
            blob = encode_chunk(key, self.memory[row * self.row_bytes:(row + 1) * self.row_bytes], self.writer,
                                self.digest, time.time_ns())
            try:
                fd, _ = file_trust.open_file(tmp, os.O_WRONLY, create=True)
                try:
                    if os.write(fd, blob) != len(blob):
                        raise OSError(0, "short write")
                    if self.config.durability is Durability.FDATASYNC:
                        os.fdatasync(fd)
                        self.stats.syncs += 1
                finally:
                    os.close(fd)
                os.rename(tmp, self.folder / name)
            except OSError as e:
                try:
                    tmp.unlink()
                except OSError:
                    pass
                self.stats.failed_jobs += 1
                return StoreResult(job_id, STORE, False, keys, tuple(done), error=StoreError(f"{tmp}: {e}"))
            with self._known_lock:
                self._known.setdefault(key, set()).add(name)
                self._own[key] = name
            self._estimate += self.file_bytes
            done.append(key)
            self.stats.chunks_stored += 1
            self.stats.bytes_stored += self.row_bytes
        if done and self.config.durability is Durability.FDATASYNC:
            dfd = os.open(self.folder, os.O_RDONLY | os.O_DIRECTORY)
            try:
                os.fsync(dfd)  # the renames are durable before the job is reported done
            finally:
                os.close(dfd)
        self.stats.stores += 1
        return StoreResult(job_id, STORE, True, keys, tuple(done), len(done) * self.row_bytes)

    def _make_room(self, keep: set[bytes]) -> bool:
        """Evict this writer's least recently used files (not those of ``keep``: the job's own) until one more fits
        the capacity; False if it cannot."""
        while self._estimate + self.file_bytes > self.config.capacity_bytes:
            if self._reapable:  # dead writers' files first, oldest first
                self._unlink_quiet(self._reapable.pop(0), evict=True)
                continue
            with self._known_lock:
                key = next((k for k in self._own if k not in keep), None)
                if key is None:
                    return False
                name = self._own.pop(key)
                names = self._known.get(key, set())
                names.discard(name)
                if not names:
                    self._known.pop(key, None)
            self._remove(name)
        return True

    def _remove(self, name: str) -> None:
        try:
            os.unlink(self.folder / name)
            self._estimate -= self.file_bytes
            self.stats.evictions += 1
        except FileNotFoundError:
            pass

    def _load(self, job_id: int, keys: tuple[bytes, ...], rows: np.ndarray) -> StoreResult:
        done: list[bytes] = []
        last = ""
        for key, row in zip(keys, rows.tolist()):
            with self._known_lock:
                names = sorted(self._known.get(key, ()), key=lambda n: n.split(".")[1] != self.writer)
            data = None
            for name in names:
                before = _file_id(self.folder / name)
                data, why = read_chunk(self.folder / name, key, self.row_bytes, self.digest)
                if data is not None:
                    break
                last = f"{name}: {why}"
                self.stats.integrity_misses += 1
                with self._known_lock:  # gone or refused: a miss from now on
                    self._known.get(key, set()).discard(name)
                    if before is not None and before == _file_id(self.folder / name):  # the very file read
                        self._refused[name] = before  # not offered again by a scan until it changes
                        _log.warning("kvxfer shared store %s: %s refused (%s): a miss, recomputed; the file is left "
                                     "in place (it may be another engine's) and not read again until it changes",
                                     self.folder, name, why)
            if data is None:
                continue
            self.memory[row * self.row_bytes:(row + 1) * self.row_bytes] = np.frombuffer(data, np.uint8)
            done.append(key)
        self.stats.loads += 1
        self.stats.chunks_loaded += len(done)
        self.stats.bytes_loaded += len(done) * self.row_bytes
        ok = len(done) == len(keys)
        self.stats.failed_jobs += not ok
        err = None if ok else StoreError(f"{len(keys) - len(done)} of {len(keys)} keys not loaded (last: {last or 'not stored'})")
        return StoreResult(job_id, LOAD, ok, keys, tuple(done), len(done) * self.row_bytes, error=err)

    def _dead(self, writer: str, leases: dict[str, float], now: float) -> bool:
        """Whether ``writer`` is proven dead: its lease is older than ``dead_after_s`` (or gone), or it names a
        pid on this host that no longer exists."""
        if writer == self.writer:
            return False
        seen = leases.get(writer)
        if seen is None or now - seen > self.dead_after_s:
            return True
        host, pid = writer.rsplit("-", 2)[0], writer.rsplit("-", 2)[1]
        if host == self.writer.rsplit("-", 2)[0] and pid.isdigit():
            try:
                os.kill(int(pid), 0)
            except ProcessLookupError:
                return True
            except OSError:
                return False
        return False

    def _scan(self) -> None:
        """Refresh the lease, list the folder (keys, bytes), reap dead writers' temporaries, and evict down to
        the capacity: own files first, then files of dead writers, oldest first."""
        now = time.time()
        try:
            os.utime(self._lease)
        except FileNotFoundError:  # taken for dead and reaped (a stall longer than dead_after_s): alive again
            self._lease.write_text(json.dumps({"host": socket.gethostname(), "pid": os.getpid()}))
        leases: dict[str, float] = {}
        for entry in os.scandir(self.folder / "writers"):
            if entry.name.endswith(".lease"):
                try:
                    leases[entry.name[:-6]] = entry.stat(follow_symlinks=False).st_mtime
                except OSError:
                    pass
        known: dict[bytes, set[str]] = {}
        refused: dict[str, tuple[int, ...]] = {}
        dead_files: list[tuple[float, str]] = []
        total = 0
        for entry in os.scandir(self.folder):
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if entry.name.startswith(".tmp."):
                w = entry.name.split(".")[2] if entry.name.count(".") >= 3 else ""
                if w and self._dead(w, leases, now):
                    self._unlink_quiet(entry.name)
                else:
                    total += st.st_size
                continue
            parsed = _parse(entry.name)
            if parsed is None or file_trust.untrusted(st) is not None:
                continue  # not a chunk, or a file that is not this user's: never read, never counted
            key, w = parsed
            if self._refused.get(entry.name) == _stat_id(st):
                refused[entry.name] = _stat_id(st)  # the file a load refused, unchanged: counted, not offered
            else:
                known.setdefault(key, set()).add(entry.name)
            total += st.st_size
            if w != self.writer and self._dead(w, leases, now):
                dead_files.append((st.st_mtime, entry.name))
        holders = {w for names in known.values() for w in (n.split(".")[1] for n in names)}
        for w in leases:  # a dead writer with no chunk left: its lease goes too
            if w not in holders and w != self.writer and now - leases[w] > self.dead_after_s:
                self._unlink_quiet(f"writers/{w}.lease")
        with self._known_lock:
            for key, name in self._own.items():  # written since the listing began: still known (unless refused)
                if name not in refused:
                    known.setdefault(key, set()).add(name)
            self._known = known
            self._refused = refused  # files gone or changed are forgotten
        self._estimate = total
        dead_files.sort()
        self._reapable = [name for _, name in dead_files]
        while self._estimate > self.config.capacity_bytes and self._reapable:
            self._unlink_quiet(self._reapable.pop(0), evict=True)
        while self._estimate > self.config.capacity_bytes and self._own:
            with self._known_lock:
                key, name = self._own.popitem(last=False)
                self._known.get(key, set()).discard(name)
            self._remove(name)
        self._last_scan = time.monotonic()

    def _unlink_quiet(self, name: str, evict: bool = False) -> None:
        try:
            size = os.lstat(self.folder / name).st_size
            os.unlink(self.folder / name)
        except OSError:
            return
        self._estimate -= size
        if evict:
            self.stats.evictions += 1
            key = _parse(name)
            if key is not None:
                with self._known_lock:
                    self._known.get(key[0], set()).discard(name)
