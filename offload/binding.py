"""Binding the worker's memory to an executor once, and what a worker needs from a GPU runtime."""
from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

from kvxfer.planner import Layout


def bind_memory(executor: Any, layout: Layout, bindings: Mapping[str, Any]) -> Any:
    """Bind ``bindings`` for ``layout``'s buffers once: ``executor.bind`` where the executor has it (resolved,
    checked and pinned once; runs then pay only a vectorized range check). Executors without it get the
    bindings themselves, which ``run(plan, bindings)`` resolves on every run.

    The one place that knows about executors without ``bind``; delete the fallback once every executor has it.
    """
    bind = getattr(executor, "bind", None)
    if bind is not None:
        return bind(layout, bindings)
    return dict(bindings)


def release_memory(executor: Any, bound: Any) -> None:
    """Undo ``bind_memory`` (a plain bindings dict needs nothing)."""
    if isinstance(bound, dict):
        return
    close = getattr(bound, "close", None)
    if close is not None:
        close()
    elif hasattr(executor, "unbind"):
        executor.unbind(bound)


def stream_handle(stream: Any) -> int:
    """A raw stream handle: None is torch's current stream when torch has a GPU initialized, else the
    legacy default stream 0; an int; or an object with ``cuda_stream`` (torch) or ``__int__`` (CUstream)."""
    if stream is None:
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream().cuda_stream)
        return 0
    return int(getattr(stream, "cuda_stream", stream))


class Pool:
    """Reusable handles (streams, events): ``acquire`` takes a free one or makes a new one, so it never
    blocks; ``release`` returns it; ``clear`` destroys every handle made. ``made`` counts creations."""

    def __init__(self, make: Callable[[], Any], destroy: Callable[[Any], Any] = lambda h: None):
        self._make, self._destroy = make, destroy
        self._free: list[Any] = []
        self._all: list[Any] = []

    @property
    def made(self) -> int:
        return len(self._all)

    def acquire(self) -> Any:
        if self._free:
            return self._free.pop()
        h = self._make()
        self._all.append(h)
        return h

    def release(self, handle: Any) -> None:
        self._free.append(handle)

    def clear(self) -> None:
        for h in self._all:
            self._destroy(h)
        self._all.clear()
        self._free.clear()
