"""The reference executor: host memory, copied with numpy on the calling thread. The oracle for every other backend.

Each run is checked whole first (``BoundMemory.offsets``: every range inside its buffer, each column read
once), then copied call by call. Within a call, ranges come in segments with one source and one destination
buffer. A segment's ranges of at least ``SMALL_RANGE_BYTES`` are copied one slice assignment each (the
per-range cost is small beside the bytes); smaller ones are grouped by size and each group moves with one
fancy-indexed gather and one scatter over n-byte windows of the two buffers, at most ``GATHER_BYTES`` at a
time so the temporary stays in cache. Writes of a valid plan never overlap, and never overlap another range's
read, so the order of the groups does not change the result.

Threads: safe to share between any number of threads; a run keeps no state on the executor (ranges that
overlap between concurrent runs race as any two writers of the same bytes do). ``after`` transfers are waited
for on the calling thread.
"""
from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, TransferPlan

from .base import (
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
from .binding import BoundMemory
from .lowering import Lowered
from .memory import Memory, check_host_view

SMALL_RANGE_BYTES = 16 << 10  # below this a range is moved in a group; at or above, by one slice assignment
GATHER_BYTES = 1 << 18  # bytes one gather/scatter pair moves: the temporary stays in the cache
FEW_RANGES = 4  # segments this short are copied range by range: grouping costs more than it saves


class NumpyExecutor(Executor):
    """Copies with numpy, complete on return. Bindings: buffer name -> contiguous numpy array or CPU tensor.

    A failure while copying (numpy running out of memory for a group's temporary, say) raises ExecutorError
    naming the call and the first descriptor of the ranges being moved; calls before it were copied, ranges of
    that call may be. Threads: see the module docstring.
    """

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse (BindingError) memory that is not host memory numpy can view."""
        check_host_view(buf, mem)

    @property
    def synchronous(self) -> bool:
        """True: every byte has moved when ``run`` returns."""
        return True

    def _attach(self, bound: BoundMemory) -> None:
        bound.extra["views"] = _views(bound)  # made once per bind

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
        low = bound.offsets(plan)  # every check, before the first byte moves
        wait_on_host(waits)
        views = bound.extra.get("views") or _views(bound)
        for call, src, dst, index in _pieces(low):
            try:
                self._move(views[src], views[dst], low, index)
            except Exception as e:  # numpy's own failures (memory for a temporary): report where, never as done
                raise ExecutorError("numpy copy", call, int(index[0]), f"{type(e).__name__}: {e}; ranges of the call "
                                    "before it may have been copied", call) from e
        return completed(plan, t0)

    def _move(self, src: np.ndarray, dst: np.ndarray, low: Lowered, index: np.ndarray) -> None:
        """Copy ranges ``index`` of ``low`` from view ``src`` to view ``dst``: gathered and scattered in groups when
        they have one size below SMALL_RANGE_BYTES, else one slice assignment each."""
        nbytes = low.nbytes[index]
        n = int(nbytes[0])
        if len(index) > 1 and n < SMALL_RANGE_BYTES and bool((nbytes == n).all()):
            window = np.dtype((np.void, n))
            sw = np.ndarray(shape=(len(src) - n + 1,), dtype=window, buffer=src, strides=(1,))
            dw = np.ndarray(shape=(len(dst) - n + 1,), dtype=window, buffer=dst, strides=(1,))
            so, do = low.src[index], low.dst[index]
            step = max(1, GATHER_BYTES // n)
            for lo in range(0, len(index), step):
                dw[do[lo:lo + step]] = sw[so[lo:lo + step]]
            return
        for s, d, m in zip(low.src[index].tolist(), low.dst[index].tolist(), nbytes.tolist()):
            dst[d:d + m] = src[s:s + m]


def _pieces(low: Lowered) -> Iterator[tuple[int, int, int, np.ndarray]]:
    """(call, source buffer, destination buffer, range indices) for every group of ranges ``_move`` takes, call by
    call: per segment of one buffer pair, its ranges of SMALL_RANGE_BYTES or more, then its smaller ones by size."""
    n = len(low.nbytes)
    if n == 0:
        return
    (src_values, src_lengths), (dst_values, dst_lengths) = low.src_runs, low.dst_runs
    src_ends, dst_ends = np.cumsum(src_lengths), np.cumsum(dst_lengths)
    cuts = np.union1d(np.concatenate((src_ends, dst_ends)), low.call_offsets)
    starts, ends = cuts[:-1], cuts[1:]
    calls = np.searchsorted(low.call_offsets, starts, side="right") - 1
    srcs = src_values[np.searchsorted(src_ends, starts, side="right")]
    dsts = dst_values[np.searchsorted(dst_ends, starts, side="right")]
    for call, sb, db, a, b in zip(calls.tolist(), srcs.tolist(), dsts.tolist(), starts.tolist(), ends.tolist()):
        index = np.arange(a, b)
        if b - a <= FEW_RANGES:
            yield call, sb, db, index
            continue
        sizes = low.nbytes[a:b]
        small = sizes < SMALL_RANGE_BYTES
        if not small.all():
            yield call, sb, db, index[~small]
            index, sizes = index[small], sizes[small]
        if len(index) == 0:
            continue
        if sizes.min() == sizes.max():
            yield call, sb, db, index
            continue
        order = np.argsort(sizes, kind="stable")
        index, sizes = index[order], sizes[order]
        bounds = np.flatnonzero(sizes[1:] != sizes[:-1]) + 1
        for group in np.split(index, bounds):
            yield call, sb, db, group


def _views(bound: BoundMemory) -> list[Any]:
    return [m.view() if m is not None and m.view is not None else None for m in bound.memory]
