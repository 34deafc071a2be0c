"""Timed secondary tiers for ``bench_vllm_tiers.py``: kvxfer's ``KvxferFileTier`` and vLLM's ``fs`` tier, each
with its scheduler-side calls timed, loaded by the engine through ``module_path="benchmarks.tier_timing"``.

Each records, in the engine process (the scheduler, where the tiers run): the wall time spent in the tier's
methods on the scheduler thread (they never block, so it is their CPU cost there), the number of scheduler steps
(``on_schedule_end`` calls), the process CPU time (every thread: the scheduler and the tier's own I/O
threads) from the first call to shutdown, and each load job's time from ``submit_load`` until
``get_finished_jobs`` reports it (read start to the chunks in host memory, as the scheduler sees it: both tiers
are polled once a step, so the step's length bounds the resolution alike). ``timing_path`` (a key of the tier's
config, taken out before the tier sees it) receives them as JSON at shutdown.
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
        self._timing = {"path": timing_path, "calls": 0, "scheduler_s": 0.0, "steps": 0, "cpu0": None, "loads": []}
        self._load_started: dict[Any, tuple[float, int]] = {}
        cls.__init__(self, *args, **config)

    def submit_load(self: Any, job: Any) -> None:  # the load's clock starts as the scheduler hands it over
        self._load_started[job.job_id] = (time.perf_counter(), len(job.keys))
        timed_submit_load(self, job)

    def get_finished_jobs(self: Any) -> Any:  # and stops when the scheduler is told the job has landed
        results = list(timed_get_finished(self))
        now = time.perf_counter()
        for r in results:
            started = self._load_started.pop(r.job_id, None)
            if started is not None:
                self._timing["loads"].append({"s": now - started[0], "chunks": started[1], "ok": bool(r.success)})
        return results

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
                           "process_cpu_s": cpu, "loads": t["loads"]}, f)

    timed_submit_load, timed_get_finished = wrap("submit_load"), wrap("get_finished_jobs")
    body = {**{n: wrap(n) for n in TIMED}, "__init__": __init__, "shutdown": shutdown, "submit_load": submit_load,
            "get_finished_jobs": get_finished_jobs}
    return type(f"Timed{cls.__name__}", (cls,), body)


TimedKvxferFileTier = _timed(KvxferFileTier)
TimedFileSystemTierManager = _timed(FileSystemTierManager)
