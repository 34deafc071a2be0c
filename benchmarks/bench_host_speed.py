"""Host paths at hardware speed (issue 41), as same-run ratios:

1. CRC-32 of a 256 MiB buffer: ``offload.checksums.crc32`` (ISA-L where installed) against ``zlib.crc32``.
2. Worker-sized jobs of 4 KiB pages (8 layers, 128 MiB), planned and run on the NumPy executor: the batched copier
   (1 and 2 threads) and the paths without it (``copier=False``), against one ``np.copyto`` of as many bytes;
   idle, and beside a spinning Python thread; with a host buffer per layer and with vLLM's host rows.
3. File I/O: pages scattered in memory written to consecutive file pages with the POSIX executor: system calls
   issued per range.

    .venv/bin/python benchmarks/bench_host_speed.py [--reps 5] [--threads 1,2]
"""
from __future__ import annotations

import argparse
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

from kvxfer.executors import FileBinding, NumpyExecutor, PosixFileExecutor
from kvxfer.offload import checksums, tier_layout
from kvxfer.planner import BlockMapping, Buffer, Layout, Location, Placement, Region, plan_transfer

from timing import fastest_s  # this folder: on sys.path when the script runs

LAYERS, PAGE, BLOCKS = 8, 4096, 4096  # 8 x 4096 x 4 KiB = 128 MiB


def best(fn: Callable[[], object], reps: int) -> float:
    out = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def crc(reps: int) -> None:
    buf = np.random.default_rng(0).integers(0, 256, 256 << 20, dtype=np.uint8)
    z = best(lambda: zlib.crc32(buf.data), reps)
    f = best(lambda: checksums.crc32(buf.data), reps)
    name = checksums.crc32_impl()[0]
    print(f"crc32 256 MiB: zlib {z * 1e3:.1f} ms ({256 / 1024 / z:.2f} GB/s), {name} {f * 1e3:.1f} ms "
          f"({256 / 1024 / f:.2f} GB/s): {z / f:.2f}x zlib")


def layout(rows: bool = False) -> Layout:
    """8 layers of 4,096 pages of 4 KiB: a device buffer per layer; on the host a buffer per layer, or with
    ``rows`` vLLM's host rows (one buffer, block b's row holding every layer's page: each page its own range)."""
    if rows:
        bufs = [Buffer(name="h", nbytes=LAYERS * BLOCKS * PAGE, location=Location.HOST)]
        host = [Placement(buffer="h", byte_offset=i * PAGE, stride_bytes=LAYERS * PAGE) for i in range(LAYERS)]
    else:
        bufs = [Buffer(name=f"h{i}", nbytes=BLOCKS * PAGE, location=Location.HOST) for i in range(LAYERS)]
        host = [Placement(buffer=f"h{i}") for i in range(LAYERS)]
    bufs += [Buffer(name=f"d{i}", nbytes=BLOCKS * PAGE) for i in range(LAYERS)]
    regions = tuple(Region(name=f"l{i}", page_bytes=PAGE, device=Placement(buffer=f"d{i}"), host=host[i])
                    for i in range(LAYERS))
    return Layout(buffers=tuple(bufs), regions=regions)


def ids(pattern: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        return np.arange(BLOCKS), np.arange(BLOCKS)
    if pattern == "runs8":
        starts = rng.permutation(BLOCKS // 8) * 8
        return np.arange(BLOCKS), (starts[:, None] + np.arange(8)).reshape(-1)
    return np.arange(BLOCKS), rng.permutation(BLOCKS)


def copies(reps: int, threads: tuple[int, ...]) -> None:
    a, b = np.empty(LAYERS * BLOCKS * PAGE, np.uint8), np.zeros(LAYERS * BLOCKS * PAGE, np.uint8)
    a[:] = 1
    execs = {f"copier x{t}": NumpyExecutor(copier_threads=t) for t in threads}
    execs["numpy paths"] = NumpyExecutor(copier=False)
    print("ratio = one np.copyto of 128 MiB / job (plan + run); best of each, the memcpy and the executors interleaved;"
          " busy rows against the idle memcpy")
    print(f"{'host':<10} {'pattern':<11} {'busy':<5} " + " ".join(f"{k:>12}" for k in execs) + f" {'memcpy ms':>10}")
    rng = np.random.default_rng(1)
    memcpy: dict[str, float] = {}
    for rows in (False, True):
        lay = layout(rows)
        mem = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in lay.buffers}
        bounds = {k: ex.bind(lay, mem) for k, ex in execs.items()}
        for busy in (False, True):
            stop = threading.Event()
            spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
            if busy:
                spinner.start()
            for pattern in ("contiguous", "runs8", "fragmented"):
                src, dst = ids(pattern, rng)
                mapping = BlockMapping(direction="d2h", src_ids=src, dst_ids=dst)
                fns: dict[str, Callable[[], object]] = {} if busy else {"memcpy": lambda: np.copyto(b, a)}
                for k, ex in execs.items():
                    fns[k] = lambda ex=ex, bound=bounds[k]: ex.run(plan_transfer(lay, mapping), bound)
                t = fastest_s(fns, reps)
                memcpy[pattern] = t.get("memcpy", memcpy.get(pattern, 0.0))  # busy rows: the idle memcpy
                print(f"{'rows' if rows else 'per layer':<10} {pattern:<11} {'yes' if busy else 'no':<5} "
                      + " ".join(f"{memcpy[pattern] / t[k]:>12.2f}" for k in execs) + f" {memcpy[pattern] * 1e3:>10.1f}")
            stop.set()
            if busy:
                spinner.join()
        for bound in bounds.values():
            bound.close()
    for ex in execs.values():
        ex.close()


def files() -> None:
    lay = tier_layout(8, 512, PAGE, files=1)
    mem = np.random.default_rng(2).integers(0, 256, lay.buffers[0].nbytes, dtype=np.uint8)
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        fb = {b.name: FileBinding(Path(d) / f"{b.name}.kv", create=True) for b in lay.buffers[1:]}
        with PosixFileExecutor(threads=1) as ex:
            bound = ex.bind(lay, {"mem": mem, **fb})
            plan = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=np.random.default_rng(3).permutation(512),
                                                   dst_ids=np.arange(512)))
            ex.run(plan, bound).wait()
            print(f"posix write of {plan.num_ranges} ranges scattered in memory, end to end in the file: "
                  f"{ex.calls} system calls ({ex.calls / plan.num_ranges:.4f} per range; before: 1 per range)")
            bound.close()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", default="1,2", help="copier thread counts to measure, comma-separated")
    args = ap.parse_args()
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    crc(args.reps)
    copies(args.reps, tuple(int(t) for t in args.threads.split(",")))
    files()


if __name__ == "__main__":
    main()
