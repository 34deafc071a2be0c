"""Shared pieces of the offload worker tests: the oracle adapter, TP rank setups that run in child
processes, and the CUDA shim executor factory (the one place that knows how the shim is injected)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.planner import BlockMapping, Buffer, Layout, Location, PlanOptions
from kvxfer.testing import apply_copies, expected_copies

SHARD_ROWS = 4
PAGE = {"rep": 256, "shard": 512, "priv": 128}  # canonical pages (shard: split over ranks)
NUM_BLOCKS = 24
K = 2
NUM_CHUNKS = 12


def oracle(layout: Layout, mapping: BlockMapping) -> Any:
    """Per-piece copies (src buf, src off, dst buf, dst off, nbytes) for ``mapping`` over ``layout``, from the
    single test oracle. Writer rotation is the layout's (each region's ``num_writers/writer_index``)."""
    return expected_copies(layout, mapping, PlanOptions())


def everyone_writes(layout: Layout) -> Layout:
    """``layout`` with every region stored by every rank (no writer rotation)."""
    regions = [r.model_dump() | {"num_writers": 1, "writer_index": 0} for r in layout.regions]
    return Layout.model_validate(layout.model_dump() | {"regions": regions})


def apply(copies: Any, arrays: dict[str, np.ndarray]) -> None:
    """Apply oracle copies in order to ``arrays`` ({buffer name: uint8 array})."""
    apply_copies(copies, arrays)


# ---- the shim ---------------------------------------------------------------------------------------------------
def shim_factory(shim_path: str | None, version: int = 13000) -> Any:
    """A zero-argument factory of CUDA batch executors on the C driver shim (host memory), or None for the
    NumPy executor. Shim injection lives here only."""
    if shim_path is None:
        return None
    from kvxfer.executors.ops_cuda import CudaBatchExecutor

    from .shims.runtime import ShimCudaRuntime

    return lambda: CudaBatchExecutor(ShimCudaRuntime(shim_path, version))


def shim_state(shim_path: str) -> Any:
    """The shim's controls and record (the same loaded library the executors' runtimes call into)."""
    import ctypes

    from .shims.build import ShimState

    return ShimState(ctypes.CDLL(shim_path))


# ---- TP ranks -----------------------------------------------------------------------------------------------------
def canonical_data(name: str, block: int) -> np.ndarray:
    """The canonical page of a TP-independent tensor for a block (the same on every rank)."""
    return np.random.default_rng([sum(name.encode()), block]).integers(0, 256, PAGE[name], dtype=np.uint8)


def device_pages(name: str, tp_size: int, rank: int, block: int) -> np.ndarray:
    """What rank ``rank`` of ``tp_size`` holds for block ``block``."""
    if name == "rep":
        return canonical_data("rep", block)
    if name == "shard":
        rows = canonical_data("shard", block).reshape(SHARD_ROWS, tp_size, -1)
        return rows[:, rank].reshape(-1).copy()
    return np.random.default_rng([7, tp_size, rank, block]).integers(0, 256, PAGE["priv"], dtype=np.uint8)


def rank_device(names: list[str], tp_size: int, rank: int, fill: str) -> Any:
    """A DeviceKV of numpy "device" buffers: ``fill`` "data" (each rank's real pages) or "sentinel"."""
    from kvxfer.offload import DeviceKV, KVTensor, Sharing

    sharing = {"rep": Sharing.REPLICATED, "shard": Sharing.SHARDED, "priv": Sharing.PRIVATE}
    tensors, buffers, bindings = [], [], {}
    for name in names:
        page = PAGE[name] // tp_size if name == "shard" else PAGE[name]
        buf = f"dev.{name}"
        if fill == "data":
            arr = np.concatenate([device_pages(name, tp_size, rank, b) for b in range(NUM_BLOCKS)])
        else:
            arr = np.random.default_rng([99, tp_size, rank, len(name)]).integers(0, 256, page * NUM_BLOCKS, dtype=np.uint8)
        bindings[buf] = arr
        buffers.append(Buffer(name=buf, nbytes=arr.nbytes, location=Location.DEVICE))
        tensors.append(KVTensor(name=name, buffer=buf, page_bytes=page, sharing=sharing[name],
                                shard_rows=SHARD_ROWS if name == "shard" else 1))
    return DeviceKV(tuple(buffers), tuple(tensors), bindings)


def tier(name: str, directory: str, create: bool = False, attachers: int = 0) -> Any:
    from kvxfer.offload import HostLayout, HostTier, SharedSpec

    return HostTier(num_chunks=NUM_CHUNKS, blocks_per_chunk=K, layout=HostLayout.CANONICAL, pin=False,
                    shared=SharedSpec(name=name, directory=directory, create=create, attachers=attachers))


STORE_JOB = dict(device_ids=list(range(8)), host_ids=[5, 1, 2, 7, 3], group_sizes=(8,), group_starts=(1,))
LOAD_JOB = dict(host_ids=[5, 1, 2, 7, 3], device_ids=[10, 11, 12, 13, 14, 15, 16, 17], group_sizes=(8,), group_starts=(1,))


def store_mapping() -> BlockMapping:
    j = STORE_JOB
    return BlockMapping(direction="d2h", src_ids=j["device_ids"], dst_ids=j["host_ids"], group_sizes=j["group_sizes"],
                        group_starts=j["group_starts"])


def load_mapping() -> BlockMapping:
    j = LOAD_JOB
    return BlockMapping(direction="h2d", src_ids=j["host_ids"], dst_ids=j["device_ids"], group_sizes=j["group_sizes"],
                        group_starts=j["group_starts"])


def run_rank(role: str, names: list[str], tp_size: int, rank: int, region: str, directory: str,
             shim_path: str | None, out_dir: str, hold: float = 0.0) -> None:
    """Child process: attach to ``region`` as rank ``rank`` of ``tp_size`` and store or load one job; write
    the job result and (loads) the device bytes to ``out_dir``. With ``hold`` > 0, keep storing until
    killed (the kill test), writing a marker file after the first job."""
    from kvxfer.offload import TPRank, create_worker

    device = rank_device(names, tp_size, rank, "data" if role == "store" else "sentinel")
    w = create_worker(device, tier(region, directory), shim_factory(shim_path), tp=TPRank(size=tp_size, rank=rank))
    out = Path(out_dir)
    if role == "store":
        w.submit_store(1, **STORE_JOB)
    else:
        w.submit_load(1, **LOAD_JOB)
    w.wait([1])
    (res,) = w.get_finished()
    if hold:
        (out / f"ready-{rank}").write_text(str(os.getpid()))
        job = 2
        while True:  # stores forever, until the parent kills this process mid-job
            w.submit_store(job, **STORE_JOB)
            w.wait([job])
            w.get_finished()
            job += 1
            time.sleep(hold)
    np.savez(out / f"{role}-{tp_size}-{rank}.npz", success=res.success, error=str(res.error),
             nbytes=res.nbytes, **{k: np.asarray(v) for k, v in device.bindings.items()})
    w.shutdown()


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
