"""One writer of the shared-store stress test (tests/test_shared_store.py): stores, loads and evicts on one
store under a small capacity and reports its counts as JSON on its last stdout line.

Run: ``python tests/shared_stress.py ROOT SEED JOBS CAPACITY``. Each key's row is a pure function of the key,
so any process can check any row it loads: a byte that differs is a wrong byte.
"""
from __future__ import annotations

import json
import sys
import time

import numpy as np

from kvxfer.offload.files.shared_store import SharedChunkStore

ROW = 4096
IDENTITY = {"model": "stress", "v": 1}
KEYS = 400


def row_of(n: int) -> np.ndarray:
    """The row stored under key ``n``: the same in every process."""
    return np.random.default_rng(n).integers(0, 256, ROW, dtype=np.uint8)


def key(n: int) -> bytes:
    return f"key-{n}".encode()


def run(root: str, seed: int, jobs: int, capacity: int, scan_s: float = 0.2, dead_after_s: float = 3.0) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    memory = np.zeros(16 * ROW, np.uint8)
    store = SharedChunkStore({"root_dir": root, "capacity_bytes": capacity, "durability": "none"}, memory, ROW,
                             IDENTITY, scan_s=scan_s, dead_after_s=dead_after_s)
    counts = {"jobs": 0, "results": 0, "stores": 0, "acked": 0, "lost": 0, "loads": 0, "loaded": 0, "wrong_bytes": 0,
              "hangs": 0}
    job_id = 0

    def wait(jid: int) -> object:
        deadline = time.monotonic() + 30.0
        while time.monotonic() < deadline:
            for r in store.poll():
                counts["results"] += 1
                if r.job_id == jid:
                    return r
            time.sleep(0.001)
        counts["hangs"] += 1
        return None

    for _ in range(jobs):
        job_id += 1
        counts["jobs"] += 1
        ns = rng.choice(KEYS, size=4, replace=False).tolist()
        if rng.random() < 0.5:  # store 4 rows, then load what was acknowledged from this writer's view
            for i, n in enumerate(ns):
                memory[i * ROW:(i + 1) * ROW] = row_of(n)
            store.submit_store(job_id, [key(n) for n in ns], list(range(4)))
            r = wait(job_id)
            counts["stores"] += 1
            if r is None or not r.success:
                continue
            done = list(r.done_keys)
            counts["acked"] += len(done)
            job_id += 1
            counts["jobs"] += 1
            memory[8 * ROW:12 * ROW] = 0
            store.submit_load(job_id, done, list(range(8, 8 + len(done))))
            back = wait(job_id)
            got = set(back.done_keys) if back is not None else set()
            counts["lost"] += sum(k not in got and store.owns(k) for k in done)  # a file it holds, unreadable
            for i, k in enumerate(done):
                if k in got:
                    n = int(k.decode().split("-")[1])
                    counts["wrong_bytes"] += int((memory[(8 + i) * ROW:(9 + i) * ROW] != row_of(n)).sum())
        else:  # load whichever of 4 keys the store knows (any writer's)
            have = [n for n in ns if store.lookup(key(n))]
            memory[:4 * ROW] = 0
            store.submit_load(job_id, [key(n) for n in have], list(range(len(have))))
            r = wait(job_id)
            counts["loads"] += 1
            if r is None:
                continue
            for i, n in enumerate(have):
                if key(n) in r.done_keys:
                    counts["loaded"] += 1
                    counts["wrong_bytes"] += int((memory[i * ROW:(i + 1) * ROW] != row_of(n)).sum())
        print(json.dumps(counts), flush=True)
    store.close()
    print(json.dumps(counts), flush=True)
    return counts


if __name__ == "__main__":
    run(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
