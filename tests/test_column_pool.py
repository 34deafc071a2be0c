"""ColumnPool (planner/column_pool.py): large offset columns are reused only once nothing refers to them.

Reuse is observed through the pool itself (how many arrays it holds, and whether a returned array is one of
them), never through addresses alone: the C allocator may hand freed memory back at the same address.
"""
from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Callable

import numpy as np
import pytest

from kvxfer.planner import (
    COLUMNS,
    Buffer,
    Layout,
    Location,
    Placement,
    PlanOptions,
    Region,
    TransferPlan,
    column_pool,
    plan_transfer,
    presets,
)
from kvxfer.planner.column_pool import POOL_MIN, ColumnPool

GIL_CPYTHON = sys.implementation.name == "cpython" and getattr(sys, "_is_gil_enabled", lambda: True)()
pytestmark = pytest.mark.skipif(not GIL_CPYTHON, reason="pooling is off by design outside CPython with the GIL")

OFFSETS = ("src_offset", "dst_offset")


def pooled(pool: ColumnPool, a: np.ndarray) -> bool:
    """Whether ``a`` views one of the arrays the pool holds (no reference to them is kept)."""
    return pool.holds(a)


# ---- reuse and its safety -----------------------------------------------------------------------------------
def test_pooling_is_on_in_cpython_with_the_gil():
    assert column_pool.FREE > 0


@pytest.mark.parametrize("n", [POOL_MIN, POOL_MIN + 1, 3 * POOL_MIN])
def test_array_is_reused_once_it_is_dropped(n):
    pool = ColumnPool()
    a = pool.take(n)[0]
    assert a.dtype == np.int64 and a.shape == (n,) and pooled(pool, a)
    assert len(pool) == 1
    del a
    b = pool.take(n)[0]
    assert len(pool) == 1 and pooled(pool, b), "a dropped array must be handed out again"
    del b
    c = pool.take(max(n - 7, POOL_MIN))[0]  # a smaller request fits the same array
    assert len(pool) == 1 and pooled(pool, c)


def _keep_whole(a):
    return a


def _keep_slice(a):
    return a[5:17]


def _keep_uint64_view(a):
    return a.view(np.uint64)


def _keep_view_of_view(a):
    return a[3:].view(np.uint64)[::2][1:]


def _keep_memoryview(a):
    return memoryview(a)


def _keep_frombuffer(a):
    return np.frombuffer(a, dtype=np.uint8)


def _keep_readonly_view(a):
    v = a[:]
    v.flags.writeable = False
    return v


KEEPERS = [_keep_whole, _keep_slice, _keep_uint64_view, _keep_view_of_view, _keep_memoryview, _keep_frombuffer,
           _keep_readonly_view]


@pytest.mark.parametrize("keep", KEEPERS, ids=lambda f: f.__name__[6:])
def test_array_is_not_reused_while_anything_views_it(keep):
    pool = ColumnPool()
    a = pool.take(POOL_MIN)[0]
    a[:] = 7
    kept = keep(a)
    snapshot = np.array(np.asarray(kept), copy=True)
    del a
    b = pool.take(POOL_MIN)[0]
    b[:] = -1
    assert not np.shares_memory(np.asarray(kept), b)
    assert len(pool) == 2
    assert np.array_equal(np.asarray(kept), snapshot)
    del b, kept
    c = pool.take(POOL_MIN)[0]  # both are free again: one of them comes back, nothing new is made
    assert len(pool) == 2 and pooled(pool, c)


def test_small_arrays_are_never_pooled():
    pool = ColumnPool()
    for n in (0, 1, 100, POOL_MIN - 1):
        a = pool.take(n)[0]
        assert a.shape == (n,) and a.dtype == np.int64
        assert a.base is None  # a fresh array that owns its memory
        b = pool.take(n)[0]
        assert not (n and np.shares_memory(a, b))
        del a, b
    assert len(pool) == 0 and pool.nbytes == 0


def test_pooling_is_off_without_trustworthy_reference_counts(monkeypatch):
    """With FREE == 0 (not CPython, or free-threaded) every call returns fresh memory and the pool holds none."""
    monkeypatch.setattr(column_pool, "FREE", 0)
    pool = ColumnPool()
    for n in (POOL_MIN, 2 * POOL_MIN, POOL_MIN):
        a = pool.take(n)[0]
        assert a.shape == (n,) and a.base is None
        a[:] = n
        del a
    assert len(pool) == 0 and pool.nbytes == 0


# ---- caps -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("slots, max_bytes", [(3, 1 << 30), (8, 5 * POOL_MIN * 8), (2, 3 * POOL_MIN * 8), (1, 1)])
def test_slot_and_byte_caps_hold_with_many_arrays_alive(slots, max_bytes):
    pool = ColumnPool(slots=slots, max_bytes=max_bytes)
    rng = np.random.default_rng(slots)
    live: list[tuple[int, np.ndarray]] = []
    for i in range(24):
        n = int(rng.integers(POOL_MIN, 3 * POOL_MIN))
        a = pool.take(n)[0]
        assert a.shape == (n,) and a.dtype == np.int64
        a[:] = i
        assert not any(np.shares_memory(a, b) for _, b in live)
        live.append((i, a))
        del a
        assert len(pool) <= slots and pool.nbytes <= max_bytes
        if i % 5 == 4:  # drop some, so that later calls can reuse or evict them
            del live[int(rng.integers(len(live)))]
    for i, a in live:  # nobody wrote over anybody
        assert bool((a == i).all())
    assert len(pool) <= slots and pool.nbytes <= max_bytes


def test_every_slot_busy_gives_correct_fresh_arrays():
    pool = ColumnPool(slots=2)
    held = [pool.take(POOL_MIN)[0] for _ in range(2)]
    assert len(pool) == 2
    extra = [pool.take(POOL_MIN + i)[0] for i in range(3)]  # no free slot: fresh, not pooled
    assert len(pool) == 2
    for i, a in enumerate(extra):
        assert a.shape == (POOL_MIN + i,) and a.dtype == np.int64 and not pooled(pool, a)
    everything = held + extra
    for i, a in enumerate(everything):
        a[:] = i
    for i, a in enumerate(everything):
        assert bool((a == i).all())
    del everything, held[0], a
    again = pool.take(POOL_MIN)[0]
    assert pooled(pool, again) and not any(np.shares_memory(again, a) for a in held + extra)


def test_a_request_larger_than_the_byte_cap_is_served_unpooled():
    pool = ColumnPool(max_bytes=POOL_MIN * 8)
    a = pool.take(4 * POOL_MIN)[0]
    assert a.shape == (4 * POOL_MIN,) and not pooled(pool, a)
    assert pool.nbytes <= POOL_MIN * 8


# ---- threads ------------------------------------------------------------------------------------------------
def _storm(pool: ColumnPool, steps: int, size: Callable[[random.Random], int],
           pause: Callable[[int], None]) -> list[str]:
    """8 threads each take ``steps`` arrays from ``pool``, in turn: check that no live holder shares the memory,
    fill it, ``pause(step)``, check the contents, drop it. Returns what went wrong."""
    live: dict[int, np.ndarray] = {}  # holder token -> its array, while held
    lock = threading.Lock()
    errors: list[str] = []
    start = threading.Barrier(8)

    def work(tid: int) -> None:
        rng = random.Random(tid)
        start.wait()
        for step in range(steps):
            a = pool.take(size(rng))[0]
            token = tid * 1000 + step
            with lock:
                clash = [t for t, b in live.items() if np.shares_memory(a, b)]
                live[token] = a
            if clash:
                errors.append(f"thread {tid} got memory held by {clash}")
            a.fill(token)
            pause(step)
            if not bool((a == token).all()):
                errors.append(f"thread {tid} step {step}: contents changed while held")
            with lock:
                del live[token]
            del a

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def test_threads_never_share_a_live_array():
    """8 threads take, fill, yield, verify and drop arrays of random sizes from one pool."""
    pool = ColumnPool()
    errors = _storm(pool, 150, lambda rng: rng.randrange(POOL_MIN // 2, 3 * POOL_MIN),
                    lambda step: time.sleep(0 if step % 3 == 0 else 0.0001))
    assert not errors, errors[:5]
    assert len(pool) <= pool.slots and pool.nbytes <= pool.max_bytes
    assert len(pool) > 0  # the pool was used


def test_threads_never_share_an_array_even_when_switched_inside_the_hand_out():
    """A thread switch forced between finding a free array and claiming it (inside ``ColumnPool.take``) must not
    let another thread claim the same array: 8 threads, a switch interval of a microsecond, and every reference
    count read followed by a yield."""
    def count_then_yield(owners: list[np.ndarray], i: int) -> int:
        n = column_pool.count_of(owners, i)
        time.sleep(0)  # another thread runs here, between the check and the claim
        return n

    pool = ColumnPool(slots=4, count=count_then_yield)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        errors = _storm(pool, 60, lambda rng: POOL_MIN, lambda step: time.sleep(0))
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:5]
    assert 0 < len(pool) <= pool.slots


# ---- through the planner --------------------------------------------------------------------------------------
NREG, NBLOCKS, NPAIRS = 64, 2048, 1024  # 64 x 1024 fragmented pairs: 65,536 ranges per offset column


def _kv_layout() -> Layout:
    """All regions dense: every region takes the same id runs (one block of rows)."""
    return presets.kv_layout(NREG, NBLOCKS, 256, shared_host=False)


def _mixed_layout() -> Layout:
    """Half the regions dense, half with padded rows: the regions' ranges assembled part by part."""
    buffers, regions = [], []
    for r in range(NREG):
        stride = 256 if r % 2 else 512
        buffers += [Buffer(name=f"g{r}", nbytes=NBLOCKS * stride), Buffer(name=f"h{r}", nbytes=NBLOCKS * 256,
                                                                         location=Location.HOST)]
        regions.append(Region(name=f"kv{r}", page_bytes=256, device=Placement(buffer=f"g{r}", stride_bytes=stride),
                              host=Placement(buffer=f"h{r}")))
    return Layout(buffers=buffers, regions=regions)


def _job(seed: int, direction: str) -> dict:
    s, d = presets.block_pattern("fragmented", NPAIRS, NBLOCKS, seed)
    return {"direction": direction, "src_ids": s.astype(np.int64), "dst_ids": d.astype(np.int64)}


def _offset_memory_disjoint(a: TransferPlan, b: TransferPlan) -> bool:
    return not any(np.shares_memory(a.column(x), b.column(y)) for x in OFFSETS for y in OFFSETS)


@pytest.mark.parametrize("make_layout", [_kv_layout, _mixed_layout], ids=["dense", "mixed"])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_plans_alive_together_never_share_offset_memory(make_layout, direction):
    layout = make_layout()
    pool = layout.info.pool
    first = plan_transfer(layout, _job(1, direction))
    assert first.num_ranges == NREG * NPAIRS > POOL_MIN
    assert all(pooled(pool, first.column(c)) for c in OFFSETS), "the offset columns come from the layout's pool"
    fingerprint = first.fingerprint
    kept = {c: first.column(c).copy() for c in COLUMNS}
    second = plan_transfer(layout, _job(2, direction))
    assert _offset_memory_disjoint(first, second)
    for seed in range(3, 8):  # more jobs, each dropped: they may take each other's memory, never first's or second's
        p = plan_transfer(layout, _job(seed, direction))
        assert _offset_memory_disjoint(p, first) and _offset_memory_disjoint(p, second)
        del p
    for c, v in kept.items():
        assert np.array_equal(first.column(c), v), f"{c} of a live plan changed"
    assert plan_transfer(layout, _job(1, direction)).fingerprint == fingerprint
    assert len(pool) <= pool.slots and pool.nbytes <= pool.max_bytes


@pytest.mark.parametrize("make_layout", [_kv_layout, _mixed_layout], ids=["dense", "mixed"])
def test_a_dropped_plans_memory_is_reused_by_a_later_plan(make_layout):
    layout = make_layout()
    pool = layout.info.pool
    first = plan_transfer(layout, _job(1, "h2d"))
    second = plan_transfer(layout, _job(2, "h2d"))
    held = len(pool)
    assert held >= 4  # two offset columns per live plan
    want = second.fingerprint
    del first
    reused = 0
    for seed in range(3, 6):
        p = plan_transfer(layout, _job(seed, "h2d"))
        assert _offset_memory_disjoint(p, second)
        reused += all(pooled(pool, p.column(c)) for c in OFFSETS)
        assert len(pool) == held, "a free array was available: nothing new is kept"
        del p
    assert reused >= 1
    assert second.fingerprint == want and plan_transfer(layout, _job(2, "h2d")) == second


def test_plans_with_pooling_off_are_the_same(monkeypatch):
    layout = _kv_layout()
    want = plan_transfer(layout, _job(4, "d2h"), options=PlanOptions(coalesce=False)).fingerprint
    monkeypatch.setattr(column_pool, "FREE", 0)
    fresh = _kv_layout()
    plan = plan_transfer(fresh, _job(4, "d2h"), options=PlanOptions(coalesce=False))
    assert plan.fingerprint == want
    assert len(fresh.info.pool) == 0
    assert all(not pooled(fresh.info.pool, plan.column(c)) for c in OFFSETS)
