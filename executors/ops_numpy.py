"""The reference executor: host memory, one slice assignment per range. The oracle for every other backend."""
from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kvxfer.planner import TransferPlan

from .base import Executor, Transfer, bind_views, completed


class NumpyExecutor(Executor):
    """Copies each range with numpy slicing. Bindings: buffer name -> contiguous numpy array or CPU tensor."""

    name = "numpy"

    def run(self, plan: TransferPlan, bindings: Mapping[str, Any], stream: Any = None) -> Transfer:
        t0 = time.perf_counter()
        views = bind_views(plan, bindings)
        cols = zip(plan.src_buf.tolist(), plan.src_offset.tolist(), plan.dst_buf.tolist(),
                   plan.dst_offset.tolist(), plan.nbytes.tolist())
        for sb, so, db, do, n in cols:
            views[db][do:do + n] = views[sb][so:so + n]
        return completed(plan, t0)
