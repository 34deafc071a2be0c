"""The file tier as the worker's lower tier: spilling its host chunks to a file and restoring them, jobs reported
like stores and loads.

``attach_files(worker, path)`` builds a FileLane (a ``TierLane``, the interface the core's worker takes a lower
tier by) over the worker's host memory and hands it to the worker (``attach_tier``); then
``worker.submit_spill(job_id, chunk_ids)`` / ``worker.submit_restore(job_id, chunk_ids)`` queue jobs whose
results come out of ``get_finished`` (``JobResult.op`` "spill" / "restore"), which ``wait`` covers and
``shutdown`` drains.

The spill layout places every host cell twice: its ``device`` side is the cell in the worker's host buffer
(one "block" is one whole chunk of the cell), its ``host`` side the cell's slot in one file (cells back to back,
``num_chunks`` chunk slots each). A spill is a d2h plan of that layout, a restore an h2d plan, both run by a
``FileTier`` (``file_tier``: NIXL storage backend; durability and per-chunk integrity are the tier's).

Ordering is the worker's (``OffloadWorker``): a spill reads host chunks and writes their file slots, a restore
reads the slots and writes the chunks, so each is ordered after the in-flight jobs it conflicts with, and later
stores and loads after it; file jobs run one at a time in submission order, on the lane's own thread, so no
submission waits for the disk. A spill moves every cell of a chunk in the host memory this worker maps (with a
shared region, one rank should spill).
"""
from __future__ import annotations

import math
import os
import time
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from kvxfer.executors import FileBinding, Transfer, wait_on_host
from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    Location,
    Placement,
    PlanError,
    Region,
    TransferPlan,
    plan_transfer,
)

from ..jobs import SPILL, TIER_OPS, Job, SubmissionError
from ..lanes import TierLane
from ..tier import HOST_BUFFER, Geometry
from .file_tier import Durability, FileTier, StorageExecutor

FILE_BUFFER = "file"


def spill_layout(geometry: Geometry, align_bytes: int = 1) -> Layout:
    """The layout of spills and restores for host rows of ``geometry``: buffer ``host`` (memory; ``device``
    placements, one block = one chunk of a cell) and buffer ``file`` (``host`` placements, cell-major), each
    placement holding ``num_chunks`` blocks (a chunk id past them would be the next cell's)."""
    n, k = geometry.num_chunks, geometry.blocks_per_chunk
    regions, at = [], 0
    for i, cell in enumerate(geometry.cells):
        page = k * cell.page_bytes
        regions.append(Region(name=f"cell{i}", page_bytes=page,
                              device=Placement(buffer=HOST_BUFFER, byte_offset=cell.offset_bytes,
                                               stride_bytes=cell.stride_bytes or geometry.row_stride_bytes, num_blocks=n),
                              host=Placement(buffer=FILE_BUFFER, byte_offset=at, num_blocks=n)))
        at += n * page
    buffers = (Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST, align_bytes=align_bytes),
               Buffer(name=FILE_BUFFER, nbytes=max(at, 1), location=Location.FILE, align_bytes=align_bytes))
    return Layout(buffers=buffers, regions=tuple(regions))


class Worker(Protocol):
    """What ``attach_files`` needs of an OffloadWorker: its host rows and their geometry, and ``attach_tier``."""

    host: np.ndarray | None
    geometry: Geometry | None

    def attach_tier(self, lane: TierLane) -> None:
        """Use ``lane`` for spills and restores."""


class FileLane(TierLane):
    """Spill and restore jobs of one worker, run in submission order on a background thread through ``tier``
    (a FileTier over ``layout``, whose memory buffer is the worker's host rows). ``owned``: closed with the lane."""

    space = "file slots"

    def __init__(self, tier: FileTier, layout: Layout, owned: tuple[Any, ...] = ()):
        self.tier, self.layout, self._owned = tier, layout, owned
        super().__init__("files")

    def plan(self, job_id: int, op: str, chunk_ids: Sequence[int] | np.ndarray) -> tuple[TransferPlan, np.ndarray]:
        """The plan and sorted unique chunk ids of ``op`` over host chunks ``chunk_ids``; SubmissionError (naming
        ``chunk_ids``) if it cannot be planned."""
        direction = TIER_OPS[op]
        try:
            m = BlockMapping(direction=direction, src_ids=chunk_ids, dst_ids=chunk_ids)
            plan = plan_transfer(self.layout, m)
        except PlanError as e:
            raise SubmissionError(job_id, "chunk_ids", e.value, e.reason, e.index) from None
        except (TypeError, ValueError) as e:
            raise SubmissionError(job_id, "chunk_ids", chunk_ids, str(e)) from None
        return plan, np.unique(np.asarray(m.src_ids, dtype=np.int64))

    def execute(self, job: Job, after: Sequence[Transfer]) -> float:
        """Wait on the host for the device jobs it is ordered after, then spill or restore; raises the tier's
        error when the job failed."""
        wait_on_host(after)
        t0 = time.perf_counter()
        r = (self.tier.spill if job.op == SPILL else self.tier.restore)(job.plan)
        if not r.success:
            raise r.error or RuntimeError(f"{job.op} failed without an error")
        return r.seconds or time.perf_counter() - t0

    def close(self) -> None:
        """Drain the queue, stop the thread, close the tier and what the lane owns."""
        super().close()
        try:
            self.tier.close()
        finally:
            for obj in self._owned:
                obj.close()


def attach_files(worker: Worker, file: str | os.PathLike[str] | FileBinding, *,
                 executor: StorageExecutor | None = None, durability: Durability | str = Durability.FDATASYNC,
                 verify: bool = True) -> FileLane:
    """Give ``worker`` a file tier: ``file`` is a path (created private to its owner, sized to the host rows) or
    a FileBinding. ``executor``: a NixlExecutor with a storage backend (None: one on NIXL's POSIX backend, closed
    with the worker). ``durability``/``verify``: the FileTier's. Raises BindingError when the file or memory do
    not fit, or the file cannot be trusted or is held by another tier; ValueError for a worker without host
    rows (one not built by ``create_worker``)."""
    if worker.geometry is None or worker.host is None:
        raise ValueError("attach_files needs a worker built by create_worker (its host rows and geometry)")
    binding = file if isinstance(file, FileBinding) else FileBinding(os.fspath(file), create=True)
    layout = spill_layout(worker.geometry, binding.block_bytes if binding.o_direct else 1)
    chunk = math.gcd(*(r.page_bytes for r in layout.regions)) if layout.regions else 1
    owned: tuple[Any, ...] = ()
    if executor is None:
        from kvxfer.executors import get_executor

        executor = get_executor({"kind": "nixl", "nixl": {"backends": ["POSIX"]}})
        owned = (executor,)
    try:
        tier = FileTier(executor, layout, {FILE_BUFFER: binding}, {HOST_BUFFER: worker.host},
                        durability=durability, chunk_bytes=chunk, verify=verify)
    except BaseException:
        for obj in owned:
            obj.close()
        raise
    lane = FileLane(tier, layout, owned)
    try:
        worker.attach_tier(lane)
    except BaseException:
        lane.close()
        raise
    return lane
