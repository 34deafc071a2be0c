"""Per-run cost of lowering a plan on bound memory, old against new in one run, and of the per-run owner check.

A C32-sized restore by default (118 regions x 256 blocks, 236 buffers: one device and one host tensor per
region) in three block patterns. Per pattern, medians of --repeat interleaved calls of:
- ``old``: ``BoundMemory.lower(plan, out)`` of the baseline binding module (--baseline FILE), on RawMemory;
  ``old+nbytes`` adds the expansion of the plan's size column that the old DMA run then passed to the driver
  (``plan.nbytes``, once per plan: per job), which the new lowering does itself (it copies the sizes it checks);
- ``new``: ``BoundMemory.descriptors(plan, arrays)`` of this checkout, into reused ``DescriptorArrays`` as the DMA
  executors keep (each column read once, the addresses bounded as written, sizes of one value kept written);
- ``new+owners``: the same with every buffer bound to a CPU torch tensor, so each run also asks every tensor the
  plan touches where it points (the check that refuses a tensor moved since bind);
- ``owners``: that check alone (``BoundMemory.buffer_runs`` of a set already seen: the probes);
- ``owners(views)``: the same with every buffer bound to a numpy view of a larger array, as aligned host memory
  is (``kvxfer.offload.aligned_empty``): the probes read the view's data pointer and its owner's.
Memory is never touched by lowering, so pages are 64 bytes (the tensors stay small); costs depend on counts.

    git show 7a517d5:executors/binding.py > /tmp/old_binding.py
    .venv/bin/python benchmarks/bench_binding.py --baseline /tmp/old_binding.py [--blocks 256] [--repeat 15]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.planner import Location, Target, plan_transfer, presets

from timing import medians_ms  # this folder: on sys.path when the script runs


def load_baseline(path: str) -> Any:
    spec = importlib.util.spec_from_file_location("kvxfer_old_binding", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--baseline {path}: not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", type=int, default=118)
    ap.add_argument("--blocks", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=15)
    ap.add_argument("--baseline", help="an older executors/binding.py, measured in the same run")
    args = ap.parse_args()
    import torch

    from kvxfer.executors import RawMemory, bind
    from kvxfer.executors._lowering import DescriptorArrays
    old = load_baseline(args.baseline) if args.baseline else None
    layout = presets.kv_layout(args.regions, 2 * args.blocks, 64, shared_host=False)
    target = Target(platform="cuda", runtime_version=13000)
    raw, base = {}, 1 << 40
    for b in layout.buffers:
        raw[b.name] = RawMemory(base, b.nbytes, b.location, device=b.device if b.location is Location.DEVICE else None)
        base += b.nbytes + 4096
    tensors = {b.name: torch.zeros(b.nbytes, dtype=torch.uint8) for b in layout.buffers}
    views = {b.name: np.zeros(b.nbytes + 64, np.uint8)[64:] for b in layout.buffers}
    bound_raw = bind(layout, raw)
    bound_torch = bind(layout, tensors, check=lambda buf, mem: None)  # as a DMA executor binds (any location)
    bound_views = bind(layout, views, check=lambda buf, mem: None)
    bound_old = None if old is None else old.bind(layout, {k: (m.address, m.nbytes) for k, m in raw.items()})
    print(f"{args.regions} regions x {args.blocks} blocks, {len(layout.buffers)} buffers; median of {args.repeat}, "
          f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for pattern in ("contiguous", "runs8", "fragmented"):
        mapping = presets.mapping(pattern, args.blocks, 2 * args.blocks, "h2d", seed=1)
        plan = plan_transfer(layout, mapping, target)
        out = (np.empty(plan.num_ranges, np.uint64), np.empty(plan.num_ranges, np.uint64))  # the old runs' arrays
        arrays = DescriptorArrays().reserve(plan.num_ranges)  # as the DMA executors keep theirs
        src_bufs, dst_bufs = (plan.column_runs(f"{side}_buf")[0].astype(np.int64) for side in ("src", "dst"))
        touched = np.concatenate([src_bufs, dst_bufs])
        fns: dict[str, Callable[[], Any]] = {
            "new": lambda: bound_raw.descriptors(plan, arrays),
            "new+owners": lambda: bound_torch.descriptors(plan, arrays),
            "owners": lambda: bound_torch.buffer_runs(src_bufs, dst_bufs, lambda: None),
            "owners(views)": lambda: bound_views.buffer_runs(src_bufs, dst_bufs, lambda: None),
        }
        if bound_old is not None:
            fns["old"] = lambda: bound_old.lower(plan, out)
            fns["old+nbytes"] = lambda: (bound_old.lower(plan, out), np.repeat(*plan.column_runs("nbytes")))
        for fn in fns.values():
            fn()
        ms = medians_ms(fns, args.repeat)
        line = f"{pattern:11} {plan.num_ranges:>7} ranges"
        if "old" in ms:
            line += f"  old {ms['old']:7.3f} ms  old+nbytes {ms['old+nbytes']:7.3f} ms"
        line += (f"  new {ms['new']:7.3f} ms  new+owners {ms['new+owners']:7.3f} ms  owners {ms['owners']:7.3f} ms"
                 f"  owners(views) {ms['owners(views)']:7.3f} ms ({len(np.unique(touched))} buffers)")
        if "old" in ms:
            line += (f"  new/old {ms['new'] / ms['old']:5.2f}  new/(old+nbytes) {ms['new'] / ms['old+nbytes']:5.2f}  "
                     f"new+owners/(old+nbytes) {ms['new+owners'] / ms['old+nbytes']:5.2f}")
        print(line)


if __name__ == "__main__":
    main()
