"""The worker's job graph as a value (``kvxfer.offload.graph``): event sequences replayed against it, no thread,
lock or executor involved. The same rules run under the worker's threads in test_offload_worker.py.

Lanes here: ``d2h`` and ``h2d`` pipelined (issue lanes, as on a GPU), ``files`` serial (a thread lane), and ``sync``
serial (a synchronous executor's lane)."""
from __future__ import annotations

import random

import numpy as np
import pytest

from kvxfer.offload import DependencyError
from kvxfer.offload.graph import GraphError, JobGraph

DEV, HOST, FILE = "device blocks", "host chunks", "file slots"


def ids(space, *xs):
    return ((space, np.unique(np.asarray(xs, dtype=np.int64))),)


def store(g, job, blocks, chunks, lane="d2h"):
    return g.accept(job, lane, "store", ids(DEV, *blocks), ids(HOST, *chunks))


def load(g, job, chunks, blocks, lane="h2d", expedited=False):
    return g.accept(job, lane, "load", ids(HOST, *chunks), ids(DEV, *blocks), expedited=expedited)


def spill(g, job, chunks):
    return g.accept(job, "files", "spill", ids(HOST, *chunks), ids(FILE, *chunks))


def restore(g, job, chunks):
    return g.accept(job, "files", "restore", ids(FILE, *chunks), ids(HOST, *chunks))


def graph():
    return JobGraph({"d2h": True, "h2d": True, "files": False})


def test_jobs_of_a_pipelined_lane_start_when_accepted_and_a_serial_lane_runs_one_at_a_time():
    g = graph()
    assert store(g, 1, [0], [0]) == [1] and store(g, 2, [1], [1]) == [2]
    assert spill(g, 3, [5]) == [3] and spill(g, 4, [6]) == []  # the files lane runs one job at a time
    assert g.settle(3) == [4]
    assert g.started("files") == [4] and g.started("d2h") == [1, 2]


def test_a_conflicting_job_of_another_pipelined_lane_starts_at_once_ordered_after_it():
    g = graph()
    store(g, 1, [0, 1], [3])
    assert load(g, 2, [3], [8, 9]) == [2]  # the executor orders it after the store
    assert g.after(2) == [1]
    assert load(g, 3, [4], [10]) == [3] and g.after(3) == []  # no conflict: nothing to order on
    g.settle(1)
    assert g.after(2) == []  # an ended job needs no ordering


def test_a_job_ordered_after_a_serial_lanes_job_starts_once_that_job_ended():
    g = graph()
    assert restore(g, 1, [3]) == [1]
    assert load(g, 2, [3], [0]) == []  # waits for the restore to be over
    assert store(g, 3, [5], [7]) == [3]  # another lane's unrelated job is not held back
    assert g.settle(1) == [2]


def test_a_lane_keeps_its_order_behind_a_job_that_waits():
    g = graph()
    restore(g, 1, [3])
    assert load(g, 2, [3], [0]) == [] and load(g, 3, [9], [1]) == []  # behind job 2 in its lane
    assert g.settle(1) == [2, 3]


def test_a_job_that_ended_at_once_still_orders_what_follows_after_the_older_jobs_of_its_lane():
    """On a pipelined lane a job that copies nothing (failed before it ran) ends at once, while older jobs of its
    lane still copy: ordering on it (its transfer is its lane's newest) is what covers them."""
    g = graph()
    restore(g, 10, [7])
    store(g, 1, [0], [3])  # still copying
    store(g, 2, [1], [3])  # the newest writer of chunk 3
    load(g, 3, [3, 7], [8])  # waits for the restore; ordered after job 2 (covering job 1)
    g.settle(2, RuntimeError("copied nothing"))
    assert g.settle(10) == [3]
    assert g.after(3) == [2]  # not done while job 1 copies
    g.settle(1)
    assert g.after(3) == []


def test_each_other_lane_contributes_only_its_newest_conflicting_job():
    g = graph()
    store(g, 1, [0], [3])
    store(g, 2, [1], [3])
    load(g, 3, [3], [5])
    assert g.after(3) == [2]  # lane order puts job 1 before job 2


def test_a_job_reading_what_a_failed_job_was_to_write_fails_before_it_starts_when_that_is_known():
    g = graph()
    restore(g, 1, [3])
    load(g, 2, [3], [0])
    boom = RuntimeError("torn chunk")
    assert g.settle(1, boom) == [2]
    err = g.failure(2)
    assert isinstance(err, DependencyError) and (err.job_id, err.op, err.root) == (1, "restore", boom)
    g.settle(2, err)  # the caller fails it without running it
    assert g.retire() == [(1, boom), (2, err)]


def test_a_failure_known_only_later_still_fails_the_reader_once_it_is_final():
    g = graph()
    store(g, 1, [0], [3])
    load(g, 2, [3], [8])  # started on the pipelined lane before the store's outcome is known
    assert g.failure(2) is None
    g.settle(2)  # its copies completed
    assert g.retire() == []  # not final while the store it read from has not ended
    boom = RuntimeError("store failed")
    g.settle(1, boom)
    (j1, e1), (j2, e2) = g.retire()
    assert (j1, e1, j2) == (1, boom, 2)
    assert isinstance(e2, DependencyError) and e2.job_id == 1 and e2.root is boom


def test_a_failure_reaches_the_whole_chain_naming_the_first_one():
    g = graph()
    restore(g, 1, [3])
    load(g, 2, [3], [0])
    store(g, 3, [0], [6])  # reads the blocks the load was to write
    boom = RuntimeError("bad file")
    g.settle(1, boom)
    g.settle(2, g.failure(2))
    g.settle(3)
    errors = dict(g.retire())
    assert errors[3].job_id == 2 and (errors[3].root_id, errors[3].root_op, errors[3].root) == (1, "restore", boom)


def test_a_job_that_only_overwrites_what_a_failed_job_touched_is_ordered_not_failed():
    g = graph()
    restore(g, 1, [3])
    assert restore(g, 2, [3]) == []  # writes chunk 3 again: ordered behind the first
    g.settle(1, RuntimeError("x"))
    assert g.failure(2) is None
    g.settle(2)
    assert [e is None for _, e in g.retire()] == [False, True]


def test_a_writer_known_to_have_succeeded_is_not_read_from():
    g = graph()
    store(g, 1, [0], [3])
    g.settle(1)  # final and successful, not yet retired
    load(g, 2, [3], [4])
    g.settle(2)
    assert g.unsettled(2) == [] and g.retire() == [(1, None), (2, None)]


def test_an_early_failure_stands_when_the_work_ends_and_orders_later_jobs_until_then():
    g = graph()
    store(g, 1, [0], [3])
    boom = RuntimeError("issue failed")
    g.fail(1, boom)  # part of it may be running still
    assert spill(g, 2, [3]) == [2] and g.after(2) == [1]  # still ordered after it
    assert isinstance(g.failure(2), DependencyError)
    g.settle(1)
    assert g.retire()[0] == (1, boom)


def test_results_retire_in_lane_order_and_in_acceptance_order_overall():
    g = graph()
    store(g, 1, [0], [0])
    store(g, 2, [1], [1])
    load(g, 3, [5], [9])
    g.settle(2)
    g.settle(3)
    assert g.retire() == [(3, None)]  # job 2 waits for job 1 in its lane
    g.settle(1)
    assert g.retire() == [(1, None), (2, None)]
    assert len(g) == 0


def test_unsettled_names_the_started_jobs_whose_end_would_tell_a_failure():
    g = graph()
    store(g, 1, [0], [3])
    load(g, 2, [3], [8])
    store(g, 3, [8], [4])
    assert g.unsettled(3) == [2]  # job 1 tells nothing more until job 2 has ended
    g.settle(2)
    assert g.unsettled(3) == [1]  # job 2 ended, not final: its source tells
    g.settle(1)
    assert g.unsettled(3) == []


def test_an_expedited_job_passes_the_waiting_jobs_it_does_not_conflict_with():
    g = graph()
    restore(g, 1, [3])
    assert load(g, 2, [3], [0, 1]) == []  # waits for the restore
    assert load(g, 3, [5], [2], expedited=True) == [3]  # passes it
    assert load(g, 4, [6], [0], expedited=True) == []  # writes block 0 as job 2 does: stays behind it
    assert load(g, 5, [7], [9]) == []  # not expedited: lane order
    assert g.settle(1) == [2, 4, 5]
    for j in (2, 3, 4, 5):
        g.settle(j)
    assert [j for j, _ in g.retire()] == [1, 2, 3, 4, 5]  # results keep lane order


def test_an_expedited_job_on_a_serial_lane_still_waits_for_the_running_one():
    g = JobGraph({"sync": False, "files": False})
    assert g.accept(1, "files", "restore", ids(FILE, 3), ids(HOST, 3)) == [1]
    assert g.accept(2, "sync", "load", ids(HOST, 3), ids(DEV, 0)) == []
    assert g.accept(3, "sync", "load", ids(HOST, 4), ids(DEV, 1), expedited=True) == [3]
    assert g.accept(4, "sync", "load", ids(HOST, 5), ids(DEV, 2), expedited=True) == []  # job 3 is running
    assert g.settle(3) == [4]
    assert g.settle(1) == []  # job 4 runs: job 2 waits for it
    assert g.settle(4) == [2]


def test_a_job_after_an_expedited_one_is_ordered_after_the_older_jobs_it_passed_too():
    g = graph()
    restore(g, 1, [3])
    load(g, 2, [3], [0])  # waits for the restore
    assert load(g, 3, [5], [1], expedited=True) == [3]  # passed job 2
    assert store(g, 4, [0, 1], [9]) == []  # reads what both loads write: job 3 having started is not enough
    assert sorted(g.after(4)) == [2, 3]
    assert g.settle(1) == [2, 4]


@pytest.mark.parametrize("event", ["accept twice", "unknown lane", "settle unstarted", "settle twice", "fail ended",
                                   "unknown job"])
def test_an_event_the_graph_cannot_take_is_refused_naming_it(event):
    g = graph()
    restore(g, 1, [3])
    load(g, 2, [3], [0])
    with pytest.raises(GraphError) as e:
        if event == "accept twice":
            store(g, 1, [0], [0])
        elif event == "unknown lane":
            g.accept(9, "nvme", "spill", ids(HOST, 1), ids(FILE, 1))
        elif event == "settle unstarted":
            g.settle(2)
        elif event == "settle twice":
            g.settle(1)
            g.settle(1)
        elif event == "fail ended":
            g.settle(1)
            g.fail(1, RuntimeError())
        else:
            g.settle(7)
    assert isinstance(e.value, ValueError) and e.value.job_id in (1, 2, 7, 9)


# ---- random event sequences against an independent model ----------------------------------------------------
LANES = {"d2h": True, "h2d": True, "files": False, "sync": False}
OPS = {"d2h": "store", "h2d": "load", "files": ("spill", "restore"), "sync": "load"}


def _random_job(rng, lane):
    op = OPS[lane] if isinstance(OPS[lane], str) else rng.choice(OPS[lane])
    a = rng.sample(range(4), rng.randint(1, 2))
    b = rng.sample(range(4), rng.randint(1, 2))
    reads, writes = {"store": (DEV, HOST), "load": (HOST, DEV), "spill": (HOST, FILE), "restore": (FILE, HOST)}[op]
    return op, ids(reads, *a), ids(writes, *b)


def _conflict(x, y):
    def meet(p, q):
        return any(s == t and set(u.tolist()) & set(v.tolist()) for s, u in p for t, v in q)
    return meet(x["reads"], y["writes"]) or meet(x["writes"], y["reads"]) or meet(x["writes"], y["writes"])


@pytest.mark.parametrize("seed", range(60))
def test_random_event_sequences_keep_every_rule(seed):
    """Accept, settle (some with errors) and retire in a random order; after each event check against a model
    written from the rules: lane order, cross-lane ordering of conflicting jobs, failures reaching exactly the
    jobs that read what a failed job was to write, each job retired once, in lane order."""
    rng = random.Random(seed)
    g = JobGraph(LANES)
    jobs: dict[int, dict] = {}  # the model's view of every job
    order: list[int] = []
    retired: list[int] = []
    next_id = 0
    for _ in range(120):
        live = [j for j in order if jobs[j]["started"] and not jobs[j]["ended"]]
        roll = rng.random()
        if roll < 0.45 and next_id < 40:
            lane = rng.choice(list(LANES))
            op, reads, writes = _random_job(rng, lane)
            pending = [jobs[j] for j in order if j not in retired]
            shape = {"reads": reads, "writes": writes}
            new = {"id": next_id, "lane": lane, "op": op, "reads": reads, "writes": writes, "started": False,
                   "ended": False, "own": None, "expedited": lane == "h2d" and rng.random() < 0.5,
                   # the model: the earlier pending jobs it must follow, by the rules
                   "lane_before": [p["id"] for p in pending if p["lane"] == lane],
                   "cross": [p["id"] for p in pending if p["lane"] != lane and _conflict(shape, p) and not p["ended"]],
                   "sources": _sources(reads, pending)}
            jobs[next_id] = new
            order.append(next_id)
            started = g.accept(next_id, lane, op, reads, writes, expedited=new["expedited"])
            next_id += 1
        elif roll < 0.85 and live:
            j = rng.choice(live)
            error = RuntimeError(f"job {j}") if rng.random() < 0.2 else None
            jobs[j]["ended"], jobs[j]["own"] = True, error
            started = g.settle(j, error)
        else:
            started = []
            for j, err in g.retire():
                retired.append(j)
                _check_error(jobs, j, err)
        for j in started:
            _check_start(jobs, j)
            _check_after(jobs, order, j, g.after(j))
            jobs[j]["started"] = True
    # drain: end everything, then everything retires once, each lane in order
    while True:
        live = [j for j in order if jobs[j]["started"] and not jobs[j]["ended"]]
        if not live:
            break
        for j in live:
            jobs[j]["ended"] = True
            for s in g.settle(j):
                _check_start(jobs, s)
                jobs[s]["started"] = True
    for j, err in g.retire():
        retired.append(j)
        _check_error(jobs, j, err)
    assert sorted(retired) == order and len(g) == 0
    for lane in LANES:
        mine = [j for j in retired if jobs[j]["lane"] == lane]
        assert mine == sorted(mine)


def _sources(reads, pending):
    """The model's last pending writer of each id read, newest first (one that succeeded for good adds no error)."""
    out, left = [], {(s, int(i)) for s, a in reads for i in a.tolist()}
    for p in reversed(pending):
        hit = {(s, int(i)) for s, a in p["writes"] for i in a.tolist()} & left
        if hit:
            out.append(p["id"])
            left -= hit
    return out


def _check_start(jobs, j):
    job = jobs[j]
    for b in job["lane_before"]:
        before = jobs[b]
        if job["expedited"] and not before["started"]:
            assert not _conflict(job, before), f"expedited job {j} passed job {b} it conflicts with"
            continue
        assert before["started"], f"job {j} started before job {b} of its lane"
        if not LANES[job["lane"]]:
            assert before["ended"], f"job {j} started on a serial lane while job {b} runs"
    for c in job["cross"]:
        other = jobs[c]
        assert other["ended"] or (other["started"] and LANES[other["lane"]]), f"job {j} started before job {c}"


def _check_after(jobs, order, j, after):
    """What the worker orders a starting job on covers every earlier conflicting job of another pipelined lane
    that may still copy: a job of that lane at least as new (its transfer completes after the older ones)."""
    for c in jobs[j]["cross"]:
        other = jobs[c]
        lane = [x for x in order if jobs[x]["lane"] == other["lane"]]
        done = all(jobs[x]["ended"] for x in lane[:lane.index(c) + 1])
        if LANES[other["lane"]] and not done:
            assert any(jobs[a]["lane"] == other["lane"] and lane.index(a) >= lane.index(c) for a in after), \
                f"job {j} starts without an order on job {c}, which may still copy (after: {after})"


def _expected_error(jobs, j):
    job = jobs[j]
    if job["own"] is not None:
        return job["own"]
    for s in job["sources"]:
        e = _expected_error(jobs, s)
        if e is not None:
            return e
    return None


def _check_error(jobs, j, err):
    """A retired job's error is its own, or a DependencyError whose root is the model's first failure it read."""
    expected = _expected_error(jobs, j)
    if jobs[j]["own"] is not None or expected is None:
        assert err is expected, (j, err, expected)
    else:
        assert isinstance(err, DependencyError) and err.root is expected, (j, err, expected)
