"""Lowering old against new in one process, on the layouts of ``bench_hostpath.py`` (236 numpy buffers).

    git show 0320498:executors/binding.py > /tmp/old_binding.py
    .venv/bin/python benchmarks/compare_lowering.py /tmp/old_binding.py [--c32]

OLD is an older ``executors/binding.py`` (its ``bind``, ``descriptors`` and ``offsets``), loaded beside this
checkout. Per shape, the four calls (old and new ``descriptors``, old and new ``offsets``) are sampled in turn
and the fastest sample of each is kept (60 samples; 8 for the C32-sized restore), so load from other processes
falls on all of them alike. New ``descriptors`` writes into reused ``DescriptorArrays``, as the DMA executors
do; the old one into three arrays made once. Nothing is asserted; figures go to benchmarks/NOTES.md.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hostpath as bh
from bench_binding import load_baseline

from kvxfer.executors import bind
from kvxfer.executors._lowering import DescriptorArrays

from timing import fastest_s

SHAPES = [("contiguous", 256, 1), ("runs8", 256, 1), ("fragmented", 256, 1), ("fragmented", 2048, 1),
          ("fragmented", 2048, 4)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("old", help="an older executors/binding.py")
    ap.add_argument("--c32", action="store_true", help="also the C32-sized restore (118 x 16,128 blocks)")
    args = ap.parse_args()
    old = load_baseline(args.old)
    print(f"{'shape (h2d)':<28}{'ranges':>9}  descriptors new/old  offsets new/old   (fastest of the samples)")
    for pattern, n, k in SHAPES + ([("fragmented", bh.C32_BLOCKS, 1)] if args.c32 else []):
        job, gpu_blocks, cpu_chunks = bh.make_job(pattern, n, k, "h2d")
        layout = bh.worker_layout(bh.NUM_TENSORS, gpu_blocks, cpu_chunks, 256, k)
        mem = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
        new_bound = bind(layout, mem, check=lambda b, m: None)  # host arrays stand in for device memory
        old_bound = old.bind(layout, mem, check=lambda b, m: None)
        plan = bh.plan_job(layout, job)
        arrays = DescriptorArrays()
        out = tuple(np.empty(plan.num_ranges, np.uint64) for _ in range(3))
        t = fastest_s({"old d": lambda: old_bound.descriptors(plan, out),
                       "new d": lambda: new_bound.descriptors(plan, arrays.reserve(plan.num_ranges)),
                       "old o": lambda: old_bound.offsets(plan), "new o": lambda: new_bound.offsets(plan)},
                      8 if n > 10000 else 60, warm=False)
        print(f"{f'118x{n} k={k} {pattern}':<28}{plan.num_ranges:>9}  {t['new d'] / t['old d']:>19.2f}"
              f"  {t['new o'] / t['old o']:>15.2f}", flush=True)


if __name__ == "__main__":
    main()
