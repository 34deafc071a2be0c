"""kvxfer's vLLM worker when things go wrong, without an engine: failed jobs reported instead of raised (under
kvxfer's connector), host chunks checked against their checksums (``kvxfer_verify``), and a counters file that
cannot be written. vLLM's own classes when installed (``make test-vllm``), stand-ins otherwise (test_vllm_spec).
"""
from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.offload import HostTier, SharedSpec
from kvxfer.offload.checksums import ChecksumError, HostChecksums
from kvxfer.offload.vllm import JobFailedError, StatsFile, WorkerCore, build_worker, read_caches

from .test_vllm_spec import PAGE, V, _caches, _layers, _mapping, _run
from .vllm.doubles import FailingRuns

torch = pytest.importorskip("torch")


def _worker(tensors: list[Any], executor: Any = None, *, k: int = 1, chunks: int = 8) -> Any:
    cmap = read_caches(_caches(tensors, [[0]]))
    return build_worker(cmap, HostTier(num_chunks=chunks, blocks_per_chunk=k), executor or NumpyExecutor(), pin=False,
                        barrier=None, creator=True)


def _verified(tensors: list[Any], **kw: Any) -> WorkerCore:
    worker = _worker(tensors, **kw)
    return WorkerCore(worker, V.Result, checksums=HostChecksums(worker.layout, worker.host, worker.geometry.num_chunks))


def _step(core: WorkerCore, *job_ids: int) -> list[tuple[int, bool]]:
    core.wait(set(job_ids))
    return [(r.job_id, r.success) for r in core.get_finished()]


def test_after_report_failures_a_failed_job_is_returned_failed_logged_and_counted(caplog: Any) -> None:
    tensors = _layers(1)
    before = tensors[0].clone()
    core = WorkerCore(_worker(tensors, FailingRuns({("d2h", 1)})), V.Result)
    core.report_failures()
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    with caplog.at_level(logging.WARNING, logger="kvxfer.offload.vllm"):
        assert _step(core, 1) == [(1, False)]
    assert "kvxfer offload job 1 (store) failed" in caplog.text and "test double: d2h run 1 fails" in caplog.text
    core.submit_store(2, V.GPU([4], [1], [0]), V.CPU([3]))
    core.submit_load(3, V.CPU([3]), V.GPU([7], [1], [0]))
    assert _step(core, 2, 3) == [(2, True), (3, True)]  # the worker goes on
    assert torch.equal(tensors[0][7], before[4])
    s = core.stats
    assert (s.stores, s.stores_failed, s.loads, s.loads_failed, s.blocks_stored) == (1, 1, 1, 0, 1)
    core.shutdown()


def test_without_report_failures_a_failed_job_stops_the_caller_with_job_failed_error() -> None:
    core = WorkerCore(_worker(_layers(1), FailingRuns({("h2d", 1)})), V.Result)
    core.submit_load(7, V.CPU([1]), V.GPU([2], [1], [0]))
    core.wait({7})
    with pytest.raises(JobFailedError, match=r"job 7 \(load\) failed.*OffloadingConnector cannot take a failed job"):
        core.get_finished()
    core.shutdown()


def test_a_host_chunk_changed_after_its_store_fails_the_load_before_any_byte_is_copied() -> None:
    tensors = _layers(1)
    before = tensors[0].clone()
    core = _verified(tensors, k=2)
    core.report_failures()
    core.submit_store(1, V.GPU([1, 2, 3, 4], [4], [0]), V.CPU([0, 1]))
    assert _step(core, 1) == [(1, True)]
    core.worker.host[PAGE + 5] ^= 0x40  # one bit of chunk 0's second page, at rest
    core.submit_load(2, V.CPU([0]), V.GPU([8, 9], [2], [0]))
    core.submit_load(3, V.CPU([1]), V.GPU([10, 11], [2], [0]))
    assert _step(core, 2, 3) == [(2, False), (3, True)]
    assert torch.equal(tensors[0][8:10], before[8:10])  # the refused load copied nothing
    assert torch.equal(tensors[0][10:12], before[3:5])
    s = core.stats
    assert (s.loads, s.loads_failed, s.loads_refused) == (1, 1, 1) and s.verify_s > 0
    core.shutdown()


def test_a_chunk_never_stored_or_being_rewritten_is_refused_and_a_restore_passes() -> None:
    tensors = _layers(1)
    core = _verified(tensors)
    core.report_failures()
    core.submit_load(1, V.CPU([5]), V.GPU([2], [1], [0]))  # nothing was stored into chunk 5
    core.submit_store(2, V.GPU([3], [1], [0]), V.CPU([4]))
    assert _step(core, 1, 2) == [(1, False), (2, True)]
    core.worker.host[4 * PAGE] ^= 1
    core.worker.host[4 * PAGE] ^= 1  # changed and changed back: the bytes match again
    core.submit_load(3, V.CPU([4]), V.GPU([9], [1], [0]))
    assert _step(core, 3) == [(3, True)]
    core.shutdown()


def test_a_checksum_failure_under_vllms_own_connector_raises_naming_the_chunk() -> None:
    core = _verified(_layers(1))
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    _step(core, 1)
    core.worker.host[2 * PAGE] ^= 0xFF
    core.submit_load(2, V.CPU([2]), V.GPU([5], [1], [0]))
    with pytest.raises(JobFailedError, match=r"job 2 \(load\) failed: ChecksumError.*host chunk\(s\) \[2\]") as e:
        core.get_finished()
    assert isinstance(e.value.__cause__, ChecksumError) and e.value.__cause__.chunks == [2]
    core.shutdown()


def test_checksums_of_head_sharded_cells_cover_this_ranks_slices_only(tmp_path: Path) -> None:
    # rank 0 of 2 in a shared canonical region: its slices are the even 32-byte pieces of each 2-page row
    (t,) = _layers(1)
    rows = _mapping(2 * PAGE, (_run(0, 0, 32, PAGE // 32, 32, 64),))
    cmap = read_caches(_caches([t], [[0]], {(0, 0): rows}), rank=0, world_size=2, canonical=True)
    tier = HostTier(num_chunks=4, layout=cmap.layout, shared=SharedSpec(name=f"test-{uuid.uuid4().hex[:12]}",
                                                                         directory=str(tmp_path), create=True))
    worker = build_worker(cmap, tier, NumpyExecutor(), pin=False, barrier=None, creator=True)
    sums = HostChecksums(worker.layout, worker.host, 4)
    core = WorkerCore(worker, V.Result, checksums=sums)
    core.report_failures()
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([1]))
    _step(core, 1)
    row = worker.geometry.row_stride_bytes
    worker.host[row + 32] ^= 0xFF  # rank 1's first piece of chunk 1: not rank 0's bytes
    assert sums.check([1]) == []
    worker.host[row + 64] ^= 0xFF  # rank 0's second piece
    assert sums.check([1]) == [1]
    core.shutdown()


def test_checksums_refuse_pages_whose_stores_rotate_writers() -> None:
    replicated = _mapping(PAGE, (_run(0, 0, PAGE, 1, PAGE, PAGE),), writers=2, index=1)
    cmap = read_caches(_caches(_layers(1), [[0]], {(0, 0): replicated}), rank=1, world_size=2, canonical=True)
    layout_tier = HostTier(num_chunks=2, layout=cmap.layout)
    from kvxfer.offload import build_layout, make_geometry

    geometry = make_geometry(cmap.device.tensors, layout_tier, cmap.tp)
    layout = build_layout(cmap.device.buffers, cmap.device.tensors, geometry, cmap.tp)
    with pytest.raises(ValueError, match="rotates 2 writers over the ranks"):
        HostChecksums(layout, np.zeros(geometry.nbytes, np.uint8), 2)


def test_a_counters_file_that_cannot_be_written_is_logged_once_and_never_fails_a_step(tmp_path: Path,
                                                                                      caplog: Any) -> None:
    folder = tmp_path / "gone"
    folder.mkdir()
    core = WorkerCore(_worker(_layers(1)), V.Result, stats_path=folder / "stats.json")
    folder.rmdir()  # removed under the running engine
    with caplog.at_level(logging.WARNING, logger="kvxfer.offload.vllm"):
        for job in (1, 2):
            core.submit_store(job, V.GPU([job], [1], [0]), V.CPU([job]))
            assert _step(core, job) == [(job, True)]
        core.shutdown()
    failures = [r for r in caplog.records if "writing the counters" in r.getMessage()]
    assert len(failures) == 1 and str(folder / "stats.json") in failures[0].getMessage()


def test_the_counters_file_catches_up_with_the_newest_update(tmp_path: Path) -> None:
    stats = StatsFile(tmp_path / "s.json")
    for i in range(50):
        stats.update({"steps": i})
    assert stats.flush(10.0)
    assert (tmp_path / "s.json").read_text().replace(" ", "").replace("\n", "") == '{"steps":49}'
    stats.close({"steps": 50})
    assert '"steps": 50' in (tmp_path / "s.json").read_text()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.json"]


def test_a_store_that_failed_records_no_checksum_so_a_load_of_its_chunk_is_refused() -> None:
    tensors = _layers(1)
    core = _verified(tensors, executor=FailingRuns({("d2h", 1)}))
    core.report_failures()
    core.submit_store(1, V.GPU([3], [1], [0]), V.CPU([2]))
    assert _step(core, 1) == [(1, False)]
    core.submit_load(2, V.CPU([2]), V.GPU([9], [1], [0]))  # the host chunk holds no stored bytes
    assert _step(core, 2) == [(2, False)] and core.stats.loads_refused == 1
    core.shutdown()
