"""What the offload worker knows about a job: its result, its errors, and which bytes it reads and writes.

A job touches id spaces: device blocks, host chunks, and the slots of a lower tier (a storage tier below host
memory, ``lanes.TierLane``; a spill writes chunk c's slot, a restore reads it; the tier names the space, such as
the file tier's "file slots"). Stores read device blocks and write host chunks; loads read host chunks and write
device blocks; spills read host chunks and write their slots; restores read the slots and write host chunks. Two
jobs conflict when one writes an id the other reads or writes (read-after-write, write-after-read, write-after-
write); the worker orders every conflicting pair and fails a job that reads what a failed job was to write
Ids are tracked at the granularity of host chunks and device blocks: a store into part of a chunk
writes it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.executors import Stream
from kvxfer.planner import Direction, TransferPlan

STORE, LOAD = Direction.D2H, Direction.H2D
SPILL, RESTORE = "spill", "restore"  # a lower tier's jobs: host chunks down to it, and back
TIER_OPS = {SPILL: STORE, RESTORE: LOAD}  # their directions
DEVICE, HOST = "device blocks", "host chunks"
Ids = tuple[tuple[str, np.ndarray], ...]  # (id space, sorted unique ids) pairs


class SubmissionError(ValueError):
    """A submission that cannot be planned; names the job, the field and the value. Nothing was queued."""

    def __init__(self, job_id: Any, field: str, value: Any, reason: str, index: int | None = None):
        self.job_id, self.field, self.value, self.reason, self.index = job_id, field, value, reason, index
        where = field if index is None else f"{field}[{index}]"
        super().__init__(f"job {job_id!r}: {where} = {value!r}: {reason}")


class WorkerClosedError(RuntimeError):
    """The worker was shut down; it takes no more jobs."""


class DependencyError(RuntimeError):
    """The job read bytes that a failed job was to write, so its own bytes are not the ones asked for.

    ``job_id``/``op``: the failed job it read from; ``cause``: that job's error. ``root_id``/``root_op``/``root``:
    the first failure of the chain (the same job when it failed on its own)."""

    def __init__(self, job_id: int, op: str, cause: BaseException):
        self.job_id, self.op, self.cause = job_id, op, cause
        self.root_id: int
        self.root_op: str
        self.root: BaseException
        if isinstance(cause, DependencyError):
            self.root_id, self.root_op, self.root = cause.root_id, cause.root_op, cause.root
        else:
            self.root_id, self.root_op, self.root = job_id, op, cause
        text = str(self.root)
        text = text if len(text) <= 160 else text[:157] + "..."
        chain = "" if self.root_id == job_id else f", which read from failed job {self.root_id} ({self.root_op})"
        super().__init__(f"reads what job {job_id} ({op}) was to write, and that job failed{chain}: "
                         f"{type(self.root).__name__}: {text}")


@dataclass(frozen=True)
class JobResult:
    """What happened to one job. ``error`` is the exception of a failed job (``success`` False): the executor's or
    the file tier's, or a DependencyError naming the failed job whose bytes this one read. ``op``: "store",
    "load", "spill" (host -> file, ``direction`` d2h) or "restore" (file -> host, ``direction`` h2d)."""

    job_id: int
    direction: Direction
    success: bool
    nbytes: int
    elapsed_s: float
    num_ranges: int
    error: BaseException | None = None
    op: str = ""


class OffloadError(RuntimeError):
    """Jobs failed and were not yet reported through ``get_finished``; ``results`` holds them."""

    def __init__(self, results: list[JobResult]):
        self.results = results
        super().__init__("; ".join(f"job {r.job_id} ({r.op or r.direction.value}) failed: {r.error}" for r in results))


@dataclass(eq=False)
class Job:
    """One accepted job, from submission to its report. Fields below ``seq`` change under the worker's lock only;
    ``ready`` is set (under the lock) once the job was issued (issue lanes) or has finished (thread lanes)."""

    job_id: int
    op: str  # "store", "load", "spill", "restore"
    direction: Direction
    plan: TransferPlan
    reads: Ids
    writes: Ids
    stream: Stream = None  # the caller's stream, resolved on the submitting thread
    layer_calls: np.ndarray | None = None  # loads: per call, the layer of its first range
    seq: int = -1
    lane: Any = None
    after: list[Job] = field(default_factory=list)  # jobs of other lanes it is ordered after (newest per lane)
    reads_from: list[Job] = field(default_factory=list)  # the last pending writers of the ids it reads
    ready: threading.Event = field(default_factory=threading.Event)
    transfer: Any = None  # issue lanes: what was issued (the run, or an empty run after a failed one)
    mark: Any = None  # issue lanes: a transfer that completes once this job and its lane's earlier jobs have
    error: BaseException | None = None
    elapsed_s: float = 0.0
    copied: bool = False  # issue lanes: the transfer has completed and was waited for
    settled: bool = False  # finished, and its failure (own or inherited) is final

    def result(self) -> JobResult:
        """The job's JobResult as it stands (bytes moved only when it succeeded)."""
        ok = self.error is None
        return JobResult(self.job_id, self.direction, ok, self.plan.total_bytes if ok else 0, self.elapsed_s,
                         self.plan.num_ranges, self.error, self.op)


def touched(op: str, device_ids: np.ndarray, host_ids: np.ndarray, slots: str = "") -> tuple[Ids, Ids]:
    """(reads, writes) of a job, by operation: device block ids and host chunk ids (sorted unique); a spill or restore
    moves host chunks to or from their slots in a lower tier, id space ``slots`` (one slot per chunk)."""
    return {
        "store": (((DEVICE, device_ids),), ((HOST, host_ids),)),
        "load": (((HOST, host_ids),), ((DEVICE, device_ids),)),
        SPILL: (((HOST, host_ids),), ((slots, host_ids),)),
        RESTORE: (((slots, host_ids),), ((HOST, host_ids),)),
    }[op]


def overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two sorted unique id arrays share an id."""
    if not len(a) or not len(b) or a[-1] < b[0] or b[-1] < a[0]:
        return False
    i = np.searchsorted(b, a)
    i[i == len(b)] = len(b) - 1
    return bool(np.any(b[i] == a))


def _any_overlap(xs: Ids, ys: Ids) -> bool:
    return any(sx == sy and overlap(a, b) for sx, a in xs for sy, b in ys)


def conflict(a: Job, b: Job) -> bool:
    """Whether ``a`` and ``b`` must not run at the same time: one writes an id the other reads or writes."""
    return _any_overlap(a.reads, b.writes) or _any_overlap(a.writes, b.reads) or _any_overlap(a.writes, b.writes)
