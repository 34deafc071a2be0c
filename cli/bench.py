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
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.planner import BlockMapping, Layout, Location, Platform, Target, plan_transfer, presets


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


@dataclass(frozen=True)
class SideArrays:
    """One side's placement of every region as arrays (what an engine without a planner keeps per KV tensor):
    block 0's byte offset, the bytes between chunks, the page size and the blocks per chunk."""

    base: np.ndarray
    stride: np.ndarray
    page: np.ndarray
    k: np.ndarray

    @classmethod
    def of(cls, layout: Layout, side: Location) -> SideArrays:
        """The arrays of ``side`` (host or device) for every region of ``layout``."""
        regions = layout.regions
        return cls(base=np.array([r.placement(side).byte_offset for r in regions], np.int64),
                   stride=np.array([r.stride(side) for r in regions], np.int64),
                   page=np.array([r.side_page(side) for r in regions], np.int64),
                   k=np.array([r.placement(side).blocks_per_chunk for r in regions], np.int64))


def engine_arrays(layout: Layout) -> dict[Location, SideArrays]:
    """Both sides' arrays, made once per layout outside the timed baselines."""
    return {side: SideArrays.of(layout, side) for side in (Location.DEVICE, Location.HOST)}


def prepare(layout: Layout) -> Layout:
    """Build the layout's per-layout structures before anything is timed (``Layout.prepare``; a planner
    without it builds them on the first plan, which the warm-up call makes)."""
    ready = getattr(layout, "prepare", None)
    return ready() if callable(ready) else layout


def naive_descriptors(sides: dict[Location, SideArrays], mapping: BlockMapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline: absolute offsets for every block of every region, one descriptor each (``sides`` from
    ``engine_arrays``)."""
    src, dst = sides[mapping.direction.src_side], sides[mapping.direction.dst_side]
    s, d = mapping.src_ids, mapping.dst_ids
    srcs = (src.base[:, None] + s[None, :] * src.stride[:, None]).ravel()
    dsts = (dst.base[:, None] + d[None, :] * dst.stride[:, None]).ravel()
    sizes = np.repeat(sides[Location.DEVICE].page, len(s))
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
    target = Target(platform=Platform.ROCM, runtime_version=71600000)
    for name, layout, mapping in plan_cases(full):
        prepare(layout)  # layout-derived arrays are built once per layout, outside the per-transfer cost
        sides = engine_arrays(layout)
        plan = plan_transfer(layout, mapping, target)
        t_plan = best_time(lambda: plan_transfer(layout, mapping, target), repeat)
        t_naive = best_time(lambda: naive_descriptors(sides, mapping), repeat)
        rows.append({"case": name, "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "plan_ms": t_plan * 1e3, "naive_ms": t_naive * 1e3,
                     "ratio": t_plan / t_naive})
    return rows


def naive_fragment_descriptors(layout: Layout, sides: dict[Location, SideArrays],
                               mapping: BlockMapping) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The baseline for chunked and fragmented layouts: one descriptor per page piece per region, by broadcasting.

    Ids are taken as already-expanded page ids on both sides (the baseline skips the chunk enumeration)."""
    side = {"src": mapping.direction.src_side, "dst": mapping.direction.dst_side}
    pages = {"src": mapping.src_ids, "dst": mapping.dst_ids}
    n = min(len(mapping.src_ids), len(mapping.dst_ids))
    out: dict[str, list[np.ndarray]] = {"src": [], "dst": [], "size": []}
    for r, reg in enumerate(layout.regions):
        frags = reg.fragments
        for key in ("src", "dst"):
            col = sides[side[key]]
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
        prepare(layout)  # layout-derived arrays are built once, outside the timed calls
        sides = engine_arrays(layout)
        plan = plan_transfer(layout, mapping)
        t_plan = best_time(lambda: plan_transfer(layout, mapping), repeat)
        t_naive = best_time(lambda: naive_fragment_descriptors(layout, sides, mapping), repeat)
        rows.append({"case": f"118x256 {name}", "requested": plan.requested_copies, "ranges": plan.num_ranges,
                     "calls": plan.num_calls, "plan_ms": t_plan * 1e3, "naive_ms": t_naive * 1e3, "ratio": t_plan / t_naive})
    return rows


def bench_memory() -> dict[str, Any]:
    """tracemalloc peak while planning 118x16128 fragmented blocks, against the plan's stored arrays (``ratio`` = peak /
    stored) and the size of its columns expanded, in MiB."""
    big = 16128
    layout = presets.kv_layout(118, 2 * big, 32 * 1024)
    mapping = presets.mapping("fragmented", big, 2 * big)
    prepare(layout)  # layout-derived arrays are built once, outside the measured call
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


Column = tuple[str, int, str, Callable[[dict[str, Any]], Any]]  # header, width, format, the row's value


def _table(columns: tuple[Column, ...], rows: list[dict[str, Any]]) -> list[str]:
    """Fixed-width lines, the first column left-aligned and the others right-aligned."""
    def line(cells: list[str]) -> str:
        return "".join(f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, (_, w, _, _)) in
                       enumerate(zip(cells, columns))).rstrip()

    return [line([h for h, _, _, _ in columns])] + [line([format(key(r), f) for _, _, f, key in columns])
                                                    for r in rows]


def _key(name: str) -> Callable[[dict[str, Any]], Any]:
    return lambda r: r[name]


PLAN_COLUMNS: tuple[Column, ...] = (
    ("case", 24, "", _key("case")), ("copies", 9, "", _key("requested")), ("ranges", 9, "", _key("ranges")),
    ("calls", 6, "", _key("calls")), ("plan ms", 10, ".3f", _key("plan_ms")),
    ("naive ms", 10, ".3f", _key("naive_ms")), ("ratio", 8, ".3f", _key("ratio")))
LAYOUT_COLUMNS: tuple[Column, ...] = (("layout case", 24, "", lambda r: r["case"].removeprefix("118x256 ")),
                                      *PLAN_COLUMNS[1:])
EXECUTOR_COLUMNS: tuple[Column, ...] = (
    ("case", 19, "", _key("case")), ("ranges", 7, "", _key("ranges")), ("MiB", 5, ".0f", lambda r: r["bytes"] / 2**20),
    ("exec ms", 9, ".2f", _key("exec_ms")), ("GB/s", 6, ".1f", _key("exec_gbps")),
    ("memcpy ms", 10, ".2f", _key("memcpy_ms")), ("speed", 6, ".2f", _key("speed_vs_memcpy")),
    ("memmove ms", 11, ".2f", _key("ranges_memmove_ms")), ("speed", 6, ".2f", _key("speed_vs_ranges")))


def format_tables(res: dict[str, Any]) -> str:
    """``run_all()`` results as fixed-width text tables, one per benchmark, none wider than 80 columns."""
    import textwrap

    m = res["memory"]
    lines = ["plan_transfer vs the naive per-block descriptor build (ratio = plan / naive;",
             "lower is better)", *_table(PLAN_COLUMNS, res["plan"]), "",
             "layout model, 118 regions x 256 blocks: plan_transfer vs naive per-piece",
             "descriptors (ratio = plan / naive)", *_table(LAYOUT_COLUMNS, res.get("layouts", [])), "",
             *textwrap.wrap(f"planning memory, {m['case']}: tracemalloc peak {m['peak_mb']:.1f} MiB, the plan's "
                            f"stored arrays {m['plan_arrays_mb']:.1f} MiB (ratio {m['ratio']:.2f}); all columns "
                            f"expanded would be {m['dense_columns_mb']:.1f} MiB", 80), "",
             "NumpyExecutor vs one memcpy of the same bytes and vs bare memmove of the same",
             "ranges (speed = that baseline's time / executor time; higher is better)",
             *_table(EXECUTOR_COLUMNS, res["executor"])]
    return "\n".join(lines)
