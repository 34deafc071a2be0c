"""HIP batch executor: each planned call is one hipMemcpyBatchAsync through ctypes on libamdhip64, with
numAttrs and flags exactly as the plan says; per-range hipMemcpyAsync when the plan targets ROCm below 7.1.

hip-python mis-declares hipMemcpyBatchAsync (``sizes`` as a scalar, arrays as outputs), so the library is
called directly. ``library`` overrides the search (tests load the fake runtime of tests/shims/fake_hip.c).
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_void_p
from pathlib import Path
from typing import Any

from kvxfer.planner import CopyApi, Platform
from kvxfer.planner.target import HIP_MAX_DESCRIPTORS

from .base import ExecutorError
from .dma import DmaExecutor, Runtime

HIP_LIBRARIES = ("libamdhip64.so", "libamdhip64.so.7", "libamdhip64.so.6")  # only devel installs ship the first
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


def _declare(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any = c_int) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class HipRuntime(Runtime):
    """libamdhip64's entry points, declared once. ``host_as_device`` marks a host-memory stand-in."""

    platform = Platform.ROCM

    def __init__(self, library: str | Path | None = None, *, device: int = 0, host_as_device: bool = False):
        lib = self.lib = load_hip(library)
        self.device, self.host_as_device = device, host_as_device
        try:
            self._set_device = _declare(lib, "hipSetDevice", [c_int])
            self._get_device = _declare(lib, "hipGetDevice", [POINTER(c_int)])
            self._error_name = _declare(lib, "hipGetErrorName", [c_int], c_char_p)
            self._copy = _declare(lib, "hipMemcpyAsync", [c_void_p, c_void_p, c_size_t, c_int, c_void_p])
            self._stream_create = _declare(lib, "hipStreamCreateWithFlags", [POINTER(c_void_p), c_uint])
            self.stream_destroy = _declare(lib, "hipStreamDestroy", [c_void_p])
            self._event_create = _declare(lib, "hipEventCreateWithFlags", [POINTER(c_void_p), c_uint])
            self.event_destroy = _declare(lib, "hipEventDestroy", [c_void_p])
            self.event_record = _declare(lib, "hipEventRecord", [c_void_p, c_void_p])
            self._stream_wait = _declare(lib, "hipStreamWaitEvent", [c_void_p, c_void_p, c_uint])
            self.event_query = _declare(lib, "hipEventQuery", [c_void_p])
            self.event_synchronize = _declare(lib, "hipEventSynchronize", [c_void_p])
            self._elapsed = _declare(lib, "hipEventElapsedTime", [POINTER(c_float), c_void_p, c_void_p])
            get_version = _declare(lib, "hipRuntimeGetVersion", [POINTER(c_int)])
        except AttributeError as e:
            raise ExecutorError("dlsym", 0, None, f"the HIP runtime lacks an entry point kvxfer needs: {e}", 0) from None
        v = c_int(0)
        self.version = v.value if get_version(byref(v)) == 0 else 0  # unknown counts as the oldest runtime
        try:
            self._batch = _declare(lib, "hipMemcpyBatchAsync", [c_void_p, c_void_p, c_void_p, c_size_t, c_void_p,
                                                                c_void_p, c_size_t, POINTER(c_size_t), c_void_p])
        except AttributeError:  # ROCm before 7.1
            self._batch = None

    def api_available(self, api: CopyApi) -> bool:
        return api is CopyApi.HIP_PER_RANGE or (api is CopyApi.HIP_BATCH and self._batch is not None)

    def batch(self, api, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream) -> int:
        return self._batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        return self._copy(dst, src, nbytes, HIP_MEMCPY_DEFAULT, stream)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Select the executor's device for the block, then give the caller back the device it had."""
        prev = c_int(self.device)
        known = self._get_device(byref(prev)) == 0
        self.check(self._set_device(self.device), "hipSetDevice")
        try:
            yield
        finally:
            if known and prev.value != self.device:
                self._set_device(prev.value)

    def stream_create(self) -> int:
        s = c_void_p()
        self.check(self._stream_create(byref(s), HIP_STREAM_NON_BLOCKING), "hipStreamCreateWithFlags")
        return s.value or 0

    def error_name(self, code: int) -> str:
        name = self._error_name(code)
        return name.decode() if name else f"hipError_t {code}"


class HipBatchExecutor(DmaExecutor):
    """Runs plans for ``rocm-*`` targets. Refuses calls above ``max_descriptors`` (default 8,192, where ROCm
    faults; 0 = no limit) before anything is issued."""

    name = "hip-batch"

    def __init__(self, library: str | Path | None = None, *, device: int = 0, host_as_device: bool = False,
                 max_descriptors: int | None = HIP_MAX_DESCRIPTORS):
        super().__init__(HipRuntime(library, device=device, host_as_device=host_as_device),
                         max_descriptors=max_descriptors)

    @classmethod
    def from_config(cls, config: Any) -> HipBatchExecutor:
        o = config.hip
        cap = HIP_MAX_DESCRIPTORS if config.max_descriptors is None else config.max_descriptors
        return cls(o.library, device=o.device, host_as_device=o.host_as_device, max_descriptors=cap)
