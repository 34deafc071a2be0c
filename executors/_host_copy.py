"""The batched host copier: every range of a job copied in one compiled call that releases the GIL.

A job's ranges arrive as three uint64 arrays (destination address, source address, size), already bounded inside
bound memory by lowering. ``HostCopier.copy`` hands them to a small loop compiled by numba
(``@njit(nogil=True, cache=True)``) that calls ``memmove`` per range (LLVM's intrinsic, which becomes libc's
``memmove``): one Python call per job instead of one per range, and no GIL while the bytes move, so Python
threads beside it (a serving engine's scheduler) run freely and the copy does not wait a switch interval per
range to take the GIL back. With ``threads`` above 1 the job's bytes are cut into that many equal shares (a range
may be cut between two shares) and the shares run on that many threads at once (the caller's and a pool's).

numba is optional (the ``fast`` extra): ``HostCopier.load`` returns None where it is missing, and the
NumPy executor keeps its own paths. The loop is compiled once per machine and cached by numba (``cache=True``:
numba's cache folder, ``NUMBA_CACHE_DIR`` where set, else next to this module, or a user-wide folder where that is
not writable); ``load`` compiles or loads it, so callers load at bind time, not inside a job.

Nothing here checks addresses: the caller passes only ranges it has bounded inside memory it holds for the call.

Threads: ``copy`` may be called from any number of threads at once; each call waits for its own shares only.
"""
from __future__ import annotations

import functools
import importlib
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvxfer.planner import MissingDependencyError, import_optional

__all__ = ["HostCopier", "even_shares", "kernel"]

Kernel = Callable[[np.ndarray, np.ndarray, np.ndarray], None]


@functools.cache
def kernel() -> Kernel:
    """The compiled copy loop ``(dst, src, nbytes)`` over uint64 arrays, compiled or loaded from numba's cache on
    first use; MissingDependencyError where numba is not installed."""
    numba: Any = import_optional("numba", "the batched host copier")
    ir: Any = importlib.import_module("llvmlite.ir")  # installed with numba
    cgutils: Any = importlib.import_module("numba.core.cgutils")
    types: Any = importlib.import_module("numba.core.types")
    intrinsic: Any = importlib.import_module("numba.extending").intrinsic

    def memmove_typer(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            d, s, m = args
            ptr = ir.IntType(8).as_pointer()
            cgutils.raw_memmove(builder, builder.inttoptr(d, ptr), builder.inttoptr(s, ptr), m, 1)
            return context.get_dummy_value()
        return types.void(types.uint64, types.uint64, types.uint64), codegen

    memmove = intrinsic(memmove_typer)  # LLVM's memmove intrinsic: libc's memmove for sizes known at run time

    def loop(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:  # pragma: no cover - compiled
        for i in range(nbytes.shape[0]):
            memmove(dst[i], src[i], nbytes[i])

    copy_ranges: Kernel = numba.njit(nogil=True, cache=True)(loop)
    empty = np.zeros(0, np.uint64)
    copy_ranges(empty, empty, empty)  # compile (or load the cached machine code) now, not in a job
    return copy_ranges


def even_shares(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray,
                parts: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """The ranges ``(dst, src, nbytes)`` (uint64 arrays of non-zero sizes) as at most ``parts`` shares of equal
    bytes, in order: a range that straddles a share's end is cut there. Every byte lands in exactly one share;
    empty shares are left out."""
    total = int(nbytes.sum(dtype=np.uint64)) if len(nbytes) else 0
    if total == 0:
        return []
    if parts <= 1:
        return [(dst, src, nbytes)]
    ends = np.cumsum(nbytes, dtype=np.uint64)
    cuts = [total * k // parts for k in range(parts + 1)]
    out = []
    for lo, hi in zip(cuts[:-1], cuts[1:]):
        if lo == hi:
            continue
        a = int(np.searchsorted(ends, np.uint64(lo), side="right"))  # the range holding byte lo
        b = int(np.searchsorted(ends, np.uint64(hi), side="left"))  # the range holding byte hi - 1
        d, s, n = dst[a:b + 1].copy(), src[a:b + 1].copy(), nbytes[a:b + 1].copy()
        skip = np.uint64(lo - (int(ends[a]) - int(nbytes[a])))
        d[0] += skip
        s[0] += skip
        n[0] -= skip
        n[-1] -= np.uint64(int(ends[b]) - hi)
        out.append((d, s, n))
    return out


class HostCopier:
    """One compiled copy call per job (see the module docstring), on ``threads`` threads (the caller's and
    ``threads - 1`` pool threads, started on first use). Make one with ``HostCopier.load(threads)``."""

    def __init__(self, copy_ranges: Kernel, threads: int = 1):
        if threads < 1:
            raise ValueError(f"threads = {threads}: at least 1")
        self.threads = threads
        self._copy = copy_ranges
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    @classmethod
    def load(cls, threads: int = 1) -> HostCopier | None:
        """A copier with the compiled loop (compiled or loaded from the cache now), or None where numba is not
        installed or cannot compile it."""
        try:
            return cls(kernel(), threads)
        except MissingDependencyError:
            return None

    def __repr__(self) -> str:
        return f"HostCopier(threads={self.threads})"

    def _workers(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.threads - 1, thread_name_prefix="kvxfer-copy")
            return self._pool

    def copy(self, dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
        """memmove every range ``i``: ``nbytes[i]`` bytes from address ``src[i]`` to ``dst[i]`` (uint64 arrays,
        bounded by the caller), without the GIL, on up to ``threads`` threads; returns once every byte moved.
        Ranges of one call must not overlap each other's writes or reads (a plan's never do)."""
        shares = even_shares(dst, src, nbytes, self.threads) if self.threads > 1 else [(dst, src, nbytes)]
        if len(shares) <= 1:
            for d, s, n in shares:
                self._copy(d, s, n)
            return
        pool = self._workers()
        futures: list[Future[None]] = [pool.submit(self._copy, d, s, n) for d, s, n in shares[1:]]
        try:
            self._copy(*shares[0])
        finally:
            for f in futures:
                f.result()

    def close(self) -> None:
        """Stop the pool threads (a later ``copy`` starts them again)."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

