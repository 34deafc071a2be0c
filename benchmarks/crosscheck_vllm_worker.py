"""kvxfer's vLLM backend against vLLM's own CPU offloading worker (``vllm/v1/kv_offload/cpu/gpu_worker.py``) of
the release on ``PYTHONPATH`` (0.33 or 0.34: the wheels have no CPU build, so their modules run over the 0.32 CPU
build's environment), on host memory.

vLLM's ``CPUOffloadingWorker`` runs as written (its handlers, descriptor filling, skips, boundary jobs, its own
``resolve_device_pointers`` on 0.34) with three stand-ins for what a CPU cannot do: the copy kernel
(``swap_blocks_batch``) is a recording one that performs each descriptor with ``memmove``, and its CUDA streams
and events are no-ops (every copy is done when the kernel returns). kvxfer's backend (``WorkerCore`` over an
``OffloadWorker`` with the NumPy executor, handed the same DevicePointers or specs) runs the same jobs on its own
copy of the device tensors; after every job the two copies must hold equal bytes, and each kvxfer job's ranges
must be no more than vLLM's descriptors.

    PYTHONPATH=/work/vllmv/0.34.0 .venv-vllm/bin/python benchmarks/crosscheck_vllm_worker.py --jobs 600
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from kvxfer.executors import NumpyExecutor
from kvxfer.offload import HostTier
from kvxfer.offload.vllm import WorkerCore, build_worker, read_caches
from kvxfer.offload.vllm.api import TRAITS, VLLM_VERSION
from kvxfer.offload.vllm.pointers import PointerMap


class _Event:
    def record(self, stream: Any = None) -> None: ...
    def query(self) -> bool: return True
    def synchronize(self) -> None: ...
    def elapsed_time(self, other: Any) -> float: return 0.0


class _Stream:
    def wait_stream(self, other: Any) -> None: ...
    def wait_event(self, event: Any) -> None: ...
    def synchronize(self) -> None: ...


@dataclass
class Tally:
    """Counts of one run: jobs, vLLM's copy descriptors and kvxfer's ranges (in all and per job)."""

    jobs: int = 0
    stores: int = 0
    loads: int = 0
    expedited: int = 0
    descriptors: int = 0
    ranges: int = 0
    bytes: int = 0
    mismatches: int = 0
    over: int = 0  # jobs where kvxfer's ranges exceeded vLLM's descriptors
    per_job: list[tuple[int, int]] = field(default_factory=list)


class _Recorder:
    """vLLM's copy kernel, recorded: each descriptor performed with memmove on host memory."""

    def __init__(self) -> None:
        self.last = 0

    def __call__(self, src: Any, dst: Any, sizes: Any, **_: Any) -> None:
        s, d, n = (np.asarray(x.numpy()).astype(np.int64) for x in (src, dst, sizes))
        for a, b, c in zip(s.tolist(), d.tolist(), n.tolist()):
            ctypes.memmove(b, a, c)
        self.last += len(n)


def _vllm_worker(kv_caches: Any, k: int, chunks: int) -> tuple[Any, _Recorder]:
    from vllm.v1.kv_offload.cpu import gpu_worker as gw

    platform = types.SimpleNamespace(Stream=_Stream, current_stream=_Stream, stream=lambda s: contextlib.nullcontext(),
                                     is_xpu=lambda: False, is_rocm=lambda: False, is_cuda_alike=lambda: False)
    proxy = types.ModuleType("torch_proxy")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    proxy.Event = lambda **kw: _Event()  # type: ignore[attr-defined]
    gw.current_platform, gw.torch, gw.PIN_MEMORY = platform, proxy, False  # host memory: nothing to pin
    worker = gw.CPUOffloadingWorker(kv_caches, blocks_per_chunk=k, num_cpu_chunks=chunks)
    rec = _Recorder()
    for h in (worker._store_handler, worker._load_handler, getattr(worker, "_expedited_load_handler", None)):
        if h is not None:
            h._swap_blocks_batch = rec
    return worker, rec


class _DeviceView(torch.Tensor):
    """A host tensor that answers ``is_cuda`` (0.33's handler asserts its device tensors are CUDA's); it shares the
    tensor's memory."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def _kv(tensors: list[torch.Tensor], groups: list[list[int]], device_view: bool = False) -> Any:
    from vllm.v1.kv_offload.base import CanonicalKVCacheRef, CanonicalKVCaches, CanonicalKVCacheTensor

    views = [t.as_subclass(_DeviceView) if device_view else t for t in tensors]
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in views],
                             [[CanonicalKVCacheRef(i, tensors[i].shape[1]) for i in refs] for refs in groups])


def run(jobs: int = 600, seed: int = 0, num_blocks: int = 96, chunks: int = 48) -> Tally:
    """``jobs`` random stores and loads (every blocks_per_chunk in 1, 2, 4; skips; partial last chunks; empty
    groups; expedited loads on 0.34) through both workers; returns the tally."""
    from vllm.v1.kv_offload.base import GPULoadStoreSpec
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec

    resolve = None
    if TRAITS.device_pointers:
        from vllm.v1.kv_offload.pointer_utils import resolve_device_pointers as resolve
    rng = np.random.default_rng(seed)
    tally = Tally()
    pages = [256, 256, 512, 128]  # bytes per block of each tensor
    groups = [[0, 1], [2], [3]]  # three KV-cache groups, the first with two layers
    for k in (1, 2, 4):
        g = torch.Generator().manual_seed(seed + k)
        ours = [torch.randint(-128, 127, (num_blocks, p), dtype=torch.int8, generator=g) for p in pages]
        theirs = [t.clone() for t in ours]
        kv_ours, kv_theirs = _kv(ours, groups), _kv(theirs, groups, device_view=not TRAITS.device_pointers)
        vw, rec = _vllm_worker(kv_theirs, k, chunks)
        cmap = read_caches(kv_ours)
        core = WorkerCore(build_worker(cmap, HostTier(num_chunks=chunks, blocks_per_chunk=k, layout=cmap.layout),
                                       NumpyExecutor(), pin=False, barrier=None, creator=True),
                          _result, pointers=PointerMap.from_kv_caches(kv_ours))
        for j in range(jobs // 3):
            job_id = k * 100000 + j
            sizes, starts, chunk_ids = [], [], []
            for _ in groups:
                n = int(rng.integers(0, 4))
                skip = int(rng.integers(0, k)) if n else 0
                size = max(0, n * k - skip - (int(rng.integers(0, k)) if n > 1 else 0))
                n = -(-(size + skip) // k) if size else 0
                sizes.append(size), starts.append(skip + k * int(rng.integers(0, 3)))
                chunk_ids.extend(rng.choice(chunks, n, replace=False).tolist())
            if not sum(sizes):
                continue
            blocks = np.concatenate([_blocks(rng, num_blocks, s) for s in sizes]).astype(np.int32)
            gpu = GPULoadStoreSpec(blocks, group_sizes=tuple(sizes), block_indices=tuple(starts))
            cpu = CPULoadStoreSpec(np.asarray(chunk_ids, dtype=np.int64))
            dev_theirs = resolve(gpu, kv_theirs) if resolve else gpu
            dev_ours = resolve(gpu, kv_ours) if resolve else gpu
            store = bool(rng.integers(0, 2))
            expedited = bool(not store and TRAITS.expedited and rng.integers(0, 2))
            rec.last = 0
            before = core.stats.ranges_stored + core.stats.ranges_loaded
            if store:
                vw.submit_store(job_id, dev_theirs, cpu)
                core.submit_store(job_id, dev_ours, cpu)
            elif expedited:
                vw.submit_load(job_id, cpu, dev_theirs, expedited=True)
                core.submit_load(job_id, cpu, dev_ours, expedited=True)
            else:
                vw.submit_load(job_id, cpu, dev_theirs)
                core.submit_load(job_id, cpu, dev_ours)
            core.wait({job_id})
            done = core.get_finished()
            vdone = vw.get_finished()
            if not (done and done[0].success and vdone and vdone[0].success):
                raise RuntimeError(f"job {job_id} failed: kvxfer {done}, vLLM {vdone}")
            ranges = core.stats.ranges_stored + core.stats.ranges_loaded - before
            tally.jobs += 1
            tally.stores += store
            tally.loads += not store
            tally.expedited += expedited
            tally.descriptors += rec.last
            tally.ranges += ranges
            tally.bytes += int(done[0].transfer_size)
            tally.over += ranges > rec.last
            tally.per_job.append((ranges, rec.last))
            tally.mismatches += not all(torch.equal(a, b) for a, b in zip(ours, theirs))
        core.shutdown()
        vw.shutdown()
    return tally


def _blocks(rng: np.random.Generator, num_blocks: int, n: int) -> np.ndarray:
    """``n`` distinct device blocks: half the time one run of adjacent blocks (what a prefill allocates), else
    scattered."""
    if rng.integers(0, 2):
        return int(rng.integers(0, num_blocks - n + 1)) + np.arange(n)
    return rng.choice(num_blocks, n, replace=False)


def _result(**kw: Any) -> Any:
    return types.SimpleNamespace(**{"transfer_size": 0, "transfer_time": 0.0, **kw})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=600)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    t = run(a.jobs, a.seed)
    print(json.dumps({"vllm": VLLM_VERSION, "jobs": t.jobs, "stores": t.stores, "loads": t.loads,
                      "expedited": t.expedited, "equal_bytes_jobs": t.jobs - t.mismatches,
                      "kvxfer_ranges": t.ranges, "vllm_descriptors": t.descriptors,
                      "jobs_with_more_ranges": t.over, "bytes": t.bytes}))


if __name__ == "__main__":
    main()
