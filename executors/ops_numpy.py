"""The reference executor: host memory, one slice assignment per range. The oracle for every other backend.

Safe to share between threads: a run keeps no state on the executor (ranges that overlap between concurrent
runs race as any two writers of the same bytes do).
"""
from __future__ import annotations

import time
from typing import Any

from kvxfer.planner import Buffer, TransferPlan

from .base import Bindings, CompletedTransfer, Executor, completed
from .binding import BoundMemory, Memory, check_host_view


class NumpyExecutor(Executor):
    """Copies each range with numpy slicing. Bindings: buffer name -> contiguous numpy array or CPU tensor."""

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse (BindingError) memory that is not host memory numpy can view."""
        check_host_view(buf, mem)

    def _attach(self, bound: BoundMemory) -> None:
        bound.extra["views"] = _views(bound)  # made once per bind

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Any = None) -> CompletedTransfer:
        """Copy every range; complete on return. Raises BindingError or PlanError before any byte moves."""
        t0 = time.perf_counter()
        bound = self.memory_for(plan, memory)
        bound.check(plan)  # every check, before the first byte moves
        views = bound.extra.get("views") or _views(bound)
        cols = zip(plan.src_buf.tolist(), plan.src_offset.tolist(), plan.dst_buf.tolist(),
                   plan.dst_offset.tolist(), plan.nbytes.tolist())
        for sb, so, db, do, n in cols:
            views[db][do:do + n] = views[sb][so:so + n]
        return completed(plan, t0)


def _views(bound: BoundMemory) -> list[Any]:
    return [m.view() if m is not None and m.view is not None else None for m in bound.memory]
