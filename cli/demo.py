"""The demo: MiniMax-M3-shaped restores planned for three runtimes, run on host memory and verified."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    BlockMapping,
    Layout,
    PlanOptions,
    Platform,
    Target,
    TransferPlan,
    cuda_version,
    hip_version,
    plan_transfer,
    presets,
)
from kvxfer.testing import random_buffers, run_reference

TARGETS = {
    "rocm-7.2": Target(platform=Platform.ROCM, runtime_version=hip_version(7, 2, 53211)),
    "rocm-7.16": Target(platform=Platform.ROCM, runtime_version=hip_version(7, 16)),
    "cuda-13.0": Target(platform=Platform.CUDA, runtime_version=cuda_version(13, 0)),
}


def describe_attrs(plan: TransferPlan) -> str:
    """The plan's attributes for the demo table: how many records the calls pass, the first's access order and flags; ``-``
    when the plan has none."""
    a = plan.attrs[0] if plan.attrs else None
    if a is None:
        return "-"
    return f"{len(plan.attrs) if plan.passes_attrs else 0}x {a.src_access_order.value} {a.flags:#x}"


Row = dict[str, Any]


def run_demo(page_bytes: int = 1024, regions: int = 118, blocks: int = 256, seed: int = 0,
             on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Plan every pattern for every target, execute on host memory, verify bytes; returns table rows and
    hands each to ``on_row`` as soon as it is verified."""
    pool = 2 * blocks
    layout = presets.kv_layout(regions, pool, page_bytes)
    base = random_buffers(layout, seed)
    rows = []
    for pattern in presets.PATTERNS:
        mapping = presets.mapping(pattern, blocks, pool, seed=seed)
        want = run_reference(layout, mapping, base)  # per-piece copies from the spec, not from the planner
        for tname, target in TARGETS.items():
            t0 = time.perf_counter()
            plan = plan_transfer(layout, mapping, target)
            t_plan = time.perf_counter() - t0
            bufs = {k: v.copy() for k, v in base.items()}
            NumpyExecutor().run(plan, bufs)
            ok = all(np.array_equal(bufs[k], want[k]) for k in bufs)
            rows.append({"pattern": pattern, "target": tname, "requested": plan.requested_copies,
                         "ranges": plan.num_ranges, "calls": plan.num_calls, "call_sizes": plan.call_sizes.tolist(),
                         "attrs": describe_attrs(plan), "api": plan.api.value, "plan_ms": t_plan * 1e3,
                         "bytes": plan.total_bytes, "verified": ok})
            if on_row is not None:
                on_row(rows[-1])
    return rows


def layout_cases(page_bytes: int, regions: int, blocks: int) -> list[tuple[str, Layout, BlockMapping, PlanOptions]]:
    """The layout features of vLLM's offload worker, each on the demo's shape."""
    pool = 2 * blocks
    contiguous = presets.mapping("contiguous", blocks, pool)
    chunks = np.arange(blocks // 4) + 1
    head_bytes = max(page_bytes // 128, 1)
    frag = presets.tp_fragment_layout(regions, pool, tokens=16, heads=8, head_bytes=head_bytes, tp=2, rank=1)
    store = presets.mapping("runs8", blocks, pool, "d2h")
    return [
        ("page-first, contiguous", presets.page_first_layout(regions, pool, page_bytes), contiguous, PlanOptions()),
        ("host chunks k=4, start 2", presets.chunked_layout(regions, pool, page_bytes, 4),
         BlockMapping(direction="h2d", src_ids=np.append(chunks, chunks[-1] + 1), dst_ids=np.arange(blocks),
                      group_sizes=[blocks], group_starts=[2]), PlanOptions()),
        ("TP2 rank 1 fragments, store", frag, store, PlanOptions()),
        ("  + writer rotation 2 of 2", frag, store, PlanOptions(num_writers=2, writer_index=1)),
        ("layer-wise calls (per layer)", presets.kv_layout(regions, pool, page_bytes), contiguous,
         PlanOptions(regions_per_call=1)),
    ]


def run_layout_demo(page_bytes: int = 1024, regions: int = 118, blocks: int = 256, seed: int = 0,
                    on_row: Callable[[Row], None] | None = None) -> list[Row]:
    """Plan each layout feature, run it, and compare every byte with the test oracle's per-piece copies."""
    rows = []
    target = TARGETS["cuda-13.0"]
    for name, layout, mapping, options in layout_cases(page_bytes, regions, blocks):
        base = random_buffers(layout, seed)
        want = run_reference(layout, mapping, base, options)
        t0 = time.perf_counter()
        plan = plan_transfer(layout, mapping, target, options)
        t_plan = time.perf_counter() - t0
        NumpyExecutor().run(plan, base)
        rows.append({"layout": name, "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "bytes": plan.total_bytes, "plan_ms": t_plan * 1e3,
                     "verified": all(np.array_equal(base[k], want[k]) for k in base)})
        if on_row is not None:
            on_row(rows[-1])
    return rows
