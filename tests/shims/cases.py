"""Host buffers and the reference result for executor tests."""
from __future__ import annotations

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import Layout, TransferPlan


def host_buffers(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    """One random uint8 array per buffer of ``layout`` (random bytes double as sentinels)."""
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers}


def expected(plan: TransferPlan, bufs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """What ``bufs`` must hold after running ``plan``: the NumPy executor's result on a copy."""
    ref = {k: v.copy() for k, v in bufs.items()}
    NumpyExecutor().run(plan, ref)
    return ref


def assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name in want:
        if not np.array_equal(got[name], want[name]):
            bad = np.flatnonzero(got[name] != want[name])
            raise AssertionError(f"buffer {name!r}: {bad.size} bytes differ, first at offset {int(bad[0])}")
