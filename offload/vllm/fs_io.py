"""The host-staged POSIX path of kvxfer's file worker for vLLM 0.34 (``fs_worker``), without vLLM.

One file per offload key, at the path vLLM's ``FileMapper`` names (vLLM's fs tiers look a key up by that file's
existence). Each file is a 64-byte integrity record followed by the payload: magic and format, a digest of the
store's identity (``offload.files.chunk_store.namespace``: what the bytes mean), a digest of the key, the payload
length and its CRC-32. A store gathers the job's device ranges into a staging buffer (ops adjacent in device
memory and in the file merged into one copy: ``merge_ops``), writes record and payload with one ``pwrite`` to a
private temporary file beside the target, ``fdatasync``s it, renames it over the target and syncs the directory:
the target is absent or whole, never torn, and a store is reported done only once durable. A load opens the file
without following links, refuses a foreign one (``executors.file_trust.untrusted``), reads it with one ``pread``
and checks the record; a file that is missing, torn (short), stale (another key's), foreign (another identity or
format, or not kvxfer's) or changed (CRC) raises ``ChunkMiss`` before one byte reaches device memory; a good
one is scattered with merged copies.

``device_ptr`` values are addresses the host can read and write (vLLM's CPU build, or host memory in tests):
this path stages on the host and does not copy from GPU memory. On GPUs the intended path is NIXL's GDS backend
(``fs_worker``): not available on this machine.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import file_trust

from ..checksums import crc32  # ISA-L where installed, else zlib: the same values
from ..files.chunk_store import namespace

__all__ = ["HEADER_BYTES", "ChunkMiss", "FileFormat", "file_ranges", "merge_ops"]

HEADER_BYTES = 64
_MAGIC = b"KVXFS\x00\x00\x01"
_HEAD = struct.Struct("<8s16s16sQI12x")  # magic, identity digest, key digest, payload bytes, CRC-32; padded to 64


class ChunkMiss(RuntimeError):
    """A file that must not be loaded: missing, torn, stale, foreign or changed (``reason`` says which)."""

    def __init__(self, path: str, reason: str, detail: str = ""):
        self.path, self.reason = path, reason
        super().__init__(f"{path}: {reason}{': ' + detail if detail else ''}; a miss, no bytes loaded")


def merge_ops(device_ptrs: np.ndarray, sizes: np.ndarray, file_offsets: np.ndarray) -> np.ndarray:
    """Ops (device address, bytes, file offset) as merged ranges, rows of (device, file offset, bytes): ops that
    follow each other in the file and in device memory become one. Sorted by file offset; vectorized."""
    d, n, f = (np.asarray(a, dtype=np.int64) for a in (device_ptrs, sizes, file_offsets))
    if len(f) == 0:
        return np.zeros((0, 3), np.int64)
    order = np.argsort(f, kind="stable")
    d, n, f = d[order], n[order], f[order]
    starts = np.ones(len(f), bool)
    starts[1:] = (f[1:] != f[:-1] + n[:-1]) | (d[1:] != d[:-1] + n[:-1])
    idx = np.flatnonzero(starts)
    ends = np.append(idx[1:], len(f)) - 1
    return np.stack([d[idx], f[idx], f[ends] + n[ends] - f[idx]], axis=1)


class FileFormat:
    """The record of one store's files: ``identity`` (what the bytes mean: model, dtype, layout, the FileMapper's
    fields...) digested once. ``store`` and ``load`` run one file each (called on I/O threads)."""

    def __init__(self, identity: Mapping[str, Any]):
        self.identity = hashlib.blake2b(namespace(identity).encode(), digest_size=16).digest()

    @staticmethod
    def _key(key: bytes) -> bytes:
        return hashlib.blake2b(bytes(key), digest_size=16).digest()

    def store(self, path: str, key: bytes, ranges: np.ndarray) -> int:
        """Gather ``ranges`` (``merge_ops`` rows) into one durable file at ``path``; returns the payload bytes."""
        size = int((ranges[:, 1] + ranges[:, 2]).max()) if len(ranges) else 0
        buf = np.zeros(HEADER_BYTES + size, np.uint8)
        base = buf.ctypes.data + HEADER_BYTES
        for dev, off, n in ranges.tolist():  # one copy per merged range
            ctypes.memmove(base + off, dev, n)
        payload = buf[HEADER_BYTES:]
        buf[:HEADER_BYTES] = np.frombuffer(_HEAD.pack(_MAGIC, self.identity, self._key(key), size,
                                                      crc32(payload.data)), np.uint8)
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.{id(buf):x}.tmp")
        fd, _ = file_trust.open_file(tmp, os.O_WRONLY | os.O_TRUNC, create=True)
        try:
            view = buf.data
            done = 0
            while done < len(buf):
                done += os.pwrite(fd, view[done:], done)
            os.fdatasync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, target)  # whole or absent at the target
        dfd = os.open(target.parent, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)  # the rename is durable before the store is reported done
        finally:
            os.close(dfd)
        return size

    def load(self, path: str, key: bytes, ranges: np.ndarray) -> int:
        """Check the file at ``path`` and scatter ``ranges`` from it; ChunkMiss (nothing copied) when it fails."""
        need = int((ranges[:, 1] + ranges[:, 2]).max()) if len(ranges) else 0
        try:
            fd, _ = file_trust.open_file(path, os.O_RDONLY, create=False)
        except FileNotFoundError:
            raise ChunkMiss(path, "missing") from None
        except OSError as e:
            raise ChunkMiss(path, "foreign", f"not opened without following links ({e.strerror})") from None
        try:
            st = os.fstat(fd)
            why = file_trust.untrusted(st)
            if why:
                raise ChunkMiss(path, "foreign", why)
            size = st.st_size
            buf = np.zeros(max(size, HEADER_BYTES), np.uint8)
            view, done = buf.data, 0
            while done < size:
                got = os.preadv(fd, [view[done:size]], done)
                if got <= 0:
                    break
                done += got
        finally:
            os.close(fd)
        if done < HEADER_BYTES:
            raise ChunkMiss(path, "torn", f"{done} bytes, shorter than its record")
        magic, ident, kd, n, crc = _HEAD.unpack(buf[:HEADER_BYTES].tobytes())
        if magic != _MAGIC or ident != self.identity:
            raise ChunkMiss(path, "foreign", "another format or identity")
        if kd != self._key(key):
            raise ChunkMiss(path, "stale", "the record names another key")
        if done != HEADER_BYTES + n:
            raise ChunkMiss(path, "torn", f"{done - HEADER_BYTES} of {n} payload bytes")
        payload = buf[HEADER_BYTES:HEADER_BYTES + n]
        if crc32(payload.data) != crc:
            raise ChunkMiss(path, "changed", "its CRC-32 does not match")
        if need > n:
            raise ChunkMiss(path, "torn", f"{n} payload bytes, the load reads up to {need}")
        base = payload.ctypes.data
        for dev, off, m in ranges.tolist():
            ctypes.memmove(dev, base + off, m)
        return int(ranges[:, 2].sum()) if len(ranges) else 0


def file_ranges(ops: Sequence[Any]) -> np.ndarray:
    """vLLM's FileOps (``device_ptr``, ``size_bytes``, ``file_offset``) of one file as merged ranges."""
    a = np.array([(o.device_ptr, o.size_bytes, o.file_offset) for o in ops], dtype=np.int64).reshape(-1, 3)
    return merge_ops(a[:, 0], a[:, 1], a[:, 2])
