"""kvxfer as the KV offloading backend of vLLM (0.32): ``KvxferOffloadingSpec`` and ``KvxferOffloadingConnector``.

Load the spec through vLLM's offloading connector, or through kvxfer's connector (a subclass of it) under which a
failed copy costs a recompute instead of the engine::

    kv_transfer_config={"kv_connector": "KvxferOffloadingConnector", "kv_connector_module_path": "kvxfer.offload.vllm",
                        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                        "kv_connector_extra_config": {"spec_name": "KvxferOffloadingSpec",
                                                      "spec_module_path": "kvxfer.offload.vllm",
                                                      "cpu_bytes_to_use": 8 << 30}}

Scheduler side: vLLM's own CPU spec. The sizing keys (``cpu_bytes_to_use``, ``blocks_per_chunk`` or
``block_size``, ``eviction_policy``, ``cache_policy_module_path``, ``store_threshold``, ``max_tracker_size``),
``CPUOffloadingManager`` with its eviction policies, and the CPU spec's metric definitions are vLLM's, reused
as they are. Worker side: ``KvxferOffloadingWorker``, which turns vLLM's load/store specs into jobs of a kvxfer
``OffloadWorker`` (its public API only). kvxfer's own keys:

- ``kvxfer_executor``: kvxfer's executor config (a dict such as ``{"kind": "auto"}`` or a TOML/JSON path), read
  by ``kvxfer.executors.get_executor`` (default: auto, which is the NumPy executor on vLLM's CPU build);
- ``kvxfer_shared_region``: map one host region shared by every rank of the engine (default: when there is
  more than one rank) instead of a private tier per rank; required by vLLM's ``canonical_layout`` and by the
  replicated single-copy layout (pure MLA at TP), which vLLM only enables on a shared region;
- ``kvxfer_stats_path``: where each rank writes kvxfer's counters as JSON (with ``.rank<r>`` before the suffix
  when there is more than one rank): replaced whole after each engine step that finished jobs (off the step, on
  a thread of its own) and at shutdown, so the file holds the counters even when vLLM kills a worker process
  that is slow to stop. Checked at start-up; a write that fails later is logged once and never fails a step;
- ``kvxfer_verify``: a CRC-32 per host chunk, recorded when a store finishes and checked before a load
  (``kvxfer.offload.checksums``); a chunk that no longer matches fails its load (refused before any copy).

What vLLM hands over and what is refused at start-up (``UnsupportedFeatureError`` naming the feature, and
``ExtraConfigError`` naming a key and its value, ``kvxfer.offload.vllm.checks``) is in ``read_caches`` and the
spec. A job that fails is never reported as success. Under vLLM's ``OffloadingConnector``, which cannot take a
failed job, ``get_finished`` raises ``JobFailedError`` naming the job and its cause, and the engine stops. Under
``KvxferOffloadingConnector`` (``kvxfer.offload.vllm.connector``) the worker reports it failed instead: a failed
load's blocks go back to vLLM as load errors (recomputed with ``kv_load_failure_policy="recompute"``) and its
chunks are no longer offered as hits, a failed store's chunks are dropped from the host tier's index, and the
engine goes on.

The wing's modules: this face (the names, and the classes loaded on first access: ``CLASSES``); ``version``
(the releases supported, ``import_vllm``); ``api`` (vLLM's names, imported once); ``checks`` (the start-up checks),
``caches`` (vLLM's KV caches as kvxfer tensors), ``worker`` (``WorkerCore``: specs to jobs, results back,
``build_worker``), ``stats`` (the counters and their file), ``tiering`` (the primary tier's cells and the file tier's
settings and identity): none of these imports vLLM; ``spec``, ``connector`` and ``tiers`` hold the classes vLLM
loads, ordinary classes over vLLM's, and import vLLM (through ``api``).

Where a vLLM release differs, one place each: an import path (``api``), the releases accepted (``version``), the
KV caches a worker is handed (``caches.read_caches``), the load/store specs and their flags (``WorkerCore``), a
spec's or connector's hooks (``spec``, ``connector``), the tiering spec and its secondary tiers (``tiers``).

Importing this module imports neither vLLM nor torch: the vLLM-facing classes are loaded on first access.
"""
from __future__ import annotations

import importlib
from typing import Any

from ..checksums import ChecksumError
from .caches import CacheMap, read_caches
from .checks import KVXFER_KEYS, ExtraConfigError, UnsupportedFeatureError
from .stats import StatsFile, WorkerStats
from .version import INSTALL_HINT, SUPPORTED_VLLM, import_vllm
from .worker import JobFailedError, WorkerCore, build_worker

# the classes vLLM loads from this module by name (spec_name, kv_connector, a secondary tier's type), each an ordinary
# class of the module named here, which imports vLLM: loaded on first access
CLASSES = {
    "KvxferOffloadingSpec": "spec", "KvxferOffloadingWorker": "spec",
    "KvxferOffloadingConnector": "connector", "KvxferWorkerMetadata": "connector", "FailedTransfers": "connector",
    "KvxferTieringOffloadingSpec": "tiers", "KvxferFileTier": "tiers",
}

__all__ = ["CLASSES", "INSTALL_HINT", "KVXFER_KEYS", "SUPPORTED_VLLM", "CacheMap", "ChecksumError", "ExtraConfigError",
           "JobFailedError", "StatsFile", "UnsupportedFeatureError", "WorkerCore", "WorkerStats", "build_worker",
           "import_vllm", "read_caches", *CLASSES]


def __getattr__(name: str) -> Any:
    if name in CLASSES:  # imports vLLM (ImportError with the install hint without it)
        return getattr(importlib.import_module(f".{CLASSES[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
