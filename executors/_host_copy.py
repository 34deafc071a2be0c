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


STREAM_BYTES = 8 << 20  # a share of at least this many bytes is written with non-temporal (streaming) stores
STREAM_RANGE = 1 << 10  # copies (ranges merged with their neighbours) shorter than this take memmove even then


@functools.cache
def kernel() -> Kernel:
    """The compiled copy loop ``(dst, src, nbytes)`` over uint64 arrays, compiled or loaded from numba's cache on
    first use; MissingDependencyError where numba is not installed.

    Per range (ranges adjacent on both sides taken as one): the next range's first KiB is prefetched (a page
    found at random otherwise waits for the hardware prefetcher to start again), then the bytes are copied. A
    call moving at least STREAM_BYTES writes copies of STREAM_RANGE bytes and more with non-temporal stores, whole
    64-byte cache lines from the destination's first line boundary on, and ends with a store fence: a job larger
    than the caches gains nothing from keeping its destination cached, and writing around the cache skips reading
    each destination line first (libc's memcpy does this only above a size it derives from the last-level cache,
    which per-layer tensors of 16 MiB stayed under on one machine: they copied at 0.6x one 128 MiB memcpy there).
    The partial lines at either end take ``memmove``: a line written partly by streaming stores and partly by
    ordinary ones costs the write-combining buffer a partial flush, which made streamed 4 KiB pages whose
    destination sat 16 bytes past a line (numpy's large arrays do) run at 0.3x memcpy, where whole lines run at
    0.85-1.3x (benchmarks/NOTES.md, "Host paths, fourth look"). Smaller calls and smaller copies call ``memmove``
    (LLVM's intrinsic, libc's)."""
    numba: Any = import_optional("numba", "the batched host copier")
    ir: Any = importlib.import_module("llvmlite.ir")  # installed with numba
    cgutils: Any = importlib.import_module("numba.core.cgutils")
    types: Any = importlib.import_module("numba.core.types")
    intrinsic: Any = importlib.import_module("numba.extending").intrinsic
    void, u64 = types.void, types.uint64

    def memmove_typer(typingctx: Any, dst: Any, src: Any, n: Any) -> Any:
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            d, s, m = args
            ptr = ir.IntType(8).as_pointer()
            cgutils.raw_memmove(builder, builder.inttoptr(d, ptr), builder.inttoptr(s, ptr), m, 1)
            return context.get_dummy_value()
        return void(u64, u64, u64), codegen

    def stream_typer(typingctx: Any, dst: Any, src: Any) -> Any:  # 32 bytes: an unaligned load, a streaming store
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            d, s = args
            vec = ir.VectorType(ir.IntType(64), 4).as_pointer()
            value = builder.load(builder.inttoptr(s, vec), align=1)
            store = builder.store(value, builder.inttoptr(d, vec), align=32)
            store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))
            return context.get_dummy_value()
        return void(u64, u64), codegen

    def prefetch_typer(typingctx: Any, addr: Any) -> Any:  # a hint: never faults, whatever the address
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
            fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                                "llvm.prefetch.p0")
            builder.call(fn, [builder.inttoptr(args[0], i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                              ir.Constant(i32, 1)])
            return context.get_dummy_value()
        return void(u64), codegen

    def fence_typer(typingctx: Any) -> Any:  # orders the streaming stores before the caller reports the job done
        def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return void(), codegen

    memmove, stream, prefetch, fence = (intrinsic(t) for t in (memmove_typer, stream_typer, prefetch_typer,
                                                                fence_typer))

    def loop(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:  # pragma: no cover - compiled
        n = nbytes.shape[0]
        total = 0
        for i in range(n):
            total += nbytes[i]
        streaming = total >= STREAM_BYTES
        i = 0
        while i < n:
            d, s, m = dst[i], src[i], nbytes[i]
            i += 1
            while i < n and dst[i] == d + m and src[i] == s + m:  # adjacent on both sides: one copy
                m += nbytes[i]
                i += 1
            if i < n:
                for line in range(16):
                    prefetch(src[i] + np.uint64(64 * line))
            if streaming and m >= STREAM_RANGE:
                head = (np.uint64(64) - (d & np.uint64(63))) & np.uint64(63)  # to the destination's next line
                memmove(d, s, head)
                d += head
                s += head
                m -= head
                end = d + (m & ~np.uint64(127))
                while d < end:
                    stream(d, s)
                    stream(d + np.uint64(32), s + np.uint64(32))
                    stream(d + np.uint64(64), s + np.uint64(64))
                    stream(d + np.uint64(96), s + np.uint64(96))
                    d += np.uint64(128)
                    s += np.uint64(128)
                m &= np.uint64(127)
            memmove(d, s, m)
        if streaming:
            fence()

    # One signature, compiled (or loaded from the cache) now: read-only arrays of any layout, which writable and
    # contiguous ones convert to. Without it numba compiles again on the first call with other flags (lowering
    # hands its arrays over frozen), inside a job.
    ranges = types.Array(types.uint64, 1, "A", readonly=True)
    copy_ranges: Kernel = numba.njit(void(ranges, ranges, ranges), nogil=True, cache=True)(loop)
    empty = np.zeros(0, np.uint64)
    copy_ranges(empty, empty, empty)  # the dispatcher's first call sets itself up: now, not in a job
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

