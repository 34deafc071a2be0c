"""One prepared device check for an NVIDIA GPU (sized for about 3 minutes on one H200): prints tables, writes JSON.

1. Byte-exact round trips (d2h then h2d) with cuda-batch and triton against the NumPy reference.
2. H2D and D2H bandwidth of a 118 x 256 x 32 KiB restore, planned per block, merged, and as one large copy.
3. Host submit time per call and per descriptor (time spent inside ``run``).
4. Triton vs DMA crossover for h2d over range sizes (same total bytes, ranges that cannot merge).
5. Decode-interference probe: a GEMM loop timed alone and next to copy-engine and SM-kernel copies.

Figures are ratios against baselines measured in the same run. ``--dry-run`` builds every plan on the CPU and
prints what would run (no GPU, no torch needed).

    python benchmarks/gpu_check.py --out gpu_check.json        # on the GPU machine
    python benchmarks/gpu_check.py --dry-run                    # anywhere
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from kvxfer.planner import BlockMapping, PlanOptions, Target, plan_transfer, presets

REGIONS, BLOCKS, MOVED, PAGE = 118, 512, 256, 32 * 1024
PATTERNS = ("contiguous", "runs8", "fragmented")
CROSSOVER_SIZES = (4096, 8192, 16384, 28672, 32768, 65536, 262144, 1 << 20)
CROSSOVER_TOTAL = 64 << 20
REPS = 5


def restore_plans(target: Target) -> dict[str, object]:
    """The restore of 256 blocks x 118 regions x 32 KiB: per block, merged (per pattern), and one large copy."""
    layout = presets.kv_layout(REGIONS, BLOCKS, PAGE, shared_device=True)
    plans = {}
    for direction in ("h2d", "d2h"):
        for pattern in PATTERNS:
            m = presets.mapping(pattern, MOVED, BLOCKS, direction)
            plans[f"{direction} {pattern} per-block"] = plan_transfer(layout, m, target, PlanOptions(coalesce=False))
            plans[f"{direction} {pattern} merged"] = plan_transfer(layout, m, target)
        # the same bytes as a single range: one region whose page is the whole moved block set
        one = presets.kv_layout(1, 2, REGIONS * MOVED * PAGE, shared_device=True)
        plans[f"{direction} one-copy"] = plan_transfer(one, BlockMapping(direction=direction, src_ids=[0], dst_ids=[0]), target)
    return plans


def crossover_plans(target: Target) -> dict[int, object]:
    """h2d plans of CROSSOVER_TOTAL bytes in ranges of each size that never merge (fragmented ids)."""
    out = {}
    for size in CROSSOVER_SIZES:
        n = CROSSOVER_TOTAL // size
        layout = presets.kv_layout(1, 2 * n + 2, size, shared_device=True)
        out[size] = plan_transfer(layout, presets.mapping("fragmented", n, 2 * n + 2, "h2d"), target)
    return out


def dry_run(out: Path | None) -> None:
    target = Target(platform="cuda", runtime_version=13000)
    rows = {name: {"ranges": p.num_ranges, "calls": p.num_calls, "bytes": p.total_bytes}
            for name, p in restore_plans(target).items()}
    rows |= {f"h2d crossover {s}": {"ranges": p.num_ranges, "calls": p.num_calls, "bytes": p.total_bytes}
             for s, p in crossover_plans(target).items()}
    print(f"{'plan':34} {'ranges':>8} {'calls':>6} {'MiB':>9}")
    for name, r in rows.items():
        print(f"{name:34} {r['ranges']:>8} {r['calls']:>6} {r['bytes'] / 2**20:>9.1f}")
    if out:
        out.write_text(json.dumps({"dry_run": True, "plans": rows}, indent=1))


# ---- on the GPU ---------------------------------------------------------------------------------------------
def _median_run(ex, plan, mem, reps=REPS, stream=None):
    """(median copy seconds from events, median host seconds inside run) over ``reps`` after one warm-up."""
    ex.run(plan, mem, stream).wait()
    copy_s, submit_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        t = ex.run(plan, mem, stream)
        submit_s.append(time.perf_counter() - t0)
        copy_s.append(t.wait().elapsed_s)
    return statistics.median(copy_s), statistics.median(submit_s)


def _memory(torch, plan, fill=True):
    """Device buffers on the GPU, host buffers pinned; random bytes."""
    mem = {}
    for b in plan.buffers:
        if b.location.value == "device":
            mem[b.name] = torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, device="cuda") if fill else \
                torch.zeros(b.nbytes, dtype=torch.uint8, device="cuda")
        else:
            t = torch.empty(b.nbytes, dtype=torch.uint8, pin_memory=True)
            t.random_(0, 256) if fill else t.zero_()
            mem[b.name] = t
    return mem


def round_trips(torch, executors, target):
    """Each executor's run of merged plans against the test oracle's per-piece copies (kvxfer.testing)."""
    from kvxfer.testing import run_reference
    layout = presets.kv_layout(8, 128, PAGE, shared_device=False)
    results = {}
    for name, ex in executors.items():
        for pattern in PATTERNS + ("descending", "interleaved"):
            ok = True
            for direction in ("d2h", "h2d"):
                mapping = presets.mapping(pattern, 48, 128, direction)
                plan = plan_transfer(layout, mapping, target)
                mem = _memory(torch, plan)
                torch.cuda.synchronize()
                want = run_reference(layout, mapping, {k: v.cpu().numpy() for k, v in mem.items()})
                ex.run(plan, mem).wait()
                ok &= all(np.array_equal(mem[k].cpu().numpy(), want[k]) for k in want)
            results[f"{name} {pattern}"] = ok
    return results


def bandwidth(torch, ex, target):
    plans = restore_plans(target)
    mem = _memory(torch, plans["h2d contiguous merged"])  # every restore plan uses buffers "gpu" and "cpu" of these sizes
    rows = {}
    for name, plan in plans.items():
        copy_s, submit_s = _median_run(ex, plan, mem)
        rows[name] = {"ranges": plan.num_ranges, "calls": plan.num_calls, "GB/s": plan.total_bytes / copy_s / 1e9,
                      "copy_ms": copy_s * 1e3, "submit_ms": submit_s * 1e3,
                      "submit_us_per_descriptor": submit_s * 1e6 / plan.num_ranges}
    for d in ("h2d", "d2h"):
        base = rows[f"{d} one-copy"]["GB/s"]
        for name, r in rows.items():
            if name.startswith(d):
                r["vs_one_copy"] = r["GB/s"] / base
    return rows


def crossover(torch, dma, triton_ex, target):
    rows = {}
    for size, plan in crossover_plans(target).items():
        mem = _memory(torch, plan)
        d, _ = _median_run(dma, plan, mem)
        t, _ = _median_run(triton_ex, plan, mem)
        rows[size] = {"ranges": plan.num_ranges, "dma_GB/s": plan.total_bytes / d / 1e9,
                      "triton_GB/s": plan.total_bytes / t / 1e9, "triton_over_dma": d / t}
        del mem
    return rows


def interference(torch, dma, triton_ex, target):
    """GEMM loop time alone vs while h2d copies run on another stream (copy engines, then the SM kernel)."""
    n, iters = 8192, 40
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    compute = torch.cuda.current_stream()
    idle = torch.cuda.Stream()

    def launch_gemms():
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record(compute)
        for _ in range(iters):
            torch.matmul(a, b)
        e.record(compute)
        return s, e

    def elapsed_ms(events):
        events[1].synchronize()
        return events[0].elapsed_time(events[1])

    elapsed_ms(launch_gemms())
    alone = statistics.median(elapsed_ms(launch_gemms()) for _ in range(3))
    plan = restore_plans(target)["h2d fragmented merged"]
    mem = _memory(torch, plan)
    rows = {"gemm_alone_ms": alone}
    for name, ex in (("cuda-batch", dma), ("triton", triton_ex)):
        ex.run(plan, mem, idle).wait()
        times, copy_s = [], []
        for _ in range(3):
            gemms = launch_gemms()  # queued on the compute stream; the copies go on other streams beside them
            transfers = [ex.run(plan, mem, idle) for _ in range(4)]
            times.append(elapsed_ms(gemms))
            copy_s += [t.wait().elapsed_s for t in transfers]
        busy = statistics.median(times)
        rows[name] = {"gemm_ms": busy, "slowdown_pct": 100 * (busy / alone - 1),
                      "copy_GB/s_during": plan.total_bytes / statistics.median(copy_s) / 1e9}
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="plan everything on the CPU and stop")
    ap.add_argument("--out", type=Path, default=None, help="write results as JSON here")
    ap.add_argument("--skip", default="", help="comma list of sections to skip: roundtrip,bandwidth,crossover,interference")
    args = ap.parse_args()
    if args.dry_run:
        dry_run(args.out)
        return 0
    import torch

    from kvxfer.executors.ops_cuda import CudaBatchExecutor
    from kvxfer.executors.ops_triton import TritonExecutor
    if not torch.cuda.is_available():
        print("gpu_check: no GPU visible to torch; use --dry-run", file=sys.stderr)
        return 2
    skip = set(filter(None, args.skip.split(",")))
    torch.cuda.init()
    dma, tri = CudaBatchExecutor(), TritonExecutor()
    target = dma.target
    report = {"date": time.strftime("%Y-%m-%d"), "gpu": torch.cuda.get_device_name(), "target": target.label,
              "torch": torch.__version__}
    print(f"# {report['gpu']}, driver {target.label}, torch {report['torch']}")
    t_start = time.perf_counter()
    if "roundtrip" not in skip:
        report["roundtrip"] = rt = round_trips(torch, {"cuda-batch": dma, "triton": tri}, target)
        print("\n## byte-exact round trips (d2h then h2d vs the NumPy reference)")
        for k, ok in rt.items():
            print(f"{k:32} {'OK' if ok else 'MISMATCH'}")
    if "bandwidth" not in skip:
        report["bandwidth"] = bw = bandwidth(torch, dma, target)
        print("\n## restore 118 x 256 x 32 KiB with cuda-batch (median of 5)")
        print(f"{'plan':28} {'ranges':>7} {'calls':>5} {'GB/s':>7} {'vs 1 copy':>9} {'copy ms':>8} "
              f"{'submit ms':>9} {'us/desc':>8}")
        for k, r in bw.items():
            print(f"{k:28} {r['ranges']:>7} {r['calls']:>5} {r['GB/s']:>7.1f} {r['vs_one_copy']:>9.2f} "
                  f"{r['copy_ms']:>8.2f} {r['submit_ms']:>9.3f} {r['submit_us_per_descriptor']:>8.3f}")
    if "crossover" not in skip:
        report["crossover"] = co = crossover(torch, dma, tri, target)
        print("\n## h2d crossover, 64 MiB in unmergeable ranges (median of 5)")
        print(f"{'range':>8} {'ranges':>7} {'DMA GB/s':>9} {'Triton GB/s':>11} {'Triton/DMA':>10}")
        for size, r in co.items():
            print(f"{size:>8} {r['ranges']:>7} {r['dma_GB/s']:>9.1f} {r['triton_GB/s']:>11.1f} {r['triton_over_dma']:>10.2f}")
    if "interference" not in skip:
        report["interference"] = it = interference(torch, dma, tri, target)
        print(f"\n## decode interference: 40 bf16 8192^3 GEMMs, alone {it['gemm_alone_ms']:.1f} ms")
        for k in ("cuda-batch", "triton"):
            print(f"{k:12} next to h2d copies: {it[k]['gemm_ms']:.1f} ms ({it[k]['slowdown_pct']:+.1f}%), "
                  f"copies at {it[k]['copy_GB/s_during']:.1f} GB/s")
    report["wall_s"] = time.perf_counter() - t_start
    print(f"\nwall {report['wall_s']:.1f} s")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1, default=str))
    ok = all(report.get("roundtrip", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
