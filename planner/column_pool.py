"""ColumnPool: reusable memory for the large offset columns that plans of one layout are built into.

Why: a serving loop plans the same layout every step, and a fragmented job's offset columns are megabytes.
Fresh arrays of that size come from the C allocator's mmap or trimmed heap top, so every plan pays a page
fault per 4 KiB it writes (on the dev machine, 4-5 ms for the two 1.9 MB columns of a 241,664-range plan,
against under 1 ms to compute them). The pool keeps a few such arrays per layout and hands one out again
once nothing refers to it any more.

Safety: a pooled array is reused only when its reference count says that no array views it (every numpy
view, and every view of a view, holds a reference to the array that owns the memory; so does anything that
exported its buffer). A plan still alive, or a column slice kept from it, keeps the memory out of the pool,
and the next plan gets fresh memory instead. Where reference counts cannot be read that way (not CPython),
and in free-threaded CPython, every call returns fresh memory; elsewhere the count of an unreferenced
pooled array is measured once at import, through the same expression the checks use.
"""
from __future__ import annotations

import sys
import sysconfig
import threading

import numpy as np

from .frozen import freeze

POOL_MIN = 1 << 13  # elements (64 KiB of int64): smaller columns are copied when frozen, not pooled
POOL_SLOTS = 8  # arrays kept per layout (two per plan: source and destination offsets)
POOL_BYTES = 128 << 20  # at most this much memory kept per layout (four C32-sized plans)


def _count(owners: list[np.ndarray], i: int) -> int:
    """The reference count of ``owners[i]``: every check goes through this one expression."""
    return sys.getrefcount(owners[i])


def _unreferenced_count() -> int:
    """What ``_count`` reads for an array that only the pool's list holds, measured on this interpreter (0:
    reference counts cannot be trusted here, so nothing is pooled)."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return 0  # other interpreters, and free-threaded CPython builds (deferred and split counts): no pooling
    owners = [np.empty(1, dtype=np.int64)]
    alone = _count(owners, 0)
    view = owners[0][:1]  # one view must count as one more reference, or the counts are not what we rely on
    ok = _count(owners, 0) == alone + 1
    del view
    return alone if ok and _count(owners, 0) == alone else 0


FREE = _unreferenced_count()  # the count of a pooled array nothing else refers to


class ColumnPool:
    """Int64 arrays for plan columns, reused once no view of them is alive. Thread-safe: ``take`` may be called
    from any thread; one lock guards the slot lists (finding, claiming and evicting an array).

    Each pooled array has a frozen twin over the same memory (``kvxfer.planner.frozen``), made once: the
    planner writes through the array ``take`` hands out, and a plan keeps the view of the twin handed out with
    it, which no holder can make writeable again. An array is free when nothing outside the pool refers to it,
    to its twin, or to the object the twin is made over (the twin's base, through which ``np.asarray`` makes
    new views that refer to that object alone): the object holds the array (one reference more), the twin
    holds the object (one more)."""

    def __init__(self, slots: int = POOL_SLOTS, max_bytes: int = POOL_BYTES):
        self.slots, self.max_bytes = slots, max_bytes
        self._owners: list[np.ndarray] = []
        self._twins: list[np.ndarray] = []  # the frozen twin of each owner, same index
        self._bases: list[object] = []  # the object each twin views (its base), same index
        self._lock = threading.Lock()

    def _free(self, i: int) -> bool:
        return (_count(self._owners, i) == FREE + 1 and _count(self._twins, i) == FREE
                and _count(self._bases, i) == FREE + 1)

    def empty(self, n: int) -> np.ndarray:
        """An uninitialised int64 array of ``n`` elements, from the pool when it is large enough to pool."""
        return self.take(n)[0]

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray | None]:
        """An uninitialised int64 array of ``n`` elements to write, and, when it comes from the pool, the frozen
        view of the same memory to hand over once it is written (None: freeze the array itself). The array is
        reused only once nothing made from it is referenced."""
        if n < POOL_MIN or not FREE:
            return np.empty(n, dtype=np.int64), None
        with self._lock:  # find and claim (take a view) under one lock: two threads never share an array
            owners = self._owners
            best = -1
            for i in range(len(owners)):
                size = len(owners[i])
                if size >= n and self._free(i) and (best < 0 or size < len(owners[best])):
                    best = i
            if best >= 0:
                return owners[best][:n], self._twins[best][:n]
            size = 1 << (n - 1).bit_length()  # next power of two: jobs of varying size reuse one array
            size = size - (size >> 2) if n <= size - (size >> 2) else size  # or 3/4 of it: at most 33% spare
            fresh = np.empty(size, dtype=np.int64)
            if len(owners) >= self.slots or self.nbytes + fresh.nbytes > self.max_bytes:
                free = [i for i in range(len(owners)) if self._free(i)]
                if not free:
                    return fresh[:n], None  # every slot is in use: not pooled
                gone = min(free, key=lambda i: len(owners[i]))
                owners.pop(gone)
                self._twins.pop(gone)
                self._bases.pop(gone)
                if self.nbytes + fresh.nbytes > self.max_bytes:
                    return fresh[:n], None
            twin = freeze(fresh)
            owners.append(fresh)
            self._twins.append(twin)
            self._bases.append(twin.base)
            return fresh[:n], twin[:n]

    @property
    def nbytes(self) -> int:
        """Bytes held by the pool (in use or free)."""
        return sum(a.nbytes for a in self._owners)

    def __len__(self) -> int:
        return len(self._owners)
