"""Looking inside a ChunkStore's files and maintaining them: ``describe`` (read-only, safe beside a running
engine), ``verify`` (every chunk read back and checked, nothing written), ``purge`` and ``resize``.

``describe`` reads the identity, the index and the integrity records without a lock and counts an entry the way
``ChunkStore`` does when it opens (entry CRC intact, epoch equal to the slot's intact record): a snapshot that a
running engine may change the next moment. ``verify``, ``purge`` and ``resize`` need the store to themselves:
they take its lock without waiting and raise ``StoreBusyError`` (saying so) when an engine holds it.

``verify`` opens the store with ``ChunkStore`` itself and loads every chunk its index holds into scratch memory,
in batches: the same record, epoch and CRC checks an engine's load makes; a chunk that fails is counted (and left
on disk: verification writes nothing). ``resize`` opens the store, moves its folder aside, opens a store of the
new capacity in its place and copies the most recently used chunks that fit (least recently used first, so their
order survives), then removes the old folder. ``purge`` removes the store's files and its folder.
"""
from __future__ import annotations

import json
import os
import shutil
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import file_trust

from .chunk_store import (
    ENTRY,
    INDEX_HEADER,
    INDEX_HEADER_BYTES,
    INDEX_MAGIC,
    MAX_KEY_BYTES,
    ChunkStore,
    StoreConfigError,
    StoreError,
    entry_check,
)
from .file_tier import EPOCH_LIMIT, HEADER, HEADER_BYTES, RECORD, record_check

__all__ = ["STORE_FILES", "StoreBusyError", "StoreReport", "VerifyReport", "describe", "find_stores", "purge", "resize",
           "verify"]

DATA = "chunks.kvx"
STORE_FILES = ("identity.json", "model.json", DATA, f"{DATA}.kvxsum", f"{DATA}.index")
BATCH_BYTES = 64 << 20  # scratch memory of verify and resize


class StoreBusyError(StoreError):
    """The store's files are held by a running store (an engine): the command needs them to itself."""


@dataclass
class StoreReport:
    """What a store holds (``describe``): ``slots`` of ``row_bytes``; ``chunks`` entries that count, ``discarded``
    entries that do not (a store interrupted, a slot reused); epochs in microseconds since 1970 (0: none)."""

    folder: Path
    identity: dict[str, Any]
    slots: int
    row_bytes: int
    chunks: int
    discarded: int
    oldest_us: int
    newest_us: int
    in_use: bool

    @property
    def capacity_bytes(self) -> int:
        """Bytes of slots: ``slots`` x ``row_bytes``."""
        return self.slots * self.row_bytes

    @property
    def nbytes(self) -> int:
        """Bytes of the chunks that count: ``chunks`` x ``row_bytes``."""
        return self.chunks * self.row_bytes


@dataclass
class VerifyReport:
    """``verify``'s count: ``checked`` chunks read back, ``failed`` refused (first few reasons in ``errors``),
    ``discarded`` index entries not counted when the store opened."""

    folder: Path
    checked: int = 0
    failed: int = 0
    discarded: int = 0
    errors: list[str] = field(default_factory=list)


def find_stores(path: str | os.PathLike[str]) -> list[Path]:
    """The store folders at ``path``: itself when it is one (it holds ``identity.json`` and an index), else the
    ones directly inside it (a tier's ``root_dir``), sorted. StoreConfigError (a ValueError) when there is none."""
    p = Path(path)
    if not p.is_dir():
        raise StoreConfigError("PATH", str(p), "no such directory")
    if (p / "identity.json").is_file():
        return [p]
    found = sorted(d for d in p.iterdir() if d.name.startswith("kvxfer-") and (d / "identity.json").is_file()
                   and not d.is_symlink())
    if not found:
        raise StoreConfigError("PATH", str(p), "neither a kvxfer store nor a folder holding one (no kvxfer-*/identity.json)")
    return found


def _read(path: Path) -> bytes:
    fd, _ = file_trust.open_file(path, os.O_RDONLY, create=False)
    try:
        why = file_trust.untrusted(os.fstat(fd))
        if why is not None:
            raise StoreError(f"{path}: {why}; refused")
        return os.pread(fd, os.fstat(fd).st_size, 0)
    finally:
        os.close(fd)


def _identity(folder: Path) -> dict[str, Any]:
    try:
        out = json.loads(_read(folder / "identity.json"))
    except (OSError, ValueError) as e:
        raise StoreError(f"{folder / 'identity.json'}: unreadable ({e})") from None
    if not isinstance(out, dict):
        raise StoreError(f"{folder / 'identity.json'}: not an identity (a JSON object)")
    return out


def _held(folder: Path) -> bool:
    """Whether a store holds the index's lock now (probed with a shared lock, released at once)."""
    import fcntl

    try:
        fd, _ = file_trust.open_file(folder / f"{DATA}.index", os.O_RDONLY, create=False)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)


def describe(folder: str | os.PathLike[str]) -> StoreReport:
    """What the store in ``folder`` holds, read without a lock and without writing (see the module docstring).
    StoreError when its files are not a store's."""
    folder = Path(folder)
    identity = _identity(folder)
    try:
        index = _read(folder / f"{DATA}.index")
    except FileNotFoundError:
        index = b""
    if len(index) < INDEX_HEADER.size:
        return StoreReport(folder, identity, 0, 0, 0, 0, 0, 0, _held(folder))
    magic, slots, row_bytes = INDEX_HEADER.unpack_from(index)
    if magic != INDEX_MAGIC:
        raise StoreError(f"{folder}/{DATA}.index: not a kvxfer store index (magic {magic!r})")
    entries = np.zeros(slots, ENTRY)
    body = np.frombuffer(index, np.uint8)[INDEX_HEADER_BYTES:INDEX_HEADER_BYTES + slots * ENTRY.itemsize]
    entries.view(np.uint8)[:len(body)] = body
    used = entries["epoch"] != 0
    trusted = _trusted_epochs(folder, slots)
    ok = used & (entries["epoch"] == trusted) & (entries["key_len"] <= MAX_KEY_BYTES)
    ids = np.arange(slots, dtype=np.uint64)
    ok[ok] = entries["check"][ok] == entry_check(ids[ok], entries[ok])
    epochs = entries["epoch"][ok]
    return StoreReport(folder, identity, int(slots), int(row_bytes), int(ok.sum()), int(used.sum() - ok.sum()),
                       int(epochs.min()) if epochs.size else 0, int(epochs.max()) if epochs.size else 0, _held(folder))


def _trusted_epochs(folder: Path, slots: int) -> np.ndarray:
    """The epoch each slot's intact integrity record holds (0 where none is intact), read as FileTier reads it."""
    out = np.zeros(slots, np.uint64)
    try:
        raw = _read(folder / f"{DATA}.kvxsum")
    except FileNotFoundError:
        return out
    if len(raw) < HEADER.size:
        return out
    identity = HEADER.unpack_from(raw)[4]
    key = np.frombuffer(identity[:8], "<u8")[0] ^ np.frombuffer(identity[8:], "<u8")[0]
    rec = np.zeros(slots, RECORD)
    body = np.frombuffer(raw, np.uint8)[HEADER_BYTES:HEADER_BYTES + slots * RECORD.itemsize]
    rec.view(np.uint8)[:len(body)] = body
    ids = np.arange(slots, dtype=np.uint64)
    intact = (rec["check"] == record_check(ids, rec["epoch"], rec["crc"], key)) & (rec["epoch"] < EPOCH_LIMIT)
    out[intact] = rec["epoch"][intact]
    return out


def _open(folder: Path, root: Path | None = None, capacity_bytes: int | None = None,
          rows: np.ndarray | None = None) -> tuple[ChunkStore, np.ndarray]:
    """``ChunkStore`` over the store in ``folder`` (its own identity and row size), with scratch rows; it takes the
    lock without waiting: StoreBusyError when a running store holds it."""
    report = describe(folder)
    if report.slots == 0:
        raise StoreError(f"{folder}: the store has no index yet (never opened by an engine)")
    if report.in_use:
        raise StoreBusyError(f"{folder}: in use by a running store (an engine on this directory): stop it first, or "
                             "use `kvxfer store show`, which reads without the lock")
    if rows is None:
        n = max(1, min(report.slots, BATCH_BYTES // report.row_bytes))
        rows = np.zeros((n, report.row_bytes), np.uint8)
    config = {"root_dir": str(root if root is not None else folder.parent),
              "capacity_bytes": capacity_bytes or report.capacity_bytes, "lock_timeout_s": 0.0}
    try:
        store = ChunkStore(config, rows, report.row_bytes, report.identity)
    except StoreError as e:
        if "held by another store" in str(e):
            raise StoreBusyError(f"{folder}: in use by a running store (an engine): stop it first") from None
        raise
    return store, rows


def _copy_out(store: ChunkStore, keys: list[bytes], job_id: int) -> tuple[list[bytes], list[str]]:
    """Load ``keys[i]`` into row i of the store's memory: the keys loaded (in the order of ``keys``) and the
    reason of a refusal."""
    store.submit_load(job_id, keys, np.arange(len(keys)))
    store.drain()
    (r,) = store.poll()
    done = set(r.done_keys)
    return [k for k in keys if k in done], [] if r.success else [str(r.error)]


def verify(folder: str | os.PathLike[str]) -> VerifyReport:
    """Read every chunk of the store in ``folder`` back and check it (records, epochs, CRCs); writes nothing.
    StoreBusyError when an engine holds the store."""
    folder = Path(folder)
    store, rows = _open(folder)
    out = VerifyReport(folder, discarded=store.stats.discarded)
    try:
        keys = list(store.index)
        for job, lo in enumerate(range(0, len(keys), len(rows))):
            batch = keys[lo:lo + len(rows)]
            done, errors = _copy_out(store, batch, job)
            out.checked += len(batch)
            out.failed += len(batch) - len(done)
            out.errors += errors[:max(0, 5 - len(out.errors))]
    finally:
        store.close()
    return out


def purge(folder: str | os.PathLike[str]) -> int:
    """Remove the store in ``folder`` (its files, then the folder); returns the bytes of the files removed.
    StoreBusyError when an engine holds it; files not a store's stay (and so does the folder then)."""
    import fcntl

    folder = Path(folder)
    _identity(folder)  # a store's folder, not any folder
    st = os.lstat(folder)
    if not stat.S_ISDIR(st.st_mode):
        raise StoreError(f"{folder}: not a directory")
    index = folder / f"{DATA}.index"
    fd = None
    if index.exists():
        fd, _ = file_trust.open_file(index, os.O_RDONLY, create=False)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreBusyError(f"{folder}: in use by a running store (an engine): stop it first") from None
    removed = 0
    try:
        for name in STORE_FILES:
            p = folder / name
            if p.is_file() and not p.is_symlink():
                removed += p.stat().st_blocks * 512
                p.unlink()
    finally:
        if fd is not None:
            os.close(fd)
    folder.rmdir()  # OSError (not empty) when files other than the store's are there: they are left alone
    return removed


def resize(folder: str | os.PathLike[str], capacity_bytes: int) -> tuple[int, int]:
    """Give the store in ``folder`` ``capacity_bytes`` of slots, keeping the most recently used chunks that fit;
    returns (chunks kept, chunks dropped). StoreBusyError when an engine holds it; StoreConfigError for a
    capacity below one chunk."""
    folder = Path(folder)
    old, rows = _open(folder)
    aside = folder.with_name(f".{folder.name}.resizing-{os.getpid()}")
    try:
        keys = list(old.index)  # least recently used first
        new_slots = capacity_bytes // old.row_bytes
        keep = keys[max(len(keys) - new_slots, 0):] if new_slots > 0 else []
        folder.rename(aside)  # the old store keeps its descriptors; the namespace is free for the new one
        try:
            new, _ = _open_new(folder, old, capacity_bytes, rows)
        except BaseException:
            aside.rename(folder)
            raise
        kept = 0
        try:
            for job, lo in enumerate(range(0, len(keep), len(rows))):
                batch = keep[lo:lo + len(rows)]
                done, _ = _copy_out(old, batch, 2 * job)
                if not done:
                    continue
                row_of = {k: i for i, k in enumerate(batch)}
                new.submit_store(2 * job + 1, done, np.array([row_of[k] for k in done], np.int64))
                new.drain()
                (r,) = new.poll()
                if not r.success:
                    raise StoreError(f"{folder}: writing the resized store failed: {r.error}")
                kept += len(done)
        finally:
            new.close()
    finally:
        old.close()
    shutil.rmtree(aside)
    return kept, len(keys) - kept


def _open_new(folder: Path, old: ChunkStore, capacity_bytes: int, rows: np.ndarray) -> tuple[ChunkStore, np.ndarray]:
    config = {"root_dir": str(folder.parent), "capacity_bytes": capacity_bytes, "lock_timeout_s": 0.0}
    text = _read(folder.with_name(f".{folder.name}.resizing-{os.getpid()}") / "identity.json")
    store = ChunkStore(config, rows, old.row_bytes, json.loads(text))
    if store.folder != folder:
        store.close()
        raise StoreError(f"{folder}: the identity names another folder ({store.folder.name}): refused")
    return store, rows
