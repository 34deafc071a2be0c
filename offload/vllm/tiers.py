"""kvxfer under vLLM's tiering (0.32): ``KvxferTieringOffloadingSpec`` and the storage tier ``KvxferFileTier``.

vLLM's ``TieringOffloadingSpec`` keeps a primary tier of host memory (a ``SharedOffloadRegion``, one per engine)
that secondary tiers in the scheduler process copy whole chunk rows out of ("cascade") and back into
("promotion"). ``KvxferTieringOffloadingSpec`` is that spec with kvxfer's worker for device <-> host, bound to
each rank's view of vLLM's region exactly where vLLM's own worker would put the cells, so vLLM's secondary tiers
(its ``fs`` tier, or kvxfer's) read and write the same chunks; it runs wherever kvxfer runs, vLLM's CPU build
included (where vLLM's own worker refuses the platform)::

    "kv_connector_extra_config": {
        "spec_name": "KvxferTieringOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm",
        "cpu_bytes_to_use": 8 << 30,
        "secondary_tiers": [{"type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm",
                             "root_dir": "/var/cache/kv", "capacity_bytes": 200 << 30}]}

``KvxferFileTier`` stores primary chunks in files through a ``ChunkStore`` (``kvxfer.offload.files.chunk_store``):
integrity records per chunk, durability before a store is reported done, bounded capacity with LRU eviction, files private to
their owner, a namespace per identity (``tier_identity``), warm restarts, and loads that check every chunk. Its
keys (``StoreConfig``): ``root_dir``, ``capacity_bytes`` (required), ``durability``, ``verify``, ``o_direct``,
``io_threads``, ``lock_timeout_s``, ``stats_path``, ``shared`` (several engines on one ``root_dir``: a
``SharedChunkStore``, docs/vllm/sharing.md); vLLM's ``locality`` and ``enable_kv_events`` (KV-cache events
of stored and removed chunks, ``events``) too. Anything else is refused at start-up with one line naming the key.
Its counters reach the engine's metrics (``metrics``: ``vllm:kvxfer_tier_*``) as well as the JSON file.

This module imports vLLM (``api``); ``kvxfer.offload.vllm`` loads it on first access of its classes. What needs
no vLLM (cells, checks, the file tier's settings and identity) is ``tiering``'s.
"""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..build import assemble_worker
from ..drain import drain_at_exit
from ..files.chunk_store import StoreConfig, StoreError
from .api import (
    VLLM_VERSION,
    Locality,
    LookupResult,
    Medium,
    OffloadingConnectorStats,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingHistogramMetadata,
    OffloadingWorker,
    RequestOffloadingContext,
    SecondaryTierManager,
    SharedOffloadRegion,
    TieringOffloadingSpec,
    TransferResult,
)
from .api import JobResult as TierJobResult
from .caches import read_caches
from .checks import caches_device, check_executor_device, stats_path
from .events import TierEvents, events_wanted
from .logs import config_summary
from .metrics import TierMeter, metric_definitions
from .tiering import (
    FORMAT,
    TIER_KEYS,
    check_tiering_extra,
    open_store,
    tier_config,
    tier_identity,
    tiering_geometry,
    worker_layout,
)
from .worker import WorkerCore, device_pointers

__all__ = ["FORMAT", "TIER_KEYS", "KvxferFileTier", "KvxferTieringOffloadingSpec", "KvxferTieringWorker", "tier_config",
           "tier_identity", "tiering_geometry"]

_log = logging.getLogger(__name__)


class KvxferTieringWorker(WorkerCore, OffloadingWorker):  # type: ignore[misc]
    """vLLM's ``OffloadingWorker`` over vLLM's primary-tier region (``WorkerCore``'s behaviour): it releases the
    region once it has drained, and keeps the wall times of its last 32 load submissions (the restore timeline)."""

    def __init__(self, region: Any, *args: Any, **kw: Any):
        super().__init__(*args, **kw)
        self.region = region
        self.stats.load_submitted = []  # type: ignore[attr-defined]  # wall times, for the restore timeline

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """``WorkerCore.submit_load``, its wall time recorded."""
        times: list[float] = self.stats.load_submitted  # type: ignore[attr-defined]
        times[:] = [*times[-31:], time.time()]
        return super().submit_load(job_id, src_spec, dst_spec, expedited)

    def _shutdown(self) -> None:
        """``WorkerCore``'s drain, then the region released (once nothing views its memory)."""
        try:
            super()._shutdown()
        finally:
            del self.worker  # vLLM unmaps the region only once nothing views its memory
            gc.collect()
            self.region.cleanup()


class KvxferTieringOffloadingSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's ``TieringOffloadingSpec`` (a host-memory primary tier in vLLM's ``SharedOffloadRegion`` and the
    ``secondary_tiers`` of its config: vLLM's ``fs``, ``KvxferFileTier``, ...) whose worker is kvxfer's,
    bound to each rank's view of that region where vLLM's worker keeps the cells, so that the scheduler-side
    tiers read and write the same chunks; it runs on vLLM's CPU build too. The ``kvxfer_*`` keys of
    ``KvxferOffloadingSpec`` apply (``kvxfer_shared_region`` must stay true: the region is vLLM's)."""

    def __init__(self, config: Any):
        check_tiering_extra(config)
        super().__init__(config)

    def get_worker(self, kv_caches: Any) -> Any:
        """This rank's KvxferTieringWorker over vLLM's ``kv_caches`` (made on the first call)."""
        if getattr(self, "_worker", None) is None:
            self._worker = _tiering_worker(self, kv_caches)
        return self._worker


class KvxferFileTier(SecondaryTierManager):  # type: ignore[misc]
    """vLLM's ``SecondaryTierManager`` over a kvxfer ``ChunkStore``: ``lookup`` answers from the store's index
    (never blocks), stores and loads run as merged file I/O on the store's thread, a chunk that fails its
    check is a miss (the promotion reports the keys that did load), a store is done once durable. Keys of
    its ``secondary_tiers`` entry: those of ``StoreConfig`` and vLLM's ``locality``. Called from the scheduler's
    thread (vLLM's tiering manager); the store's own thread does the I/O."""

    medium = Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 backpressure_detector: Any = None, **config: Any):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        locality = config.pop("locality", None)
        self.locality = Locality(locality) if locality is not None else None
        wanted = events_wanted(offloading_spec, config.pop("enable_kv_events", False), tier_type)
        self._rejected: list[Any] = []  # jobs the store refused at submission, reported failed
        self._refusals_logged = 0
        self.store = open_store(offloading_spec, primary_kv_view, tier_type, self.block_size_bytes, config,
                                self.storage_executor, VLLM_VERSION)
        self.meter, self._refused = TierMeter(tier_type), 0
        self.events: TierEvents | None = None
        if wanted:  # what the store holds from an earlier run is announced once, as stored
            self.events = TierEvents(OffloadingEvent, self.medium, self.locality, tier_type)
            self.events.stored(list(self.store.index))
        self.store.on_removed = self._removed
        self._close = drain_at_exit(self.store.close, f"kvxfer file tier {self.store.folder}")  # or at exit

    def storage_executor(self, settings: StoreConfig) -> Any:
        """The executor the store runs its files on; None (here): kvxfer's POSIX executor on ``io_threads``
        threads, made and closed by the store. A subclass may supply another (a NIXL storage executor)."""
        return None

    def lookup(self, key: bytes, req_context: Any) -> Any:
        """A hit when the store's index holds ``key`` (no I/O)."""
        return LookupResult.HIT if self.store.lookup(key) else LookupResult.MISS

    def submit_store(self, job_metadata: Any) -> None:
        """Queue a store of the job's primary-tier chunks under its keys (the store's thread writes them); a job
        the store refuses (a chunk id out of range, a key twice, an id in use) fails as a job, never raises."""
        self._submit(self.store.submit_store, job_metadata)

    def submit_load(self, job_metadata: Any) -> None:
        """Queue a load of the job's keys into its primary-tier chunks (ahead of queued stores); a refused job
        fails as a job."""
        self._submit(self.store.submit_load, job_metadata)

    def _submit(self, submit: Any, job: Any) -> None:
        try:
            submit(job.job_id, list(job.keys), job.chunk_ids)
        except (ValueError, StoreError) as e:  # on the scheduler's thread: the job fails, the engine goes on
            if not self._refusals_logged:
                _log.warning("kvxfer file tier: job %s refused (%s); it is reported failed (further refusals are "
                             "only reported)", job.job_id, e)
            self._refusals_logged += 1
            self._rejected.append(TierJobResult(job_id=job.job_id, success=False, transfer_time=0.0, transfer_bytes=0,
                                               successful_keys=None))

    def get_finished_jobs(self) -> list[Any]:
        """vLLM's results of the jobs finished since the last call (a failed load names the keys that did load);
        stores that succeeded are reported as stored (``take_events``), every job is counted (``get_stats``)."""
        self._refused = 0
        results = self.store.poll()  # a chunk a load refused leaves the index here (``_removed``)
        lost = 0
        for r in results:
            self.meter.job(r.op, success=r.success, chunks=len(r.done_keys), nbytes=r.nbytes, seconds=r.seconds)
            if r.op == "load":
                lost += len(r.keys) - len(r.done_keys)
            elif r.success and self.events is not None:
                done = set(r.done_keys)
                self.events.stored([k for k in r.keys if k in done])
        self.meter.misses("unavailable", max(lost - self._refused, 0))
        rejected, self._rejected = self._rejected, []
        return rejected + [TierJobResult(job_id=r.job_id, success=r.success, transfer_time=r.seconds, transfer_bytes=r.nbytes,
                              successful_keys=None if r.success else (tuple(r.done_keys) or None))
                for r in results]

    def _removed(self, keys: Sequence[bytes], cause: str) -> None:
        """The store's report of ``keys`` leaving it (evicted, or refused by a load): events and misses."""
        if cause == "integrity":
            self._refused += len(keys)
            self.meter.misses("integrity", len(keys))
        if self.events is not None:
            self.events.removed(keys)

    def take_events(self) -> list[Any]:
        """vLLM's ``OffloadingEvent``s since the last call (none unless ``enable_kv_events`` and the engine's KV
        cache events are on): stored keys once durable, removed keys once evicted or refused."""
        return self.events.take() if self.events is not None else []

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """The metrics ``get_stats`` reports (``kvxfer.offload.vllm.metrics.METRICS``), as vLLM declares them."""
        return metric_definitions(OffloadingCounterMetadata, OffloadingGaugeMetadata, OffloadingHistogramMetadata)

    def get_stats(self) -> Any:
        """The store's counters since the last call, as vLLM's stats (summed into the engine's metrics)."""
        stats = OffloadingConnectorStats()
        add = {"counter": stats.increase_counter, "gauge": stats.set_gauge, "histogram": stats.observe_histogram}
        for name, kind, labels, value in self.meter.take(vars(self.store.stats), len(self.store.index), self.store.slots):
            add[kind](name, value, labels)
        return stats

    def has_pending_work(self) -> bool:
        """Whether jobs are queued, running or finished and not yet reported (vLLM keeps stepping until none is)."""
        return bool(self._rejected) or self.store.pending

    def touch(self, keys: Sequence[bytes], req_context: Any) -> None:
        """Mark ``keys`` recently used (eviction is LRU)."""
        self.store.touch(keys)

    def on_new_request(self, req_context: Any) -> Any:
        """vLLM's empty per-request context (the tier keeps none)."""
        return RequestOffloadingContext()

    def drain_jobs(self) -> None:
        """Block until every queued job has finished."""
        self.store.drain()

    def shutdown(self) -> None:
        """Drain and close the store."""
        self._close()  # drains: every store submitted is durable (or failed) before the engine goes


def _tiering_worker(spec: Any, kv_caches: Any) -> KvxferTieringWorker:
    """The KvxferTieringWorker of tiering ``spec`` over vLLM's ``kv_caches``, bound to this rank's view of vLLM's
    region."""
    import torch

    p, extra = spec.config.parallel, spec.extra_config
    kind = caches_device(spec, kv_caches)
    check_executor_device(extra.get("kvxfer_executor"), kind)
    rank = 0 if spec.replicated_layout else p.rank
    region = SharedOffloadRegion(engine_id=spec._engine_id, num_chunks=spec.num_chunks, rank=rank,
                                 kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
                                 cpu_page_size=spec.cpu_page_size_per_worker)
    try:
        canonical = bool(spec.config.canonical_layout)
        if canonical:
            spec._validate_canonical_refs(kv_caches)  # vLLM's certification: portable bytes or a refusal
        caches = read_caches(kv_caches, rank=p.rank, world_size=p.world_size, canonical=canonical,
                             replicated=bool(spec.replicated_layout))
        geometry = tiering_geometry(kv_caches, caches, num_chunks=spec.num_chunks, blocks_per_chunk=spec.blocks_per_chunk,
                                    row_bytes=spec.kv_bytes_per_chunk, rank_offset=rank * spec.cpu_page_size_per_worker)
        memory = region.base_tensor.numpy().view(np.uint8)
        worker = assemble_worker(worker_layout(caches, geometry), caches.device, (geometry, memory, None),
                                 extra.get("kvxfer_executor"), tp=caches.tp, pin=kind == "cuda", strict_pin=False,
                                 on_unpinned=_warn_unpinned)
    except BaseException:
        region.cleanup()
        raise
    _log.info("kvxfer is active (KvxferTieringOffloadingSpec): rank %d/%d on vLLM's primary tier (%d chunks of %d "
              "block(s), %d regions); config: %s", p.rank, p.world_size, spec.num_chunks, spec.blocks_per_chunk,
              len(caches.refs), config_summary(extra))
    out = KvxferTieringWorker(region, worker, TransferResult, stream=torch.cuda.current_stream if kind == "cuda" else None,
                              stats_path=stats_path(extra.get("kvxfer_stats_path"), p.rank, p.world_size),
                              pointers=device_pointers(kv_caches))
    out.stats.host_tier = "vllm-tiering"
    return out


def _warn_unpinned(reason: str) -> None:
    _log.warning("kvxfer: pinning vLLM's primary tier failed (%s); it stays pageable", reason)
