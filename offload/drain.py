"""Accepted jobs drained on every way out a process takes that Python sees.

A worker or store runs its jobs on daemon threads, which the interpreter stops without a word as it exits: a store
accepted and not yet written would be lost by a script (or an engine process) that ends without calling its
``shutdown``/``close``. ``drain_at_exit(close)`` wraps such a close so that it runs once, whoever calls it first:
the owner, or the interpreter at exit (``atexit``, which runs while daemon threads still run). What no process can
see (SIGKILL, a parent that kills its engine process after a grace period) is the user's to avoid: the docs say how
(``docs/vllm/failures.md``, ``docs/reference/troubleshooting.md``).
"""
from __future__ import annotations

import atexit
import itertools
import logging
import threading
import weakref
from collections.abc import Callable

__all__ = ["DrainAtExit", "drain_at_exit", "drain_now"]

_log = logging.getLogger("kvxfer.offload")
_open: weakref.WeakSet[DrainAtExit] = weakref.WeakSet()
_guard = threading.Lock()
_hooked = False
_order = itertools.count()


class DrainAtExit:
    """``close`` made to run at most once: by calling this object (every call after the first waits for the first
    to finish and returns), or at interpreter exit while the object is alive. Held by its owner: once the owner is
    collected, nothing keeps ``close`` (or what it closes) alive. Callable from any thread."""

    __slots__ = ("__weakref__", "_close", "_done", "_lock", "name", "order")

    def __init__(self, close: Callable[[], None], name: str):
        self._close: Callable[[], None] | None = close
        self._lock = threading.Lock()
        self._done = False
        self.name = name
        self.order = next(_order)

    @property
    def done(self) -> bool:
        """Whether ``close`` has run (or is running)."""
        return self._done

    def __call__(self) -> None:
        with self._lock:  # a second caller waits here until the first close returns
            if self._done:
                return
            self._done = True
            close, self._close = self._close, None
            _open.discard(self)
            if close is not None:
                close()


def drain_at_exit(close: Callable[[], None], name: str = "") -> DrainAtExit:
    """``close`` (a worker's ``shutdown``, a store's ``close``: drains what was accepted, then releases) wrapped to
    run once, now registered to run at interpreter exit unless its owner ran it first. ``name`` is for the log."""
    global _hooked
    entry = DrainAtExit(close, name or getattr(close, "__qualname__", repr(close)))
    with _guard:
        _open.add(entry)
        if not _hooked:
            atexit.register(drain_now)
            _hooked = True
    return entry


def drain_now() -> int:
    """Run every registered close not yet run, newest first (a store after the worker that feeds it); a close that
    raises is logged and the others still run. Returns how many ran. Called at interpreter exit."""
    with _guard:
        entries = sorted(_open, key=lambda e: e.order)  # a snapshot: closing discards from the set
    ran = 0
    for entry in reversed(entries):
        if entry.done:
            continue
        try:
            entry()
            ran += 1
        except Exception as e:  # one failed drain never stops the others
            _log.warning("kvxfer: draining %s at exit failed: %r", entry.name, e)
    return ran
