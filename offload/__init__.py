"""kvxfer.offload: the offload worker a serving engine calls every step (store and load jobs, ordering,
completion, shared host memory across TP ranks, a file tier for spills and restores), and a drop-in for the
simple one-call copy path.

Imports kvxfer.planner and kvxfer.executors only. A core and wings:

- the core knows no engine and no storage kind: ``worker`` (OffloadWorker: planning, the lock, lanes, waiting),
  ``graph`` (the job graph as a pure value: accept, settle, retire), ``jobs`` (results, errors, conflicts),
  ``lanes`` (in-order execution, and ``LowerTier``: what a storage tier below host memory plugs in as),
  ``tier`` (the host tier's shape), ``shared`` (host regions across processes), ``build`` (create_worker),
  ``simple`` (the one-call path), ``checksums`` (a CRC per host chunk). No core module imports a wing;
- ``files`` (a storage kind): ``file_tier`` (FileTier: files, records, durability), ``spill`` (the file tier as
  the worker's lower tier: ``attach_files``), ``chunk_store`` (ChunkStore: keyed chunks in files);
- ``vllm`` (an engine): vLLM's offloading spec, connector and tiers over this worker, loaded on first access;
  importing it does not import vLLM.

This face holds the core's names and loads the files wing's names on first access (``files``). Modules that
moved into a wing keep their old dotted path (``kvxfer.offload.file_tier``, ``kvxfer.offload.vllm_checks``, ...):
importing one gives the module at its new path, with a DeprecationWarning naming it.
"""
import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from types import FrameType, ModuleType
from typing import Any

from .build import create_worker, host_memory
from .graph import DependencyError
from .jobs import JobResult, OffloadError, SubmissionError, WorkerClosedError
from .shared import SharedRegion, SharedRegionError, find_stale, remove_stale
from .simple import CopyParams, build_params, copy_blocks, pin_tensor
from .tier import (
    Cell,
    DeviceKV,
    Geometry,
    HostLayout,
    HostTier,
    KVTensor,
    SharedSpec,
    Sharing,
    TPRank,
    build_layout,
    device_from_tensors,
    make_geometry,
)
from .worker import OffloadWorker

# the files wing's names this face exports, loaded on first access
_FILES = ("Durability", "FileLane", "FileTier", "IntegrityError", "TierError", "TierResult", "aligned_empty",
          "attach_files", "spill_layout", "tier_layout")
_WINGS = ("files", "vllm")
# old dotted paths of the modules that moved into a wing -> their new paths
MOVED = {
    "kvxfer.offload.file_tier": "kvxfer.offload.files.file_tier",
    "kvxfer.offload.spill": "kvxfer.offload.files.spill",
    "kvxfer.offload.chunk_store": "kvxfer.offload.files.chunk_store",
    "kvxfer.offload.vllm_caches": "kvxfer.offload.vllm.caches",
    "kvxfer.offload.vllm_checks": "kvxfer.offload.vllm.checks",
    "kvxfer.offload.vllm_connector": "kvxfer.offload.vllm.connector",
    "kvxfer.offload.vllm_spec": "kvxfer.offload.vllm.spec",
    "kvxfer.offload.vllm_stats": "kvxfer.offload.vllm.stats",
    "kvxfer.offload.vllm_tiers": "kvxfer.offload.vllm.tiers",
    "kvxfer.offload.vllm_worker": "kvxfer.offload.vllm.worker",
}

__all__ = [
    "Cell", "CopyParams", "DependencyError", "DeviceKV", "Durability", "FileLane", "FileTier", "Geometry", "HostLayout",
    "HostTier", "IntegrityError", "JobResult", "KVTensor", "MOVED", "OffloadError", "OffloadWorker", "SharedRegion",
    "SharedRegionError", "SharedSpec", "Sharing", "SubmissionError", "TPRank", "TierError", "TierResult",
    "WorkerClosedError", "aligned_empty", "attach_files", "build_layout", "build_params", "copy_blocks",
    "create_worker", "device_from_tensors", "files", "find_stale", "host_memory", "make_geometry", "pin_tensor",
    "remove_stale", "spill_layout", "tier_layout", "vllm",
]


def __getattr__(name: str) -> Any:
    if name in _FILES:
        return getattr(importlib.import_module(".files", __name__), name)
    if name in _WINGS:
        return importlib.import_module(f".{name}", __name__)
    if f"{__name__}.{name}" in MOVED:  # kvxfer.offload.file_tier as an attribute: the module, with the warning
        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class _Moved(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports of a module's old dotted path (``MOVED``) give the module at its new path, the same object (so
    what is set on one is set on the other), after a DeprecationWarning naming the new path. Consulted last,
    only for names no other finder knows."""

    def __init__(self, moved: dict[str, str]):
        self.moved = moved
        self._specs: dict[str, Any] = {}

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        """A spec this loader fills for an old path, else None."""
        return importlib.machinery.ModuleSpec(fullname, self) if fullname in self.moved else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The module at the new path (imported if need be), after the warning."""
        new = self.moved[spec.name]
        warnings.warn(f"{spec.name} moved to {new}; import it from there", DeprecationWarning, stacklevel=_caller())
        module = importlib.import_module(new)
        self._specs[spec.name] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing runs again; the import system gave the module the old path's spec, so its own goes back."""
        module.__spec__ = self._specs.pop(module.__spec__.name, module.__spec__) if module.__spec__ else None


def _caller() -> int:
    """The stacklevel, for a ``warn`` in ``create_module``, of the frame that imported the old path: past the import
    system (its bootstrap frames, which ``warn`` skips itself, and ``importlib.import_module``)."""
    frame: FrameType | None = sys._getframe(2)
    level = 2
    while frame is not None and str(frame.f_globals.get("__name__", "")).partition(".")[0] == "importlib":
        if "_bootstrap" not in frame.f_code.co_filename:
            level += 1
        frame = frame.f_back
    return level


if not any(isinstance(f, _Moved) for f in sys.meta_path):
    sys.meta_path.append(_Moved(MOVED))
