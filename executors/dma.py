"""What the CUDA and HIP batch executors share: the 24-byte attribute record, the runtime calls they need,
and the lowering of a plan onto a copy stream (descriptor arrays, attributes, events, stream order).

The backend files (ops_cuda.py, ops_hip.py) only bind a ``Runtime`` to their driver's entry points.
"""
from __future__ import annotations

import contextlib
import ctypes
import sys
import weakref
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from kvxfer.planner import CopyApi, CopyAttributes, PlanError, Platform, Target, TransferPlan

from .base import Bound, Buffer, Executor, ExecutorError, Transfer, bind_addresses, check_location, check_plan_target

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


def stream_handle(stream: Any, device: int = 0) -> int:
    """A raw stream handle from None (torch's current stream on ``device`` when torch has initialized a GPU,
    else the legacy default stream 0), an int, a torch stream (``cuda_stream``) or a cuda-bindings CUstream."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream(device).cuda_stream)
        return 0
    handle = getattr(stream, "cuda_stream", stream)
    try:
        return int(handle)
    except (TypeError, ValueError):
        raise TypeError(f"stream = {stream!r}: expected None, an int handle, a torch stream or a CUstream") from None


class Runtime:
    """The runtime calls a DMA executor issues. Subclasses bind them to a driver; methods return raw codes.

    ``platform``/``version`` describe what was found; ``host_as_device`` marks host-memory stand-ins (shims)
    whose "device" buffers are host memory. ``api_available(api)`` says whether an entry point resolved.
    """

    platform: Platform
    version: int
    device: int = 0  # ordinal of the device the executor copies on
    host_as_device: bool = False

    def api_available(self, api: CopyApi) -> bool: raise NotImplementedError
    def batch(self, api: CopyApi, dsts: int, srcs: int, sizes: int, count: int, attrs: int | None,
              attrs_idxs: int | None, num_attrs: int, fail_idx: Any, stream: int) -> int: raise NotImplementedError
    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int: raise NotImplementedError
    def stream_create(self) -> int: raise NotImplementedError
    def stream_destroy(self, stream: int) -> int: raise NotImplementedError
    def event_destroy(self, event: int) -> int: raise NotImplementedError
    def event_record(self, event: int, stream: int) -> int: raise NotImplementedError
    def event_query(self, event: int) -> int: raise NotImplementedError
    def event_synchronize(self, event: int) -> int: raise NotImplementedError

    # CUDA's driver and HIP's runtime share these C signatures; subclasses set the three ctypes functions:
    # _event_create(event*, flags), _stream_wait(stream, event, flags), _elapsed(float*, start, end).
    def event_create(self) -> int:
        e = ctypes.c_void_p()
        self.check(self._event_create(ctypes.byref(e), 0), "event create")
        return e.value

    def stream_wait_event(self, stream: int, event: int) -> int:
        return self._stream_wait(stream, event, 0)

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        ms = ctypes.c_float()
        return self._elapsed(ctypes.byref(ms), start, end), ms.value

    def error_name(self, code: int) -> str: raise NotImplementedError
    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Make the runtime's device current on this thread for the block, then restore the caller's."""
        yield

    def check(self, code: int, call: str) -> None:
        """Raise ExecutorError for a failed stream/event call (one that issues no copies)."""
        if code:
            raise ExecutorError(call, 0, None, f"{self.error_name(code)} ({code})", 0)


class DescriptorBuffers:
    """Reused address arrays (uint64) for the descriptors of one plan; they grow, never shrink."""

    def __init__(self) -> None:
        self.src = np.zeros(0, dtype=np.uint64)
        self.dst = np.zeros(0, dtype=np.uint64)

    def reserve(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if len(self.src) < n:
            size = max(n, 2 * len(self.src), 1024)
            self.src, self.dst = np.empty(size, dtype=np.uint64), np.empty(size, dtype=np.uint64)
        return self.src, self.dst


class DmaExecutor(Executor):
    """Runs a plan with the driver's copy engines, one driver call per planned call.

    Copies go on the executor's own copy stream. Each run first makes that stream wait for the caller's
    compute stream (``stream``; stores read the live cache, loads overwrite blocks that may still be being
    zeroed) and for the end of the previous run, then records start/end events for timing. ``max_descriptors``
    refuses plans whose calls exceed a runtime limit (ROCm faults above 8,192), 0/None = no limit.
    """

    def __init__(self, runtime: Runtime, *, max_descriptors: int | None = None):
        self.runtime = runtime
        self.max_descriptors = max_descriptors or None
        self._buffers = DescriptorBuffers()
        self._fail_idx = ctypes.c_size_t(SIZE_MAX)
        self._last: Transfer | None = None
        self._inflight: list[Transfer] = []  # keeps bound memory alive until the copies finish
        with runtime.current():
            self._stream = runtime.stream_create()

    @property
    def target(self) -> Target:
        return Target(platform=self.runtime.platform, runtime_version=self.runtime.version)

    def close(self) -> None:
        if self._stream is not None:
            if self._last is not None:
                self._last.wait()
            with self.runtime.current():
                self.runtime.stream_destroy(self._stream)
            self._stream = None

    def _check_memory(self, buf: Buffer, bound: Bound) -> None:
        check_location(buf, bound, host_as_device=self.runtime.host_as_device)

    def _check_plan(self, plan: TransferPlan) -> None:
        check_plan_target(plan, self.target)
        if not self.runtime.api_available(plan.api):
            raise ExecutorError(plan.api.value, 0, None, f"the {self.target.label} runtime returned no entry point "
                                "for it (NULL: unavailable in this driver)", 0)
        cap = self.max_descriptors
        if cap and plan.num_calls and int(plan.call_sizes.max()) > cap:
            i = int(np.argmax(plan.call_sizes > cap))
            raise PlanError("call_sizes", int(plan.call_sizes[i]), f"call {i} exceeds this executor's cap of {cap} "
                            f"descriptors per call; re-plan with PlanOptions(max_descriptors<={cap})", i)

    def run(self, plan: TransferPlan, bindings: Mapping[str, Any], stream: Any = None) -> Transfer:
        """Issue every call of ``plan``; returns at once. Raises TargetMismatchError, BindingError or
        PlanError before anything is issued, ExecutorError (naming call, chunk, descriptor and what was
        already issued) when the driver fails."""
        if self._stream is None:
            raise ExecutorError("run", 0, None, "the executor was closed", 0)
        self._check_plan(plan)
        addrs = bind_addresses(plan, bindings, self._check_memory, self._buffers.reserve(plan.num_ranges))
        rt = self.runtime
        self._inflight = [t for t in self._inflight if not _finished(t)]
        with rt.current():  # the caller's current device/context is restored afterwards
            compute = stream_handle(stream, rt.device)
            events: list[int] = []
            try:  # every event made is destroyed with the transfer, even if a later create fails
                for _ in range(3 + max(plan.num_calls - 1, 0)):
                    events.append(rt.event_create())
            except ExecutorError:
                _destroy_events(rt, tuple(events))
                raise
            ready, start, end = events[:3]
            # marks[i] completes with call i (calls complete in order on the copy stream); the last is ``end``
            marks = events[3:] + [end]
            transfer = Transfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls,
                                _keep=([b.owner for b in addrs.bound if b is not None], tuple(events)))
            weakref.finalize(transfer, _destroy_events, rt, tuple(events))
            rt.check(rt.event_record(ready, compute), "event record (compute stream)")
            rt.check(rt.stream_wait_event(self._stream, ready), "stream wait (compute stream)")
            if self._last is not None:
                rt.check(rt.stream_wait_event(self._stream, self._last._keep[1][2]), "stream wait (previous transfer)")
            rt.check(rt.event_record(start, self._stream), "event record (start)")
            transfer._poll = lambda: _query(rt, end)
            transfer._wait = lambda: _finish(rt, start, end)
            transfer._call_poll = lambda i: _query(rt, marks[i])
            transfer._call_wait = lambda i: rt.check(rt.event_synchronize(marks[i]), "event synchronize (call)")
            transfer._stream_wait = lambda s, i: rt.check(rt.stream_wait_event(stream_handle(s, rt.device), marks[i]),
                                                          "stream wait (consumer)")
            try:
                self._issue(plan, addrs.src, addrs.dst, marks)
            finally:  # successors must order after whatever was issued, even on failure
                rt.event_record(end, self._stream)
                self._last = transfer
                self._inflight.append(transfer)
        return transfer

    def _issue(self, plan: TransferPlan, src: np.ndarray, dst: np.ndarray, marks: list[int]) -> None:
        rt, s = self.runtime, self._stream
        if plan.api not in BATCH_APIS:
            self._issue_per_range(plan, src, dst, marks)
            return
        sizes = plan.nbytes  # uint64 == size_t on the 64-bit platforms drivers support
        src_p, dst_p, size_p = src.ctypes.data, dst.ctypes.data, sizes.ctypes.data
        table = attribute_records(plan.attrs) if plan.passes_attrs else None
        for c in range(plan.num_calls):
            lo, hi = int(plan.call_offsets[c]), int(plan.call_offsets[c + 1])
            attrs = idxs = None
            num_attrs = 0
            if table is not None:
                ids, starts = plan.attr_runs(c)
                attrs, idxs, num_attrs = table[ids], starts.astype(np.uint64), len(ids)
            self._fail_idx.value = SIZE_MAX
            code = rt.batch(plan.api, dst_p + 8 * lo, src_p + 8 * lo, size_p + 8 * lo, hi - lo,
                            None if attrs is None else attrs.ctypes.data, None if idxs is None else idxs.ctypes.data,
                            num_attrs, self._fail_idx, s)
            if code:
                local = self._fail_idx.value if plan.api is not CopyApi.CUDA_BATCH_V2 else SIZE_MAX
                raise _call_error(rt, plan, c, code, None if local >= hi - lo else lo + local)
            _mark_call(rt, marks, c, s)

    def _issue_per_range(self, plan: TransferPlan, src: np.ndarray, dst: np.ndarray, marks: list[int]) -> None:
        """Below the batch APIs: one cuMemcpyAsync/hipMemcpyAsync per range, in plan order on the same stream,
        so completion, ordering and error reporting are what the batch path gives."""
        rt, s = self.runtime, self._stream
        d_all, s_all, n_all = dst[:plan.num_ranges].tolist(), src[:plan.num_ranges].tolist(), plan.nbytes.tolist()
        copy = rt.copy
        for c in range(plan.num_calls):
            lo, hi = int(plan.call_offsets[c]), int(plan.call_offsets[c + 1])
            for i in range(lo, hi):
                code = copy(d_all[i], s_all[i], n_all[i], s)
                if code:
                    raise _call_error(rt, plan, c, code, i)
            _mark_call(rt, marks, c, s)


def _mark_call(rt: Runtime, marks: list[int], call: int, stream: int) -> None:
    """Record the event that says call ``call`` is done (the last call's is the transfer's end event)."""
    if call < len(marks) - 1:
        code = rt.event_record(marks[call], stream)
        if code:  # calls 0..call were issued; the copies themselves may still complete
            raise ExecutorError(f"event record (end of call {call})", call + 1, None,
                                f"{rt.error_name(code)} ({code})", call + 1)


def _call_error(rt: Runtime, plan: TransferPlan, call: int, code: int, descriptor: int | None) -> ExecutorError:
    lo = int(plan.call_offsets[call])
    where = ("" if descriptor is None else
             f"; descriptor {descriptor} is index {descriptor - lo} of the call, the descriptors before it may have been copied")
    if descriptor is None and plan.api is CopyApi.CUDA_BATCH_V2:
        where = "; the 13.0 ABI reports no failing descriptor"
    return ExecutorError(plan.api.value, call, descriptor, f"{rt.error_name(code)} ({code}){where}", call)


def _finished(t: Transfer) -> bool:
    """True once ``t`` no longer touches memory: done, or failed (its error is raised to its owner, not here)."""
    try:
        return t.done()
    except ExecutorError:
        return True


def _query(rt: Runtime, end: int) -> bool:
    code = rt.event_query(end)
    if code == NOT_READY:
        return False
    rt.check(code, "event query")
    return True


def _finish(rt: Runtime, start: int, end: int) -> float:
    rt.check(rt.event_synchronize(end), "event synchronize")
    code, ms = rt.event_elapsed_ms(start, end)
    rt.check(code, "event elapsed time")
    return ms / 1e3


def _destroy_events(rt: Runtime, events: tuple[int, ...]) -> None:
    for e in events:  # destroying a pending event is legal: the driver frees it once it completes
        rt.event_destroy(e)
