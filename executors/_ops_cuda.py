"""CUDA batch executor: each planned call is one cuMemcpyBatchAsync (13.0 ABI without failIdx, or 12.8 ABI
with it), or per-range cuMemcpyAsync when the plan targets a driver below 12.8.

``CudaRuntime`` uses cuda-bindings for init, version, context, streams and events. The copy entry points
(both batch ABIs and cuMemcpyAsync) are resolved with cuGetProcAddress and called through ctypes:
cuda-bindings' wrappers build one Python object per pointer, too slow for tens of thousands of descriptors. A
NULL entry point (older drivers return success with NULL) means "unavailable". Tests pass a host-memory
runtime instead.

The device's primary context is retained once and kept for the life of the process, as the CUDA runtime
does: a release that drops the last reference resets the context under every other user of the runtime API in
the process (torch among them), and nothing here can tell whether another reference exists.
"""
from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Iterator
from ctypes import POINTER, byref, c_int, c_size_t, c_void_p
from typing import Any

from kvxfer.planner import Buffer, CopyApi, Platform, import_optional

from ._base import ExecutorError
from ._dma import DmaExecutor, Runtime, driver_result
from ._memory import Memory, check_location
from ._options import CudaOptions

BATCH_V12080 = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t,
                                POINTER(c_size_t), c_void_p)
BATCH_V13000 = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p, c_void_p, c_size_t, c_void_p, c_void_p, c_size_t, c_void_p)
BATCH_ABIS = ((CopyApi.CUDA_BATCH_V2, 13000, BATCH_V13000), (CopyApi.CUDA_BATCH, 12080, BATCH_V12080))
MEMCPY_ASYNC = ctypes.CFUNCTYPE(c_int, ctypes.c_uint64, ctypes.c_uint64, c_size_t, c_void_p)
CU_STREAM_NON_BLOCKING = 1


class CudaRuntime:
    """The CUDA driver on device ``device`` (a Runtime): cuda-bindings for everything but the copy calls.

    ``version`` drives the runtime as an older driver (at most the installed one): 12080 uses the 12.8 batch
    ABI on a 13.x driver, anything below 12080 the per-range cuMemcpyAsync path. None: cuDriverGetVersion.
    Plans must then be made for ``executor.target``, which reports that version.
    """

    platform = Platform.CUDA
    domain = "cuda"  # events and streams of every CUDA context in the process order each other
    _batch: dict[CopyApi, Any]  # ctypes function pointers by ABI, only those the driver has

    def __init__(self, device: int = 0, *, version: int | None = None):
        cu = import_optional("cuda.bindings.driver", "the CUDA batch executor")
        self._cu = cu
        try:
            self._ok(cu.cuInit(0), "cuInit")
        except ExecutorError:
            raise
        except Exception as e:  # cuda-bindings raises when libcuda.so itself is missing
            raise ExecutorError("cuInit", 0, None, f"no CUDA driver could be loaded ({e})", 0) from None
        self.driver_version = int(self._ok(cu.cuDriverGetVersion(), "cuDriverGetVersion"))
        if version is not None and not 0 < int(version) <= self.driver_version:
            raise ValueError(f"version = {version}: must be a CUDA driver version in 1..{self.driver_version} "
                             f"(the installed driver's cuDriverGetVersion)")
        self.version = self.driver_version if version is None else int(version)
        self.device = device
        self._device = self._ok(cu.cuDeviceGet(device), "cuDeviceGet")
        self._ctx = self._ok(cu.cuDevicePrimaryCtxRetain(self._device), "cuDevicePrimaryCtxRetain")
        self._batch = {}
        for api, abi, proto in BATCH_ABIS:
            if self.version >= abi:
                res = cu.cuGetProcAddress(b"cuMemcpyBatchAsync", abi,
                                          cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
                if int(res[0]) == 0 and res[1]:
                    self._batch[api] = proto(int(res[1]))
        res = cu.cuGetProcAddress(b"cuMemcpyAsync", min(self.driver_version, 13000),
                                  cu.CUdriverProcAddress_flags.CU_GET_PROC_ADDRESS_DEFAULT)
        if int(res[0]) != 0 or not res[1]:
            raise ExecutorError("cuGetProcAddress", 0, None, f"no entry point for cuMemcpyAsync ({res[0]})", 0)
        self._copy = MEMCPY_ASYNC(int(res[1]))

    def _ok(self, result: Any, call: str) -> Any:
        return driver_result(result, call, self._name)

    def _name(self, err: Any) -> str:
        _, name = self._cu.cuGetErrorName(err)
        return name.decode() if name else f"CUresult {int(err)}"

    def error_name(self, code: int) -> str:
        """cuGetErrorName for ``code``."""
        return self._name(self._cu.CUresult(code))

    def api_available(self, api: CopyApi) -> bool:
        """Per-range copies always; a batch ABI when cuGetProcAddress returned its entry point."""
        return api is CopyApi.CUDA_PER_RANGE or api in self._batch

    def batch(self, api: CopyApi, dsts: int, srcs: int, sizes: int, count: int, attrs: int | None,
              attrs_idxs: int | None, num_attrs: int, fail_idx: ctypes.c_size_t, stream: int) -> int:
        """cuMemcpyBatchAsync through the ABI of ``api`` (the 13.0 ABI takes no ``fail_idx``)."""
        fn = self._batch[api]
        if api is CopyApi.CUDA_BATCH_V2:
            return int(fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, stream))
        return int(fn(dsts, srcs, sizes, count, attrs, attrs_idxs, num_attrs, byref(fail_idx), stream))

    def copy(self, dst: int, src: int, nbytes: int, stream: int) -> int:
        """cuMemcpyAsync (through ctypes: the per-range path issues one call per range)."""
        return int(self._copy(dst, src, nbytes, stream))

    def stream_create(self) -> int:
        """cuStreamCreate (non-blocking)."""
        return int(self._ok(self._cu.cuStreamCreate(CU_STREAM_NON_BLOCKING), "cuStreamCreate"))

    def stream_destroy(self, stream: int) -> int:
        """cuStreamDestroy."""
        return int(self._cu.cuStreamDestroy(self._cu.CUstream(stream))[0])

    def event_create(self) -> int:
        """cuEventCreate."""
        return int(self._ok(self._cu.cuEventCreate(0), "cuEventCreate"))

    def event_destroy(self, event: int) -> int:
        """cuEventDestroy."""
        return int(self._cu.cuEventDestroy(self._cu.CUevent(event))[0])

    def event_record(self, event: int, stream: int) -> int:
        """cuEventRecord."""
        return int(self._cu.cuEventRecord(self._cu.CUevent(event), self._cu.CUstream(stream))[0])

    def stream_wait_event(self, stream: int, event: int) -> int:
        """cuStreamWaitEvent."""
        return int(self._cu.cuStreamWaitEvent(self._cu.CUstream(stream), self._cu.CUevent(event), 0)[0])

    def event_query(self, event: int) -> int:
        """cuEventQuery."""
        return int(self._cu.cuEventQuery(self._cu.CUevent(event))[0])

    def event_synchronize(self, event: int) -> int:
        """cuEventSynchronize."""
        return int(self._cu.cuEventSynchronize(self._cu.CUevent(event))[0])

    def event_elapsed_ms(self, start: int, end: int) -> tuple[int, float]:
        """cuEventElapsedTime."""
        err, ms = self._cu.cuEventElapsedTime(self._cu.CUevent(start), self._cu.CUevent(end))
        return int(err), float(ms)

    @contextlib.contextmanager
    def current(self) -> Iterator[None]:
        """Push the device's primary context for the block and pop it after, so the caller's stays current."""
        self._ok(self._cu.cuCtxPushCurrent(self._ctx), "cuCtxPushCurrent")
        try:
            yield
        finally:
            self._cu.cuCtxPopCurrent()

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Location check only: BindingError when the memory sits elsewhere (or on another device) than the buffer."""
        check_location(buf, mem)

    def close(self) -> None:
        """Nothing to release: the primary context stays retained for the process (see the module docstring),
        so closing an executor never resets the context other code in the process is using."""


class CudaBatchExecutor(DmaExecutor):
    """Runs plans for ``cuda-*`` targets on ``runtime`` (default: a CudaRuntime on ``device``, released with
    the executor)."""

    def __init__(self, runtime: Runtime | None = None, *, device: int = 0, max_descriptors: int | None = None):
        super().__init__(runtime if runtime is not None else CudaRuntime(device), max_descriptors=max_descriptors,
                         own_runtime=runtime is None)

    @classmethod
    def from_options(cls, options: CudaOptions) -> CudaBatchExecutor:
        """An executor on a new CudaRuntime for ``options.device``, with ``options.max_descriptors``."""
        return cls(device=options.device, max_descriptors=options.max_descriptors)
