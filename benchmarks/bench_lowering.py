"""Host cost of lowering a plan to addresses, against planning it: a C32-sized restore (118 regions x 16,128
blocks of 32 KiB, 236 buffers: one device and one host tensor per region) in three block patterns.

Memory is given by address (RawMemory), so nothing is allocated: lowering never touches the bytes. Prints
one line per pattern: plan ms, lowering ms (median of --repeat), lowering / planning. Uses ``bind`` + ``run``'s
lowering when the executors have it, else the per-run ``bind_addresses`` of older versions.

    .venv/bin/python benchmarks/bench_lowering.py [--blocks 16128] [--repeat 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

from kvxfer.planner import Location, Target, plan_transfer, presets


def _median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--regions", type=int, default=118)
    ap.add_argument("--blocks", type=int, default=16128)
    ap.add_argument("--page", type=int, default=32 * 1024)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    from kvxfer import executors
    from kvxfer.executors import RawMemory

    layout = presets.kv_layout(args.regions, 2 * args.blocks, args.page, shared_host=False)
    target = Target(platform="cuda", runtime_version=13000)
    base = 1 << 40
    memory = {}
    for b in layout.buffers:
        memory[b.name] = RawMemory(base, b.nbytes, b.location, device=b.device if b.location is Location.DEVICE else None)
        base += b.nbytes + 4096
    bound = None
    if hasattr(executors, "bind"):
        bound = executors.bind(layout.buffers, memory)
    print(f"{args.regions} regions x {args.blocks} blocks x {args.page} B, {len(layout.buffers)} buffers, "
          f"{'bind once + lower' if bound is not None else 'bind_addresses per run'}")
    for pattern in ("contiguous", "runs8", "fragmented"):
        mapping = presets.mapping(pattern, args.blocks, 2 * args.blocks, "h2d", seed=1)
        plan_ms = _median_ms(lambda: plan_transfer(layout, mapping, target), args.repeat)
        plan = plan_transfer(layout, mapping, target)
        if bound is not None:
            lower = lambda: bound.lower(plan)  # noqa: E731
        else:
            lower = lambda: executors.bind_addresses(plan, memory, lambda buf, b: None)  # noqa: E731
        lower()
        low_ms = _median_ms(lower, args.repeat)
        print(f"{pattern:11} {plan.num_ranges:>9} ranges  plan {plan_ms:8.2f} ms  lower {low_ms:8.2f} ms  "
              f"lower/plan {low_ms / plan_ms:5.2f}")


if __name__ == "__main__":
    main()
