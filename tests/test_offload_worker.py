"""The offload worker in one process: ordering across lanes, per-layer completion, failures and the jobs that
depend on them, shutdown racing submissions, the caller's stream reaching every executor kind, file jobs that
never block submission; on the NumPy executor (background threads), on the CUDA batch executor over the C
driver shim (stream and event order replayed from the shim's record), and on an asynchronous runtime double
whose copies run later on its own thread (so lanes really race)."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import types

import numpy as np
import pytest

from kvxfer.executors import ExecutorError, NumpyExecutor, wait_on_host
from kvxfer.offload import (
    DependencyError,
    DeviceKV,
    FileLane,
    HostTier,
    KVTensor,
    OffloadError,
    SubmissionError,
    TPRank,
    WorkerClosedError,
    create_worker,
    spill_layout,
)
from kvxfer.planner import BlockMapping, Buffer, Location, Target
from kvxfer.testing import apply_copies, expected_copies

from . import offload_cases as oc
from .shims.build import build, compiler

COMPUTE = 77  # the caller's compute stream handle on the shim
NB, NCH, K, PAGE = 32, 12, 2, 64
TIMEOUT_S = 60  # harness timeouts: a correct worker never comes near them


def _device(seed=0, n=3, groups=(0, 0, 0)):
    rng = np.random.default_rng(seed)
    bind = {f"d{i}": rng.integers(0, 256, NB * PAGE, dtype=np.uint8) for i in range(n)}
    tensors = tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=PAGE, group=groups[i]) for i in range(n))
    return DeviceKV(tuple(Buffer(name=f"d{i}", nbytes=NB * PAGE, location=Location.DEVICE) for i in range(n)), tensors, bind)


@pytest.fixture(scope="module")
def shim_lib(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return str(build("fake_cuda", tmp_path_factory.mktemp("offload_worker_shim")))


class Made(list):
    """The executors a factory made, in order (store lane first)."""

    def factory(self, make):
        def f():
            self.append(make())
            return self[-1]
        return f


DOUBLES = {"numpy": oc.SlowNumpy, "async": oc.AsyncNumpy}


@pytest.fixture(params=["numpy", "cuda-shim", "async"])
def backend(request, shim_lib):
    """(executor factory, executors made, shim state or None, kind). The only place the tests inject the driver
    shim."""
    made, seeds = Made(), iter(range(100))
    if request.param in DOUBLES:
        return made.factory(lambda: DOUBLES[request.param](next(seeds))), made, None, request.param
    state = oc.shim_state(shim_lib)
    state.reset()
    return made.factory(oc.shim_factory(shim_lib)), made, state, request.param


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


def _joined(*threads):
    for t in threads:
        t.join(TIMEOUT_S)
    return not any(t.is_alive() for t in threads)


# ---- ordering ----------------------------------------------------------------------------------------------------
def test_fifty_interleaved_jobs_equal_a_sequential_replay(backend):
    factory, made, state, _ = backend
    dev = _device(1)
    w = _worker(factory, dev)
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy()}
    jobs = _random_jobs(50, seed=3)
    held = state is not None  # on the shim, copies finish at once: report them unfinished to exercise the order
    if held:
        rts = [(ex.runtime, ex.runtime.event_query) for ex in made]
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
        assert [op for op, *_ in state.log].count("stream") == 2  # the executors' copy streams: the worker makes none
    w.shutdown()


@pytest.mark.parametrize("kind", ["numpy", "async"])
def test_cross_lane_rule_is_what_makes_the_replay_hold(kind, monkeypatch):
    """Without the rule (no job ordered after another lane's), the racing lanes give other bytes. On the
    asynchronous double the race is real as on a GPU: copies run later, on another thread."""
    import kvxfer.offload.graph as gm
    monkeypatch.setattr(gm, "conflict", lambda a, b: False)
    make = DOUBLES[kind]
    mismatched = 0
    for seed in range(4):
        dev = _device(seed)
        seeds = iter(range(seed * 10, seed * 10 + 2))
        w = _worker(lambda: make(next(seeds)), dev)
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
    factory, made, state, _ = backend
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


def test_stores_rotate_writers_over_replicated_regions_in_one_plan():
    """Mixed replicated and private regions over two groups with skips, on both ranks of two: each job is one
    plan, its bytes are the oracle's for the layout's per-region writers, and the two ranks together write
    every replicated piece exactly once while each writes all of its private pieces."""
    from kvxfer.offload import HostLayout, Sharing

    class Recording(NumpyExecutor):
        plans: list = []

        def run(self, plan, memory, stream=None, after=None):
            self.plans.append(plan)
            return super().run(plan, memory, stream)

    dev = _device(5, n=3, groups=(0, 1, 0))
    tensors = tuple(t.model_copy(update={"sharing": Sharing.REPLICATED if i == 1 else Sharing.PRIVATE})
                    for i, t in enumerate(dev.tensors))
    m = BlockMapping(direction="d2h", src_ids=[3, 4, 5, 9, 10, 11, 12], dst_ids=[2, 7, 4, 0], group_sizes=(3, 4),
                     group_starts=(1, 2))
    replicated_pieces = []
    for rank in range(2):
        d = DeviceKV(dev.buffers, tensors, {k: v.copy() for k, v in dev.bindings.items()})
        ex = Recording()
        w = create_worker(d, HostTier(num_chunks=NCH, blocks_per_chunk=K, layout=HostLayout.CANONICAL, pin=False),
                          ex, tp=TPRank(size=2, rank=rank))
        writers = {r.name: (r.num_writers, r.writer_index) for r in w.layout.regions}
        assert writers == {"L0": (1, 0), "L1": (2, rank), "L2": (1, 0)}
        want = {**{k: v.copy() for k, v in d.bindings.items()}, "host": w.host.copy()}
        ex.plans.clear()
        w.submit_store(1, m.src_ids, m.dst_ids, m.group_sizes, m.group_starts)
        w.wait([1])
        (res,) = w.get_finished()
        assert len(ex.plans) == 1 and len(ex.plans[0].buffers_used("src")) == 3  # one plan reads every region
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


# ---- failures ----------------------------------------------------------------------------------------------------
def test_failed_job_is_reported_and_independent_later_jobs_run(backend):
    factory, made, state, kind = backend
    dev = _device(3)
    n_regions = 3
    if state is None:  # the job moving three blocks fails
        seeds = iter(range(2))
        w = _worker(lambda: DOUBLES[kind](next(seeds), fail=lambda plan: plan.total_bytes == 3 * PAGE * n_regions), dev)
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


def _files(w, **kw):
    """A file tier double attached to ``w``; returns it."""
    layout = spill_layout(w.geometry)
    tier = oc.FakeTier(layout, w.host, **kw)
    w.attach_files(FileLane(tier, layout))
    return tier


def _chunks_of(layout, plan, side):
    """Host chunk ids a spill/restore plan touches (by the file-side offsets of its ranges)."""
    off, region = getattr(plan, f"{side}_offset"), plan.region
    return {int(o - layout.regions[r].host.byte_offset) // layout.regions[r].page_bytes
            for o, r in zip(off.tolist(), region.tolist())}


def _poisoned_file_job(layout, chunk):
    def fail(op, plan):
        return chunk in _chunks_of(layout, plan, "dst" if op == "spill" else "src")
    return fail


POISON_BLOCK = NB - 1  # a device block only the jobs meant to fail touch


def _poisoned_run(plan):
    """Whether a store or load plan touches POISON_BLOCK of buffer d0."""
    for side in ("src", "dst"):
        buf, off = getattr(plan, f"{side}_buf"), getattr(plan, f"{side}_offset")
        on_d0 = np.array([plan.buffers[b].name == "d0" for b in range(len(plan.buffers))])[buf]
        if np.any(on_d0 & (off <= POISON_BLOCK * PAGE) & (POISON_BLOCK * PAGE < off + plan.nbytes)):
            return True
    return False


@pytest.mark.parametrize("kind", ["numpy", "async"])
def test_failure_reaches_the_jobs_that_read_its_bytes_and_only_those(kind):
    make = DOUBLES[kind]
    dev = _device(7)
    before = {k: v.copy() for k, v in dev.bindings.items()}
    w = _worker(lambda: make(1, fail=_poisoned_run), dev, regions_per_layer=None)
    tier = _files(w, fail=_poisoned_file_job(spill_layout(w.geometry), 3))
    try:
        w.submit_restore(1, [3])  # fails (the tier double refuses chunk 3)
        w.submit_load(2, [3], [20, 21])  # reads chunk 3: fails, naming job 1
        w.submit_store(3, [20, 21], [5])  # reads the blocks job 2 wrote: fails, naming job 2 (first failure: 1)
        w.submit_spill(4, [5])  # reads chunk 5: fails, naming job 3
        w.submit_load(5, [4], [22, 23])  # unrelated: runs
        w.submit_store(6, [0, 1], [3])  # overwrites chunk 3 after the failed restore: only ordered
        w.submit_load(7, [3], [24, 25])  # reads job 6's chunk 3: runs
        w.submit_store(8, [POISON_BLOCK, 2], [6])  # fails on its own
        w.submit_store(9, [2, 3], [7])  # runs; the newest store that job 10 conflicts with (it reads block 2)
        w.submit_load(10, [6], [2, 4])  # reads chunk 6, written by job 8 two stores back: fails, naming job 8
        w.wait(range(1, 11))
        res = {r.job_id: r for r in w.get_finished()}
    finally:
        w.shutdown()
    assert sorted(res) == list(range(1, 11))
    assert {j for j, r in res.items() if r.success} == {5, 6, 7, 9}
    assert isinstance(res[1].error, oc.BindingError) and isinstance(res[8].error, ExecutorError)
    for j, src, root in ((2, 1, 1), (3, 2, 1), (4, 3, 1), (10, 8, 8)):
        e = res[j].error
        assert isinstance(e, DependencyError) and (e.job_id, e.root_id) == (src, root), (j, e)
        assert f"reads what job {src} ({res[src].op}) was to write" in str(e) and res[j].nbytes == 0
    assert "which read from failed job 1 (restore)" in str(res[3].error)
    for i in range(3):  # the failed jobs copied nothing; the others did
        d = dev.bindings[f"d{i}"].reshape(NB, PAGE)
        b = before[f"d{i}"].reshape(NB, PAGE)
        np.testing.assert_array_equal(d[[20, 21]], b[[20, 21]])  # job 2 never ran
        np.testing.assert_array_equal(d[[24, 25]], b[[0, 1]])  # job 7: job 6's copy of blocks 0, 1
    assert [op for op, _ in tier.log] == ["restore"]  # the spill after a failure never reached the file


def _storm(n, seed):
    """Random stores, loads, spills and restores; some touch POISON_BLOCK (their run fails), some chunk 11
    (their file job fails)."""
    rng = np.random.default_rng(seed)
    jobs = []
    for j in range(n):
        op = rng.choice(["store", "load", "spill", "restore"], p=[0.35, 0.35, 0.15, 0.15])
        chunks = sorted(rng.choice(NCH, int(rng.integers(1, 3)), replace=False).tolist())
        if op in ("spill", "restore"):
            jobs.append((op, j, None, chunks))
            continue
        blocks = rng.choice(10, 2 * len(chunks), replace=False).tolist()
        if rng.random() < 0.1:
            blocks[0] = POISON_BLOCK
        jobs.append((op, j, blocks, chunks))
    return jobs


def _replay(w, layout, jobs, injected, arrays):
    """Sequential replay: a job fails when injected or when the last writer of an id it reads failed; a failed
    job copies nothing (here every failure is known before the job would start). Returns the failed ids."""
    writer, failed = {}, set()
    for op, j, blocks, chunks in jobs:
        dev, host = set(blocks or ()), set(chunks)
        reads = {"store": [("dev", dev)], "load": [("host", host)], "spill": [("host", host)], "restore": [("file", host)]}[op]
        writes = {"store": [("host", host)], "load": [("dev", dev)], "spill": [("file", host)], "restore": [("host", host)]}[op]
        if j in injected or any(writer.get((s, i)) in failed for s, ids in reads for i in ids):
            failed.add(j)
        elif op in ("store", "load"):
            oc.apply(oc.oracle(w.layout, _plain(op, blocks, chunks)), arrays)
        else:
            d = "d2h" if op == "spill" else "h2d"
            apply_copies(expected_copies(layout, BlockMapping(direction=d, src_ids=chunks, dst_ids=chunks)), arrays)
        for s, ids in writes:
            for i in ids:
                writer[(s, i)] = j
    return failed


def _plain(op, blocks, chunks):
    if op == "store":
        return BlockMapping(direction="d2h", src_ids=blocks, dst_ids=chunks, group_sizes=(len(blocks),))
    return BlockMapping(direction="h2d", src_ids=chunks, dst_ids=blocks, group_sizes=(len(blocks),))


@pytest.mark.parametrize("kind", ["numpy", "async"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_storms_with_failures_equal_a_sequential_replay(kind, seed):
    """Failed jobs, the jobs that read what they were to write (transitively, across lanes and the file tier),
    and every byte of every buffer and of the file equal a sequential replay in submission order."""
    make = DOUBLES[kind]
    dev = _device(seed + 20)
    seeds = iter(range(seed * 10, seed * 10 + 2))
    w = _worker(lambda: make(next(seeds), fail=_poisoned_run), dev, regions_per_layer=None)
    layout = spill_layout(w.geometry)
    tier = _files(w, fail=_poisoned_file_job(layout, NCH - 1))
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy(), "file": tier.file.copy()}
    jobs = _storm(70, seed)
    injected = {j for op, j, blocks, chunks in jobs
                if (blocks and POISON_BLOCK in blocks) or (op in ("spill", "restore") and NCH - 1 in chunks)}
    try:
        for op, j, blocks, chunks in jobs:
            if op == "store":
                assert w.submit_store(j, blocks, chunks, (len(blocks),))
            elif op == "load":
                assert w.submit_load(j, chunks, blocks, (len(blocks),))
            else:
                assert (w.submit_spill if op == "spill" else w.submit_restore)(j, chunks)
        w.wait(range(len(jobs)))
        results = {r.job_id: r for r in w.get_finished()}
    finally:
        w.shutdown()
    failed = _replay(w, layout, jobs, injected, want)
    assert injected and failed - injected, "the storm should hold failures and jobs that inherit them"
    assert {j for j, r in results.items() if not r.success} == failed
    for j in failed - injected:
        assert isinstance(results[j].error, DependencyError) and results[j].error.root_id in injected
    for name, arr in {**dev.bindings, "host": w.host, "file": tier.file}.items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_failure_found_only_on_the_device_still_fails_its_readers():
    """A failure the executor reports only when the copy is waited for (a device-side error): the readers ran,
    and are reported failed all the same, transitively."""
    ex = [oc.AsyncNumpy(1, fail_late=_poisoned_run), oc.AsyncNumpy(2, fail_late=_poisoned_run)]
    it = iter(ex)
    w = _worker(lambda: next(it), _device(9), regions_per_layer=None)
    hold = threading.Event()
    ex[0].gate = lambda plan: hold  # the store lane holds its copies, so the readers issue before the failure shows
    try:
        w.submit_store(1, [POISON_BLOCK, 3], [2])  # fails on the device
        w.submit_load(2, [2], [10, 11])  # reads chunk 2: issued now, fails later
        w.submit_store(3, [10, 11], [4])  # reads what job 2 wrote
        w.submit_store(4, [5, 6], [8])  # independent
        hold.set()
        w.wait(range(1, 5))
        res = {r.job_id: r for r in w.get_finished()}
    finally:
        w.shutdown()
    assert [res[j].success for j in range(1, 5)] == [False, False, False, True]
    assert isinstance(res[1].error, ExecutorError) and "on the device" in str(res[1].error)
    assert (res[2].error.job_id, res[3].error.job_id, res[3].error.root_id) == (1, 2, 1)


def test_shutdown_drains_jobs_in_flight_and_raises_unreported_failures():
    dev = _device(4)
    w = _worker(lambda: oc.SlowNumpy(1), dev)
    for j in range(10):
        w.submit_store(j, [2 * j % NB, (2 * j + 1) % NB], [j % NCH])
    w.shutdown()
    res = w.get_finished()
    assert [r.job_id for r in res] == list(range(10)) and all(r.success for r in res)
    with pytest.raises(WorkerClosedError, match="job 11"):
        w.submit_load(11, [0], [0, 1])
    ex = oc.SlowNumpy(2, fail=lambda plan: plan.total_bytes == K * PAGE * 3)
    w = _worker(lambda: ex, dev)
    w.submit_store(1, [0, 1], [0])
    with pytest.raises(OffloadError, match="job 1 \\(store\\) failed: memcpy failed") as e:
        w.shutdown()
    assert [r.job_id for r in e.value.results] == [1] and [r.job_id for r in w.get_finished()] == [1]


@pytest.mark.parametrize("kind", ["numpy", "async"])
def test_submissions_racing_shutdown_are_each_run_and_reported_or_refused(kind):
    """Threads submit while another shuts the worker down. Every submission returns True or raises
    WorkerClosedError; every accepted job ran, is reported exactly once, and waiting for it returns."""
    make = DOUBLES[kind]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # switch threads often: more interleavings per round
    try:
        for rnd in range(12):
            made = Made()
            w = _worker(made.factory(lambda: make(rnd, max_pause_s=0.0002)))
            accepted, refused, errors = [], [], []
            start = threading.Barrier(5)

            def submitter(t):
                start.wait()
                for i in range(30):
                    jid = 100 * t + i
                    try:
                        ok = (w.submit_store(jid, [t * 4 + i % 4], [(t * 3 + i) % NCH]) if (i + t) % 2 else
                              w.submit_load(jid, [(t * 3 + i) % NCH], [t * 4 + i % 4]))
                    except WorkerClosedError:
                        refused.append(jid)
                    except Exception as e:  # anything else is a defect (a deque mutated during iteration, ...)
                        errors.append(e)
                    else:
                        if ok is True:
                            accepted.append(jid)

            def closer():
                start.wait()
                for _ in range(int(np.random.default_rng(rnd).integers(0, 20000))):  # shut down mid-stream
                    pass
                try:
                    w.shutdown()
                except Exception as e:
                    errors.append(e)

            threads = [threading.Thread(target=submitter, args=(t,), daemon=True) for t in range(4)]
            threads.append(threading.Thread(target=closer, daemon=True))
            for t in threads:
                t.start()
            assert _joined(*threads), f"round {rnd}: a submitter or shutdown hung"
            assert not errors, errors
            waiter = threading.Thread(target=w.wait, args=(accepted,), daemon=True)
            waiter.start()
            assert _joined(waiter), f"round {rnd}: wait() on accepted jobs hung"
            ids = [r.job_id for r in w.get_finished()]
            assert sorted(ids) == sorted(accepted) and len(set(ids)) == len(ids), f"round {rnd}: lost or repeated jobs"
            assert len(accepted) + len(refused) == 120
            if kind == "numpy":
                assert sum(ex.runs for ex in made) == len(accepted)  # every accepted job really ran
            else:
                assert sum(len(ex.runs) for ex in made) == len(accepted)
    finally:
        sys.setswitchinterval(switch)


# ---- the caller's stream -----------------------------------------------------------------------------------------
class Wrapper:
    """A plain object in front of an executor (not an Executor subclass), recording the stream of every run."""

    synchronous = False

    def __init__(self, inner, seen):
        self.inner, self.seen = inner, seen

    @property
    def target(self):
        return self.inner.target

    def bind(self, buffers, bindings):
        return self.inner.bind(buffers, bindings)

    def run(self, plan, memory, stream=None, after=None):
        self.seen.append((plan.direction.value, stream))
        wait_on_host(after or ())
        return self.inner.run(plan, memory, stream=stream)

    def close(self):
        self.inner.close()


@pytest.mark.parametrize("kind", ["numpy", "cuda-shim", "wrapper", "auto"])
def test_every_executor_kind_receives_the_callers_stream(kind, shim_lib, monkeypatch):
    """The stream passed to submit reaches the executor; None becomes the submitting thread's current stream,
    resolved there, not on a lane thread (here torch's current stream is faked per thread)."""
    torch = pytest.importorskip("torch")
    local = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: types.SimpleNamespace(
        cuda_stream=getattr(local, "stream", 5)))
    local.stream = 1234  # this thread's current stream; any other thread's is 5
    seen: list = []
    state = oc.shim_state(shim_lib)
    state.reset()
    shim = oc.shim_factory(shim_lib)
    if kind == "numpy":
        class Recording(NumpyExecutor):
            def run(self, plan, memory, stream=None, after=None):
                seen.append((plan.direction.value, stream))
                return super().run(plan, memory, stream)
        factory = Recording
    elif kind == "cuda-shim":
        factory = shim
    elif kind == "wrapper":
        def factory():
            return Wrapper(shim(), seen)
    else:
        from kvxfer.executors import AutoExecutor, ExecutorConfig, ExecutorKind
        from kvxfer.planner import Platform

        def factory():
            return AutoExecutor(ExecutorConfig.load({"kind": "auto"}), platform=Platform.CUDA,
                                executors={ExecutorKind.CUDA_BATCH: Wrapper(shim(), seen),
                                           ExecutorKind.TRITON: Wrapper(shim(), seen)})
    w = _worker(factory)
    copy_streams = {a for op, a, _ in state.log if op == "stream"}
    w.submit_store(1, [0, 1], [0], stream=COMPUTE)
    w.submit_load(2, [5], [10, 11])
    w.wait([1, 2])
    assert all(r.success for r in w.get_finished())
    w.shutdown()
    if kind == "cuda-shim":  # the executor's copy stream waits for an event recorded on the caller's stream
        seen = list(zip(("d2h", "h2d"), [b for op, _, b in state.log if op == "record" and b not in copy_streams and b != 0]))
    assert sorted(seen) == [("d2h", COMPUTE), ("h2d", 1234)]  # the two lanes may run in either order


TRITON_SCRIPT = textwrap.dedent("""
    import numpy as np
    from kvxfer.executors import TritonExecutor
    from kvxfer.offload import DeviceKV, HostTier, KVTensor, create_worker
    from kvxfer.planner import Buffer
    seen = []
    class Recording(TritonExecutor):
        def run(self, plan, memory, stream=None, after=None):
            seen.append((plan.direction.value, stream))
            return super().run(plan, memory, stream)
    rng = np.random.default_rng(0)
    dev = DeviceKV(tuple(Buffer(name=f"d{i}", nbytes=32 * 64, location="device") for i in range(2)),
                   tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=64) for i in range(2)),
                   {f"d{i}": rng.integers(0, 256, 32 * 64, dtype=np.uint8) for i in range(2)})
    w = create_worker(dev, HostTier(num_chunks=12, blocks_per_chunk=2, row_align_bytes=1, pin=False), Recording)
    w.submit_store(1, [0, 1], [0], stream=77)
    w.submit_load(2, [0], [10, 11], stream=88)
    w.wait([1, 2])
    ok = [r.success for r in w.get_finished()]
    w.shutdown()
    same = all(np.array_equal(dev.bindings[k].reshape(32, 64)[[10, 11]], dev.bindings[k].reshape(32, 64)[[0, 1]])
               for k in dev.bindings)
    print("RESULT", sorted(seen), ok, same, flush=True)
""")


def test_triton_executor_under_the_worker_receives_the_callers_stream(tmp_path):
    """The real Triton executor (on the CPU, through the interpreter: a synchronous executor on a lane thread)."""
    pytest.importorskip("triton")
    pytest.importorskip("torch")
    script = tmp_path / "triton_worker.py"
    script.write_text(TRITON_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "TRITON_INTERPRET": "1"})
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    assert line, run.stdout[-2000:] + run.stderr[-2000:]
    assert line[0] == "RESULT [('d2h', 77), ('h2d', 88)] [True, True] True", line[0]


# ---- file jobs never block submission --------------------------------------------------------------------------
def test_jobs_waiting_for_a_file_job_are_issued_later_and_submission_never_blocks():
    ex = [oc.AsyncNumpy(1), oc.AsyncNumpy(2)]
    it = iter(ex)
    dev = _device(11)
    w = _worker(lambda: next(it), dev, regions_per_layer=1)
    release, started = threading.Event(), threading.Event()
    tier = _files(w, gate=lambda op, plan: release, started=lambda op, plan: started.set())
    layout = spill_layout(w.geometry)
    tier.file[:] = np.random.default_rng(3).integers(0, 256, tier.file.size, dtype=np.uint8)  # what a restore brings
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy(), "file": tier.file.copy()}
    try:
        assert w.submit_restore(1, [3])
        assert started.wait(TIMEOUT_S)  # the restore is in the tier now, held there until released
        done = []
        submit = threading.Thread(target=lambda: done.append((w.submit_load(2, [3], [20, 21], stream=COMPUTE),
                                                              w.submit_store(3, [0, 1], [3], stream=COMPUTE))))
        submit.start()
        assert _joined(submit) and done == [(True, True)]  # accepted while the restore is still held
        assert ex[0].runs == [] and ex[1].runs == []  # nothing issued: both wait for the restore
        waiters = [threading.Thread(target=f, daemon=True) for f in (
            lambda: w.wait_for_layer(2, 0), lambda: w.stream_wait_for_layer(2, 1, 99), lambda: w.wait([2, 3]))]
        for t in waiters:
            t.start()
        for t in waiters:
            t.join(0.2)
        assert all(t.is_alive() for t in waiters)  # they wait for the deferred load to be issued first
        release.set()
        assert _joined(*waiters)
        w.wait([1, 2, 3])
        res = {r.job_id: r for r in w.get_finished()}
    finally:
        release.set()
        w.shutdown()
    assert all(res[j].success for j in (1, 2, 3)), res
    (load,), (store,) = ex[1].runs, ex[0].runs  # issued by the file lane's thread once the restore was done,
    assert load[3] == store[3] == "kvxfer-offload-files" and load[1] == store[1] == COMPUTE  # with the caller's stream
    assert (99, 1) in ex[1].transfers[0].stream_waits  # the consumer stream waits on layer 1's call
    apply_copies(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[3], dst_ids=[3])), want)
    oc.apply(oc.oracle(w.layout, _plain("load", [20, 21], [3])), want)
    oc.apply(oc.oracle(w.layout, _plain("store", [0, 1], [3])), want)
    for name, arr in {**dev.bindings, "host": w.host}.items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_an_expedited_load_passes_queued_loads_it_does_not_conflict_with():
    """vLLM 0.34 marks some loads expedited: one may be issued before loads queued behind a file job, unless it
    touches what they touch; results still come in submission order, and the bytes equal a sequential replay."""
    ex = [oc.AsyncNumpy(1), oc.AsyncNumpy(2)]
    it = iter(ex)
    dev = _device(12)
    w = _worker(lambda: next(it), dev, regions_per_layer=None)
    release, started = threading.Event(), threading.Event()
    tier = _files(w, gate=lambda op, plan: release, started=lambda op, plan: started.set())
    layout = spill_layout(w.geometry)
    tier.file[:] = np.random.default_rng(4).integers(0, 256, tier.file.size, dtype=np.uint8)
    w.host[:] = np.random.default_rng(5).integers(0, 256, w.host.size, dtype=np.uint8)
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy(), "file": tier.file.copy()}
    try:
        assert w.submit_restore(1, [3])
        assert started.wait(TIMEOUT_S)  # held in the tier
        assert w.submit_load(2, [3], [20, 21])  # reads the restored chunk: waits for it
        assert w.submit_load(3, [5], [22, 23], expedited=True)  # passes job 2
        assert w.submit_load(4, [6], [20, 21], expedited=True)  # writes job 2's blocks: stays behind it
        assert w.submit_load(5, [7], [24, 25])  # not expedited: lane order
        assert [run[0].num_ranges > 0 for run in ex[1].runs] == [True]  # job 3 alone was issued
        release.set()
        w.wait([1, 2, 3, 4, 5])
        res = w.get_finished()
    finally:
        release.set()
        w.shutdown()
    assert [(r.job_id, r.success) for r in res] == [(1, True), (2, True), (3, True), (4, True), (5, True)]
    apply_copies(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[3], dst_ids=[3])), want)
    for chunk, blocks in (([3], [20, 21]), ([5], [22, 23]), ([6], [20, 21]), ([7], [24, 25])):
        oc.apply(oc.oracle(w.layout, _plain("load", blocks, chunk)), want)
    for name, arr in {**dev.bindings, "host": w.host}.items():
        np.testing.assert_array_equal(arr, want[name], err_msg=name)


def test_a_restore_waits_for_an_in_flight_load_that_reads_the_same_chunk():
    gate = threading.Event()
    ex = [oc.AsyncNumpy(1), oc.AsyncNumpy(2, gate=lambda plan: gate)]  # loads are slow: held until the gate opens
    it = iter(ex)
    dev = _device(12)
    w = _worker(lambda: next(it), dev, regions_per_layer=None)
    restore_started = threading.Event()
    tier = _files(w, started=lambda op, plan: restore_started.set())
    tier.file[:] = 7  # what the restore brings back
    w.host[:] = np.random.default_rng(4).integers(0, 8, w.host.size, dtype=np.uint8)  # what the load must read
    want = {**{k: v.copy() for k, v in dev.bindings.items()}, "host": w.host.copy()}
    oc.apply(oc.oracle(w.layout, _plain("load", [20, 21], [3])), want)
    try:
        w.submit_load(1, [3], [20, 21])  # held: reads chunk 3 later
        w.submit_restore(2, [3])  # overwrites chunk 3
        assert not restore_started.wait(0.5), "the restore overwrote chunk 3 before the load read it"
        gate.set()
        w.wait([1, 2])
        assert all(r.success for r in w.get_finished())
    finally:
        gate.set()
        w.shutdown()
    for name in dev.bindings:  # the load read chunk 3 as it was before the restore
        np.testing.assert_array_equal(dev.bindings[name], want[name], err_msg=name)
    assert np.all(w.host.reshape(-1)[w.geometry.cells[0].offset_bytes + 3 * K * PAGE:][:K * PAGE] == 7)


# ---- submissions -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,field,match", [
    ((5, [0, 1], [NCH]), "host_ids", rf"past the {NCH} chunks of {K} blocks of region 'L0' \(host side, buffer 'host'\)"),
    ((5, [0, NB], [1]), "device_ids", "past buffer"),
    ((5, [0, -1], [1]), "device_ids", "non-negative"),
    ((5, [0, 1], [1], (3,)), "device_ids", "past the end of the list"),
    ((5, [0, 1, 2], [1], (3,)), "host_ids", "past the end of the list"),
    ((5, [0, 1], [1], (2, 2)), "group_sizes", "1 KV-cache groups"),
    (("x", [0, 1], [1]), "job_id", "must be an integer"),
])
def test_bad_submission_raises_before_anything_is_queued(args, field, match):
    ex = oc.SlowNumpy(3)
    w = _worker(lambda: ex)
    with pytest.raises(SubmissionError, match=match) as e:
        w.submit_store(*args)
    assert e.value.field == field and e.value.job_id == args[0]
    assert w.get_finished() == [] and ex.runs == 0
    w.submit_store(5, [0, 1], [1])
    with pytest.raises(SubmissionError, match="still pending"):
        w.submit_load(5, [1], [0, 1])
    w.shutdown()
    assert [r.job_id for r in w.get_finished()] == [5]


def test_host_chunks_past_the_tier_are_refused_even_inside_padded_rows():
    """With rows padded to 4 KiB, chunk NCH of the first tensor still lies inside the host buffer (over the next
    tensor's chunk 0): refused by the planner, since the layout states the tier's chunk count, for every kind
    of job."""
    dev = _device(13)
    w = create_worker(dev, HostTier(num_chunks=NCH, blocks_per_chunk=K, pin=False), lambda: oc.SlowNumpy(0))
    _files(w)
    before = w.host.copy()
    try:
        for submit, field in ((lambda: w.submit_store(1, [0, 1], [NCH]), "host_ids"),
                              (lambda: w.submit_load(2, [3, NCH + 1], [0, 1, 2, 3]), "host_ids"),
                              (lambda: w.submit_spill(3, [NCH]), "chunk_ids"), (lambda: w.submit_restore(4, [NCH]), "chunk_ids")):
            with pytest.raises(SubmissionError, match=f"past the {NCH} (chunks of {K} )?blocks of region") as e:
                submit()  # (a file job's "blocks" are whole chunks of a cell)
            assert e.value.field == field
        assert w.get_finished() == []
    finally:
        w.shutdown()
    assert np.array_equal(w.host, before)


def test_target_of_numpy_worker_is_cpu():
    w = _worker({"kind": "numpy"})
    assert w.target == Target()
    w.shutdown()
