"""kvxfer inside vLLM's CPU build: time to first token for a re-requested long prefix, restored through kvxfer
against recomputed, kvxfer's host time per engine step, and store/load throughput inside the engine against one
memcpy of the same bytes.

The model is a Llama written by the benchmark (seeded weights; by default 8 layers, hidden 512, 8 KV heads of
64, float32: a 2,048-token prefix is 64 blocks of 32 tokens and 64 MiB of KV, and its prefill takes more than a
second on this machine). Each engine serves, one after the other: P (the prefix plus a 16-token suffix), two
long prompts that evict P's blocks from the engine's cache (80 blocks), then P' (the prefix with another
suffix). Every request generates one token, so the wall time of a generate call is its time to first token.
Two engines run in this process: without offloading (P' recomputes the prefix) and with kvxfer's spec (P'
loads it). The memcpy baseline is ``np.copyto`` of the loaded (stored) byte count between two buffers, best of
5, in this process. Last, the same store and load through kvxfer's vLLM worker outside any engine, with the process
otherwise idle and with another Python thread spinning (what vLLM's worker thread does beside the copies).

    .venv-vllm/bin/python benchmarks/bench_vllm.py [--layers 8] [--hidden 512] [--prefix-blocks 64]
                                                   [--blocks-per-chunk 1] [--omp-bind 0] [--quick]

``--quick``: a small model and prefix (a smoke run; its figures are not for notes). Needs .venv-vllm
(``make venv-vllm``).
"""
from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the engine runner and the model writer live with the engine tests
    sys.path.insert(0, str(ROOT))


def _memcpy_s(nbytes: int, reps: int = 5) -> float:
    src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - t0)
    return best


def outside_engine(layers: int, page_bytes: int, blocks: int, busy: bool, reps: int = 5, direction: str = "load") -> float:
    """GB/s of the engine's load or store (``direction``; ``blocks`` blocks x ``layers`` tensors, descending device ids
    against ascending chunks: one range per page, as in the engine) through kvxfer's vLLM worker with vLLM's own spec
    classes, outside any engine; ``busy``: while another Python thread spins (the engine's worker thread)."""
    import threading

    import torch
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        TransferResult,
    )
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    from kvxfer.executors import NumpyExecutor
    from kvxfer.offload import HostTier
    from kvxfer.offload.vllm import WorkerCore, build_worker, read_caches

    tensors = [torch.zeros(blocks + 16, page_bytes, dtype=torch.int8) for _ in range(layers)]
    caches = CanonicalKVCaches([CanonicalKVCacheTensor(t, page_bytes) for t in tensors],
                               [[CanonicalKVCacheRef(i, page_bytes) for i in range(layers)]])
    worker = build_worker(read_caches(caches), HostTier(num_chunks=blocks), NumpyExecutor(), pin=False, barrier=None,
                          creator=True)
    core = WorkerCore(worker, TransferResult)
    device, host = list(range(blocks + 15, 15, -1)), list(range(blocks))
    stop = threading.Event()
    spinner = threading.Thread(target=lambda: [sum(range(1000)) for _ in iter(stop.is_set, True)])
    if busy:
        spinner.start()
    best = float("inf")
    try:
        core.submit_store(0, GPULoadStoreSpec(device, [blocks], [0]), CPULoadStoreSpec(host))
        core.wait({0})
        for job in range(1, reps + 1):
            if direction == "store":
                core.submit_store(job, GPULoadStoreSpec(device, [blocks], [0]), CPULoadStoreSpec(host))
            else:
                core.submit_load(job, CPULoadStoreSpec(host), GPULoadStoreSpec(device, [blocks], [0]))
            core.wait({job})
            best = min([best] + [r.transfer_time for r in core.get_finished() if r.job_id == job])
    finally:
        stop.set()
        if busy:
            spinner.join()
        core.shutdown()
    return blocks * layers * page_bytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--omp-bind", default=None, help="VLLM_CPU_OMP_THREADS_BIND for the engines (for example 0: the "
                    "forward pass on core 0, leaving core 1 to kvxfer's copy threads)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None, help="also write the figures here")
    a = ap.parse_args()
    if a.quick:
        a.layers, a.hidden, a.prefix_blocks = 2, 128, 8
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    if a.omp_bind is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = a.omp_bind
    from tests.vllm.engine import run

    r = random.Random(0)
    prefix_tokens = a.prefix_blocks * 32
    prefix = [r.randrange(3, 4000) for _ in range(prefix_tokens)]
    requests = [prefix + [r.randrange(3, 4000) for _ in range(16)],
                [r.randrange(3, 4000) for _ in range(prefix_tokens + 40)],
                [r.randrange(3, 4000) for _ in range(prefix_tokens + 40)],
                prefix + [r.randrange(3, 4000) for _ in range(16)]]
    heads = a.hidden // 64
    tmp = Path(tempfile.mkdtemp(prefix="kvxfer-bench-vllm-"))
    model = {"model_dir": str(tmp / "model"), "layers": a.layers, "hidden": a.hidden, "heads": heads, "kv_heads": heads,
             "intermediate": a.hidden * 11 // 4, "vocab": 4096}
    blocks = a.prefix_blocks + 16
    engine = {"num_gpu_blocks_override": blocks, "max_model_len": (a.prefix_blocks + 2) * 32, "max_num_batched_tokens": 8192}
    base = {"model": model, "engine": engine, "requests": requests, "max_tokens": 1}
    results = {}
    for name, offload in (("recomputed", None),
                          ("kvxfer", {"cpu_bytes_to_use": 4 << 30, "blocks_per_chunk": a.blocks_per_chunk})):
        res = run({**base, "name": name, "offload": offload})
        if res["error"]:
            raise SystemExit(f"{name}: {res['error']}")
        results[name] = res
    rec, kv = results["recomputed"], results["kvxfer"]
    if rec["tokens"] != kv["tokens"]:
        raise SystemExit(f"tokens differ: {rec['tokens']} vs {kv['tokens']}")
    (stats,) = kv["stats"]
    m = kv["metrics"]
    kv_mib = stats["bytes_loaded"] / 2**20
    print(f"vLLM CPU build, Llama {a.layers} layers x hidden {a.hidden} ({heads} KV heads of 64, float32), prefix "
          f"{prefix_tokens} tokens = {a.prefix_blocks} blocks, blocks_per_chunk {a.blocks_per_chunk}, "
          f"VLLM_CPU_OMP_THREADS_BIND {os.environ.get('VLLM_CPU_OMP_THREADS_BIND', '(vLLM default)')}")
    print("\ntime to first token (wall time of a 1-token generate), the prefix re-requested after eviction")
    print(f"{'':28} {'recomputed':>10} {'kvxfer':>10}")
    print(f"{'cold prefill of P (s)':28} {rec['request_times_s'][0]:10.3f} {kv['request_times_s'][0]:10.3f}")
    print(f"{'re-requested P-prime (s)':28} {rec['request_times_s'][3]:10.3f} {kv['request_times_s'][3]:10.3f}")
    print(f"{'speed-up':28} {'':10} {rec['request_times_s'][3] / kv['request_times_s'][3]:9.1f}x")
    print(f"\nprefix hits from the offload tier: {m.get('vllm:external_prefix_cache_hits', 0):.0f} tokens; "
          f"kvxfer loaded {stats['blocks_loaded']} blocks ({kv_mib:.1f} MiB) in {stats['loads']} job(s), "
          f"{stats['ranges_loaded']} ranges")
    steps = max(stats["steps"], 1)
    jobs = max(stats["stores"] + stats["loads"], 1)
    print(f"kvxfer host time (submit + get_finished): {stats['host_s'] * 1e3:.2f} ms over {stats['steps']} engine steps "
          f"= {stats['host_s'] / steps * 1e6:.0f} us per step; {stats['host_s'] / jobs * 1e6:.0f} us per job")
    print("\nthroughput inside the engine (NumPy executor, copy time per job) vs one memcpy of the same bytes")
    print(f"{'dir':5} {'MiB':>7} {'ranges':>7} {'kvxfer GB/s':>11} {'memcpy GB/s':>11} {'ratio':>6}")
    figures: dict[str, Any] = {"ttft_recomputed_s": rec["request_times_s"][3], "ttft_restored_s": kv["request_times_s"][3],
                               "host_us_per_step": stats["host_s"] / steps * 1e6, "stats": stats}
    for d, nbytes, secs, ranges in (("store", stats["bytes_stored"], stats["store_s"], stats["ranges_stored"]),
                                    ("load", stats["bytes_loaded"], stats["load_s"], stats["ranges_loaded"])):
        copy_s = _memcpy_s(nbytes)
        gbs, mem_gbs = nbytes / secs / 1e9, nbytes / copy_s / 1e9
        figures[f"{d}_gbs"], figures[f"{d}_memcpy_gbs"] = gbs, mem_gbs
        print(f"{d:5} {nbytes / 2**20:7.1f} {ranges:7d} {gbs:11.2f} {mem_gbs:11.2f} {gbs / mem_gbs:6.2f}")
    page_bytes = heads * 32 * 2 * 64 * 4
    print(f"\nthe same jobs outside the engine ({a.prefix_blocks} blocks x {a.layers} layers of {page_bytes >> 10} KiB, "
          f"{a.prefix_blocks * a.layers} ranges, best of 5) vs one memcpy")
    copy_gbs = stats["bytes_loaded"] / _memcpy_s(stats["bytes_loaded"]) / 1e9
    for d in ("store", "load"):
        for busy in (False, True):
            gbs = outside_engine(a.layers, page_bytes, a.prefix_blocks, busy, direction=d)
            key = f"outside_{'' if d == 'load' else 'store_'}{'busy' if busy else 'idle'}_gbs"  # loads: the old keys
            figures[key] = gbs
            print(f"{d:5} {'another Python thread spinning' if busy else 'process otherwise idle':32} {gbs:6.2f} GB/s, "
                  f"memcpy {copy_gbs:6.2f} GB/s, ratio {gbs / copy_gbs:5.2f}")
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1))


if __name__ == "__main__":
    main()
