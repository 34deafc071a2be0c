"""The batched host copier (``executors/_host_copy``) and the NumPy executor's use of it: byte for byte what one
slice assignment per range gives, sentinels included, from many threads at once; every byte of a job in exactly
one thread's share; the executor's refusals before any byte moves; and today's paths where numba is missing."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.executors import BindingError, ExecutorConfig, ExecutorError, NumpyExecutor, _host_copy
from kvxfer.executors._host_copy import HostCopier, even_shares
from kvxfer.executors._ops_numpy import HostPath
from kvxfer.planner import PlanError
from kvxfer.planner.optional import MissingDependencyError

from .test_exec_numpy import LAYOUT, SIZE, random_plan, reference

numba_only = pytest.mark.skipif(HostCopier.load() is None, reason="numba is not installed (pip install 'kvxfer[fast]')")


def _bytes(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> list[tuple[int, int]]:
    return [(int(d) + i, int(s) + i) for d, s, n in zip(dst, src, nbytes) for i in range(int(n))]


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(1, 40), min_size=1, max_size=30), st.integers(1, 9))
def test_shares_hold_every_byte_once_in_order_and_no_empty_range(sizes, parts):
    nbytes = np.array(sizes, np.uint64)
    dst = np.cumsum(nbytes, dtype=np.uint64) * np.uint64(3)  # any distinct addresses
    src = dst + np.uint64(10_000)
    shares = even_shares(dst, src, nbytes, parts)
    assert len(shares) <= parts
    assert [b for share in shares for b in _bytes(*share)] == _bytes(dst, src, nbytes)
    assert all(len(n) and (n > 0).all() for _, _, n in shares)
    share_bytes = [int(n.sum()) for _, _, n in shares]
    assert max(share_bytes) - min(share_bytes) <= 1  # equal shares


@numba_only
@pytest.mark.parametrize("threads", [1, 2, 5])
def test_the_copier_equals_one_slice_assignment_per_range_from_many_threads_at_once(threads):
    """Eight Python threads run random plans through one executor at once, each on its own buffers (random bytes:
    every untouched byte a sentinel); each ends byte for byte as the reference."""
    ex = NumpyExecutor(copier_threads=threads)
    errors: list[BaseException] = []

    def job(seed: int) -> None:
        try:
            for k in range(3):
                plan = random_plan(10 * seed + k)
                rng = np.random.default_rng(seed * 31 + k)
                bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
                want = reference(plan, bufs)
                bound = ex.bind(LAYOUT, bufs)
                ex.run(plan, bound)
                assert all(np.array_equal(bufs[n], want[n]) for n in bufs)
        except BaseException as e:  # reported by the main thread
            errors.append(e)
    workers = [threading.Thread(target=job, args=(s,)) for s in range(8)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    ex.close()
    assert not errors, errors[0]
    assert ex.paths(random_plan(1))[HostPath.COPIER][0] == random_plan(1).num_ranges


@numba_only
def test_the_copier_refuses_before_any_byte_moves():
    """Every refusal of the executor stands with the copier: a range past its buffer (a column written after the
    check), a read-only destination, memory whose owner moved it; nothing is written."""
    ex = NumpyExecutor()
    assert ex.host_copier() is not None
    rng = np.random.default_rng(3)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    before = {k: v.copy() for k, v in bufs.items()}

    plan = random_plan(2)
    assert plan.check().checked
    offsets = plan.column("dst_offset").copy()
    offsets[-1] = SIZE - 1  # written after the check: the range ends past its buffer
    plan._store["dst_offset"] = offsets
    plan._dense.clear()
    with pytest.raises(PlanError, match="dst_offset"):
        ex.run(plan, bufs)
    assert all(np.array_equal(bufs[k], before[k]) for k in bufs)

    plan = random_plan(2)
    ro = {k: v.copy() for k, v in bufs.items()}
    for v in ro.values():
        v.flags.writeable = False
    with pytest.raises(BindingError, match="read-only"):
        ex.run(plan, ro)

    owner = np.zeros(3 * SIZE, np.uint8)
    views = {b.name: owner[i * SIZE:(i + 1) * SIZE] for i, b in enumerate(LAYOUT.buffers)}
    bound = ex.bind(LAYOUT, views)
    owner.__setstate__((1, (3 * SIZE,), np.dtype(np.uint8), False, bytes(3 * SIZE)))  # frees the bound memory
    with pytest.raises(BindingError):
        ex.run(plan, bound)


@numba_only
def test_a_failing_copy_is_an_executor_error_never_done(monkeypatch):
    ex = NumpyExecutor()
    copier = ex.host_copier()

    def fails(*_):
        raise RuntimeError("can't start new thread")
    monkeypatch.setattr(copier, "copy", fails)
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers}
    with pytest.raises(ExecutorError, match="^host copy failed at chunk 0, descriptor 0: RuntimeError: can't start"):
        ex.run(random_plan(1), bufs)


def test_without_numba_the_executor_keeps_its_own_paths_and_says_why(monkeypatch):
    def missing():
        raise MissingDependencyError("numba", "the batched host copier", ImportError("No module named 'numba'"))
    monkeypatch.setattr(_host_copy, "kernel", missing)
    ex = NumpyExecutor()
    plan = random_plan(6)
    assert ex.host_copier() is None
    assert ex.paths(plan)[HostPath.COPIER] == (0, 0) and ex.paths(plan)[HostPath.WINDOW][0] > 0
    assert "copier: numba not installed" in ex.explain(plan)
    assert "copier off" in NumpyExecutor(copier=False).explain(plan)
    rng = np.random.default_rng(8)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    want = reference(plan, bufs)
    ex.run(plan, bufs)
    assert all(np.array_equal(bufs[k], want[k]) for k in bufs)


def test_the_copier_options_come_from_config_and_environment():
    c = ExecutorConfig.load(env={"KVXFER_NUMPY_COPIER": "0", "KVXFER_NUMPY_COPIER_THREADS": "2"})
    assert c.numpy.copier is False and c.numpy.copier_threads == 2
    ex = NumpyExecutor.from_options(c.numpy)
    assert (ex.copier, ex.copier_threads, ex.host_copier()) == (False, 2, None)
    with pytest.raises(ValueError, match="copier_threads"):
        NumpyExecutor(copier_threads=0)
    with pytest.raises(ValueError, match="KVXFER_NUMPY_COPIER"):
        ExecutorConfig.load(env={"KVXFER_NUMPY_COPIER": "maybe"})


def _large_job(seed: int, size: int) -> tuple[np.ndarray, np.ndarray, list[tuple[int, int, int]]]:
    """Two buffers of ``size`` random bytes and about ``size / 3`` bytes of ranges (offsets in the destination,
    offsets in the source, sizes) that overlap nothing: unaligned starts, odd sizes, pages found at random, and
    runs adjacent on both sides (the copier takes them as one copy)."""
    rng = np.random.default_rng(seed)
    src, dst = (rng.integers(0, 256, size, dtype=np.uint8) for _ in range(2))
    slot, groups, k = size // 512, [], 0
    while k < 512:  # destination slots in groups of one, or of two holding two adjacent ranges
        m = 2 if k < 511 and rng.random() < 0.3 else 1
        groups.append((k, m))
        k += m
    ranges = []
    for m in (1, 2):  # each group reads a group of as many slots, found at random
        mine = [g for g in groups if g[1] == m]
        for (d, _), (s, _) in zip(mine, [mine[i] for i in rng.permutation(len(mine))]):
            if m == 2:
                pad = int(rng.integers(0, slot))
                ranges += [(d * slot + pad, s * slot + pad, slot - pad), ((d + 1) * slot, (s + 1) * slot,
                                                                          int(rng.integers(1, slot)))]
            else:
                n = int(rng.integers(1, slot))  # an odd size anywhere in its slot: unaligned on both sides
                ranges.append((d * slot + int(rng.integers(0, slot - n + 1)), s * slot + int(rng.integers(0, slot - n + 1)), n))
    return src, dst, ranges


@numba_only
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("size", [1 << 20, 64 << 20])  # below and above the size written around the caches
def test_large_jobs_copy_byte_for_byte_with_streaming_stores_and_merged_neighbours(threads, size):
    """Jobs above STREAM_BYTES take streaming stores (aligned heads, 128-byte bodies, ragged tails), neighbours
    merge: every byte as one slice assignment per range gives, every other byte untouched, on 1-3 threads."""
    copier = HostCopier.load(threads)
    src, dst, ranges = _large_job(threads * 7 + size % 97, size)
    want = dst.copy()
    src_ranges = []
    for d, s, n in ranges:
        src_ranges.append((s, n))
        want[d:d + n] = src[s:s + n]
    if size > _host_copy.STREAM_BYTES:
        assert sum(n for _, _, n in ranges) >= _host_copy.STREAM_BYTES
    cols = [np.array([dst.ctypes.data + d for d, _, _ in ranges], np.uint64),
            np.array([src.ctypes.data + s for _, s, _ in ranges], np.uint64),
            np.array([n for _, _, n in ranges], np.uint64)]
    for c in cols:
        c.flags.writeable = False  # as lowering hands them over
    copier.copy(*cols)
    copier.close()
    assert np.array_equal(dst, want)


@numba_only
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shift", [0, 16, 63])  # where the destination buffer starts against a 64-byte line
def test_streamed_jobs_of_small_copies_at_every_line_offset_copy_byte_for_byte(threads, shift):
    """A job above STREAM_BYTES made of copies around STREAM_RANGE (one byte below it, at it, just above, a
    line or two above) at every offset against the destination's cache lines: the lines streamed, the partial
    lines at either end copied plainly, every byte as a slice assignment gives it, the gaps between untouched."""
    rng = np.random.default_rng(threads * 100 + shift)
    floor = _host_copy.STREAM_RANGE
    sizes = [floor - 1, floor, floor + 1, floor + 63, floor + 64, floor + 127, floor + 130, 2 * floor + 5, 64, 1]
    slot = 2 * floor + 256
    count = _host_copy.STREAM_BYTES * len(sizes) // sum(sizes) + 64  # enough bytes to stream
    raw_src = rng.integers(0, 256, count * slot + 64, dtype=np.uint8)
    raw_dst = rng.integers(0, 256, count * slot + 64, dtype=np.uint8)
    src, dst = raw_src[(-raw_src.ctypes.data) % 64:], raw_dst[(-raw_dst.ctypes.data + shift) % 64:]
    ranges = []
    for d_slot, s_slot in zip(range(count), rng.permutation(count)):
        n = sizes[d_slot % len(sizes)]
        ranges.append((d_slot * slot + int(rng.integers(0, slot - n)), int(s_slot) * slot + int(rng.integers(0, 200)), n))
    assert sum(n for _, _, n in ranges) >= _host_copy.STREAM_BYTES
    want = dst.copy()
    for d, s, n in ranges:
        want[d:d + n] = src[s:s + n]
    cols = [np.array([dst.ctypes.data + d for d, _, _ in ranges], np.uint64),
            np.array([src.ctypes.data + s for _, s, _ in ranges], np.uint64),
            np.array([n for _, _, n in ranges], np.uint64)]
    copier = HostCopier.load(threads)
    copier.copy(*cols)
    copier.close()
    assert np.array_equal(dst, want)


@numba_only
def test_a_job_compiles_nothing_the_loop_and_lowering_were_compiled_at_bind():
    """The copy loop and lowering's pass hold the signatures compiled at bind, for the read-only arrays lowering
    hands over: a job never compiles (numba would otherwise compile another version inside the first job)."""
    from kvxfer.executors import _lower_kernel
    ex = NumpyExecutor()
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers}
    bound = ex.bind(LAYOUT, bufs)
    copy_loop, add_bounded = _host_copy.kernel(), _lower_kernel.kernel()
    before = (list(copy_loop.signatures), list(add_bounded.signatures))  # type: ignore[attr-defined]
    assert (len(before[0]), len(before[1])) == (1, 2)  # lowering's: contiguous arrays, and any layout
    ex.run(random_plan(4), bound)
    assert (list(copy_loop.signatures), list(add_bounded.signatures)) == before  # type: ignore[attr-defined]


@numba_only
@pytest.mark.parametrize("step", [1, 2])  # contiguous arrays, and strided ones (the second signature)
def test_lowerings_pass_writes_base_plus_offset_and_says_whether_every_run_is_inside(step):
    """The compiled pass (contiguous arrays, and strided ones through its second signature): every address is
    base + offset modulo 2^64; it answers True only while every run's addresses lie in [base, limit], so an
    offset one byte past its run's last start, and a sum that wraps past 2^64, both answer False."""
    from kvxfer.executors import _lower_kernel
    add_bounded = _lower_kernel.kernel()
    lengths = np.array([3, 1, 7, 5], np.int64)
    bases = np.array([1 << 40, 1 << 41, (1 << 64) - 4096, 7], np.uint64)  # run 2 ends exactly at 2^64
    offs = np.random.default_rng(step).integers(0, 4096, int(lengths.sum()), dtype=np.uint64)
    limits = bases + np.uint64(4095)  # each run's last start: its base + 4095

    def run(offsets: np.ndarray) -> tuple[bool, list[int]]:
        def wide(a: np.ndarray) -> np.ndarray:  # the same values, strided when step > 1
            return np.repeat(a, step)[::step]
        out = np.zeros(len(offsets) * step, np.uint64)
        ok = add_bounded(wide(offsets), wide(bases), wide(lengths), wide(limits), out[::step])
        return ok, out[::step].tolist()

    ok, got = run(offs)
    assert ok is True and got == (np.repeat(bases, lengths) + offs).tolist()
    past = offs.copy()
    past[0] = np.uint64(4096)  # one byte past run 0's last start
    assert run(past)[0] is False
    wraps = offs.copy()
    wraps[5] = np.uint64(4096)  # run 2: 2^64 - 4096 + 4096 wraps to 0, below its base
    ok, got = run(wraps)
    assert ok is False and got[5] == 0
