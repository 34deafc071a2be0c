"""Host cost of lowering a plan to addresses, against planning it: a C32-sized restore (118 regions x 16,128
blocks of 32 KiB, 236 buffers: one device and one host tensor per region) in three block patterns.

Memory is given by address (RawMemory), so nothing is allocated: lowering never touches the bytes. Prints
one line per pattern: plan ms, lowering ms on memory bound once (``BoundMemory.lower``, what ``run`` pays per
job), both as medians of --repeat interleaved runs, and lowering / planning. With ``--baseline FILE`` (the
executors' base.py of an older version, which lowered with ``bind_addresses`` on every run), that is
measured in the same run too:

    git show 5c4bba4:executors/base.py > /tmp/old_base.py
    .venv/bin/python benchmarks/bench_lowering.py --baseline /tmp/old_base.py [--blocks 16128] [--repeat 7]
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
import time

import numpy as np

from kvxfer.planner import Location, Target, plan_transfer, presets

from timing import medians_ms  # this folder: on sys.path when the script runs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", type=int, default=118)
    ap.add_argument("--blocks", type=int, default=16128)
    ap.add_argument("--page", type=int, default=32 * 1024)
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--baseline", help="an older executors/base.py with bind_addresses, measured in the same run")
    args = ap.parse_args()
    from kvxfer.executors import RawMemory, bind

    old = None
    if args.baseline:
        spec = importlib.util.spec_from_file_location("kvxfer_old_base", args.baseline)
        old = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = old  # dataclasses look their module up
        spec.loader.exec_module(old)
    layout = presets.kv_layout(args.regions, 2 * args.blocks, args.page, shared_host=False)
    target = Target(platform="cuda", runtime_version=13000)
    base = 1 << 40
    memory = {}
    for b in layout.buffers:
        memory[b.name] = RawMemory(base, b.nbytes, b.location, device=b.device if b.location is Location.DEVICE else None)
        base += b.nbytes + 4096
    bound = bind(layout, memory)
    old_memory = None if old is None else {k: (m.address, m.nbytes) for k, m in memory.items()}
    print(f"{args.regions} regions x {args.blocks} blocks x {args.page} B, {len(layout.buffers)} buffers; "
          f"median of {args.repeat}, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    for pattern in ("contiguous", "runs8", "fragmented"):
        mapping = presets.mapping(pattern, args.blocks, 2 * args.blocks, "h2d", seed=1)
        plan = plan_transfer(layout, mapping, target)
        out = (np.empty(plan.num_ranges, np.uint64), np.empty(plan.num_ranges, np.uint64))  # as DMA runs reuse theirs
        fns = {"plan": lambda: plan_transfer(layout, mapping, target), "lower": lambda: bound.lower(plan, out)}
        if old is not None:
            fns["old"] = lambda: old.bind_addresses(plan, old_memory, lambda buf, b: None)
        for fn in fns.values():
            fn()
        ms = medians_ms(fns, args.repeat)
        line = (f"{pattern:11} {plan.num_ranges:>9} ranges  plan {ms['plan']:8.2f} ms  lower {ms['lower']:8.2f} ms  "
                f"lower/plan {ms['lower'] / ms['plan']:5.2f}")
        if old is not None:
            line += f"  | per-run bind_addresses {ms['old']:8.2f} ms ({ms['old'] / ms['plan']:5.2f} x plan)"
        print(line)


if __name__ == "__main__":
    main()
