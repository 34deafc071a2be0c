"""The spec side of kvxfer's vLLM backend: ``KvxferOffloadingSpec`` (over vLLM's CPU spec) and
``KvxferOffloadingWorker`` (over vLLM's ``OffloadingWorker``), and the start-up checks that need vLLM's sizing or the
KV caches it hands over. Imports vLLM (``api``); ``kvxfer.offload.vllm`` loads it on first access of these names.
"""
from __future__ import annotations

import logging
import re
from typing import Any

from kvxfer.executors import ExecutorSpec

from ..checksums import HostChecksums
from ..tier import HostTier, SharedSpec, Sharing
from ..worker import OffloadWorker
from .api import (
    CPUOffloadingSpec,
    OffloadingWorker,
    TransferResult,
    get_current_vllm_config_or_none,
    get_inner_dp_world_group,
    get_world_group,
)
from .caches import CacheMap, read_caches
from .checks import (
    UnsupportedFeatureError,
    caches_device,
    check_blocks_per_chunk,
    check_executor_device,
    check_extra,
    check_host_memory,
    stats_path,
)
from .logs import config_summary
from .worker import WorkerCore, build_worker, device_pointers

__all__ = ["KvxferOffloadingSpec", "KvxferOffloadingWorker"]

_log = logging.getLogger("kvxfer.offload.vllm")


def _region_name(engine_id: str) -> str:
    return "vllm-" + re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)[:120]


def _all_ranks_barrier() -> None:
    """Every worker rank of this engine reaches this point (vLLM's CPU process group)."""
    try:
        group = get_inner_dp_world_group()
    except AssertionError:  # no inner data-parallel group in this configuration
        group = get_world_group()
    group.barrier()


def _max_model_len() -> int | None:
    """The engine's max_model_len, when vLLM has set its current config (it does while connectors are built)."""
    config = get_current_vllm_config_or_none()
    model = getattr(config, "model_config", None)
    return int(model.max_model_len) if model is not None and model.max_model_len else None


def _check_spec(spec: Any) -> None:
    """The start-up checks that need vLLM's sizing (after CPUOffloadingSpec.__init__): the chunk against
    max_model_len, the features kvxfer's host tier needs."""
    config, extra = spec.config, spec.extra_config
    if config.groups:
        check_blocks_per_chunk(extra, spec.blocks_per_chunk, config.groups[0].tokens_per_block, _max_model_len())
    if config.canonical_layout and not spec.kvxfer_shared_region:
        raise UnsupportedFeatureError("canonical_layout without the shared host region",
                                      "set kvxfer_shared_region to true (canonical cells are shared by all ranks)")
    if extra.get("kvxfer_verify") and spec.replicated_layout:
        raise UnsupportedFeatureError("kvxfer_verify with the replicated single-copy layout",
                                      "ranks load the copy rank 0 stored, whose checksums only rank 0 holds")


def _check_worker(spec: Any, caches: CacheMap, device: str, creator: bool) -> None:
    """The worker's start-up checks, before any host memory is allocated: the executor kind against the KV caches'
    device, checksums against rotating writers, the host tier against the memory available (by the rank that
    allocates it)."""
    extra = spec.extra_config
    check_executor_device(extra.get("kvxfer_executor"), device)
    if extra.get("kvxfer_verify") and any(t.sharing is Sharing.REPLICATED for _, t in caches.refs):
        raise UnsupportedFeatureError("kvxfer_verify with replicated canonical pages",
                                      "their stores rotate writers over the ranks, so a rank loads pages whose "
                                      "checksums another rank holds")
    shared = spec.kvxfer_shared_region
    if creator or not shared:
        per_chunk = spec.kv_bytes_per_chunk if shared else spec.cpu_page_size_per_worker
        check_host_memory(spec.num_chunks * per_chunk, extra.get("cpu_bytes_to_use"), "/dev/shm" if shared else None)


class KvxferOffloadingWorker(WorkerCore, OffloadingWorker):  # type: ignore[misc]
    """vLLM's ``OffloadingWorker`` over a kvxfer ``OffloadWorker`` (the behaviour is ``WorkerCore``'s):
    ``submit_store``/``submit_load`` turn vLLM's load/store specs into jobs, ``get_finished`` returns
    vLLM's ``TransferResult`` with bytes and seconds (a failed job raises ``JobFailedError``, or is reported
    failed once ``report_failures`` was called), ``wait`` blocks for the named jobs, ``shutdown`` drains."""


class KvxferOffloadingSpec(CPUOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``OffloadingSpec`` for kvxfer: vLLM's CPU spec (sizing from ``cpu_bytes_to_use`` and
    ``blocks_per_chunk``, ``CPUOffloadingManager``, eviction policies, metric definitions) whose worker side is
    ``KvxferOffloadingWorker``. vLLM builds it from ``kv_connector_extra_config`` (``spec_name``
    "KvxferOffloadingSpec", ``spec_module_path`` "kvxfer.offload.vllm"), which may also hold the
    ``kvxfer_*`` keys described in ``kvxfer.offload.vllm``. Refuses at start-up, in one line naming the key and value
    (``ExtraConfigError``) or the feature (``UnsupportedFeatureError``), both ValueErrors: unknown ``kvxfer_*`` keys,
    a bad executor config or one whose kind cannot copy the engine's KV caches, a counters path that cannot be
    written, a host tier larger than the memory available, a chunk longer than the model's ``max_model_len``,
    unsupported KV caches; warns about keys neither vLLM nor kvxfer reads. Subclasses may override
    ``make_executor`` (the executor the workers run) and extend ``extra_keys`` (keys they read)."""

    extra_keys: tuple[str, ...] = ()  # keys of kv_connector_extra_config a subclass reads (not warned about)
    kvxfer_shared_region: bool  # the host tier is one region shared by the engine's ranks

    def __init__(self, config: Any):
        for warning in check_extra(config.extra_config, self.extra_keys, config.parallel.world_size):
            _log.warning("kvxfer: %s", warning)
        self.kvxfer_shared_region = bool(config.extra_config.get("kvxfer_shared_region", config.parallel.world_size > 1))
        super().__init__(config)
        _check_spec(self)

    def _uses_shared_region(self) -> bool:
        # vLLM sizes chunks and enables the replicated single-copy layout by this answer
        return self.kvxfer_shared_region

    def make_executor(self) -> ExecutorSpec:
        """The executor (or config, or factory) the workers run: ``kvxfer_executor``."""
        executor: ExecutorSpec = self.extra_config.get("kvxfer_executor")
        return executor

    def get_worker(self, kv_caches: Any) -> Any:
        """This rank's KvxferOffloadingWorker over vLLM's ``kv_caches`` (made on the first call)."""
        if getattr(self, "_worker", None) is None:
            self._worker = _make_worker(self, kv_caches)
        return self._worker


def _shared_spec(spec: Any) -> SharedSpec | None:
    p = spec.config.parallel
    if not spec.kvxfer_shared_region:
        return None
    return SharedSpec(name=_region_name(spec.config.engine_id), create=p.rank == 0,
                      attachers=p.world_size - 1 if p.rank == 0 else 0)


def _checksums(worker: OffloadWorker, num_chunks: int) -> HostChecksums:
    if worker.host is None:
        raise RuntimeError("kvxfer_verify: the offload worker holds no host rows to check")
    return HostChecksums(worker.layout, worker.host, num_chunks)


def _make_worker(spec: Any, kv_caches: Any) -> KvxferOffloadingWorker:
    """The KvxferOffloadingWorker of ``spec`` over vLLM's ``kv_caches`` (see KvxferOffloadingSpec)."""
    p, extra = spec.config.parallel, spec.extra_config
    kind = caches_device(spec, kv_caches)
    shared = _shared_spec(spec)
    barrier = _all_ranks_barrier if shared is not None and p.world_size > 1 else None
    try:
        caches = read_caches(kv_caches, rank=p.rank, world_size=p.world_size,
                             canonical=bool(spec.config.canonical_layout), replicated=bool(spec.replicated_layout))
        _check_worker(spec, caches, kind, creator=p.rank == 0)
        tier = HostTier(num_chunks=spec.num_chunks, blocks_per_chunk=spec.blocks_per_chunk, layout=caches.layout,
                        shared=shared, pin=kind == "cuda")
    except BaseException:
        if barrier is not None:
            barrier()  # every rank passes the barrier once, so a refusal on one rank never hangs the others
        raise
    worker = build_worker(caches, tier, spec.make_executor(), pin=kind == "cuda", barrier=barrier, creator=p.rank == 0)
    _log.info("kvxfer is active (KvxferOffloadingSpec): rank %d/%d, %d chunks of %d block(s), %d regions in %d group(s), "
              "%s host tier%s; config: %s", p.rank, p.world_size, spec.num_chunks, spec.blocks_per_chunk, len(caches.refs),
              caches.num_groups, "shared" if shared else "private", ", checksums on" if extra.get("kvxfer_verify") else "",
              config_summary(extra))
    import torch

    try:
        checksums = _checksums(worker, spec.num_chunks) if extra.get("kvxfer_verify") else None
    except BaseException:
        worker.shutdown()
        raise
    out = KvxferOffloadingWorker(worker, TransferResult, stream=torch.cuda.current_stream if kind == "cuda" else None,
                                 stats_path=stats_path(extra.get("kvxfer_stats_path"), p.rank, p.world_size),
                                 checksums=checksums, pointers=device_pointers(kv_caches))
    out.stats.host_tier = "shared" if shared else "private"
    return out
