"""No busy wait and no polling delay in kvxfer's own waits (issue 30): on vLLM's CPU build the copies run on a
Python lane thread beside the engine's busy Python threads, so every kvxfer thread that waits must block on
something its producer signals (an Event, a Condition), holding no GIL and taking no CPU, and must wake when the
job finishes, not at the next turn of a poll.

Each case holds a job unfinished (a test double's gate) for HOLD_S while kvxfer's threads wait for it: the waiters
(``wait``, ``wait_for_layer``, ``stream_wait_for_layer``, the vLLM ``WorkerCore.wait``), and the lane threads that
wait for another lane's job. Over the hold each such thread must use under a fifth of the wall time in CPU and
make (almost) no Python or C calls (a profile hook counts them: a poll of any period below the hold shows up as
calls, a sleeping poll included). Once released, every waiter returns, after the job's copies finished by the
executor's own account, and the next ``get_finished`` reports it. No assert times anything.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from kvxfer.executors import CompletedTransfer, ExecutorError, NumpyExecutor, Transfer, wait_on_host
from kvxfer.offload import DeviceKV, FileLane, HostTier, KVTensor, create_worker, spill_layout
from kvxfer.offload.lanes import ThreadLane
from kvxfer.offload.vllm.worker import WorkerCore
from kvxfer.planner import Buffer, Location

from . import offload_cases as oc

pytestmark = pytest.mark.skipif(not hasattr(time, "pthread_getcpuclockid"), reason="needs per-thread CPU clocks")

HOLD_S = 0.3  # how long a job is held unfinished while its waiters are measured
SETTLE_S = 0.1  # given to the waiters to reach their blocking call before the hold is measured
MAX_CALLS = 10  # profiled calls a blocked thread may make over the hold (a blocking wait makes none)
MAX_CPU = 0.2  # CPU seconds per wall second a blocked thread may use
TIMEOUT_S = 60  # harness timeouts: a correct worker never comes near them
NB, NCH, K, PAGE = 16, 6, 2, 64


class Calls:
    """A profile hook counting the calls (Python and C) each thread makes, by thread id."""

    def __init__(self) -> None:
        self.n: collections.Counter[int] = collections.Counter()

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.n[threading.get_ident()] += 1


@pytest.fixture
def calls():
    """Count the calls of every thread started from now on (the worker's lanes, the waiters)."""
    hook = Calls()
    threading.setprofile(hook)
    try:
        yield hook
    finally:
        threading.setprofile(None)  # type: ignore[arg-type]


def _cpu_s(thread: threading.Thread) -> float:
    assert thread.ident is not None
    return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))


def _hold(calls: Calls, threads: list[threading.Thread]) -> dict[str, tuple[float, int]]:
    """Sleep SETTLE_S, then HOLD_S; each thread's (CPU per wall second, calls) over the hold."""
    time.sleep(SETTLE_S)
    cpu0, n0, t0 = [_cpu_s(t) for t in threads], [calls.n[t.ident or 0] for t in threads], time.monotonic()
    time.sleep(HOLD_S)
    wall = time.monotonic() - t0
    return {t.name: ((_cpu_s(t) - c) / wall, calls.n[t.ident or 0] - n) for t, c, n in zip(threads, cpu0, n0)}


def _assert_idle(held: dict[str, tuple[float, int]]) -> None:
    busy = {name: v for name, v in held.items() if v[0] >= MAX_CPU or v[1] > MAX_CALLS}
    assert not busy, f"threads that polled while blocked, (CPU per wall second, calls over {HOLD_S} s): {busy}"


def _device(seed: int = 0) -> DeviceKV:
    rng = np.random.default_rng(seed)
    bind = {f"d{i}": rng.integers(0, 256, NB * PAGE, dtype=np.uint8) for i in range(2)}
    tensors = tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=PAGE) for i in range(2))
    return DeviceKV(tuple(Buffer(name=f"d{i}", nbytes=NB * PAGE, location=Location.DEVICE) for i in range(2)), tensors, bind)


def _worker(*executors: Any) -> Any:
    """A worker whose store lane runs on ``executors[0]`` and load lane on ``executors[1]``."""
    it = iter(executors)
    return create_worker(_device(), HostTier(num_chunks=NCH, blocks_per_chunk=K, row_align_bytes=1, pin=False),
                         lambda: next(it), regions_per_layer=1)


class GatedNumpy(NumpyExecutor):
    """The NumPy executor (synchronous, so its jobs run on a lane thread) whose runs wait for ``gate``, then copy,
    then append "finished" to ``log``."""

    def __init__(self, gate: threading.Event, log: list[str]):
        super().__init__()
        self.gate, self.log = gate, log

    def run(self, plan, memory, stream=None, after=None):
        self.gate.wait()
        t = super().run(plan, memory, stream, after)
        self.log.append("finished")
        return t


def _case(name: str, gate: threading.Event) -> tuple[Any, list[Callable[[], Any]], list[str], Callable[[], bool], list[int]]:
    """(worker, waits, names of lane threads that must be blocked, whether the held job's copies finished, job ids
    get_finished must report once the waits return) of case ``name``; the held job finishes once ``gate`` is set."""
    log: list[str] = []
    if name == "thread lane":  # the job runs on the store lane's thread
        w = _worker(GatedNumpy(gate, log), NumpyExecutor())
        core = WorkerCore(w, lambda **kw: kw)
        w.submit_store(1, [0, 1], [0])
        return w, [lambda: w.wait([1]), lambda: core.wait([1])], [], lambda: log == ["finished"], [1]
    if name == "issue lane":  # the copies run later on the executor's own thread, as on a GPU
        ex = oc.AsyncNumpy(0, gate=lambda plan: gate)
        w = _worker(oc.AsyncNumpy(1), ex)
        w.submit_load(1, [0], [4, 5])
        return w, [lambda: w.wait([1]), lambda: w.wait_for_layer(1, 0)], [], \
            lambda: bool(ex.transfers) and all(t.finished.is_set() for t in ex.transfers), [1]
    if name == "issued after a thread lane's job":  # the load is issued only once the store it reads is done
        ex = oc.AsyncNumpy(1)
        w = _worker(GatedNumpy(gate, log), ex)
        w.submit_store(1, [0, 1], [0])
        w.submit_load(2, [0], [4, 5])
        return w, [lambda: w.wait([2]), lambda: w.wait_for_layer(2, 0), lambda: w.stream_wait_for_layer(2, 1, 99)], \
            [], lambda: log == ["finished"], [1, 2]
    if name == "a lane thread waits for an issue lane's job":  # the load lane's thread waits for the store's copies
        ex = oc.AsyncNumpy(0, gate=lambda plan: gate)
        w = _worker(ex, NumpyExecutor())
        w.submit_store(1, [0, 1], [0])
        w.submit_load(2, [0], [4, 5])
        return w, [lambda: w.wait([2])], ["kvxfer-offload-h2d"], \
            lambda: bool(ex.transfers) and ex.transfers[0].finished.is_set(), [1, 2]
    if name == "the file lane waits for an issue lane's job":  # a spill of a chunk a store is still writing
        ex = oc.AsyncNumpy(0, gate=lambda plan: gate)
        w = _worker(ex, oc.AsyncNumpy(1))
        w.attach_files(FileLane(oc.FakeTier(spill_layout(w.geometry), w.host), spill_layout(w.geometry)))
        w.submit_store(1, [0, 1], [0])
        w.submit_spill(2, [0])
        return w, [lambda: w.wait([2])], ["kvxfer-offload-files"], \
            lambda: bool(ex.transfers) and ex.transfers[0].finished.is_set(), [1, 2]
    raise AssertionError(name)


CASES = ["thread lane", "issue lane", "issued after a thread lane's job", "a lane thread waits for an issue lane's job",
         "the file lane waits for an issue lane's job"]


@pytest.mark.parametrize("case", CASES)
def test_waiting_for_an_unfinished_job_holds_no_cpu_and_returns_once_it_finished(case, calls):
    gate = threading.Event()
    before = set(threading.enumerate())
    w, waits, lane_names, finished, reported = _case(case, gate)
    woke: list[tuple[int, bool]] = []  # (waiter, whether the held job's copies had finished when its wait returned)

    def waiter(i: int, wait: Callable[[], Any]) -> None:
        wait()
        woke.append((i, finished()))

    waiters = [threading.Thread(target=waiter, args=(i, f), name=f"waiter-{i}", daemon=True) for i, f in enumerate(waits)]
    try:
        for t in waiters:
            t.start()
        lanes = [t for t in threading.enumerate() if t not in before and t.name in lane_names]
        assert len(lanes) == len(lane_names)
        held = _hold(calls, [*waiters, *lanes])
        assert woke == [] and not finished()  # still held: the waits really wait
        _assert_idle(held)
        gate.set()
        for t in waiters:
            t.join(TIMEOUT_S)
        assert not any(t.is_alive() for t in waiters)
        assert sorted(woke) == [(i, True) for i in range(len(waits))]  # each returned after the copies finished
        w.wait(reported)
        got = {r.job_id: r.success for r in w.get_finished()}  # reported by the next call, no poll in between
        assert got == {j: True for j in reported}
    finally:
        gate.set()
        w.shutdown()


def test_idle_lanes_hold_no_cpu_and_shutdown_wakes_them(calls):
    before = set(threading.enumerate())
    w = _worker(NumpyExecutor(), NumpyExecutor())
    w.attach_files(FileLane(oc.FakeTier(spill_layout(w.geometry), w.host), spill_layout(w.geometry)))
    lanes = [t for t in threading.enumerate() if t not in before and t.name.startswith("kvxfer-offload-")]
    assert sorted(t.name for t in lanes) == ["kvxfer-offload-d2h", "kvxfer-offload-files", "kvxfer-offload-h2d"]
    try:
        _assert_idle(_hold(calls, lanes))  # blocked waiting for a job: no poll of their queues
    finally:
        stop = threading.Thread(target=w.shutdown, daemon=True)
        stop.start()
        stop.join(TIMEOUT_S)
    assert not stop.is_alive() and not any(t.is_alive() for t in lanes)


class Recording(ThreadLane):
    """A bare lane whose step records the jobs it ran, each after ``gate`` is set."""

    def __init__(self, gate: threading.Event):
        name = f"recording-{id(self)}"
        super().__init__(name)
        # the lane's thread, found by the name it is given (the test reads no private attribute)
        self.thread = next(t for t in threading.enumerate() if t.name == f"kvxfer-offload-{name}")
        self.ran: list[Any] = []
        self.step = lambda lane, job: (gate.wait(), self.ran.append(job))


def _closed(lane: Recording) -> bool:
    """Close ``lane`` on another thread; whether that close returned and the lane's thread ended."""
    stop = threading.Thread(target=lane.close, daemon=True)
    stop.start()
    stop.join(TIMEOUT_S)
    return not stop.is_alive() and not lane.thread.is_alive()


def test_close_wakes_a_lane_blocked_for_its_next_job(calls):
    gate = threading.Event()
    gate.set()
    lane = Recording(gate)
    lane.submit("a")  # type: ignore[arg-type]  # the lane never looks inside a job
    held = _hold(calls, [lane.thread])  # ran it, now blocked with nothing queued
    assert lane.ran == ["a"]
    _assert_idle(held)
    assert _closed(lane)


def test_close_runs_every_queued_job_before_it_returns():
    gate = threading.Event()
    lane = Recording(gate)
    for job in "abc":
        lane.submit(job)  # type: ignore[arg-type]
    stop = threading.Thread(target=lane.close, daemon=True)
    stop.start()
    stop.join(0.2)
    assert stop.is_alive() and lane.ran == []  # closing waits for the queued jobs
    gate.set()
    stop.join(TIMEOUT_S)
    assert not stop.is_alive() and not lane.thread.is_alive() and lane.ran == ["a", "b", "c"]


class Counted(Transfer):
    """A transfer double counting its ``done`` and ``wait`` calls; ``error`` is raised by ``wait``."""

    def __init__(self, error: BaseException | None = None):
        super().__init__(nbytes=0, ranges=0, calls=1)
        self.error, self.dones, self.waits = error, 0, 0

    def done(self) -> bool:
        self.dones += 1
        return True

    def wait(self) -> Counted:
        self.waits += 1
        if self.error is not None:
            raise self.error
        return self


@pytest.mark.parametrize("helper", [wait_on_host])
def test_host_waits_on_several_transfers_wait_once_on_each_and_never_poll(helper):
    ts = [Counted(), Counted(ExecutorError("batch", 0, None, "injected", 0)), Counted()]
    helper(ts)  # a failed transfer's error is its owner's: the others are still waited for
    assert [(t.waits, t.dones) for t in ts] == [(1, 0)] * 3
    helper([CompletedTransfer(nbytes=0, ranges=0, calls=1)])
