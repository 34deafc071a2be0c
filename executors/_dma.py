"""What the CUDA and HIP batch executors share: the 24-byte attribute record, the ``Runtime`` protocol a
driver implements, and the lowering of a plan onto a copy stream (descriptor arrays, attributes, events,
stream order).

The backend files (ops_cuda.py, ops_hip.py) only implement ``Runtime`` for their driver. Tests pass a
host-memory runtime (tests/shims) through the executor's constructor.

Threads: one executor may be shared by any number of threads. ``run`` waits on the calling thread for the
``after`` transfers it cannot order on the device, then holds the executor's lock while it lowers and issues
the plan (the descriptor arrays are reused and the copy stream's order is one chain), so concurrent runs
serialize their submission; the copies themselves stay asynchronous. ``close`` takes the same lock. A
DmaTransfer's methods may be called from any thread.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
import weakref
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from kvxfer.planner import Buffer, CopyApi, CopyAttributes, PlanError, Platform, Target, TransferPlan

from ._base import (
    After,
    Executor,
    ExecutorError,
    Stream,
    Transfer,
    check_plan_target,
    split_after,
    stream_handle,
    transfers_after,
    wait_on_host,
)
from ._binding import BoundMemory, hold_for_stream
from ._lowering import DescriptorArrays, Lowered
from ._memory import Memory

__all__ = ["ATTR_DTYPE", "DmaExecutor", "DmaTransfer", "MemcpyAttributes", "MemLocation", "Runtime", "attribute_records",
           "check", "driver_result", "stream_handle"]

SIZE_MAX = (1 << 64) - 1
NOT_READY = 600  # CUDA_ERROR_NOT_READY and hipErrorNotReady share the value
BATCH_APIS = (CopyApi.CUDA_BATCH_V2, CopyApi.CUDA_BATCH, CopyApi.HIP_BATCH)


class MemLocation(ctypes.Structure):
    """CUmemLocation / hipMemLocation: {int type; int id;}."""

    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class MemcpyAttributes(ctypes.Structure):
    """CUmemcpyAttributes / hipMemcpyAttributes: 24 bytes, 4-byte aligned."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", MemLocation), ("dstLocHint", MemLocation),
                ("flags", ctypes.c_uint)]


ATTR_DTYPE = np.dtype(MemcpyAttributes)


def attribute_records(attrs: tuple[CopyAttributes, ...]) -> np.ndarray:
    """The plan's attribute table as an array of C records (index = the plan's ``attr`` id)."""
    rec = np.zeros(len(attrs), dtype=ATTR_DTYPE)
    for i, a in enumerate(attrs):
        rec[i] = (a.src_access_order.code, (a.src_location.code, a.src_location.id),
                  (a.dst_location.code, a.dst_location.id), a.flags)
    return rec


class Runtime(Protocol):
    """The driver calls a DMA executor issues. Every call returns the driver's raw code (0 = success) except
    ``stream_create``/``event_create``, which raise ExecutorError, and ``error_name``.

    ``batch`` passes descriptor arrays by address (size_t/pointer arrays the executor owns) and is a ctypes
    function in every implementation: the Python bindings build one object per pointer, too slow for tens of
    thousands of descriptors (CUDA) or mis-declare the call (hip-python). ``fail_idx`` is written by ABIs
    that report a failing descriptor. ``check_memory`` refuses memory the runtime cannot address. ``domain``
    names the driver: transfers of one domain order each other's streams on the device ("cuda", "rocm").
    """

    platform: Platform
    version: int
    device: int
    domain: str

    def api_available(self, api: CopyApi) -> bool:
        """Whether the driver has an entry point for ``api`` (a NULL or missing symbol counts as unavailable)."""

    def batch(self, api: CopyApi, dsts: int, srcs: int, sizes: int, count: int, attrs: int | None,
              attrs_idxs: int | None, num_attrs: int, fail_idx: ctypes.c_size_t, stream: int) -> int:
        """Issue one batch copy of ``count`` descriptors on ``stream``; the arrays are passed by address. Returns the driver's
        code; on failure an ABI that reports it writes the failing descriptor's index (within the call) to ``fail_idx``."""

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """Issue one asynchronous copy of ``nbytes`` from address ``src`` to ``dst`` on ``stream``; returns the driver's code."""

    def stream_create(self) -> int:
        """A new non-blocking stream's handle; raises ExecutorError naming the driver call on failure."""

    def stream_destroy(self, stream: int) -> int:
        """Destroy ``stream``; returns the driver's code."""

    def event_create(self) -> int:
        """A new event's handle; raises ExecutorError naming the driver call on failure."""

    def event_destroy(self, event: int) -> int:
        """Destroy ``event``; returns the driver's code."""

    def event_record(self, event: int, stream: int) -> int:
        """Record ``event`` on ``stream``; returns the driver's code."""

    def stream_wait_event(self, stream: int, event: int) -> int:
        """Make ``stream`` wait on the device until ``event`` completes; returns the driver's code."""

    def event_query(self, event: int) -> int:
        """Poll ``event``: 0 once complete, NOT_READY while pending, else the driver's error code."""

    def event_synchronize(self, event: int) -> int:
        """Block the host until ``event`` completes; returns the driver's code."""

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        """``(code, milliseconds)`` between two recorded events."""

    def error_name(self, code: int) -> str:
        """The driver's name for error ``code`` (for messages)."""

    def current(self) -> contextlib.AbstractContextManager[None]:
        """A context manager that makes this runtime's device current for the block and restores the caller's after it."""

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse, with BindingError naming the buffer, memory this runtime cannot address for ``buf``."""

    def close(self) -> None:
        """Release what the runtime holds (a retained context); called once, by the executor that made the runtime."""


def check(rt: Runtime, code: int, call: str) -> None:
    """Raise ExecutorError for a failed stream/event call (one that issues no copies)."""
    if code:
        raise ExecutorError(call, 0, None, f"{rt.error_name(code)} ({code})", 0)


def driver_result(result: Any, call: str, error_name: Any) -> Any:
    """Unpack a Python binding's ``(err, *values)`` tuple (cuda-bindings and hip-python both return one):
    the value(s), or ExecutorError naming ``call`` and ``error_name(err)``."""
    err, *rest = result if isinstance(result, tuple) else (result,)
    if int(err) != 0:
        raise ExecutorError(call, 0, None, f"{error_name(err)} ({int(err)})", 0)
    return rest[0] if len(rest) == 1 else tuple(rest) or None


@dataclass(eq=False, kw_only=True)
class DmaTransfer(Transfer):
    """A plan issued on a copy stream. ``marks[i]`` completes with call i (the last is ``end``); ``keep``
    holds the bound memory until the copies are seen finished (``done`` or ``wait``), then lets it go (a closed
    binding's memory is then held by nothing here); the events are destroyed with the transfer."""

    runtime: Runtime = field(repr=False)
    start: int = field(repr=False)
    end: int = field(repr=False)
    marks: tuple[int, ...] = field(repr=False)
    keep: tuple[Any, ...] = field(repr=False, default=())

    def done(self) -> bool:
        """Whether the transfer's end event has completed; ExecutorError if the driver reports an error."""
        finished = _query(self.runtime, self.end)
        if finished:
            self.keep = ()
        return finished

    def wait(self) -> DmaTransfer:
        """Block until every call is done and set ``elapsed_s`` from the start/end events; returns self. Raises ExecutorError."""
        rt = self.runtime
        check(rt, rt.event_synchronize(self.end), "event synchronize")
        self.keep = ()
        code, ms = rt.event_elapsed_ms(self.start, self.end)
        check(rt, code, "event elapsed time")
        self.elapsed_s = ms / 1e3
        return self

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` has completed (IndexError outside the calls; ExecutorError from the driver)."""
        return _query(self.runtime, self.marks[self._call(call)])

    def wait_call(self, call: int) -> DmaTransfer:
        """Block the host until call ``call`` has completed; returns self. Raises IndexError or ExecutorError."""
        check(self.runtime, self.runtime.event_synchronize(self.marks[self._call(call)]), "event synchronize (call)")
        return self

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Make ``stream`` (see ``stream_handle``; a stream of the runtime's driver) wait on the device until call ``call``
        (default: the last) is done. Raises IndexError, RunArgumentError or ExecutorError."""
        rt = self.runtime
        check(rt, rt.stream_wait_event(stream_handle(stream, rt.device), self.marks[self._call(call)]),
              "stream wait (consumer)")


class DmaExecutor(Executor):
    """Runs a plan with the driver's copy engines, one driver call per planned call.

    Copies go on the executor's own copy stream. Each run first makes that stream wait for the caller's
    compute stream (``stream``; stores read the live cache, loads overwrite blocks that may still be being
    zeroed), for the end of the previous run, and for every ``after`` transfer: on the device for transfers of
    the runtime's domain (DMA transfers of this driver, Triton on the same GPU platform), on the host before
    anything is issued for the others. It then records start/end events for timing. ``max_descriptors``
    refuses plans whose calls exceed a runtime limit (ROCm faults above 8,192), 0/None = no limit.
    Threads: see the module docstring.
    """

    def __init__(self, runtime: Runtime, *, max_descriptors: int | None = None, own_runtime: bool = False):
        self.runtime = runtime
        self.max_descriptors = max_descriptors or None
        self._own_runtime = own_runtime  # a runtime made by the executor is closed with it
        self._buffers = DescriptorArrays()
        self._fail_idx = ctypes.c_size_t(SIZE_MAX)
        self._lock = threading.Lock()
        self._last: DmaTransfer | None = None
        self._inflight: list[DmaTransfer] = []  # keeps bound memory alive until the copies finish
        self._stream_held = False  # torch was told the copy stream uses its tensors (hold_for_stream)
        with runtime.current():
            self._stream: int | None = runtime.stream_create()

    @property
    def target(self) -> Target:
        """The platform and runtime version of the runtime this executor drives."""
        return Target(platform=self.runtime.platform, runtime_version=self.runtime.version)

    @property
    def synchronous(self) -> bool:
        """False: ``run`` issues the copies on the copy stream and returns."""
        return False

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Delegate to the runtime's ``check_memory`` (BindingError for memory it cannot address)."""
        self.runtime.check_memory(buf, mem)

    def _attach(self, bound: BoundMemory) -> None:
        if self._stream is not None:
            self._stream_held |= hold_for_stream(bound, self._stream)

    def close(self) -> None:
        """Wait for the last transfer, destroy the copy stream and close a runtime the executor made; later runs raise
        ExecutorError. Safe to call twice.

        A copy stream that torch was told about (CUDA tensors bound, see ``hold_for_stream``) is not destroyed
        but left to the process: torch records an event on it whenever one of those tensors is freed, even
        long after this executor is gone, and an event on a destroyed stream aborts the process (seen on an
        H200: "context is destroyed" when such a tensor was freed after close)."""
        with self._lock:
            if self._stream is not None:
                if self._last is not None:
                    self._last.wait()
                if not self._stream_held:
                    with self.runtime.current():
                        self.runtime.stream_destroy(self._stream)
                self._stream = None
            if self._own_runtime:
                self.runtime.close()
                self._own_runtime = False

    def _check_plan(self, plan: TransferPlan) -> None:
        check_plan_target(plan, self.target)
        if not self.runtime.api_available(plan.api):
            raise ExecutorError(plan.api.value, 0, None, f"the {self.target.label} runtime returned no entry point "
                                "for it (NULL: unavailable in this driver)", 0)

    def _check_calls(self, low: Lowered) -> None:
        """Refuse calls longer than ``max_descriptors`` (PlanError naming the call), from the call offsets as read."""
        cap = self.max_descriptors
        sizes = low.call_sizes
        if cap and len(sizes) and int(sizes.max()) > cap:
            i = int(np.argmax(sizes > cap))
            raise PlanError("call_sizes", int(sizes[i]), f"call {i} exceeds this executor's cap of {cap} "
                            f"descriptors per call; re-plan with PlanOptions(max_descriptors<={cap})", i)

    def run(self, plan: TransferPlan, memory: BoundMemory | Mapping[str, Any], stream: Stream = None,
            after: After = None) -> DmaTransfer:
        """Issue every call of ``plan`` after ``stream``'s pending work and every ``after`` transfer (see
        ``Executor.run``); returns at once. Raises TargetMismatchError, BindingError, PlanError or
        RunArgumentError before anything is issued, ExecutorError (naming call, chunk, descriptor and what was
        already issued) when the driver fails."""
        self._check_plan(plan)
        waits = transfers_after(after)
        bound = self.memory_for(plan, memory)
        on_device, on_host = split_after(waits, self.runtime.domain)
        wait_on_host(on_host)
        with self._lock:
            if self._stream is None:
                raise ExecutorError("run", 0, None, "the executor was closed", 0)
            if bound is not memory:  # bound for this run only: tell torch which stream uses it
                self._stream_held |= hold_for_stream(bound, self._stream)
            low = bound.descriptors(plan, self._buffers.reserve(plan.num_ranges))
            self._check_calls(low)
            self._inflight = [t for t in self._inflight if not _finished(t)]
            return self._submit(plan, bound, low, stream, on_device)

    def _submit(self, plan: TransferPlan, bound: BoundMemory, low: Lowered, stream: Stream,
                after: list[Transfer]) -> DmaTransfer:
        rt, s = self.runtime, int(self._stream or 0)  # open: run checked it under the lock
        with rt.current():  # the caller's current device/context is restored afterwards
            compute = stream_handle(stream, rt.device)
            events: list[int] = []
            try:  # every event made is destroyed with the transfer, even if a later create fails
                for _ in range(3 + max(low.num_calls - 1, 0)):
                    events.append(rt.event_create())
            except ExecutorError:
                _destroy_events(rt, tuple(events))
                raise
            ready, start, end = events[:3]
            marks = (*events[3:], end)  # marks[i] completes with call i (calls complete in order on the stream)
            transfer = DmaTransfer(nbytes=low.total_bytes, ranges=plan.num_ranges, calls=low.num_calls,
                                   domain=rt.domain, runtime=rt, start=start, end=end, marks=marks,
                                   keep=tuple(bound.owners()))
            weakref.finalize(transfer, _destroy_events, rt, tuple(events))
            check(rt, rt.event_record(ready, compute), "event record (compute stream)")
            check(rt, rt.stream_wait_event(s, ready), "stream wait (compute stream)")
            if self._last is not None:
                check(rt, rt.stream_wait_event(s, self._last.end), "stream wait (previous transfer)")
            for t in after:  # transfers of this driver: ordered on the device
                t.stream_wait(s)
            check(rt, rt.event_record(start, s), "event record (start)")
            try:
                if plan.api in BATCH_APIS:
                    self._issue_batches(plan, low, marks)
                else:
                    self._issue_per_range(plan, low, marks)
            finally:  # successors must order after whatever was issued, even on failure
                rt.event_record(end, s)
                self._last = transfer
                self._inflight.append(transfer)
        return transfer

    def _issue_batches(self, plan: TransferPlan, low: Lowered, marks: tuple[int, ...]) -> None:
        rt, s = self.runtime, int(self._stream or 0)  # open: run checked it under the lock
        sizes = low.nbytes  # uint64 == size_t on the 64-bit platforms drivers support; the sizes checked
        src_p, dst_p, size_p = low.src.ctypes.data, low.dst.ctypes.data, sizes.ctypes.data
        table = attribute_records(plan.attrs) if plan.passes_attrs else None
        for c, (lo, hi) in enumerate(low.calls()):
            attrs = idxs = None
            num_attrs = 0
            if table is not None:
                ids, starts = low.call_attrs(c)
                attrs, idxs, num_attrs = table[ids], starts.astype(np.uint64), len(ids)
            self._fail_idx.value = SIZE_MAX
            code = rt.batch(plan.api, dst_p + 8 * lo, src_p + 8 * lo, size_p + 8 * lo, hi - lo,
                            None if attrs is None else attrs.ctypes.data, None if idxs is None else idxs.ctypes.data,
                            num_attrs, self._fail_idx, s)
            if code:
                local = self._fail_idx.value if plan.api is not CopyApi.CUDA_BATCH_V2 else SIZE_MAX
                raise _call_error(rt, plan, lo, c, code, None if local >= hi - lo else lo + local)
            _mark_call(rt, marks, c, s)

    def _issue_per_range(self, plan: TransferPlan, low: Lowered, marks: tuple[int, ...]) -> None:
        """Below the batch APIs: one cuMemcpyAsync/hipMemcpyAsync per range, in plan order on the same stream,
        so completion, ordering and error reporting are what the batch path gives."""
        rt, s = self.runtime, int(self._stream or 0)  # open: run checked it under the lock
        d_all, s_all, n_all = low.dst.tolist(), low.src.tolist(), low.nbytes.tolist()
        copy = rt.copy
        for c, (lo, hi) in enumerate(low.calls()):
            for i in range(lo, hi):
                code = copy(d_all[i], s_all[i], n_all[i], s)
                if code:
                    raise _call_error(rt, plan, lo, c, code, i)
            _mark_call(rt, marks, c, s)


def _mark_call(rt: Runtime, marks: tuple[int, ...], call: int, stream: int) -> None:
    """Record the event that says call ``call`` is done (the last call's is the transfer's end event)."""
    if call < len(marks) - 1:
        code = rt.event_record(marks[call], stream)
        if code:  # calls 0..call were issued; the copies themselves may still complete
            raise ExecutorError(f"event record (end of call {call})", call + 1, None,
                                f"{rt.error_name(code)} ({code})", call + 1)


def _call_error(rt: Runtime, plan: TransferPlan, lo: int, call: int, code: int, descriptor: int | None) -> ExecutorError:
    where = ("" if descriptor is None else
             f"; descriptor {descriptor} is index {descriptor - lo} of the call, the descriptors before it may have been copied")
    if descriptor is None and plan.api is CopyApi.CUDA_BATCH_V2:
        where = "; the 13.0 ABI reports no failing descriptor"
    return ExecutorError(plan.api.value, call, descriptor, f"{rt.error_name(code)} ({code}){where}", call)


def _finished(t: DmaTransfer) -> bool:
    """True once ``t`` no longer touches memory: done, or failed (its error is raised to its owner, not here)."""
    try:
        return t.done()
    except ExecutorError:
        return True


def _query(rt: Runtime, event: int) -> bool:
    code = rt.event_query(event)
    if code == NOT_READY:
        return False
    check(rt, code, "event query")
    return True


def _destroy_events(rt: Runtime, events: tuple[int, ...]) -> None:
    for e in events:  # destroying a pending event is legal: the driver frees it once it completes
        rt.event_destroy(e)
