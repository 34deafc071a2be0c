"""One prepared device check for an NVIDIA GPU (sized for about 3 minutes on one H200): prints tables, writes JSON.

Sections run in this order, each guarded (a failure is recorded and the next section runs) and the JSON is
rewritten after each, so a sticky CUDA error or a timeout keeps every figure measured before it. The copy-engine
(DMA) sections come first, the SM-kernel (Triton) ones after:

 1. environment: torch, triton, cuda-bindings, pydantic, numpy and driver versions, GPU name and SM count;
 2. dma-roundtrip: byte-exact round trips (d2h then h2d) with cuda-batch against the NumPy reference;
 3. bandwidth: H2D and D2H GB/s of the 118 x 256 x 32 KiB restore planned per block, merged (three patterns)
    and as one large copy; every run's destination bytes are checked afterwards;
 4. submit: host time inside ``run`` for per-block plans of 236 .. 30,208 descriptors, fitted as a fixed cost
    per run plus a cost per descriptor (the slope);
 5. dma-interference: a decode-shaped, memory-bound matmul ([32, 8192] x [8192, 28672] bf16) and an 8192^3 GEMM
    timed alone and beside copy-engine copies, both measured over the window where they overlap;
 6. triton-roundtrip, 7. run-api (a Triton load ordered ``after`` a DMA store of the host blocks it reads, on the
    device, and the reverse; a bound device tensor moved by ``set_`` is refused),
 8. crossover (Triton vs DMA over range sizes, same bytes, ranges that cannot merge),
 9. triton-interference (the same compute beside SM-kernel copies);
10. offload: a short store/load job loop through kvxfer.offload, only when that package imports.

Every timed sample is kept in the JSON. Figures are ratios against baselines measured in the same run. Copy
times are the transfers' own device events; submit times are host time inside ``run``.

    python benchmarks/gpu_check.py --out gpu_check.json    # on the GPU machine (benchmarks/gpu_run.sh wraps it)
    python benchmarks/gpu_check.py --dry-run               # any machine: builds every plan, prints counts
    python benchmarks/gpu_check.py --device cpu --out x.json
        # any machine: every section on the CPU (NumPy executor, Triton interpreter, host-timed events) at
        # small sizes; checks the plumbing and the bytes, its timings mean nothing
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import importlib
import importlib.metadata
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.planner import BlockMapping, PlanOptions, Target, TransferPlan, plan_transfer, presets

PATTERNS = ("contiguous", "runs8", "fragmented")


@dataclass(frozen=True)
class Sizes:
    """Every size the check uses. ``GPU`` is the H200 run; ``CPU`` the small one for ``--device cpu``."""

    regions: int = 118
    blocks: int = 512
    moved: int = 256
    page: int = 32 * 1024
    reps: int = 5
    submit_moved: tuple[int, ...] = (2, 8, 32, 128, 256)  # per-block plans of regions * m descriptors
    crossover_sizes: tuple[int, ...] = (4096, 8192, 16384, 28672, 32768, 65536, 262144, 1 << 20)
    crossover_total: int = 64 << 20
    roundtrip: tuple[int, int, int, int] = (8, 128, 48, 32 * 1024)  # regions, blocks, moved, page
    decode: tuple[int, int, int] = (32, 8192, 28672)  # [m, k] x [k, n]
    gemm: int = 8192
    transfers_beside: int = 2  # restore transfers queued beside the compute
    max_compute_ops: int = 800  # keeps the launch queue from filling (the host must reach the copies)
    regions_per_layer: int = 2  # K and V: layer-wise calls carry two regions each
    c32: tuple[int, int, int, int] = (118, 16128, 64, 32 * 1024)  # regions, blocks moved, sentinel blocks, page
    c32_reps: int = 2  # timed runs of each newest-ABI C32 plan (after a warm-up)


GPU = Sizes()
CPU = Sizes(regions=4, blocks=32, moved=16, page=4096, reps=2, submit_moved=(1, 2, 4, 8, 16),
            crossover_sizes=(512, 2048, 8192), crossover_total=64 << 10, roundtrip=(2, 16, 6, 1024),
            decode=(4, 64, 128), gemm=64, max_compute_ops=40, c32=(4, 64, 8, 1024), c32_reps=1)


# ---- plans (pure; also the --dry-run) -----------------------------------------------------------------------
def restore_plans(target: Target, s: Sizes = GPU) -> dict[str, TransferPlan]:
    """The restore of ``moved`` blocks x ``regions`` regions: per block, merged (per pattern), and one copy.
    Every plan uses the buffers "gpu" and "cpu" of the same sizes."""
    layout = presets.kv_layout(s.regions, s.blocks, s.page, shared_device=True)
    plans = {}
    for direction in ("h2d", "d2h"):
        for pattern in PATTERNS:
            m = presets.mapping(pattern, s.moved, s.blocks, direction)
            plans[f"{direction} {pattern} per-block"] = plan_transfer(layout, m, target, PlanOptions(coalesce=False))
            plans[f"{direction} {pattern} merged"] = plan_transfer(layout, m, target)
        one = presets.kv_layout(1, s.blocks // s.moved, s.regions * s.moved * s.page, shared_device=True)  # same buffers
        plans[f"{direction} one-copy"] = plan_transfer(one, BlockMapping(direction=direction, src_ids=[0], dst_ids=[1]),
                                                       target)
    return plans


def submit_plans(target: Target, s: Sizes = GPU) -> dict[int, TransferPlan]:
    """h2d per-block plans of regions * m descriptors (fragmented ids), on the restore buffers."""
    layout = presets.kv_layout(s.regions, s.blocks, s.page, shared_device=True)
    out = {}
    for m in s.submit_moved:
        plan = plan_transfer(layout, presets.mapping("fragmented", m, s.blocks, "h2d"), target, PlanOptions(coalesce=False))
        out[plan.num_ranges] = plan
    return out


def crossover_plans(target: Target, s: Sizes = GPU) -> dict[int, TransferPlan]:
    """h2d plans of ``crossover_total`` bytes in ranges of each size that never merge (fragmented ids)."""
    out = {}
    for size in s.crossover_sizes:
        n = s.crossover_total // size
        layout = presets.kv_layout(1, 2 * n + 2, size, shared_device=True)
        out[size] = plan_transfer(layout, presets.mapping("fragmented", n, 2 * n + 2, "h2d"), target)
    return out


def layer_plans(target: Target, s: Sizes = GPU) -> dict[str, TransferPlan]:
    """The restore planned with one call per layer (``regions_per_layer`` regions each), h2d."""
    layout = presets.kv_layout(s.regions, s.blocks, s.page, shared_device=True)
    return {f"h2d {p} per-layer": plan_transfer(layout, presets.mapping(p, s.moved, s.blocks, "h2d"), target,
                                                PlanOptions(regions_per_call=s.regions_per_layer))
            for p in ("contiguous", "fragmented")}


# Seconds per section on one H200, for the time budget: the times measured there on 2026-12-04 (the second full
# run: 182 s of wall time in all, start-up included), and for the layer-wise section its three gated transfers
# per pattern (0.2 s each) added. Sections not in this table are estimated from the figures those runs gave.
MEASURED_S = {"environment": 0.2, "dma-roundtrip": 0.6, "bandwidth": 4.1, "submit": 0.4, "dma-interference": 0.8,
              "cuda-apis": 4.2, "copy-flags": 2.7, "layerwise": 2.3, "c32": 131.7, "triton-roundtrip": 2.6,
              "run-api": 0.1, "crossover": 0.8, "triton-interference": 0.3, "c32-triton": 12.4, "offload": 0.1,
              "executor-close": 0.5}


def estimate_seconds(s: Sizes = GPU) -> dict[str, float]:
    """The check's time on one H200 per section, plus start-up (imports, CUDA, Triton's first compiles): measured
    times (MEASURED_S) for the default sizes; for other sizes the C32 sections scale with their bytes."""
    regions, moved, _, page = s.c32
    scale = regions * moved * page / (118 * 16128 * 32 * 1024)
    est = {name: MEASURED_S[name] * (scale if name.startswith("c32") else 1.0) for name, _ in SECTIONS}
    est["startup"] = 25.0
    est["total"] = sum(est.values())
    return {k: round(v, 1) for k, v in est.items()}


def dry_run(out: Path | None) -> None:
    target = Target(platform="cuda", runtime_version=13000)
    c32 = {name: entry[0] for name, entry in c32_plans(target).items()}
    groups = {"": restore_plans(target) | layer_plans(target), "submit ": submit_plans(target),
              "h2d crossover ": crossover_plans(target), "c32 ": c32}
    rows = {f"{prefix}{k}": {"ranges": p.num_ranges, "calls": p.num_calls, "bytes": p.total_bytes}
            for prefix, plans in groups.items() for k, p in plans.items()}
    print(f"{'plan':34} {'ranges':>8} {'calls':>6} {'MiB':>9}")
    for name, r in rows.items():
        print(f"{name:34} {r['ranges']:>8} {r['calls']:>6} {r['bytes'] / 2**20:>9.1f}")
    est = estimate_seconds()
    print("\nsections, in order, with their seconds on one H200 (measured there on 2026-12-04):")
    for name, _ in SECTIONS:
        print(f"  {name:22} {est[name]:>7.1f}")
    print(f"  {'start-up':22} {est['startup']:>7.1f}\n  {'total':22} {est['total']:>7.1f}")
    if out:
        out.write_text(json.dumps({"dry_run": True, "plans": rows, "estimate_s": est}, indent=1))


# ---- figures (pure) -----------------------------------------------------------------------------------------
def spread(samples: list[float]) -> dict[str, Any]:
    return {"median": statistics.median(samples), "min": min(samples), "max": max(samples), "samples": list(samples)}


def fit_line(x: list[float], y: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of y over x; needs two distinct x."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(intercept), float(slope)


def crossover_size(rows: dict[int, dict[str, Any]]) -> int | None:
    """The smallest range size from which DMA is at least as fast as Triton at every larger size (None: never)."""
    sizes = sorted(rows)
    for i, size in enumerate(sizes):
        if all(rows[s]["triton_over_dma"] is not None and rows[s]["triton_over_dma"] <= 1 for s in sizes[i:]):
            return size
    return None


def overlap_figures(copies: list[tuple[float, float, int]], ops: list[tuple[float, float, int]],
                    alone_op_ms: float, alone_copy_gbps: float | None) -> dict[str, Any]:
    """Copies and compute over the same window: compute intervals that lie wholly inside the copy span, and
    copy intervals that lie wholly inside the compute span.

    ``copies``: (start ms, end ms, bytes) per transfer; ``ops``: (start ms, end ms, ops) per group of compute
    ops, all on one clock. Returns the compute time per op during copies and its slowdown against
    ``alone_op_ms``, and the copy GB/s during compute against ``alone_copy_gbps``; None where nothing overlapped.
    """
    c0, c1 = min(a for a, _, _ in copies), max(b for _, b, _ in copies)
    k0, k1 = min(a for a, _, _ in ops), max(b for _, b, _ in ops)
    inside_ops = [(a, b, n) for a, b, n in ops if a >= c0 and b <= c1]
    inside_copies = [(a, b, n) for a, b, n in copies if a >= k0 and b <= k1]
    per_op = [(b - a) / n for a, b, n in inside_ops]
    op_ms = statistics.median(per_op) if per_op else None
    copy_s = sum(b - a for a, b, _ in inside_copies) / 1e3
    gbps = sum(n for _, _, n in inside_copies) / copy_s / 1e9 if inside_copies and copy_s > 0 else None
    return {"window_ms": max(0.0, min(c1, k1) - max(c0, k0)), "compute_groups_during_copies": len(inside_ops),
            "op_ms_during": op_ms, "op_ms_alone": alone_op_ms,
            "slowdown_pct": None if op_ms is None else 100 * (op_ms / alone_op_ms - 1),
            "transfers_during_compute": len(inside_copies), "copy_GB/s_during": gbps, "copy_GB/s_alone": alone_copy_gbps,
            "copy_vs_alone": None if gbps is None or not alone_copy_gbps else gbps / alone_copy_gbps,
            "op_ms_samples_during": per_op}


def unit_map(plan: TransferPlan) -> tuple[int, dict[int, dict[int, tuple[np.ndarray, np.ndarray]]]]:
    """The plan as copies of ``unit``-byte cells (``unit`` = gcd of every offset, size and buffer size):
    ``{dst buffer: {src buffer: (dst cells, src cells)}}``, vectorized (no loop over ranges)."""
    cols = [plan.src_offset, plan.dst_offset, plan.nbytes, np.array([b.nbytes for b in plan.buffers], np.uint64)]
    unit = int(np.gcd.reduce(np.concatenate(cols).astype(np.int64)))
    counts = (plan.nbytes // np.uint64(unit)).astype(np.int64)
    within = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    src = np.repeat((plan.src_offset // np.uint64(unit)).astype(np.int64), counts) + within
    dst = np.repeat((plan.dst_offset // np.uint64(unit)).astype(np.int64), counts) + within
    sb, db = np.repeat(plan.src_buf, counts), np.repeat(plan.dst_buf, counts)
    out: dict[int, dict[int, tuple[np.ndarray, np.ndarray]]] = {}
    for d in np.unique(db).tolist():
        for s_ in np.unique(sb[db == d]).tolist():
            sel = (db == d) & (sb == s_)
            out.setdefault(d, {})[s_] = (dst[sel], src[sel])
    return unit, out


# ---- what the check asks of torch: a CUDA GPU, or the CPU with host-timed events ----------------------------
class HostEvent:
    """A torch.cuda.Event stand-in for CPU runs: host time at record."""

    t = 0.0

    def record(self, stream: Any = None) -> None:
        self.t = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def elapsed_time(self, end: HostEvent) -> float:
        return (end.t - self.t) * 1e3


class HostStream:
    """A torch.cuda.Stream stand-in for CPU runs (work runs when issued)."""

    cuda_stream = 0

    def wait_event(self, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any) -> None:
        pass


class Device:
    """Memory, random fill, events and streams on a CUDA GPU (``gpu``) or the CPU."""

    def __init__(self, torch: Any, gpu: bool):
        self.torch, self.gpu = torch, gpu
        self.dev = torch.device("cuda" if gpu else "cpu")

    def empty(self, nbytes: int, location: str) -> Any:
        t = self.torch
        if location == "device":
            return t.empty(nbytes, dtype=t.uint8, device=self.dev)
        return t.empty(nbytes, dtype=t.uint8, pin_memory=self.gpu)

    def fill(self, tensor: Any, seed: int) -> None:
        """Random bytes, made on the GPU and copied into host memory in chunks (no CPU-thread fill)."""
        t = self.torch
        g = t.Generator(device=self.dev)
        g.manual_seed(seed)
        if tensor.device.type == self.dev.type:
            tensor.random_(0, 256, generator=g)
        else:
            self.fill_through(tensor, g)

    def fill_through(self, tensor: Any, generator: Any, chunk: int = 256 << 20) -> None:
        """Fill ``tensor`` (host memory) with random bytes made on this device, ``chunk`` bytes at a time."""
        t = self.torch
        scratch = t.empty(min(chunk, tensor.numel()), dtype=t.uint8, device=self.dev)
        for lo in range(0, tensor.numel(), chunk):
            n = min(chunk, tensor.numel() - lo)
            scratch[:n].random_(0, 256, generator=generator)
            tensor[lo:lo + n].copy_(scratch[:n])
        self.synchronize()

    def memory(self, plan: TransferPlan | Any, seed: int = 0) -> dict[str, Any]:
        """One buffer per buffer of ``plan`` (a plan or a layout): device buffers on the GPU, host buffers
        pinned; random bytes."""
        mem = {}
        for i, b in enumerate(plan.buffers):
            mem[b.name] = self.empty(b.nbytes, b.location.value)
            self.fill(mem[b.name], seed * 1000 + i)
        return mem

    def event(self) -> Any:
        return self.torch.cuda.Event(enable_timing=True) if self.gpu else HostEvent()

    def stream(self) -> Any:
        return self.torch.cuda.Stream() if self.gpu else HostStream()

    def on(self, stream: Any) -> contextlib.AbstractContextManager[Any]:
        return self.torch.cuda.stream(stream) if self.gpu else contextlib.nullcontext()

    def synchronize(self) -> None:
        if self.gpu:
            self.torch.cuda.synchronize()

    def matmul_operands(self, shape: tuple[int, int, int], seed: int) -> tuple[Any, Any]:
        t = self.torch
        m, k, n = shape
        dtype = t.bfloat16 if self.gpu else t.float32
        g = t.Generator(device=self.dev)
        g.manual_seed(seed)
        return (t.randn(m, k, dtype=dtype, device=self.dev, generator=g),
                t.randn(k, n, dtype=dtype, device=self.dev, generator=g))


# ---- executors: ONE place constructs them ---------------------------------------------------------------------
DMA_ROLES = {"dma": None, "dma-12.8": 12080, "dma-per-copy": 12000}  # role -> driver version the runtime is driven as


def make_executor(dev: Device, role: str, cuda_stand_in: Any = None) -> Any:
    """The executor for ``role``: "dma" (the copy engines, the driver's newest batch ABI), "dma-12.8" (the same
    driver through the 12.8 ABI of cuMemcpyBatchAsync), "dma-per-copy" (one cuMemcpyAsync per range, the path
    below 12.8) or "triton" (the SM kernel).

    On a GPU: CudaBatchExecutor over a CudaRuntime driven as that version, and TritonExecutor(). On the CPU:
    ``cuda_stand_in(version)`` (a host-memory stand-in for the CUDA driver reporting ``version``, None for its
    newest; given by tests) under CudaBatchExecutor, else the NumPy executor; Triton under its interpreter
    (TRITON_INTERPRET=1 must be set before triton is imported).
    """
    if role in DMA_ROLES:
        from kvxfer.executors import CudaBatchExecutor, CudaRuntime, NumpyExecutor
        version = DMA_ROLES[role]
        if dev.gpu:
            return CudaBatchExecutor(CudaRuntime(0, version=version)) if version else CudaBatchExecutor()
        return CudaBatchExecutor(cuda_stand_in(version)) if cuda_stand_in is not None else NumpyExecutor()
    if role == "triton":
        from kvxfer.executors import TritonExecutor
        return TritonExecutor()
    raise ValueError(f"role = {role!r}: expected one of {', '.join([*DMA_ROLES, 'triton'])}")


def bind(ex: Any, plan: TransferPlan, mem: dict[str, Any]) -> Any:
    """Bind ``mem`` once where the executor can (``bind``), else hand the dict to every run. (Delete the
    fallback once every executor binds.)"""
    b = getattr(ex, "bind", None)
    return b(plan.buffers, mem) if b is not None else mem


def unbind(bound: Any) -> None:
    close = getattr(bound, "close", None)
    if close is not None:
        close()


# ---- measuring --------------------------------------------------------------------------------------------
@dataclass
class Check:
    """The state of one check: device, sizes, executors and the report written after every section."""

    dev: Device
    sizes: Sizes
    out: Path | None
    cuda_stand_in: Any = None
    report: dict[str, Any] | None = None
    executors: dict[str, Any] | None = None
    alone: dict[str, Any] | None = None  # compute-alone baselines, shared by both interference sections
    restore_mem: dict[str, Any] | None = None  # the restore buffers, shared by the sections that use them
    ops: dict[str, Any] | None = None  # the compute kinds and their operands, made once
    c32: Any = None  # the C32 buffers (C32Memory), shared by the c32 sections, freed by the last
    c32_setup_s: float = 0.0

    def executor(self, role: str) -> Any:
        self.executors = self.executors or {}
        if role not in self.executors:
            self.executors[role] = make_executor(self.dev, role, self.cuda_stand_in)
        return self.executors[role]

    def target_for(self, role: str) -> Target:
        """What plans for ``role`` are made for: a DMA role's own driver version; Triton takes the check's target."""
        return self.executor(role).target if role in DMA_ROLES else self.target

    @property
    def target(self) -> Target:
        """What the plans are made for: the DMA executor's driver, or Triton's where that executor fails."""
        try:
            return self.executor("dma").target
        except Exception:
            return self.executor("triton").target

    def save(self) -> None:
        if self.out is None:
            return
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        tmp.replace(self.out)

    def section(self, name: str, fn: Callable[[Check], Any]) -> None:
        """Run one section: its result or its error goes into the report, which is written either way."""
        self.report["running"] = name
        self.save()
        t0 = time.perf_counter()
        try:
            self.report[name] = fn(self)
            status = "ok"
        except Exception as e:
            self.report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            status = "error"
            print(f"\n!! section {name} failed: {type(e).__name__}: {e}", file=sys.stderr)
        self.report["sections"][name] = {"status": status, "seconds": round(time.perf_counter() - t0, 3)}
        self.report.pop("running", None)
        self.save()


def timed_runs(ex: Any, plan: TransferPlan, bound: Any, reps: int, stream: Any = None) -> dict[str, Any]:
    """One warm-up, then ``reps`` runs: copy seconds from the transfer's events, submit seconds on the host."""
    ex.run(plan, bound, stream).wait()
    copy_s, submit_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        t = ex.run(plan, bound, stream)
        submit_s.append(time.perf_counter() - t0)
        copy_s.append(t.wait().elapsed_s)
    gbps = [plan.total_bytes / max(c, 1e-12) / 1e9 for c in copy_s]
    return {"ranges": plan.num_ranges, "calls": plan.num_calls, "bytes": plan.total_bytes,
            "GB/s": spread(gbps), "copy_ms": spread([c * 1e3 for c in copy_s]),
            "submit_ms": spread([s * 1e3 for s in submit_s])}


def scramble(ck: Check, plan: TransferPlan, mem: dict[str, Any], seed: int) -> dict[str, Any]:
    """Fresh random bytes in every destination buffer; returns their snapshot (on the device) for the check."""
    before = {}
    for i in plan.buffers_used("dst").tolist():
        name = plan.buffers[i].name
        ck.dev.fill(mem[name], seed + i)
        before[name] = mem[name].to(ck.dev.dev, copy=True)
    return before


def check_bytes(ck: Check, plan: TransferPlan, mem: dict[str, Any], before: dict[str, Any]) -> bool:
    """Every destination cell holds its source cell and every other destination byte is as before."""
    t, dev = ck.dev.torch, ck.dev.dev
    unit, cells = unit_map(plan)
    ok = True
    for d, by_src in cells.items():
        name = plan.buffers[d].name
        got = mem[name].to(dev).view(-1, unit)
        untouched = t.ones(got.shape[0], dtype=t.bool, device=dev)
        for s_, (dst_cells, src_cells) in by_src.items():
            src = mem[plan.buffers[s_].name].to(dev).view(-1, unit)
            di, si = t.from_numpy(dst_cells).to(dev), t.from_numpy(src_cells).to(dev)
            ok &= bool(t.equal(got.index_select(0, di), src.index_select(0, si)))
            untouched[di] = False
        ok &= bool(t.equal(got[untouched], before[name].view(-1, unit)[untouched]))
    return ok


def measured(ck: Check, ex: Any, plan: TransferPlan, mem: dict[str, Any], seed: int) -> dict[str, Any]:
    """Timed runs of ``plan`` on fresh destination bytes, then the bytes of those runs checked."""
    before = scramble(ck, plan, mem, seed)
    bound = bind(ex, plan, mem)
    try:
        row = timed_runs(ex, plan, bound, ck.sizes.reps)
    finally:
        unbind(bound)
    ck.dev.synchronize()
    row["bytes_ok"] = check_bytes(ck, plan, mem, before)
    return row


# ---- sections -----------------------------------------------------------------------------------------------
def environment(ck: Check) -> dict[str, Any]:
    torch = ck.dev.torch

    def version(dist: str) -> str | None:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return None

    env = {"date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "host": platform.node(),
           "python": platform.python_version(), "argv": sys.argv, "sizes": asdict(ck.sizes),
           "torch": torch.__version__, "torch_cuda": getattr(torch.version, "cuda", None),
           **{dist: version(dist) for dist in ("triton", "cuda-bindings", "cuda-python", "numpy", "pydantic")},
           "device": "cuda" if ck.dev.gpu else "cpu", "triton_interpret": os.environ.get("TRITON_INTERPRET")}
    if ck.dev.gpu:
        props = torch.cuda.get_device_properties(0)
        env |= {"gpu": props.name, "sm_count": props.multi_processor_count, "gpu_memory_GiB": props.total_memory / 2**30,
                "compute_capability": f"{props.major}.{props.minor}"}
        with contextlib.suppress(Exception):
            env["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=20).stdout.strip()
    else:
        env |= {"gpu": None, "sm_count": None, "cpu_count": os.cpu_count()}
    try:  # the DMA executor's driver version (cuDriverGetVersion); its failure must not lose the versions above
        env["executor_target"], env["dma_executor"] = ck.target.label, type(ck.executor("dma")).__name__
    except Exception as e:
        env["executor_target"] = env["dma_executor_error"] = f"{type(e).__name__}: {e}"
    print(f"# {env['gpu'] or 'CPU'} ({env['sm_count']} SMs), driver {env.get('driver')} / {env['executor_target']}, "
          f"torch {env['torch']}, triton {env['triton']}, cuda-bindings {env['cuda-bindings']}")
    return env


def round_trips(ck: Check, role: str) -> dict[str, bool]:
    """d2h then h2d for five patterns on per-region device buffers, each compared with the test oracle's
    per-piece copies (kvxfer.testing)."""
    from kvxfer.testing import run_reference
    ex, target = ck.executor(role), ck.target_for(role)
    regions, blocks, moved, page = ck.sizes.roundtrip
    layout = presets.kv_layout(regions, blocks, page, shared_device=False)
    results = {}
    for seed, pattern in enumerate((*PATTERNS, "descending", "interleaved")):
        ok = True
        for direction in ("d2h", "h2d"):
            mapping = presets.mapping(pattern, moved, blocks, direction)
            plan = plan_transfer(layout, mapping, target)
            mem = ck.dev.memory(plan, seed)
            want = run_reference(layout, mapping, {k: v.cpu().numpy() for k, v in mem.items()})
            ex.run(plan, mem).wait()
            ck.dev.synchronize()
            ok &= all(np.array_equal(mem[k].cpu().numpy(), want[k]) for k in want)
        results[pattern] = ok
        print(f"{role} round trip {pattern:12} {'OK' if ok else 'MISMATCH'}")
    return results


def run_api(ck: Check) -> dict[str, Any]:
    """``after`` across executors: a load on one reads host blocks a store on the other writes, issued back to
    back with no host wait (on a GPU the order is a device-side event wait); every byte is compared with the
    oracle run in order. Then a bound device buffer whose tensor moved (``set_``) must be refused."""
    from kvxfer.executors import BindingError
    from kvxfer.testing import run_reference
    dma, tri = ck.executor("dma"), ck.executor("triton")
    regions, blocks, moved, page = ck.sizes.roundtrip
    layout = presets.kv_layout(regions, blocks, page, shared_device=False)
    out: dict[str, Any] = {}
    for name, (first, second) in {"dma then triton": (dma, tri), "triton then dma": (tri, dma)}.items():
        store = presets.mapping("fragmented", moved, blocks, "d2h", seed=5)
        load = BlockMapping(direction="h2d", src_ids=store.dst_ids, dst_ids=list(reversed(store.src_ids)))
        plans = [plan_transfer(layout, m, ck.target) for m in (store, load)]
        mem = ck.dev.memory(plans[0], 7)
        want = run_reference(layout, load, run_reference(layout, store, {k: v.cpu().numpy() for k, v in mem.items()}))
        t = first.run(plans[0], mem)
        second.run(plans[1], mem, after=t).wait()
        ck.dev.synchronize()
        out[f"{name} bytes_ok"] = all(np.array_equal(mem[k].cpu().numpy(), want[k]) for k in want)
    plan = plan_transfer(layout, presets.mapping("fragmented", moved, blocks, "h2d"), ck.target)
    mem = ck.dev.memory(plan, 9)
    bound = bind(dma, plan, mem)
    device = next(b.name for b in plan.buffers if b.location.value == "device")
    mem[device].set_(ck.dev.torch.empty_like(mem[device]))
    try:
        dma.run(plan, bound).wait()
        out["moved tensor refused"] = False
    except BindingError:
        out["moved tensor refused"] = True
    finally:
        unbind(bound)
    print("run api: " + ", ".join(f"{k} {v}" for k, v in out.items()))
    return out


def restore_memory(ck: Check) -> dict[str, Any]:
    if ck.restore_mem is None:
        ck.restore_mem = ck.dev.memory(restore_plans(ck.target, ck.sizes)["h2d contiguous merged"])
    return ck.restore_mem


def bandwidth(ck: Check) -> dict[str, Any]:
    ex = ck.executor("dma")
    mem = restore_memory(ck)
    rows = {}
    for i, (name, plan) in enumerate(restore_plans(ck.target, ck.sizes).items()):
        rows[name] = measured(ck, ex, plan, mem, seed=100 + 10 * i)
        r = rows[name]
        print(f"{name:28} {r['ranges']:>7} ranges {r['GB/s']['median']:>8.2f} GB/s  submit {r['submit_ms']['median']:.3f} ms"
              f"  bytes {'ok' if r['bytes_ok'] else 'WRONG'}")
    for d in ("h2d", "d2h"):
        base = rows[f"{d} one-copy"]["GB/s"]["median"]
        for name, r in rows.items():
            if name.startswith(d):
                r["vs_one_copy"] = r["GB/s"]["median"] / base
    return rows


def submit_cost(ck: Check) -> dict[str, Any]:
    """Host time inside run() over descriptor counts: intercept = fixed cost per run, slope = per descriptor."""
    ex = ck.executor("dma")
    mem = restore_memory(ck)
    rows, xs, ys = {}, [], []
    for n, plan in submit_plans(ck.target, ck.sizes).items():
        bound = bind(ex, plan, mem)
        try:
            r = timed_runs(ex, plan, bound, ck.sizes.reps)
        finally:
            unbind(bound)
        rows[n] = r
        xs += [n] * len(r["submit_ms"]["samples"])
        ys += r["submit_ms"]["samples"]
    fixed_ms, per_desc_ms = fit_line(xs, ys)
    out = {"per_descriptor_us": per_desc_ms * 1e3, "fixed_per_run_us": fixed_ms * 1e3, "by_descriptors": rows}
    print(f"submit: {out['per_descriptor_us']:.3f} us per descriptor + {out['fixed_per_run_us']:.1f} us per run "
          f"(fit over {len(rows)} descriptor counts)")
    return out


def compute_ops(ck: Check) -> dict[str, tuple[Callable[[], Any], Any]]:
    """The compute beside the copies: a decode-shaped memory-bound matmul and a compute-bound GEMM."""
    if ck.ops is None:
        s = ck.sizes
        a, w = ck.dev.matmul_operands(s.decode, 1)
        x, y = ck.dev.matmul_operands((s.gemm, s.gemm, s.gemm), 2)
        mm = ck.dev.torch.matmul
        ck.ops = {"decode": (lambda: mm(a, w), (a, w)), "gemm": (lambda: mm(x, y), (x, y))}
    return ck.ops


def queue_ops(ck: Check, op: Callable[[], Any], iters: int, group: int, stream: Any) -> list[Any]:
    """Queue ``iters`` ops on ``stream`` with an event before the first and after every ``group`` ops."""
    events = [ck.dev.event()]
    with ck.dev.on(stream):
        events[0].record(stream)
        for i in range(iters):
            op()
            if (i + 1) % group == 0 or i == iters - 1:
                events.append(ck.dev.event())
                events[-1].record(stream)
    return events


def op_groups(events: list[Any], ref: Any, iters: int, group: int) -> list[tuple[float, float, int]]:
    events[-1].synchronize()
    t = [ref.elapsed_time(e) for e in events]
    sizes = [group] * (len(t) - 2) + [iters - group * (len(t) - 2)]
    return [(t[i], t[i + 1], sizes[i]) for i in range(len(t) - 1)]


def alone_baselines(ck: Check) -> dict[str, Any]:
    """Per-op time of each compute kind with no copies running (every group's sample kept)."""
    if ck.alone is None:
        ck.alone = {}
        for name, (op, _) in compute_ops(ck).items():
            stream = ck.dev.stream()
            for _ in range(3):
                op()
            ck.dev.synchronize()
            iters = ck.sizes.max_compute_ops // 4
            ref = ck.dev.event()
            ref.record(stream)
            groups = op_groups(queue_ops(ck, op, iters, max(1, iters // 50), stream), ref, iters, max(1, iters // 50))
            per_op = [(b - a) / n for a, b, n in groups]
            ck.alone[name] = {"op_ms": statistics.median(per_op), "samples": per_op}
    return ck.alone


def copies_beside(ck: Check, role: str, plan_name: str = "h2d fragmented merged",
                  plan: TransferPlan | None = None, quiet: bool = False) -> dict[str, Any]:
    """Each compute kind alone, then beside ``transfers_beside`` restore transfers on the ``role`` executor,
    with compute and copies measured over the window where they overlap. ``plan``: another plan over the
    restore buffers (named ``plan_name`` in the report) instead of the restore plan of that name."""
    ex = ck.executor(role)
    plan = plan if plan is not None else restore_plans(ck.target, ck.sizes)[plan_name]
    mem = restore_memory(ck)
    alone = alone_baselines(ck)
    feed, compute, marker = ck.dev.stream(), ck.dev.stream(), ck.dev.stream()
    k = ck.sizes.transfers_beside
    bound = bind(ex, plan, mem)
    try:
        solo = _transfers(ck, ex, plan, bound, feed, marker, k, ref=None)
        alone_gbps = sum(n for _, _, n in solo) / (sum(b - a for a, b, _ in solo) / 1e3) / 1e9
        copy_ms = max(b for _, b, _ in solo) - min(a for a, _, _ in solo)
        rows = {"plan": plan_name, "ranges": plan.num_ranges, "transfers": k, "copies_alone_ms": copy_ms}
        for name, (op, _) in compute_ops(ck).items():
            op_ms = alone[name]["op_ms"]
            iters = max(1, min(ck.sizes.max_compute_ops, math.ceil(2.0 * copy_ms / max(op_ms, 1e-6))))
            group = max(1, iters // 100)
            ck.dev.synchronize()
            ref = ck.dev.event()
            ref.record(compute)
            events = queue_ops(ck, op, iters, group, compute)  # compute first: the host then reaches the copies
            copies = _transfers(ck, ex, plan, bound, feed, marker, k, ref=ref)
            rows[name] = overlap_figures(copies, op_groups(events, ref, iters, group), op_ms, alone_gbps)
            rows[name]["compute_ops"] = iters
            r = rows[name]
            if not quiet:
                print(f"{role:7} beside {name:6}: compute {_pct(r['slowdown_pct'])} per op, copies "
                      f"{_num(r['copy_GB/s_during'])} GB/s during vs {alone_gbps:.2f} alone")
    finally:
        unbind(bound)
    return rows


def _transfers(ck: Check, ex: Any, plan: TransferPlan, bound: Any, feed: Any, marker: Any, k: int,
               ref: Any) -> list[tuple[float, float, int]]:
    """Queue ``k`` transfers back to back; (start, end, bytes) of each in ms on ``ref``'s clock. The end is an
    event on an idle marker stream made to wait for the transfer; the start is that end minus the transfer's
    own elapsed time."""
    if ref is None:
        ck.dev.synchronize()
        ref = ck.dev.event()
        ref.record(feed)
    ends, transfers = [], []
    for _ in range(k):
        t = ex.run(plan, bound, feed)
        t.stream_wait(marker)
        e = ck.dev.event()
        e.record(marker)
        ends.append(e)
        transfers.append(t)
    out = []
    ref.synchronize()
    for t, e in zip(transfers, ends):
        t.wait()
        e.synchronize()
        end = ref.elapsed_time(e)
        out.append((end - t.elapsed_s * 1e3, end, plan.total_bytes))
    return out


def crossover(ck: Check) -> dict[str, Any]:
    dma, tri = ck.executor("dma"), ck.executor("triton")
    rows: dict[int, dict[str, Any]] = {}
    for size, plan in crossover_plans(ck.target, ck.sizes).items():
        mem = ck.dev.memory(plan, seed=size)
        d = measured(ck, dma, plan, mem, seed=7)
        t = measured(ck, tri, plan, mem, seed=8)
        dm, tm = d["copy_ms"]["median"], t["copy_ms"]["median"]
        rows[size] = {"ranges": plan.num_ranges, "dma": d, "triton": t, "dma_GB/s": d["GB/s"]["median"],
                      "triton_GB/s": t["GB/s"]["median"], "triton_over_dma": dm / tm if tm > 0 else None,
                      "bytes_ok": d["bytes_ok"] and t["bytes_ok"]}
        del mem
        print(f"crossover {size:>8} B: DMA {rows[size]['dma_GB/s']:8.2f} GB/s, Triton {rows[size]['triton_GB/s']:8.2f} GB/s")
    return {"rows": rows, "dma_from_bytes": crossover_size(rows),
            "note": "Triton copy time is the transfer's events (start..end on its stream)"}


def offload_jobs(ck: Check) -> dict[str, Any]:
    """A short store/load job loop through the offload worker (kvxfer.offload) on the DMA executor: per-layer
    device tensors, host chunks of 4 blocks; every restore compared with the bytes that were stored."""
    try:
        from kvxfer.offload import DeviceKV, HostTier, KVTensor, create_worker
        from kvxfer.planner import Buffer, Location
    except ImportError as e:
        print(f"offload: skipped, kvxfer.offload does not import here ({e})")
        return {"skipped": f"kvxfer.offload does not import here ({e})"}
    regions, blocks, moved, page = ck.sizes.roundtrip
    k = 4
    moved -= moved % k
    gpu = ck.dev.empty(regions * blocks * page, "device")
    ck.dev.fill(gpu, 11)
    tensors = tuple(KVTensor(name=f"layer{i}", buffer="gpu", page_bytes=page, byte_offset=i * blocks * page)
                    for i in range(regions))
    device = DeviceKV((Buffer(name="gpu", nbytes=gpu.numel(), location=Location.DEVICE),), tensors, {"gpu": gpu})
    worker = make_worker(create_worker, device, HostTier(num_chunks=2 * moved // k, blocks_per_chunk=k),
                         ck.executor("dma"))
    pages = gpu.view(regions, blocks, page)
    results, ok_bytes, t0 = [], True, time.perf_counter()
    try:
        for job in range(0, 8, 2):
            src = list(range(moved)) if job % 4 == 0 else list(range(moved - 1, -1, -1))  # ascending, descending
            chunks = list(range(moved // k))
            want = pages[:, src].clone()
            worker.submit_store(job, src, chunks)
            dst = list(range(blocks - moved, blocks))
            worker.submit_load(job + 1, chunks, dst)  # ordered after the store: same host chunks
            worker.wait({job, job + 1})
            ck.dev.synchronize()
            ok_bytes &= bool(ck.dev.torch.equal(pages[:, dst], want))
            results += worker.get_finished()
        wall = time.perf_counter() - t0
    finally:
        worker.shutdown()
    ok = bool(results) and all(r.success for r in results)
    print(f"offload: {len(results)} jobs, all succeeded: {ok}, restores equal the stores: {ok_bytes}, "
          f"{wall * 1e3:.1f} ms wall")
    return {"jobs": len(results), "all_succeeded": ok, "bytes_ok": ok_bytes, "wall_ms": wall * 1e3,
            "per_job_ms": [r.elapsed_s * 1e3 for r in results], "ranges": [r.num_ranges for r in results],
            "errors": [str(r.error) for r in results if r.error is not None]}


def make_worker(create_worker: Any, device: Any, tier: Any, executor: Any) -> Any:
    """ONE place that builds the offload worker."""
    return create_worker(device, tier, executor, regions_per_layer=1)


# ---- the CUDA copy paths, copy flags, layer-wise calls, the C32 restore, the executor's close ----------------
def cuda_apis(ck: Check) -> dict[str, Any]:
    """Every CUDA copy path on the same driver, each forced through a runtime driven as its version: the newest
    batch ABI ("dma": 13.0 on a 13.x driver), the 12.8 ABI (with failIdx) and per-range cuMemcpyAsync (the path
    below 12.8). Per path: the five round trips against the oracle, and three restore plans timed, their bytes
    checked (runs of 8 merged both ways, fragmented per block h2d)."""
    mem = restore_memory(ck)
    out: dict[str, Any] = {}
    for role in DMA_ROLES:
        ex = ck.executor(role)
        plans = restore_plans(ex.target, ck.sizes)
        row: dict[str, Any] = {"target": ex.target.label, "round_trips": round_trips(ck, role)}
        for i, name in enumerate(("h2d runs8 merged", "d2h runs8 merged", "h2d fragmented per-block")):
            row[name] = measured(ck, ex, plans[name], mem, seed=300 + 10 * i) | {"api": plans[name].api.value}
            r = row[name]
            print(f"{role:13} {name:26} {r['api']:18} {r['ranges']:>7} ranges {r['GB/s']['median']:>8.2f} GB/s  "
                  f"submit {r['submit_ms']['median']:.3f} ms  bytes {'ok' if r['bytes_ok'] else 'WRONG'}")
        out[role] = row
    return out


def copy_flags(ck: Check) -> dict[str, Any]:
    """CUDA's PREFER_OVERLAP_WITH_COMPUTE copy flag against none (flags 0), on ranges of at most 128 KiB (the
    restore's fragmented plans: 32 KiB ranges) and larger ones (its contiguous plan: 8 MiB ranges): copy GB/s
    alone (bytes checked), and the decode matmul and the GEMM beside the copies."""
    s = ck.sizes
    target = ck.target
    layout = presets.kv_layout(s.regions, s.blocks, s.page, shared_device=True)
    mem = restore_memory(ck)
    ex = ck.executor("dma")
    rows: dict[str, Any] = {}
    for i, (direction, pattern) in enumerate((("h2d", "fragmented"), ("d2h", "fragmented"), ("h2d", "contiguous"))):
        m = presets.mapping(pattern, s.moved, s.blocks, direction)
        for flag in (False, True):
            plan = plan_transfer(layout, m, target, PlanOptions(prefer_overlap_with_compute=flag))
            flags = sorted({a.flags for a in plan.attrs})
            name = f"{direction} {pattern} {'prefer-overlap' if flag else 'flags-0'}"
            r = measured(ck, ex, plan, mem, seed=400 + 10 * i + flag)
            r |= {"flags": [hex(f) for f in flags], "passes_attrs": plan.passes_attrs,
                  "max_range_bytes": int(plan.nbytes.max()), "beside": copies_beside(ck, "dma", name, plan=plan, quiet=True)}
            rows[name] = r
            b = r["beside"]
            print(f"flags {name:34} {','.join(r['flags']):6} {r['GB/s']['median']:>7.2f} GB/s alone; beside decode "
                  f"{_pct(b['decode']['slowdown_pct'])} (copies {_num(b['decode']['copy_GB/s_during'])} GB/s), beside gemm "
                  f"{_pct(b['gemm']['slowdown_pct'])} (copies {_num(b['gemm']['copy_GB/s_during'])} GB/s)")
    return rows


def layerwise(ck: Check) -> dict[str, Any]:
    """Layer-wise calls: the restore (h2d, contiguous and fragmented) planned with one call per layer (two
    regions, K and V) against one call. Per layer: when its copy completed (its event, from the transfer's
    start), and how long after that a consumer stream waiting on that layer ran (the time from a layer's copy
    to its event being seen). Then a forward pass that computes layer i as soon as layer i has landed, against
    one that waits for the whole restore (one decode-sized matmul per layer)."""
    s = ck.sizes
    layout = presets.kv_layout(s.regions, s.blocks, s.page, shared_device=True)
    mem = restore_memory(ck)
    ex = ck.executor("dma")
    op = compute_ops(ck)["decode"][0]
    out: dict[str, Any] = {"regions_per_layer": s.regions_per_layer}
    for i, pattern in enumerate(("contiguous", "fragmented")):
        m = presets.mapping(pattern, s.moved, s.blocks, "h2d")
        one = plan_transfer(layout, m, ck.target)
        per_layer = plan_transfer(layout, m, ck.target, PlanOptions(regions_per_call=s.regions_per_layer))
        row: dict[str, Any] = {"one call": measured(ck, ex, one, mem, seed=500 + 10 * i),
                               "per layer": measured(ck, ex, per_layer, mem, seed=505 + 10 * i)}
        bound = bind(ex, per_layer, mem)
        try:
            row |= layer_events(ck, ex, per_layer, bound, op)
        finally:
            unbind(bound)
        out[pattern] = row
        pl, oc = row["per layer"], row["one call"]
        lag = row.get("consumer_lag_ms")
        print(f"layerwise {pattern:10}: {per_layer.num_calls} calls {pl['GB/s']['median']:.2f} GB/s (one call "
              f"{oc['GB/s']['median']:.2f}), submit {pl['submit_ms']['median']:.3f} ms "
              f"(one call {oc['submit_ms']['median']:.3f}); "
              + ("" if lag is None else
                 f"first layer at {row['layer_done_ms'][0]:.3f} of {row['layer_done_ms'][-1]:.3f} ms, consumer lag median "
                 f"{lag['median']:.4f} ms max {lag['max']:.4f}; forward pipelined {row['forward_pipelined_ms']:.3f} ms "
                 f"vs after the restore {row['forward_after_restore_ms']:.3f} ms"))
    return out


def layer_events(ck: Check, ex: Any, plan: TransferPlan, bound: Any, op: Callable[[], Any]) -> dict[str, Any]:
    """Device-side per-layer figures of ``plan`` (one call per layer) on a DMA executor: from a transfer's raw
    events (its start and per-call marks) and events the driver records on a consumer stream. Executors
    without device events (the NumPy one) give none."""
    probe = ex.run(plan, bound).wait()
    if not hasattr(probe, "marks"):
        return {"consumer_lag_ms": None, "note": f"{type(ex).__name__} has no per-call device events"}
    rt = ex.runtime
    consumer = ck.dev.stream()
    handle = int(getattr(consumer, "cuda_stream", 0))

    def ms(a: int, b: int) -> float:
        code, v = rt.event_elapsed_ms(a, b)
        check_code(rt, code, "event elapsed time")
        return float(v)

    gate_open_early: list[bool] = []
    opened_in_submit: list[bool] = []
    submit_ms: list[float] = []
    with ck.dev.on(consumer):  # the consumer's first matmul (its library handle and workspace) outside the figures
        op()
    ck.dev.synchronize()

    def consume(mode: str) -> tuple[list[float], list[float]]:
        """One transfer and a consumer stream: "lag" waits on each layer and records an event; "pipelined" also
        computes after each layer's wait; "after" waits for the whole restore, then computes every layer.
        Returns each layer's done time and the consumer's event times, in ms from the transfer's start. On a
        GPU the copies wait behind a gate (a sleeping kernel on the stream ``run`` orders them after) until the
        host has queued every consumer step, so the figures are the device's, not the host's submission."""
        ck.dev.synchronize()
        gate, opened = ck.dev.stream(), ck.dev.event()
        if ck.dev.gpu:
            with ck.dev.on(gate):
                ck.dev.torch.cuda._sleep(GATE_CYCLES)
        opened.record(gate)
        t0 = time.perf_counter()
        t = ex.run(plan, bound, gate)
        submit_ms.append((time.perf_counter() - t0) * 1e3)
        opened_in_submit.append(bool(ck.dev.gpu and opened.query()))  # run() blocked until the copies could start
        events: list[int] = []
        try:
            with rt.current():
                for layer in range(plan.num_calls):
                    if mode != "after" or layer == 0:
                        t.stream_wait(consumer, layer if mode != "after" else -1)
                    events.append(rt.event_create())
                    check_code(rt, rt.event_record(events[-1], handle), "event record (consumer)")
                    if mode != "lag":
                        with ck.dev.on(consumer):
                            op()
                events.append(rt.event_create())
                check_code(rt, rt.event_record(events[-1], handle), "event record (consumer end)")
            gate_open_early.append(bool(ck.dev.gpu and opened.query()))  # the gate opened before all was queued
            check_code(rt, rt.event_synchronize(events[-1]), "event synchronize (consumer end)")
            t.wait()
            return [ms(t.start, mark) for mark in t.marks], [ms(t.start, e) for e in events]
        finally:
            with rt.current():
                for e in events:
                    rt.event_destroy(e)

    done, seen = consume("lag")
    lag = [b - a for a, b in zip(done, seen)]  # a layer's copy done -> the consumer waiting on it running
    pipelined = consume("pipelined")[1][-1]
    after_restore = consume("after")[1][-1]
    return {"layer_done_ms": done, "consumer_seen_ms": seen[:-1], "consumer_lag_ms": spread(lag),
            "forward_pipelined_ms": pipelined, "forward_after_restore_ms": after_restore,
            "forward_ops": plan.num_calls, "gated": ck.dev.gpu, "gate_opened_before_queued": gate_open_early,
            "gate_opened_during_submit": opened_in_submit, "gated_submit_ms": submit_ms}


GATE_CYCLES = 400_000_000  # about 0.2 s of a sleeping kernel on an H200 (1.98 GHz): the host queues meanwhile


def check_code(rt: Any, code: int, call: str) -> None:
    if code:
        raise RuntimeError(f"{call}: {rt.error_name(code)} ({code})")


# ---- the C32 restore: MiniMax-M3 at TP4 (118 KV regions), 32 requests restored at once --------------------
C32_PATTERNS = ("contiguous", "runs8", "fragmented")


def c32_layout(s: Sizes = GPU) -> Any:
    """``regions`` regions of ``moved + slack`` pages in one device and one host buffer; the ``slack`` pages
    that open every region are never written (sentinels)."""
    regions, moved, slack, page = s.c32
    return presets.kv_layout(regions, moved + slack, page, shared_device=True)


def c32_mapping(pattern: str, s: Sizes, direction: str, seed: int = 32) -> BlockMapping:
    """The C32 restore's block pairs: ``moved`` of them per region, destinations always at or above ``slack``.
    contiguous: one run; runs8: runs of 8 at shuffled places on both sides; fragmented: sources shuffled,
    destinations ascending (almost no pair adjacent on both sides)."""
    _, n, slack, _ = s.c32
    rng = np.random.default_rng(seed)
    if pattern == "contiguous":
        src, dst = np.arange(n), np.arange(n) + slack
    elif pattern == "runs8":
        src = (rng.permutation(n // 8)[:, None] * 8 + np.arange(8)).ravel()
        dst = (rng.permutation(n // 8)[:, None] * 8 + np.arange(8)).ravel() + slack
    elif pattern == "fragmented":
        src, dst = rng.permutation(n), np.arange(n) + slack
    else:
        raise ValueError(f"pattern = {pattern!r}: expected one of {', '.join(C32_PATTERNS)}")
    return BlockMapping(direction=direction, src_ids=src, dst_ids=dst)


C32Entry = tuple[TransferPlan, np.ndarray, np.ndarray]


def c32_plans(target: Target, s: Sizes = GPU, merged_only: bool = False) -> dict[str, C32Entry]:
    """Every C32 plan with the pages it must move, as (plan, source page numbers, destination page numbers) over
    the buffers' pages: merged, per block (vLLM 0.34's submission: one descriptor per block per region, flags 0,
    emulated by a per-block plan on the same executor) and one copy of the whole buffer (the baseline)."""
    regions, moved, slack, page = s.c32
    blocks = moved + slack
    layout = c32_layout(s)
    out = {}
    for direction in ("h2d", "d2h"):
        for pattern in C32_PATTERNS:
            m = c32_mapping(pattern, s, direction)
            base = (np.arange(regions, dtype=np.int64) * blocks)[:, None]
            src = (base + np.asarray(m.src_ids, np.int64)).ravel()
            dst = (base + np.asarray(m.dst_ids, np.int64)).ravel()
            out[f"{direction} {pattern} merged"] = (plan_transfer(layout, m, target), src, dst)
            if not merged_only:
                per_block = plan_transfer(layout, m, target, PlanOptions(coalesce=False))
                out[f"{direction} {pattern} per-block"] = (per_block, src, dst)
        if not merged_only:
            one = presets.kv_layout(1, 1, regions * blocks * page, shared_device=True)  # the same two buffers
            every = np.arange(regions * blocks, dtype=np.int64)
            out[f"{direction} one-copy"] = (plan_transfer(one, BlockMapping(direction=direction, src_ids=[0], dst_ids=[0]),
                                                          target), every, every)
    return out


@dataclass
class C32Memory:
    """The C32 buffers (device and pinned host), page fingerprints and what the host buffer holds now."""

    mem: dict[str, Any]
    weights: Any  # one odd int64 per 8-byte word of a page
    host_fp: Any  # fingerprints of the host buffer's pages as they are now (on the device)


def fingerprints(ck: Check, buf: Any, page: int, weights: Any, chunk_bytes: int = 256 << 20) -> Any:
    """One int64 per page of ``buf``: the wrapping sum of its 8-byte words times ``weights`` (odd, so any change
    of one word changes it), computed on the device; host buffers are copied in ``chunk_bytes`` pieces."""
    t = ck.dev.torch
    n = buf.numel() // page
    out = t.empty(n, dtype=t.int64, device=ck.dev.dev)
    step = max(1, chunk_bytes // page)
    for lo in range(0, n, step):
        hi = min(n, lo + step)
        part = buf[lo * page:hi * page]
        if part.device != out.device:
            part = part.to(ck.dev.dev, non_blocking=True)
        out[lo:hi] = (part.view(t.int64).view(hi - lo, page // 8) * weights).sum(1)
    return out


def c32_memory(ck: Check) -> C32Memory:
    if ck.c32 is None:
        t = ck.dev.torch
        page = ck.sizes.c32[3]
        t0 = time.perf_counter()
        mem = ck.dev.memory(c32_layout(ck.sizes), seed=32)
        g = t.Generator(device=ck.dev.dev)
        g.manual_seed(3232)
        weights = t.randint(-2**62, 2**62, (page // 8,), dtype=t.int64, device=ck.dev.dev, generator=g) | 1
        ck.c32 = C32Memory(mem, weights, fingerprints(ck, mem["cpu"], page, weights))
        ck.c32_setup_s = time.perf_counter() - t0
    return ck.c32


def c32_run(ck: Check, ex: Any, name: str, entry: C32Entry, reps: int,
            seed: int, api: str | None = None) -> dict[str, Any]:
    """``entry``'s plan on the C32 buffers, timed (``reps`` runs after a warm-up; 0: one run), and its bytes
    checked page by page against the pages the block ids name (not the plan): every destination page holds its
    source page, every other destination page is as before. The device-side operand gets fresh random bytes
    first, so a run that copies nothing cannot pass."""
    plan, src_pages, dst_pages = entry
    c = c32_memory(ck)
    page = ck.sizes.c32[3]
    t = ck.dev.torch
    gpu, cpu = c.mem["gpu"], c.mem["cpu"]
    ck.dev.fill(gpu, seed)
    if plan.direction.value == "h2d":
        src_fp, before = c.host_fp, fingerprints(ck, gpu, page, c.weights)
    else:
        src_fp, before = fingerprints(ck, gpu, page, c.weights), c.host_fp
    bound = bind(ex, plan, c.mem)
    try:
        if reps:
            row = timed_runs(ex, plan, bound, reps)
        else:
            t0 = time.perf_counter()
            tr = ex.run(plan, bound)
            submit = time.perf_counter() - t0
            copy = tr.wait().elapsed_s
            row = {"ranges": plan.num_ranges, "calls": plan.num_calls, "bytes": plan.total_bytes,
                   "GB/s": spread([plan.total_bytes / max(copy or 0, 1e-12) / 1e9]), "copy_ms": spread([(copy or 0) * 1e3]),
                   "submit_ms": spread([submit * 1e3])}
    finally:
        unbind(bound)
    ck.dev.synchronize()
    after = fingerprints(ck, gpu if plan.direction.value == "h2d" else cpu, page, c.weights)
    if plan.direction.value == "d2h":
        c.host_fp = after
    di, si = t.from_numpy(dst_pages).to(ck.dev.dev), t.from_numpy(src_pages).to(ck.dev.dev)
    untouched = t.ones(after.numel(), dtype=t.bool, device=ck.dev.dev)
    untouched[di] = False
    row["bytes_ok"] = bool(t.equal(after[di], src_fp[si])) and bool(t.equal(after[untouched], before[untouched]))
    row["pages_checked"], row["sentinel_pages"] = int(di.numel()), int(untouched.sum())
    row["api"] = api or plan.api.value  # what issued the copies: the plan's driver call, or the kernel
    print(f"c32 {name:36} {row['api']:18} {plan.num_ranges:>8} ranges {row['GB/s']['median']:>7.2f} GB/s  "
          f"submit {row['submit_ms']['median']:>9.3f} ms  bytes {'ok' if row['bytes_ok'] else 'WRONG'}")
    return row


def _guarded(rows: dict[str, Any], name: str, fn: Callable[[], dict[str, Any]]) -> None:
    """One row of a long section: its error is recorded and the section goes on."""
    try:
        rows[name] = fn()
    except Exception as e:
        rows[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"c32 {name}: {type(e).__name__}: {e}", file=sys.stderr)


def c32_restore(ck: Check) -> dict[str, Any]:
    """The C32 restore (118 regions x 16,128 blocks x 32 KiB, 62 GB) on the copy engines: merged against per
    block (vLLM 0.34's submission, emulated) and one copy of the whole buffer, timed on the newest ABI; then
    every merged plan once through the 12.8 ABI and the per-copy path. Every run's pages checked."""
    regions, moved, slack, page = ck.sizes.c32
    rows: dict[str, Any] = {"shape": {"regions": regions, "blocks_moved": moved, "sentinel_blocks": slack, "page": page,
                                      "bytes": regions * moved * page}}
    c32_memory(ck)
    rows["setup_s"] = ck.c32_setup_s
    ex = ck.executor("dma")
    for i, (name, entry) in enumerate(c32_plans(ex.target, ck.sizes).items()):
        _guarded(rows, f"dma {name}", lambda: c32_run(ck, ex, f"dma {name}", entry, ck.sizes.c32_reps, 3200 + i))
    for d in ("h2d", "d2h"):
        base = rows.get(f"dma {d} one-copy", {}).get("GB/s", {}).get("median")
        for pattern in C32_PATTERNS:
            merged, per_block = rows.get(f"dma {d} {pattern} merged", {}), rows.get(f"dma {d} {pattern} per-block", {})
            if "GB/s" in merged and base:
                merged["vs_one_copy"] = merged["GB/s"]["median"] / base
            if "GB/s" in merged and "GB/s" in per_block:
                merged["vs_per_block_GB/s"] = merged["GB/s"]["median"] / per_block["GB/s"]["median"]
                merged["per_block_submit_over_merged"] = per_block["submit_ms"]["median"] / merged["submit_ms"]["median"]
    for role in ("dma-12.8", "dma-per-copy"):
        other = ck.executor(role)
        for i, (name, entry) in enumerate(c32_plans(other.target, ck.sizes, merged_only=True).items()):
            _guarded(rows, f"{role} {name}", lambda: c32_run(ck, other, f"{role} {name}", entry, 0, 3300 + i))
    return rows


def c32_triton(ck: Check) -> dict[str, Any]:
    """The C32 restore's merged plans on the Triton kernel, once each, every page checked; the C32 buffers are
    freed afterwards."""
    rows: dict[str, Any] = {}
    try:
        c32_memory(ck)
        ex = ck.executor("triton")
        for i, (name, entry) in enumerate(c32_plans(ck.target, ck.sizes, merged_only=True).items()):
            _guarded(rows, f"triton {name}", lambda: c32_run(ck, ex, f"triton {name}", entry, 0, 3400 + i, "triton kernel"))
    finally:
        ck.c32 = None
        if ck.dev.gpu:
            ck.dev.torch.cuda.empty_cache()
    return rows


def executor_close(ck: Check) -> dict[str, Any]:
    """A DMA executor made, run and closed while torch keeps using the GPU: torch's memory is then freed,
    allocated and computed with as before (closing an executor must leave the process's context alone)."""
    t = ck.dev.torch
    regions, blocks, moved, page = ck.sizes.roundtrip
    layout = presets.kv_layout(regions, blocks, page, shared_device=True)
    ex = make_executor(ck.dev, "dma", ck.cuda_stand_in)
    plan = plan_transfer(layout, presets.mapping("runs8", moved, blocks, "h2d"), ex.target)
    mem = ck.dev.memory(plan, seed=77)
    ex.run(plan, mem).wait()
    ex.close()
    del mem
    ck.dev.synchronize()
    x = t.ones(1 << 20, device=ck.dev.dev)
    ok = float(x.sum()) == float(1 << 20)
    del x
    ck.dev.synchronize()
    if ck.dev.gpu:
        t.cuda.empty_cache()
    print(f"executor close: torch works after it: {ok}")
    return {"torch_after_close": ok}


SECTIONS: tuple[tuple[str, Callable[[Check], Any]], ...] = (
    ("environment", environment),
    ("dma-roundtrip", lambda ck: round_trips(ck, "dma")),
    ("bandwidth", bandwidth),
    ("submit", submit_cost),
    ("dma-interference", lambda ck: copies_beside(ck, "dma")),
    ("cuda-apis", cuda_apis),
    ("copy-flags", copy_flags),
    ("layerwise", layerwise),
    ("c32", c32_restore),
    ("triton-roundtrip", lambda ck: round_trips(ck, "triton")),
    ("run-api", run_api),
    ("crossover", crossover),
    ("triton-interference", lambda ck: copies_beside(ck, "triton")),
    ("c32-triton", c32_triton),
    ("offload", offload_jobs),
    ("executor-close", executor_close),
)


# ---- the table at the end -----------------------------------------------------------------------------------
def _num(v: Any, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _pct(v: Any) -> str:
    return "-" if v is None else f"{v:+.1f}%"


def summary(report: dict[str, Any]) -> str:
    """The figures the issue asks for, as a fixed-width table (sections that failed show their error)."""
    lines = ["", "## summary", f"{'section':22} {'status':7} {'s':>7}"]
    lines += [f"{k:22} {v['status']:7} {v['seconds']:>7.1f}" for k, v in report["sections"].items()]
    bw = report.get("bandwidth", {})
    if "error" not in bw and bw:
        lines += ["", f"{'restore plan':28} {'ranges':>7} {'GB/s':>8} {'min':>8} {'max':>8} {'vs 1 copy':>9} {'bytes':>6}"]
        for k, r in bw.items():
            g = r["GB/s"]
            lines.append(f"{k:28} {r['ranges']:>7} {g['median']:>8.2f} {g['min']:>8.2f} {g['max']:>8.2f} "
                         f"{r['vs_one_copy']:>9.2f} {'ok' if r['bytes_ok'] else 'WRONG':>6}")
    sub = report.get("submit", {})
    if "error" not in sub and sub:
        lines.append(f"\nsubmit: {sub['per_descriptor_us']:.3f} us per descriptor, "
                     f"{sub['fixed_per_run_us']:.1f} us fixed per run")
    co = report.get("crossover", {})
    if "error" not in co and co:
        lines += ["", f"{'range B':>8} {'ranges':>7} {'DMA GB/s':>9} {'Triton GB/s':>11} {'Triton/DMA':>10} {'bytes':>6}"]
        for size, r in co["rows"].items():
            lines.append(f"{size:>8} {r['ranges']:>7} {r['dma_GB/s']:>9.2f} {r['triton_GB/s']:>11.2f} "
                         f"{_num(r['triton_over_dma']):>10} {'ok' if r['bytes_ok'] else 'WRONG':>6}")
        lines.append(f"DMA at least as fast from {co['dma_from_bytes']} B ranges on")
    rows = [(sec, kind, report[sec][kind]) for sec in ("dma-interference", "triton-interference")
            if isinstance(report.get(sec), dict) and "error" not in report[sec] for kind in ("decode", "gemm")
            if kind in report[sec]]
    if rows:
        lines += ["", f"{'copies beside':20} {'compute':7} {'op ms alone':>11} {'op ms with':>10} {'slowdown':>9} "
                  f"{'copy GB/s with':>14} {'vs alone':>8}"]
        for sec, kind, r in rows:
            lines.append(f"{sec.split('-')[0]:20} {kind:7} {r['op_ms_alone']:>11.4f} {_num(r['op_ms_during'], '.4f'):>10} "
                         f"{_pct(r['slowdown_pct']):>9} {_num(r['copy_GB/s_during']):>14} {_num(r['copy_vs_alone']):>8}")
    rt = [(k, p, ok) for k in ("dma-roundtrip", "triton-roundtrip", "run-api") if isinstance(report.get(k), dict)
          and "error" not in report[k] for p, ok in report[k].items()]
    if rt:
        lines.append("\nround trips: " + ", ".join(f"{k.split('-')[0]} {p} {'ok' if ok else 'MISMATCH'}" for k, p, ok in rt))
    lines += _new_tables(report)
    return "\n".join(lines)


def _ok(row: dict[str, Any]) -> str:
    return "ok" if row.get("bytes_ok") else "WRONG"


def _new_tables(report: dict[str, Any]) -> list[str]:
    """The tables of the CUDA-path, copy-flag, layer-wise, C32 and close sections."""
    lines: list[str] = []
    apis = _section(report, "cuda-apis")
    if apis:
        lines += ["", f"{'cuda path':13} {'target':10} {'plan':26} {'api':18} {'ranges':>7} {'GB/s':>8} {'submit ms':>10} "
                  f"{'bytes':>6} round trips"]
        for role, row in apis.items():
            trips = "ok" if all(row["round_trips"].values()) else "MISMATCH"
            for name, r in row.items():
                if isinstance(r, dict) and "GB/s" in r:
                    lines.append(f"{role:13} {row['target']:10} {name:26} {r['api']:18} {r['ranges']:>7} "
                                 f"{r['GB/s']['median']:>8.2f} {r['submit_ms']['median']:>10.3f} {_ok(r):>6} {trips}")
    flags = _section(report, "copy-flags")
    if flags:
        lines += ["", f"{'copy flags':34} {'flags':6} {'max range':>10} {'GB/s':>7} {'decode':>8} {'copies':>7} "
                  f"{'gemm':>8} {'copies':>7} {'bytes':>6}"]
        for name, r in flags.items():
            b = r["beside"]
            lines.append(f"{name:34} {','.join(r['flags']):6} {r['max_range_bytes']:>10} {r['GB/s']['median']:>7.2f} "
                         f"{_pct(b['decode']['slowdown_pct']):>8} {_num(b['decode']['copy_GB/s_during']):>7} "
                         f"{_pct(b['gemm']['slowdown_pct']):>8} {_num(b['gemm']['copy_GB/s_during']):>7} {_ok(r):>6}")
    lw = _section(report, "layerwise")
    if lw:
        lines += ["", f"{'layer-wise':11} {'calls':>5} {'GB/s':>7} {'1 call':>7} {'submit':>8} {'1 call':>8} "
                  f"{'1st layer':>9} {'all':>8} {'lag med':>8} {'lag max':>8} {'fwd pipe':>9} {'fwd after':>9}"]
        for pattern in ("contiguous", "fragmented"):
            r = lw.get(pattern)
            if not r:
                continue
            pl, oc, lag = r["per layer"], r["one call"], r.get("consumer_lag_ms")
            tail = ("(no device events)" if lag is None else
                    f"{r['layer_done_ms'][0]:>9.3f} {r['layer_done_ms'][-1]:>8.3f} {lag['median']:>8.4f} {lag['max']:>8.4f} "
                    f"{r['forward_pipelined_ms']:>9.3f} {r['forward_after_restore_ms']:>9.3f}")
            lines.append(f"{pattern:11} {pl['calls']:>5} {pl['GB/s']['median']:>7.2f} {oc['GB/s']['median']:>7.2f} "
                         f"{pl['submit_ms']['median']:>8.3f} {oc['submit_ms']['median']:>8.3f} {tail}")
    for sec in ("c32", "c32-triton"):
        rows = _section(report, sec)
        if not rows:
            continue
        lines += ["", f"{sec + ' restore plan':42} {'api':18} {'ranges':>8} {'GB/s':>7} {'submit ms':>10} {'vs 1 copy':>9} "
                  f"{'vs per-block':>12} {'bytes':>6}"]
        for name, r in rows.items():
            if not isinstance(r, dict) or name in ("shape",):
                continue
            if "error" in r:
                lines.append(f"{name:42} ERROR {r['error'][:80]}")
                continue
            lines.append(f"{name:42} {r['api']:18} {r['ranges']:>8} {r['GB/s']['median']:>7.2f} "
                         f"{r['submit_ms']['median']:>10.3f} "
                         f"{_num(r.get('vs_one_copy')):>9} {_num(r.get('vs_per_block_GB/s')):>12} {_ok(r):>6}")
    close = _section(report, "executor-close")
    if close:
        lines.append(f"\nexecutor close: torch works after it: {close['torch_after_close']}")
    return lines


def _section(report: dict[str, Any], name: str) -> dict[str, Any]:
    r = report.get(name)
    return r if isinstance(r, dict) and "error" not in r else {}


def _bytes_flags(obj: Any) -> list[bool]:
    """Every ``bytes_ok`` and every round-trip verdict under ``obj`` (the new sections' rows)."""
    if not isinstance(obj, dict):
        return []
    out = [bool(v) for k, v in obj.items() if k == "bytes_ok"]
    out += [bool(v) for v in obj.get("round_trips", {}).values()]
    for k, v in obj.items():
        if k != "round_trips":
            out += _bytes_flags(v)
    return out


def bytes_all_ok(report: dict[str, Any]) -> bool:
    """False if any round trip or checked run got wrong bytes (sections that failed count separately)."""
    ok = all(v for k in ("dma-roundtrip", "triton-roundtrip", "run-api") if "error" not in report.get(k, {})
             for v in report.get(k, {}).values())
    ok &= all(r.get("bytes_ok", True) for r in report.get("bandwidth", {}).values() if isinstance(r, dict))
    ok &= all(r.get("bytes_ok", True) for r in report.get("crossover", {}).get("rows", {}).values())
    ok &= all(f for k in ("cuda-apis", "copy-flags", "layerwise", "c32", "c32-triton") for f in _bytes_flags(report.get(k)))
    return ok


def run_check(device: str, out: Path | None, skip: set[str] = frozenset(), cuda_stand_in: Any = None,
              sizes: Sizes | None = None) -> dict[str, Any]:
    """Run every section not in ``skip`` on ``device`` ("cuda" or "cpu"); returns the report (also written to
    ``out`` after every section)."""
    import torch
    dev = Device(torch, device == "cuda")
    ck = Check(dev, sizes or (GPU if dev.gpu else CPU), out, cuda_stand_in,
               report={"sections": {}, "skipped": sorted(skip)})
    faulthandler.enable()
    for name, fn in SECTIONS:
        if name in skip:
            continue
        print(f"\n## {name}", flush=True)
        faulthandler.dump_traceback_later(120, exit=False)  # a hung section prints where it hangs
        ck.section(name, fn)
        faulthandler.cancel_dump_traceback_later()
    for ex in (ck.executors or {}).values():
        with contextlib.suppress(Exception):
            ex.close()
    ck.report["bytes_ok"] = bytes_all_ok(ck.report)
    ck.save()
    print(summary(ck.report))
    return ck.report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dry-run", action="store_true", help="plan everything on the CPU, print the counts and stop")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                    help="cpu: every section at small sizes on the CPU (plumbing and bytes only)")
    ap.add_argument("--out", type=Path, default=None, help="write the report as JSON here (after every section)")
    ap.add_argument("--skip", default="", help=f"comma list of sections to skip: {','.join(n for n, _ in SECTIONS)}")
    args = ap.parse_args(argv)
    if args.dry_run:
        dry_run(args.out)
        return 0
    skip = set(filter(None, args.skip.split(",")))
    unknown = skip - {n for n, _ in SECTIONS}
    if unknown:
        ap.error(f"--skip: unknown sections {sorted(unknown)}")
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read by triton at import, which comes later
    else:
        import torch
        if not torch.cuda.is_available():
            print("gpu_check: no GPU visible to torch; use --device cpu or --dry-run", file=sys.stderr)
            return 2
    report = run_check(args.device, args.out, skip)
    failed = [k for k, v in report["sections"].items() if v["status"] != "ok"]
    return 1 if not report["bytes_ok"] else (3 if failed else 0)


if __name__ == "__main__":
    sys.exit(main())
