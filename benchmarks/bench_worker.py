"""The offload worker's host cost per job and its CPU throughput, against baselines measured in the same run.

Shapes: 118 KV tensors of 256-byte pages (host cost, not bandwidth); jobs of 256 and 2,048 blocks; host chunks
of k = 1 and 4 blocks; contiguous, runs of 8 and fragmented block lists; stores and loads. For each: the
caller's host time per job (``submit_*``: checks, planning, queueing or issuing; median over R jobs, each
waited for before the next so no copy competes), beside planning the same job alone (the baseline: what
submit adds is the worker's own share), and jobs per second end to end (R jobs submitted back to
back, then waited for).
Executors: none (copies nothing: the worker's own host cost with no copy thread competing for the GIL), the
NumPy executor on the worker's background threads, and (``--shim``) the CUDA batch executor
on the C driver shim, whose copies are synchronous memmoves on the caller's thread.

Throughput: 256-block jobs of 4 KiB pages through the worker (NumPy executor; submit + wait, best of R)
against one memcpy (``np.copyto``, best of R) of the same number of bytes; ratio = memcpy time / worker time.

    python benchmarks/bench_worker.py [--reps 8] [--shim] [--quick]

``--quick``: a smoke run (3 reps, 256-block jobs, contiguous and fragmented ids only); its figures are not for notes.
"""
from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from kvxfer.executors import CompletedTransfer, Executor
from kvxfer.offload import DeviceKV, HostTier, KVTensor, create_worker
from kvxfer.planner import Buffer, Location

TENSORS = 118


class NoCopy(Executor):
    """An executor that copies nothing and finishes at once: the worker's own host cost, with no copy running.
    It binds like any executor (once, at worker construction) and accepts any memory, since it touches none."""

    name = "none"
    synchronous = True  # finished on return, like the NumPy executor: the worker runs it on a lane thread

    def check_memory(self, buf: Any, mem: Any) -> None:
        pass

    def run(self, plan: Any, bindings: Any, stream: Any = None, after: Any = None) -> Any:
        return CompletedTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls, elapsed_s=0.0)


def ids(pattern: str, n: int, space: int, run: int, rng: np.random.Generator) -> np.ndarray:
    """``n`` ids out of ``space``: one ascending run, runs of ``run`` at shuffled places, or no two adjacent."""
    if pattern == "contiguous":
        return np.arange(n)
    if pattern == "runs8":
        slots = rng.permutation(space // run)[:-(-n // run)] * run
        return (slots[:, None] + np.arange(run)).ravel()[:n]
    return rng.permutation(space // 2)[:n] * 2


def make_worker(n: int, k: int, page: int, executor: Any, tensors: int = TENSORS) -> tuple[Any, np.ndarray]:
    """A worker over ``tensors`` KV tensors of ``2 n`` blocks of ``page`` bytes in one device buffer (host memory
    standing for it), a host tier of as many blocks in chunks of ``k``; and the device array."""
    blocks = 2 * n
    dev = np.random.default_rng(0).integers(0, 256, tensors * blocks * page, dtype=np.uint8)
    kv = tuple(KVTensor(name=f"t{i}", buffer="gpu", page_bytes=page, byte_offset=i * blocks * page)
               for i in range(tensors))
    device = DeviceKV((Buffer(name="gpu", nbytes=dev.nbytes, location=Location.DEVICE),), kv, {"gpu": dev})
    w = create_worker(device, HostTier(num_chunks=blocks // k, blocks_per_chunk=k, row_align_bytes=1, pin=False),
                      executor, regions_per_layer=None)
    return w, dev


def bench_jobs(n: int, k: int, pattern: str, direction: str, executor: Any, reps: int, page: int = 256) -> dict[str, Any]:
    w, _ = make_worker(n, k, page, executor)
    rng = np.random.default_rng(1)
    jobs = [(ids(pattern, n, 2 * n, 8, rng), ids(pattern, n // k, 2 * n // k, max(8 // k, 1), rng)) for _ in range(reps)]
    submit = w.submit_store if direction == "d2h" else w.submit_load
    # warm-up (layout caches, executor first use)
    d, h = jobs[0]
    submit(0, d, h) if direction == "d2h" else submit(0, h, d)
    w.wait([0])
    w.get_finished()
    host = []  # the caller's time in submit, with the lanes idle (no copy thread competing for the GIL)
    for j, (d, h) in enumerate(jobs, start=1):
        s = time.perf_counter()
        submit(j, d, h) if direction == "d2h" else submit(j, h, d)
        host.append(time.perf_counter() - s)
        w.wait([j])
    res = w.get_finished()
    from kvxfer.planner import BlockMapping, PlanOptions, plan_transfer
    plan = []  # baseline in the same run: planning the same jobs alone (what submit adds is the worker's share)
    for d, h in jobs:
        s_ids, d_ids = (d, h) if direction == "d2h" else (h, d)
        s = time.perf_counter()
        plan_transfer(w.layout, BlockMapping(direction=direction, src_ids=s_ids, dst_ids=d_ids, group_sizes=(n,)),
                      w.target, PlanOptions())
        plan.append(time.perf_counter() - s)
    t0 = time.perf_counter()  # end to end: back to back, then wait for all
    for j, (d, h) in enumerate(jobs, start=reps + 1):
        submit(j, d, h) if direction == "d2h" else submit(j, h, d)
    w.wait(range(reps + 1, 2 * reps + 1))
    total = time.perf_counter() - t0
    res += w.get_finished()
    w.shutdown()
    assert all(r.success for r in res)
    return dict(blocks=n, k=k, pattern=pattern, direction=direction, host_us=1e6 * float(np.median(host)),
                plan_us=1e6 * float(np.median(plan)),
                jobs_s=reps / total, ranges=res[0].num_ranges, mib=res[0].nbytes / 2**20)


def bench_throughput(pattern: str, direction: str, reps: int) -> dict[str, Any]:
    """Best of ``reps`` for one job (submit + wait) against the best of ``reps`` memcpys of its bytes, both
    into memory touched beforehand (the machine is shared: the minimum is the least disturbed run)."""
    n, page = 256, 4096
    w, _ = make_worker(n, 1, page, {"kind": "numpy"})
    w.host[:] = 1  # first touch outside the timing, as for the memcpy destination
    rng = np.random.default_rng(2)
    jobs = [(ids(pattern, n, 2 * n, 8, rng), ids(pattern, n, 2 * n, 8, rng)) for _ in range(reps + 1)]
    submit = w.submit_store if direction == "d2h" else w.submit_load
    times = []
    for j, (d, h) in enumerate(jobs):
        t0 = time.perf_counter()
        submit(j, d, h) if direction == "d2h" else submit(j, h, d)
        w.wait([j])
        times.append(time.perf_counter() - t0)
    nbytes = w.get_finished()[0].nbytes
    w.shutdown()
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    copies = []
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    worker_s, memcpy_s = min(times[1:]), min(copies[1:])
    return dict(pattern=pattern, direction=direction, mib=nbytes / 2**20, worker_gbs=nbytes / worker_s / 1e9,
                memcpy_gbs=nbytes / memcpy_s / 1e9, ratio=memcpy_s / worker_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--reps", type=int, default=8)
    p.add_argument("--shim", action="store_true", help="also the CUDA batch executor on the C driver shim (needs cc)")
    p.add_argument("--executors", default="none,numpy", help="comma list of: none (no copies), numpy")
    p.add_argument("--quick", action="store_true", help="smoke run: 3 reps, 256-block jobs, two id patterns")
    a = p.parse_args()
    sizes, patterns = ((256,), ("contiguous", "fragmented")) if a.quick else ((256, 2048), ("contiguous", "runs8", "fragmented"))
    if a.quick:
        a.reps = min(a.reps, 3)
    known = {"none": NoCopy, "numpy": {"kind": "numpy"}}
    executors: list[tuple[str, Any]] = [(e, known[e]) for e in a.executors.split(",") if e]
    if a.shim:
        import sys
        import tempfile
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, for tests.shims
        from kvxfer.executors import CudaBatchExecutor
        from tests.shims.build import build  # the test shim: a host-memory stand-in for the driver
        from tests.shims.runtime import ShimCudaRuntime
        lib = str(build("fake_cuda", tempfile.mkdtemp()))
        executors.append(("cuda-shim", lambda: CudaBatchExecutor(ShimCudaRuntime(lib, 13000))))
    print(f"{'executor':10} {'blocks':>6} {'k':>2} {'pattern':11} {'dir':4} {'ranges':>7} {'MiB':>6} "
          f"{'host us/job':>11} {'plan us':>8} {'jobs/s':>8}")
    for name, ex in executors:
        for n in sizes:
            for k in (1, 4):
                for pattern in patterns:
                    for direction in ("d2h", "h2d"):
                        r = bench_jobs(n, k, pattern, direction, ex, a.reps)
                        print(f"{name:10} {n:6d} {k:2d} {pattern:11} {direction:4} {r['ranges']:7d} {r['mib']:6.1f} "
                              f"{r['host_us']:11.0f} {r['plan_us']:8.0f} {r['jobs_s']:8.1f}", flush=True)
    print("\nthroughput, 118 x 256 blocks x 4 KiB per job (NumPy executor) vs one memcpy of the same bytes")
    print(f"{'pattern':11} {'dir':4} {'MiB/job':>7} {'worker GB/s':>11} {'memcpy GB/s':>11} {'ratio':>6}")
    for pattern in patterns:
        for direction in ("d2h", "h2d"):
            r = bench_throughput(pattern, direction, a.reps)
            print(f"{pattern:11} {direction:4} {r['mib']:7.1f} {r['worker_gbs']:11.2f} {r['memcpy_gbs']:11.2f} "
                  f"{r['ratio']:6.2f}", flush=True)


if __name__ == "__main__":
    main()
