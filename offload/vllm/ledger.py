"""What failed, without vLLM: the worker side's record of failed jobs (``WorkerFailures``) and the scheduler
side's (``FailureLedger``), which ``kvxfer.offload.vllm.connector`` keeps under vLLM's classes."""
from __future__ import annotations

import logging
from collections.abc import Iterable
from typing import Any

__all__ = ["FailureLedger", "WorkerFailures"]

_log = logging.getLogger("kvxfer.offload.vllm")


class WorkerFailures:
    """One rank's failed jobs since its last report. A failed load's device blocks go to ``load_errors`` (vLLM
    maps them back to requests with one KV-cache group), or, with several groups (whose block ids vLLM cannot map
    back), its request to ``failed_recving``; every failed job's id to ``failed_jobs``. vLLM's worker thread only."""

    def __init__(self, groups: int):
        self.by_request = groups > 1
        self.loads: dict[int, tuple[str, list[int]]] = {}  # load job -> (request, device blocks), until finished
        self.load_errors: set[int] = set()
        self.failed_recving: set[str] = set()
        self.failed_jobs: set[int] = set()

    def started(self, job_id: int, req_id: str, blocks: Iterable[int]) -> None:
        """A load job of request ``req_id`` into device ``blocks`` was submitted."""
        self.loads[job_id] = (req_id, [int(b) for b in blocks])

    def on_result(self, job_id: int, success: bool) -> None:
        """Record a finished job: a failed load's blocks (or its request, with several groups) and every failed job."""
        load = self.loads.pop(job_id, None)
        if success:
            return
        self.failed_jobs.add(job_id)
        if load is None:
            return
        if self.by_request:
            self.failed_recving.add(load[0])
        else:
            self.load_errors.update(load[1])


class FailureLedger:
    """The scheduler side's record of which jobs failed (``FailedTransfers`` keeps one; no vLLM needed): the keys of
    each job of the step (from the specs the manager handed out, matched when the step's metadata names the jobs),
    stores that failed (completed unsuccessfully when vLLM completes them) and keys of failed loads (misses until a
    store of them is prepared anew). Scheduler thread only."""

    def __init__(self) -> None:
        self.handed: dict[int, tuple[Any, frozenset[Any]]] = {}  # id(spec) -> (spec, keys), this step's
        self.jobs: dict[int, tuple[bool, frozenset[Any]]] = {}  # job -> (is a store, keys), until completed
        self.failed_stores: set[frozenset[Any]] = set()
        self.missing: set[Any] = set()  # keys of failed loads

    def name_jobs(self, meta: Any) -> None:
        """Learn the keys of this step's jobs (vLLM's OffloadingConnectorMetadata ``store_jobs``/``load_jobs``)."""
        for jobs, store in ((meta.store_jobs, True), (meta.load_jobs, False)):
            for job_id, job in jobs.items():
                handed = self.handed.get(id(job.dst_spec if store else job.src_spec))
                if handed is not None:
                    self.jobs[job_id] = (store, handed[1])
        self.handed.clear()

    def fail(self, job_ids: Iterable[int]) -> None:
        """These jobs failed on some rank: a store completes unsuccessfully, a load's keys miss from now on."""
        for job_id in job_ids:
            entry = self.jobs.get(job_id)
            if entry is None:  # not a job of this step's specs (a reset cache discarded it)
                continue
            store, keys = entry
            if store:
                self.failed_stores.add(keys)
            else:
                self.missing |= keys
                _log.warning("kvxfer: a load of %d chunk(s) failed; they are no longer offered as hits", len(keys))

    def hides(self, key: Any) -> bool:
        """Whether ``key`` must miss: a load of it failed and no store of it was prepared since."""
        return key in self.missing

    def store_failed(self, keys: frozenset[Any]) -> bool:
        """Whether the store of ``keys`` failed (then it is forgotten); the job of ``keys`` is forgotten either way."""
        failed = keys in self.failed_stores
        if failed:
            self.failed_stores.discard(keys)
            _log.warning("kvxfer: a store of %d chunk(s) failed; they are dropped from the host tier's index", len(keys))
        self.forget(keys)
        return failed

    def forget(self, keys: frozenset[Any]) -> None:
        """Drop the jobs that moved ``keys``: their outcome has been handed to the manager."""
        self.jobs = {j: v for j, v in self.jobs.items() if v[1] != keys}

    def clear(self) -> None:
        """Forget every job, failed store and missing key (the connector was reset)."""
        self.handed.clear()
        self.jobs.clear()
        self.failed_stores.clear()
        self.missing.clear()
