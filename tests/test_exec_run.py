"""One run API for every executor: ``run(plan, memory, stream=None, after=None)``, ``synchronous``, and
``Transfer.stream_wait`` on every transfer kind.

``after`` orders a run behind transfers of any executor: on the device where they share a driver (the shim's
log shows the copy stream waiting on the other transfer's end event, with no host sync), else on the host
before anything is issued. A failed ``after`` transfer still counts as finished; its error is not raised here.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvxfer.executors import (
    CompletedTransfer,
    CudaBatchExecutor,
    Executor,
    ExecutorError,
    ExecutorKind,
    NumpyExecutor,
    RawMemory,
    RunArgumentError,
    Transfer,
    stream_handle,
)
from kvxfer.executors.config import AutoExecutor, ExecutorConfig
from kvxfer.planner import Platform, Target, cuda_version, plan_transfer, presets

from .shims.build import ShimState, build, compiler
from .shims.cases import assert_same, expected, host_buffers

V13 = cuda_version(13, 0)
TARGET = Target(platform="cuda", runtime_version=V13)
LAYOUT = presets.kv_layout(2, 32, 256)


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return build("fake_cuda", tmp_path_factory.mktemp("run_shim"))


@pytest.fixture
def shim(shim_path):
    """(make an executor on the shim, the shim's state), state reset."""
    from .shims.runtime import ShimCudaRuntime
    state = ShimState(ctypes.CDLL(str(shim_path)))
    state.reset()
    state.set(null_batch=0)
    made = []

    def make() -> CudaBatchExecutor:
        made.append(CudaBatchExecutor(ShimCudaRuntime(shim_path, V13)))
        return made[-1]
    yield make, state
    for ex in made:
        ex.close()


def _plan(direction="h2d", n=8, seed=0):
    return plan_transfer(LAYOUT, presets.mapping("fragmented", n, 32, direction, seed=seed), TARGET)


class HostTransfer(Transfer):
    """A transfer of an executor without device events: ``wait`` records what the shim had issued by then."""

    def __init__(self, log: list, state: ShimState | None = None, fails: bool = False):
        super().__init__(nbytes=0, ranges=0, calls=1)
        self.log, self.state, self.fails = log, state, fails

    def wait(self) -> HostTransfer:
        self.log.append(("waited", list(self.state.counts) if self.state is not None else None))
        if self.fails:
            raise ExecutorError("elsewhere", 0, None, "this transfer failed", 0)
        return self


def test_synchronous_says_whether_run_returns_with_every_copy_done(shim):
    make, _ = shim
    assert NumpyExecutor().synchronous is True
    assert make().synchronous is False
    assert AutoExecutor(ExecutorConfig(), platform=Platform.CPU).synchronous is True
    assert AutoExecutor(ExecutorConfig(), platform=Platform.CUDA, executors={}).synchronous is False
    assert Executor().synchronous is False


def test_a_dma_run_after_a_transfer_of_the_same_driver_waits_on_the_device(shim):
    make, state = shim
    first, second = make(), make()
    bufs = host_buffers(LAYOUT, seed=1)
    p1, p2 = _plan(seed=1), _plan("d2h", seed=2)
    want = expected(p2, expected(p1, bufs))
    t1 = first.run(p1, bufs)
    t2 = second.run(p2, bufs, after=t1)
    t2.wait()
    assert_same(bufs, want)
    log = [op for op in state.log if op[0] in ("wait", "record", "batch", "sync")]
    s2 = state.streams[1]  # the second executor's copy stream
    at = log.index(("wait", s2, t1.end))  # the second copy stream waits for the first transfer's end event
    assert log.index(("record", t2.start, s2)) > at and ("sync", t1.end, 0) not in log[:at]


@pytest.mark.parametrize("fails", [False, True])
def test_a_dma_run_after_a_host_transfer_waits_for_it_before_issuing_anything(shim, fails):
    make, state = shim
    ex = make()
    log: list = []
    bufs = host_buffers(LAYOUT, seed=3)
    plan = _plan(seed=3)
    want = expected(plan, bufs)
    t = ex.run(plan, bufs, after=[HostTransfer(log, state), CompletedTransfer(nbytes=0, ranges=0, calls=0),
                                  HostTransfer(log, state, fails=fails)])
    t.wait()  # the failure belongs to the other transfer: this run is not failed by it
    assert log == [("waited", []), ("waited", [])]  # both waited for before the first batch was issued
    assert state.counts == plan.call_sizes.tolist()
    assert_same(bufs, want)


@pytest.mark.parametrize("after, index", [("x", None), ([1], 0), (["a", "b"], 0), ({"a": 1}, None)])
def test_after_must_be_transfers_and_is_checked_before_anything_is_issued(shim, after, index):
    make, state = shim
    bufs = host_buffers(LAYOUT)
    where = "after" if index is None else rf"after\[{index}\]"
    for ex in (make(), NumpyExecutor()):
        with pytest.raises(RunArgumentError, match=rf"^{where} = .*: expected"):
            ex.run(_plan(), bufs, after=after)
    assert state.counts == []


@pytest.mark.parametrize("stream", [object(), "7", 7.0, -1, 1 << 64, True])
def test_a_stream_of_the_wrong_kind_is_refused_before_anything_is_issued(shim, stream):
    make, state = shim
    bufs = host_buffers(LAYOUT)
    before = {k: v.copy() for k, v in bufs.items()}
    for ex in (make(), NumpyExecutor()):
        with pytest.raises(RunArgumentError, match=r"^stream = .*: (expected None|a stream handle)"):
            ex.run(_plan(), bufs, stream=stream)
    assert state.counts == [] and all(np.array_equal(bufs[k], before[k]) for k in bufs)


def test_the_numpy_executor_takes_a_stream_and_copies_after_every_after_transfer():
    log: list = []
    bufs = host_buffers(LAYOUT, seed=4)
    plan = _plan(seed=4)
    want = expected(plan, bufs)

    class Watch(HostTransfer):
        def wait(self):
            log.append(("waited", all(np.array_equal(bufs[k], want[k]) for k in bufs)))
            return super().wait()
    t = NumpyExecutor().run(plan, bufs, stream=5, after=(Watch([]), Watch([], fails=True)))
    assert t.done() and log == [("waited", False), ("waited", False)]  # nothing had moved when each was waited for
    assert_same(bufs, want)


def test_stream_wait_works_on_every_transfer_kind(shim):
    make, state = shim
    ex = make()
    bufs = host_buffers(LAYOUT)
    dma = ex.run(_plan(), bufs)
    dma.stream_wait(42)
    assert ("wait", 42, dma.end) in state.log  # on the device
    done = NumpyExecutor().run(_plan(), bufs)
    done.stream_wait(42)  # finished on return: nothing to wait for
    with pytest.raises(IndexError):
        done.stream_wait(42, call=5)
    with pytest.raises(RunArgumentError, match="^stream = "):
        dma.stream_wait(object())


def test_stream_handle_is_public_and_reads_every_kind_of_stream():
    class TorchLike:
        cuda_stream = 1234
    assert stream_handle(None) == 0  # no GPU initialized here: the legacy default stream
    assert stream_handle(77) == 77 and stream_handle(np.uint64(9)) == 9 and stream_handle(TorchLike()) == 1234
    for bad in (object(), "x", -3, True, 1 << 64):
        with pytest.raises(RunArgumentError, match=r"^stream = "):
            stream_handle(bad)


class Recorder(Executor):
    """Stands in for the Triton executor under auto: records each run's ``after`` and returns a host transfer."""

    def __init__(self, log: list, state: ShimState):
        self.log, self.state = log, state

    def run(self, plan, memory, stream=None, after=None):
        self.log.append(("triton", stream, tuple(after or ())))
        return HostTransfer(self.log, self.state)


def test_auto_orders_a_run_after_the_previous_one_when_it_switches_executor(shim):
    make, state = shim
    log: list = []
    dma = make()
    auto = AutoExecutor(ExecutorConfig(), platform=Platform.CUDA,
                        executors={ExecutorKind.CUDA_BATCH: dma, ExecutorKind.TRITON: Recorder(log, state)})
    bufs = host_buffers(LAYOUT, seed=6)
    pinned = {k: RawMemory(v.ctypes.data, v.nbytes, pinned=True) for k, v in bufs.items()}  # small loads go to triton
    store, load = _plan("d2h", seed=6), _plan("h2d", seed=7)
    t1 = auto.run(store, pinned, stream=9)
    assert auto.last_choice[0] is ExecutorKind.CUDA_BATCH
    auto.run(load, pinned, stream=9, after=None)
    assert auto.last_choice[0] is ExecutorKind.TRITON and log == [("triton", 9, (t1,))]  # after the previous one
    t3 = auto.run(store, pinned, stream=9)  # back to DMA: after the triton transfer, waited for on the host
    t3.wait()
    assert log[1] == ("waited", list(state.counts[:store.num_calls]))
    assert state.counts == store.call_sizes.tolist() * 2
