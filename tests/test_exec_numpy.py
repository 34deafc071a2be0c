"""The NumPy executor's grouped copy path equals one slice assignment per range, byte for byte, sentinels included.

Hand-made plans mix sizes on both sides of SMALL_RANGE_BYTES within one segment, odd offsets and sizes, buffer
pairs that change mid-call, several calls, and a source and destination in one buffer; the reference is a
Python loop over the plan's ranges written here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import ExecutorError, NumpyExecutor
from kvxfer.executors.ops_numpy import FEW_RANGES, GATHER_BYTES, SMALL_RANGE_BYTES
from kvxfer.planner import COLUMNS, Buffer, Layout, Location, Placement, Region, TransferPlan, plan_transfer

SIZE = 1 << 20
LAYOUT = Layout(buffers=(Buffer(name="h", nbytes=SIZE, location=Location.HOST), Buffer(name="d0", nbytes=SIZE),
                         Buffer(name="d1", nbytes=SIZE)),
                regions=(Region(name="r", page_bytes=64, device=Placement(buffer="d0"), host=Placement(buffer="h")),))
TEMPLATE = plan_transfer(LAYOUT, {"direction": "h2d", "src_ids": [0], "dst_ids": [0]})
SIZES = (1, 7, 64, 64, 64, 512, 4096, SMALL_RANGE_BYTES - 1, SMALL_RANGE_BYTES, 20000, GATHER_BYTES + 3)


def random_plan(seed: int, segments: int = 6, calls: int = 3) -> TransferPlan:
    """Ranges in ``segments`` runs of one (source, destination) buffer pair, destinations never overlapping each
    other or any source in the same buffer; ``calls`` calls cut across the runs."""
    rng = np.random.default_rng(seed)
    rows = []
    free = {0: [0], 1: [0], 2: [0]}  # per buffer: the next free destination byte (destinations in the upper half)
    for _ in range(segments):
        src, dst = (int(x) for x in rng.choice(3, 2, replace=bool(rng.integers(0, 2))))
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.choice(SIZES))
            if free[dst][0] + n > SIZE // 2:
                continue
            do = SIZE // 2 + free[dst][0] + int(rng.integers(0, 3))
            free[dst][0] = do - SIZE // 2 + n
            so = int(rng.integers(0, SIZE // 2 - n))  # sources in the lower half: never a destination
            rows.append((src, so, dst, do, n))
    cols = {c: np.array(v) for c, v in zip(("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes"), zip(*rows))}
    cols["region"] = np.zeros(len(rows), np.int32)
    cols["attr"] = np.zeros(len(rows), np.uint16)
    cuts = np.unique(np.concatenate(([0, len(rows)], rng.integers(1, len(rows), calls - 1))))
    return TransferPlan(direction=TEMPLATE.direction, target=TEMPLATE.target, options=TEMPLATE.options,
                        buffers=LAYOUT.buffers, regions=TEMPLATE.regions, attrs=TEMPLATE.attrs,
                        requested_copies=len(rows), call_offsets=cuts, columns={c: cols[c] for c in COLUMNS})


def reference(plan: TransferPlan, bufs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in bufs.items()}
    names = [b.name for b in plan.buffers]
    for sb, so, db, do, n in zip(*(plan.column(c).tolist() for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes"))):
        out[names[db]][do:do + n] = out[names[sb]][so:so + n]
    return out


@pytest.mark.parametrize("seed", range(12))
def test_grouped_copies_equal_one_slice_assignment_per_range(seed):
    plan = random_plan(seed)
    rng = np.random.default_rng(100 + seed)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}  # random bytes: sentinels
    want = reference(plan, bufs)
    sizes = plan.nbytes
    assert (sizes < SMALL_RANGE_BYTES).sum() > FEW_RANGES and (sizes >= SMALL_RANGE_BYTES).any()  # both paths taken
    NumpyExecutor().run(plan, bufs)
    for k in bufs:
        assert np.array_equal(bufs[k], want[k]), k


def test_a_read_only_source_can_be_read_and_any_buffer_pair_copies():
    plan = random_plan(99)
    rng = np.random.default_rng(5)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    want = reference(plan, bufs)
    ro = {k: v.copy() for k, v in bufs.items()}
    written = set(np.unique(plan.dst_buf).tolist())
    for i, b in enumerate(LAYOUT.buffers):
        if i not in written:
            ro[b.name].flags.writeable = False
    NumpyExecutor().run(plan, ro)
    assert all(np.array_equal(ro[k], want[k]) for k in ro)


def test_a_failure_while_copying_names_the_call_and_leaves_later_calls_uncopied():
    plan = random_plan(3)
    assert plan.num_calls >= 2
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) + 1 for b in LAYOUT.buffers}
    k = plan.num_calls - 1
    first = int(plan.call_offsets[k])

    class RunsOutOfMemory(NumpyExecutor):
        def move(self, src, dst, low, index):
            if int(index.max()) >= first:
                raise MemoryError("no memory for the temporary")
            super().move(src, dst, low, index)
    with pytest.raises(ExecutorError, match=rf"^numpy copy failed at chunk {k}, descriptor \d+: MemoryError: no memory"):
        RunsOutOfMemory().run(plan, bufs)
