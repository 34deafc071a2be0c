"""A toy serving loop that offloads and restores KV blocks every step through kvxfer's offload worker.

Each step, the "engine" evicts a few requests' blocks to host chunks (stores) and restores earlier ones
into free device blocks (loads), then collects finished jobs. Without a GPU the worker runs the NumPy
executor on background threads; with one it uses the DMA batch executor on copy streams. Every restore is
checked against the bytes the engine offloaded.

    python examples/offload_loop.py [--steps 12]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from kvxfer.offload import DeviceKV, HostTier, KVTensor, create_worker
from kvxfer.planner import Buffer, Location

LAYERS, BLOCKS, PAGE, K, CHUNKS = 8, 256, 4096, 4, 64


def main(steps: int = 12, seed: int = 0) -> int:
    rng = np.random.default_rng(seed)
    gpu = np.zeros(LAYERS * BLOCKS * PAGE, dtype=np.uint8)  # one allocation, one region per layer
    tensors = tuple(KVTensor(name=f"layer{i}", buffer="gpu", page_bytes=PAGE, byte_offset=i * BLOCKS * PAGE)
                    for i in range(LAYERS))
    device = DeviceKV((Buffer(name="gpu", nbytes=gpu.nbytes, location=Location.DEVICE),), tensors, {"gpu": gpu})
    worker = create_worker(device, HostTier(num_chunks=CHUNKS, blocks_per_chunk=K), regions_per_layer=1)
    pages = gpu.reshape(LAYERS, BLOCKS, PAGE)
    print(f"worker: {LAYERS} layers x {BLOCKS} blocks x {PAGE} B, host {CHUNKS} chunks of {K} blocks, "
          f"executor {worker.target.label}, {len(worker.layout.regions)} regions")
    offloaded: dict[int, tuple[list[int], np.ndarray]] = {}  # chunk list -> what was stored
    free_chunks = list(range(CHUNKS))
    job = 0
    bad = 0
    t0 = time.perf_counter()
    for step in range(steps):
        pages[:] = rng.integers(0, 256, pages.shape[1:], dtype=np.uint8)[None]  # "compute" writes the cache
        pages[:, :, :8] = np.arange(LAYERS, dtype=np.uint8)[:, None, None]
        n = int(rng.integers(1, 5)) * K  # evict one request's blocks
        blocks = sorted(rng.choice(BLOCKS // 2, n, replace=False).tolist(), reverse=bool(step % 2))
        chunks = [free_chunks.pop(0) for _ in range(n // K)]
        worker.submit_store(job, blocks, chunks)
        offloaded[job] = (chunks, pages[:, blocks].copy())
        job += 1
        if step and step % 3 == 0:  # restore an earlier request into free blocks of the upper half
            sid = min(offloaded)
            chunks, want = offloaded.pop(sid)
            dst = list(range(BLOCKS // 2, BLOCKS // 2 + want.shape[1]))
            worker.submit_load(job, chunks, dst)
            worker.wait_for_layer(job, 0)  # layer 0 can start its attention while later layers load
            worker.wait([job])
            bad += int(not np.array_equal(pages[:, dst], want))
            free_chunks += chunks
            job += 1
        worker.wait(range(job))  # the engine reuses evicted blocks next step: their stores must have read them
        for r in worker.get_finished():
            print(f"step {step:2d}: job {r.job_id:2d} {r.direction.value} {'ok' if r.success else 'FAILED'} "
                  f"{r.nbytes / 2**20:6.2f} MiB in {r.num_ranges:3d} ranges, {r.elapsed_s * 1e3:6.2f} ms"
                  + (f" ({r.error})" if r.error else ""))
    worker.shutdown()
    for r in worker.get_finished():
        print(f"drained: job {r.job_id} {r.direction.value} {'ok' if r.success else 'FAILED'}")
    print(f"{job} jobs in {time.perf_counter() - t0:.2f} s; restores verified: {'all' if not bad else f'{bad} BAD'}")
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=12)
    raise SystemExit(main(p.parse_args().steps))
