"""The POSIX file executor: plans between host memory and files as pread/pwrite on threads, against the oracle.

Round trips are compared byte for byte with per-block copies walked from the layout (``kvxfer.testing``),
untouched bytes included; merged ranges are one call each (cut into pieces above ``piece_bytes``); a short file,
a failed call and a plan with no file side are errors, never a run reported done.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer.executors import BindingError, ExecutorError, FileBinding, PosixFileExecutor, get_executor
from kvxfer.offload import FileTier, tier_layout
from kvxfer.planner import BlockMapping, plan_transfer, presets
from kvxfer.testing import apply_copies, expected_copies

REGIONS, BLOCKS, PAGE = 3, 32, 4096


@pytest.fixture
def executor():
    ex = PosixFileExecutor(threads=3, piece_bytes=2 * PAGE)
    yield ex
    ex.close()


def _setup(tmp_path, seed: int):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=2)
    mem = np.random.default_rng(seed).integers(0, 256, layout.buffers[0].nbytes, dtype=np.uint8)
    files = {b.name: FileBinding(tmp_path / f"{b.name}.kv", create=True) for b in layout.buffers[1:]}
    return layout, mem, files


@pytest.mark.parametrize("pattern", ["contiguous", "runs8", "descending", "fragmented"])
def test_round_trip_through_files_is_byte_exact(executor, tmp_path, pattern):
    layout, mem, files = _setup(tmp_path, seed=len(pattern))
    spill = presets.mapping(pattern, 12, BLOCKS, "d2h", seed=len(pattern))
    back = BlockMapping(direction="h2d", src_ids=spill.dst_ids, dst_ids=np.random.default_rng(3).permutation(BLOCKS)[:12])
    want = {"mem": mem.copy(), **{b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers[1:]}}
    apply_copies(expected_copies(layout, spill), want)
    bound = executor.bind(layout, {"mem": mem, **files})
    executor.run(plan_transfer(layout, spill), bound).wait()
    for name, fb in files.items():
        on_disk = np.fromfile(fb.path, np.uint8)
        assert np.array_equal(on_disk[:len(want[name])], want[name]), name
    mem[:] = 0xEE
    want["mem"][:] = 0xEE
    apply_copies(expected_copies(layout, back), want)
    t = executor.run(plan_transfer(layout, back), bound).wait()
    assert t.done() and t.elapsed_s is not None and np.array_equal(mem, want["mem"])
    bound.close()


def test_a_merged_range_is_one_call_per_piece(tmp_path):
    layout, mem, files = _setup(tmp_path, seed=1)
    with PosixFileExecutor(threads=2, piece_bytes=4 * PAGE) as ex:
        bound = ex.bind(layout, {"mem": mem, **files})
        plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=range(8), dst_ids=range(8)))
        assert plan.num_ranges == REGIONS  # one range per region: 8 pages each
        ex.run(plan, bound).wait()
        assert (ex.calls, ex.bytes_moved) == (REGIONS * 2, plan.total_bytes)  # 8 pages in pieces of 4


def test_a_short_file_is_a_failed_read_naming_the_call(executor, tmp_path):
    layout, mem, files = _setup(tmp_path, seed=2)
    bound = executor.bind(layout, {"mem": mem, **files})
    os.truncate(files["file0"].path, PAGE)
    t = executor.run(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[3], dst_ids=[0])), bound)
    with pytest.raises(ExecutorError) as e:
        t.wait()
    assert e.value.call == "pread" and "short read" in str(e.value)


def test_a_failed_write_names_the_call_and_the_errno(executor, tmp_path):
    layout, mem, files = _setup(tmp_path, seed=3)
    bound = executor.bind(layout, {"mem": mem, **files})
    os.close(files["file1"].fd)  # the descriptor goes away behind the binding
    files["file1"].fd = os.open(os.devnull, os.O_RDONLY)  # and its number now reads /dev/null: writes fail
    with pytest.raises(ExecutorError) as e:
        executor.run(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0])), bound).wait()
    assert e.value.call == "pwrite" and "errno 9" in str(e.value)


def test_a_plan_without_a_file_side_is_refused_before_any_io(executor):
    from kvxfer.planner import presets as p

    layout = p.kv_layout(num_regions=1, num_blocks=4, page_bytes=PAGE)
    host = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    with pytest.raises(BindingError, match="a file buffer binds to a FileBinding|both host memory"):
        executor.run(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[1])), host)


def test_file_tier_spills_and_restores_through_posix_calls(tmp_path):
    layout, mem, files = _setup(tmp_path, seed=4)
    ex = get_executor({"kind": "posix", "posix": {"threads": 2}})
    with FileTier(ex, layout, files, {"mem": mem}, chunk_bytes=PAGE) as tier:
        before = mem.copy()
        tier.spill(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1, 2], dst_ids=[9, 10, 11]))
                   ).raise_for_error()
        mem[:] = 0
        tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[9, 10, 11], dst_ids=[0, 1, 2]))
                     ).raise_for_error()
        got, want = mem.reshape(REGIONS, BLOCKS, PAGE), before.reshape(REGIONS, BLOCKS, PAGE)
        assert np.array_equal(got[:, :3], want[:, :3]) and not got[:, 3:].any()
    ex.close()
