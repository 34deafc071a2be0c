"""kvxfer's counters in one rank's vLLM worker (``WorkerStats``) and the file they are written to (``StatsFile``).

The file is replaced whole after each engine step that finished jobs, on a thread of its own: writing it costs
0.4-4 ms on a disk (benchmarks/NOTES.md, "vLLM counters file"), which the engine step never waits for. A write
that fails (disk full, the folder removed) is logged once and retried with the next update; it never fails a step.
"""
from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..files.atomic import replace_file
from ..jobs import JobResult

__all__ = ["StatsFile", "WorkerStats"]

_log = logging.getLogger("kvxfer.offload.vllm")


@dataclass
class WorkerStats:
    """kvxfer's counters in one rank's worker. ``blocks_*`` count device blocks of jobs that succeeded, per KV-cache
    group in ``*_by_group``; ``host_s``: host time spent in submit_store, submit_load and get_finished (checksums
    included); ``steps``: get_finished calls (vLLM calls it once per engine step); ``host_tier``: "private" or
    "shared"; ``stores_failed``/``loads_failed``: jobs reported failed (``loads_refused``: of those, loads refused
    before any copy because a host chunk's checksum did not match, ``kvxfer_verify``); ``verify_s``: host time spent
    computing and checking checksums."""

    host_tier: str = ""
    stores: int = 0
    loads: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    blocks_stored_by_group: list[int] = field(default_factory=list)
    blocks_loaded_by_group: list[int] = field(default_factory=list)
    bytes_stored: int = 0
    bytes_loaded: int = 0
    ranges_stored: int = 0
    ranges_loaded: int = 0
    store_s: float = 0.0
    load_s: float = 0.0
    host_s: float = 0.0
    steps: int = 0
    stores_failed: int = 0
    loads_failed: int = 0
    loads_refused: int = 0
    verify_s: float = 0.0

    def record(self, r: JobResult, group_blocks: tuple[int, ...]) -> None:
        """Count a finished job that moved ``group_blocks[g]`` device blocks of group g (a failed one: only as failed)."""
        store = r.op == "store"
        if not r.success:
            if store:
                self.stores_failed += 1
            else:
                self.loads_failed += 1
            return
        by_group = self.blocks_stored_by_group if store else self.blocks_loaded_by_group
        by_group.extend([0] * (len(group_blocks) - len(by_group)))
        for g, n in enumerate(group_blocks):
            by_group[g] += n
        if store:
            self.stores += 1
            self.blocks_stored += sum(group_blocks)
            self.bytes_stored += r.nbytes
            self.ranges_stored += r.num_ranges
            self.store_s += r.elapsed_s
        else:
            self.loads += 1
            self.blocks_loaded += sum(group_blocks)
            self.bytes_loaded += r.nbytes
            self.ranges_loaded += r.num_ranges
            self.load_s += r.elapsed_s

    def snapshot(self) -> dict[str, Any]:
        """The counters as a new dict (lists copied), safe to hand to another thread."""
        return {k: list(v) if isinstance(v, list) else v for k, v in vars(self).items()}


class StatsFile:
    """The counters file at ``path``, replaced whole (a temporary file, then ``os.replace``) so a reader never sees
    half of one.

    Threading contract: ``update``, ``flush`` and ``close`` are called by one thread (the worker's); the writer
    thread, started by the first ``update``, only writes. ``_cond`` guards ``_pending`` (the newest snapshot not yet
    written), ``_queued``/``_done`` (update counts) and ``_closed``. ``update`` never waits for the disk: a snapshot
    that arrives while one is being written replaces the one waiting, so the file always ends at the newest.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._cond = threading.Condition()
        self._pending: dict[str, Any] | None = None
        self._queued = self._done = 0
        self._closed = False
        self._warned = False
        self._thread: threading.Thread | None = None

    def update(self, counters: dict[str, Any]) -> None:
        """Queue ``counters`` (a snapshot the caller no longer changes) to be written; returns at once."""
        with self._cond:
            if self._closed:
                return
            self._pending, self._queued = counters, self._queued + 1
            self._cond.notify_all()
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvxfer-stats", daemon=True)
            self._thread.start()

    def flush(self, timeout_s: float = 10.0) -> bool:
        """Wait until every queued snapshot was written (or its write failed); False when ``timeout_s`` passed first."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._done >= target, timeout_s)

    def close(self, counters: dict[str, Any] | None = None, timeout_s: float = 10.0) -> None:
        """Write ``counters`` (when given) and everything queued, then stop the writer thread (at most ``timeout_s``)."""
        if counters is not None:
            self.update(counters)
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                counters, seq, self._pending = self._pending, self._queued, None
            self._write(counters)
            with self._cond:
                self._done = seq
                self._cond.notify_all()

    def _write(self, counters: dict[str, Any]) -> None:
        try:  # a new temporary file (no link followed, none reused), renamed over the path
            replace_file(self.path, json.dumps(counters, indent=1).encode())
        except Exception as e:  # any failure: the writer thread goes on
            if not self._warned:  # once: a full disk would otherwise log every step
                self._warned = True
                _log.warning("kvxfer: writing the counters to %s failed (%s); the engine goes on, and later writes are "
                             "tried without this message", self.path, e)
