"""Host paths at hardware speed (issue 41), as same-run ratios:

1. CRC-32 of a 256 MiB buffer: ``offload.checksums.crc32`` (ISA-L where installed) against ``zlib.crc32``.
2. Worker-sized jobs of 4 KiB pages (8 layers, 128 MiB), planned and run on the NumPy executor: the batched copier
   (1 and 2 threads) and today's paths (``copier=False``), against one ``np.copyto`` of the same bytes; idle, and
   beside a spinning Python thread.
3. File I/O: pages scattered in memory written to consecutive file pages with the POSIX executor: system calls
   issued per range.

    .venv/bin/python benchmarks/bench_host_speed.py [--reps 5]
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


def layout() -> Layout:
    bufs = [Buffer(name=f"h{i}", nbytes=BLOCKS * PAGE, location=Location.HOST) for i in range(LAYERS)]
    bufs += [Buffer(name=f"d{i}", nbytes=BLOCKS * PAGE) for i in range(LAYERS)]
    regions = tuple(Region(name=f"l{i}", page_bytes=PAGE, device=Placement(buffer=f"d{i}"), host=Placement(buffer=f"h{i}"))
                    for i in range(LAYERS))
    return Layout(buffers=tuple(bufs), regions=regions)


def ids(pattern: str, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "contiguous":
        return np.arange(BLOCKS), np.arange(BLOCKS)
    if pattern == "runs8":
        starts = rng.permutation(BLOCKS // 8) * 8
        return np.arange(BLOCKS), (starts[:, None] + np.arange(8)).reshape(-1)
    return np.arange(BLOCKS), rng.permutation(BLOCKS)


def copies(reps: int) -> None:
    lay = layout()
    rng = np.random.default_rng(1)
    mem = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in lay.buffers}
    a, b = np.empty(LAYERS * BLOCKS * PAGE, np.uint8), np.zeros(LAYERS * BLOCKS * PAGE, np.uint8)
    a[:] = 1
    memcpy = best(lambda: np.copyto(b, a), reps)
    execs = {"copier x1": NumpyExecutor(copier_threads=1), "copier x2": NumpyExecutor(copier_threads=2),
             "numpy paths": NumpyExecutor(copier=False)}
    bounds = {k: ex.bind(lay, mem) for k, ex in execs.items()}
    print(f"one memcpy of 128 MiB: {memcpy * 1e3:.1f} ms ({0.125 / memcpy:.2f} GB/s); ratio = memcpy / job (plan + run)")
    print(f"{'pattern':<11} {'busy':<5} " + " ".join(f"{k:>12}" for k in execs))
    for busy in (False, True):
        stop = threading.Event()
        spinner = threading.Thread(target=lambda: [None for _ in iter(stop.is_set, True)], daemon=True)
        if busy:
            spinner.start()
        for pattern in ("contiguous", "runs8", "fragmented"):
            src, dst = ids(pattern, rng)
            row = []
            for k, ex in execs.items():
                bound = bounds[k]
                t = best(lambda: ex.run(plan_transfer(lay, BlockMapping(direction="d2h", src_ids=src, dst_ids=dst)),
                                        bound), reps)
                row.append(memcpy / t)
            print(f"{pattern:<11} {'yes' if busy else 'no':<5} " + " ".join(f"{r:>12.2f}" for r in row))
        stop.set()
        if busy:
            spinner.join()
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
    args = ap.parse_args()
    print(time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    crc(args.reps)
    copies(args.reps)
    files()


if __name__ == "__main__":
    main()
