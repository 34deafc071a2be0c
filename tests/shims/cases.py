"""Host buffers and the reference result for executor tests."""
from __future__ import annotations

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import Layout, TransferPlan
from kvxfer.testing import random_buffers


def host_buffers(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    """One random uint8 array per buffer of ``layout`` (random bytes double as sentinels)."""
    return random_buffers(layout, seed)


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


def gpu_buffers(layout: Layout) -> dict:
    """Random bytes in every buffer: device buffers on the GPU, host buffers pinned (device tests only)."""
    import torch

    def make(b):
        t = torch.randint(0, 255, (b.nbytes,), dtype=torch.uint8)
        return t.to("cuda") if b.location.value == "device" else t.pin_memory()
    return {b.name: make(b) for b in layout.buffers}


def gpu_round_trip(ex, plan: TransferPlan, mem: dict) -> None:
    """Run ``plan`` on GPU memory and compare every byte with the NumPy reference."""
    import torch

    want = expected(plan, {k: v.cpu().numpy().copy() for k, v in mem.items()})
    torch.cuda.synchronize()
    ex.run(plan, mem).wait()
    assert_same({k: v.cpu().numpy() for k, v in mem.items()}, want)
