"""``KvxferOffloadingConnector``: vLLM's ``OffloadingConnector`` under which a failed copy costs a recompute, not
the engine, loaded by vLLM as ``kv_connector="KvxferOffloadingConnector"``,
``kv_connector_module_path="kvxfer.offload.vllm"`` (whose face loads this module on first access). Imports vLLM
(``api``).

vLLM's connector asserts that every transfer succeeded. This one keeps vLLM's bookkeeping as it is and adds:

- Worker side (every rank). The spec's worker is told to report failures (``report_failures``, on kvxfer's
  worker) and wrapped: a failed job is handed on to vLLM's connector worker as done, with no bytes, so vLLM
  releases it as usual, and is recorded. A failed load's device blocks are returned by
  ``get_block_ids_with_load_errors`` (one KV-cache group), or its request as a failed receive (several groups,
  whose block ids vLLM cannot map back to requests); vLLM then recomputes them under
  ``kv_load_failure_policy="recompute"``. Every failed job's id travels to the scheduler in the worker metadata
  (``KvxferWorkerMetadata.failed_jobs``, merged over the ranks).
- Scheduler side. The offloading manager is wrapped (``FailedTransfers``): it learns each job's keys from the
  specs it handed out (``prepare_store``, ``prepare_load``). A store that failed on any rank is completed with
  ``success=False``, so vLLM's manager removes its chunks instead of marking them loadable. The chunks of a load
  that failed are no longer found (``lookup`` misses them; vLLM's manager has no call that drops loadable
  chunks, so they stay until evicted, and a new store of the same key makes it loadable again): the retried
  request recomputes instead of loading bytes that failed once, which would fail again when they are bad. That
  also keeps vLLM 0.32 from admitting the retry as an async load, which it holds back until blocks for the request
  are free twice over (the request stays among its in-flight prefills), forever in a full cache.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

from .api import (
    KVCacheAccess,
    LookupResult,
    OffloadingConnector,
    OffloadingConnectorWorker,
    OffloadingManager,
    OffloadingWorker,
    OffloadingWorkerMetadata,
    TransferResult,
)
from .hooks import kv_cache_access as _access
from .hooks import may_load_async as _may_load_async
from .hooks import supports_sleep_mode as _sleep_mode
from .ledger import FailureLedger, WorkerFailures

__all__ = ["FailedTransfers", "FailureLedger", "FailureReports", "KvxferConnectorWorker", "KvxferOffloadingConnector",
           "KvxferWorkerMetadata", "WorkerFailures"]

_log = logging.getLogger("kvxfer.offload.vllm")


@dataclass
class KvxferWorkerMetadata(OffloadingWorkerMetadata):  # type: ignore[misc]
    """vLLM's ``OffloadingWorkerMetadata`` plus ``failed_jobs``: the ids of the jobs that failed on a worker
    since its last report (merged over the ranks by ``aggregate``), for the scheduler side of
    ``KvxferOffloadingConnector``."""

    failed_jobs: set[int] = field(default_factory=set)

    def aggregate(self, other: Any) -> Any:
        """vLLM's merge of two ranks' metadata, with the failed jobs of both (vLLM folds the ranks' metadata into the
        first one's: a rank without failures still carries this class)."""
        merged = OffloadingWorkerMetadata.aggregate(self, other)
        return KvxferWorkerMetadata(completed_jobs=merged.completed_jobs, transfer_stats=merged.transfer_stats,
                                    failed_jobs=self.failed_jobs | set(getattr(other, "failed_jobs", ())))


class FailureReports(OffloadingWorker):  # type: ignore[misc]
    """The spec's OffloadingWorker, whose failed jobs are handed on as done (no bytes, so they count in no
    transfer statistics) after ``on_result(job_id, success)`` saw every finished job. Same threading as the
    worker it wraps (vLLM's worker thread)."""

    def __init__(self, inner: Any, on_result: Callable[[int, bool], None]):
        self.inner, self._on_result = inner, on_result

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """The wrapped worker's ``submit_store``."""
        return bool(self.inner.submit_store(job_id, src_spec, dst_spec))

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """The wrapped worker's ``submit_load`` (``expedited`` handed on where set: 0.34's flag)."""
        if expedited:
            return bool(self.inner.submit_load(job_id, src_spec, dst_spec, expedited=True))
        return bool(self.inner.submit_load(job_id, src_spec, dst_spec))

    def get_finished(self) -> list[Any]:
        """The wrapped worker's results, each seen by ``on_result`` first; a failed job as a successful one with no bytes."""
        out = []
        for r in self.inner.get_finished():
            self._on_result(r.job_id, bool(r.success))
            out.append(r if r.success else TransferResult(job_id=r.job_id, success=True))
        return out

    def wait(self, job_ids: set[int]) -> None:
        """The wrapped worker's ``wait``."""
        self.inner.wait(job_ids)

    def shutdown(self) -> None:
        """The wrapped worker's ``shutdown``."""
        self.inner.shutdown()


class KvxferConnectorWorker(OffloadingConnectorWorker):  # type: ignore[misc]
    """vLLM's OffloadingConnectorWorker that records failed jobs (see the module) for the connector to report."""

    worker: Any  # the spec's OffloadingWorker (vLLM's attribute), wrapped once the caches are registered

    def __init__(self, spec: Any, vllm_config: Any, kv_cache_config: Any):
        super().__init__(spec, vllm_config, kv_cache_config)
        self.failures = WorkerFailures(len(kv_cache_config.kv_cache_groups))

    def register_kv_caches(self, kv_caches: Any) -> None:
        """vLLM's registration, then the spec's worker told to report failures (kvxfer's) and wrapped."""
        super().register_kv_caches(kv_caches)
        inner = self.worker
        if hasattr(inner, "report_failures"):  # kvxfer's worker raises JobFailedError unless told
            inner.report_failures()
        self.worker = FailureReports(inner, self.on_result)

    def start_kv_transfers(self, metadata: Any) -> None:
        """Remember each load job's request and device blocks, then vLLM's ``start_kv_transfers``."""
        for job_id, entry in metadata.load_jobs.items():
            self.failures.started(job_id, entry.req_id, entry.dst_spec.block_ids)
        super().start_kv_transfers(metadata)

    def on_result(self, job_id: int, success: bool) -> None:
        """Record a finished job (``WorkerFailures.on_result``)."""
        self.failures.on_result(job_id, success)

    def build_connector_worker_meta(self) -> Any:
        """vLLM's worker metadata as a KvxferWorkerMetadata carrying the jobs that failed since the last report."""
        out = super().build_connector_worker_meta()
        if out is None:  # nothing completed: failed jobs (always completed too) wait for the next report
            return None
        failed, self.failures.failed_jobs = self.failures.failed_jobs, set()
        return KvxferWorkerMetadata(completed_jobs=out.completed_jobs, transfer_stats=out.transfer_stats,
                                    failed_jobs=failed)


class _Passed:
    """The calls of vLLM's ``OffloadingManager`` that ``FailedTransfers`` hands to the manager it wraps (``inner``),
    as they are (a mixin before vLLM's abstract base, so these are the definitions its ABC sees)."""

    inner: Any

    def get_load_source(self, key: Any, req_context: Any) -> Any:
        return self.inner.get_load_source(key, req_context)

    def touch(self, keys: Collection[Any], req_context: Any) -> Any:
        return self.inner.touch(keys, req_context)

    def on_new_request(self, req_context: Any) -> Any:
        return self.inner.on_new_request(req_context)

    def on_request_finished(self, req_context: Any) -> Any:
        return self.inner.on_request_finished(req_context)

    def take_events(self) -> Any:
        return self.inner.take_events()

    def on_schedule_end(self, context: Any) -> Any:
        return self.inner.on_schedule_end(context)

    def has_pending_work(self) -> bool:
        return bool(self.inner.has_pending_work())

    def get_stats(self) -> Any:
        return self.inner.get_stats()

    def shutdown(self) -> Any:
        return self.inner.shutdown()


class FailedTransfers(_Passed, OffloadingManager):  # type: ignore[misc]
    """An ``OffloadingManager`` over vLLM's (``FailedTransfers(manager)``), told which jobs failed, as
    ``KvxferOffloadingConnector``'s scheduler side uses it: a failed store is completed with ``success=False`` (its
    chunks leave the index), a failed load's keys miss from then on, until a store of them is prepared anew.
    A job's keys are the ``keys_to_store`` of the ``prepare_store`` whose ``store_spec`` became a store job's
    ``dst_spec``, or the keys of the ``prepare_load`` whose spec became a load job's ``src_spec``: ``name_jobs(meta)``
    learns them after each ``build_connector_meta`` (vLLM's ``OffloadingConnectorMetadata``), ``fail(job_ids)`` marks
    them. Every other call is the manager's. Called from the scheduler's thread only, like the manager."""

    def __init__(self, inner: Any):
        self.inner, self.ledger = inner, FailureLedger()

    def name_jobs(self, meta: Any) -> None:
        """Learn the keys of this step's jobs (vLLM's OffloadingConnectorMetadata ``store_jobs``/``load_jobs``)."""
        self.ledger.name_jobs(meta)

    def fail(self, job_ids: Iterable[int]) -> None:
        """These jobs failed on some rank: a store completes unsuccessfully, a load's keys miss from now on."""
        self.ledger.fail(job_ids)

    def lookup(self, key: Any, req_context: Any) -> Any:
        """A miss for the key of a failed load, else the manager's answer."""
        return LookupResult.MISS if self.ledger.hides(key) else self.inner.lookup(key, req_context)

    def prepare_store(self, keys: Collection[Any], req_context: Any) -> Any:
        """The manager's store spec, remembered with its keys (which a failed load no longer hides)."""
        out = self.inner.prepare_store(keys, req_context)
        if out is not None and out.keys_to_store:
            self.ledger.handed[id(out.store_spec)] = (out.store_spec, frozenset(out.keys_to_store))
            self.ledger.missing.difference_update(out.keys_to_store)
        return out

    def prepare_load(self, keys: Collection[Any], req_context: Any) -> Any:
        """The manager's load spec, remembered with its keys."""
        out = self.inner.prepare_load(keys, req_context)
        self.ledger.handed[id(out)] = (out, frozenset(keys))
        return out

    def complete_store(self, keys: Collection[Any], req_context: Any, success: bool = True) -> None:
        """The manager's ``complete_store``, unsuccessful when the store of ``keys`` failed on some rank."""
        failed = self.ledger.store_failed(frozenset(keys))
        self.inner.complete_store(keys, req_context, success and not failed)

    def complete_load(self, keys: Collection[Any], req_context: Any) -> Any:
        """The manager's ``complete_load``; the job of ``keys`` is forgotten."""
        self.ledger.forget(frozenset(keys))
        return self.inner.complete_load(keys, req_context)

    def reset_cache(self) -> None:
        """Forget every job and failure, then the manager's ``reset_cache``."""
        self.ledger.clear()
        self.inner.reset_cache()


class KvxferOffloadingConnector(OffloadingConnector):  # type: ignore[misc]
    """vLLM's ``OffloadingConnector`` that survives failed copies, loaded with ``kv_connector``
    "KvxferOffloadingConnector" and ``kv_connector_module_path`` "kvxfer.offload.vllm" (any offloading spec;
    kvxfer's is told to report failures instead of raising). A failed load's device blocks are reported as load
    errors (``get_block_ids_with_load_errors``; with several KV-cache groups, whose block ids vLLM cannot map
    back, the request as a failed receive), which vLLM recomputes under ``kv_load_failure_policy="recompute"``
    (under "fail" the request ends with an error). A failed store is completed unsuccessfully in the scheduler's
    offloading manager, which drops its chunks from the index; the chunks of a failed load are no longer offered as
    hits. See ``kvxfer.offload.vllm.connector``."""

    connector_worker: Any  # vLLM's attributes: the worker side (worker role) and scheduler side (scheduler role)
    connector_scheduler: Any

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any):
        super().__init__(vllm_config, role, kv_cache_config)
        if self.connector_worker is not None:  # vLLM's, built by the base class: rebuilt as kvxfer's over its spec
            self.connector_worker = KvxferConnectorWorker(self.connector_worker.spec, vllm_config, kv_cache_config)
        if self.connector_scheduler is not None:
            self.connector_scheduler.manager = FailedTransfers(self.connector_scheduler.manager)
            policy = vllm_config.kv_transfer_config.kv_load_failure_policy
            if policy != "recompute":
                _log.info("kvxfer: kv_load_failure_policy is %r: a request whose load fails ends with an error "
                          "(\"recompute\" recomputes its blocks instead)", policy)

    @classmethod
    def kv_cache_access(cls, kv_transfer_config: Any) -> Any:
        """0.34: how kvxfer's workers reach the device KV cache (``hooks.kv_cache_access``), as vLLM's flags."""
        flags = KVCacheAccess.IN_PROCESS
        for name in _access(getattr(kv_transfer_config, "kv_connector_extra_config", None)):
            flags |= getattr(KVCacheAccess, name)
        return flags

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """0.33 on: whether kvxfer follows sleep mode's remap (``hooks.supports_sleep_mode``)."""
        return _sleep_mode(getattr(kv_transfer_config, "kv_connector_extra_config", None))

    def may_load_async(self, request: Any) -> bool:
        """0.34: whether this request may load while the batch is full (``hooks.may_load_async``)."""
        return _may_load_async(request, bool(super().may_load_async(request)))

    def build_connector_meta(self, scheduler_output: Any) -> Any:
        """vLLM's connector metadata; the scheduler's manager learns the keys of its jobs."""
        out = super().build_connector_meta(scheduler_output)
        self.connector_scheduler.manager.name_jobs(out)
        return out

    def update_connector_output(self, connector_output: Any) -> None:
        """The jobs that failed on any rank go to the scheduler's manager, then vLLM's ``update_connector_output``."""
        meta_in = connector_output.kv_connector_worker_meta
        if isinstance(meta_in, KvxferWorkerMetadata) and meta_in.failed_jobs:
            self.connector_scheduler.manager.fail(meta_in.failed_jobs)
        super().update_connector_output(connector_output)

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM's transfer results, with the requests whose loads failed (several KV-cache groups) as failed receives."""
        out = super().get_transfer_results(finished_req_ids)
        w = self.connector_worker
        if w is not None:
            failed, w.failures.failed_recving = w.failures.failed_recving, set()
            out.failed_recving |= failed
        return out

    def get_block_ids_with_load_errors(self) -> set[int]:
        """The device blocks of the loads that failed since the last call (one KV-cache group)."""
        w = self.connector_worker
        if w is None:
            return set()
        errors, w.failures.load_errors = w.failures.load_errors, set()
        return set(errors)
