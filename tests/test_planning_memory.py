"""Planning memory stays within 2x the plan it produces, under every option; fingerprints expand nothing.

Memory is the tracemalloc peak during ``plan_transfer`` (inputs built before tracing starts) divided by
``plan.stored_nbytes`` taken right after planning. Sizes, not times: nothing here depends on machine speed.
"""
from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from kvxfer.planner import COLUMNS, PlanOptions, Target, hip_version, plan_transfer, presets
from kvxfer.planner.runs import Runs

BLOCKS = 2048  # 118 regions x 2048 fragmented pairs: 241,664 ranges, a few MiB of plan
OPTIONS = {
    "defaults": PlanOptions(), "no-coalesce": PlanOptions(coalesce=False), "cap-3": PlanOptions(max_descriptors=3),
    "cap-4096": PlanOptions(max_descriptors=4096), "max-range-16KiB": PlanOptions(max_range_bytes=16 * 1024),
    "max-range-24KiB": PlanOptions(max_range_bytes=24 * 1024), "regions-per-call-1": PlanOptions(regions_per_call=1),
    "regions-per-call-2": PlanOptions(regions_per_call=2), "overlap-flag": PlanOptions(prefer_overlap_with_compute=True),
    "writers-2": PlanOptions(num_writers=2, writer_index=0),
    "everything": PlanOptions(regions_per_call=2, max_descriptors=1000, max_range_bytes=16 * 1024, num_writers=2),
}


@pytest.fixture(scope="module")
def layout():
    layout = presets.kv_layout(118, 2 * BLOCKS, 32 * 1024)
    return layout.prepare()  # derived once per layout, as a serving loop does


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("name", sorted(OPTIONS))
def test_planning_peak_memory_is_at_most_twice_the_plan(layout, name, direction):
    mapping = presets.mapping("fragmented", BLOCKS, 2 * BLOCKS, direction)
    target = Target(platform="rocm", runtime_version=hip_version(7, 16))
    plan_transfer(layout, mapping, target, OPTIONS[name])  # per-layout caches made outside the measurement
    gc.collect()
    tracemalloc.start()
    try:
        plan = plan_transfer(layout, mapping, target, OPTIONS[name])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.num_ranges >= 118 * BLOCKS // 2  # a real plan (writer rotation keeps half the pages)
    assert peak <= 2 * plan.stored_nbytes, f"{name}: peak {peak} B for a plan of {plan.stored_nbytes} B"


def test_fingerprint_neither_expands_nor_keeps_run_length_columns(layout):
    plan = plan_transfer(layout, presets.mapping("fragmented", BLOCKS, 2 * BLOCKS), options=PlanOptions(regions_per_call=2))
    stored = plan.stored_nbytes
    assert stored < plan.num_ranges * 17  # two dense offset columns (16 B a range); the other five in runs
    gc.collect()
    tracemalloc.start()
    try:
        fingerprint = plan.fingerprint
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert plan.stored_nbytes == stored  # nothing expanded to be kept
    one_column = plan.num_ranges * 8
    assert peak < one_column, f"hashing took {peak} B; one expanded column is {one_column} B"
    assert fingerprint == plan_transfer(layout, presets.mapping("fragmented", BLOCKS, 2 * BLOCKS),
                                        options=PlanOptions(regions_per_call=2)).fingerprint


def test_fingerprint_is_the_same_for_run_length_and_expanded_columns(layout):
    """Hashing a run-length column piece by piece gives the hash of its dense bytes."""
    plan = plan_transfer(layout, presets.mapping("runs8", 300, 2 * BLOCKS))
    from kvxfer.planner import TransferPlan
    again = TransferPlan.from_dict(plan.to_dict())  # every column dense
    assert again.stored_nbytes == plan.num_ranges * sum(d.itemsize for d in COLUMNS.values()) + again.call_offsets.nbytes
    assert again.fingerprint == plan.fingerprint


@pytest.mark.parametrize("column", ["src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region", "attr",
                                    "call_offsets"])
def test_changing_any_one_column_changes_the_fingerprint(column):
    """Each column, run-length or dense, feeds the hash: one changed entry gives another fingerprint."""
    from kvxfer.planner import Buffer, CopyAttributes, TransferPlan
    from kvxfer.planner.plan import LocationHint

    buffers = (Buffer(name="a", nbytes=1 << 20), Buffer(name="b", nbytes=1 << 20))
    hint = LocationHint(location="device")
    attrs = (CopyAttributes(src_access_order="any", src_location=hint, dst_location=hint),) * 2
    n = 300_000  # more than one streamed piece of a run-length column

    def plan(change: bool) -> TransferPlan:
        cols = {"src_buf": Runs(np.array([0, 1]), np.array([n // 2, n // 2])), "src_offset": np.arange(n) * 2,
                "dst_buf": Runs(np.array([1, 0]), np.array([n // 2, n // 2])), "dst_offset": np.arange(n) * 2 + 1,
                "nbytes": Runs(np.array([1]), np.array([n])), "region": Runs(np.array([0, 1]), np.array([n - 1, 1])),
                "attr": Runs(np.array([0, 1]), np.array([n - 1, 1]))}
        offsets = np.array([0, n // 2, n])
        if change and column == "call_offsets":
            offsets = np.array([0, n // 2 + 1, n])
        elif change:
            col = cols[column]
            dense = col.dense() if isinstance(col, Runs) else col.copy()
            dense[-1] = (dense[-1] + 1) % 2 if column.endswith("buf") or column in ("region", "attr") else dense[-1] + 1
            cols[column] = dense
        return TransferPlan(direction="h2d", target=Target(), options=PlanOptions(), buffers=buffers,
                            regions=("r0", "r1"), attrs=attrs, requested_copies=n, call_offsets=offsets, columns=cols)

    assert set(COLUMNS) | {"call_offsets"} >= {column}
    base, changed = plan(False), plan(True)
    assert base.fingerprint == plan(False).fingerprint
    assert base.fingerprint != changed.fingerprint
