"""Planner and reference-executor benchmarks, each measured as a ratio against a baseline in the same run.

- plan: plan_transfer against the naive per-block descriptor build (one descriptor per block per region,
  made by numpy broadcasting, as engines without a planner do it).
- numpy executor: NumpyExecutor on a merged plan against one memcpy (np.copyto) of the same bytes.
- memory: tracemalloc peak while planning, against the size of the plan's own arrays.
"""
from __future__ import annotations

import gc
import platform
import time
import tracemalloc
from typing import Any, Callable

import numpy as np

from kvxfer.planner import BlockMapping, Layout, PlanOptions, Target, plan_transfer, presets


def best_time(fn: Callable[[], Any], repeat: int, min_s: float = 0.05) -> float:
    """Median of ``repeat`` timed calls (after one warm-up), each looped until it lasts ``min_s``."""
    fn()
    samples = []
    for _ in range(repeat):
        loops, t = 0, 0.0
        t0 = time.perf_counter()
        while t < min_s or loops == 0:
            fn()
            loops += 1
            t = time.perf_counter() - t0
        samples.append(t / loops)
    return float(np.median(samples))


def naive_descriptors(layout: Layout, mapping: BlockMapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline: absolute offsets for every block of every region, one descriptor each."""
    info = layout.info
    src, dst = info.side[mapping.direction.src_side], info.side[mapping.direction.dst_side]
    s, d = mapping.src_ids, mapping.dst_ids
    srcs = (src["base"][:, None] + s[None, :] * src["stride"][:, None]).ravel()
    dsts = (dst["base"][:, None] + d[None, :] * dst["stride"][:, None]).ravel()
    sizes = np.repeat(info.page, len(s))
    return srcs, dsts, sizes


def plan_cases(full: bool) -> list[tuple[str, Layout, BlockMapping]]:
    cases = []
    layout = presets.kv_layout(118, 512, 32 * 1024)
    for pat in presets.PATTERNS:
        cases.append((f"118x256 {pat}", layout, presets.mapping(pat, 256, 512)))
    big = 16128
    layout_big = presets.kv_layout(118, 2 * big, 32 * 1024)
    for pat in presets.PATTERNS if full else ("contiguous", "fragmented"):
        cases.append((f"118x{big} {pat}", layout_big, presets.mapping(pat, big, 2 * big)))
    return cases


def bench_plan(full: bool = True, repeat: int = 5) -> list[dict[str, Any]]:
    rows = []
    target = Target(platform="rocm", runtime_version=71600000)
    for name, layout, mapping in plan_cases(full):
        layout.info  # layout-derived arrays are built once per layout, outside the per-transfer cost
        plan = plan_transfer(layout, mapping, target)
        t_plan = best_time(lambda: plan_transfer(layout, mapping, target), repeat)
        t_naive = best_time(lambda: naive_descriptors(layout, mapping), repeat)
        rows.append({"case": name, "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "plan_ms": t_plan * 1e3, "naive_ms": t_naive * 1e3,
                     "ratio": t_plan / t_naive})
    return rows


def bench_memory() -> dict[str, Any]:
    big = 16128
    layout = presets.kv_layout(118, 2 * big, 32 * 1024)
    mapping = presets.mapping("fragmented", big, 2 * big)
    layout.info
    plan_transfer(layout, mapping)  # warm caches
    gc.collect()
    tracemalloc.start()
    plan = plan_transfer(layout, mapping)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    own = sum(getattr(plan, c).nbytes for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region", "attr"))
    return {"case": f"118x{big} fragmented", "peak_mb": peak / 2**20, "plan_arrays_mb": own / 2**20, "ratio": peak / own}


def bench_executor(page_bytes: int = 32 * 1024, repeat: int = 5) -> list[dict[str, Any]]:
    from kvxfer.executors import NumpyExecutor

    rows = []
    layout = presets.kv_layout(118, 512, page_bytes)
    bufs = {b.name: np.ones(b.nbytes, dtype=np.uint8) for b in layout.buffers}
    ex = NumpyExecutor()
    for pat in ("contiguous", "runs8", "fragmented"):
        plan = plan_transfer(layout, presets.mapping(pat, 256, 512))
        moved = plan.total_bytes
        a, b = np.ones(moved, np.uint8), np.zeros(moved, np.uint8)
        t_exec = best_time(lambda: ex.run(plan, bufs), repeat)
        t_copy = best_time(lambda: np.copyto(b, a), repeat)
        rows.append({"case": f"118x256 {pat}", "ranges": plan.num_ranges, "bytes": moved,
                     "exec_ms": t_exec * 1e3, "memcpy_ms": t_copy * 1e3, "speed_vs_memcpy": t_copy / t_exec,
                     "exec_gbps": moved / t_exec / 1e9})
    return rows


def run_all(full: bool = True) -> dict[str, Any]:
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "numpy": np.__version__, "plan": bench_plan(full), "memory": bench_memory(), "executor": bench_executor()}


def format_tables(res: dict[str, Any]) -> str:
    lines = ["plan_transfer vs naive per-block descriptor build (ratio = plan / naive; lower is better)",
             f"{'case':<26}{'requested':>10}{'ranges':>9}{'calls':>6}{'plan ms':>10}{'naive ms':>10}{'ratio':>8}"]
    for r in res["plan"]:
        lines.append(f"{r['case']:<26}{r['requested']:>10}{r['ranges']:>9}{r['calls']:>6}{r['plan_ms']:>10.3f}"
                     f"{r['naive_ms']:>10.3f}{r['ratio']:>8.3f}")
    m = res["memory"]
    lines += ["", f"planning memory, {m['case']}: peak {m['peak_mb']:.1f} MiB, plan arrays {m['plan_arrays_mb']:.1f} MiB, "
              f"ratio {m['ratio']:.2f}", "",
              "NumpyExecutor vs one memcpy of the same bytes (speed = memcpy time / executor time; higher is better)",
              f"{'case':<26}{'ranges':>9}{'MiB':>8}{'exec ms':>10}{'memcpy ms':>11}{'speed':>8}{'GB/s':>7}"]
    for r in res["executor"]:
        lines.append(f"{r['case']:<26}{r['ranges']:>9}{r['bytes'] / 2**20:>8.0f}{r['exec_ms']:>10.2f}"
                     f"{r['memcpy_ms']:>11.2f}{r['speed_vs_memcpy']:>8.2f}{r['exec_gbps']:>7.1f}")
    return "\n".join(lines)
