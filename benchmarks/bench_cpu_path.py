"""The CPU copy path (the NumPy executor under the offload worker) against memcpy, with the process idle and
with one Python thread spinning beside it, and the limits it meets, in one run.

Rows, each the best of --reps jobs (submit + wait through ``create_worker`` with the NumPy executor) against
the best of --reps ``np.copyto`` of the job's bytes between two buffers touched beforehand (ratio = memcpy
time / job time; 1.0 = memcpy speed):

- ``load512``: the engine's load from ``bench_vllm.py``: 8 KV tensors of 128 KiB pages, 64 blocks in descending
  device order against ascending chunks: 512 ranges, 64 MiB;
- ``contiguous``/``runs8``/``fragmented``: 118 KV tensors of 4 KiB pages, 256 blocks per job (118 MiB), stores
  (d2h) and loads (h2d), as ``bench_worker.py``'s throughput.

``busy`` rows run the same while another Python thread spins (``sum(range(1000))`` in a loop: a serving engine's
scheduler or worker thread). Limits measured in the same run: memcpy of the job's bytes with one thread
(``np.copyto``) and two (two halves on two threads; torch's ``copy_`` on its intra-op threads when torch is
installed), the cost of one call on each path for a 64-byte range (the per-range floor), and the speed of pure
Python work beside the spinning thread against idle (the GIL's fair share: what any Python-driven copy gets),
one memcpy's speed at 16-256 MiB (glibc's non-temporal stores above a size: the engine's store baseline), and
the job's bytes copied as 4 KiB and 32 KiB pages between random places of buffers twice as large, one memmove
each, less the same loop of empty memmoves (what random pages cost the memory system, per-range Python aside).
With ``--baseline-tree DIR`` (a tree whose ``kvxfer/`` links to another checkout's packages), each row also runs
there, in a subprocess, interleaved: the before/after columns of one run.

    .venv/bin/python benchmarks/bench_cpu_path.py [--reps 5] [--baseline-tree /tmp/headtree] [--rows load512,runs8]
                                                  [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
from bench_worker import ids, make_worker  # this folder: on sys.path when the script runs

ROWS = [("load512", "h2d")] + [(p, d) for p in ("contiguous", "runs8", "fragmented") for d in ("d2h", "h2d")]


def _spinning() -> tuple[threading.Event, threading.Thread]:
    stop = threading.Event()
    t = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)], daemon=True)
    t.start()
    return stop, t


def measure(row: str, direction: str, busy: bool, reps: int) -> dict[str, float]:
    """One row: the job's bytes, its best time (another thread spinning where ``busy``) and the best memcpy of as
    many bytes with the process idle."""
    rng = np.random.default_rng(2)
    if row == "load512":
        n = 64
        w, _ = make_worker(n, 1, 128 << 10, {"kind": "numpy"}, tensors=8)
        jobs = [(np.arange(n + 15, 15, -1), np.arange(n))] * (reps + 1)
    else:
        n = 256
        w, _ = make_worker(n, 1, 4096, {"kind": "numpy"})
        jobs = [(ids(row, n, 2 * n, 8, rng), ids(row, n, 2 * n, 8, rng)) for _ in range(reps + 1)]
    w.host[:] = 1  # first touch outside the timing
    w.submit_store(10_000, jobs[0][0], jobs[0][1])  # the host rows hold data before a load
    w.wait([10_000])
    w.get_finished()
    stop = t = None
    if busy:
        stop, t = _spinning()
    try:
        times = []
        for j, (d, h) in enumerate(jobs):
            t0 = time.perf_counter()
            w.submit_store(j, d, h) if direction == "d2h" else w.submit_load(j, h, d)
            w.wait([j])
            times.append(time.perf_counter() - t0)
    finally:
        if stop is not None and t is not None:
            stop.set()
            t.join()
    results = w.get_finished()
    w.shutdown()
    assert all(r.success for r in results), results
    nbytes = results[0].nbytes
    src, dst = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    copies = []  # with the process idle: a busy row's ratio is against memcpy on an idle machine
    for _ in range(reps + 1):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        copies.append(time.perf_counter() - t0)
    return dict(nbytes=nbytes, job_s=min(times[1:]), memcpy_s=min(copies[1:]))


def limits(nbytes: int, reps: int) -> dict[str, float]:
    """GB/s of memcpy with one and two threads, and microseconds per 64-byte range on each path."""
    a, b = np.ones(nbytes, np.uint8), np.ones(nbytes, np.uint8)
    best: Callable[[Callable[[], Any]], float] = lambda fn: min(_timed(fn) for _ in range(reps))  # noqa: E731
    half = nbytes // 2
    def two() -> None:
        ts = [threading.Thread(target=np.copyto, args=(b[i * half:(i + 1) * half], a[i * half:(i + 1) * half]))
              for i in range(2)]
        [x.start() for x in ts]
        [x.join() for x in ts]
    out = {"memcpy_1t_gbs": nbytes / best(lambda: np.copyto(b, a)) / 1e9, "memcpy_2t_gbs": nbytes / best(two) / 1e9}
    try:
        import torch
        ta, tb = torch.from_numpy(a), torch.from_numpy(b)
        out["torch_copy_gbs"] = nbytes / best(lambda: tb.copy_(ta)) / 1e9
        out["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    from kvxfer.executors import NumpyExecutor
    from kvxfer.executors._ops_numpy import HostPath
    ex = NumpyExecutor()
    mm = ex._memmove  # the memmove path's per-range call
    n, src, dst = 10_000, a.ctypes.data, b.ctypes.data
    out["memmove_us_per_range"] = best(lambda: [mm(dst + 64 * i, src + 64 * i, 64) for i in range(n)]) / n * 1e6
    win = np.dtype((np.void, 64))
    sw = np.ndarray((n,), win, buffer=a[:64 * n]); dw = np.ndarray((n,), win, buffer=b[:64 * n])  # noqa: E702
    idx = np.random.default_rng(0).permutation(n)
    out["window_us_per_range"] = best(lambda: [dw.__setitem__(idx[i:i + 256], sw[idx[i:i + 256]])
                                               for i in range(0, n, 256)]) / n * 1e6
    out["paths"] = [p.value for p in HostPath]
    for mib in (16, 64, 194, 256):  # one memcpy's speed by size: glibc switches to non-temporal stores above a size
        x, y = np.ones(mib << 20, np.uint8), np.ones(mib << 20, np.uint8)
        out[f"memcpy_{mib}mib_gbs"] = (mib << 20) / best(lambda x=x, y=y: np.copyto(y, x)) / 1e9

    big_a, big_b = np.ones(2 * nbytes, np.uint8), np.ones(2 * nbytes, np.uint8)
    for page in (4096, 32768):  # memmoves of the job's bytes as pages at random places (twice the job's span) ...
        rng = np.random.default_rng(1)
        k = nbytes // page
        sa = (big_a.ctypes.data + rng.permutation(2 * k)[:k] * page).tolist()
        da = (big_b.ctypes.data + rng.permutation(2 * k)[:k] * page).tolist()
        full = best(lambda sa=sa, da=da, page=page: [mm(d, s_, page) for s_, d in zip(sa, da)])
        empty = best(lambda sa=sa, da=da: [mm(d, s_, 0) for s_, d in zip(sa, da)])  # ... less the calls' own cost
        out[f"random_{page}_copy_gbs"] = nbytes / max(full - empty, 1e-9) / 1e9
    del big_a, big_b

    def work() -> None:  # Python bytecode (a C loop such as sum(range(n)) would keep the GIL throughout)
        for _ in range(1_000_000):
            pass
    idle = best(work)
    stop, t = _spinning()
    try:
        busy = best(work)
    finally:
        stop.set()
        t.join()
    out["python_share_busy"] = idle / busy  # the GIL's share a thread gets beside one spinning thread
    return out


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _one(row: str, direction: str, busy: bool, reps: int, tree: str | None) -> dict[str, float]:
    if tree is None:
        return measure(row, direction, busy, reps)
    env = {**os.environ, "PYTHONPATH": tree}
    out = subprocess.run([sys.executable, __file__, "--row", row, direction, str(int(busy)), "--reps", str(reps)],
                         env=env, capture_output=True, text=True, check=True, cwd="/")
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--baseline-tree", default=None)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--rows", default=",".join(dict.fromkeys(r for r, _ in ROWS)), help="comma list of rows to run")
    ap.add_argument("--row", nargs=3, default=None, help=argparse.SUPPRESS)  # one measurement (for --baseline-tree)
    a = ap.parse_args()
    if a.row:
        print(json.dumps(measure(a.row[0], a.row[1], bool(int(a.row[2])), a.reps)))
        return
    print(f"CPU copy path vs memcpy, best of {a.reps}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{os.cpu_count()} CPUs")
    figures: dict[str, Any] = {"limits": limits(118 << 20, a.reps)}
    lim = figures["limits"]
    print("limits: memcpy 1 thread {memcpy_1t_gbs:.2f} GB/s, 2 threads {memcpy_2t_gbs:.2f} GB/s".format(**lim)
          + (f", torch copy_ on {lim['torch_threads']} threads {lim['torch_copy_gbs']:.2f} GB/s"
             if "torch_copy_gbs" in lim else "")
          + f"; per 64-byte range: memmove {lim['memmove_us_per_range']:.2f} us, window {lim['window_us_per_range']:.2f} us"
          + f"; pure Python beside a spinning thread: {lim['python_share_busy']:.2f}x its idle speed")
    print("one memcpy by size: " + ", ".join(f"{m} MiB {lim[f'memcpy_{m}mib_gbs']:.2f} GB/s" for m in (16, 64, 194, 256))
          + f"; random pages, the calls' cost taken out: 4 KiB {lim['random_4096_copy_gbs']:.2f} GB/s, 32 KiB "
          f"{lim['random_32768_copy_gbs']:.2f} GB/s")
    cols = ["new"] + (["old"] if a.baseline_tree else [])
    print(f"{'row':11} {'dir':4} {'busy':4} {'MiB':>6} {'memcpy GB/s':>11} "
          + " ".join(f"{c + ' GB/s':>9} {c + ' ratio':>9}" for c in cols))
    for row, direction in (r for r in ROWS if r[0] in a.rows.split(",")):
        for busy in (False, True):
            got = {"new": _one(row, direction, busy, a.reps, None)}
            if a.baseline_tree:
                got["old"] = _one(row, direction, busy, a.reps, a.baseline_tree)
            base = got["new"]
            figures[f"{row}_{direction}_{'busy' if busy else 'idle'}"] = got
            print(f"{row:11} {direction:4} {'yes' if busy else 'no':4} {base['nbytes'] / 2**20:6.1f} "
                  f"{base['nbytes'] / base['memcpy_s'] / 1e9:11.2f} "
                  + " ".join(f"{g['nbytes'] / g['job_s'] / 1e9:9.2f} {g['memcpy_s'] / g['job_s']:9.2f}" for g in got.values()),
                  flush=True)
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
