"""kvxfer's vLLM worker outside an engine, same-run ratios: what the counters file costs an engine step, and
what ``kvxfer_verify`` costs a job.

1. Counters (``kvxfer_stats_path``): per step, the counters written on the step (JSON, a temporary file,
   ``os.replace``: what the worker did before) against handed to ``StatsFile`` (a snapshot queued for its thread),
   in a folder on the repository's disk and in /dev/shm; ``steps`` steps each, median per step.
2. Checksums: a store of ``blocks`` device blocks of ``layers`` tensors (``page`` bytes each) into host chunks,
   then the load of them back, through ``WorkerCore`` on the NumPy executor, without and with checksums,
   alternating, ``reps`` times; median job time (submit to result) and the ratio. Beside it: ``zlib.crc32`` and
   ``np.copyto`` throughput on the same bytes.

    .venv/bin/python benchmarks/bench_vllm_worker.py [--steps 400] [--layers 8] [--page-kib 128] [--blocks 64]
                                                     [--blocks-per-chunk 1] [--reps 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.offload import HostTier
from kvxfer.offload.checksums import HostChecksums
from kvxfer.offload.vllm import StatsFile, WorkerCore, WorkerStats, build_worker, read_caches

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # vLLM's classes or their stand-ins live with the vLLM tests
    sys.path.insert(0, str(ROOT))

from tests.vllm.doubles import vllm_types  # noqa: E402

V = vllm_types()


def counters(folder: Path, steps: int) -> dict[str, float]:
    """Median µs per step: the counters written on the step, and handed to StatsFile."""
    stats = WorkerStats(host_tier="private", blocks_stored_by_group=[1], blocks_loaded_by_group=[1])
    path = folder / "stats.json"
    on_step = []
    for i in range(steps):
        stats.steps = i
        t0 = time.perf_counter()
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(vars(stats), indent=1))
        os.replace(tmp, path)
        on_step.append(time.perf_counter() - t0)
    writer, handed = StatsFile(path), []
    for i in range(steps):
        stats.steps = i
        t0 = time.perf_counter()
        writer.update(stats.snapshot())
        handed.append(time.perf_counter() - t0)
        time.sleep(0.0005)  # an engine step is longer than this: the thread keeps up
    writer.close()
    return {"on_step_us": statistics.median(on_step) * 1e6, "handed_us": statistics.median(handed) * 1e6}


def _job(core: WorkerCore, store: bool, job_id: int, blocks: int, k: int) -> float:
    chunks = V.CPU(list(range(blocks // k)))
    device = V.GPU(list(range(blocks) if store else range(blocks, 2 * blocks)), [blocks], [0])
    t0 = time.perf_counter()
    if store:
        core.submit_store(job_id, device, chunks)
    else:
        core.submit_load(job_id, chunks, device)
    core.wait({job_id})
    (r,) = core.get_finished()
    assert r.success, r
    return time.perf_counter() - t0


def checksums(layers: int, page: int, blocks: int, k: int, reps: int) -> dict[str, float]:
    """Median store and load job seconds without and with checksums, alternating (one worker each)."""
    import torch

    g = torch.Generator().manual_seed(0)
    tensors = [torch.randint(-128, 127, (2 * blocks, page), dtype=torch.int8, generator=g) for _ in range(layers)]
    cmap = read_caches(V.Caches([V.Tensor(t, page) for t in tensors], [[V.Ref(i, page) for i in range(layers)]]))
    cores = {}
    for verify in (False, True):
        w = build_worker(cmap, HostTier(num_chunks=blocks // k, blocks_per_chunk=k), NumpyExecutor(), pin=False,
                         barrier=None, creator=True)
        cores[verify] = WorkerCore(w, V.Result, checksums=HostChecksums(w.layout, w.host, blocks // k) if verify else None)
    times: dict[tuple[bool, bool], list[float]] = {(v, s): [] for v in (False, True) for s in (True, False)}
    job = 0
    for _ in range(reps):
        for verify in (False, True):
            for store in (True, False):
                job += 1
                times[verify, store].append(_job(cores[verify], store, job, blocks, k))
    for c in cores.values():
        c.shutdown()
    med = {f"{'verify' if v else 'plain'}_{'store' if s else 'load'}_ms": statistics.median(t) * 1e3
           for (v, s), t in times.items()}
    nbytes = layers * blocks * page
    a, b = np.random.default_rng(0).integers(0, 255, nbytes, dtype=np.uint8), np.empty(nbytes, np.uint8)
    crc, copy = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        zlib.crc32(a)
        crc.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        np.copyto(b, a)
        copy.append(time.perf_counter() - t0)
    return {**med, "job_mib": nbytes / 2**20, "crc32_gbs": nbytes / min(crc) / 1e9, "copyto_gbs": nbytes / min(copy) / 1e9}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--page-kib", type=int, default=128)
    ap.add_argument("--blocks", type=int, default=64)
    ap.add_argument("--blocks-per-chunk", type=int, default=1)
    ap.add_argument("--reps", type=int, default=7)
    a = ap.parse_args(argv)
    (ROOT / "build").mkdir(exist_ok=True)
    for label, parent in (("disk", ROOT / "build"), ("tmpfs", Path("/dev/shm"))):
        with tempfile.TemporaryDirectory(dir=parent, prefix="kvxfer-bench-stats-") as d:
            c = counters(Path(d), a.steps)
        print(f"counters file on {label:5}: written on the step {c['on_step_us']:8.1f} µs/step, handed to its thread "
              f"{c['handed_us']:6.1f} µs/step ({c['on_step_us'] / c['handed_us']:.0f}x less on the step)")
    v = checksums(a.layers, a.page_kib << 10, a.blocks, a.blocks_per_chunk, a.reps)
    print(f"jobs of {v['job_mib']:.0f} MiB ({a.layers} tensors x {a.blocks} blocks x {a.page_kib} KiB, k={a.blocks_per_chunk}):")
    for op in ("store", "load"):
        plain, verify = v[f"plain_{op}_ms"], v[f"verify_{op}_ms"]
        print(f"  {op:5}: {plain:7.2f} ms plain, {verify:7.2f} ms with kvxfer_verify ({verify / plain:.2f}x)")
    print(f"  zlib.crc32 {v['crc32_gbs']:.2f} GB/s, np.copyto {v['copyto_gbs']:.2f} GB/s on the same bytes")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
