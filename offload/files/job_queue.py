"""The job queue's state that both chunk stores share (``ChunkStore``, ``SharedChunkStore``): whether work is left,
and waiting for the queue to empty. A store holds ``_cond`` (guarding the rest), ``_queue`` (jobs not started),
``_running`` (jobs started, not finished) and ``_results`` (finished, not yet polled); ``_died`` is why its
thread stopped, if it ever did (a waiter then returns instead of waiting for jobs nobody runs).
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from typing import Any

__all__ = ["QueuedJobs"]


class QueuedJobs:
    """``pending`` and ``drain`` over a store's job queue (the attributes named in the module docstring), and what
    the store's thread does with a job's result (``_finished``) or should it stop anyway (``_stopped``)."""

    _cond: threading.Condition
    _queue: deque[Any]
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

    def _failed(self, job: Any, why: BaseException) -> Any:
        """``job`` as a failed result, of the store's kind of result."""
        raise NotImplementedError

    def _finished(self, result: Any) -> None:
        """A running job's result: kept for ``poll``, the job no longer running, waiters woken."""
        with self._cond:
            self._results.append(result)
            self._running -= 1
            self._cond.notify_all()

    def _stopped(self, log: logging.Logger, name: str, running: Any, why: BaseException) -> None:
        """The store's thread stops (``why``): logged; the job it ran (``running``, None if none) and every queued
        one fail as jobs; from now on submissions fail as jobs and ``drain`` returns at once."""
        log.error("kvxfer %s: the store's thread stopped (%r); its jobs fail from now on", name, why)
        with self._cond:
            self._died = why
            for job in [*([running] if running is not None else []), *self._queue]:
                self._results.append(self._failed(job, why))
            self._queue.clear()
            self._running = 0
            self._cond.notify_all()
