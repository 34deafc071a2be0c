"""The offload worker's file tier on NIXL's real POSIX backend: store to host, spill to a file, drop the host
copy, restore from the file, load to other device blocks; every byte checked against the oracle
(``kvxfer.testing``). Plus a restore of never-spilled chunks (reported failed, later jobs still run) and bad
submissions (refused before anything is queued)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.executors.nixl_peer import LOOPBACK_ENV
from kvxfer.offload import DeviceKV, HostTier, KVTensor, SharedSpec, SubmissionError, create_worker
from kvxfer.planner import BlockMapping, Buffer, Location
from kvxfer.testing import apply_copies, expected_copies

for _k, _v in LOOPBACK_ENV.items():  # set before nixl loads UCX (kvxfer imports it lazily)
    os.environ.setdefault(_k, _v)
pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install 'kvxfer[nixl]')")

from kvxfer.offload import attach_files  # noqa: E402
from kvxfer.offload.files.file_tier import IntegrityError  # noqa: E402

NB, NCH, K, PAGE = 32, 12, 2, 4096


@pytest.fixture(scope="module")
def executor():
    from kvxfer.executors.config import get_executor

    ex = get_executor({"kind": "nixl", "nixl": {"backends": ["POSIX"], "poll_timeout_s": 20.0}})
    yield ex
    ex.close()


def _device(seed: int) -> DeviceKV:
    rng = np.random.default_rng(seed)
    bind = {f"d{i}": rng.integers(0, 256, NB * PAGE, dtype=np.uint8) for i in range(3)}
    tensors = tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=PAGE // (i + 1)) for i in range(3))
    bufs = tuple(Buffer(name=f"d{i}", nbytes=NB * PAGE, location=Location.DEVICE) for i in range(3))
    return DeviceKV(bufs, tensors, bind)


def _worker(executor, disk, seed=0, **kw):
    device = _device(seed)
    worker = create_worker(device, HostTier(num_chunks=NCH, blocks_per_chunk=K, pin=False, **kw), NumpyExecutor())
    attach_files(worker, disk / "spill.kv", executor=executor)
    return worker, device


@pytest.mark.parametrize("host", ["private", "padded", "shared"])
def test_store_spill_drop_restore_load_is_byte_exact(executor, disk, host):
    kw = {"private": {"row_align_bytes": 1}, "padded": {"row_align_bytes": 4096},  # tensor-major chunks
          "shared": {"shared": SharedSpec(name=f"kvxfer-files-{os.getpid()}", directory=str(disk), create=True)}}
    worker, device = _worker(executor, disk, seed=1, **kw[host])  # shared: row-major rows, padded to 4 KiB
    assert all((c.stride_bytes is None) == (host == "shared") for c in worker.geometry.cells)
    src, chunks, dst = [3, 0, 7, 8, 20, 21], [9, 2, 5], [30, 11, 12, 13, 1, 2]
    store = BlockMapping(direction="d2h", src_ids=src, dst_ids=chunks, group_sizes=(len(src),))
    load = BlockMapping(direction="h2d", src_ids=chunks, dst_ids=dst, group_sizes=(len(dst),))
    want = {n: np.array(a, copy=True) for n, a in device.bindings.items()} | {"host": np.zeros_like(worker.host)}
    apply_copies(expected_copies(worker.layout, store), want)
    try:
        assert worker.submit_store(0, src, chunks)
        assert worker.submit_spill(1, chunks)  # ordered after the store on its own: no wait in between
        worker.wait([1])
        spilled = worker.host.copy()
        assert np.array_equal(spilled, want["host"])
        worker.host[:] = 0  # drop the host copy
        assert worker.submit_restore(2, chunks)
        assert worker.submit_load(3, chunks, dst)  # ordered after the restore
        worker.wait(range(4))
        results = {r.job_id: r for r in worker.get_finished()}
        apply_copies(expected_copies(worker.layout, load), want)
        for n, a in want.items():
            got = worker.host if n == "host" else device.bindings[n]
            bad = np.flatnonzero(got != a)
            assert bad.size == 0, f"{n}: {bad.size} bytes differ, first at {bad[:1]}"
        assert [results[j].op for j in range(4)] == ["store", "spill", "restore", "load"]
        cell_bytes = sum(t.page_bytes for t in device.tensors) * K * len(chunks)
        for j in range(4):
            r = results[j]
            assert r.success and r.error is None, r
            assert r.nbytes == cell_bytes, r
            assert r.elapsed_s >= 0 and r.num_ranges >= 1
    finally:
        worker.shutdown()


def test_restore_of_never_spilled_chunks_fails_and_later_jobs_run(executor, disk):
    worker, device = _worker(executor, disk, seed=2, row_align_bytes=1)
    want = {n: np.array(a, copy=True) for n, a in device.bindings.items()}
    try:
        worker.submit_store(0, [0, 1], [4])
        worker.submit_spill(1, [4])
        worker.submit_restore(2, [4, 6])  # chunk 6 never spilled
        worker.submit_store(3, [2, 3], [6])  # waits for the failed restore, then runs
        worker.submit_spill(4, [6])
        worker.submit_restore(5, [6])
        worker.submit_load(6, [6], [10, 11])
        worker.wait(range(7))
        results = {r.job_id: r for r in worker.get_finished()}
        assert sorted(results) == list(range(7))
        bad = results[2]
        assert not bad.success and bad.nbytes == 0 and bad.op == "restore"
        assert isinstance(bad.error, IntegrityError) and "never spilled" in str(bad.error), bad.error
        assert all(results[j].success for j in (0, 1, 3, 4, 5, 6)), results
        for i, t in enumerate(device.tensors):  # block b of tensor i: bytes [b*page, (b+1)*page) of d{i}
            got = device.bindings[f"d{i}"][:NB * t.page_bytes].reshape(NB, -1)
            orig = want[f"d{i}"][:NB * t.page_bytes].reshape(NB, -1)
            assert np.array_equal(got[[10, 11]], orig[[2, 3]]), t.name  # chunk 6 went store->spill->restore->load
            assert np.array_equal(got[:10], orig[:10]) and np.array_equal(got[12:], orig[12:]), t.name
    finally:
        worker.shutdown()


def test_bad_file_submissions_are_refused_before_queueing(executor, disk):
    worker, device = _worker(executor, disk, seed=3, row_align_bytes=1)
    try:
        with pytest.raises(SubmissionError) as e:
            worker.submit_spill(0, [NCH])
        assert e.value.job_id == 0 and e.value.field.startswith("chunk_ids") and e.value.value == NCH
        with pytest.raises(SubmissionError) as e:
            worker.submit_restore(1, [1, 1])
        assert e.value.field.startswith("chunk_ids")
        with pytest.raises(SubmissionError) as e:
            worker.submit_restore("x", [1])
        assert e.value.field == "job_id"
        worker.submit_store(2, [0, 1], [1])
        with pytest.raises(SubmissionError) as e:
            worker.submit_spill(2, [1])
        assert e.value.field == "job_id" and "pending" in e.value.reason
        worker.wait([0, 1, 2])
        assert [(r.job_id, r.op, r.success) for r in worker.get_finished()] == [(2, "store", True)]
    finally:
        worker.shutdown()
    plain = create_worker(_device(4), HostTier(num_chunks=NCH, blocks_per_chunk=K, pin=False), NumpyExecutor())
    try:
        with pytest.raises(SubmissionError, match="no file tier"):
            plain.submit_spill(0, [0])
    finally:
        plain.shutdown()


def test_a_load_after_a_failed_restore_is_failed_naming_the_restore(executor, disk):
    """The restore finds a torn chunk (a byte flipped on disk); the load ordered after it must not report the
    bytes it would copy as a success, and later jobs that read what the load wrote fail too."""
    from kvxfer.offload import DependencyError

    worker, device = _worker(executor, disk, seed=5, row_align_bytes=1)
    before = {n: np.array(a, copy=True) for n, a in device.bindings.items()}
    try:
        worker.submit_store(0, [0, 1, 2, 3], [4, 5])
        worker.submit_spill(1, [4, 5])
        worker.wait([0, 1])
        with open(disk / "spill.kv", "r+b") as f:  # tear chunk 4 of the first cell on disk
            f.seek(4 * K * PAGE + 10)
            byte = f.read(1)
            f.seek(4 * K * PAGE + 10)
            f.write(bytes([byte[0] ^ 0xFF]))
        worker.host[:] = 0
        worker.submit_restore(2, [4, 5])  # fails: chunk 4 is torn
        worker.submit_load(3, [4, 5], [20, 21, 22, 23])  # reads what the restore was to bring back
        worker.submit_store(4, [20, 21], [7])  # reads what the load was to write
        worker.submit_load(5, [9], [30, 31])  # unrelated
        worker.wait(range(6))
        res = {r.job_id: r for r in worker.get_finished()}
    finally:
        worker.shutdown()
    assert not res[2].success and isinstance(res[2].error, IntegrityError)
    for j, src in ((3, 2), (4, 3)):
        assert not res[j].success and res[j].nbytes == 0 and isinstance(res[j].error, DependencyError), res[j]
        assert res[j].error.job_id == src and res[j].error.root_id == 2 and "IntegrityError" in str(res[j].error)
    assert res[0].success and res[1].success and res[5].success
    for i, t in enumerate(device.tensors):  # the failed load copied nothing into blocks 20-23
        got = device.bindings[f"d{i}"][:NB * t.page_bytes].reshape(NB, -1)
        assert np.array_equal(got[20:24], before[f"d{i}"][:NB * t.page_bytes].reshape(NB, -1)[20:24]), t.name
