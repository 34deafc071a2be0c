"""The worker side of kvxfer's vLLM backend without vLLM's base classes: ``WorkerCore`` turns vLLM's load/store
specs into jobs of a kvxfer ``OffloadWorker`` and its results into vLLM's ``TransferResult``; ``build_worker``
makes that OffloadWorker over the caches ``read_caches`` mapped and a host tier.
"""
from __future__ import annotations

import logging
import mmap
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import ExecutorSpec
from kvxfer.planner import Buffer, Layout, Location

from ..build import assemble_worker, host_memory
from ..checksums import ChecksumError, HostChecksums
from ..drain import drain_at_exit
from ..jobs import LOAD, JobResult, OffloadError
from ..tier import HOST_BUFFER, HostTier, host_region
from ..worker import OffloadWorker
from .caches import CacheMap
from .pointers import PointerError, PointerMap
from .stats import StatsFile, WorkerStats

__all__ = ["JobFailedError", "WorkerCore", "build_worker", "device_pointers"]

_log = logging.getLogger("kvxfer.offload.vllm")
_FAILURES_LOGGED = 10  # failed jobs logged one by one; past that only counted (WorkerStats)


class JobFailedError(RuntimeError):
    """A kvxfer job failed under vLLM's ``OffloadingConnector``, which cannot take a failed job: the engine stops
    (``KvxferOffloadingConnector`` takes it instead)."""

    def __init__(self, result: JobResult):
        self.result = result
        super().__init__(f"kvxfer offload job {result.job_id} ({result.op or result.direction.value}) failed: "
                         f"{result.error!r}; vLLM's OffloadingConnector cannot take a failed job, so the engine stops "
                         "(KvxferOffloadingConnector recomputes instead)")


class WorkerCore:
    """The worker side without vLLM's base class: vLLM's specs -> OffloadWorker jobs, results -> TransferResult.

    ``worker``: the OffloadWorker. ``result``: TransferResult's constructor. ``stream``: None (host memory,
    nothing to order), or a callable returning the compute stream jobs order after (``torch.cuda.current_stream``),
    called at each submission. ``pointers``: the PointerMap of the bound caches, which maps vLLM 0.34's
    ``DevicePointers`` jobs back to block ids (a job given as pointers without one raises PointerError); 0.32's
    and 0.33's specs carry block ids. ``stats_path``: the counters file (``StatsFile``), updated after each call of
    ``get_finished`` that finished jobs and at ``shutdown``. ``checksums``: check host chunks (``kvxfer_verify``):
    recorded when a store finishes, checked before a load is submitted; a load of a chunk that does not match is
    not submitted and is reported failed with a ChecksumError.

    A failed job raises JobFailedError from ``get_finished`` (vLLM's connector asserts success), until
    ``report_failures()`` is called (by ``KvxferOffloadingConnector``, before the first job): failed jobs are then
    returned as ``TransferResult(success=False)``, logged and counted.

    Threading: called from vLLM's worker thread only (one caller, as the connector does); the OffloadWorker's lanes
    run the copies and the StatsFile's thread writes the counters.
    """

    def __init__(self, worker: OffloadWorker, result: Callable[..., Any], *, stream: Callable[[], Any] | None = None,
                 stats_path: str | Path | None = None, checksums: HostChecksums | None = None,
                 pointers: PointerMap | None = None):
        self.worker, self._result, self._stream = worker, result, stream
        self.pointers = pointers
        self.stats = WorkerStats()
        self._blocks: dict[int, tuple[int, ...]] = {}
        self._stats = StatsFile(stats_path) if stats_path is not None else None
        self._checksums = checksums
        self._stored: dict[int, np.ndarray] = {}  # store jobs in flight -> their host chunks (with checksums)
        self._refused: list[JobResult] = []  # loads refused at submission, reported by the next get_finished
        self._report = False
        # drained once: by shutdown, or at interpreter exit (daemon lanes would otherwise drop accepted stores)
        self._drain = drain_at_exit(self._shutdown, f"kvxfer's vLLM worker ({type(self).__name__})")

    def report_failures(self) -> None:
        """From now on report failed jobs as failed TransferResults instead of raising JobFailedError."""
        self._report = True

    @staticmethod
    def _ids(spec: Any) -> np.ndarray:
        # vLLM's specs hold int32 numpy ids: handed on as they are (no copy here)
        ids = spec.block_ids
        return ids if isinstance(ids, np.ndarray) else np.asarray(ids)

    def _groups(self, gpu_spec: Any) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
        sizes, starts = getattr(gpu_spec, "group_sizes", None), getattr(gpu_spec, "block_indices", None)
        return (None if sizes is None else tuple(sizes)), (None if starts is None else tuple(starts))

    def _device(self, spec: Any) -> Any:
        """The device side of a job as block ids: a GPULoadStoreSpec as it is, 0.34's DevicePointers mapped."""
        if not hasattr(spec, "ptrs"):
            return spec
        if self.pointers is None:
            raise PointerError("ptrs", 0, "DevicePointers", "this worker was made without a PointerMap")
        return self.pointers.blocks(spec)

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Device blocks ``src_spec`` (vLLM's GPULoadStoreSpec, or 0.34's DevicePointers) -> host chunks
        ``dst_spec.block_ids``. True once queued; raises kvxfer's SubmissionError naming the job and the field when
        the spec does not fit (PointerError when the pointers do not)."""
        src_spec = self._device(src_spec)
        if self._checksums is None:
            return self._submit(self.worker.submit_store, job_id, src_spec, src_spec, dst_spec)
        chunks = self._ids(dst_spec)
        self._checksums.forget(chunks)  # rewritten from now on: a load must not pass on an old checksum
        ok = self._submit(self.worker.submit_store, job_id, src_spec, src_spec, dst_spec)
        self._stored[job_id] = chunks  # recorded when get_finished (this thread, later) reports the store
        return ok

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False) -> bool:
        """Host chunks ``src_spec.block_ids`` -> device blocks ``dst_spec`` (GPULoadStoreSpec or DevicePointers);
        see submit_store. ``expedited`` (0.34: the step waits on it): the OffloadWorker runs it ahead of queued
        work it does not conflict with. With checksums, chunks that do not match fail the job here, before any
        copy."""
        dst_spec = self._device(dst_spec)
        if self._checksums is not None and self._refuse_load(self._checksums, job_id, src_spec, dst_spec):
            return True
        return self._submit(self.worker.submit_load, job_id, dst_spec, src_spec, dst_spec, expedited)

    def _refuse_load(self, checksums: HostChecksums, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Check the load's host chunks; on a mismatch queue its failed result and return True."""
        t0 = time.perf_counter()
        bad = checksums.check(self._ids(src_spec))
        spent = time.perf_counter() - t0
        self.stats.verify_s += spent
        self.stats.host_s += spent
        if not bad:
            return False
        self.stats.loads_refused += 1
        self._blocks[job_id] = self._groups(dst_spec)[0] or (len(dst_spec.block_ids),)
        self._refused.append(JobResult(job_id, LOAD, False, 0, 0.0, 0, ChecksumError(bad), "load"))
        return True

    def _submit(self, submit: Callable[..., bool], job_id: int, gpu_spec: Any, src_spec: Any, dst_spec: Any,
                expedited: bool = False) -> bool:
        t0 = time.perf_counter()
        sizes, starts = self._groups(gpu_spec)
        extra = {"expedited": True} if expedited else {}
        ok = submit(job_id, self._ids(src_spec), self._ids(dst_spec), sizes, starts,
                    stream=self._stream() if self._stream else None, **extra)
        self._blocks[job_id] = sizes or (len(gpu_spec.block_ids),)
        self.stats.host_s += time.perf_counter() - t0
        return ok

    def get_finished(self) -> list[Any]:
        """TransferResults (bytes and seconds set) of the jobs finished since the last call, each once. A failed
        job raises JobFailedError (its cause chained), or after ``report_failures`` is returned with success False."""
        t0 = time.perf_counter()
        out = []
        try:
            refused, self._refused = self._refused, []
            for r in refused + self.worker.get_finished():
                out.append(self._finish(r))
        finally:
            self.stats.steps += 1
            self.stats.host_s += time.perf_counter() - t0
        if out and self._stats is not None:
            self._stats.update(self.stats.snapshot())
        return out

    def _finish(self, r: JobResult) -> Any:
        """The TransferResult of a finished job, counted (and its chunks' checksums recorded after a store)."""
        self.stats.record(r, self._blocks.pop(r.job_id, ()))
        chunks = self._stored.pop(r.job_id, None)
        if r.success:
            if chunks is not None and self._checksums is not None:
                t0 = time.perf_counter()
                self._checksums.record(chunks)
                self.stats.verify_s += time.perf_counter() - t0
            return self._result(job_id=r.job_id, success=True, transfer_size=r.nbytes, transfer_time=r.elapsed_s)
        if not self._report:
            raise JobFailedError(r) from r.error
        failed = self.stats.stores_failed + self.stats.loads_failed
        if failed <= _FAILURES_LOGGED:
            _log.warning("kvxfer offload job %d (%s) failed, reported to vLLM as failed%s: %r", r.job_id, r.op, "" if
                         failed < _FAILURES_LOGGED else " (further failures are only counted)", r.error)
        return self._result(job_id=r.job_id, success=False)

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the named jobs have finished (unknown or reported ids return at once)."""
        self.worker.wait(job_ids)

    def shutdown(self) -> None:
        """Drain every job, release the host memory, write the counters; raises kvxfer's OffloadError for
        failed jobs not yet reported (logged instead after ``report_failures``). Runs once: later calls return once
        the first is done. A process that exits without calling it drains at exit (``kvxfer.offload.drain``)."""
        self._drain()

    def _shutdown(self) -> None:
        self._checksums = None  # no view of the host memory outlives it
        try:
            self.worker.shutdown()
        except OffloadError as e:
            if not self._report:
                raise
            _log.warning("kvxfer offload jobs failed as the worker shut down: %s", e)
        finally:
            if self._stats is not None:
                self._stats.close(self.stats.snapshot())


def build_worker(caches: CacheMap, tier: HostTier, executor: ExecutorSpec, *, pin: bool, barrier: Callable[[], None] | None,
                 creator: bool) -> OffloadWorker:
    """An OffloadWorker over ``caches``: the host cells (a private tier, or the shared region that ``creator``
    makes and the other ranks attach after ``barrier``), committed (every page touched) by the rank that made
    them, one region per ref, pinned when ``pin``. Everything acquired is released if a step fails."""
    if tier.shared is not None and not creator and barrier is not None:
        barrier()  # the creator has made the region
    try:
        geometry, memory, region = host_memory(caches.device, tier, caches.tp)
        if creator or tier.shared is None:
            # commit the host rows now, as vLLM's own CPU tier does (zeroed tensors, a populated region): otherwise
            # the first store into each page pays its page fault inside an engine step
            memory[::mmap.PAGESIZE] = 0
    finally:
        if tier.shared is not None and creator and barrier is not None:
            barrier()  # made (or failed: the others then find no region and say so)
    try:
        regions = tuple(host_region(t, geometry, caches.tp).model_copy(update={"name": name}) for name, t in caches.refs)
        host = Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST)
        layout = Layout(buffers=(*caches.device.buffers, host), regions=regions, num_groups=caches.num_groups)
    except BaseException:
        if region is not None:
            region.close()
        raise
    return assemble_worker(layout, caches.device, (geometry, memory, region), executor, tp=caches.tp, pin=pin,
                           strict_pin=False, on_unpinned=_warn_unpinned)


def device_pointers(kv_caches: Any) -> PointerMap | None:
    """The PointerMap of vLLM's ``kv_caches`` where the running release hands workers DevicePointers (0.34 on),
    else None: the one place the wing's workers ask the version."""
    from .api import TRAITS  # vLLM's release, checked when api was imported

    return PointerMap.from_kv_caches(kv_caches) if TRAITS.device_pointers else None


def _warn_unpinned(reason: str) -> None:
    _log.warning("kvxfer: pinning the host tier failed (%s); it stays pageable", reason)
