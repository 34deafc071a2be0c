"""Per-block against merged plans through NIXL over UCX loopback, in one process and across two.

For each shape and pattern, one plan with PlanOptions(coalesce=False) (one descriptor per block copy) and
one merged plan run the same load from a remote tier (h2d: READ of the remote host buffer) or the same
store (d2h: WRITE). Reported: descriptors, median and min time from run() to completion (the two plans
alternate in every repetition), median time for run() to return (building and posting the descriptor
lists), merged/per-block ratios, and the marginal cost of one more descriptor (from the mins). Bytes are checked once
per plan against the test oracle (kvxfer.testing) when both sides together hold under CHECK_LIMIT bytes (the full
restore shape holds 2 x 1.9 GiB; its bytes are checked at reduced size by --quick and by the tests).

    python benchmarks/bench_nixl.py [--reps 7] [--direction h2d] [--out out/bench_nixl.json] [--quick]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from kvxfer.executors import NixlExecutor
from kvxfer.executors.nixl_peer import LOOPBACK_ENV, PeerProcess
from kvxfer.planner import PlanOptions, plan_transfer, presets
from kvxfer.testing import random_buffers, run_reference

KIB = 1024
SHAPES = {  # name -> (regions, blocks moved, blocks per region, page bytes)
    "256x32KiB": (1, 256, 512, 32 * KIB),
    "restore-118": (118, 256, 512, 32 * KIB),
    "2048x4KiB": (1, 2048, 4096, 4 * KIB),  # descriptor-bound: same 8 MiB as 256x32KiB in 8x the pieces
}
QUICK_SHAPES = {"256x32KiB": SHAPES["256x32KiB"], "restore-118": (118, 64, 128, 8 * KIB),
                "2048x4KiB": SHAPES["2048x4KiB"]}
PATTERNS = ("contiguous", "runs8")
CHECK_LIMIT = 512 * 1024 * KIB


def _time(ex: NixlExecutor, plans: dict, bindings, reps: int) -> dict[str, dict[str, float]]:
    """Per plan: median and min seconds from run() to completion, median for run() to return.

    The plans alternate within every repetition, so load from other processes hits them alike.
    """
    total: dict[str, list[float]] = {k: [] for k in plans}
    post: dict[str, list[float]] = {k: [] for k in plans}
    for rep in range(reps + 1):  # the first round warms up (page faults, connection setup)
        for label, plan in plans.items():
            t0 = time.perf_counter()
            t = ex.run(plan, bindings)
            p = time.perf_counter() - t0
            t.wait()
            if rep:
                total[label].append(t.elapsed_s)
                post[label].append(p)
    return {k: {"median": statistics.median(total[k]), "min": min(total[k]), "post": statistics.median(post[k])}
            for k in plans}


def _check(ex, plan, layout, mapping, local, remote, read_remote) -> None:
    """One run compared with the test oracle's per-piece copies (kvxfer.testing); raises on any differing byte."""
    fresh = random_buffers(layout, plan.num_ranges)
    for k, a in local.items():
        a[:] = fresh[k]
    want = run_reference(layout, mapping, {**local, **read_remote()})
    ex.run(plan, {**local, **remote}).wait()
    got = {**local, **read_remote()}
    bad = [k for k in want if not np.array_equal(want[k], got[k])]
    if bad:
        raise SystemExit(f"bytes differ after {plan!r} in {bad[:3]}")


def bench(mode: str, shapes: dict, direction: str, reps: int, progress_thread: bool) -> list[dict]:
    rows = []
    for shape, (regions, n, blocks, page) in shapes.items():
        layout = presets.kv_layout(regions, blocks, page)
        host = layout.buffers[0]  # "cpu": the remote tier's buffer
        checked = 2 * host.nbytes < CHECK_LIMIT
        dev = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers[1:]}
        ex = NixlExecutor(name=f"engine-{mode}-{shape}", poll_timeout_s=120, progress_thread=progress_thread)
        reg = ex.register(dev, layout.buffers[1:])
        if mode == "one-process":
            tier = NixlExecutor(name=f"tier-{shape}", poll_timeout_s=120)
            tier_mem = {"cpu": np.zeros(host.nbytes, np.uint8)}
            remote = ex.add_peer(tier.describe(tier.register(tier_mem)))
            tier.add_peer(ex.describe(reg))
            def read_remote():
                return {"cpu": tier_mem["cpu"].copy()}
            peer = None
        else:
            peer = PeerProcess(ex, {host.name: host.nbytes}, reg, options={"poll_timeout_s": 120}, timeout_s=300,
                               seed=0 if checked else None)
            remote = peer.remote
            def read_remote():
                return {"cpu": peer.read("cpu")}
        try:
            for pattern in PATTERNS:
                mapping = presets.mapping(pattern, n, blocks, direction)
                per_block = plan_transfer(layout, mapping, options=PlanOptions(coalesce=False))
                merged = plan_transfer(layout, mapping)
                plans = {"per_block": per_block, "merged": merged}
                if checked:
                    for plan in plans.values():
                        _check(ex, plan, layout, mapping, dev, remote, read_remote)
                res = _time(ex, plans, {**dev, **remote}, reps)
                a, b = res["per_block"], res["merged"]
                rows.append({"mode": mode, "shape": shape, "pattern": pattern, "direction": direction,
                             "bytes": merged.total_bytes, "descriptors_per_block": per_block.num_ranges,
                             "descriptors_merged": merged.num_ranges, "per_block_ms": a["median"] * 1e3,
                             "merged_ms": b["median"] * 1e3, "ratio": b["median"] / a["median"],
                             "per_block_min_ms": a["min"] * 1e3, "merged_min_ms": b["min"] * 1e3,
                             "ratio_of_min": b["min"] / a["min"],
                             "post_per_block_ms": a["post"] * 1e3, "post_merged_ms": b["post"] * 1e3,
                             "us_per_descriptor": (a["min"] - b["min"]) / max(per_block.num_ranges
                                                                               - merged.num_ranges, 1) * 1e6,
                             "bytes_checked": checked})
                print(_fmt(rows[-1]), flush=True)
        finally:
            if peer is not None:
                peer.close()
            ex.close()
    return rows


HEADER = (f"{'mode':<12} {'shape':<12} {'pattern':<11} {'desc':>13} {'per-block ms':>12} {'merged ms':>10} "
          f"{'ratio':>6} {'min ms':>15} {'ratio':>6} {'post ms':>15} {'us/desc':>8}")


def _fmt(r: dict) -> str:
    desc = f"{r['descriptors_per_block']}->{r['descriptors_merged']}"
    post = f"{r['post_per_block_ms']:.2f}/{r['post_merged_ms']:.2f}"
    mins = f"{r['per_block_min_ms']:.2f}/{r['merged_min_ms']:.2f}"
    return (f"{r['mode']:<12} {r['shape']:<12} {r['pattern']:<11} {desc:>13} {r['per_block_ms']:>12.2f} "
            f"{r['merged_ms']:>10.2f} {r['ratio']:>6.2f} {mins:>15} {r['ratio_of_min']:>6.2f} {post:>15} "
            f"{r['us_per_descriptor']:>8.1f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--direction", choices=("h2d", "d2h"), default="h2d")
    ap.add_argument("--modes", default="one-process,two-process")
    ap.add_argument("--progress-thread", action="store_true",
                    help="give the initiating agent a progress thread too (it spins; on few cores it competes)")
    ap.add_argument("--quick", action="store_true", help="small restore shape (for a smoke run)")
    ap.add_argument("--out", type=Path, default=Path("out/bench_nixl.json"))
    args = ap.parse_args()
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    shapes = QUICK_SHAPES if args.quick else SHAPES
    print(HEADER)
    rows = [r for mode in args.modes.split(",") for r in bench(mode, shapes, args.direction, args.reps,
                                                                   args.progress_thread)]
    meta = {"date": time.strftime("%Y-%m-%d"), "reps": args.reps, "host": platform.node(),
            "cpus": os.cpu_count(), "initiator_progress_thread": args.progress_thread,
            "ucx": {k: os.environ[k] for k in LOOPBACK_ENV}}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
