"""Timing shared by the benchmark scripts (imported from their own folder when they run as scripts)."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any


def medians_ms(fns: dict[str, Callable[[], Any]], repeat: int) -> dict[str, float]:
    """Median milliseconds of each function over ``repeat`` rounds, calls interleaved so machine load hits all alike."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def fastest_s(fns: dict[str, Callable[[], Any]], samples: int, warm: bool = True) -> dict[str, float]:
    """The fastest of ``samples`` seconds of each function, calls interleaved so machine load hits all alike
    (each called once first when ``warm``)."""
    if warm:
        for fn in fns.values():
            fn()
    best = {k: float("inf") for k in fns}
    for _ in range(samples):
        for k, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            best[k] = min(best[k], time.perf_counter() - t0)
    return best
