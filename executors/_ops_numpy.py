"""The reference executor: host memory, copied on the calling thread. The oracle for every other backend.

Each run is checked whole first (``BoundMemory.offsets``: every range inside its buffer, each column read
once), then copied. Where numba is installed (``kvxfer[fast]``) and ``copier`` is on (the default), every range
of the run takes one path:

* ``copier``: the batched host copier (``_host_copy``): the run's (destination, source, size) ranges, lowered to
  addresses by ``BoundMemory.descriptors`` (bounded inside the bound memory, the owners probed), copied by one
  compiled call that releases the GIL for the whole job, on ``copier_threads`` threads. The loop is compiled (or
  loaded from numba's cache) when the executor first binds memory or runs, so no job pays for it but a one-off
  run's first.

Otherwise the run is copied call by call. Within a call, ranges come in segments with one source and one
destination buffer, and each range takes one of three paths (``HostPath``; ``explain(plan)`` counts them):

* ``window``: ranges below ``small_range_bytes``, grouped by size; each group moves by fancy-indexed gathers
  and scatters over n-byte windows of the two buffers, ``WINDOW_STEP`` ranges and at most ``GATHER_BYTES`` at
  a time (the temporary stays in cache).
* ``memmove``: larger ranges, and segments of at most ``FEW_RANGES``: one libc ``memmove`` each (pieces of at
  most ``HELD_PIECE_BYTES``), called through ctypes with the GIL held.
* ``torch`` (off by default: ``bulk_range_bytes=None``): ranges of ``bulk_range_bytes`` or more, when torch is
  already imported in the process (kvxfer never imports it for this): one ``torch._foreach_copy_`` per group,
  which releases the GIL once and copies on torch's intra-op threads. Called from the main thread it copies
  1 MiB ranges at about twice memcpy's speed on two cores; from any other thread (the offload worker's lanes)
  torch ran each copy on one thread, and inside vLLM's CPU build, beside the engine's own torch threads, the
  engine's loads went 3x slower than by memmove (``benchmarks/NOTES.md``): hence off unless asked for.

Why the GIL matters: numpy releases it around any copy of more than 500 elements, and a thread that released
it waits a whole switch interval (``sys.getswitchinterval()``, 5 ms) to take it back from a busy Python thread.
A serving engine always has one (its scheduler, its worker thread), so copying range by range with numpy
costs up to 5 ms per range: 512 ranges of 128 KiB took 2.6 s instead of 8 ms. Here the GIL is released at
most once per group of torch ranges (the window steps stay below numpy's threshold, and the memmoves keep
it): other threads still run between ranges, as between any two Python bytecodes, and wait at most one
memmove piece (about half a millisecond) for their turn.

Writes of a valid plan never overlap, and never overlap another range's read, so the order of the groups does
not change the result. Every address comes from this executor's own views of the bound memory, after
``offsets`` bounded each range inside its buffer.

Threads: safe to share between any number of threads; a run keeps no state on the executor (ranges that
overlap between concurrent runs race as any two writers of the same bytes do). ``after`` transfers are waited
for on the calling thread.
"""
from __future__ import annotations

import ctypes
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from enum import StrEnum
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, TransferPlan, format_bytes

from ._base import (
    After,
    Bindings,
    CompletedTransfer,
    Executor,
    ExecutorError,
    Stream,
    completed,
    stream_handle,
    transfers_after,
    wait_on_host,
)
from ._binding import BoundMemory
from ._host_copy import HostCopier
from ._lowering import DescriptorArrays, Lowered
from ._memory import Memory, check_host_view
from ._options import NumpyOptions

SMALL_RANGE_BYTES: int = NumpyOptions.model_fields["small_range_bytes"].default  # below: window groups
BULK_RANGE_BYTES: int | None = NumpyOptions.model_fields["bulk_range_bytes"].default  # at or above: torch (None: off)
GATHER_BYTES = 1 << 18  # bytes one gather/scatter pair moves at most: the temporary stays in the cache
WINDOW_STEP = 256  # ranges one gather/scatter pair moves at most: numpy keeps the GIL for loops of <= 500 elements
HELD_PIECE_BYTES = 4 << 20  # bytes one memmove moves at most, with the GIL held (~0.6 ms at 7 GB/s)
FEW_RANGES = 4  # segments this short go range by range (memmove): grouping costs more than it saves


class HostPath(StrEnum):
    """How the NumPy executor moves a range (see the module docstring)."""

    WINDOW = "window"
    MEMMOVE = "memmove"
    TORCH = "torch"
    COPIER = "copier"


class NumpyExecutor(Executor):
    """Copies host memory, complete on return. Bindings: buffer name -> contiguous numpy array or CPU tensor.

    ``small_range_bytes``: ranges below it move in window groups; ``bulk_range_bytes``: ranges at or above it
    move through torch when torch is imported (None, the default: never). ``copier``: every range through the
    batched host copier where numba is installed (then the two thresholds do not apply), on ``copier_threads``
    threads. A failure while copying (numpy running out of memory for a group's temporary, say) raises
    ExecutorError naming the call and the first descriptor of the ranges being moved; calls before it were
    copied, ranges of that call may be. Threads: see the module docstring.
    """

    def __init__(self, small_range_bytes: int = SMALL_RANGE_BYTES, bulk_range_bytes: int | None = BULK_RANGE_BYTES,
                 copier: bool = True, copier_threads: int = 1):
        opts = NumpyOptions(small_range_bytes=small_range_bytes, bulk_range_bytes=bulk_range_bytes, copier=copier,
                            copier_threads=copier_threads)
        self.small_range_bytes, self.bulk_range_bytes = opts.small_range_bytes, opts.bulk_range_bytes
        self.copier, self.copier_threads = opts.copier, opts.copier_threads
        self._memmove = _held_memmove()
        self._loaded: list[HostCopier | None] = []  # [] until loaded; then [the copier, or None where numba is missing]
        self._load_lock = threading.Lock()
        self._arrays = threading.local()  # per thread: DescriptorArrays the copier's jobs lower into (grow only)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_memmove", "_loaded", "_load_lock", "_arrays"):  # made again where the executor is unpickled
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._memmove = _held_memmove()
        self._loaded, self._load_lock, self._arrays = [], threading.Lock(), threading.local()

    @classmethod
    def from_options(cls, options: Any) -> NumpyExecutor:
        """An executor from ``NumpyOptions``."""
        opts = options if isinstance(options, NumpyOptions) else NumpyOptions.model_validate(options)
        return cls(opts.small_range_bytes, opts.bulk_range_bytes, opts.copier, opts.copier_threads)

    def __repr__(self) -> str:
        torch = "" if self.bulk_range_bytes is None or self._torch() is not None else " (torch not imported: memmove)"
        return (f"NumpyExecutor(small_range_bytes={self.small_range_bytes}, bulk_range_bytes={self.bulk_range_bytes}"
                f"{torch}, copier={self.copier}, copier_threads={self.copier_threads})")

    def host_copier(self) -> HostCopier | None:
        """The batched host copier this executor runs every range through, loaded (numba imported, the loop
        compiled or read from numba's cache) on the first call; None where ``copier`` is off or numba is not
        installed. ``bind`` calls it, so a bound run never pays for the load."""
        if not self.copier:
            return None
        if not self._loaded:
            with self._load_lock:
                if not self._loaded:
                    self._loaded.append(HostCopier.load(self.copier_threads))
        return self._loaded[0]

    def close(self) -> None:
        """Stop the copier's pool threads, if it started any (a later run starts them again)."""
        copier = self._loaded[0] if self._loaded else None
        if copier is not None:
            copier.close()

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse (BindingError) memory that is not host memory numpy can view."""
        check_host_view(buf, mem)

    @property
    def synchronous(self) -> bool:
        """True: every byte has moved when ``run`` returns."""
        return True

    def _attach(self, bound: BoundMemory) -> None:
        self.host_copier()  # loaded now, before the first job
        bound.extra["views"] = _views(bound)  # made once per bind

    def _torch(self) -> Any:
        torch = sys.modules.get("torch") if self.bulk_range_bytes is not None else None
        return torch if torch is not None and hasattr(torch, "_foreach_copy_") else None

    def paths(self, plan: TransferPlan) -> dict[HostPath, tuple[int, int]]:
        """(ranges, bytes) that each path would move for ``plan`` in this process now (``explain`` prints it)."""
        plan.check_shape()
        sizes = plan.nbytes.astype(np.uint64)
        out = {p: (0, 0) for p in HostPath}
        if self.host_copier() is not None:
            out[HostPath.COPIER] = (plan.num_ranges, int(sizes.sum()))
            return out
        pieces = self._pieces(sizes, plan.column_runs("src_buf"), plan.column_runs("dst_buf"), plan.call_offsets,
                              self._torch())
        for _, _, _, path, index in pieces:
            n, b = out[path]
            out[path] = (n + len(index), b + int(sizes[index].sum()))
        return out

    def explain(self, plan: TransferPlan) -> str:
        """One line: how many ranges and bytes of ``plan`` each path moves, and why (see the module docstring)."""
        counts = self.paths(plan)
        parts = [f"{p.value} {n} ranges / {format_bytes(b)}" for p, (n, b) in counts.items() if n]
        copier = self.host_copier()
        if copier is not None:
            threads = f"{copier.threads} thread{'s' if copier.threads > 1 else ''}"
            return f"numpy: {', '.join(parts) or 'nothing to copy'} (batched copier: numba, GIL released, {threads})"
        if self.bulk_range_bytes is None:
            torch = "torch off"
        else:
            torch = f"torch from {self.bulk_range_bytes} B" + ("" if self._torch() is not None else ", not imported")
        why = "copier off" if not self.copier else "copier: numba not installed"
        return (f"numpy: {', '.join(parts) or 'nothing to copy'} (window below {self.small_range_bytes} B, {torch}, "
                f"{why})")

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Stream = None,
            after: After = None) -> CompletedTransfer:
        """Copy every range once every ``after`` transfer has finished; complete on return. ``stream`` is accepted
        (host memory: nothing to order). Raises BindingError, PlanError or RunArgumentError before any byte moves,
        ExecutorError naming the call and descriptor when a copy fails."""
        t0 = time.perf_counter()
        if stream is not None:
            stream_handle(stream)  # a stream of the wrong kind is refused, as by every executor
        waits = transfers_after(after)
        bound = self.memory_for(plan, memory)
        copier = self.host_copier()
        if copier is not None:
            arrays = getattr(self._arrays, "value", None)
            if arrays is None:
                arrays = self._arrays.value = DescriptorArrays()
            # every check, before the first byte moves; addresses inside bound memory, in this thread's arrays
            low = bound.descriptors(plan, arrays.reserve(plan.num_ranges))
            wait_on_host(waits)
            try:
                copier.copy(*(np.ascontiguousarray(a, dtype=np.uint64) for a in (low.dst, low.src, low.nbytes)))
            except Exception as e:  # a thread of the pool that could not start, say: never reported as done
                raise ExecutorError("host copy", 0, 0, f"{type(e).__name__}: {e}; ranges may have been copied", 0) from e
            return completed(plan, t0)
        low = bound.offsets(plan)  # every check, before the first byte moves
        wait_on_host(waits)
        views = bound.extra.get("views") or _views(bound)
        sides = _Sides(views, bound, self._torch())
        for call, src, dst, path, index in self._pieces(low.nbytes, low.src_runs, low.dst_runs, low.call_offsets,
                                                        sides.torch):
            try:
                self.move(path, sides, src, dst, low, index)
            except Exception as e:  # numpy's or torch's own failures (memory for a temporary): never as done
                raise ExecutorError("numpy copy", call, int(index[0]), f"{type(e).__name__}: {e}; ranges of the call "
                                    "before it may have been copied", call) from e
        return completed(plan, t0)

    def move(self, path: HostPath, sides: _Sides, src: int, dst: int, low: Lowered, index: np.ndarray) -> None:
        """Copy ranges ``index`` of ``low`` from buffer ``src`` to buffer ``dst`` by ``path``. ``run`` calls it once
        per group of ranges; a subclass may wrap it (a test double fails it to stand for numpy running out of
        memory)."""
        so, do, nbytes = low.src[index], low.dst[index], low.nbytes[index]
        if path is HostPath.WINDOW:
            # intp indices: numpy's fast path, which keeps the GIL for small gathers (uint64 ones are converted
            # element by element in a loop that releases it every time)
            so, do, n = so.astype(np.intp), do.astype(np.intp), int(nbytes[0])
            sw, dw = sides.windows(src, n), sides.windows(dst, n)
            step = max(1, min(WINDOW_STEP, GATHER_BYTES // n))
            for lo in range(0, len(index), step):
                dw[do[lo:lo + step]] = sw[so[lo:lo + step]]
        elif path is HostPath.TORCH:
            ts, td = sides.tensor(src), sides.tensor(dst)
            pairs = list(zip(so.tolist(), do.tolist(), nbytes.tolist()))
            sides.torch._foreach_copy_([td[d:d + m] for _, d, m in pairs], [ts[s:s + m] for s, _, m in pairs])
        else:
            mm, sa, da = self._memmove, sides.address(src), sides.address(dst)
            for s, d, m in zip(so.tolist(), do.tolist(), nbytes.tolist()):
                for o in range(0, m, HELD_PIECE_BYTES):
                    mm(da + d + o, sa + s + o, min(HELD_PIECE_BYTES, m - o))

    def _pieces(self, nbytes: np.ndarray, src_runs: tuple[np.ndarray, np.ndarray], dst_runs: tuple[np.ndarray, np.ndarray],
                call_offsets: np.ndarray, torch: Any) -> Iterator[tuple[int, int, int, HostPath, np.ndarray]]:
        """(call, source buffer, destination buffer, path, range indices) for every group ``move`` takes, call by
        call and segment by segment (one buffer pair): a lowered run's ranges, or a plan's for ``paths``. ``torch``:
        the module when the torch path is on (``_torch()``), else None."""
        if len(nbytes) == 0:
            return
        (src_values, src_ends), (dst_values, dst_ends) = _merged(*src_runs), _merged(*dst_runs)
        cuts = np.union1d(np.concatenate((src_ends, dst_ends)), call_offsets)
        starts, ends = cuts[:-1], cuts[1:]
        calls = np.searchsorted(call_offsets, starts, side="right") - 1
        srcs = src_values[np.searchsorted(src_ends, starts, side="right")]
        dsts = dst_values[np.searchsorted(dst_ends, starts, side="right")]
        bulk_from = self.bulk_range_bytes if torch is not None else None
        for call, sb, db, a, b in zip(calls.tolist(), srcs.tolist(), dsts.tolist(), starts.tolist(), ends.tolist()):
            for path, index in _groups(nbytes, a, b, self.small_range_bytes, bulk_from):
                yield call, sb, db, path, index


def _groups(nbytes: np.ndarray, a: int, b: int, small_from: int,
            bulk_from: int | None) -> Iterator[tuple[HostPath, np.ndarray]]:
    """(path, range indices) for the ranges ``a:b`` of one segment: bulk ones (``bulk_from`` bytes or more; None:
    none) through torch, those below ``small_from`` in window groups of one size, the rest by memmove."""
    index = np.arange(a, b)
    if b - a <= FEW_RANGES:
        yield HostPath.MEMMOVE, index
        return
    sizes = nbytes[a:b]
    bulk = sizes >= bulk_from if bulk_from is not None else np.zeros(len(sizes), bool)
    small = (sizes < small_from) & ~bulk
    mid = ~(small | bulk)
    if bulk.any():
        yield HostPath.TORCH, index[bulk]
    if mid.any():
        yield HostPath.MEMMOVE, index[mid]
    index, sizes = index[small], sizes[small]
    if len(index) == 0:
        return
    if sizes.min() == sizes.max():
        yield HostPath.WINDOW, index
        return
    order = np.argsort(sizes, kind="stable")
    index, sizes = index[order], sizes[order]
    for group in np.split(index, np.flatnonzero(sizes[1:] != sizes[:-1]) + 1):
        yield HostPath.WINDOW, group


def _merged(values: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(value, end) of each maximal run: lowered runs may split one buffer's ranges (a run per region)."""
    ends = np.cumsum(lengths)
    last = np.append(values[1:] != values[:-1], True) if len(values) else np.zeros(0, bool)
    return values[last], ends[last]


class _Sides:
    """One run's ways into the bound buffers: the views (and what is derived from them: addresses, n-byte
    windows, torch tensors), each made the first time a group needs it."""

    def __init__(self, views: list[Any], bound: BoundMemory, torch: Any):
        self.views, self.bound, self.torch = views, bound, torch
        self._addresses: dict[int, int] = {}
        self._windows: dict[tuple[int, int], np.ndarray] = {}

    def address(self, buf: int) -> int:
        """The address of buffer ``buf``'s first byte, read from this executor's view of it."""
        a = self._addresses.get(buf)
        if a is None:
            a = self._addresses[buf] = int(self.views[buf].__array_interface__["data"][0])
        return a

    def windows(self, buf: int, n: int) -> np.ndarray:
        """Buffer ``buf`` as overlapping n-byte elements, one starting at every byte."""
        w = self._windows.get((buf, n))
        if w is None:
            v = self.views[buf]
            w = self._windows[(buf, n)] = np.ndarray(shape=(len(v) - n + 1,), dtype=np.dtype((np.void, n)), buffer=v,
                                                     strides=(1,))
        return w

    def tensor(self, buf: int) -> Any:
        """Buffer ``buf`` as a flat uint8 CPU tensor over the same memory (made once per bind)."""
        tensors = self.bound.extra.setdefault("tensors", {})
        t = tensors.get(buf)
        if t is None:
            with warnings.catch_warnings():  # a read-only source: torch warns that it could write it; kvxfer does not
                warnings.simplefilter("ignore", UserWarning)
                t = tensors[buf] = self.torch.from_numpy(self.views[buf])
        return t


def _held_memmove() -> Any:
    """libc's memmove through ctypes, keeping the GIL (``ctypes.memmove`` itself releases it around each call)."""
    address = ctypes.cast(ctypes.memmove, ctypes.c_void_p).value
    if address is None:  # pragma: no cover - ctypes always has memmove
        raise ImportError("ctypes has no memmove")
    return ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(address)


def _views(bound: BoundMemory) -> list[Any]:
    return [m.view() if m is not None and m.view is not None else None for m in bound.memory]
