"""Checksums of host chunks: a CRC-32 per chunk over the bytes this rank keeps in it, recorded once a store into
the chunk has finished and compared before a load reads it, so host bytes changed at rest (a flipped bit, a stray
write) are noticed instead of copied to the device.

Which bytes: for every region of the layout (aliased regions once), chunk c's cells on this rank: its k pages at
``host.byte_offset + c * host.stride_bytes``, or for a head-sharded region (fragments) this rank's pieces of each
canonical page. A region whose stores rotate writers over the ranks is refused: a rank would load pages another
rank wrote, whose checksum it never computed. Cost: one CRC pass over the chunk's bytes per store and per load
(``crc32``; benchmarks/NOTES.md, "kvxfer_verify").

``crc32`` is the one CRC-32 every integrity check of kvxfer computes (host chunks here, the file tier's chunks and
records): ISA-L's (``isal.isal_zlib.crc32``, the ``fast`` extra) where it is installed, several times faster, else
``zlib.crc32``. Both compute the same function (zlib's CRC-32: same values, same running start value), so what
one wrote the other checks; the choice is made once per process (``crc32_impl``).
"""
from __future__ import annotations

import functools
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from kvxfer.planner import Layout, MissingDependencyError, import_optional

__all__ = ["ChecksumError", "HostChecksums", "crc32", "crc32_impl"]


@functools.cache
def crc32_impl() -> tuple[str, Callable[..., int]]:
    """(its name, the CRC-32 function) chosen once: ISA-L's where ``isal`` is installed, else zlib's."""
    try:
        return "isal", import_optional("isal.isal_zlib", "fast checksums").crc32
    except MissingDependencyError:
        return "zlib", zlib.crc32


def crc32(data: Any, value: int = 0) -> int:
    """zlib's CRC-32 of ``data`` (any contiguous buffer) continued from ``value``, by ``crc32_impl``'s function."""
    return crc32_impl()[1](data, value)

Extent = tuple[int, int, tuple[int, ...], tuple[int, ...]]  # (chunk 0's offset, chunk stride, shape, byte strides)


class ChecksumError(RuntimeError):
    """Host chunks whose bytes no longer match the checksum recorded when they were stored (or that were never
    stored by this worker); ``chunks`` lists them."""

    def __init__(self, chunks: Sequence[int]):
        self.chunks = list(chunks)
        super().__init__(f"host chunk(s) {self.chunks[:8]}{' ...' if len(self.chunks) > 8 else ''} do not match the "
                         "checksum recorded when they were stored (changed since, or never stored by this worker)")


def _extents(layout: Layout) -> list[Extent]:
    """Per region of ``layout``, the byte views of its chunk 0 on the host side (its ``host`` placement, in the one
    host buffer), adjacent whole-page cells merged."""
    out: set[Extent] = set()
    for r in layout.regions:
        if r.num_writers not in (None, 1):
            raise ValueError(f"region {r.name!r} rotates {r.num_writers} writers over the ranks: a rank loads pages "
                             "another rank wrote, so its checksums cannot be checked here")
        k, page = r.host.blocks_per_chunk, r.host_page_bytes or r.page_bytes
        stride = r.host.stride_bytes or k * page
        if not r.fragments:
            out.add((r.host.byte_offset, stride, (k * page,), (1,)))
        for f in r.fragments:
            out.add((r.host.byte_offset + f.canonical_offset, stride, (k, f.count, f.fragment_bytes),
                     (page, f.canonical_stride, 1)))
    merged: list[Extent] = []
    for e in sorted(out):
        last = merged[-1] if merged else None
        if last and len(e[2]) == len(last[2]) == 1 and e[1] == last[1] and last[0] + last[2][0] == e[0]:
            merged[-1] = (last[0], last[1], (last[2][0] + e[2][0],), (1,))
        else:
            merged.append(e)
    return merged


class HostChecksums:
    """Checksums of the host chunks of ``layout`` in ``memory`` (the host buffer's bytes), ``num_chunks`` of them.

    ``record(chunks)`` after a store into them finished; ``forget(chunks)`` when a store into them is submitted;
    ``check(chunks)`` before a load: the chunks whose bytes differ or that hold no recorded checksum. Raises
    ValueError for a layout with rotating writers. Called from one thread (the engine's worker thread); the bytes
    of a chunk being checked or recorded must not be written meanwhile (the engine loads only chunks whose store
    has finished, and stores only into chunks no load reads).
    """

    def __init__(self, layout: Layout, memory: np.ndarray, num_chunks: int):
        self._extents = _extents(layout)
        self._memory = memory.reshape(-1).view(np.uint8)
        self._crc = np.full(num_chunks, -1, dtype=np.int64)  # -1: none recorded

    def _crc_of(self, chunk: int) -> int:
        crc = 0
        for offset, stride, shape, strides in self._extents:
            start = offset + chunk * stride
            if len(shape) == 1:
                crc = crc32(self._memory[start:start + shape[0]].data, crc)
            else:
                view = as_strided(self._memory[start:], shape=shape, strides=strides, writeable=False)
                crc = crc32(np.ascontiguousarray(view).data, crc)
        return crc

    def _valid(self, chunks: Sequence[int] | np.ndarray) -> np.ndarray:
        # ids past the tier are left to the worker, which refuses them naming the job and the field
        ids = np.unique(np.asarray(chunks, dtype=np.int64))
        return ids[(ids >= 0) & (ids < len(self._crc))]

    def record(self, chunks: Sequence[int] | np.ndarray) -> None:
        """Record the checksum of each chunk in ``chunks`` as its bytes are now."""
        for c in self._valid(chunks):
            self._crc[c] = self._crc_of(int(c))

    def forget(self, chunks: Sequence[int] | np.ndarray) -> None:
        """Drop the checksums of ``chunks`` (a store is about to rewrite them)."""
        self._crc[self._valid(chunks)] = -1

    def check(self, chunks: Sequence[int] | np.ndarray) -> list[int]:
        """The chunks of ``chunks`` whose bytes do not match their recorded checksum, or that have none (ids outside
        the tier are not checked here)."""
        return [int(c) for c in self._valid(chunks) if self._crc[c] < 0 or self._crc_of(int(c)) != self._crc[c]]
