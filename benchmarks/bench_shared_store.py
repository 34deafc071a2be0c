"""Shared store throughput and cross-engine hits: ``python benchmarks/bench_shared_store.py [--chunks N]``.

1. Store then load throughput with 1 writer process and with N writer processes on one shared store (each writer
   stores its own keys, then loads them back; every byte checked): aggregate MB/s.
2. Two engines sharing one store against two engines with a store each: engine A stores K chunks, engine B
   looks them up and loads them (B's hit rate, and B's time to have the prefix in memory, the file-tier part of
   a time to first token); separate stores give B no hits (it recomputes).
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import numpy as np

from kvxfer.offload.files.shared_store import HEADER_BYTES, SharedChunkStore

ROW = 256 << 10
ID = {"model": "bench", "v": 1}


def _open(root: str, chunks: int, memory: np.ndarray) -> SharedChunkStore:
    return SharedChunkStore({"root_dir": root, "capacity_bytes": 4 * chunks * (ROW + HEADER_BYTES), "durability": "none"},
                            memory, ROW, ID)


def _writer(root: str, w: int, chunks: int, out: mp.Queue) -> None:  # type: ignore[type-arg]
    memory = np.random.default_rng(w).integers(0, 256, 16 * ROW, dtype=np.uint8)
    store = _open(root, chunks, memory)
    keys = [f"w{w}-{i}".encode() for i in range(chunks)]
    t0 = time.perf_counter()
    for j in range(0, chunks, 16):
        store.submit_store(j, keys[j:j + 16], list(range(len(keys[j:j + 16]))))
        store.drain()
        assert all(r.success for r in store.poll())
    t1 = time.perf_counter()
    back = np.zeros_like(memory)
    store.memory = back
    for j in range(0, chunks, 16):
        store.submit_load(10**6 + j, keys[j:j + 16], list(range(len(keys[j:j + 16]))))
        store.drain()
        assert all(r.success for r in store.poll())
    t2 = time.perf_counter()
    store.close()
    assert np.array_equal(back, memory)
    out.put((t1 - t0, t2 - t1))


def throughput(writers: int, chunks: int) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as root:
        q: mp.Queue = mp.Queue()  # type: ignore[type-arg]
        ps = [mp.Process(target=_writer, args=(root, w, chunks, q)) for w in range(writers)]
        for p in ps:
            p.start()
        times = [q.get() for _ in ps]
        for p in ps:
            p.join()
        mb = writers * chunks * ROW / 1e6
        return mb / max(t[0] for t in times), mb / max(t[1] for t in times)


def cross_engine(chunks: int, shared: bool) -> tuple[float, float]:
    with tempfile.TemporaryDirectory(dir="/var/tmp") as ra, tempfile.TemporaryDirectory(dir="/var/tmp") as rb:
        mem_a = np.random.default_rng(1).integers(0, 256, chunks * ROW, dtype=np.uint8)
        a = _open(ra, chunks, mem_a)
        keys = [f"p{i}".encode() for i in range(chunks)]
        a.submit_store(1, keys, list(range(chunks)))
        a.drain()
        a.poll()
        mem_b = np.zeros_like(mem_a)
        b = _open(ra if shared else rb, chunks, mem_b)
        t0 = time.perf_counter()
        have = [k for k in keys if b.lookup(k)]
        b.submit_load(2, have, list(range(len(have))))
        b.drain()
        b.poll()
        seconds = time.perf_counter() - t0
        a.close()
        b.close()
        return len(have) / chunks, seconds


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--writers", type=int, default=4)
    args = ap.parse_args()
    for n in (1, args.writers):
        st, ld = throughput(n, args.chunks)
        print(f"writers={n} chunks/writer={args.chunks} row={ROW >> 10} KiB  store {st:8.1f} MB/s  load {ld:8.1f} MB/s")
    for shared in (True, False):
        hit, s = cross_engine(args.chunks, shared)
        print(f"{'one shared store ' if shared else 'a store per engine'}: engine B hit rate {hit:.2f}, "
              f"prefix of {args.chunks} chunks in memory after {s * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
