"""The job queue's state that both chunk stores share (``ChunkStore``, ``SharedChunkStore``): whether work is left,
and waiting for the queue to empty. A store holds ``_cond`` (guarding the rest), ``_queue`` (jobs not started),
``_running`` (jobs started, not finished) and ``_results`` (finished, not yet polled); ``_died`` is why its
thread stopped, if it ever did (a waiter then returns instead of waiting for jobs nobody runs).
"""
from __future__ import annotations

import threading
from collections.abc import Sized
from typing import Any

__all__ = ["QueuedJobs"]


class QueuedJobs:
    """``pending`` and ``drain`` over a store's job queue (the attributes named in the module docstring)."""

    _cond: threading.Condition
    _queue: Sized
    _running: int
    _results: list[Any]
    _died: BaseException | None = None

    @property
    def pending(self) -> bool:
        """Whether a job is queued, running, or finished and not yet polled."""
        with self._cond:
            return bool(self._queue or self._running or self._results)

    def drain(self) -> None:
        """Block until every submitted job has finished (its result waits for ``poll``), or the store's thread has
        stopped (its jobs then fail as jobs)."""
        with self._cond:
            while (self._queue or self._running) and self._died is None:
                self._cond.wait()
