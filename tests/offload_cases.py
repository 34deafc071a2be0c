"""Shared pieces of the offload worker tests: the oracle adapter, executor and file tier doubles, TP rank setups
that run in child processes, and the CUDA shim executor factory (the one place that knows how the shim is
injected)."""
from __future__ import annotations

import os
import queue
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import BindingError, ExecutorError, NumpyExecutor, Transfer, wait_on_host
from kvxfer.offload import TierResult
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


# ---- executor doubles -------------------------------------------------------------------------------------------
class SlowNumpy(NumpyExecutor):
    """The NumPy executor (synchronous) after a random pause, so lanes really race; fails the runs ``fail(plan)``
    picks before copying anything. Waits for ``after`` on the host, as the contract asks of host executors."""

    def __init__(self, seed: int = 0, fail: Callable[[Any], bool] | None = None, max_pause_s: float = 0.003):
        super().__init__()
        self.rng, self.fail, self.max_pause_s, self.runs = np.random.default_rng(seed), fail, max_pause_s, 0
        self.lock = threading.Lock()

    def run(self, plan, memory, stream=None, after=None):
        wait_on_host(after or ())
        with self.lock:
            pause = float(self.rng.random()) * self.max_pause_s
            self.runs += 1
        time.sleep(pause)
        if self.fail is not None and self.fail(plan):
            raise ExecutorError("memcpy", 0, 0, "injected failure", 0)
        return super().run(plan, memory, stream)


@dataclass(eq=False, kw_only=True)
class AsyncTransfer(Transfer):
    """A run of AsyncNumpy: ``finished`` once its copies ran on the double's thread (or failed there)."""

    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    stream: Any = None
    stream_waits: list[tuple[Any, int]] = field(default_factory=list)

    def done(self) -> bool:
        if self.finished.is_set() and self.error is not None:
            raise self.error
        return self.finished.is_set()

    def wait(self) -> AsyncTransfer:
        self.finished.wait()
        if self.error is not None:
            raise self.error
        self.elapsed_s = self.elapsed_s or 1e-6
        return self

    def call_done(self, call: int) -> bool:
        self._call(call)
        return self.done()

    def wait_call(self, call: int) -> AsyncTransfer:
        self._call(call)
        return self.wait()

    def stream_wait(self, stream: Any, call: int = -1) -> None:
        self.stream_waits.append((stream, call))  # a device wait: nothing to do on the host


class AsyncNumpy(NumpyExecutor):
    """A non-synchronous executor over host memory, honouring the executors' contract: ``run`` checks the plan
    and returns at once; the copies happen later on the double's own thread, after its previous run (runs
    complete in issue order) and after every transfer in ``after``. ``gate(plan)`` may return an Event the copy
    waits for (a slow executor held by the test). ``fail(plan)``: raise at issue, nothing issued;
    ``fail_late(plan)``: copy nothing and report the error when waited for (a device-side failure). ``runs``
    records ``(plan, stream, after, thread name)`` of every call."""

    synchronous = False

    def __init__(self, seed: int = 0, max_pause_s: float = 0.002, fail: Callable[[Any], bool] | None = None,
                 fail_late: Callable[[Any], bool] | None = None, gate: Callable[[Any], Any] | None = None):
        super().__init__()
        self.rng, self.max_pause_s = np.random.default_rng(seed), max_pause_s
        self.fail, self.fail_late, self.gate = fail, fail_late, gate
        self.runs: list[tuple[Any, Any, list[Any], str]] = []
        self.transfers: list[AsyncTransfer] = []
        self._last: AsyncTransfer | None = None
        self._queue: queue.Queue[Any] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, daemon=True, name="async-double")
        self._thread.start()

    def run(self, plan, memory, stream=None, after=None):
        bound = self.memory_for(plan, memory)
        bound.check(plan)
        self.runs.append((plan, stream, list(after or ()), threading.current_thread().name))
        if self.fail is not None and self.fail(plan):
            raise ExecutorError("batch", 0, 0, "injected failure at issue", 0)
        t = AsyncTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls, stream=stream)
        views = [m.view() if m is not None and m.view is not None else None for m in bound.memory]
        gate = self.gate(plan) if self.gate is not None else None
        late = self.fail_late is not None and self.fail_late(plan)
        self._queue.put((t, self._last, list(after or ()), plan, views, gate, late, float(self.rng.random())))
        self._last = t
        self.transfers.append(t)
        return t

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            t, prev, after, plan, views, gate, late, r = item
            if prev is not None:
                prev.finished.wait()
            wait_on_host(after or ())
            if gate is not None:
                gate.wait()
            time.sleep(r * self.max_pause_s)
            if late:
                t.error = ExecutorError("batch", 0, None, "injected failure on the device", 0)
            else:
                for sb, so, db, do, n in zip(plan.src_buf.tolist(), plan.src_offset.tolist(), plan.dst_buf.tolist(),
                                             plan.dst_offset.tolist(), plan.nbytes.tolist()):
                    views[db][do:do + n] = views[sb][so:so + n]
            t.finished.set()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()


class FakeTier:
    """A file tier double over the worker's host rows and a numpy "file": spill and restore run the plan with the
    NumPy executor. ``fail(op, plan)`` fails a job before it moves a byte; ``gate(op, plan)`` may return an Event
    the job waits for; ``started(op, plan)`` is called as a job starts. ``log`` records ``(op, chunks)``."""

    def __init__(self, layout: Layout, host: np.ndarray, fail: Callable[[str, Any], bool] | None = None,
                 gate: Callable[[str, Any], Any] | None = None, started: Callable[[str, Any], None] | None = None):
        self.file = np.zeros(layout.buffers[layout.buffer_index("file")].nbytes, np.uint8)
        self.memory = {"host": host, "file": self.file}
        self.fail, self.gate, self.started = fail, gate, started
        self.log: list[tuple[str, Any]] = []
        self.closed = False

    def _job(self, op: str, plan: Any) -> TierResult:
        if self.started is not None:
            self.started(op, plan)
        gate = self.gate(op, plan) if self.gate is not None else None
        if gate is not None:
            gate.wait()
        self.log.append((op, plan))
        if self.fail is not None and self.fail(op, plan):
            return TierResult(op, False, 0, 0.0, error=BindingError("file", op, "injected failure"))
        NumpyExecutor().run(plan, self.memory)
        return TierResult(op, True, plan.total_bytes, 1e-6)

    def spill(self, plan: Any) -> TierResult:
        return self._job("spill", plan)

    def restore(self, plan: Any) -> TierResult:
        return self._job("restore", plan)

    def close(self) -> None:
        self.closed = True


# ---- the shim ---------------------------------------------------------------------------------------------------
def shim_factory(shim_path: str | None, version: int = 13000) -> Any:
    """A zero-argument factory of CUDA batch executors on the C driver shim (host memory), or None for the
    NumPy executor. Shim injection lives here only."""
    if shim_path is None:
        return None
    from kvxfer.executors import CudaBatchExecutor

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


class HalfThenBlock(NumpyExecutor):
    """Copies the first half of a plan's ranges, writes ``marker`` (a file), then blocks for good: a rank that is
    in the middle of a job when it is killed."""

    def __init__(self, marker: Path):
        super().__init__()
        self.marker = marker

    def run(self, plan, memory, stream=None, after=None):
        bound = self.memory_for(plan, memory)
        bound.check(plan)
        views = [m.view() if m is not None and m.view is not None else None for m in bound.memory]
        cols = zip(plan.src_buf.tolist(), plan.src_offset.tolist(), plan.dst_buf.tolist(), plan.dst_offset.tolist(),
                   plan.nbytes.tolist())
        for k, (sb, so, db, do, n) in enumerate(cols):
            if k == plan.num_ranges // 2:
                break
            views[db][do:do + n] = views[sb][so:so + n]
        self.marker.write_text(str(os.getpid()))
        threading.Event().wait()


def run_rank(role: str, names: list[str], tp_size: int, rank: int, region: str, directory: str,
             shim_path: str | None, out_dir: str, hold: bool = False) -> None:
    """Child process: attach to ``region`` as rank ``rank`` of ``tp_size`` and store or load one job; write
    the job result and (loads) the device bytes to ``out_dir``. With ``hold``, the store stops half-way through
    its copies and blocks there after writing a marker file ``ready-<rank>``, until the parent kills the process
    (a rank killed mid-job)."""
    from kvxfer.offload import TPRank, create_worker

    device = rank_device(names, tp_size, rank, "data" if role == "store" else "sentinel")
    out = Path(out_dir)
    executor = (lambda: HalfThenBlock(out / f"ready-{rank}")) if hold else shim_factory(shim_path)
    w = create_worker(device, tier(region, directory), executor, tp=TPRank(size=tp_size, rank=rank))
    if role == "store":
        w.submit_store(1, **STORE_JOB)
    else:
        w.submit_load(1, **LOAD_JOB)
    w.wait([1])  # with hold: blocks here until killed
    (res,) = w.get_finished()
    np.savez(out / f"{role}-{tp_size}-{rank}.npz", success=res.success, error=str(res.error),
             nbytes=res.nbytes, **{k: np.asarray(v) for k, v in device.bindings.items()})
    w.shutdown()


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
