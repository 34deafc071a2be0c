"""HIP batch executor: each planned call is one hipMemcpyBatchAsync, with numAttrs and flags exactly as the
plan says; per-range hipMemcpyAsync when the plan targets ROCm below 7.1.

``HipRuntime`` uses hip-python for version, device, streams, events and the per-range copy. hip-python
mis-declares hipMemcpyBatchAsync (``sizes`` as a scalar, arrays as outputs), so that one call goes through
ctypes on libamdhip64 (``library`` overrides the search). Tests pass a host-memory runtime instead.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import POINTER, byref, c_int, c_size_t, c_void_p
from pathlib import Path
from typing import Any

from kvxfer.planner import Buffer, CopyApi, Platform, Target, import_optional

from ._base import ExecutorError
from ._dma import DmaExecutor, Runtime, driver_result
from ._memory import Memory, check_location
from ._options import HipOptions

HIP_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")  # only devel installs ship the first
HIP_MAX_DESCRIPTORS = Target(platform=Platform.ROCM).default_max_descriptors
HIP_MEMCPY_DEFAULT = 4
HIP_STREAM_NON_BLOCKING = 1


def load_hip(library: str | Path | None = None) -> ctypes.CDLL:
    """Load ``library``, or the first of HIP_LIBRARIES that loads. Raises ExecutorError naming every
    candidate and why it failed."""
    candidates = (str(library),) if library else HIP_LIBRARIES
    reasons = []
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError as e:
            reasons.append(f"{name}: {e}")
    raise ExecutorError("dlopen", 0, None, "could not load the HIP runtime; tried " + "; ".join(reasons), 0)


def declare_batch(lib: ctypes.CDLL) -> Any:
    """hipMemcpyBatchAsync with its C signature, or None on ROCm before 7.1 (no such symbol)."""
    try:
        fn = lib.hipMemcpyBatchAsync
    except AttributeError:
        return None
    fn.argtypes = [c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, POINTER(c_size_t), c_void_p]
    fn.restype = c_int
    return fn


class HipRuntime:
    """The HIP runtime on device ``device`` (a Runtime): hip-python, plus ctypes for the batch call."""

    platform = Platform.ROCM
    domain = "rocm"
    _batch: Any  # ctypes function (declare_batch), None before ROCm 7.1

    def __init__(self, library: str | Path | None = None, *, device: int = 0):
        self._batch = declare_batch(load_hip(library))
        hip = import_optional("hip.hip", "the HIP batch executor")
        self._hip, self.device = hip, device
        err, version = hip.hipRuntimeGetVersion()
        self.version = int(version) if int(err) == 0 else 0  # unknown counts as the oldest runtime

    def _ok(self, result: Any, call: str) -> Any:
        return driver_result(result, call, self.error_name)

    def error_name(self, code: Any) -> str:
        """hipGetErrorName for ``code``."""
        name = self._hip.hipGetErrorName(code)
        name = name[0] if isinstance(name, tuple) else name
        return name.decode() if isinstance(name, bytes) else str(name or f"hipError_t {int(code)}")

    def api_available(self, api: CopyApi) -> bool:
        """Per-range copies always; the batch call when libamdhip64 has hipMemcpyBatchAsync (ROCm 7.1+)."""
        return api is CopyApi.HIP_PER_RANGE or (api is CopyApi.HIP_BATCH and self._batch is not None)

    def batch(self, api: CopyApi, dsts: int, srcs: int, sizes: int, count: int, attrs: int | None,
              attrs_idxs: int | None, num_attrs: int, fail_idx: ctypes.c_size_t, stream: int) -> int:
        """hipMemcpyBatchAsync through ctypes."""
        return int(self._batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream))

    def _code(self, result: Any) -> int:
        return int(result[0] if isinstance(result, tuple) else result)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """hipMemcpyAsync (hipMemcpyDefault)."""
        return self._code(self._hip.hipMemcpyAsync(dst, src, nbytes, HIP_MEMCPY_DEFAULT, stream))

    def stream_create(self) -> int:
        """hipStreamCreateWithFlags (non-blocking)."""
        return int(self._ok(self._hip.hipStreamCreateWithFlags(HIP_STREAM_NON_BLOCKING), "hipStreamCreateWithFlags"))

    def stream_destroy(self, stream: int) -> int:
        """hipStreamDestroy."""
        return self._code(self._hip.hipStreamDestroy(stream))

    def event_create(self) -> int:
        """hipEventCreateWithFlags."""
        return int(self._ok(self._hip.hipEventCreateWithFlags(0), "hipEventCreateWithFlags"))

    def event_destroy(self, event: int) -> int:
        """hipEventDestroy."""
        return self._code(self._hip.hipEventDestroy(event))

    def event_record(self, event: int, stream: int) -> int:
        """hipEventRecord."""
        return self._code(self._hip.hipEventRecord(event, stream))

    def stream_wait_event(self, stream: int, event: int) -> int:
        """hipStreamWaitEvent."""
        return self._code(self._hip.hipStreamWaitEvent(stream, event, 0))

    def event_query(self, event: int) -> int:
        """hipEventQuery."""
        return self._code(self._hip.hipEventQuery(event))

    def event_synchronize(self, event: int) -> int:
        """hipEventSynchronize."""
        return self._code(self._hip.hipEventSynchronize(event))

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        """hipEventElapsedTime."""
        err, ms = self._hip.hipEventElapsedTime(start, end)
        return int(err), float(ms)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Select the executor's device for the block, then give the caller back the device it had."""
        err, prev = self._hip.hipGetDevice()
        self._ok(self._hip.hipSetDevice(self.device), "hipSetDevice")
        try:
            yield
        finally:
            if int(err) == 0 and int(prev) != self.device:
                self._hip.hipSetDevice(int(prev))

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Location check only: BindingError when the memory sits elsewhere (or on another device) than the buffer."""
        check_location(buf, mem)

    def close(self) -> None:
        """Nothing to release: HIP keeps no per-runtime context here."""


class HipBatchExecutor(DmaExecutor):
    """Runs plans for ``rocm-*`` targets on ``runtime`` (default: a HipRuntime on ``device``). Refuses calls
    above ``max_descriptors`` (default 8,192, where ROCm faults; 0 = no limit) before anything is issued."""

    def __init__(self, runtime: Runtime | None = None, *, device: int = 0, library: str | Path | None = None,
                 max_descriptors: int | None = HIP_MAX_DESCRIPTORS):
        super().__init__(runtime if runtime is not None else HipRuntime(library, device=device),
                         max_descriptors=max_descriptors, own_runtime=runtime is None)

    @classmethod
    def from_options(cls, options: HipOptions) -> HipBatchExecutor:
        """An executor on a new HipRuntime for ``options.device`` and ``options.library``; ``max_descriptors`` None means the
        ROCm default cap."""
        cap = HIP_MAX_DESCRIPTORS if options.max_descriptors is None else options.max_descriptors
        return cls(device=options.device, library=options.library, max_descriptors=cap)
