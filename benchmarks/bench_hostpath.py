"""Per-job host cost of kvxfer (plan + lowering to addresses on a bound executor) against a vLLM-worker-style
per-job descriptor build, measured in the same run. Nothing here is asserted; see benchmarks/NOTES.md.

    .venv/bin/python benchmarks/bench_hostpath.py            # full table (about 1-2 minutes)
    .venv/bin/python benchmarks/bench_hostpath.py --quick    # fewer samples, same shapes

Columns (milliseconds per job, medians):
- plan: ``plan_transfer`` from the scheduler's numpy id arrays (the dict hot path; layout built once, outside
  the timing);
- lower: the executor's per-job work before the first copy, on memory bound once (NumPy: the offsets read once
  into its own memory and bounded; CUDA batch on the C shim: every range bounded as turned into addresses, in
  reused descriptor arrays);
- baseline: the per-job descriptor fill of vLLM's CPU-offload worker: vLLM's own ``compute_sub_block_ptrs``, called
  per tensor as its worker calls it, when vLLM is importable (``.venv-vllm/bin/python``), else
  ``vllm_style_descriptors``, written from its description (``--baseline`` picks);
- ratio: (plan + lower) / baseline; targets: <= 0.5 contiguous and runs of 8, <= 0.8 fragmented.

Every shape is checked before timing: the plan's ranges, expanded to pages, are exactly the baseline's
descriptors (same addresses and sizes), so both sides describe the same copies.

Pages are ``--page-bytes`` (default 256) so that the buffers of a C32-sized layout fit in memory: no cost
measured here depends on the page size (only ids, regions and ranges are computed), and nothing is copied.
"""
from __future__ import annotations

import argparse
import itertools
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the C driver shim's builder lives with the tests
    sys.path.insert(0, str(ROOT))

from kvxfer.planner import (  # noqa: E402
    BlockMapping,
    Buffer,
    Direction,
    Layout,
    Location,
    Placement,
    Region,
    Target,
    cuda_version,
    plan_transfer,
)

TARGET = Target(platform="cuda", runtime_version=cuda_version(13, 0))
NUM_TENSORS = 118
C32_BLOCKS = 16128


# ---- the layout: one device tensor and one host tensor per KV tensor (vLLM's per-tensor host allocation) ----
def worker_layout(num_tensors: int, gpu_blocks: int, cpu_chunks: int, page_bytes: int, k: int,
                  stated: bool = False) -> Layout:
    """``num_tensors`` KV tensors: device tensor t holds ``gpu_blocks`` pages; host tensor t holds
    ``cpu_chunks`` rows of ``k`` pages (vLLM's ``torch.zeros(num_chunks, k*page)``). ``stated``: every
    placement states its block count, as the offload worker's layouts do."""
    buffers, regions = [], []
    dev_n, host_n = (gpu_blocks, cpu_chunks * k) if stated else (None, None)
    for t in range(num_tensors):
        buffers.append(Buffer(name=f"gpu.kv{t}", nbytes=gpu_blocks * page_bytes, location=Location.DEVICE))
        buffers.append(Buffer(name=f"cpu.kv{t}", nbytes=cpu_chunks * k * page_bytes, location=Location.HOST))
        regions.append(Region(name=f"kv{t}", page_bytes=page_bytes, device=Placement(buffer=f"gpu.kv{t}", num_blocks=dev_n),
                              host=Placement(buffer=f"cpu.kv{t}", blocks_per_chunk=k, num_blocks=host_n)))
    return Layout(buffers=tuple(buffers), regions=tuple(regions))


@dataclass(frozen=True)
class Job:
    """One transfer as the scheduler hands it over: device block ids, host chunk ids, k, skip, direction."""

    direction: Direction
    gpu_ids: np.ndarray
    cpu_chunks: np.ndarray
    k: int
    skip: int = 0

    @property
    def count(self) -> int:
        return len(self.gpu_ids)


def make_job(pattern: str, n: int, k: int, direction: str, seed: int = 0) -> tuple[Job, int, int]:
    """A job of ``n`` blocks; returns it with the device blocks and host chunks the layout needs.

    contiguous: one run on both sides; runs8: runs of 8 blocks (8/k chunks) at shuffled places;
    fragmented: no two blocks adjacent on the device side, and no two chunks adjacent on the host side.
    """
    rng = np.random.default_rng(seed)
    chunks = -(-n // k)
    gpu_blocks, cpu_chunks = 2 * n + 8, 2 * chunks + 8
    if pattern == "contiguous":
        gpu = np.arange(n) + 3
        cpu = np.arange(chunks) + 5
    elif pattern == "runs8":
        runs, per = -(-n // 8), max(8 // k, 1)
        gpu = (rng.permutation(gpu_blocks // 8)[:runs, None] * 8 + np.arange(8)).ravel()[:n]
        cpu = (rng.permutation(cpu_chunks // per)[:runs, None] * per + np.arange(per)).ravel()[:chunks]
    elif pattern == "fragmented":
        gpu = rng.permutation(gpu_blocks // 2)[:n] * 2
        cpu = rng.permutation(cpu_chunks // 2)[:chunks] * 2
    else:
        raise ValueError(f"pattern = {pattern!r}: expected contiguous, runs8 or fragmented")
    return Job(Direction(direction), gpu.astype(np.int64), cpu.astype(np.int64), k), gpu_blocks, cpu_chunks


# ---- the baseline, written from the description of vLLM's CPU-offload worker ----------------------------
@dataclass(frozen=True)
class TensorAddrs:
    """What the worker resolves once at start-up, per KV tensor: base addresses, row stride, page size."""

    gpu_base: int
    cpu_base: int
    cpu_row_stride: int
    page_bytes: int
    k: int
    group: int = 0


class DescriptorPool:
    """The worker's pooled descriptor buffers: three int64 arrays (src, dst, size) reused across jobs."""

    def __init__(self) -> None:
        self.src = self.dst = self.size = np.zeros(0, dtype=np.int64)

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if len(self.src) < n:
            self.src, self.dst, self.size = (np.empty(n, dtype=np.int64) for _ in range(3))
        return self.src[:n], self.dst[:n], self.size[:n]


def vllm_style_descriptors(tensors: list[TensorAddrs], job: Job, pool: DescriptorPool, group_sizes: list[int],
                           block_indices: list[int], num_writers: int = 1,
                           writer_index: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One descriptor per page per tensor, as vLLM's worker fills them each step (nothing merged).

    A Python loop over groups and tensors; per tensor, numpy broadcasting gives the host sub-page addresses
    ``base + chunk*row_stride + j*sub_page``, flattened and sliced ``[skip:skip+count]``; device pages are
    ``base + block*page``. On stores, writer rotation filters pages afterwards.
    """
    parts: list[tuple[np.ndarray, np.ndarray, int]] = []
    gpu_at = cpu_at = 0
    for g, (count, start) in enumerate(zip(group_sizes, block_indices)):
        k = next((t.k for t in tensors if t.group == g), 1)
        skip = start % k
        n_chunks = -(-(skip + count) // k)
        gpu_ids = job.gpu_ids[gpu_at:gpu_at + count]
        cpu_ids = job.cpu_chunks[cpu_at:cpu_at + n_chunks]
        gpu_at, cpu_at = gpu_at + count, cpu_at + n_chunks
        keep = None
        if job.direction is Direction.D2H and num_writers > 1:
            canonical = (cpu_ids[:, None] * k + np.arange(k)).ravel()[skip:skip + count]
            keep = canonical % num_writers == writer_index
        for t in tensors:
            if t.group != g:
                continue
            sub = t.page_bytes
            cpu = (t.cpu_base + cpu_ids[:, None] * t.cpu_row_stride + np.arange(t.k) * sub).ravel()[skip:skip + count]
            gpu = t.gpu_base + gpu_ids * t.page_bytes
            if keep is not None:
                cpu, gpu = cpu[keep], gpu[keep]
            parts.append((gpu, cpu, t.page_bytes))
    n = sum(len(p[0]) for p in parts)
    src, dst, size = pool.take(n)
    at = 0
    load = job.direction is Direction.H2D
    for gpu, cpu, page in parts:
        m = len(gpu)
        src[at:at + m], dst[at:at + m] = (cpu, gpu) if load else (gpu, cpu)
        size[at:at + m] = page
        at += m
    return src, dst, size


def run_based_descriptors(tensors: list[TensorAddrs], job: Job) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The comparator for contiguous jobs (k = 1): find id runs where both sides advance by one, then emit one
    descriptor per run per tensor by broadcasting (what a hand-written coalescing build does)."""
    s, d = (job.cpu_chunks, job.gpu_ids) if job.direction is Direction.H2D else (job.gpu_ids, job.cpu_chunks)
    brk = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts = np.concatenate(([0], brk))
    lengths = np.diff(np.append(starts, len(s)))
    gpu_base = np.array([t.gpu_base for t in tensors], dtype=np.int64)[:, None]
    cpu_base = np.array([t.cpu_base for t in tensors], dtype=np.int64)[:, None]
    page = np.array([t.page_bytes for t in tensors], dtype=np.int64)[:, None]
    gpu_side, cpu_side = (d, s) if job.direction is Direction.H2D else (s, d)
    gpu = (gpu_base + gpu_side[starts] * page).ravel()
    cpu = (cpu_base + cpu_side[starts] * page).ravel()
    size = (page * lengths).ravel()
    return (cpu, gpu, size) if job.direction is Direction.H2D else (gpu, cpu, size)


# ---- kvxfer: planning and lowering, each behind one adapter ----------------------------------------------
def plan_job(layout: Layout, job: Job) -> Any:
    """kvxfer's per-job planning from the scheduler's arrays: the hot path (a dict of numpy id arrays, checked
    but not copied into a BlockMapping)."""
    s, d = (job.cpu_chunks, job.gpu_ids) if job.direction is Direction.H2D else (job.gpu_ids, job.cpu_chunks)
    mapping: dict[str, Any] = {"direction": job.direction, "src_ids": s, "dst_ids": d}
    if job.k > 1 or job.skip:
        mapping |= {"group_sizes": (job.count,), "group_starts": (job.skip,)}
    return plan_transfer(layout, mapping, TARGET)


def plan_job_mapping(layout: Layout, job: Job) -> Any:
    """The same plan through a BlockMapping built per job (ids copied into an immutable value)."""
    s, d = (job.cpu_chunks, job.gpu_ids) if job.direction is Direction.H2D else (job.gpu_ids, job.cpu_chunks)
    grouped = job.k > 1 or job.skip
    mapping = BlockMapping(direction=job.direction, src_ids=s, dst_ids=d,
                           group_sizes=(job.count,) if grouped else None,
                           group_starts=(job.skip,) if grouped else None)
    return plan_transfer(layout, mapping, TARGET)


def bound_lowering(executor: Any, layout: Layout, bindings: dict[str, Any]) -> tuple[str, Callable[[Any], Any]]:
    """(how, lower): ``lower(plan)`` does an executor's per-job host work before its first copy.

    Memory is bound here, once (``executor.bind``). Executors that copy through views of the bound memory
    (NumPy) lower to offsets read once into memory of their own (``bound.offsets(plan)``); the others turn every
    range into absolute addresses in reused descriptor arrays (``bound.descriptors(plan, arrays.reserve(n))``,
    as the DMA executors do). That is what ``run`` does before its first copy. (The BEFORE table in NOTES.md was
    measured on the code before bind existed, where every run resolved and checked every buffer.)
    """
    from kvxfer.executors import NumpyExecutor
    from kvxfer.executors._lowering import DescriptorArrays

    bound = executor.bind(layout, bindings)
    if isinstance(executor, NumpyExecutor):
        return "bind() once, then bound.offsets(plan) per job (views: offsets read once, no addresses)", bound.offsets
    arrays = DescriptorArrays()  # reused address and size arrays, as the DMA executors keep
    return ("bind() once, then bound.descriptors(plan, arrays) per job",
            lambda plan: bound.descriptors(plan, arrays.reserve(plan.num_ranges)))


def vllm_worker() -> Any:
    """vLLM's own per-tensor descriptor fill (``compute_sub_block_ptrs`` of its CPU-offload worker), when vLLM is
    importable (run this script with .venv-vllm's python), else None."""
    try:
        from vllm.v1.kv_offload.cpu import gpu_worker  # type: ignore[import-not-found, unused-ignore]
    except Exception:
        return None
    return gpu_worker.compute_sub_block_ptrs


def vllm_descriptors(fill: Any, views: list[tuple[Any, Any]], job: Job, out: tuple[np.ndarray, np.ndarray, np.ndarray],
                     page: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One job's descriptors through vLLM's own fill, as its ``_fill_direct_ops`` calls it: per tensor, the
    source and destination pointers (``fill(ids, blocks_per_chunk, output, tensor, skip)``) and the sizes.
    ``views``: per KV tensor, (device tensor ``[blocks, page]``, host tensor ``[chunks, k * page]``)."""
    load = job.direction is Direction.H2D
    src_ids, dst_ids = (job.cpu_chunks, job.gpu_ids) if load else (job.gpu_ids, job.cpu_chunks)
    src_k, dst_k = (job.k, 1) if load else (1, job.k)
    n = job.count
    src, dst, size = (a[:n * len(views)] for a in out)
    at = 0
    for gpu, cpu in views:
        fill(src_ids, src_k, src[at:at + n], cpu if load else gpu, job.skip if load else 0)
        fill(dst_ids, dst_k, dst[at:at + n], gpu if load else cpu, 0 if load else job.skip)
        size[at:at + n] = page
        at += n
    return src, dst, size


def executors(shim_dir: Path) -> list[tuple[str, Any]]:
    """The NumPy executor, and the CUDA batch executor on the C driver shim (host memory stands in for GPU)."""
    from kvxfer.executors import NumpyExecutor

    out: list[tuple[str, Any]] = [("numpy", NumpyExecutor())]
    try:
        from kvxfer.executors import CudaBatchExecutor
        from tests.shims.build import build, compiler

        if compiler() is None:
            raise RuntimeError("no C compiler for the driver shim")
        lib = build("fake_cuda", shim_dir)
        from tests.shims.runtime import ShimCudaRuntime  # the shim runtime the tests inject through the constructor

        runtime: Any = ShimCudaRuntime(lib, cuda_version(13, 0))
        out.append(("cuda-shim", CudaBatchExecutor(runtime)))
    except Exception as e:  # report, and measure what can be measured
        print(f"# CUDA shim executor skipped: {e}", file=sys.stderr)
    return out


# ---- timing and checks -------------------------------------------------------------------------------------
def median_times(fns: dict[str, Callable[[], Any]], repeat: int, min_s: float) -> dict[str, float]:
    """Per function, the median (``name``) and the smallest (``name_min``) over ``repeat`` samples of its mean
    time when looped for ``min_s``, in ms.

    The functions are sampled in turn (one sample of each, then the next round), so that load from other
    processes on a shared machine falls on all of them alike and the ratios stay comparable. The smallest
    sample of each gives a second ratio that no slow phase of the machine can favour either way.
    """
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for fn in fns.values():
        fn()  # warm-up
    for _ in range(repeat):
        for name, fn in fns.items():
            loops, t0 = 0, time.perf_counter()
            while True:
                fn()
                loops += 1
                t = time.perf_counter() - t0
                if t >= min_s:
                    break
            samples[name].append(t / loops)
    out = {name: float(np.median(v)) * 1e3 for name, v in samples.items()}
    return out | {f"{name}_min": float(np.min(v)) * 1e3 for name, v in samples.items()}


def memory_for(layout: Layout) -> tuple[dict[str, np.ndarray], list[TensorAddrs]]:
    """Zeroed host arrays for every buffer (untouched pages cost no memory) and the per-tensor addresses."""
    mem = {b.name: np.zeros(b.nbytes, dtype=np.uint8) for b in layout.buffers}
    tensors = []
    for r in layout.regions:
        k = r.host.blocks_per_chunk
        tensors.append(TensorAddrs(mem[r.device.buffer].ctypes.data, mem[r.host.buffer].ctypes.data,
                                   r.stride("host"), r.page_bytes, k, r.group))
    return mem, tensors


def pages_of(src: np.ndarray, dst: np.ndarray, size: np.ndarray, page: int) -> np.ndarray:
    """Descriptors expanded to (src, dst) per page, sorted: equal for two builds of the same copies."""
    n = (size // page).astype(np.int64)
    step = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    pairs = np.stack((np.repeat(src, n) + step * page, np.repeat(dst, n) + step * page), axis=1)
    return pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]


def plan_addresses(plan: Any, mem: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    base = np.array([mem[b.name].ctypes.data for b in plan.buffers], dtype=np.int64)
    return (base[plan.src_buf] + plan.src_offset.astype(np.int64), base[plan.dst_buf] + plan.dst_offset.astype(np.int64),
            plan.nbytes.astype(np.int64))


def check_same_copies(a: tuple[np.ndarray, ...], b: tuple[np.ndarray, ...], page: int, what: str) -> None:
    if int(a[2].sum()) != int(b[2].sum()) or not np.array_equal(pages_of(*a, page), pages_of(*b, page)):
        raise SystemExit(f"{what}: kvxfer's plan and the baseline describe different copies")


# ---- the shapes ------------------------------------------------------------------------------------------------
@dataclass
class Run:
    """What every shape is measured with: the executors, the sampling, the page size and the tensor count."""

    execs: list[tuple[str, Any]]
    repeat: int
    min_s: float
    page: int
    tensors: int
    how: dict[str, str] = field(default_factory=dict)  # executor name -> which lowering was measured
    vllm: Any = None  # vLLM's own descriptor fill, as the baseline (None: the description-based one)

    def lowering(self, layout: Layout, mem: dict[str, np.ndarray], plan: Any) -> dict[str, Callable[[], Any]]:
        fns = {}
        for name, ex in self.execs:
            self.how[name], lower = bound_lowering(ex, layout, mem)
            fns[f"lower_{name}"] = lambda lower=lower: lower(plan)
        return fns


def job_row(run: Run, n: int, k: int, pattern: str, direction: str) -> dict[str, Any]:
    """One shape: checked for equal copies, then plan, lowering per executor and the baseline, sampled in turn."""
    job, gpu_blocks, cpu_chunks = make_job(pattern, n, k, direction, seed=n + k)
    layout = worker_layout(run.tensors, gpu_blocks, cpu_chunks, run.page, k)
    layout.prepare()  # per-layout work is done once, outside the per-job cost
    mem, tensors = memory_for(layout)
    fns: dict[str, Callable[[], Any]] = {"plan": lambda: plan_job(layout, job), "baseline": baseline(run, layout, mem,
                                                                                                     tensors, job)}
    plan = plan_job(layout, job)
    descriptors = fns["baseline"]()
    check_same_copies(plan_addresses(plan, mem), descriptors, run.page, f"{n} blocks k={k} {pattern} {direction}")
    ms = median_times(fns | run.lowering(layout, mem, plan), run.repeat, run.min_s)
    return ({"case": f"{run.tensors}x{n} k={k} {pattern} {direction}", "descriptors": len(descriptors[0]),
             "ranges": plan.num_ranges} | {f"{key}_ms": v for key, v in ms.items()})


def baseline(run: Run, layout: Layout, mem: dict[str, np.ndarray], tensors: list[TensorAddrs],
             job: Job) -> Callable[[], Any]:
    """The baseline's per-job fill: vLLM's own (``run.vllm``), on torch views of the same memory, into pooled
    int64 arrays as its worker keeps; else the description-based ``vllm_style_descriptors``."""
    if run.vllm is None:
        pool = DescriptorPool()
        return lambda: vllm_style_descriptors(tensors, job, pool, [job.count], [job.skip])
    import torch

    views = [(torch.from_numpy(mem[r.device.buffer]).view(-1, r.page_bytes),
              torch.from_numpy(mem[r.host.buffer]).view(-1, r.stride("host"))) for r in layout.regions]
    out = tuple(np.empty(job.count * len(views), np.int64) for _ in range(3))
    page = layout.regions[0].page_bytes
    return lambda: vllm_descriptors(run.vllm, views, job, out, page)  # type: ignore[arg-type]


def job_rows(run: Run, sizes: tuple[int, ...]) -> list[dict[str, Any]]:
    return [job_row(run, n, k, pattern, direction)
            for n, k, pattern, direction in itertools.product(sizes, (1, 4), ("contiguous", "runs8", "fragmented"),
                                                               ("h2d", "d2h"))]


def c32_rows(run: Run, blocks: int = C32_BLOCKS) -> list[dict[str, Any]]:
    """A C32-sized restore (118 x 16,128 blocks): fragmented lowering vs planning, and the contiguous plan vs a
    run-based coalescing build of the same descriptors."""
    rows = []
    for pattern in ("fragmented", "contiguous"):
        job, gpu_blocks, cpu_chunks = make_job(pattern, blocks, 1, "h2d", seed=32)
        layout = worker_layout(run.tensors, gpu_blocks, cpu_chunks, run.page, 1)
        layout.prepare()
        mem, tensors = memory_for(layout)
        plan = plan_job(layout, job)
        fns: dict[str, Callable[[], Any]] = {"plan": lambda: plan_job(layout, job)}
        if pattern == "contiguous":
            fns["plan_mapping"] = lambda: plan_job_mapping(layout, job)  # for comparison: ids copied into a value
            fns["runs"] = lambda: run_based_descriptors(tensors, job)
            check_same_copies(plan_addresses(plan, mem), fns["runs"](), run.page, "C32 contiguous")
        else:
            fns |= run.lowering(layout, mem, plan)
        ms = median_times(fns, run.repeat, run.min_s)
        rows.append({"case": f"{run.tensors}x{blocks} {pattern} h2d", "ranges": plan.num_ranges}
                    | {f"{key}_ms": v for key, v in ms.items()})
        del mem
    return rows


def format_tables(rows: list[dict[str, Any]], c32: list[dict[str, Any]], names: list[str], how: dict[str, str]) -> str:
    lines = ["per-job host cost, ms (median); ratio = (plan + lower) / baseline, lower is better; min-ratio: the same",
             "  ratio from each function's fastest sample",
             *(f"  lower[{n}]: {how.get(n, '?')}" for n in names)]
    head = f"{'case':<34}{'descs':>8}{'ranges':>8}{'plan':>8}"
    for n in names:
        head += f"{'lower:' + n:>16}{'total':>8}"
    head += f"{'baseline':>10}" + "".join(f"{'ratio:' + n:>16}" for n in names)
    head += "".join(f"{'min-ratio:' + n:>20}" for n in names)
    lines.append(head)
    for r in rows:
        line = f"{r['case']:<34}{r['descriptors']:>8}{r['ranges']:>8}{r['plan_ms']:>8.3f}"
        for n in names:
            line += f"{r[f'lower_{n}_ms']:>16.3f}{r['plan_ms'] + r[f'lower_{n}_ms']:>8.3f}"
        line += f"{r['baseline_ms']:>10.3f}"
        line += "".join(f"{(r['plan_ms'] + r[f'lower_{n}_ms']) / r['baseline_ms']:>16.2f}" for n in names)
        line += "".join(f"{(r['plan_min_ms'] + r[f'lower_{n}_min_ms']) / r['baseline_min_ms']:>20.2f}" for n in names)
        lines.append(line)
    lines += ["", "C32-sized restore (k=1, h2d)"]
    for r in c32:
        if "runs_ms" in r:
            lines.append(f"{r['case']:<34} ranges {r['ranges']:>8}  plan {r['plan_ms']:8.3f} ms  run-based build "
                         f"{r['runs_ms']:8.3f} ms  ratio plan/runs {r['plan_ms'] / r['runs_ms']:6.2f} (min-ratio "
                         f"{r['plan_min_ms'] / r['runs_min_ms']:.2f}; plan from a BlockMapping "
                         f"{r['plan_mapping_ms']:.3f} ms, ratio {r['plan_mapping_ms'] / r['runs_ms']:.2f})")
        else:
            parts = "  ".join(f"lower:{n} {r[f'lower_{n}_ms']:8.3f} ms (lower/plan {r[f'lower_{n}_ms'] / r['plan_ms']:5.2f}, "
                              f"min {r[f'lower_{n}_min_ms'] / r['plan_min_ms']:.2f})" for n in names)
            lines.append(f"{r['case']:<34} ranges {r['ranges']:>8}  plan {r['plan_ms']:8.3f} ms  {parts}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter samples (same shapes)")
    ap.add_argument("--page-bytes", type=int, default=256, help="page size of the layouts (costs do not depend on it)")
    ap.add_argument("--sizes", type=int, nargs="+", default=[256, 2048], help="job sizes in blocks")
    ap.add_argument("--tensors", type=int, default=NUM_TENSORS, help="KV tensors per layout")
    ap.add_argument("--c32-blocks", type=int, default=C32_BLOCKS, help="blocks of the C32-sized restore (0: skip it)")
    ap.add_argument("--baseline", choices=["vllm", "description"], default=None,
                    help="vllm: vLLM's own descriptor fill (needs vLLM: run with .venv-vllm's python); description: "
                         "the fill written from its description (default: vllm when importable)")
    args = ap.parse_args(argv)
    fill = vllm_worker() if args.baseline != "description" else None
    if args.baseline == "vllm" and fill is None:
        raise SystemExit("--baseline vllm: vLLM is not importable here (run with .venv-vllm/bin/python)")
    repeat, min_s = (3, 0.01) if args.quick else (7, 0.04)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        run = Run(executors(Path(tmp)), repeat, min_s, args.page_bytes, args.tensors, vllm=fill)
        rows = job_rows(run, tuple(args.sizes))
        c32 = c32_rows(run, args.c32_blocks) if args.c32_blocks else []
        for _, ex in run.execs:
            ex.close()
    source = f"vLLM {__import__('vllm').__version__} compute_sub_block_ptrs" if fill else "vllm_style_descriptors"
    print(f"# {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, numpy {np.__version__}, "
          f"page_bytes {args.page_bytes}, {'quick' if args.quick else 'full'} run, {time.perf_counter() - t0:.0f} s, "
          f"baseline: {source}")
    print(format_tables(rows, c32, [n for n, _ in run.execs], run.how))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
