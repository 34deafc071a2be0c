"""The POSIX file executor: plans between host memory and files as pread/pwrite on threads, against the oracle.

Round trips are compared byte for byte with per-block copies walked from the layout (``kvxfer.testing``),
untouched bytes included; merged ranges are one call each (cut into pieces above ``piece_bytes``); a short file,
a failed call and a plan with no file side are errors, never a run reported done.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer.executors import BindingError, CompletedTransfer, ExecutorError, FileBinding, PosixFileExecutor, get_executor
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


def test_ranges_end_to_end_in_a_file_but_apart_in_memory_go_in_vectored_calls(tmp_path):
    """Pages scattered in memory, written to (and read back from) consecutive file pages: one pwritev/preadv per
    run of them (at most piece_bytes a call), byte for byte as the oracle, untouched bytes included."""
    layout, mem, files = _setup(tmp_path, seed=4)
    scattered = np.random.default_rng(4).permutation(BLOCKS)[:8]
    spill = BlockMapping(direction="d2h", src_ids=scattered, dst_ids=range(8))
    want = {"mem": mem.copy(), **{b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers[1:]}}
    apply_copies(expected_copies(layout, spill), want)
    with PosixFileExecutor(threads=1, piece_bytes=8 * PAGE) as ex:
        bound = ex.bind(layout, {"mem": mem, **files})
        plan = plan_transfer(layout, spill)
        assert plan.num_ranges == 8 * REGIONS
        ex.run(plan, bound).wait()
        assert ex.calls <= REGIONS and ex.bytes_moved == plan.total_bytes
        for name, fb in files.items():
            assert np.array_equal(np.fromfile(fb.path, np.uint8)[:len(want[name])], want[name]), name
        back = BlockMapping(direction="h2d", src_ids=range(8), dst_ids=scattered[::-1])
        mem[:] = 0xEE
        want["mem"][:] = 0xEE
        apply_copies(expected_copies(layout, back), want)
        ex.run(plan_transfer(layout, back), bound).wait()
        assert ex.calls <= 2 * REGIONS and np.array_equal(mem, want["mem"])
        bound.close()


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
    ro = os.open(files["file1"].path, os.O_RDONLY)  # the same file, opened for reading only
    os.dup2(ro, files["file1"].fd)  # replaces the binding's descriptor behind it: writes fail (EBADF)
    os.close(ro)
    with pytest.raises(ExecutorError) as e:
        executor.run(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0])), bound).wait()
    assert e.value.call == "pwrite" and "errno 9" in str(e.value)


@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_a_descriptor_closed_behind_the_binding_and_reused_is_refused_and_the_other_file_untouched(executor, tmp_path,
                                                                                                   direction):
    """The binding's descriptor is closed behind it and its number goes to another file: a run (a write or a read)
    is refused before any I/O, naming the buffer, and the other file keeps its bytes (never written, never read
    into memory as if it were the spill file)."""
    layout, mem, files = _setup(tmp_path, seed=6)
    bound = executor.bind(layout, {"mem": mem, **files})
    fd = files["file1"].fd
    other = tmp_path / "unrelated.bin"
    other.write_bytes(bytes(range(256)) * 64)
    os.close(fd)
    reused = _reuse(fd, other)
    before = mem.copy()
    mapping = BlockMapping(direction=direction, src_ids=[0, 1, 2], dst_ids=[4, 5, 6])
    try:
        with pytest.raises(BindingError, match=r"^bindings\['file1'\] = fd \d+ of .*file1\.kv'?: the descriptor was closed "
                           "and now refers to another file$"):
            executor.run(plan_transfer(layout, mapping), bound)
    finally:
        os.close(reused)
    assert other.read_bytes() == bytes(range(256)) * 64
    assert np.array_equal(mem, before)


class Meanwhile(CompletedTransfer):
    """A transfer a run waits for (``after``) that runs ``act`` while the run waits: what another thread could do
    between the run's checks and its I/O."""

    def __init__(self, act):
        super().__init__(nbytes=0, ranges=0, calls=1)
        self.act = act

    def wait(self) -> Meanwhile:
        self.act()
        return self


def test_a_run_writes_through_its_own_descriptor_whatever_happens_to_the_bindings_meanwhile(tmp_path):
    """A run's I/O goes through descriptors of its own, checked before it waits for ``after``: the binding's
    descriptor closed and its number reused while the run waits changes nothing it writes, and the run's
    descriptors are closed once it has finished."""
    layout, mem, files = _setup(tmp_path, seed=7)
    other = tmp_path / "unrelated.bin"
    other.write_bytes(b"\x5a" * 4096)
    reused: list[int] = []

    def close_and_reuse() -> None:
        fd = files["file0"].fd
        os.close(fd)
        reused.append(_reuse(fd, other))

    with PosixFileExecutor(threads=2, piece_bytes=PAGE) as ex:
        bound = ex.bind(layout, {"mem": mem, **files})
        mapping = BlockMapping(direction="d2h", src_ids=list(range(16)), dst_ids=list(range(16)))
        want = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers[1:]} | {"mem": mem.copy()}
        apply_copies(expected_copies(layout, mapping), want)
        open_before = len(os.listdir("/proc/self/fd"))
        try:
            ex.run(plan_transfer(layout, mapping), bound, after=Meanwhile(close_and_reuse)).wait()
        finally:
            for fd in reused:
                os.close(fd)
        assert other.read_bytes() == b"\x5a" * 4096, "the run wrote into the file that took the descriptor's number"
        for name in ("file0", "file1"):
            on_disk = np.fromfile(files[name].path, np.uint8)
            assert np.array_equal(on_disk[:len(want[name])], want[name]), name
        assert len(os.listdir("/proc/self/fd")) == open_before - 1  # file0's closed; the run's own are closed too


def _reuse(fd: int, path) -> int:
    """Open ``path`` under the number ``fd`` (closed just before), as the next open of a process would."""
    other = os.open(path, os.O_RDWR)
    if other != fd:
        os.dup2(other, fd)
        os.close(other)
    return fd


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


@pytest.mark.parametrize("threads", [1, 3])
def test_a_large_restore_checksums_pieces_as_they_land_and_still_refuses_a_corrupted_chunk(tmp_path, threads):
    """A verified restore of 12 MiB on the POSIX executor (pieces of 1 MiB holding whole chunks of 64 KiB) has
    each piece checksummed as it lands, on the tier's CRC threads: the right chunks pass byte for byte, and one
    byte flipped in the file is refused naming its chunk, exactly as the pass after the read refuses it."""
    chunk, blocks = 64 << 10, 64
    layout = tier_layout(3, blocks, chunk)  # 3 regions x 64 pages of 64 KiB: 12 MiB
    mem = np.random.default_rng(threads).integers(0, 256, layout.buffers[0].nbytes, dtype=np.uint8)
    path = tmp_path / "file0.kv"
    ids = np.arange(blocks)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=ids, dst_ids=ids))
    restore = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids))
    ex = PosixFileExecutor(threads=threads, piece_bytes=1 << 20)
    landed = []
    run = ex.run

    def counted(*args, **kw):
        if kw.get("on_read") is not None:
            hook = kw["on_read"]
            kw["on_read"] = lambda k, at, view: (landed.append((k, at, len(view))), hook(k, at, view))
        return run(*args, **kw)
    ex.run = counted
    with FileTier(ex, layout, {"file0": FileBinding(path, create=True)}, {"mem": mem}, chunk_bytes=chunk,
                  durability="none") as tier:
        want = mem.copy()
        tier.spill(spill).raise_for_error()
        mem[:] = 0
        tier.restore(restore).raise_for_error()
        assert np.array_equal(mem, want)
        assert sum(n for _, _, n in landed) == mem.nbytes  # every byte checksummed as it landed
        bad = 2 * blocks * chunk + 5 * chunk + 123  # region 2, page 5: the file's chunk 133
        with open(path, "r+b") as f:
            f.seek(bad)
            byte = f.read(1)
            f.seek(bad)
            f.write(bytes([byte[0] ^ 0x40]))
        result = tier.restore(restore)
        assert not result.success and "chunk 133" in str(result.error) and "checksum" in str(result.error)
    ex.close()
