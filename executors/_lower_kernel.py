"""Lowering's addition and its bound in one compiled pass (numba, optional: the ``fast`` extra).

Without it, lowering a side of a plan (``_lowering._place``) adds each buffer run's base to its offsets in one
numpy pass, then bounds the addresses with a maximum and a minimum per run (``reduceat``): three passes over
the addresses. ``kernel()`` returns a loop that does all three in one: each address is written, and compared
with its run's largest and smallest, while it is in a register. On a C32-sized restore (1.9 million ranges a
side) that is the difference between reading the addresses three times and once.

The loop decides nothing: it returns whether every run's largest address is at most its run's limit and its
smallest at least its base (no sum wrapped), and the caller applies the same rule as without it: where that
holds (and the plan's largest range fits every buffer used) the side is inside; otherwise the bound rule itself
(``bounds.check_inside``) compares every range and names the first one outside.

Compiled once per machine and cached by numba (as ``_host_copy``'s loop); ``kernel()`` compiles or loads it, so
``bind`` loads it, never a job.
"""
from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.planner import MissingDependencyError, import_optional

__all__ = ["AddBounded", "kernel", "load"]

AddBounded = Callable[[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray], bool]


def _add_bounded(offs: np.ndarray, bases: np.ndarray, lengths: np.ndarray, limits: np.ndarray,
                 out: np.ndarray) -> bool:  # pragma: no cover - compiled
    """``out[i]`` = its run's base + ``offs[i]`` (modulo 2^64) for the runs ``lengths`` (int64, covering
    ``offs``); True when every run's addresses lie in [its base, its limit]."""
    ok = True
    at = 0
    for r in range(lengths.shape[0]):
        b = bases[r]
        m = lengths[r]
        src = offs[at:at + m]  # a view per run: its index counts from 0, so no negative-index test stops SIMD
        dst = out[at:at + m]
        hi = b
        lo = b
        for j in range(src.shape[0]):
            a = b + src[j]
            dst[j] = a
            hi = max(hi, a)
            lo = min(lo, a)
        if hi > limits[r] or lo < b:
            ok = False
        at += m
    return ok


@functools.cache
def kernel() -> AddBounded:
    """The compiled loop (see the module docstring), compiled or loaded from numba's cache on first use;
    MissingDependencyError where numba is not installed."""
    numba: Any = import_optional("numba", "lowering's compiled pass")
    types: Any = numba.types

    def signature(layout: str) -> Any:  # read-only inputs: writable arrays convert to them
        read = types.Array(types.uint64, 1, layout, readonly=True)
        return types.boolean(read, read, types.Array(types.int64, 1, layout, readonly=True), read,
                             types.Array(types.uint64, 1, layout))
    # contiguous arrays (what lowering passes: about 20% faster, the loop vectorizes without stride checks), and
    # any layout; both compiled (or loaded) now, so no job compiles
    fn: AddBounded = numba.njit([signature("C"), signature("A")], nogil=True, cache=True)(_add_bounded)
    empty = np.zeros(0, np.uint64)
    fn(empty, empty, np.zeros(0, np.int64), empty, empty)  # the dispatcher's first call sets itself up: now
    return fn


def load() -> AddBounded | None:
    """``kernel()``, or None where numba is not installed."""
    try:
        return kernel()
    except MissingDependencyError:
        return None
