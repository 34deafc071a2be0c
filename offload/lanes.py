"""The worker's lanes: each runs one kind of job in submission order.

- An issue lane (non-synchronous executors: GPU DMA, Triton on a GPU, ``auto`` there, any executor whose ``run``
  only issues) issues a job on the submitting thread, or later if it must wait for a job of a host lane; its
  executor completes its runs in issue order, and a job's cross-lane dependencies reach the executor as
  ``after``. Nothing here blocks.
- A thread lane (synchronous executors such as NumPy, and a lower tier) runs its jobs on a background thread, so
  submitting stays asynchronous. The thread blocks on its queue's Condition (no poll): ``submit`` and ``close``
  notify it, so an idle lane takes no CPU and ``close`` wakes it.
- A lower tier (``TierLane``, a thread lane: the file tier of ``kvxfer.offload.files``) moves host chunks to its
  own slots (a spill) and back (a restore). It names the id space of its slots, plans a job over host chunk ids
  and does it; the worker orders, starts and reports its jobs like any other lane's. The core knows no kind of
  lower tier: a wing subclasses ``TierLane`` and hands it to ``OffloadWorker.attach_tier``.

Lanes hold state; the worker decides when a job may issue or run and what it waits for (``OffloadWorker``).
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from kvxfer.executors import BoundMemory, PlanRunner, Stream, Transfer
from kvxfer.planner import TransferPlan

if TYPE_CHECKING:  # what a lane runs; the lane never looks inside one
    from .jobs import Job


def run(executor: PlanRunner, plan: TransferPlan, bound: BoundMemory, stream: Stream, after: Sequence[Transfer]) -> Transfer:
    """``executor.run`` of ``plan`` after ``stream``'s work so far and after every transfer of ``after`` (the one
    ordering mechanism: the executor honours ``after`` on the device where it can, else on the host)."""
    transfer: Transfer = executor.run(plan, bound, stream=stream, after=list(after) or None)
    return transfer


class IssueLane:
    """One direction on a non-synchronous executor. ``jobs``: accepted and not yet retired, in order; ``waiting``:
    the suffix of them not yet issued; ``mark``: the newest issued job's mark. ``barrier``: an empty plan, run
    after a failed run so that later jobs can order after whatever the failed run issued."""

    issues = True

    def __init__(self, name: str, executor: PlanRunner, bound: BoundMemory, barrier: TransferPlan):
        self.name, self.executor, self.bound, self.barrier = name, executor, bound, barrier
        self.jobs: deque[Job] = deque()
        self.waiting: deque[Job] = deque()
        self.mark: Transfer | None = None

    def close(self) -> None:
        """Nothing runs on its own: the executor is the worker's to close."""


class ThreadLane:
    """Jobs run one at a time in submission order on a background thread: ``step(lane, job)`` (set by the worker
    that adopts the lane) does one job, waiting for its dependencies and recording the outcome on it; a subclass's
    ``execute(job, after)`` does the job's own work, returns its seconds and raises to fail it."""

    issues = False

    def __init__(self, name: str):
        self.name = name
        self.jobs: deque[Job] = deque()
        self.step: Callable[[ThreadLane, Job], None] | None = None
        self._queue: deque[Job | None] = deque()
        self._ready = threading.Condition()
        self._thread = threading.Thread(target=self._loop, name=f"kvxfer-offload-{name}", daemon=True)
        self._thread.start()

    def submit(self, job: Job) -> None:
        """Queue ``job`` behind the jobs already queued."""
        with self._ready:
            self._queue.append(job)
            self._ready.notify()

    def execute(self, job: Job, after: Sequence[Transfer]) -> float:
        """Do ``job``'s work on the lane's thread, after ``after`` (transfers of issue lanes); returns the seconds it
        took, raises to fail it."""
        raise NotImplementedError

    def _loop(self) -> None:
        while True:
            with self._ready:
                while not self._queue:
                    self._ready.wait()
                job = self._queue.popleft()
            if job is None:
                return
            if self.step is not None:
                self.step(self, job)

    def close(self) -> None:
        """Run what is queued, then stop the thread."""
        with self._ready:
            self._queue.append(None)
            self._ready.notify()
        self._thread.join()


class ExecutorLane(ThreadLane):
    """One direction on a synchronous executor (NumPy; Triton under the interpreter; ``auto`` without a GPU)."""

    def __init__(self, name: str, executor: PlanRunner, bound: BoundMemory):
        self.executor, self.bound = executor, bound
        super().__init__(name)

    def execute(self, job: Job, after: Sequence[Transfer]) -> float:
        """Run the job's plan on the executor (which waits for ``after`` on the host); its measured seconds."""
        return run(self.executor, job.plan, self.bound, job.stream, after).wait().elapsed_s or 0.0


class TierLane(ThreadLane):
    """A storage tier below host memory, as a worker runs it (see the module): spills (host chunks -> the tier's
    slots, ``jobs.SPILL``) and restores (back, ``jobs.RESTORE``), one at a time on the lane's thread. ``space``
    names the id space of its slots (one slot per host chunk); a subclass plans a job (``plan``), does it
    (``execute``, after the issue lanes' transfers in ``after``) and releases what it holds (``close``)."""

    space = "tier slots"

    def plan(self, job_id: int, op: str, chunk_ids: Sequence[int] | np.ndarray) -> tuple[TransferPlan, np.ndarray]:
        """The plan of ``op`` (``jobs.SPILL`` or ``jobs.RESTORE``) over host chunks ``chunk_ids`` and the sorted unique
        chunk ids; SubmissionError (naming ``chunk_ids``) when it cannot be planned."""
        raise NotImplementedError
