"""What the offload worker knows about a job: its result, its errors, its own record, and which bytes it reads and
writes.

A job touches id spaces: device blocks, host chunks, and the slots of a lower tier (a storage tier below host
memory, ``lanes.TierLane``; a spill writes chunk c's slot, a restore reads it; the tier names the space, such as
the file tier's "file slots"). Stores read device blocks and write host chunks; loads read host chunks and write
device blocks; spills read host chunks and write their slots; restores read the slots and write host chunks
(``touched``). Two jobs conflict when one writes an id the other reads or writes; the worker's job graph
(``graph``) orders every conflicting pair and fails a job that reads what a failed job was to write. Ids are
tracked at the granularity of host chunks and device blocks: a store into part of a chunk writes it.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from kvxfer.executors import Stream
from kvxfer.planner import Direction, TransferPlan

if TYPE_CHECKING:  # what touched() returns; the graph reads it
    from .graph import Ids

STORE, LOAD = Direction.D2H, Direction.H2D
SPILL, RESTORE = "spill", "restore"  # a lower tier's jobs: host chunks down to it, and back
TIER_OPS = {SPILL: STORE, RESTORE: LOAD}  # their directions
DEVICE, HOST = "device blocks", "host chunks"


class SubmissionError(ValueError):
    """A submission that cannot be planned; names the job, the field and the value. Nothing was queued."""

    def __init__(self, job_id: Any, field: str, value: Any, reason: str, index: int | None = None):
        self.job_id, self.field, self.value, self.reason, self.index = job_id, field, value, reason, index
        where = field if index is None else f"{field}[{index}]"
        super().__init__(f"job {job_id!r}: {where} = {value!r}: {reason}")


class WorkerClosedError(RuntimeError):
    """The worker was shut down; it takes no more jobs."""


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
    """One accepted job as the worker runs it, from submission to its report; what orders it and decides its outcome
    is the worker's ``JobGraph``. Fields below ``seq`` change under the worker's lock only; ``ready`` is set (under
    the lock) once the job was issued (issue lanes) or has ended (thread lanes)."""

    job_id: int
    op: str  # "store", "load", "spill", "restore"
    direction: Direction
    plan: TransferPlan
    stream: Stream = None  # the caller's stream, resolved on the submitting thread
    layer_calls: np.ndarray | None = None  # loads: per call, the layer of its first range
    seq: int = -1
    lane: Any = None
    after: list[Any] = field(default_factory=list)  # thread lanes: the transfers it runs after (issue lanes' marks)
    ready: threading.Event = field(default_factory=threading.Event)
    transfer: Any = None  # issue lanes: what was issued (the run, or an empty run after a failed one)
    mark: Any = None  # issue lanes: a transfer that completes once this job and its lane's earlier jobs have
    error: BaseException | None = None  # its own failure (once retired: its outcome, an inherited failure too)
    elapsed_s: float = 0.0
    ended: bool = False  # its work is over (copies done and waited for, or run) and the graph was told

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
