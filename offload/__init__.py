"""kvxfer.offload: the offload worker a serving engine calls every step (store and load jobs, ordering,
completion, shared host memory across TP ranks, a file tier for spills and restores), and a drop-in for the
simple one-call copy path.

Imports kvxfer.planner and kvxfer.executors only (``files``: the NIXL file tier, loaded lazily by
``attach_files``). ``vllm``: vLLM's offloading spec over this worker (``kvxfer.offload.vllm``), a submodule
loaded on first access; importing it does not import vLLM.
"""
import importlib
from typing import Any

from .build import DeviceKV, create_worker, device_from_tensors, host_memory
from .files import FileLane, attach_files, spill_layout
from .shared import SharedRegion, SharedRegionError, find_stale, remove_stale
from .simple import CopyParams, build_params, copy_blocks, pin_tensor
from .tier import Cell, Geometry, HostLayout, HostTier, KVTensor, SharedSpec, Sharing, TPRank, build_layout, make_geometry
from .worker import JobResult, OffloadError, OffloadWorker, Pool, SubmissionError, WorkerClosedError

__all__ = [
    "Cell", "CopyParams", "DeviceKV", "FileLane", "Geometry", "HostLayout", "HostTier", "JobResult", "KVTensor", "OffloadError",
    "OffloadWorker", "Pool", "SharedRegion", "SharedRegionError", "SharedSpec", "Sharing", "SubmissionError", "TPRank",
    "WorkerClosedError", "attach_files", "build_layout", "build_params", "copy_blocks", "create_worker",
    "device_from_tensors", "find_stale", "host_memory", "make_geometry", "pin_tensor", "remove_stale", "spill_layout",
    "vllm",
]


def __getattr__(name: str) -> Any:
    if name == "vllm":
        return importlib.import_module(".vllm", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
