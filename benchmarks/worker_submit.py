"""The offload worker's own host cost per job, robust to a busy machine: ``submit_*`` alone, and submit + wait,
as the minimum and median over many jobs of one shape (bench_worker.py's shapes and its NoCopy executor: no copy
competes for the GIL). Runs against whichever kvxfer is installed, so old and new code compare in alternating
processes started from each checkout's root:

    python benchmarks/worker_submit.py BLOCKS K PATTERN DIR [REPS]     # e.g. 256 1 contiguous d2h 60
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path.cwd() / "benchmarks"))  # this checkout's bench_worker (its NoCopy and shapes)
from bench_worker import NoCopy, ids, make_worker


def main() -> None:
    n, k, pattern, direction = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4]
    reps = int(sys.argv[5]) if len(sys.argv) > 5 else 60
    w, _ = make_worker(n, k, 256, NoCopy)
    rng = np.random.default_rng(1)
    jobs = [(ids(pattern, n, 2 * n, 8, rng), ids(pattern, n // k, 2 * n // k, max(8 // k, 1), rng)) for _ in range(reps + 1)]
    submit = w.submit_store if direction == "d2h" else w.submit_load
    host, total = [], []
    for j, (d, h) in enumerate(jobs):
        t0 = time.perf_counter()
        submit(j, d, h) if direction == "d2h" else submit(j, h, d)
        t1 = time.perf_counter()
        w.wait([j])
        t2 = time.perf_counter()
        assert all(r.success for r in w.get_finished())
        if j:  # the first job pays the per-layout warm-up
            host.append(t1 - t0)
            total.append(t2 - t0)
    w.shutdown()
    print(f"{n:5d} {k} {pattern:10s} {direction}  submit min {min(host) * 1e6:7.0f} med {statistics.median(host) * 1e6:7.0f} us"
          f"   submit+wait min {min(total) * 1e6:7.0f} med {statistics.median(total) * 1e6:7.0f} us", flush=True)


if __name__ == "__main__":
    main()
