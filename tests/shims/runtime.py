"""Host-memory Runtimes over the C shims (fake_cuda.c, fake_hip.c): what tests pass to the DMA executors'
constructors. Every call goes through ctypes into the shim, which copies with memmove and records what it
was given; "device" buffers are host memory, so any location is accepted."""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p
from pathlib import Path
from typing import Any

from kvxfer.executors import ExecutorError
from kvxfer.planner import CopyApi, Platform

BATCH_V12080 = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t,
                                POINTER(c_size_t), c_void_p)
BATCH_V13000 = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_void_p)
MEMCPY_ASYNC = ctypes.CFUNCTYPE(c_int, c_uint64, c_uint64, c_size_t, c_void_p)
HANDLE_CREATE = ctypes.CFUNCTYPE(c_int, POINTER(c_void_p), c_uint)
EVENT_RECORD = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)
STREAM_WAIT = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_uint)
ONE_HANDLE = ctypes.CFUNCTYPE(c_int, c_void_p)
ELAPSED = ctypes.CFUNCTYPE(c_int, POINTER(c_float), c_void_p, c_void_p)
ERROR_NAME = ctypes.CFUNCTYPE(c_int, c_int, POINTER(c_char_p))


class ShimRuntime:
    """What both shims share: handle-creating calls, the no-op context, any memory location."""

    device = 0
    _stream_create: Any
    _event_create: Any
    _stream_wait: Any
    _elapsed: Any

    def _create(self, fn: Any, call: str) -> int:
        h = c_void_p()
        code = fn(byref(h), 1)
        if code:
            raise ExecutorError(call, 0, None, f"{self.error_name(code)} ({code})", 0)
        return h.value or 0

    def stream_create(self) -> int:
        return self._create(self._stream_create, "stream create")

    def event_create(self) -> int:
        return self._create(self._event_create, "event create")

    def stream_wait_event(self, stream: int, event: int) -> int:
        return self._stream_wait(stream, event, 0)

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        ms = c_float()
        return self._elapsed(byref(ms), start, end), ms.value

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        yield

    def check_memory(self, buf: Any, mem: Any) -> None:
        """Host memory stands in for device memory here."""

    def close(self) -> None:
        pass

    def error_name(self, code: int) -> str:
        raise NotImplementedError


class ShimCudaRuntime(ShimRuntime):
    """The CUDA driver as the shim fakes it, reporting ``version``; entry points come from its cuGetProcAddress."""

    platform = Platform.CUDA

    def __init__(self, path: str | Path, version: int):
        self.lib = ctypes.CDLL(str(path))
        self.domain = f"shim:{path}"  # the shim's handles mean something to this library only
        ctypes.c_long.in_dll(self.lib, "shim_version").value = int(version)
        self._proc = self.lib.fake_cuGetProcAddress
        self._proc.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, c_void_p]
        v = c_int()
        code = self.lib.fake_cuDriverGetVersion(byref(v))
        if code:
            raise ExecutorError("cuDriverGetVersion", 0, None, f"error {code}", 0)
        self.version = v.value
        basic = min(self.version, 12080)

        def need(symbol: str, proto: Any, abi: int = basic) -> Any:
            p = self._get(symbol, abi)
            if not p:
                raise ExecutorError(symbol, 0, None, f"cuGetProcAddress returned NULL (driver {self.version})", 0)
            return proto(p)

        self._batch = {}
        for api, abi, proto in ((CopyApi.CUDA_BATCH_V2, 13000, BATCH_V13000), (CopyApi.CUDA_BATCH, 12080, BATCH_V12080)):
            p = self._get("cuMemcpyBatchAsync", abi) if self.version >= abi else 0
            if p:
                self._batch[api] = proto(p)
        self._stream_create = need("cuStreamCreate", HANDLE_CREATE)
        self.stream_destroy = need("cuStreamDestroy", ONE_HANDLE)
        self.copy = need("cuMemcpyAsync", MEMCPY_ASYNC)
        self._event_create = need("cuEventCreate", HANDLE_CREATE)
        self.event_destroy = need("cuEventDestroy", ONE_HANDLE)
        self.event_record = need("cuEventRecord", EVENT_RECORD)
        self._stream_wait = need("cuStreamWaitEvent", STREAM_WAIT)
        self.event_query = need("cuEventQuery", ONE_HANDLE)
        self.event_synchronize = need("cuEventSynchronize", ONE_HANDLE)
        self._elapsed = need("cuEventElapsedTime", ELAPSED)
        self._error_name = need("cuGetErrorName", ERROR_NAME, min(self.version, 6000))

    def _get(self, symbol: str, abi: int) -> int:
        p = c_void_p()
        return (p.value or 0) if self._proc(symbol.encode(), byref(p), abi, 0, None) == 0 else 0

    def api_available(self, api: CopyApi) -> bool:
        return api is CopyApi.CUDA_PER_RANGE or api in self._batch

    def batch(self, api, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream) -> int:
        fn = self._batch[api]
        if api is CopyApi.CUDA_BATCH_V2:
            return fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream)
        return fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream)

    def error_name(self, code: int) -> str:
        name = c_char_p()
        return name.value.decode() if self._error_name(code, byref(name)) == 0 and name.value else f"CUresult {code}"


def _declare(lib: ctypes.CDLL, name: str, argtypes: list[Any], restype: Any = c_int) -> Any:
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = argtypes, restype
    return fn


class ShimHipRuntime(ShimRuntime):
    """The HIP runtime as the shim fakes it (the version is whatever the test set in ``shim_version``)."""

    platform = Platform.ROCM

    def __init__(self, path: str | Path):
        lib = self.lib = ctypes.CDLL(str(path))
        self.domain = f"shim:{path}"
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
        v = c_int(0)
        self.version = v.value if _declare(lib, "hipRuntimeGetVersion", [POINTER(c_int)])(byref(v)) == 0 else 0
        self._batch = _declare(lib, "hipMemcpyBatchAsync", [c_void_p, c_void_p, c_void_p, c_size_t, c_void_p,
                                                            c_void_p, c_size_t, POINTER(c_size_t), c_void_p])

    def api_available(self, api: CopyApi) -> bool:
        return api in (CopyApi.HIP_PER_RANGE, CopyApi.HIP_BATCH)

    def batch(self, api, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream) -> int:
        return self._batch(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream)

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        return self._copy(dst, src, nbytes, 4, stream)  # hipMemcpyDefault

    def error_name(self, code: int) -> str:
        name = self._error_name(code)
        return name.decode() if name else f"hipError_t {code}"
