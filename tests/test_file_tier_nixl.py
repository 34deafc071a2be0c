"""The storage tier on NIXL's real POSIX backend: host memory -> files -> host memory through FileTier.

Every restore is compared byte for byte with per-block copies walked from the layout (tests/reference.py),
sentinel bytes included; the files on disk are compared too. Error paths (missing and short files,
misaligned O_DIRECT, a read-only or closed descriptor, a full filesystem, stale and corrupted chunks) must
each give a precise error and no job reported done.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors import BindingError, ExecutorError
from kvxfer.executors.nixl_peer import LOOPBACK_ENV
from kvxfer.planner import BlockMapping, Layout, PlanOptions, plan_transfer, presets
from kvxfer.testing import apply_copies, expected_copies

for _k, _v in LOOPBACK_ENV.items():  # set before nixl loads UCX (kvxfer imports it lazily)
    os.environ.setdefault(_k, _v)
pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install 'kvxfer[nixl]')")

from kvxfer.executors import NixlExecutor  # noqa: E402
from kvxfer.executors.nixl_memory import FileBinding  # noqa: E402
from kvxfer.offload.files.file_tier import (  # noqa: E402
    Durability,
    FileTier,
    IntegrityError,
    TierError,
    aligned_empty,
    tier_layout,
)

REGIONS, BLOCKS, PAGE, FILES = 5, 32, 4096, 2
SENTINEL = 0xAB


@pytest.fixture(scope="module")
def executor():
    from kvxfer.executors.config import get_executor

    ex = get_executor({"kind": "nixl", "nixl": {"backends": ["POSIX"], "poll_timeout_s": 20.0}})
    assert isinstance(ex, NixlExecutor) and list(ex.agent.backends) == ["POSIX"]
    yield ex
    ex.close()


def _memory(layout: Layout, seed: int, o_direct: bool) -> np.ndarray:
    n = layout.buffers[0].nbytes
    mem = aligned_empty(n) if o_direct else np.empty(n, np.uint8)
    mem[:] = np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)
    return mem


def _files(layout: Layout, disk: Path, o_direct: bool = False, **kw) -> dict[str, FileBinding]:
    return {b.name: FileBinding(disk / f"{b.name}.kv", create=True, o_direct=o_direct, **kw)
            for b in layout.buffers if b.location.value == "file"}


def _tier(executor, layout, disk, mem, o_direct=False, **kw) -> FileTier:
    return FileTier(executor, layout, _files(layout, disk, o_direct), {"mem": mem}, chunk_bytes=PAGE, **kw)


def _on_disk(layout: Layout, tier: FileTier) -> dict[str, np.ndarray]:
    out = {}
    for name, fb in tier.files.items():
        size = layout.buffers[layout.buffer_index(name)].nbytes
        data = np.fromfile(fb.path, dtype=np.uint8)
        out[name] = np.concatenate([data, np.zeros(max(0, size - len(data)), np.uint8)])[:size]
    return out


def _maps(pattern: str, n: int, seed: int) -> tuple[BlockMapping, BlockMapping]:
    """A spill (memory blocks -> file slots) and the restore of those slots into other memory blocks."""
    spill = presets.mapping(pattern, n, BLOCKS, "d2h", seed=seed)
    back = np.random.default_rng(seed + 1).permutation(BLOCKS)[:n]
    return spill, BlockMapping(direction="h2d", src_ids=spill.dst_ids, dst_ids=back)


# ---- round trips -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("o_direct", [False, True], ids=["buffered", "odirect"])
@pytest.mark.parametrize("coalesce", [True, False], ids=["merged", "per-block"])
@pytest.mark.parametrize("pattern", ["contiguous", "runs8", "descending", "fragmented"])
def test_round_trip_is_byte_exact(executor, disk, pattern, coalesce, o_direct):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES, align_bytes=4096 if o_direct else 1)
    mem = _memory(layout, seed=len(pattern), o_direct=o_direct)
    spill_map, restore_map = _maps(pattern, 12, seed=len(pattern))
    opts = PlanOptions(coalesce=coalesce, max_descriptors=16)
    spill, restore = plan_transfer(layout, spill_map, options=opts), plan_transfer(layout, restore_map, options=opts)
    if coalesce and pattern == "contiguous":
        assert spill.num_ranges == REGIONS  # one I/O request per region
    with _tier(executor, layout, disk, mem, o_direct) as tier:
        want = {"mem": mem.copy(), **{n: np.zeros(b.nbytes, np.uint8) for n, b in
                                      ((b.name, b) for b in layout.buffers if b.name != "mem")}}
        apply_copies(expected_copies(layout, spill_map), want)
        r = tier.spill(spill)
        assert r.success and r.error is None and r.nbytes == spill.total_bytes, r
        assert r.chunks == 12 * REGIONS and r.epoch is not None and r.epoch > 0
        got_files = _on_disk(layout, tier)
        for name in tier.files:
            assert np.array_equal(got_files[name], want[name]), name
        mem[:] = SENTINEL
        want["mem"][:] = SENTINEL
        apply_copies(expected_copies(layout, restore_map), want)
        r = tier.restore(restore)
        assert r.success and r.nbytes == restore.total_bytes, r
        bad = np.flatnonzero(mem != want["mem"])
        assert bad.size == 0, f"{bad.size} bytes differ, first at {bad[:1]}"


def test_tier_reopened_trusts_records_and_never_repeats_an_epoch(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=7, o_direct=False)
    spill_map, restore_map = _maps("runs8", 16, seed=7)
    with _tier(executor, layout, disk, mem) as tier:
        first = tier.spill(plan_transfer(layout, spill_map)).epoch
    want = {"mem": mem.copy(), **_zero_files(layout)}
    apply_copies(expected_copies(layout, spill_map), want)
    mem[:] = SENTINEL
    want["mem"][:] = SENTINEL
    apply_copies(expected_copies(layout, restore_map), want)
    files = {n: FileBinding(disk / f"{n}.kv") for n in _zero_files(layout)}
    with FileTier(executor, layout, files, {"mem": mem}, chunk_bytes=PAGE) as tier:
        tier.restore(plan_transfer(layout, restore_map)).raise_for_error()
        assert np.array_equal(mem, want["mem"])
        assert tier.spill(plan_transfer(layout, spill_map)).epoch > first


def _zero_files(layout: Layout) -> dict[str, np.ndarray]:
    return {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers if b.location.value == "file"}


# ---- durability --------------------------------------------------------------------------------------------
def test_fdatasync_policy_syncs_every_touched_file_and_its_records_before_done(executor, disk, monkeypatch):
    import kvxfer.offload.files.file_tier as ft

    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=3, o_direct=False)
    synced: list[str] = []
    real = os.fdatasync

    def spy(fd):
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    with _tier(executor, layout, disk, mem) as tier:
        monkeypatch.setattr(ft.os, "fdatasync", spy)
        plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[3, 4]))
        assert tier.spill(plan).success
        paths = {str(fb.path.resolve()) for fb in tier.files.values()}
        assert set(synced) == paths | {p + ".kvxsum" for p in paths}
        for p in paths:  # the records cleared before the data, the data before its new records
            first, last = synced.index(p + ".kvxsum"), len(synced) - 1 - synced[::-1].index(p + ".kvxsum")
            assert first < synced.index(p) < last
    with _tier(executor, layout, disk, mem, durability="none") as tier:
        synced.clear()
        assert tier.durability is Durability.NONE and tier.spill(plan).success and synced == []


def test_failed_fdatasync_is_a_failed_spill_naming_the_file(executor, disk, monkeypatch):
    import kvxfer.offload.files.file_tier as ft

    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=4, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[2]))
    with _tier(executor, layout, disk, mem) as tier:
        def eio(fd):
            raise OSError(5, "Input/output error")
        monkeypatch.setattr(ft.os, "fdatasync", eio)
        r = tier.spill(spill)
        assert not r.success and isinstance(r.error, TierError) and r.nbytes == 0
        assert r.error.step == "fdatasync" and "file0.kv" in str(r.error) and "Input/output error" in str(r.error)
        monkeypatch.undo()
        r = tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[2], dst_ids=[0])))
        assert not r.success and isinstance(r.error, IntegrityError) and "last spill failed" in str(r.error)


# ---- error paths ---------------------------------------------------------------------------------------------
def test_missing_file_is_refused_at_bind(executor, disk):
    layout = tier_layout(2, 8, PAGE)
    with pytest.raises(BindingError, match=r"bindings\['file0'\] = .*nope.kv: no such file"):
        FileTier(executor, layout, {"file0": FileBinding(disk / "nope.kv")}, {"mem": _memory(layout, 0, False)})


def test_short_file_is_refused_before_reading(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=5, o_direct=False)
    spill_map, restore_map = _maps("contiguous", 8, seed=5)
    with _tier(executor, layout, disk, mem) as tier:
        assert tier.spill(plan_transfer(layout, spill_map)).success
        os.truncate(tier.files["file1"].path, PAGE * 3)
        before = mem.copy()
        r = tier.restore(plan_transfer(layout, restore_map))
        assert not r.success and isinstance(r.error, TierError) and r.error.step == "extent check"
        assert "file1.kv" in str(r.error) and "short file" in str(r.error) and "the file has 12288" in str(r.error)
        assert np.array_equal(mem, before)  # nothing was read


def test_short_read_through_the_executor_is_an_error_not_done(executor, disk):
    """Below the tier: NIXL's POSIX backend itself must not report a read past the end as DONE."""
    layout = tier_layout(1, 8, PAGE)
    mem = np.zeros(layout.buffers[0].nbytes, np.uint8)
    fb = FileBinding(disk / "short.kv", create=True, size=PAGE)  # 1 page on disk, the buffer holds 8
    reg_m, reg_f = executor.register({"mem": mem}, layout.buffers[:1]), executor.register({"file0": fb}, layout)
    try:
        plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1, 2], dst_ids=[0, 1, 2]))
        t = executor.run(plan, {"mem": mem, "file0": fb})
        with pytest.raises(ExecutorError, match="check_xfer_state failed at chunk 0"):
            t.wait()
        assert not _done(t)
    finally:
        reg_f.deregister()
        reg_m.deregister()
        fb.close()


def _done(t) -> bool:
    try:
        return t.done()
    except ExecutorError:
        return False


def test_o_direct_needs_an_aligned_layout_and_aligned_memory(executor, disk):
    unaligned = tier_layout(2, 8, PAGE)  # align_bytes 1 on memory and file
    mem_only = Layout(buffers=[b.model_copy(update={"align_bytes": 1 if b.name == "mem" else 4096})
                               for b in unaligned.buffers], regions=unaligned.regions)
    with pytest.raises(BindingError, match=r"bindings\['mem'\] = align_bytes 1: O_DIRECT .* Buffer\(align_bytes=4096\)"):
        _tier(executor, mem_only, disk, _memory(mem_only, 0, True), o_direct=True)
    file_only = Layout(buffers=[b.model_copy(update={"align_bytes": 4096 if b.name == "mem" else 1})
                                for b in unaligned.buffers], regions=unaligned.regions)
    with pytest.raises(BindingError, match=r"bindings\['file0'\] = buffer's align_bytes 1: O_DIRECT needs multiples "
                       r"of the block size 4096"):
        _tier(executor, file_only, disk, _memory(file_only, 0, True), o_direct=True)
    aligned = tier_layout(2, 8, PAGE, align_bytes=4096)
    raw = aligned_empty(aligned.buffers[0].nbytes + 64)
    with pytest.raises(BindingError, match=r"bindings\['mem'\] = address 0x[0-9a-f]+: O_DIRECT I/O .* aligned to 4096"):
        _tier(executor, aligned, disk, raw[64:], o_direct=True)


def test_misaligned_plan_for_o_direct_is_refused_before_any_io(executor, disk):
    lay = tier_layout(2, 8, PAGE, align_bytes=4096)
    with _tier(executor, lay, disk, _memory(lay, 1, True), o_direct=True) as tier:
        odd = tier_layout(2, 8, PAGE)  # the same shape, planned without alignment: a hand-made plan
        plan = plan_transfer(odd, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[1]))
        r = tier.spill(plan)
        assert not r.success and isinstance(r.error, BindingError) and "bind the plan's layout" in str(r.error)  # the binding's table check
        assert os.path.getsize(tier.files["file0"].path) == lay.buffers[1].nbytes  # sized, never written


def test_read_only_descriptor_fails_the_spill_naming_file_and_call(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=6, o_direct=False)
    for name in ("file0", "file1"):
        (disk / f"{name}.kv").write_bytes(bytes(layout.buffers[layout.buffer_index(name)].nbytes))
    files = {n: FileBinding(disk / f"{n}.kv", readonly=True) for n in ("file0", "file1")}
    with FileTier(executor, layout, files, {"mem": mem}, chunk_bytes=PAGE) as tier:
        spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0, 1]),
                              options=PlanOptions(max_descriptors=3))
        r = tier.spill(spill)
        assert not r.success and isinstance(r.error, TierError) and r.nbytes == 0
        assert r.error.call == 0 and r.error.step in ("transfer", "check_xfer_state")
        assert "file0.kv" in str(r.error) and "call 0" in str(r.error)
        assert all(not (disk / f"{n}.kv").read_bytes().strip(b"\0") for n in files)
        r = tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[5])))
        assert not r.success and "last spill failed" in str(r.error)


def test_closed_descriptor_is_reported_and_never_done(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=8, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0, 1]))
    with _tier(executor, layout, disk, mem) as tier:
        fd = tier.files["file1"].fd
        os.close(fd)
        r = tier.spill(spill)
        assert not r.success and r.error.step == "descriptor check" and "file1.kv" in str(r.error)
        # the same closed descriptor straight through the executor: NIXL's submission fails, never DONE
        t = None
        with pytest.raises(ExecutorError, match=r"(transfer|check_xfer_state) failed at chunk 0") as e:
            t = executor.run(spill, {"mem": mem, **tier.files})
            t.wait()
        assert t is None or not _done(t)
        assert "nixlBackendError" in str(e.value) or "ERR" in str(e.value)
        os.dup2(os.open(os.devnull, os.O_RDONLY), fd)  # keep the number taken until the tier closes it


FULL_FS_SCRIPT = textwrap.dedent("""
    import os, sys
    import numpy as np
    from kvxfer.offload.files.file_tier import FileTier, tier_layout
    from kvxfer.executors.nixl_memory import FileBinding
    from kvxfer.executors import NixlExecutor
    from kvxfer.planner import BlockMapping, plan_transfer
    mnt = sys.argv[1]
    lay = tier_layout(2, 32, 4096)
    mem = np.full(lay.buffers[0].nbytes, 7, np.uint8)
    ex = NixlExecutor(backends=["POSIX"], poll_timeout_s=20)
    tier = FileTier(ex, lay, {"file0": FileBinding(mnt + "/file0.kv", create=True)}, {"mem": mem}, chunk_bytes=4096)
    plan = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=list(range(32)), dst_ids=list(range(32))))
    r = tier.spill(plan)
    print("RESULT", r.success, r.nbytes, type(r.error).__name__, r.error, flush=True)
    tier.close(); ex.close()
""")


def test_full_filesystem_fails_the_spill_naming_the_file(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs in a private mount namespace here: {probe.stderr.strip()}")
    script = tmp_path / "spill.py"
    script.write_text(FULL_FS_SCRIPT)
    run = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs -o size=64k tmpfs {mnt} && "
                          f"exec {sys.executable} {script} {mnt}"], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **LOOPBACK_ENV})
    line = [x for x in run.stdout.splitlines() if x.startswith("RESULT")]
    assert line, run.stdout + run.stderr
    assert line[0].startswith("RESULT False 0 TierError"), line[0]  # 256 KiB into 64 KiB: ENOSPC
    assert "file0.kv" in line[0] and "call 0" in line[0]


def test_corrupted_chunk_is_refused_naming_the_chunk(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=9, o_direct=False)
    spill_map, restore_map = _maps("runs8", 16, seed=9)
    with _tier(executor, layout, disk, mem) as tier:
        assert tier.spill(plan_transfer(layout, spill_map)).success
        slot = int(spill_map.dst_ids[3])  # region kv0's page for that slot sits at chunk `slot` of file0
        with open(tier.files["file0"].path, "r+b") as f:
            f.seek(slot * PAGE + 100)
            f.write(b"\x00" if f.read(1) != b"\x00" else b"\x01")
        r = tier.restore(plan_transfer(layout, restore_map))
        assert not r.success and isinstance(r.error, IntegrityError) and r.error.chunk == slot
        assert "torn or corrupted" in str(r.error) and "file0.kv" in str(r.error) and "1 of" in str(r.error)


def test_stale_spill_is_refused(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=10, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1, 2], dst_ids=[4, 5, 6]))
    restore = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[4, 5, 6], dst_ids=[0, 1, 2]))
    with _tier(executor, layout, disk, mem) as tier:
        e1 = tier.spill(spill).epoch
        old = {p: Path(p).read_bytes() for fb in tier.files.values() for p in (str(fb.path), f"{fb.path}.kvxsum")}
        mem[:] = 1
        e2 = tier.spill(spill).epoch
        assert e2 > e1
        new = {p: Path(p).read_bytes() for p in old}
        for p, data in old.items():  # an older copy of the files comes back (a restored backup, a stale mount)
            Path(p).write_bytes(data)
        before = mem.copy()
        r = tier.restore(restore)
        assert not r.success and isinstance(r.error, IntegrityError)
        assert f"stale: the file holds epoch {e1}, the last spill of this chunk wrote epoch {e2}" in str(r.error)
        assert np.array_equal(mem, before)  # refused before reading
        for p in old:  # records of the second spill over data of the first: a torn spill
            if p.endswith(".kvxsum"):
                Path(p).write_bytes(new[p])
        r = tier.restore(restore)
        assert not r.success and isinstance(r.error, IntegrityError) and "torn or corrupted" in str(r.error)


def test_chunk_never_spilled_is_refused(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=11, o_direct=False)
    with _tier(executor, layout, disk, mem) as tier:
        before = mem.copy()
        r = tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[9], dst_ids=[0])))
        assert not r.success and "chunk 9: never spilled" in str(r.error)
        assert np.array_equal(mem, before)


def test_plan_in_the_wrong_direction_or_with_unbound_buffers_is_refused(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=12, o_direct=False)
    with _tier(executor, layout, disk, mem) as tier:
        restore_like = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[0]))
        r = tier.spill(restore_like)
        assert not r.success and isinstance(r.error, BindingError) and "spill writes this buffer as file" in str(r.error)
    with pytest.raises(BindingError, match=r"integrity records of another layout \(want 8192-byte chunks"):
        FileTier(executor, layout, _files(layout, disk), {"mem": mem}, chunk_bytes=2 * PAGE)
    (disk / "big").mkdir()
    with FileTier(executor, layout, _files(layout, disk / "big"), {"mem": mem}, chunk_bytes=2 * PAGE) as tier:
        r = tier.spill(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[3])))
        assert not r.success and "whole integrity chunks of 8192 bytes" in str(r.error)
    with pytest.raises(BindingError, match="the layout places this buffer in file"):
        FileTier(executor, layout, {}, {"file0": mem})


def test_epochs_alone_without_checksums(executor, disk):
    """verify=False (a VRAM tier through GDS cannot checksum host bytes): round trips, stale still refused."""
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=13, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[7, 8]))
    restore = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[7, 8], dst_ids=[2, 3]))
    want = {"mem": mem.copy(), **_zero_files(layout)}
    apply_copies(expected_copies(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[7, 8])), want)
    apply_copies(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[7, 8], dst_ids=[2, 3])), want)
    with _tier(executor, layout, disk, mem, verify=False) as tier:
        assert tier.spill(spill).success and tier.restore(restore).success
        assert np.array_equal(mem, want["mem"])
        sidecar = Path(f"{tier.files['file0'].path}.kvxsum")
        old = sidecar.read_bytes()
        assert tier.spill(spill).success
        sidecar.write_bytes(old)
        r = tier.restore(restore)
        assert not r.success and "stale" in str(r.error)


def test_storage_backend_that_cannot_start_is_named():
    try:
        ex = NixlExecutor(backends=["GDS"])
    except ValueError as e:
        assert "nixl.backends = ['GDS']: could not start" in str(e) and "cuFile" in str(e)
    else:
        ex.close()
        pytest.skip("GDS starts on this machine (cuFile present); the GPU test below covers it")


@pytest.mark.gpu
def test_gds_round_trip_vram_file_vram(disk):
    """GPU machines: the same plans between device memory and a file through GDS (cuFile)."""
    import torch

    try:
        ex = NixlExecutor(backends=["GDS"], poll_timeout_s=60)
    except ValueError as e:
        pytest.skip(str(e))
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES, align_bytes=4096)
    n = layout.buffers[0].nbytes
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda")
    dst = torch.full((n,), SENTINEL, dtype=torch.uint8, device="cuda")
    spill_map, restore_map = _maps("runs8", 12, seed=21)
    try:
        with FileTier(ex, layout, _files(layout, disk, o_direct=True), {"mem": src}, verify=False) as tier:
            assert tier.spill(plan_transfer(layout, spill_map)).raise_for_error().success
        files = {n_: FileBinding(disk / f"{n_}.kv", o_direct=True) for n_ in _zero_files(layout)}
        with FileTier(ex, layout, files, {"mem": dst}, verify=False) as tier:
            tier.restore(plan_transfer(layout, restore_map)).raise_for_error()
        want = {"mem": src.cpu().numpy(), **_zero_files(layout)}
        apply_copies(expected_copies(layout, spill_map), want)
        want["mem"][:] = SENTINEL
        apply_copies(expected_copies(layout, restore_map), want)
        assert np.array_equal(dst.cpu().numpy(), want["mem"])
    finally:
        ex.close()


def test_jobs_of_one_tier_from_several_threads_run_one_after_another(executor, disk):
    from concurrent.futures import ThreadPoolExecutor

    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=14, o_direct=False)
    maps = [BlockMapping(direction="d2h", src_ids=[2 * k, 2 * k + 1], dst_ids=[2 * k, 2 * k + 1]) for k in range(8)]
    want = {"mem": mem.copy(), **_zero_files(layout)}
    for m in maps:
        apply_copies(expected_copies(layout, m), want)
    with _tier(executor, layout, disk, mem) as tier:
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(lambda m: tier.spill(plan_transfer(layout, m)), maps))
        epochs = sorted(r.epoch for r in results)
        assert all(r.success for r in results) and epochs == list(range(epochs[0], epochs[0] + 8))
        on_disk = _on_disk(layout, tier)
        assert all(np.array_equal(on_disk[n], want[n]) for n in on_disk)
        mem[:] = SENTINEL
        back = BlockMapping(direction="h2d", src_ids=np.arange(16), dst_ids=np.arange(16))
        tier.restore(plan_transfer(layout, back)).raise_for_error()
        want["mem"][:] = SENTINEL
        apply_copies(expected_copies(layout, back), want)
        assert np.array_equal(mem, want["mem"])


# ---- records name their file; one tier per file; epochs never repeat ---------------------------------------------
def _spill_all(executor, layout, disk, seed):
    """Spill every block of a fresh tier over ``disk``; returns the memory spilled."""
    mem = _memory(layout, seed=seed, o_direct=False)
    ids = list(range(BLOCKS))
    with _tier(executor, layout, disk, mem) as tier:
        tier.spill(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=ids, dst_ids=ids))).raise_for_error()
    return mem


def _swap(a: Path, b: Path) -> None:
    tmp = a.with_name(a.name + ".swap")
    a.rename(tmp)
    b.rename(a)
    tmp.rename(b)


def test_data_and_records_of_two_files_swapped_are_refused(executor, disk):
    """One spill wrote both files (one epoch); their data and records trade places: never restored as success."""
    layout = tier_layout(4, BLOCKS, PAGE, files=2)  # two files of one size: their headers agree on the layout
    _spill_all(executor, layout, disk, seed=30)
    for suffix in (".kv", ".kv.kvxsum"):
        _swap(disk / f"file0{suffix}", disk / f"file1{suffix}")
    with pytest.raises(BindingError, match=r"file0\.kv\.kvxsum: the records were written for '.*file1\.kv', not for the "
                       r"file beside them: files moved or swapped"):
        _tier(executor, layout, disk, _memory(layout, 0, False))


def test_files_renamed_into_each_others_place_between_runs_are_refused(executor, disk):
    """Two tiers (two engines), one file each; between runs the files and their records swap places."""
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    a, b = disk / "a", disk / "b"
    a.mkdir(), b.mkdir()
    _spill_all(executor, layout, a, seed=31)
    _spill_all(executor, layout, b, seed=32)
    for suffix in (".kv", ".kv.kvxsum"):
        _swap(a / f"file0{suffix}", b / f"file0{suffix}")
    for here, there in ((a, b), (b, a)):
        with pytest.raises(BindingError, match=rf"{here.name}/file0\.kv\.kvxsum: the records were written for "
                           rf"'.*{there.name}/file0\.kv', not for the file beside them"):
            _tier(executor, layout, here, _memory(layout, 0, False))


def test_records_of_another_file_at_the_same_path_are_refused(executor, disk):
    """The data file was replaced (a copy renamed into its place, as a restored backup would be) while its records
    stayed."""
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    _spill_all(executor, layout, disk, seed=33)
    data = disk / "file0.kv"
    copy = disk / "copy"
    copy.write_bytes(bytes(data.stat().st_size))  # another file of the same size
    copy.chmod(0o600)
    copy.replace(data)
    with pytest.raises(BindingError, match="written for another file at this path"):
        _tier(executor, layout, disk, _memory(layout, 0, False))


def test_two_tiers_on_one_file_are_refused_and_epochs_never_repeat(executor, disk):
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    mem = _memory(layout, seed=34, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0, 1]))
    with _tier(executor, layout, disk, mem) as first:
        last = first.spill(spill).epoch
        with pytest.raises(BindingError, match=r"locked by another FileTier for more than 0.2 s"):
            _tier(executor, layout, disk, mem, lock_timeout_s=0.2)
    with _tier(executor, layout, disk, mem) as second:  # released with the first: the next tier goes on above it
        assert second.spill(spill).epoch > last
        second.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[2, 3]))).raise_for_error()


def test_records_of_an_older_format_are_refused_with_what_to_do(executor, disk):
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    (disk / "file0.kv").write_bytes(bytes(layout.buffers[1].nbytes))
    (disk / "file0.kv").chmod(0o600)
    (disk / "file0.kv.kvxsum").write_bytes(b"KVXSUM01" + bytes(56))
    (disk / "file0.kv.kvxsum").chmod(0o600)
    with pytest.raises(BindingError, match=r"file0\.kv\.kvxsum: integrity records of an older format .*remove them and "
                       r"the data file to start over"):
        _tier(executor, layout, disk, _memory(layout, 0, False))


def test_a_record_copied_into_another_chunks_slot_is_refused_without_checksums(executor, disk):
    from kvxfer.offload.files.file_tier import HEADER_BYTES, RECORD

    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=35, o_direct=False)
    with _tier(executor, layout, disk, mem, verify=False) as tier:
        tier.spill(plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[4, 5]))).raise_for_error()
        records = Path(f"{tier.files['file0'].path}.kvxsum")
        raw = bytearray(records.read_bytes())
        n = RECORD.itemsize
        raw[HEADER_BYTES + 5 * n:HEADER_BYTES + 6 * n] = raw[HEADER_BYTES + 4 * n:HEADER_BYTES + 5 * n]  # chunk 4's into 5
        records.write_bytes(bytes(raw))
        r = tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[5], dst_ids=[9])))
        assert not r.success and isinstance(r.error, IntegrityError) and r.error.chunk == 5
        assert "belongs to another chunk or file" in str(r.error)


class _CutsShortAfterReading:
    """The tier's executor, except that the file ``victim`` is cut to ``keep`` bytes once a read completes."""

    def __init__(self, inner, victim, keep):
        self.inner, self.victim, self.keep = inner, victim, keep

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, plan, memory, stream=None, after=None):
        t = self.inner.run(plan, memory)
        wait, victim, keep = t.wait, self.victim, self.keep

        def wait_then_cut():
            wait()
            os.truncate(victim, keep)
            return t
        t.wait = wait_then_cut
        return t


def test_a_file_cut_short_under_a_read_is_caught_without_checksums(executor, disk):
    layout = tier_layout(REGIONS, BLOCKS, PAGE, files=FILES)
    mem = _memory(layout, seed=36, o_direct=False)
    spill = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[6, 7]))
    with _tier(executor, layout, disk, mem, verify=False) as tier:
        tier.spill(spill).raise_for_error()
    cutting = _CutsShortAfterReading(executor, disk / "file0.kv", PAGE * 2)
    with FileTier(cutting, layout, _files(layout, disk), {"mem": mem}, chunk_bytes=PAGE, verify=False) as tier:
        r = tier.restore(plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[6, 7], dst_ids=[2, 3])))
        assert not r.success and isinstance(r.error, TierError) and r.error.step == "extent check after reading"
        assert "short file" in str(r.error) and "file0.kv" in str(r.error)


@pytest.mark.parametrize("op", ["spill", "restore"])
@pytest.mark.parametrize("where", ["offset", "size"])
def test_file_ranges_must_cover_whole_integrity_chunks(executor, disk, op, where):
    from kvxfer.planner import TransferPlan

    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    mem = _memory(layout, seed=37, o_direct=False)
    d = "d2h" if op == "spill" else "h2d"
    good = plan_transfer(layout, BlockMapping(direction=d, src_ids=[1], dst_ids=[1]))
    file_side = "dst" if op == "spill" else "src"
    plan = good.to_dict()
    plan.pop("fingerprint")
    column = plan["columns"][f"{file_side}_offset" if where == "offset" else "nbytes"]
    column[0] += 512 if where == "offset" else -512  # starts, or ends, inside an integrity chunk
    bad = TransferPlan.from_dict(plan)  # a plan read from a file: well-formed, but not in whole chunks
    with _tier(executor, layout, disk, mem) as tier:
        before = mem.copy()
        r = getattr(tier, op)(bad)
        field = f"{file_side}_offset" if where == "offset" else "nbytes"
        assert not r.success and isinstance(r.error, BindingError), r
        assert f"{field}[0]" in str(r.error) and "whole integrity chunks of 4096 bytes" in str(r.error)
        assert np.array_equal(mem, before) and not _on_disk(layout, tier)["file0"].any()  # nothing moved


# ---- files the tier did not create are not trusted ---------------------------------------------------------------
def test_file_binding_never_follows_a_planted_link(executor, disk):
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    target = disk / "precious"
    target.write_bytes(b"keep me")
    (disk / "file0.kv").symlink_to(target)
    with pytest.raises(BindingError, match=r"file0\.kv: is a symbolic link: refused"):
        _tier(executor, layout, disk, _memory(layout, 0, False))
    assert target.read_bytes() == b"keep me"  # neither sized nor written


@pytest.mark.parametrize("how", ["writable by others", "owned by another user", "not a file"])
def test_file_binding_refuses_a_file_it_cannot_trust_unless_allowed(executor, disk, how):
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    path = disk / "file0.kv"
    if how == "not a file":
        os.mkfifo(path)
        fragment = "not a regular file"
    else:
        path.write_bytes(bytes(layout.buffers[1].nbytes))
        if how == "owned by another user":
            if os.geteuid() != 0:
                pytest.skip("changing a file's owner needs root (the CI and these machines run tests as root)")
            os.chown(path, 12345, 12345)
            path.chmod(0o600)
            fragment = "owned by uid 12345"
        else:
            path.chmod(0o666)
            fragment = "writable by others"
    with pytest.raises(BindingError, match=f"{fragment}.*refused"):
        _tier(executor, layout, disk, _memory(layout, 0, False))
    if how != "not a file":  # the caller vouches for it
        files = {"file0": FileBinding(path, allow_foreign=True)}
        FileTier(executor, layout, files, {"mem": _memory(layout, 0, False)}, chunk_bytes=PAGE).close()


def test_spill_files_and_records_are_private_to_their_owner(executor, disk):
    layout = tier_layout(2, BLOCKS, PAGE, files=1)
    _spill_all(executor, layout, disk, seed=38)
    assert {p.name: p.stat().st_mode & 0o777 for p in disk.iterdir()} == {"file0.kv": 0o600, "file0.kv.kvxsum": 0o600}
