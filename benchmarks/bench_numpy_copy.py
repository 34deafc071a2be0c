"""The NumPy executor on fragmented pages against one memcpy of the same bytes and against the per-range loop it
used before (one slice assignment per range), in one run.

Per page size: a fragmented h2d plan (random block ids on both sides, nothing merges) over --regions regions,
about --mbytes MiB in all, on memory bound once. Columns are medians of --repeat interleaved runs:
- ``memcpy``: ``np.copyto`` of one contiguous array of the plan's total bytes;
- ``loop``: ``bound.check(plan)`` then one slice assignment per range (the executor before 2026-12-01);
- ``numpy``: ``NumpyExecutor.run(plan, bound)`` (its paths, ``NumpyExecutor.explain``: ranges below
  SMALL_RANGE_BYTES in window groups, larger ones by memmove, from 1 MiB through torch when it is imported).
Ratios are memcpy time / time (1.0 = memcpy speed). Every run's result is checked against the loop's.

    .venv/bin/python benchmarks/bench_numpy_copy.py [--mbytes 64] [--repeat 7]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.executors._ops_numpy import SMALL_RANGE_BYTES
from kvxfer.planner import plan_transfer, presets

from timing import medians_ms  # this folder: on sys.path when the script runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mbytes", type=int, default=64)
    ap.add_argument("--regions", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--pages", default="512,2048,4096,16384,32768,131072")
    args = ap.parse_args()
    ex = NumpyExecutor()
    print(f"fragmented h2d, {args.regions} regions, ~{args.mbytes} MiB per plan; median of {args.repeat}; "
          f"SMALL_RANGE_BYTES {SMALL_RANGE_BYTES}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for page in (int(p) for p in args.pages.split(",")):
        per_region = max(1, (args.mbytes << 20) // page // args.regions)
        layout = presets.kv_layout(args.regions, 2 * per_region, page, shared_host=False)
        plan = plan_transfer(layout, presets.mapping("fragmented", per_region, 2 * per_region, "h2d", seed=1))
        rng = np.random.default_rng(0)
        mem = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers}
        bound = ex.bind(layout, mem)
        views = [mem[b.name] for b in layout.buffers]
        cols = [plan.column(c).tolist() for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes")]

        def loop() -> None:
            bound.check(plan)
            for sb, so, db, do, n in zip(*cols):
                views[db][do:do + n] = views[sb][so:so + n]
        a, b = np.ones(plan.total_bytes, np.uint8), np.empty(plan.total_bytes, np.uint8)
        fns = {"memcpy": lambda: np.copyto(b, a), "loop": loop, "numpy": lambda: ex.run(plan, bound)}
        loop()
        want = {k: v.copy() for k, v in mem.items()}
        ex.run(plan, bound)
        if any(not np.array_equal(mem[k], want[k]) for k in mem):
            raise SystemExit(f"page {page}: the NumPy executor and the loop disagree")
        ms = medians_ms(fns, args.repeat)
        print(f"  {ex.explain(plan)}")
        print(f"page {page:>7} B x {plan.num_ranges:>7} ranges  memcpy {ms['memcpy']:8.2f} ms  loop {ms['loop']:8.2f} ms "
              f"({ms['memcpy'] / ms['loop']:4.2f}x memcpy)  numpy {ms['numpy']:8.2f} ms ({ms['memcpy'] / ms['numpy']:4.2f}x "
              f"memcpy, {ms['loop'] / ms['numpy']:5.2f}x the loop)")


if __name__ == "__main__":
    main()
