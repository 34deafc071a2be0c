"""Timed secondary tiers for ``bench_vllm_tiers.py``: kvxfer's ``KvxferFileTier`` and vLLM's ``fs`` tier, each
with its scheduler-side calls timed, loaded by the engine through ``module_path="benchmarks.tier_timing"``.

Each records, in the engine process (the scheduler, where the tiers run): the wall time spent in the tier's
methods on the scheduler thread (they never block, so it is their CPU cost there), the number of scheduler steps
(``on_schedule_end`` calls), and the process CPU time (every thread: the scheduler and the tier's own I/O
threads) from the first call to shutdown. ``timing_path`` (a key of the tier's config, taken out before the tier
sees it) receives them as JSON at shutdown.
"""
from __future__ import annotations

import json
import time
from typing import Any

from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

from kvxfer.offload.vllm import KvxferFileTier

TIMED = ("lookup", "submit_store", "submit_load", "get_finished_jobs", "touch", "on_new_request", "on_request_finished",
         "on_schedule_end", "has_pending_work")


def _timed(cls: type) -> type:
    """A subclass of tier class ``cls`` whose scheduler-side methods are timed (see the module docstring)."""

    def __init__(self: Any, *args: Any, timing_path: str = "", **config: Any) -> None:
        self._timing = {"path": timing_path, "calls": 0, "scheduler_s": 0.0, "steps": 0, "cpu0": None}
        cls.__init__(self, *args, **config)

    def wrap(name: str) -> Any:
        base = getattr(cls, name)

        def method(self: Any, *args: Any, **kw: Any) -> Any:
            t = self._timing
            if t["cpu0"] is None:
                t["cpu0"] = time.process_time()
            t0 = time.perf_counter()
            try:
                return base(self, *args, **kw)
            finally:
                t["scheduler_s"] += time.perf_counter() - t0
                t["calls"] += 1
                t["steps"] += name == "on_schedule_end"
        return method

    def shutdown(self: Any) -> None:
        cls.shutdown(self)
        t = self._timing
        cpu = time.process_time() - (t["cpu0"] if t["cpu0"] is not None else time.process_time())
        if t["path"]:
            with open(t["path"], "w") as f:
                json.dump({"calls": t["calls"], "scheduler_s": t["scheduler_s"], "steps": t["steps"],
                           "process_cpu_s": cpu}, f)

    body = {"__init__": __init__, "shutdown": shutdown, **{n: wrap(n) for n in TIMED}}
    return type(f"Timed{cls.__name__}", (cls,), body)


TimedKvxferFileTier = _timed(KvxferFileTier)
TimedFileSystemTierManager = _timed(FileSystemTierManager)
