"""Temporary adapters to the cross-branch contract, in one place so they can go in one step.

The worker codes against ``Executor.run(plan, memory, stream=None, after=None)``, ``Executor.synchronous``,
``kvxfer.executors.stream_handle`` (executors branch) and ``Layout.group_count`` / ``Layout.chunked`` (planner
branch). Until those land, these functions give the same answers from what exists today; once they land, each
function's first branch is the whole of it, and callers can use the real names directly.
"""
from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

from kvxfer.executors import NumpyExecutor, Transfer
from kvxfer.planner import Layout, Platform, TransferPlan

try:
    from kvxfer.executors import stream_handle  # public once the executors branch lands
except ImportError:  # TEMPORARY: the DMA module's function, the same one the executors branch exports
    from kvxfer.executors.dma import stream_handle

__all__ = ["Run", "chunked", "group_count", "runner", "stream_handle", "synchronous", "wait_quietly"]


def synchronous(executor: Any) -> bool:
    """``executor.synchronous``: True when ``run`` has finished every copy when it returns."""
    value = getattr(executor, "synchronous", None)
    if isinstance(value, bool):
        return value
    # TEMPORARY: what the executors branch's property reports for today's executors
    if isinstance(executor, NumpyExecutor) or getattr(executor, "interpret", False):
        return True
    return getattr(executor, "platform", None) is Platform.CPU  # auto on a host without a GPU picks NumPy


def wait_quietly(transfers: Sequence[Transfer]) -> None:
    """Block until every transfer has finished, successfully or not: an error belongs to the transfer's owner."""
    for t in transfers:
        try:
            t.wait()
        except Exception:  # reported by the job that ran it
            pass


Run = Callable[[TransferPlan, Any, Any, Sequence[Transfer]], Transfer]


def runner(executor: Any) -> Run:
    """``run(plan, memory, stream, after)`` for ``executor``, resolved once: ``executor.run(plan, memory,
    stream=stream, after=after)``, whose copies start after ``stream``'s work so far and after every transfer in
    ``after`` has finished."""
    try:
        takes_after = "after" in inspect.signature(executor.run).parameters
    except (TypeError, ValueError):
        takes_after = False
    if takes_after:
        return lambda plan, memory, stream, after: executor.run(plan, memory, stream=stream, after=list(after) or None)
    # TEMPORARY, for executors without ``after``: host executors wait on the host; GPU executors order through the
    # caller's stream (the copy stream waits for that stream, which then waits for each transfer on the device)
    host = synchronous(executor)

    def run(plan: TransferPlan, memory: Any, stream: Any, after: Sequence[Transfer]) -> Transfer:
        if host:
            wait_quietly(after)
        else:
            for t in after:
                t.stream_wait(stream, -1)
        return executor.run(plan, memory, stream=stream)  # type: ignore[no-any-return]
    return run


def group_count(layout: Layout) -> int:
    """``layout.group_count``: the declared KV-cache groups, else one more than the largest region group (1 if none)."""
    value = getattr(layout, "group_count", None)
    if isinstance(value, int):
        return value
    return layout.num_groups or 1 + max((r.group for r in layout.regions), default=0)


def chunked(layout: Layout) -> bool:
    """``layout.chunked``: some region holds more than one block per chunk on some side."""
    value = getattr(layout, "chunked", None)
    if isinstance(value, bool):
        return value
    return any(p.blocks_per_chunk > 1 for r in layout.regions for p in (r.device, r.host))
