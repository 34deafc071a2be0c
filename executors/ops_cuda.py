"""CUDA batch executor: each planned call is one cuMemcpyBatchAsync through a ctypes function pointer
(13.0 ABI without failIdx, or 12.8 ABI with it), or per-range cuMemcpyAsync when the plan targets a driver
below 12.8.

Driver access goes through a small provider resolved in the constructor: ``CudaDriver`` uses cuda-bindings
for init, version, context, streams and cuGetProcAddress; ``ShimDriver`` loads a host-memory stand-in (a C
library exporting ``fake_cu*`` entry points, see tests/shims/fake_cuda.c) so the executor runs end to end
without a GPU. Entry points are resolved once, on the instance; a NULL pointer means "unavailable".
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import POINTER, byref, c_char_p, c_float, c_int, c_size_t, c_uint, c_uint64, c_void_p
from pathlib import Path
from typing import Any

from kvxfer.planner import CopyApi, Platform

from .base import ExecutorError
from .dma import DmaExecutor, Runtime

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

CU_STREAM_NON_BLOCKING = 1


class CudaDriver:
    """The real driver through cuda-bindings: cuInit, the device's primary context, streams, cuGetProcAddress."""

    host_as_device = False

    def __init__(self, device: int = 0):
        try:
            from cuda.bindings import driver as cu
        except ImportError as e:
            raise ImportError(f"the CUDA batch executor needs cuda-bindings: pip install 'kvxfer[cuda]' ({e})") from None
        self._cu = cu
        try:
            self._ok(cu.cuInit(0), "cuInit")
        except ExecutorError:
            raise
        except Exception as e:  # cuda-bindings raises when libcuda.so itself is missing
            raise ExecutorError("cuInit", 0, None, f"no CUDA driver could be loaded ({e})", 0) from None
        self.version = int(self._ok(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        self.ordinal = device
        self._device = self._ok(cu.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = self._ok(cu.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._streams: dict[int, Any] = {}

    def _ok(self, result: Any, call: str) -> Any:
        err, *rest = result if isinstance(result, tuple) else (result,)
        if int(err) != 0:
            _, name = self._cu.cuGetErrorName(err)
            raise ExecutorError(call, 0, None, f"{name.decode() if name else 'unknown'} ({int(err)})", 0)
        return rest[0] if len(rest) == 1 else tuple(rest) or None

    def get_proc(self, symbol: str, abi_version: int) -> int:
        cu = self._cu
        res = cu.cuGetProcAddress(symbol.encode(), abi_version, cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        return int(res[1]) if int(res[0]) == 0 and res[1] else 0

    def close(self) -> None:
        """Release the primary context retained by the constructor (once)."""
        if self._ctx is not None:
            self._cu.cuDevicePrimaryCtxRelease(self._device)
            self._ctx = None

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Push the device's primary context for the block and pop it after, so the caller's stays current."""
        self._ok(self._cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._cu.cuCtxPopCurrent()

    def stream_create(self) -> int:
        s = self._ok(self._cu.cuStreamCreate(CU_STREAM_NON_BLOCKING), "cuStreamCreate")
        self._streams[int(s)] = s
        return int(s)

    def stream_destroy(self, handle: int) -> int:
        s = self._streams.pop(handle, None)
        return 0 if s is None else int(self._cu.cuStreamDestroy(s)[0])


class ShimDriver:
    """A host-memory stand-in for the driver: a C library exporting ``fake_cuGetProcAddress``,
    ``fake_cuDriverGetVersion`` and the fakes they resolve. ``version`` overrides the version it reports."""

    host_as_device = True

    def __init__(self, path: str | Path, version: int | None = None):
        try:
            self.lib = ctypes.CDLL(str(path))
            proc = self.lib.fake_cuGetProcAddress
        except (OSError, AttributeError) as e:
            raise ExecutorError("dlopen", 0, None, f"cannot load CUDA shim {str(path)!r}: {e}", 0) from None
        if version is not None:
            ctypes.c_long.in_dll(self.lib, "shim_version").value = int(version)
        proc.argtypes = [c_char_p, POINTER(c_void_p), c_int, c_uint64, c_void_p]
        self._proc = proc
        v = c_int()
        code = self.lib.fake_cuDriverGetVersion(byref(v))
        if code:
            raise ExecutorError("cuDriverGetVersion", 0, None, f"error {code}", 0)
        self.version = v.value
        create = self.get_proc("cuStreamCreate", 2000)
        if self.version < 2000 or not create:
            raise ExecutorError("cuDriverGetVersion", 0, None, f"the shim reports driver version {self.version}: pass "
                                "version= (or set KVXFER_SHIM_VERSION), e.g. 13000", 0)
        self._stream_create = HANDLE_CREATE(create)

    def get_proc(self, symbol: str, abi_version: int) -> int:
        p = c_void_p()
        return (p.value or 0) if self._proc(symbol.encode(), byref(p), abi_version, 0, None) == 0 else 0

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        yield  # host memory: no context

    def stream_create(self) -> int:
        s = c_void_p()
        code = self._stream_create(byref(s), CU_STREAM_NON_BLOCKING)
        if code:
            raise ExecutorError("cuStreamCreate", 0, None, f"error {code}", 0)
        return s.value or 0

    def stream_destroy(self, handle: int) -> int:
        return 0


class CudaRuntime(Runtime):
    """The driver entry points the executor calls, resolved once through ``driver.get_proc``."""

    platform = Platform.CUDA

    def __init__(self, driver: CudaDriver | ShimDriver):
        self.driver = driver
        self.version = driver.version
        self.host_as_device = driver.host_as_device
        self.device = getattr(driver, "ordinal", 0)
        basic = min(self.version, 12080)  # ABI of the non-batch calls; never above what the driver has

        def need(symbol: str, proto: Any, abi: int = basic) -> Any:
            p = driver.get_proc(symbol, abi)
            if not p:
                raise ExecutorError(symbol, 0, None, f"cuGetProcAddress returned NULL (driver {self.version})", 0)
            return proto(p)

        self._batch: dict[CopyApi, Any] = {}
        for api, abi, proto in ((CopyApi.CUDA_BATCH_V2, 13000, BATCH_V13000), (CopyApi.CUDA_BATCH, 12080, BATCH_V12080)):
            p = driver.get_proc("cuMemcpyBatchAsync", abi) if self.version >= abi else 0
            if p:
                self._batch[api] = proto(p)
        self.copy = need("cuMemcpyAsync", MEMCPY_ASYNC)
        self._event_create = need("cuEventCreate", HANDLE_CREATE)
        self.event_destroy = need("cuEventDestroy", ONE_HANDLE)
        self.event_record = need("cuEventRecord", EVENT_RECORD)
        self._stream_wait = need("cuStreamWaitEvent", STREAM_WAIT)
        self.event_query = need("cuEventQuery", ONE_HANDLE)
        self.event_synchronize = need("cuEventSynchronize", ONE_HANDLE)
        self._elapsed = need("cuEventElapsedTime", ELAPSED)
        self._error_name = need("cuGetErrorName", ERROR_NAME, min(self.version, 6000))

    def api_available(self, api: CopyApi) -> bool:
        return api is CopyApi.CUDA_PER_RANGE or api in self._batch

    def batch(self, api, dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, fail_idx, stream) -> int:
        fn = self._batch[api]
        if api is CopyApi.CUDA_BATCH_V2:
            return fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream)
        return fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream)

    def current(self) -> contextlib.AbstractContextManager[None]:
        return self.driver.current()

    def stream_create(self) -> int:
        return self.driver.stream_create()

    def stream_destroy(self, stream: int) -> int:
        return self.driver.stream_destroy(stream)

    def error_name(self, code: int) -> str:
        name = c_char_p()
        return name.value.decode() if self._error_name(code, byref(name)) == 0 and name.value else f"CUresult {code}"


class CudaBatchExecutor(DmaExecutor):
    """Runs plans for ``cuda-*`` targets. ``driver``: a CudaDriver (default, device ``device``) or ShimDriver."""

    name = "cuda-batch"

    def __init__(self, driver: CudaDriver | ShimDriver | None = None, *, device: int = 0,
                 max_descriptors: int | None = None):
        self._own_driver = driver is None  # a driver made here is closed (context released) with the executor
        super().__init__(CudaRuntime(driver if driver is not None else CudaDriver(device)),
                         max_descriptors=max_descriptors)

    def close(self) -> None:
        super().close()
        if self._own_driver:
            self.runtime.driver.close()
            self._own_driver = False

    @classmethod
    def from_config(cls, config: Any) -> CudaBatchExecutor:
        o = config.cuda
        driver = ShimDriver(o.driver_lib, o.driver_version) if o.driver_lib else None
        return cls(driver, device=o.device, max_descriptors=config.max_descriptors)
