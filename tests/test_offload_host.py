"""Host memory for the offload worker: the shared region's lifecycle and pinning, the host tier geometry,
worker construction from torch tensors, and the simple one-call copy path."""
from __future__ import annotations

from pathlib import Path

import pytest

from kvxfer.executors import BindingError
from kvxfer.executors._pinning import Registrar
from kvxfer.offload import (
    HostLayout,
    HostTier,
    KVTensor,
    SharedRegion,
    SharedRegionError,
    Sharing,
    SubmissionError,
    TPRank,
    build_params,
    copy_blocks,
    create_worker,
    device_from_tensors,
    find_stale,
    make_geometry,
    pin_tensor,
    remove_stale,
)
from kvxfer.planner import LayoutError

from . import offload_cases as oc

TENSORS = (KVTensor(name="rep", buffer="d", page_bytes=256, sharing=Sharing.REPLICATED),
           KVTensor(name="shard", buffer="d", page_bytes=128, sharing=Sharing.SHARDED, shard_rows=4),
           KVTensor(name="priv", buffer="d", page_bytes=96))


@pytest.fixture
def shm(tmp_path):
    return str(tmp_path)  # a private directory: the same code as /dev/shm, nothing left behind


class FakeRegistrar:
    def __init__(self, fail_at: int | None = None):
        self.calls, self.live, self.fail_at = [], set(), fail_at

    def registrar(self) -> Registrar:
        def reg(addr, n):
            self.calls.append((addr, n))
            if len(self.calls) - 1 == self.fail_at:
                return 2
            self.live.add(addr)
            return 0
        return Registrar("fakeHostRegister", reg, lambda a: self.live.discard(a) or 0, lambda c: f"E{c}")


def test_canonical_geometry_shares_cells_and_pads_rows():
    g = make_geometry(TENSORS, HostTier(num_chunks=4, blocks_per_chunk=2, layout=HostLayout.CANONICAL), TPRank(size=2))
    cells = {(c.tensor, c.rank): (c.offset_bytes, c.page_bytes) for c in g.cells}
    assert cells == {("rep", None): (0, 256), ("shard", None): (512, 256), ("priv", 0): (1024, 96),
                     ("priv", 1): (1216, 96)}
    assert g.row_stride_bytes == 4096 and g.nbytes == 4 * 4096
    direct = make_geometry(TENSORS, HostTier(num_chunks=4, layout=HostLayout.DIRECT), TPRank(size=2))
    assert [(c.tensor, c.rank, c.offset_bytes) for c in direct.cells][:4] == [
        ("rep", 0, 0), ("shard", 0, 256), ("priv", 0, 384), ("rep", 1, 480)]  # rank r's cells in a row


def test_region_attach_counts_and_unlinks_after_the_last(shm):
    g = make_geometry(TENSORS, HostTier(num_chunks=3, layout=HostLayout.CANONICAL), TPRank(size=2))
    a = SharedRegion.create("r1", g, attachers=2, directory=shm)
    path = Path(shm) / "kvxfer-r1"
    b = SharedRegion.attach("r1", shm)
    assert path.exists()
    c = SharedRegion.attach("r1", shm)
    assert not path.exists()  # every expected rank attached
    a.data[:] = 7
    b.data[10] = 1
    assert c.geometry == g and c.data[10] == 1 and int(c.data.sum()) == 7 * (g.nbytes - 1) + 1
    with pytest.raises(SharedRegionError, match="no such region"):
        SharedRegion.attach("r1", shm)
    with pytest.raises(SharedRegionError, match="exists"):
        SharedRegion.create("r2", g, attachers=1, directory=shm), SharedRegion.create("r2", g, attachers=1, directory=shm)
    for r in (a, b, c):
        r.close()
    assert find_stale(shm) == []  # r2's owner (this process) lives
    assert not [p for p in Path(shm).iterdir() if p.name.endswith(".tmp")]


def test_stale_regions_of_dead_owners_are_found_and_removed(shm):
    g = make_geometry(TENSORS, HostTier(num_chunks=1), TPRank())
    r = SharedRegion.create("dead", g, attachers=1, directory=shm)
    r.close()
    path = Path(shm) / "kvxfer-dead"
    raw = bytearray(path.read_bytes())
    raw[64:72] = (2**22 + 12345).to_bytes(8, "little")  # a pid no process has
    path.write_bytes(bytes(raw))
    (Path(shm) / f".kvxfer-half.{2**22 + 12345}.tmp").write_bytes(b"")  # a creator killed mid-create
    assert sorted(p.name for p in find_stale(shm)) == [".kvxfer-half.4206649.tmp", "kvxfer-dead"]
    assert len(remove_stale(shm)) == 2 and not list(Path(shm).iterdir())


def test_the_stale_scan_skips_what_is_no_region_without_blocking_or_raising(shm):
    """A FIFO (a blocking open would wait for a writer forever), a folder, a link, another program's file and
    names or headers with pids past pid_t sit under kvxfer names: none is opened so that it blocks, none raises,
    none is listed or removed; the one stale region beside them is."""
    import os
    import struct
    import subprocess
    import sys

    g = make_geometry(TENSORS, HostTier(num_chunks=1), TPRank())
    for name, pid in (("dead", 2**22 + 12345), ("huge", 2**31), ("negative", -(2**40))):
        SharedRegion.create(name, g, attachers=1, directory=shm).close()
        path = Path(shm) / f"kvxfer-{name}"
        raw = bytearray(path.read_bytes())
        struct.pack_into("<q", raw, 64, pid)  # the creator's pid: one no process has, past pid_t, or far below it
        path.write_bytes(bytes(raw))
    os.mkfifo(Path(shm) / "kvxfer-fifo")
    (Path(shm) / "kvxfer-folder").mkdir()
    (Path(shm) / "kvxfer-other").write_bytes(b"another program's file")
    (Path(shm) / "kvxfer-link").symlink_to(Path(shm) / "kvxfer-dead")
    (Path(shm) / f".kvxfer-x.{2**40}.tmp").write_bytes(b"")  # no process has that pid: not kvxfer's
    (Path(shm) / ".kvxfer-y.4206649.tmp").mkdir()
    code = (f"from kvxfer.offload import find_stale, remove_stale; print(sorted(p.name for p in find_stale({shm!r}))); "
            f"print(sorted(p.name for p in remove_stale({shm!r})))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)  # no hang
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["['kvxfer-dead']"] * 2
    assert sorted(p.name for p in Path(shm).iterdir()) == sorted([
        "kvxfer-huge", "kvxfer-negative", "kvxfer-fifo", "kvxfer-folder", "kvxfer-other", "kvxfer-link",
        f".kvxfer-x.{2**40}.tmp", ".kvxfer-y.4206649.tmp"])


def test_a_taken_region_name_is_reported_with_advice_that_is_true(shm):
    g = make_geometry(TENSORS, HostTier(num_chunks=1), TPRank())
    (Path(shm) / "kvxfer-taken").write_bytes(b"another program's file")
    with pytest.raises(SharedRegionError, match="not a kvxfer region: remove_stale leaves it alone; remove it if "
                                                "nothing uses it, or choose another name"):
        SharedRegion.create("taken", g, directory=shm)
    assert remove_stale(shm) == [] and (Path(shm) / "kvxfer-taken").exists()  # the advice holds: it stays
    live = SharedRegion.create("live", g, attachers=1, directory=shm)
    with pytest.raises(SharedRegionError, match=r"another live region, of processes \["):
        SharedRegion.create("live", g, directory=shm)
    live.close()
    path = Path(shm) / "kvxfer-live"
    raw = bytearray(path.read_bytes())
    raw[64:72] = (2**22 + 12345).to_bytes(8, "little")  # its creator gone
    path.write_bytes(bytes(raw))
    with pytest.raises(SharedRegionError, match=r"a stale region whose processes are all gone: remove_stale\(\) removes it"):
        SharedRegion.create("live", g, directory=shm)
    assert remove_stale(shm) == [path]  # the advice holds: removed, and the name is free again
    SharedRegion.create("live", g, directory=shm).close()
    assert not [p for p in Path(shm).iterdir() if p.name.endswith(".tmp")]


def test_pinning_is_row_aligned_and_rolls_back(shm):
    g = make_geometry(TENSORS, HostTier(num_chunks=10, layout=HostLayout.CANONICAL), TPRank(size=2))
    r = SharedRegion.create("pin", g, directory=shm)
    fake = FakeRegistrar()
    p = r.pin(fake.registrar(), max_chunk_bytes=3 * g.row_stride_bytes + 100)
    base = r.data.ctypes.data
    assert p.pinned and [(a - base, n) for a, n in fake.calls] == [(0, 3 * 4096), (3 * 4096, 3 * 4096), (6 * 4096, 3 * 4096),
                                                                    (9 * 4096, 4096)]
    r.close()
    assert not fake.live  # unregistered with the region
    r = SharedRegion.create("pin2", g, directory=shm)
    fake = FakeRegistrar(fail_at=2)
    p = r.pin(fake.registrar(), max_chunk_bytes=3 * g.row_stride_bytes)
    assert not p.pinned and "chunk 2" in p.reason and not fake.live  # rolled back, stays pageable
    r.close()


def test_attach_with_other_chunking_is_refused(shm):
    dev = oc.rank_device(["rep", "shard"], 2, 0, "data")
    t = oc.tier("geo", shm, create=True, attachers=1)
    w = create_worker(dev, t, {"kind": "numpy"}, tp=TPRank(size=2))
    bad = t.model_copy(update={"num_chunks": 5, "shared": t.shared.model_copy(update={"create": False})})
    with pytest.raises(LayoutError, match="num_chunks"):
        create_worker(dev, bad, {"kind": "numpy"}, tp=TPRank(size=2))
    w.shutdown()


def test_loader_with_a_private_layer_of_another_tp_size_is_refused(shm):
    store = oc.rank_device(["rep", "priv"], 2, 0, "data")
    w = create_worker(store, oc.tier("tp", shm, create=True, attachers=1), {"kind": "numpy"}, tp=TPRank(size=2))
    with pytest.raises(LayoutError, match="no cell for it in rank 2's cells"):
        create_worker(oc.rank_device(["rep", "priv"], 4, 2, "data"), oc.tier("tp", shm), {"kind": "numpy"},
                      tp=TPRank(size=4, rank=2))
    w.shutdown()


torch = pytest.importorskip("torch")


def test_worker_from_torch_tensors_round_trips():
    layers = {f"layer{i}": torch.randint(0, 255, (16, 4, 8), dtype=torch.uint8) for i in range(2)}
    kv = torch.randint(0, 255, (2, 16, 32), dtype=torch.uint8)  # one storage, two views: one buffer
    layers |= {"k": kv[0], "v": kv[1]}
    dev = device_from_tensors(layers)
    assert len(dev.buffers) == 3 and dev.tensors[3].byte_offset == 16 * 32
    before = {k: t.clone() for k, t in layers.items()}
    w = create_worker(dev, HostTier(num_chunks=8, blocks_per_chunk=4, pin=False), {"kind": "numpy"})
    w.submit_store(1, [3, 4, 5, 6, 7], [6, 2])
    w.submit_load(2, [6, 2], [10, 11, 12, 13, 14])
    w.wait([1, 2])
    assert [r.success for r in w.get_finished()] == [True, True]
    for k, t in layers.items():
        assert torch.equal(t[10:15], before[k][3:8]) and torch.equal(t[:10], before[k][:10])
    w.shutdown()


def test_a_device_block_past_a_view_is_refused_not_written_into_the_next_view():
    # vLLM's CPU build at TP=2 puts both ranks' views of a layer in one storage; this rank binds only its own,
    # but the buffer is the whole storage, so block 8 of this rank's view is block 0 of the other rank's
    storage = torch.zeros(2, 8, 64, dtype=torch.uint8)
    dev = device_from_tensors({"layer0": storage[0]})
    assert len(dev.buffers) == 1 and dev.buffers[0].nbytes == 2 * 8 * 64 and dev.tensors[0].num_blocks == 8
    w = create_worker(dev, HostTier(num_chunks=4, pin=False), {"kind": "numpy"})
    w.host[:] = 7
    with pytest.raises(SubmissionError, match=r"job 2: device_ids\[1\] = 8: past the 8 blocks of region 'layer0' "
                                              r"\(device side, buffer 'device.layer0'\)"):
        w.submit_load(2, [0, 1], [7, 8])
    w.submit_load(3, [0, 1], [6, 7])
    w.wait([3])
    assert [r.success for r in w.get_finished()] == [True]
    assert storage[0, 6:].eq(7).all() and not storage[1].any()  # the other rank's view is untouched
    w.shutdown()


def test_simple_path_copies_every_layer_on_one_plan():
    gpu = [torch.randint(0, 255, (12, 64), dtype=torch.uint8) for _ in range(3)]
    cpu = [torch.zeros(20, 64, dtype=torch.uint8) for _ in range(3)]
    params = build_params(gpu, cpu)
    assert params.direction.value == "d2h"
    t = copy_blocks([1, 2, 3, 9], [4, 5, 6, 0], params, stream=None).wait()
    assert t.ranges == 3 * 2  # per layer: blocks 1-3 merge into one range, block 9 is another
    for g, c in zip(gpu, cpu):
        assert torch.equal(c[4:7], g[1:4]) and torch.equal(c[0], g[9]) and not c[7:].any() and not c[1:4].any()
    back = build_params(cpu, gpu)  # all-host caches count as a store: the sources are the "device"
    copy_blocks([4], [11], back).wait()
    with pytest.raises(ValueError, match="dst_ids"):
        copy_blocks([0], [99], params)
    params.close()
    back.close()


def test_pin_tensor_registers_whole_rows():
    t = torch.zeros(10, 3, 100, dtype=torch.uint8)
    fake = FakeRegistrar()
    p = pin_tensor(t, fake.registrar())
    assert p.pinned and fake.calls == [(t.data_ptr(), t.numel())]
    p.close()
    assert not fake.live  # released


def test_example_serving_loop_runs_and_verifies(capsys):
    import importlib.util
    path = Path(__file__).resolve().parent.parent / "examples" / "offload_loop.py"
    spec = importlib.util.spec_from_file_location("offload_loop", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(steps=7) == 0
    out = capsys.readouterr().out
    assert "restores verified: all" in out and "h2d ok" in out and "FAILED" not in out


def test_worker_pins_its_host_tier_and_unpins_at_shutdown(shm):
    dev = oc.rank_device(["rep", "priv"], 1, 0, "data")
    fake = FakeRegistrar()
    w = create_worker(dev, HostTier(num_chunks=6, pin=True), {"kind": "numpy"}, registrar=fake.registrar())
    assert fake.calls == [(w.host.ctypes.data, w.host.nbytes)] and fake.live
    w.shutdown()
    assert not fake.live
    refused = FakeRegistrar(fail_at=0)
    t = oc.tier("pinfail", shm, create=True).model_copy(update={"pin": True})
    with pytest.raises(RuntimeError, match="pinning the host tier failed: fakeHostRegister failed on chunk 0"):
        create_worker(dev, t, {"kind": "numpy"}, registrar=refused.registrar())
    assert not list(Path(shm).glob("kvxfer-pinfail"))  # no attachers expected: the name went at creation



def test_a_worker_that_may_stay_pageable_says_why_and_still_runs():
    """The vLLM backend's choice: a failed pin is reported (to ``on_unpinned``), the worker still runs on
    pageable memory; a failure after pinning releases what was pinned."""
    from kvxfer.offload.build import assemble_worker, host_memory
    from kvxfer.offload.tier import build_layout

    dev = oc.rank_device(["rep", "priv"], 1, 0, "data")
    tier = HostTier(num_chunks=6)
    geometry, memory, region = host_memory(dev, tier, TPRank())
    layout = build_layout(dev.buffers, dev.tensors, geometry, TPRank())
    said: list[str] = []
    w = assemble_worker(layout, dev, (geometry, memory, region), {"kind": "numpy"}, tp=TPRank(), pin=True,
                        registrar=FakeRegistrar(fail_at=0).registrar(), strict_pin=False, on_unpinned=said.append)
    assert len(said) == 1 and said[0].startswith("fakeHostRegister failed on chunk 0")
    assert w.submit_store(1, [0, 1], [2, 3]) and w.wait([1]) is None
    assert [r.success for r in w.get_finished()] == [True]
    w.shutdown()
    fake = FakeRegistrar()
    with pytest.raises(BindingError, match="bindings\\['host'\\]"):  # refused after the pin: the pin is released
        assemble_worker(layout, dev, (geometry, memory[:-1], None), {"kind": "numpy"}, tp=TPRank(), pin=True,
                        registrar=fake.registrar())
    assert fake.calls and not fake.live

# ---- shared regions trust nothing on disk -----------------------------------------------------------------------
def _geometry():
    return make_geometry(TENSORS, HostTier(num_chunks=3, layout=HostLayout.CANONICAL), TPRank(size=2))


def test_region_files_are_private_to_their_owner(shm):
    r = SharedRegion.create("mode", _geometry(), attachers=1, directory=shm)
    assert (Path(shm) / "kvxfer-mode").stat().st_mode & 0o777 == 0o600
    r.close()


def test_a_killed_attacher_is_not_counted_so_the_last_rank_gets_in(shm):
    import subprocess
    import sys

    creator = SharedRegion.create("killed", _geometry(), attachers=2, directory=shm)
    code = ("import os, signal; from kvxfer.offload import SharedRegion; "
            f"SharedRegion.attach('killed', {shm!r}); os.kill(os.getpid(), signal.SIGKILL)")
    assert subprocess.run([sys.executable, "-c", code], timeout=120).returncode == -9  # attached, then killed
    a = SharedRegion.attach("killed", shm)  # the rank restarted after the crash
    b = SharedRegion.attach("killed", shm)  # and the last rank
    assert not (Path(shm) / "kvxfer-killed").exists()  # two counted attachers: the name is gone
    for r in (a, b, creator):
        r.close()


def test_attachers_that_detached_still_count(shm):
    creator = SharedRegion.create("detached", _geometry(), attachers=2, directory=shm)
    SharedRegion.attach("detached", shm).close()  # a rank that finished its work and closed
    SharedRegion.attach("detached", shm).close()
    assert not (Path(shm) / "kvxfer-detached").exists()
    creator.close()
    assert find_stale(shm) == []


@pytest.mark.parametrize("how", ["writable by others", "owned by another user"])
def test_attach_refuses_a_region_it_cannot_trust_unless_allowed(shm, how):
    import os

    r = SharedRegion.create("foreign", _geometry(), attachers=2, directory=shm)
    path = Path(shm) / "kvxfer-foreign"
    if how == "owned by another user":
        if os.geteuid() != 0:
            pytest.skip("changing a file's owner needs root (the CI and these machines run tests as root)")
        os.chown(path, 12345, 12345)
        fragment = "owned by uid 12345"
    else:
        path.chmod(0o666)
        fragment = "writable by others"
    with pytest.raises(SharedRegionError, match=fragment):
        SharedRegion.attach("foreign", shm)
    SharedRegion.attach("foreign", shm, allow_foreign=True).close()  # the caller trusts it: attached
    r.close()


def test_attach_never_follows_a_planted_link(shm, tmp_path_factory):
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    r = SharedRegion.create("target", _geometry(), attachers=1, directory=elsewhere)
    (Path(shm) / "kvxfer-planted").symlink_to(Path(elsewhere) / "kvxfer-target")
    with pytest.raises(SharedRegionError, match="symbolic link"):
        SharedRegion.attach("planted", shm)
    assert (Path(elsewhere) / "kvxfer-target").exists()  # not attached through the link: still expecting one
    r.close()


def test_region_names_are_checked_in_one_place_and_never_leave_the_directory(shm):
    from kvxfer.offload import SharedSpec

    (Path(shm) / "kvxfer-..").mkdir()  # a planted folder that "../x" would reach
    reasons = set()
    for act in (lambda: SharedRegion.create("../x", _geometry(), directory=shm), lambda: SharedRegion.attach("../x", shm),
                lambda: SharedSpec(name="../x")):
        with pytest.raises(ValueError, match=r"name = '\.\./x': must be 1 to 200 of") as e:
            act()
        reasons.add(e.value.reason)
    assert len(reasons) == 1 and not list((Path(shm) / "kvxfer-..").iterdir())


def _craft(shm, name, change):
    """A region file whose header ``change(raw: bytearray)`` edits (a planted or corrupted region)."""
    r = SharedRegion.create(name, _geometry(), attachers=1, directory=shm)
    r.close()
    path = Path(shm) / f"kvxfer-{name}"
    raw = bytearray(path.read_bytes())
    change(raw)
    path.write_bytes(bytes(raw))
    return path


def _put(offset, fmt, *values):
    import struct

    def change(raw):
        struct.pack_into(fmt, raw, offset, *values)
    return change


BAD_HEADERS = [
    ("magic", _put(0, "<8s", b"NOTKVXF0")),
    ("data_offset", _put(8, "<q", 0)),  # rows mapped over the header
    ("data_offset", _put(8, "<q", 4096 + 7)),
    ("data_offset", _put(8, "<q", 1 << 40)),
    ("json_bytes", _put(16, "<q", 0)),
    ("json_bytes", _put(16, "<q", 1 << 62)),
    ("json_bytes", _put(16, "<q", -5)),
    ("expected attachers", _put(24, "<q", -1)),
    ("expected attachers", _put(24, "<q", 1 << 40)),
    ("attached count", _put(32, "<q", 9)),
    ("geometry", lambda raw: raw.__setitem__(slice(1088, 1098), b"{not json!")),
    ("geometry", _put(1088, "<9s", b'{"x": 1} ')),
    ("size", lambda raw: raw.__delitem__(slice(len(raw) - 100, None))),  # rows cut short
    ("size", lambda raw: raw.__delitem__(slice(500, None))),  # inside the header
    ("pids[1]", lambda raw: (_put(32, "<q", 1)(raw), _put(80, "<qq", 2**31, 0)(raw))),  # a pid past pid_t
]


@pytest.mark.parametrize("field,change", BAD_HEADERS, ids=[f"{f}-{i}" for i, (f, _) in enumerate(BAD_HEADERS)])
def test_every_bad_header_field_raises_one_precise_error(shm, field, change):
    _craft(shm, "crafted", change)
    with pytest.raises(SharedRegionError) as e:
        SharedRegion.attach("crafted", shm)
    assert e.value.field == field and f"{field} = " in str(e.value), str(e.value)


def test_attach_waits_a_bounded_time_for_a_lock_holder(shm):
    import fcntl
    import os
    import threading

    r = SharedRegion.create("locked", _geometry(), attachers=1, directory=shm)
    fd = os.open(Path(shm) / "kvxfer-locked", os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # a stopped attacher holding the lock
    outcome = []

    def attach():
        try:
            SharedRegion.attach("locked", shm, lock_timeout_s=0.2)
        except SharedRegionError as e:
            outcome.append(e)
    t = threading.Thread(target=attach, daemon=True)
    t.start()
    t.join(60)
    os.close(fd)
    assert not t.is_alive() and outcome and "held by another process for more than 0.2 s" in str(outcome[0])
    r.close()


def test_two_names_for_one_region_are_refused_and_even_when_allowed_never_admit_more_attachers(shm):
    import os
    import threading

    creator = SharedRegion.create("twice", _geometry(), attachers=2, directory=shm)
    os.link(Path(shm) / "kvxfer-twice", Path(shm) / "kvxfer-alias")  # a second name for the same file
    for name in ("twice", "alias"):  # a file with two names is not trusted unless the caller vouches for it
        with pytest.raises(SharedRegionError, match="a file with 2 names"):
            SharedRegion.attach(name, shm)
    start, got, refused = threading.Barrier(6), [], []

    def attach(name):
        start.wait()
        try:
            got.append(SharedRegion.attach(name, shm, allow_foreign=True))
        except SharedRegionError as e:
            refused.append(str(e))
    threads = [threading.Thread(target=attach, args=(n,), daemon=True) for n in ("twice", "alias") * 3]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 2 and len(refused) == 4
    assert all("all 2 expected attachers already attached" in m or "no such region" in m for m in refused), refused
    with pytest.raises(SharedRegionError, match="already attached|no such region"):
        SharedRegion.attach("alias", shm)
    for r in (*got, creator):
        r.close()
