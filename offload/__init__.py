"""kvxfer.offload: the offload worker a serving engine calls every step (store and load jobs, ordering,
completion, shared host memory across TP ranks, a file tier for spills and restores), and a drop-in for the
simple one-call copy path.

Imports kvxfer.planner and kvxfer.executors only (the file tier's NIXL executor is built lazily by
``attach_files``). Modules: ``worker`` (OffloadWorker), ``jobs`` (results, errors, conflicts), ``lanes`` (in-order
execution), ``spill`` (the worker's file tier), ``file_tier`` (FileTier: files, records, durability), ``shared``
(host regions across processes), ``tier`` (the host tier's shape), ``build`` (create_worker), ``simple``.
``checksums`` (a CRC per host chunk). ``vllm``: vLLM's offloading spec and connector over this worker
(``kvxfer.offload.vllm``, with its ``vllm_*`` modules), a submodule loaded on first access; importing it does not
import vLLM.
"""
import importlib
from typing import Any

from .build import DeviceKV, create_worker, device_from_tensors, host_memory
from .file_tier import Durability, FileTier, IntegrityError, TierError, TierResult, aligned_empty, tier_layout
from .jobs import DependencyError, JobResult, OffloadError, SubmissionError, WorkerClosedError
from .shared import SharedRegion, SharedRegionError, find_stale, remove_stale
from .simple import CopyParams, build_params, copy_blocks, pin_tensor
from .spill import FileLane, attach_files, spill_layout
from .tier import Cell, Geometry, HostLayout, HostTier, KVTensor, SharedSpec, Sharing, TPRank, build_layout, make_geometry
from .worker import OffloadWorker

__all__ = [
    "Cell", "CopyParams", "DependencyError", "DeviceKV", "Durability", "FileLane", "FileTier", "Geometry", "HostLayout",
    "HostTier", "IntegrityError", "JobResult", "KVTensor", "OffloadError", "OffloadWorker", "SharedRegion",
    "SharedRegionError", "SharedSpec", "Sharing", "SubmissionError", "TPRank", "TierError", "TierResult",
    "WorkerClosedError", "aligned_empty", "attach_files", "build_layout", "build_params", "copy_blocks",
    "create_worker", "device_from_tensors", "file_tier", "find_stale", "host_memory", "make_geometry", "pin_tensor",
    "remove_stale", "spill_layout", "tier_layout", "vllm",
]


def __getattr__(name: str) -> Any:
    if name == "vllm":
        return importlib.import_module(".vllm", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
