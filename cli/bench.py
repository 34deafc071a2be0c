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
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.planner import BlockMapping, Layout, Target, plan_transfer, presets


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
    srcs = (src.base[:, None] + s[None, :] * src.stride[:, None]).ravel()
    dsts = (dst.base[:, None] + d[None, :] * dst.stride[:, None]).ravel()
    sizes = np.repeat(info.page, len(s))
    return srcs, dsts, sizes


def plan_cases(full: bool) -> list[tuple[str, Layout, BlockMapping]]:
    """The planner benchmark's cases as (name, layout, mapping): every pattern at 118x256 blocks, and at 118x16128 blocks
    every pattern when ``full`` (else contiguous and fragmented only)."""
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
    """One row per ``plan_cases(full)`` case: plan_transfer (ROCm 7.16 target) timed against ``naive_descriptors``, with
    requested copies, ranges, calls, both times in ms and the ratio plan / naive."""
    rows = []
    target = Target(platform="rocm", runtime_version=71600000)
    for name, layout, mapping in plan_cases(full):
        _ = layout.info  # layout-derived arrays are built once per layout, outside the per-transfer cost
        plan = plan_transfer(layout, mapping, target)
        t_plan = best_time(lambda: plan_transfer(layout, mapping, target), repeat)
        t_naive = best_time(lambda: naive_descriptors(layout, mapping), repeat)
        rows.append({"case": name, "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "plan_ms": t_plan * 1e3, "naive_ms": t_naive * 1e3,
                     "ratio": t_plan / t_naive})
    return rows


def naive_fragment_descriptors(layout: Layout, mapping: BlockMapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline for chunked and fragmented layouts: one descriptor per page piece per region, by broadcasting.

    Ids are taken as already-expanded page ids on both sides (the baseline skips the chunk enumeration)."""
    info = layout.info
    side = {"src": mapping.direction.src_side, "dst": mapping.direction.dst_side}
    pages = {"src": mapping.src_ids, "dst": mapping.dst_ids}
    n = min(len(mapping.src_ids), len(mapping.dst_ids))
    out: dict[str, list[np.ndarray]] = {"src": [], "dst": [], "size": []}
    for r, reg in enumerate(layout.regions):
        frags = reg.fragments
        for key in ("src", "dst"):
            col = info.side[side[key]]
            p = np.resize(pages[key], n)
            k = int(col.k[r])
            off = col.base[r] + (p // k) * col.stride[r] + (p % k) * col.page[r]
            local = (side[key] == "device")
            if frags:
                piece = np.concatenate([(f.local_offset if local else f.canonical_offset)
                                        + np.arange(f.count) * (f.local_stride if local else f.canonical_stride) for f in frags])
                off = (off[:, None] + piece).ravel()
            out[key].append(off)
        sizes = np.concatenate([np.full(f.count, f.fragment_bytes) for f in frags]) if frags else np.array([reg.page_bytes])
        out["size"].append(np.tile(sizes, n))
    return tuple(np.concatenate(v) for v in (out["src"], out["dst"], out["size"]))  # type: ignore[return-value]


def layout_cases() -> list[tuple[str, Layout, BlockMapping]]:
    """The layout-model cases as (name, layout, mapping): chunked host pages (4 blocks per chunk) and TP-2 fragments, each
    with a contiguous and a fragmented mapping."""
    chunked = presets.chunked_layout(118, 512, 32 * 1024, blocks_per_chunk=4)
    frag = presets.tp_fragment_layout(118, 512, tokens=16, heads=8, head_bytes=256, tp=2, rank=0)
    rng = np.random.default_rng(0)
    cases = []
    for pat in ("contiguous", "fragmented"):
        dev = np.arange(256) + 100 if pat == "contiguous" else np.sort(rng.permutation(256)[:256] * 2)
        chunks = np.arange(64) if pat == "contiguous" else rng.permutation(128)[:64]
        cases.append((f"k=4 chunks {pat}", chunked,
                      BlockMapping(direction="h2d", src_ids=chunks, dst_ids=dev, group_sizes=[256])))
        cases.append((f"tp2 fragments {pat}", frag, presets.mapping(pat, 256, 512, "d2h")))
    return cases


def bench_layouts(repeat: int = 5) -> list[dict[str, Any]]:
    """One row per ``layout_cases()`` case: plan_transfer timed against ``naive_fragment_descriptors``, with the ratio."""
    rows = []
    for name, layout, mapping in layout_cases():
        _ = layout.info  # layout-derived arrays are built once, outside the timed calls
        plan = plan_transfer(layout, mapping)
        t_plan = best_time(lambda: plan_transfer(layout, mapping), repeat)
        t_naive = best_time(lambda: naive_fragment_descriptors(layout, mapping), repeat)
        rows.append({"case": f"118x256 {name}", "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "plan_ms": t_plan * 1e3, "naive_ms": t_naive * 1e3, "ratio": t_plan / t_naive})
    return rows


def bench_memory() -> dict[str, Any]:
    """tracemalloc peak while planning 118x16128 fragmented blocks, against the plan's stored arrays (``ratio`` = peak /
    stored) and the size of its columns expanded, in MiB."""
    big = 16128
    layout = presets.kv_layout(118, 2 * big, 32 * 1024)
    mapping = presets.mapping("fragmented", big, 2 * big)
    _ = layout.info  # layout-derived arrays are built once, outside the timed calls
    plan_transfer(layout, mapping)  # warm caches
    gc.collect()
    tracemalloc.start()
    plan = plan_transfer(layout, mapping)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    stored = plan.stored_nbytes
    dense = sum(getattr(plan, c).nbytes for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region", "attr"))
    return {"case": f"118x{big} fragmented", "peak_mb": peak / 2**20, "plan_arrays_mb": stored / 2**20,
            "dense_columns_mb": dense / 2**20, "ratio": peak / stored}


def bench_executor(page_bytes: int = 32 * 1024, repeat: int = 5) -> list[dict[str, Any]]:
    """One row per pattern: NumpyExecutor on a merged plan against one np.copyto of the same bytes and against bare memmove
    of the same ranges (speeds are baseline time / executor time), plus GB/s."""
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
        t_ranges = best_time(lambda: _memmove_ranges(plan, bufs), repeat)
        rows.append({"case": f"118x256 {pat}", "ranges": plan.num_ranges, "bytes": moved,
                     "exec_ms": t_exec * 1e3, "memcpy_ms": t_copy * 1e3, "speed_vs_memcpy": t_copy / t_exec,
                     "ranges_memmove_ms": t_ranges * 1e3, "speed_vs_ranges": t_ranges / t_exec,
                     "exec_gbps": moved / t_exec / 1e9})
    return rows


def _memmove_ranges(plan: Any, bufs: dict[str, np.ndarray]) -> None:
    """Second baseline: the plan's ranges as bare memmove calls (what any executor must at least do)."""
    import ctypes

    base = [bufs[b.name].ctypes.data for b in plan.buffers]
    for sb, so, db, do, n in zip(plan.src_buf.tolist(), plan.src_offset.tolist(), plan.dst_buf.tolist(),
                                 plan.dst_offset.tolist(), plan.nbytes.tolist()):
        ctypes.memmove(base[db] + do, base[sb] + so, n)


def run_all(full: bool = True) -> dict[str, Any]:
    """Every benchmark's results with date, machine and numpy version, as a JSON-ready dict."""
    return {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.machine()} {platform.processor() or ''}".strip(),
            "numpy": np.__version__, "plan": bench_plan(full), "layouts": bench_layouts(), "memory": bench_memory(),
            "executor": bench_executor()}


def format_tables(res: dict[str, Any]) -> str:
    """``run_all()`` results as fixed-width text tables, one per benchmark."""
    lines = ["plan_transfer vs naive per-block descriptor build (ratio = plan / naive; lower is better)",
             f"{'case':<26}{'requested':>10}{'ranges':>9}{'calls':>6}{'plan ms':>10}{'naive ms':>10}{'ratio':>8}"]
    for r in res["plan"]:
        lines.append(f"{r['case']:<26}{r['requested']:>10}{r['ranges']:>9}{r['calls']:>6}{r['plan_ms']:>10.3f}"
                     f"{r['naive_ms']:>10.3f}{r['ratio']:>8.3f}")
    lines += ["", "layout model: plan_transfer vs naive per-piece descriptors (ratio = plan / naive)",
              f"{'case':<36}{'requested':>10}{'ranges':>9}{'calls':>6}{'plan ms':>10}{'naive ms':>10}{'ratio':>8}"]
    for r in res.get("layouts", []):
        lines.append(f"{r['case']:<36}{r['requested']:>10}{r['ranges']:>9}{r['calls']:>6}{r['plan_ms']:>10.3f}"
                     f"{r['naive_ms']:>10.3f}{r['ratio']:>8.3f}")
    m = res["memory"]
    lines += ["", f"planning memory, {m['case']}: tracemalloc peak {m['peak_mb']:.1f} MiB, plan's stored arrays "
              f"{m['plan_arrays_mb']:.1f} MiB (ratio {m['ratio']:.2f}); all columns expanded would be "
              f"{m['dense_columns_mb']:.1f} MiB", "",
              "NumpyExecutor vs one memcpy of the same bytes, and vs bare memmove of the same ranges",
              "(speed = baseline time / executor time; higher is better)",
              f"{'case':<26}{'ranges':>9}{'MiB':>8}{'exec ms':>10}{'memcpy ms':>11}{'speed':>8}"
              f"{'memmove/range ms':>18}{'speed':>8}{'GB/s':>7}"]
    for r in res["executor"]:
        lines.append(f"{r['case']:<26}{r['ranges']:>9}{r['bytes'] / 2**20:>8.0f}{r['exec_ms']:>10.2f}"
                     f"{r['memcpy_ms']:>11.2f}{r['speed_vs_memcpy']:>8.2f}{r['ranges_memmove_ms']:>18.2f}"
                     f"{r['speed_vs_ranges']:>8.2f}{r['exec_gbps']:>7.1f}")
    return "\n".join(lines)
