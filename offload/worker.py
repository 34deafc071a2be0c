"""OffloadWorker: store (device -> host) and load (host -> device) jobs for a serving engine's loop, and spill
(host -> a lower tier) and restore (back) jobs once a lower tier is attached (``attach_tier``; the file tier:
``kvxfer.offload.attach_files``).

The worker plans each job, holds the lock, runs the lanes and waits; which job may start, what it is ordered
after and what its outcome is are its job graph's (``graph.JobGraph``, a pure value the worker feeds events):

- Each kind of job runs in a lane, in submission order (``lanes``). A job that conflicts with a pending job of
  another lane (one writes a device block, host chunk or tier slot the other reads or writes: ``jobs``) is
  ordered after it. That is the one dependency mechanism: the executor receives the transfers a job is ordered
  after as ``after`` (``Executor.run(plan, bound, stream, after)``), which it honours on the device where it can.
  A job waiting for a job of a host lane (a lower tier, a synchronous executor) is not issued until that job has
  ended, so submitting never blocks; ``wait``, ``wait_for_layer`` and ``stream_wait_for_layer`` wait for such a
  job to be issued first. The result equals a sequential replay in submission order.
- Failures reach the jobs that depend on them: a job that reads bytes a failed job was to write (the last pending
  writer of an id it reads) is reported failed with a DependencyError naming that job, and it copies nothing when
  the failure is known before it starts (when it is known only later, on a GPU, its copies ran and its result is
  still a failure). A job that only overwrites what a failed job read or wrote is ordered after it, not failed.

The caller's stream goes to the executor with every job: resolved on the submitting thread (None: that thread's
current stream), so a store never reads blocks that compute queued before it is still writing.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, TypeAlias

import numpy as np

from kvxfer.executors import BoundMemory, ExecutorSpec, PlanRunner, Stream, coerce_executor, stream_handle
from kvxfer.planner import BlockMapping, Direction, Layout, Location, PlanError, PlanOptions, TransferPlan, plan_transfer

from .graph import DependencyError, JobGraph
from .jobs import (
    LOAD,
    RESTORE,
    SPILL,
    STORE,
    TIER_OPS,
    Job,
    JobResult,
    OffloadError,
    SubmissionError,
    WorkerClosedError,
    touched,
)
from .lanes import ExecutorLane, IssueLane, ThreadLane, TierLane, run
from .tier import Geometry

__all__ = ["DependencyError", "JobResult", "OffloadError", "OffloadWorker", "SubmissionError", "WorkerClosedError"]

Ids: TypeAlias = Sequence[int] | np.ndarray
Lane: TypeAlias = IssueLane | ThreadLane


class OffloadWorker:
    """Store and load jobs over one layout (device buffers and the host tier), bound once.

    ``layout``/``bindings``: every buffer the jobs touch and its memory. ``executor``: anything
    ``kvxfer.executors.coerce_executor`` takes: an Executor (shared by both directions, the caller's), a
    zero-argument factory, or an ExecutorConfig / dict / path / None for ``kvxfer.executors.get_executor`` (auto:
    the GPU's DMA executor, or the NumPy executor without a GPU); factories and configs build one executor per
    direction, closed by ``shutdown``. A non-synchronous executor (``Executor.synchronous`` False) must complete
    its runs in the order they were issued, as every kvxfer GPU executor does. Which rank stores which pages is the
    layout's: ``Region.num_writers/writer_index`` (a replicated region rotates writers over the TP ranks, see
    ``tier.host_region``), so each job is one plan. ``regions_per_layer``: regions per layer for per-layer load
    completion (None: whole jobs only). ``on_close``: callables run last by ``shutdown`` (releasing host memory).
    Ids are bounded by the layout: each placement's ``num_blocks`` where it states one (a KV tensor's blocks, the
    host tier's chunks), else its buffer; an id past them is refused by the planner (SubmissionError naming the
    id). ``host``/``geometry``: the host rows and their Geometry, for a lower tier (``attach_files``;
    ``create_worker`` passes them).

    Threading contract:

    - Every public method may be called from any thread, concurrently with any other (an engine usually calls
      from one). A submission racing ``shutdown`` either is accepted (returns True), and is then run and
      reported before ``shutdown`` returns, or raises WorkerClosedError. ``get_finished`` reports each accepted
      job exactly once.
    - One lock, ``_lock``, guards all bookkeeping: the job graph, the pending jobs, the sequence counter, the
      closed flag, every issue lane's ``mark`` and every job's state (``ready``, ``transfer``, ``mark``,
      ``after``, ``error``, ``elapsed_s``, ``ended``). It is held to accept a job (the graph orders it and the
      jobs that may start are issued or queued in one step, so every lane sees its jobs in order), to issue on a
      non-synchronous executor (whose ``run`` only enqueues), to poll for completion, to record a job's end and
      to retire jobs. It is never held while anything is awaited: a copy, a lower tier's job, a lane thread, a
      synchronous executor's run.
    - Planning a submission is pure and runs outside the lock; the job id is checked before planning and again
      when the job is accepted.
    - Lane threads (one per direction on a synchronous executor, one for a lower tier) each run their lane's jobs
      in order, each handed over once the graph let it start; they take the lock only to record the outcome and
      start what was waiting for it.
    - ``get_finished`` only polls, so it never blocks; ``wait``, ``wait_for_layer``, ``stream_wait_for_layer`` and
      ``shutdown`` block without the lock.
    - No wait polls (a lane thread shares the GIL with the engine's threads): a waiter blocks on the job's ``ready``
      Event, set under the lock as soon as the job was issued or has run, then once on its transfer's own ``wait``;
      a lane thread blocks on its queue's Condition, which ``submit`` and ``close`` notify. So a blocked thread
      takes no CPU, and wakes when the job finishes.
    """

    def __init__(self, layout: Layout, bindings: Mapping[str, Any], executor: ExecutorSpec = None, *,
                 regions_per_layer: int | None = 1, max_descriptors: int | None = None,
                 on_close: Sequence[Callable[[], Any]] = (), host: np.ndarray | None = None,
                 geometry: Geometry | None = None):
        self.layout = layout
        self.host, self.geometry = host, geometry
        self._executors, self._owned = self._make_executors(executor)
        self.target = self._executors[STORE].target
        self.regions_per_layer = regions_per_layer
        base = PlanOptions(max_descriptors=max_descriptors)
        self._options = {STORE: base, LOAD: base.model_copy(update={"regions_per_call": regions_per_layer})}
        self._on_close = list(on_close)
        self._chunked, self._groups = layout.chunked, layout.group_count
        self._device = next((b.device for b in layout.buffers if b.location is Location.DEVICE), 0)
        self._lock = threading.Lock()
        self._graph = JobGraph()
        self._jobs: dict[int, Job] = {}  # accepted and not yet reported
        self._drained: list[Job] = []  # retired by shutdown, not yet reported
        self._seq = 0
        self._closed = False
        self._shut = threading.Event()  # set once shutdown has finished
        self._tier: TierLane | None = None  # set by attach_tier
        self._bound: dict[Direction, BoundMemory] = {}
        self._lanes: dict[Direction, Lane] = {}
        try:
            for d in (STORE, LOAD):
                lane = self._lanes[d] = self._lane(d, bindings)
                self._graph.add_lane(lane.name, lane.issues)
        except BaseException:  # what was made so far; the host memory is the caller's (on_close is not run)
            self._close_lanes(on_close=False)
            raise

    def _lane(self, d: Direction, bindings: Mapping[str, Any]) -> Lane:
        ex = self._executors[d]
        bound = self._bound[d] = ex.bind(self.layout, bindings)
        if ex.synchronous:
            lane = ExecutorLane(d.value, ex, bound)
            lane.step = self._step
            return lane
        empty = BlockMapping(direction=d, src_ids=[], dst_ids=[], group_sizes=(0,) * self._groups)
        return IssueLane(d.value, ex, bound, plan_transfer(self.layout, empty, self.target, self._options[d]))

    @staticmethod
    def _make_executors(executor: ExecutorSpec) -> tuple[dict[Direction, PlanRunner], list[PlanRunner]]:
        """One executor per direction (the same given one for both, or one made per direction: one copy stream
        each; ``auto`` made as the kind this platform runs, since a worker's jobs need one fixed executor), and
        those the worker made and closes."""
        source = coerce_executor(executor)
        made: dict[Direction, PlanRunner] = {}
        owned: list[PlanRunner] = []
        try:
            for d in (STORE, LOAD):
                made[d], mine = source.make(one_kind=True)
                if mine:
                    owned.append(made[d])
        except BaseException:
            for ex in owned:
                ex.close()
            raise
        return made, owned

    # ---- submitting -----------------------------------------------------------------------------------------
    def submit_store(self, job_id: int, device_ids: Ids, host_ids: Ids, group_sizes: Sequence[int] | None = None,
                     group_starts: Sequence[int] | None = None, *, stream: Stream = None) -> bool:
        """Copy device blocks ``device_ids`` into host chunks ``host_ids`` (per group: ``group_sizes`` blocks
        from logical block ``group_starts``). Returns True once accepted; raises SubmissionError (nothing queued)
        or WorkerClosedError. ``stream``: the compute stream the copy waits for (None: the submitting thread's
        current stream), in any form the executor takes (an int handle, a torch stream)."""
        return self._submit(STORE, job_id, device_ids, host_ids, group_sizes, group_starts, stream, False)

    def submit_load(self, job_id: int, host_ids: Ids, device_ids: Ids, group_sizes: Sequence[int] | None = None,
                    group_starts: Sequence[int] | None = None, *, stream: Stream = None, expedited: bool = False) -> bool:
        """Copy host chunks ``host_ids`` into device blocks ``device_ids``; see ``submit_store``. ``expedited``: the
        load may start before queued loads it does not conflict with (results still come in submission order)."""
        return self._submit(LOAD, job_id, host_ids, device_ids, group_sizes, group_starts, stream, bool(expedited))

    def attach_tier(self, lane: TierLane) -> None:
        """Use ``lane`` (a lower tier: ``lanes.TierLane``; the file tier's is built by ``kvxfer.offload.attach_files``)
        for spills and restores. Raises WorkerClosedError after shutdown, ValueError when one is already attached."""
        with self._lock:
            if self._closed:
                raise WorkerClosedError("the worker was shut down")
            if self._tier is not None:
                raise ValueError("a file tier is already attached")
            lane.step = self._step
            self._graph.add_lane(lane.name, lane.issues)
            self._tier = lane

    attach_files = attach_tier  # the name ``kvxfer.offload.attach_files`` called before lower tiers had one

    def submit_spill(self, job_id: int, chunk_ids: Ids) -> bool:
        """Write host chunks ``chunk_ids`` to the lower tier, after in-flight jobs writing them. Returns True once
        accepted; raises SubmissionError (nothing queued) or WorkerClosedError."""
        return self._submit_tier(SPILL, job_id, chunk_ids)

    def submit_restore(self, job_id: int, chunk_ids: Ids) -> bool:
        """Read host chunks ``chunk_ids`` back from the lower tier, after in-flight stores and loads touching them;
        later stores and loads of these chunks are ordered after it. A chunk not spilled, stale or torn fails the
        job, and the loads that read it."""
        return self._submit_tier(RESTORE, job_id, chunk_ids)

    def _submit_tier(self, op: str, job_id: Any, chunk_ids: Ids) -> bool:
        job_id = self._check_id(job_id)
        tier = self._tier
        if tier is None:
            raise SubmissionError(job_id, "op", op, "no file tier attached (kvxfer.offload.attach_files)")
        plan, chunks = tier.plan(job_id, op, chunk_ids)
        reads, writes = touched(op, np.zeros(0, np.int64), chunks, tier.space)
        self._accept(Job(job_id, op, TIER_OPS[op], plan), tier, reads, writes, False)
        return True

    def _check_id(self, job_id: Any) -> int:
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise SubmissionError(job_id, "job_id", job_id, "must be an integer")
        checked = int(job_id)
        with self._lock:
            self._refuse(checked)
        return checked

    def _refuse(self, job_id: int) -> None:
        """Raise unless a job ``job_id`` may be accepted now (under the lock)."""
        if self._closed:
            raise WorkerClosedError(f"job {job_id!r}: the worker was shut down")
        if job_id in self._jobs:
            raise SubmissionError(job_id, "job_id", job_id, "a job with this id is still pending (in flight or not "
                                  "yet returned by get_finished)")

    def _submit(self, direction: Direction, job_id: Any, src: Ids, dst: Ids, sizes: Sequence[int] | None,
                starts: Sequence[int] | None, stream: Stream, expedited: bool) -> bool:
        job_id = self._check_id(job_id)
        plan = self._plan(direction, job_id, src, dst, sizes, starts)
        dev, host = (dst, src) if direction is LOAD else (src, dst)  # valid ids: the plan was made from them
        op = "load" if direction is LOAD else "store"
        device_ids, host_ids = (np.unique(np.asarray(ids, dtype=np.int64)) for ids in (dev, host))
        reads, writes = touched(op, device_ids, host_ids)
        layer_calls = None
        if direction is LOAD and self.regions_per_layer:
            layer_calls = plan.region[plan.call_offsets[:-1]].astype(np.int64) // self.regions_per_layer \
                if plan.num_calls else np.zeros(0, np.int64)
        resolved = stream if stream is not None else stream_handle(None, self._device)  # on this thread
        self._accept(Job(job_id, op, direction, plan, resolved, layer_calls), self._lanes[direction], reads, writes,
                     expedited)
        return True

    def _plan(self, direction: Direction, job_id: int, src: Ids, dst: Ids, sizes: Sequence[int] | None,
              starts: Sequence[int] | None) -> TransferPlan:
        names = {"src_ids": "host_ids", "dst_ids": "device_ids"} if direction is LOAD else \
                {"src_ids": "device_ids", "dst_ids": "host_ids"}
        if sizes is None and self._chunked and self._groups == 1:
            try:  # one group of every device block listed, from a chunk boundary
                sizes = (len(dst if direction is LOAD else src),)
            except TypeError:
                pass
        try:  # numpy id arrays take the planner's hot path (checked, not copied); anything else is validated
            mapping = {"direction": direction, "src_ids": src, "dst_ids": dst,
                       "group_sizes": None if sizes is None else tuple(sizes),
                       "group_starts": None if starts is None else tuple(starts)}
            return plan_transfer(self.layout, mapping, self.target, self._options[direction])
        except PlanError as e:
            head, _, rest = e.field.partition(".")
            raise SubmissionError(job_id, names.get(head, head) + (f".{rest}" if rest else ""), e.value, e.reason,
                                  e.index) from None
        except (TypeError, ValueError) as e:
            raise SubmissionError(job_id, "group_sizes/group_starts", (sizes, starts), str(e)) from None

    def _accept(self, job: Job, lane: Lane, reads: Any, writes: Any, expedited: bool) -> None:
        """Accept ``job`` into ``lane``: one step under the lock (or WorkerClosedError / SubmissionError)."""
        with self._lock:
            self._refuse(job.job_id)
            job.seq, self._seq, job.lane = self._seq, self._seq + 1, lane
            self._jobs[job.job_id] = job
            self._start(self._graph.accept(job.job_id, lane.name, job.op, reads, writes, expedited=expedited))

    # ---- starting and ending (under the lock, never blocking) --------------------------------------------------
    def _start(self, job_ids: Iterable[int]) -> None:
        """Start the jobs the graph let start, in its order, and those their starts and ends let start: fail one
        without running it when a job it reads from is known to have failed (polling those first), else issue it
        (issue lanes) or hand it to its lane's thread. Under the lock."""
        queue = deque(job_ids)
        interrupt: BaseException | None = None
        while queue:
            job = self._jobs[queue.popleft()]
            while (polled := self._poll(self._graph.unsettled(job.job_id))) is not None:
                queue += polled
            failure = self._graph.failure(job.job_id)
            lane = job.lane
            if failure is not None:  # it copies nothing; successors of its lane order after the lane's last mark
                job.error, job.ended = failure, True
                if isinstance(lane, IssueLane):
                    job.mark = lane.mark
                job.ready.set()
                queue += self._graph.settle(job.job_id, failure)
                continue
            after = [d.mark for d in map(self._jobs.__getitem__, self._graph.after(job.job_id))
                     if d.lane.issues and d.mark is not None]
            if isinstance(lane, ThreadLane):
                job.after = after
                lane.submit(job)
                continue
            queue += self._issue(lane, job, after)
            if job.error is not None and not isinstance(job.error, Exception):
                interrupt = interrupt or job.error
        if interrupt is not None:
            raise interrupt

    def _issue(self, lane: IssueLane, job: Job, after: list[Any]) -> list[int]:
        """Run ``job`` on its lane's executor (which only issues); when the run raises (nothing or part of the plan
        issued), an empty run for later jobs to order after. The jobs that start now. Under the lock."""
        started: list[int] = []
        try:
            job.transfer = job.mark = run(lane.executor, job.plan, lane.bound, job.stream, after)
        except BaseException as e:
            job.error = e
            try:
                job.transfer = job.mark = run(lane.executor, lane.barrier, lane.bound, job.stream, ())
            except Exception:
                job.mark = lane.mark
            if job.transfer is None:  # nothing runs: it has ended
                job.ended = True
                started = self._graph.settle(job.job_id, e)
            else:  # ordered until the empty run completes
                self._graph.fail(job.job_id, e)
        lane.mark = job.mark
        job.ready.set()
        return started

    def _step(self, lane: ThreadLane, job: Job) -> None:
        """Run one job of a thread lane, on its thread (the graph let it start), then record its end and start what
        was waiting for it."""
        error: BaseException | None = None
        seconds = 0.0
        try:
            seconds = lane.execute(job, job.after)
        except BaseException as e:  # reported on the job, never raised on the lane's thread
            error = e
        finally:
            with self._lock:
                job.error, job.elapsed_s, job.ended, job.after = error, seconds, True, []
                job.ready.set()
                self._start(self._graph.settle(job.job_id, error))

    def _copies_done(self, job: Job) -> bool:
        """Whether issued ``job``'s copies completed (recording their error and time). Never blocks."""
        t = job.transfer
        try:
            if not t.done():
                return False
            t.wait()  # done: sets the measured time without blocking
            if job.error is None:
                job.elapsed_s = t.elapsed_s or 0.0
        except Exception as e:
            job.error = job.error or e
        return True

    def _poll(self, job_ids: Iterable[int]) -> list[int] | None:
        """End every issued job of ``job_ids`` whose copies completed; the jobs that start now, or None when none
        ended. Under the lock."""
        started: list[int] | None = None
        for jid in job_ids:
            job = self._jobs[jid]
            if job.lane.issues and not job.ended and job.transfer is not None and self._copies_done(job):
                job.ended = True
                started = [*(started or ()), *self._graph.settle(jid, job.error)]
        return started

    def _retire(self) -> list[Job]:
        """End the issued jobs whose copies completed (each issue lane in order, up to its first one still copying),
        start what that lets start, then take the graph's final jobs, each with its outcome. Under the lock."""
        started: list[int] = []
        for lane in self._lanes.values():
            if lane.issues:
                for jid in self._graph.started(lane.name):
                    job = self._jobs[jid]
                    if job.ended or job.transfer is None or not self._copies_done(job):
                        break
                    job.ended = True
                    started += self._graph.settle(jid, job.error)
        self._start(started)
        out = []
        for jid, error in self._graph.retire():
            job = self._jobs[jid]
            job.error = error
            out.append(job)
        return out

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, in submission order within each lane (a lane stops at
        its first unfinished job). A failed job is reported with its error. Never blocks."""
        with self._lock:
            jobs = sorted(self._drained + self._retire(), key=lambda j: j.seq)
            self._drained = []
            for j in jobs:
                del self._jobs[j.job_id]
            return [j.result() for j in jobs]

    # ---- waiting (without the lock) ---------------------------------------------------------------------------
    def _job(self, job_id: int) -> Job:
        with self._lock:
            job = self._jobs.get(int(job_id))
        if job is None:
            raise KeyError(f"job {job_id!r} is not pending (never submitted, or already returned by get_finished)")
        return job

    def _block(self, job: Job) -> None:
        """Block until ``job`` has finished (issued first, if it waits for a host lane's job), and record what its
        transfer reports."""
        job.ready.wait()
        t = job.transfer
        if not job.lane.issues or t is None:
            return
        error: Exception | None = None
        try:
            t.wait()
        except Exception as e:
            error = e
        with self._lock:
            if not job.ended:
                job.ended = True
                if error is not None:
                    job.error = job.error or error
                elif job.error is None:
                    job.elapsed_s = t.elapsed_s or 0.0
                self._start(self._graph.settle(job.job_id, job.error))

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished (ids no longer pending return at once); collect their
        results with ``get_finished``."""
        for jid in sorted(int(j) for j in job_ids):
            with self._lock:
                job = self._jobs.get(jid)
            if job is not None:
                self._block(job)

    def _layer_call(self, job: Job, layer: int) -> tuple[Any, int] | None:
        if not job.lane.issues or job.error is not None or job.transfer is None or job.layer_calls is None \
                or not len(job.layer_calls):
            return None
        c = int(np.searchsorted(job.layer_calls, layer, side="right")) - 1
        return job.transfer, max(c, 0)

    def wait_for_layer(self, job_id: int, layer: int) -> None:
        """Block until layer ``layer`` (regions ``layer*regions_per_layer ...``) of load ``job_id`` has arrived
        (the whole job on a host lane). KeyError when the job is not pending."""
        job = self._job(job_id)
        job.ready.wait()
        hit = self._layer_call(job, int(layer))
        if hit is None:
            self._block(job)
        else:
            hit[0].wait_call(hit[1])

    def stream_wait_for_layer(self, job_id: int, layer: int, stream: Stream) -> None:
        """Make ``stream`` wait, on the device, until layer ``layer`` of load ``job_id`` has arrived (a job not yet
        issued is waited for on the host until it is; on a host lane the host waits for the whole job instead).
        KeyError when the job is not pending."""
        job = self._job(job_id)
        job.ready.wait()
        hit = self._layer_call(job, int(layer))
        if hit is not None:
            hit[0].stream_wait(stream, hit[1])
        elif not job.lane.issues:
            self._block(job)
        elif job.mark is not None:
            job.mark.stream_wait(stream, -1)

    # ---- shutting down ----------------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Refuse new jobs, drain every accepted one, release the lower tier, bound memory and executors, then the
        host memory. Raises OffloadError for failed jobs not yet reported; their results stay in ``get_finished``.
        A second call waits for the first to finish and returns."""
        with self._lock:
            first, self._closed = not self._closed, True
            jobs = list(self._jobs.values())
        if not first:
            self._shut.wait()
            return
        try:
            for job in jobs:
                self._block(job)
            with self._lock:
                self._drained += self._retire()
                failed = [j.result() for j in self._drained if j.error is not None]
            self._close_lanes(on_close=True)
        finally:
            self._shut.set()
        if failed:
            raise OffloadError(failed)

    def _close_lanes(self, on_close: bool) -> None:
        try:
            if self._tier is not None:
                self._tier.close()
            for lane in self._lanes.values():
                lane.close()
            for bound in self._bound.values():
                bound.close()
            for ex in self._owned:
                ex.close()
        finally:
            for close in self._on_close if on_close else ():
                close()

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
