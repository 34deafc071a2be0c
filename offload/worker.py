"""OffloadWorker: store (device -> host) and load (host -> device) jobs for a serving engine's loop.

Each direction is a lane whose jobs complete in submission order. A job that touches host chunks or device
blocks that an in-flight job of the other direction also touches is ordered after that job (the newest such
one; lanes are in order, so that covers the older ones), which makes the result equal a sequential replay
in submission order. Jobs are planned at submission, so a bad submission raises before anything is queued.

With a file tier attached (``kvxfer.offload.files.attach_files``), spill and restore jobs run in submission
order on their own thread. A file job waits for the newest in-flight store (spill) or store and load
(restore) touching its chunks; a store or load submitted while a file job touching its host chunks is in
flight waits for that file job (host lanes: on the lane's thread; GPU lanes: on the host, at submission).

Two lane kinds, chosen by the executor:
- GPU executors with a runtime (CUDA/HIP batch): ``submit`` issues at once on the lane's executor, whose copy
  stream waits for the caller's compute stream and for the lane's previous job. A cross-direction dependency
  goes through a pooled gate stream that waits for compute and for the other job's end, on the device.
- Anything else (the NumPy executor): a background thread per lane runs the jobs in order, waiting on the
  host for a dependency, so submission stays asynchronous.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.executors.dma import check, stream_handle
from kvxfer.planner import BlockMapping, Direction, Layout, PlanError, PlanOptions, TransferPlan, plan_transfer

from .tier import TPRank

STORE, LOAD = Direction.D2H, Direction.H2D


class SubmissionError(ValueError):
    """A submission that cannot be planned; names the job, the field and the value. Nothing was queued."""

    def __init__(self, job_id: Any, field: str, value: Any, reason: str, index: int | None = None):
        self.job_id, self.field, self.value, self.reason, self.index = job_id, field, value, reason, index
        where = field if index is None else f"{field}[{index}]"
        super().__init__(f"job {job_id!r}: {where} = {value!r}: {reason}")


class WorkerClosedError(RuntimeError):
    """The worker was shut down; it takes no more jobs."""


class OffloadError(RuntimeError):
    """Jobs failed and were not yet reported through ``get_finished``; ``results`` holds them."""

    def __init__(self, results: list[JobResult]):
        self.results = results
        kind = [r.op if r.op in ("spill", "restore") else r.direction.value for r in results]
        super().__init__("; ".join(f"job {r.job_id} ({k}) failed: {r.error}" for r, k in zip(results, kind)))


@dataclass(frozen=True)
class JobResult:
    """What happened to one job. ``error`` is the exception of a failed job (``success`` False). ``op``: "store",
    "load", "spill" (host -> file, ``direction`` d2h) or "restore" (file -> host, ``direction`` h2d)."""

    job_id: int
    direction: Direction
    success: bool
    nbytes: int
    elapsed_s: float
    num_ranges: int
    error: BaseException | None = None
    op: str = ""


class Pool:
    """Reusable handles (streams, events): ``acquire`` takes a free one or makes a new one, so it never
    blocks; ``release`` returns it; ``clear`` destroys every handle made. ``made`` counts creations."""

    def __init__(self, make: Callable[[], Any], destroy: Callable[[Any], Any] = lambda h: None):
        self._make, self._destroy = make, destroy
        self._free: list[Any] = []
        self._all: list[Any] = []

    @property
    def made(self) -> int:
        """Number of handles made since the last ``clear``."""
        return len(self._all)

    def acquire(self) -> Any:
        """A free handle, or a newly made one when none is free."""
        if self._free:
            return self._free.pop()
        h = self._make()
        self._all.append(h)
        return h

    def release(self, handle: Any) -> None:
        """Return ``handle`` to the free list."""
        self._free.append(handle)

    def clear(self) -> None:
        """Destroy every handle made (free or not) and forget them."""
        for h in self._all:
            self._destroy(h)
        self._all.clear()
        self._free.clear()


@dataclass(eq=False)
class _Job:
    job_id: int
    seq: int
    direction: Direction
    plan: TransferPlan
    device_ids: np.ndarray  # sorted unique: the job's device and host extents, for conflict checks
    host_ids: np.ndarray
    after: _Job | None = None
    transfers: list[Any] = field(default_factory=list)
    error: BaseException | None = None
    elapsed_s: float = 0.0
    finished: threading.Event | None = None
    pooled: list[tuple[Pool, Any]] = field(default_factory=list)
    layer_calls: np.ndarray | None = None  # per call: the layer of its first range (loads)
    op: str = ""  # "store"/"load"; "spill"/"restore" for file jobs
    waits: list[threading.Event] = field(default_factory=list)  # file jobs this one runs after
    deps: list[tuple[Any, _Job]] = field(default_factory=list)  # file jobs: (lane, job) it runs after


def _overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two sorted unique id arrays share an id."""
    if not len(a) or not len(b) or a[-1] < b[0] or b[-1] < a[0]:
        return False
    i = np.searchsorted(b, a)
    i[i == len(b)] = len(b) - 1
    return bool(np.any(b[i] == a))


class ThreadLane:
    """Runs jobs in submission order on a background thread; a subclass's ``execute(job)`` does one job's work.
    A job's error is recorded on it (never raised on the thread) and its ``finished`` event is set either way."""

    def __init__(self, name: str):
        self.jobs: deque[Any] = deque()
        self._queue: deque[Any | None] = deque()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-offload-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Any, stream: Any = None) -> None:
        """Queue ``job`` behind the jobs already queued."""
        job.finished = threading.Event()  # not pooled: a later job may still hold this one as its dependency
        self.jobs.append(job)
        with self._ready:
            self._queue.append(job)
            self._ready.notify()

    def execute(self, job: Any) -> None:
        """Do ``job``'s work on the lane's thread (subclasses); raise to fail it."""
        raise NotImplementedError

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                job = self._queue.popleft()
            if job is None:
                return
            try:
                self.execute(job)
            except BaseException as e:  # reported on the job, never raised on this thread
                job.error = e
            finally:
                job.finished.set()

    def done(self, job: Any) -> bool:
        """Whether ``job`` has finished (done or failed)."""
        return bool(job.finished.is_set())

    def wait(self, job: Any) -> None:
        """Block until ``job`` has finished."""
        job.finished.wait()

    def wait_layer(self, job: Any, layer: int) -> None:
        """Block until ``job`` has finished: a host lane completes a job as a whole."""
        self.wait(job)

    def stream_wait_layer(self, job: Any, layer: int, stream: Any) -> None:
        """Block the host until ``job`` has finished (no device stream to order)."""
        self.wait(job)

    def retire(self, job: Any) -> None:
        """Nothing to release per job."""

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._thread.join()


class _ExecutorLane(ThreadLane):
    """Runs one direction's jobs in order on a background thread (host executors)."""

    def __init__(self, executor: Any, bound: Any, name: str):
        self.executor, self.bound = executor, bound
        super().__init__(name)

    def execute(self, job: _Job) -> None:
        if job.after is not None and job.after.finished is not None:
            job.after.finished.wait()
        for ev in job.waits:
            ev.wait()
        t = self.executor.run(job.plan, self.bound).wait()
        job.transfers.append(t)
        job.elapsed_s += t.elapsed_s or 0.0


class _StreamLane:
    """Issues one direction's jobs on a GPU executor's copy stream at submission (DMA executors)."""

    def __init__(self, executor: Any, bound: Any, runtime: Any, barrier: TransferPlan):
        self.executor, self.bound, self.runtime, self.barrier = executor, bound, runtime, barrier
        self.jobs: deque[_Job] = deque()
        self.streams = Pool(self._stream_create, self._stream_destroy)
        self.events = Pool(self._event_create, self._event_destroy)

    def _stream_create(self) -> int:
        with self.runtime.current():
            return self.runtime.stream_create()

    def _stream_destroy(self, s: int) -> None:
        with self.runtime.current():
            self.runtime.stream_destroy(s)

    def _event_create(self) -> int:
        with self.runtime.current():
            return self.runtime.event_create()

    def _event_destroy(self, e: int) -> None:
        with self.runtime.current():
            self.runtime.event_destroy(e)

    def submit(self, job: _Job, stream: Any) -> None:
        self.jobs.append(job)
        for ev in job.waits:  # a file job writing or reading these host chunks: order on the host
            ev.wait()
        gate = stream
        dep = job.after
        if dep is not None and dep.transfers and not _done_quietly(dep):
            rt = self.runtime
            try:
                gate, ready = self.streams.acquire(), self.events.acquire()
                job.pooled += [(self.streams, gate), (self.events, ready)]
                with rt.current():  # gate: the caller's compute so far, then the other direction's job
                    check(rt, rt.event_record(ready, stream_handle(stream, rt.device)), "event record (compute stream)")
                    check(rt, rt.stream_wait_event(gate, ready), "stream wait (compute stream)")
                dep.transfers[-1].stream_wait(gate, -1)
            except Exception as e:  # nothing issued: the job fails without copying
                job.error = e
                return
        try:
            job.transfers.append(self.executor.run(job.plan, self.bound, stream=gate))
        except Exception as e:
            job.error = e
            try:  # an empty run: its end follows whatever the failed run issued, so successors can order on it
                job.transfers.append(self.executor.run(self.barrier, self.bound, stream=gate))
            except Exception:
                pass

    def done(self, job: _Job) -> bool:
        return _done_quietly(job)

    def wait(self, job: _Job) -> None:
        for t in job.transfers:
            try:
                t.wait()
            except Exception as e:
                job.error = job.error or e

    def _load_call(self, job: _Job, layer: int) -> tuple[Any, int] | None:
        if job.error is not None or not job.transfers or job.layer_calls is None or not len(job.layer_calls):
            return None
        c = int(np.searchsorted(job.layer_calls, layer, side="right")) - 1
        return job.transfers[0], max(c, 0)

    def wait_layer(self, job: _Job, layer: int) -> None:
        hit = self._load_call(job, layer)
        if hit is None:
            self.wait(job)
        else:
            hit[0].wait_call(hit[1])

    def stream_wait_layer(self, job: _Job, layer: int, stream: Any) -> None:
        hit = self._load_call(job, layer)
        if hit is not None:
            hit[0].stream_wait(stream, hit[1])
        elif job.transfers:
            job.transfers[-1].stream_wait(stream, -1)

    def retire(self, job: _Job) -> None:
        for t in job.transfers:
            if t.elapsed_s is None:
                try:
                    t.wait()
                except Exception as e:
                    job.error = job.error or e
            job.elapsed_s += t.elapsed_s or 0.0
        for pool, h in job.pooled:
            pool.release(h)
        job.pooled.clear()

    def close(self) -> None:
        self.streams.clear()
        self.events.clear()


def _done_quietly(job: _Job) -> bool:
    """Every transfer of ``job`` finished (a failing query counts as finished, with the error kept)."""
    for t in job.transfers:
        try:
            if not t.done():
                return False
        except Exception as e:
            job.error = job.error or e
    return True


class OffloadWorker:
    """Store and load jobs over one layout (device buffers and the host tier), bound once.

    ``layout``/``bindings``: every buffer the jobs touch and its memory. ``executor``: an Executor (shared by
    both directions), a zero-argument factory, or an ExecutorConfig / dict / path for
    ``kvxfer.executors.get_executor`` (auto: the GPU's DMA executor, or the NumPy executor without a GPU);
    factories and configs build one executor per direction, closed by ``shutdown``.
    Which rank stores which pages is the layout's: ``Region.num_writers/writer_index`` (a replicated region
    rotates writers over the TP ranks, see ``tier.host_region``), so each job is one plan. ``regions_per_layer``:
    regions per layer for per-layer load completion (None: whole jobs only). ``on_close``: callables run
    last by ``shutdown`` (releasing host memory).
    """

    def __init__(self, layout: Layout, bindings: Mapping[str, Any], executor: Any = None, *,
                 tp: TPRank | None = None, regions_per_layer: int | None = 1,
                 max_descriptors: int | None = None, on_close: Sequence[Any] = ()):
        self.layout = layout
        self.tp = tp or TPRank()
        self.host: Any = bindings.get("host")  # the host rows (set by create_worker)
        self.geometry: Any = None
        self._executors, self._owned = self._make_executors(executor)
        self.target = self._executors[STORE].target
        self.regions_per_layer = regions_per_layer
        base = PlanOptions(max_descriptors=max_descriptors)
        self._options = {STORE: base, LOAD: base.model_copy(update={"regions_per_call": regions_per_layer})}
        self._on_close = list(on_close)
        self._chunked = any(int(c.k.max(initial=1)) > 1 for c in layout.info.side.values())
        self._bound: dict[Direction, Any] = {}
        self._lanes: dict[Direction, _ExecutorLane | _StreamLane] = {}
        groups = (0,) * layout.info.num_groups
        for d in (STORE, LOAD):
            ex = self._executors[d]
            self._bound[d] = ex.bind(layout, bindings)
            runtime = getattr(ex, "runtime", None)
            if runtime is not None and hasattr(runtime, "event_record"):
                barrier = plan_transfer(layout, BlockMapping(direction=d, src_ids=[], dst_ids=[], group_sizes=groups),
                                        self.target, base)
                self._lanes[d] = _StreamLane(ex, self._bound[d], runtime, barrier)
            else:
                self._lanes[d] = _ExecutorLane(ex, self._bound[d], d.value)
        self._pending: dict[int, _Job] = {}
        self._drained: list[_Job] = []
        self._seq = 0
        self._closed = False
        self._files: Any = None  # a FileLane (kvxfer.offload.files.attach_files)

    @staticmethod
    def _make_executors(executor: Any) -> tuple[dict[Direction, Any], bool]:
        if executor is not None and hasattr(executor, "run") and not isinstance(executor, type):
            return {STORE: executor, LOAD: executor}, False
        if callable(executor):  # a factory: one executor (one copy stream) per direction
            return {STORE: executor(), LOAD: executor()}, True
        from kvxfer.executors import ExecutorConfig, choose_executor, get_executor

        config = executor if isinstance(executor, ExecutorConfig) else ExecutorConfig.load(executor)
        if config.kind.value == "auto":  # one DMA executor per direction (the SM-kernel choice is per plan)
            config = config.model_copy(update={"kind": choose_executor(config)[0]})
        return {STORE: get_executor(config), LOAD: get_executor(config)}, True

    # ---- submitting -----------------------------------------------------------------------------------------
    def submit_store(self, job_id: int, device_ids: Any, host_ids: Any, group_sizes: Sequence[int] | None = None,
                     group_starts: Sequence[int] | None = None, *, stream: Any = None) -> bool:
        """Copy device blocks ``device_ids`` into host chunks ``host_ids`` (per group: ``group_sizes`` blocks
        from logical block ``group_starts``). Returns True once queued; raises SubmissionError (nothing queued)
        or WorkerClosedError. ``stream``: the compute stream the copy waits for (None: current)."""
        return self._submit(STORE, job_id, device_ids, host_ids, group_sizes, group_starts, stream)

    def submit_load(self, job_id: int, host_ids: Any, device_ids: Any, group_sizes: Sequence[int] | None = None,
                    group_starts: Sequence[int] | None = None, *, stream: Any = None) -> bool:
        """Copy host chunks ``host_ids`` into device blocks ``device_ids``; see ``submit_store``."""
        return self._submit(LOAD, job_id, host_ids, device_ids, group_sizes, group_starts, stream)

    def attach_files(self, lane: Any) -> None:
        """Use ``lane`` (a FileLane; build it with ``kvxfer.offload.files.attach_files``) for spills and restores."""
        if self._closed:
            raise WorkerClosedError("the worker was shut down")
        if self._files is not None:
            raise ValueError("a file tier is already attached")
        self._files = lane

    def submit_spill(self, job_id: int, chunk_ids: Any) -> bool:
        """Write host chunks ``chunk_ids`` to the file tier, after in-flight stores into them. Returns True once
        queued; raises SubmissionError (nothing queued) or WorkerClosedError."""
        return self._submit_file("spill", job_id, chunk_ids)

    def submit_restore(self, job_id: int, chunk_ids: Any) -> bool:
        """Read host chunks ``chunk_ids`` back from the file tier, after in-flight stores and loads touching them;
        later stores and loads of these chunks wait for it. A chunk not spilled, stale or torn fails the job."""
        return self._submit_file("restore", job_id, chunk_ids)

    def _submit_file(self, op: str, job_id: Any, chunk_ids: Any) -> bool:
        job_id = self._check_id(job_id)
        if self._files is None:
            raise SubmissionError(job_id, "op", op, "no file tier attached (kvxfer.offload.files.attach_files)")
        direction, plan, chunks = self._files.plan(job_id, op, chunk_ids)
        job = _Job(job_id, self._seq, direction, plan, np.zeros(0, np.int64), chunks, op=op)
        for d in ((STORE,) if op == "spill" else (STORE, LOAD)):
            lane = self._lanes[d]
            for prev in reversed(lane.jobs):  # newest first: the lane is in order
                if _overlap(job.host_ids, prev.host_ids):
                    if not lane.done(prev):
                        job.deps.append((lane, prev))
                    break
        self._seq += 1
        self._pending[job_id] = job
        self._files.submit(job)
        return True

    def _check_id(self, job_id: Any) -> int:
        if self._closed:
            raise WorkerClosedError(f"job {job_id!r}: the worker was shut down")
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise SubmissionError(job_id, "job_id", job_id, "must be an integer")
        job_id = int(job_id)
        if job_id in self._pending:
            raise SubmissionError(job_id, "job_id", job_id, "a job with this id is still pending (in flight or not "
                                  "yet returned by get_finished)")
        return job_id

    def _submit(self, direction: Direction, job_id: Any, src: Any, dst: Any, sizes: Any, starts: Any, stream: Any) -> bool:
        job_id = self._check_id(job_id)
        names = {"src_ids": "host_ids", "dst_ids": "device_ids"} if direction is LOAD else \
                {"src_ids": "device_ids", "dst_ids": "host_ids"}
        if sizes is None and self._chunked and self.layout.info.num_groups == 1:
            try:  # one group of every device block listed, from a chunk boundary
                sizes = (len(dst if direction is LOAD else src),)
            except TypeError:
                pass
        try:  # numpy id arrays take the planner's hot path (checked, not copied); anything else is validated
            mapping = {"direction": direction, "src_ids": src, "dst_ids": dst,
                       "group_sizes": None if sizes is None else tuple(sizes),
                       "group_starts": None if starts is None else tuple(starts)}
            plan = plan_transfer(self.layout, mapping, self.target, self._options[direction])
        except PlanError as e:
            head, _, rest = e.field.partition(".")
            raise SubmissionError(job_id, names.get(head, head) + (f".{rest}" if rest else ""), e.value, e.reason,
                                  e.index) from None
        except (TypeError, ValueError) as e:
            raise SubmissionError(job_id, "group_sizes/group_starts", (sizes, starts), str(e)) from None
        dev, host = (dst, src) if direction is LOAD else (src, dst)  # valid ids: the plan was made from them
        job = _Job(job_id, self._seq, direction, plan, np.unique(np.asarray(dev, dtype=np.int64)),
                   np.unique(np.asarray(host, dtype=np.int64)),
                   op="load" if direction is LOAD else "store")
        other = self._lanes[LOAD if direction is STORE else STORE]
        for prev in reversed(other.jobs):  # newest first: the lane is in order, so the newest conflict suffices
            if _overlap(job.device_ids, prev.device_ids) or _overlap(job.host_ids, prev.host_ids):
                if not other.done(prev):
                    job.after = prev
                break
        if self._files is not None:
            for prev in reversed(self._files.jobs):  # newest in-flight file job on these chunks (in order)
                if _overlap(job.host_ids, prev.host_ids):
                    if not self._files.done(prev):
                        job.waits.append(prev.finished)
                    break
        if direction is LOAD and self.regions_per_layer:
            job.layer_calls = plan.region[plan.call_offsets[:-1]].astype(np.int64) // self.regions_per_layer \
                if plan.num_calls else np.zeros(0, np.int64)
        self._seq += 1
        self._pending[job_id] = job
        self._lanes[direction].submit(job, stream)
        return True

    # ---- completion -----------------------------------------------------------------------------------------
    def _result(self, job: _Job) -> JobResult:
        ok = job.error is None
        return JobResult(job.job_id, job.direction, ok, job.plan.total_bytes if ok else 0, job.elapsed_s,
                         job.plan.num_ranges, job.error, job.op)

    def _all_lanes(self) -> list[Any]:
        return [*self._lanes.values(), *([self._files] if self._files is not None else [])]

    def _lane(self, job: _Job) -> Any:
        return self._files if job.op in ("spill", "restore") else self._lanes[job.direction]

    def _retire_ready(self) -> list[_Job]:
        out = []
        for lane in self._all_lanes():
            while lane.jobs and lane.done(lane.jobs[0]):
                job = lane.jobs.popleft()
                lane.retire(job)
                out.append(job)
        return out

    def get_finished(self) -> list[JobResult]:
        """Results of the jobs finished since the last call, in submission order within each direction
        (a direction stops at its first unfinished job). A failed job is reported with its error."""
        jobs = sorted(self._drained + self._retire_ready(), key=lambda j: j.seq)
        self._drained = []
        for j in jobs:
            self._pending.pop(j.job_id, None)
        return [self._result(j) for j in jobs]

    def _job(self, job_id: int) -> _Job:
        job = self._pending.get(int(job_id))
        if job is None:
            raise KeyError(f"job {job_id!r} is not pending (never submitted, or already returned by get_finished)")
        return job

    def wait(self, job_ids: Any) -> None:
        """Block until the given jobs have finished (ids no longer pending return at once); collect their
        results with ``get_finished``."""
        for jid in sorted(int(j) for j in job_ids):
            job = self._pending.get(jid)
            if job is not None:
                self._lane(job).wait(job)

    def wait_for_layer(self, job_id: int, layer: int) -> None:
        """Block until layer ``layer`` (regions ``layer*regions_per_layer ...``) of load ``job_id`` has arrived."""
        job = self._job(job_id)
        self._lane(job).wait_layer(job, int(layer))

    def stream_wait_for_layer(self, job_id: int, layer: int, stream: Any) -> None:
        """Make ``stream`` wait, on the device, until layer ``layer`` of load ``job_id`` has arrived (on the
        host executor: blocks the host instead)."""
        job = self._job(job_id)
        self._lane(job).stream_wait_layer(job, int(layer), stream)

    @property
    def pool_sizes(self) -> dict[str, int]:
        """Handles each pool has made (GPU lanes: gate streams and events; host lanes have none)."""
        out = {}
        for d, lane in self._lanes.items():
            for name in ("streams", "events"):
                pool = getattr(lane, name, None)
                if pool is not None:
                    out[f"{d.value}.{name}"] = pool.made
        return out

    def shutdown(self) -> None:
        """Drain every job in order, release pools, bound memory and executors, then the host memory.
        Raises OffloadError for failed jobs not yet reported; their results stay in ``get_finished``."""
        if self._closed:
            return
        self._closed = True
        for lane in self._all_lanes():
            for job in lane.jobs:
                lane.wait(job)
        self._drained += self._retire_ready()
        try:
            if self._files is not None:
                self._files.close()
            for d, lane in self._lanes.items():
                lane.close()
                self._bound[d].close()
            if self._owned:
                for ex in {id(e): e for e in self._executors.values()}.values():
                    ex.close()
        finally:
            for close in self._on_close:
                close()
        failed = [self._result(j) for j in self._drained if j.error is not None]
        if failed:
            raise OffloadError(failed)

    def __enter__(self) -> OffloadWorker:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()
