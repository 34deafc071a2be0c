"""kvxfer.offload.files: files as a storage kind below host memory, a wing over the offload core.

- ``file_tier``: ``FileTier``, spilling memory to files and restoring it through a storage executor (NIXL's POSIX
  or GDS backends, or kvxfer's POSIX executor), with stated durability and per-chunk integrity records;
- ``spill``: the file tier as an offload worker's lower tier (``FileLane``, a ``kvxfer.offload.lanes.TierLane``;
  ``attach_files``), so spills and restores are jobs ordered and reported like stores and loads;
- ``chunk_store``: ``ChunkStore``, chunks stored in files under keys (slots, an index, LRU capacity, namespaces by
  identity, warm restarts), on a FileTier: what an engine's secondary tier sits on (vLLM's ``KvxferFileTier``).

Imports the core (jobs, lanes, the host tier's shape), kvxfer.planner and kvxfer.executors; never an engine.
"""
from .admin import StoreBusyError, describe, find_stores, purge, resize, verify
from .chunk_store import ChunkStore, StoreConfig, StoreConfigError, StoreError, StoreResult, StoreStats, namespace
from .file_tier import (
    Durability,
    FileTier,
    IntegrityError,
    StorageExecutor,
    TierConfigError,
    TierError,
    TierResult,
    aligned_empty,
    tier_layout,
)
from .spill import FileLane, attach_files, spill_layout

__all__ = ["ChunkStore", "Durability", "FileLane", "FileTier", "IntegrityError", "StorageExecutor", "StoreBusyError",
           "StoreConfig", "StoreConfigError", "StoreError", "StoreResult", "StoreStats", "TierConfigError", "TierError",
           "TierResult", "aligned_empty", "attach_files", "describe", "find_stores", "namespace", "purge", "resize",
           "spill_layout", "tier_layout", "verify"]
