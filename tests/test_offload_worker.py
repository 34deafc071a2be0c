"""The offload worker in one process: ordering across directions, per-layer completion, failures, pools,
submission checks, on the NumPy executor (background threads) and on the CUDA batch executor over the C
driver shim, where stream and event order is replayed from the shim's record."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from kvxfer.executors import ExecutorError, NumpyExecutor
from kvxfer.offload import (
    DeviceKV,
    HostTier,
    KVTensor,
    OffloadError,
    SubmissionError,
    TPRank,
    WorkerClosedError,
    create_worker,
)
from kvxfer.planner import BlockMapping, Buffer, Location, Target

from . import offload_cases as oc
from .shims.build import build, compiler

COMPUTE = 77  # the caller's compute stream handle on the shim
NB, NCH, K, PAGE = 32, 12, 2, 64


def _device(seed=0, n=3, groups=(0, 0, 0)):
    rng = np.random.default_rng(seed)
    bind = {f"d{i}": rng.integers(0, 256, NB * PAGE, dtype=np.uint8) for i in range(n)}
    tensors = tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=PAGE, group=groups[i]) for i in range(n))
    return DeviceKV(tuple(Buffer(name=f"d{i}", nbytes=NB * PAGE, location=Location.DEVICE) for i in range(n)), tensors, bind)


class SlowNumpy(NumpyExecutor):
    """The NumPy executor after a random pause, so the two lanes really race; can fail chosen runs."""

    def __init__(self, seed: int, fail: set | None = None):
        self.rng, self.fail, self.runs = np.random.default_rng(seed), fail or set(), 0

    def run(self, plan, bindings, stream=None):
        time.sleep(float(self.rng.random()) * 0.003)
        self.runs += 1
        if plan.total_bytes in self.fail:
            raise ExecutorError("memcpy", 0, 0, "injected failure", 0)
        return super().run(plan, bindings, stream)


@pytest.fixture(scope="module")
def shim_lib(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return str(build("fake_cuda", tmp_path_factory.mktemp("offload_worker_shim")))


@pytest.fixture(params=["numpy", "cuda-shim"])
def backend(request, shim_lib):
    """(executor factory, shim state or None). The only place the tests inject the driver shim."""
    if request.param == "numpy":
        seeds = iter(range(100))
        return (lambda: SlowNumpy(next(seeds))), None
    state = oc.shim_state(shim_lib)
    state.reset()
    return oc.shim_factory(shim_lib), state


def _worker(factory, device=None, **kw):
    return create_worker(device or _device(), HostTier(num_chunks=NCH, blocks_per_chunk=K, row_align_bytes=1, pin=False),
                         factory, **kw)


def _random_jobs(n, seed):
    rng = np.random.default_rng(seed)
    jobs = []
    for j in range(n):
        chunks = rng.choice(NCH, int(rng.integers(1, 4)), replace=False)
        skip = int(rng.integers(0, K))
        count = len(chunks) * K - skip - int(rng.integers(0, K if len(chunks) * K - skip > 1 else 1))
        blocks = rng.choice(8, count, replace=False) + 8 * int(rng.integers(0, 2))  # overlapping device blocks
        jobs.append(("store" if rng.random() < 0.5 else "load", j, blocks.tolist(), chunks.tolist(), count, skip))
    return jobs


def _mapping(kind, blocks, chunks, count, skip):
    if kind == "store":
        return BlockMapping(direction="d2h", src_ids=blocks, dst_ids=chunks, group_sizes=(count,), group_starts=(skip,))
    return BlockMapping(direction="h2d", src_ids=chunks, dst_ids=blocks, group_sizes=(count,), group_starts=(skip,))


def _submit(w, kind, j, blocks, chunks, count, skip, **kw):
    if kind == "store":
        return w.submit_store(j, blocks, chunks, (count,), (skip,), **kw)
    return w.submit_load(j, chunks, blocks, (count,), (skip,), **kw)


def _happens_before(log, marks):
    """Replay the shim's record as streams and events: for each batch/copy (by log index), the set of
    earlier batches and compute marks that must finish first. ``marks``: log index -> mark inserted on the
    compute stream there (the caller's compute work at each submission)."""
    deps: dict[int, set] = {}
    ev: dict[int, set] = {}
    before: dict[int, set] = {}
    for i, (op, a, b) in enumerate(log):
        if i in marks:
            deps.setdefault(COMPUTE, set()).add(("mark", marks[i]))
        if op == "record":
            ev[a] = set(deps.get(b, ()))
        elif op == "wait":
            deps.setdefault(a, set()).update(ev.get(b, ()))
        elif op in ("batch", "copy"):
            before[i] = set(deps.get(a, ()))
            deps.setdefault(a, set()).add(("op", i))
    return before


def test_fifty_interleaved_jobs_equal_a_sequential_replay(backend):
    factory, state = backend
    dev = _device(1)
    w = _worker(factory, dev)
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy()}
    jobs = _random_jobs(50, seed=3)
    held = state is not None  # on the shim, copies finish at once: report them unfinished to exercise the gates
    if held:
        rts = [(rt, rt.event_query) for rt in (w._executors[d].runtime for d in w._executors)]
        for rt, _ in rts:
            rt.event_query = lambda e: 600  # CUDA_ERROR_NOT_READY
    spans, results = [], []
    for i, job in enumerate(jobs):
        a = len(state.log) if held else 0
        assert _submit(w, *job, stream=COMPUTE) is True
        spans.append((a, len(state.log) if held else 0))
        if not held and i % 7 == 3:
            results += w.get_finished()
    if held:
        for rt, real in rts:
            rt.event_query = real
    w.wait([j for _, j, *_ in jobs])
    results += w.get_finished()
    for kind, _j, blocks, chunks, count, skip in jobs:
        oc.apply(oc.oracle(w.layout, _mapping(kind, blocks, chunks, count, skip)), want)
    for k in dev.bindings:
        np.testing.assert_array_equal(dev.bindings[k], want[k], err_msg=k)
    np.testing.assert_array_equal(w.host, want["host"])
    assert all(r.success for r in results) and sorted(r.job_id for r in results) == list(range(50))
    for d in ("d2h", "h2d"):
        ids = [r.job_id for r in results if r.direction.value == d]
        assert ids == sorted(ids)  # submission order per direction
    if held:  # every pair of jobs that touch a common block or chunk is ordered on the device
        before = _happens_before(state.log, {a: j for j, (a, _) in enumerate(spans)})
        ops = [[i for i in range(a, b) if state.log[i][0] in ("batch", "copy")] for a, b in spans]
        for j, (_kind, _, blocks, chunks, *_r) in enumerate(jobs):
            if not ops[j]:
                continue
            first = before[ops[j][0]]
            assert ("mark", j) in first, f"job {j} does not wait for the compute stream"
            for i in range(j):
                _, _, b2, c2, *_r2 = jobs[i]
                if ops[i] and (set(blocks) & set(b2) or set(chunks) & set(c2)):
                    assert ("op", ops[i][-1]) in first, f"job {j} is not ordered after conflicting job {i}"
        assert w.pool_sizes["d2h.streams"] + w.pool_sizes["h2d.streams"] >= 1
    w.shutdown()


def test_cross_direction_rule_is_what_makes_the_replay_hold(backend, monkeypatch):
    """Without the rule (no job waits for the other direction), the racing lanes give other bytes."""
    factory, state = backend
    if state is not None:
        pytest.skip("the shim copies synchronously: no race to lose")
    import kvxfer.offload.worker as wm
    monkeypatch.setattr(wm, "_overlap", lambda a, b: False)
    mismatched = 0
    for seed in range(4):
        dev = _device(seed)
        w = _worker(factory, dev)
        want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy()}
        jobs = _random_jobs(50, seed=seed + 10)
        for job in jobs:
            _submit(w, *job)
            oc.apply(oc.oracle(w.layout, _mapping(*job[:1], *job[2:])), want)
        w.shutdown()
        mismatched += any(not np.array_equal(dev.bindings[k], want[k]) for k in dev.bindings) or \
            not np.array_equal(w.host, want["host"])
    assert mismatched


def test_per_layer_completion_of_loads(backend):
    factory, state = backend
    dev = _device(2)
    w = _worker(factory, dev, regions_per_layer=1)
    w.submit_store(1, list(range(8)), [0, 1, 2, 3], stream=COMPUTE)
    w.submit_load(2, [0, 1, 2, 3], list(range(16, 24)), stream=COMPUTE)
    for layer in range(3):
        w.wait_for_layer(2, layer)
        w.stream_wait_for_layer(2, layer, 99)
        np.testing.assert_array_equal(dev.bindings[f"d{layer}"][16 * PAGE:24 * PAGE], dev.bindings[f"d{layer}"][:8 * PAGE])
    if state is not None:  # the consumer stream waits on the event that ends each layer's call
        waits = [e for op, s, e in state.log if op == "wait" and s == 99]
        syncs = [a for op, a, _ in state.log if op == "sync"]
        assert len(set(waits)) == 3 and waits == syncs[-3:]
    res = w.get_finished()
    assert [r.job_id for r in res] == [1, 2] and all(r.success for r in res)
    with pytest.raises(KeyError, match="not pending"):
        w.wait_for_layer(2, 0)
    w.shutdown()


def test_failed_job_is_reported_and_later_jobs_run(backend):
    factory, state = backend
    dev = _device(3)
    n_regions = 3
    if state is None:
        ex = SlowNumpy(0, fail={3 * PAGE * n_regions})  # the job moving three blocks fails
        w = _worker(lambda: ex, dev)
    else:
        w = _worker(factory, dev)
        state.set(fail_at=n_regions * 2 + 1, fail_code=700)  # job 1 copies 2 ranges per region; job 2 fails
    w.submit_store(1, list(range(4)), [0, 2])  # 4 blocks into 2 chunks (k=2): 2 ranges per region
    w.submit_store(2, list(range(4, 7)), [4, 5])
    w.submit_load(3, [0, 2], list(range(20, 24)))
    w.wait([1, 2, 3])
    res = {r.job_id: r for r in w.get_finished()}
    assert res[1].success and res[3].success
    assert not res[2].success and isinstance(res[2].error, ExecutorError) and res[2].nbytes == 0
    for i in range(n_regions):
        np.testing.assert_array_equal(dev.bindings[f"d{i}"][20 * PAGE:24 * PAGE], dev.bindings[f"d{i}"][:4 * PAGE])
    w.shutdown()


def test_shutdown_drains_jobs_in_flight_and_raises_unreported_failures():
    dev = _device(4)
    w = _worker(lambda: SlowNumpy(1), dev)
    for j in range(10):
        w.submit_store(j, [2 * j % NB, (2 * j + 1) % NB], [j % NCH])
    w.shutdown()
    res = w.get_finished()
    assert [r.job_id for r in res] == list(range(10)) and all(r.success for r in res)
    with pytest.raises(WorkerClosedError, match="job 11"):
        w.submit_load(11, [0], [0, 1])
    ex = SlowNumpy(2, fail={K * PAGE * 3})
    w = _worker(lambda: ex, dev)
    w.submit_store(1, [0, 1], [0])
    with pytest.raises(OffloadError, match="job 1 \\(d2h\\) failed: memcpy failed") as e:
        w.shutdown()
    assert [r.job_id for r in e.value.results] == [1] and [r.job_id for r in w.get_finished()] == [1]


@pytest.mark.parametrize("args,field,match", [
    ((5, [0, 1], [NCH]), "host_ids", "ends at byte .*, past buffer 'host'"),
    ((5, [0, NB], [1]), "device_ids", "past buffer"),
    ((5, [0, -1], [1]), "device_ids", "non-negative"),
    ((5, [0, 1], [1], (3,)), "device_ids", "past the end of the list"),
    ((5, [0, 1, 2], [1], (3,)), "host_ids", "past the end of the list"),
    ((5, [0, 1], [1], (2, 2)), "group_sizes", "1 KV-cache groups"),
    (("x", [0, 1], [1]), "job_id", "must be an integer"),
])
def test_bad_submission_raises_before_anything_is_queued(args, field, match):
    w = _worker(lambda: SlowNumpy(3))
    with pytest.raises(SubmissionError, match=match) as e:
        w.submit_store(*args)
    assert e.value.field == field and e.value.job_id == args[0]
    assert w.get_finished() == [] and not w._pending
    w.submit_store(5, [0, 1], [1])
    with pytest.raises(SubmissionError, match="still pending"):
        w.submit_load(5, [1], [0, 1])
    w.shutdown()


def test_pools_grow_on_demand_and_are_reused(shim_lib):
    factory = oc.shim_factory(shim_lib)
    w = _worker(factory)
    rts = [w._executors[d].runtime for d in w._executors]
    hold = threading.Event()
    for rt in rts:
        real = rt.event_query
        rt.event_query = lambda e, real=real: 0 if hold.is_set() else 600
    for j in range(6):  # alternating conflicting jobs: each needs a gate while the other lane is in flight
        w.submit_store(j, [0, 1], [0]) if j % 2 == 0 else w.submit_load(j, [0], [0, 1])
    made = w.pool_sizes
    assert made["d2h.streams"] + made["h2d.streams"] == 5
    hold.set()
    w.wait(range(6))
    assert len(w.get_finished()) == 6
    hold.clear()
    for j in range(6, 12):
        w.submit_store(j, [0, 1], [0]) if j % 2 == 0 else w.submit_load(j, [0], [0, 1])
    assert w.pool_sizes == made  # reused, none made
    hold.set()
    w.shutdown()


def test_stores_rotate_writers_over_replicated_regions_in_one_plan():
    """Mixed replicated and private regions over two groups with skips, on both ranks of two: each job is one
    plan, its bytes are the oracle's for the layout's per-region writers, and the two ranks together write
    every replicated piece exactly once while each writes all of its private pieces."""
    from kvxfer.offload import HostLayout, Sharing
    dev = _device(5, n=3, groups=(0, 1, 0))
    tensors = tuple(t.model_copy(update={"sharing": Sharing.REPLICATED if i == 1 else Sharing.PRIVATE})
                    for i, t in enumerate(dev.tensors))
    m = BlockMapping(direction="d2h", src_ids=[3, 4, 5, 9, 10, 11, 12], dst_ids=[2, 7, 4, 0], group_sizes=(3, 4),
                     group_starts=(1, 2))
    replicated_pieces = []
    for rank in range(2):
        d = DeviceKV(dev.buffers, tensors, {k: v.copy() for k, v in dev.bindings.items()})
        w = create_worker(d, HostTier(num_chunks=NCH, blocks_per_chunk=K, layout=HostLayout.CANONICAL, pin=False),
                          lambda: NumpyExecutor(), tp=TPRank(size=2, rank=rank))
        writers = {r.name: (r.num_writers, r.writer_index) for r in w.layout.regions}
        assert writers == {"L0": (1, 0), "L1": (2, rank), "L2": (1, 0)}
        want = {**{k: v.copy() for k, v in d.bindings.items()}, "host": w.host.copy()}
        w.submit_store(1, m.src_ids, m.dst_ids, m.group_sizes, m.group_starts)
        assert len(w._pending[1].plan.buffers_used("src")) == 3  # one plan reads every region
        w.wait([1])
        (res,) = w.get_finished()
        copies = oc.oracle(w.layout, m)
        assert res.success and res.nbytes == copies.total_bytes
        oc.apply(copies, want)
        np.testing.assert_array_equal(w.host, want["host"])
        replicated_pieces.append({c for c in copies if c[0] == "d1"})
        everyone = oc.oracle(oc.everyone_writes(w.layout), m)
        assert {c for c in copies if c[0] != "d1"} == {c for c in everyone if c[0] != "d1"}
        w.shutdown()
    assert replicated_pieces[0] and replicated_pieces[1] and not replicated_pieces[0] & replicated_pieces[1]
    assert replicated_pieces[0] | replicated_pieces[1] == {c for c in everyone if c[0] == "d1"}


def test_target_of_numpy_worker_is_cpu():
    w = _worker({"kind": "numpy"})
    assert w.target == Target()
    w.shutdown()
