"""The shared store (offload/files/shared_store.py): several writers on one root_dir, no lock, every chunk
validated, eviction only of a writer's own files or of dead writers' files; and a multi-process stress run."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from kvxfer.offload.files import ChunkStore
from kvxfer.offload.files.shared_store import HEADER_BYTES, SharedChunkStore, encode_chunk

ROW = 4096
IDENTITY = {"model": "shared-test", "v": 1}
STRESS = Path(__file__).with_name("shared_stress.py")


def _store(root: Path, memory: np.ndarray, chunks: int = 16, **kw: float) -> SharedChunkStore:
    return SharedChunkStore({"root_dir": str(root), "capacity_bytes": chunks * (ROW + HEADER_BYTES),
                             "durability": "none"}, memory, ROW, IDENTITY, **kw)


def _run(store: SharedChunkStore, op: str, job: int, keys: list[bytes], rows: list[int]) -> object:
    (store.submit_store if op == "store" else store.submit_load)(job, keys, rows)
    store.drain()
    (r,) = store.poll()
    return r


def _rows(n: int) -> np.ndarray:
    return np.random.default_rng(7).integers(0, 256, n * ROW, dtype=np.uint8)


def test_a_second_store_opens_and_loads_the_first_ones_chunks(tmp_path: Path) -> None:
    mem_a, mem_b = _rows(4), np.zeros(4 * ROW, np.uint8)
    a = _store(tmp_path, mem_a)
    b = _store(tmp_path, mem_b)  # no lock: opens at once beside a
    try:
        assert _run(a, "store", 1, [b"k0", b"k1"], [0, 1]).success
        c = _store(tmp_path, np.zeros(4 * ROW, np.uint8))
        assert c.lookup(b"k0") and c.lookup(b"k1")
        c.close()
        b._scan()
        assert b.lookup(b"k1")
        r = _run(b, "load", 2, [b"k1", b"k0"], [0, 1])
        assert r.success and r.done_keys == (b"k1", b"k0")
        assert np.array_equal(mem_b[:ROW], mem_a[ROW:2 * ROW]) and np.array_equal(mem_b[ROW:2 * ROW], mem_a[:ROW])
        assert _run(b, "store", 3, [b"k0"], [2]).done_keys == (b"k0",)  # held by a: not written again
        assert not b.owns(b"k0") and a.owns(b"k0")
    finally:
        a.close()
        b.close()


def _one_file(tmp_path: Path) -> tuple[SharedChunkStore, SharedChunkStore, np.ndarray, Path]:
    a = _store(tmp_path, _rows(2))
    assert _run(a, "store", 1, [b"k"], [0]).success
    mem = np.full(2 * ROW, 0xEE, np.uint8)
    b = _store(tmp_path, mem)
    (path,) = [p for p in b.folder.iterdir() if p.suffix == ".kvc"]
    return a, b, mem, path


@pytest.mark.parametrize("damage", ["flip", "cut", "other-key", "mode", "link", "other-identity"])
def test_a_damaged_foreign_or_planted_chunk_is_a_miss_never_bytes(tmp_path: Path, damage: str) -> None:
    a, b, mem, path = _one_file(tmp_path)
    raw = bytearray(path.read_bytes())
    if damage == "flip":
        raw[HEADER_BYTES + 100] ^= 1
        path.write_bytes(raw)
    elif damage == "cut":
        path.write_bytes(raw[:-1])
    elif damage == "other-key":
        path.write_bytes(encode_chunk(b"x", raw[HEADER_BYTES:], a.writer, a.digest, 1))
    elif damage == "other-identity":
        path.write_bytes(encode_chunk(b"k", raw[HEADER_BYTES:], a.writer, bytes(16), 1))
    elif damage == "mode":
        os.chmod(path, 0o666)
    else:
        planted = tmp_path / "planted"
        planted.write_bytes(raw)
        path.unlink()
        path.symlink_to(planted)
    r = _run(b, "load", 2, [b"k"], [1])
    assert not r.success and r.done_keys == ()
    assert (mem == 0xEE).all()  # nothing was copied into memory
    a.close()
    b.close()


def test_a_refused_chunk_is_left_in_place_logged_once_and_not_offered_again_until_its_file_changes(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    # a damaged file stayed a hit at every listing, so vLLM promoted and failed it again every second; it may be
    # another live engine's file, so it is never renamed or removed for it
    a, b, mem, path = _one_file(tmp_path)
    good = path.read_bytes()
    raw = bytearray(good)
    raw[HEADER_BYTES + 100] ^= 1
    path.write_bytes(raw)
    with caplog.at_level("WARNING", logger="kvxfer.offload.files.shared_store"):
        assert not _run(b, "load", 2, [b"k"], [1]).success
        for _ in range(2):
            b._scan()
            assert not b.lookup(b"k")  # a miss from now on, listing after listing
    assert path.read_bytes() == raw and sorted(p.name for p in b.folder.iterdir() if p.is_file()) == [path.name]
    assert sum("refused" in m and path.name in m for m in caplog.messages) == 1
    tmp = path.with_suffix(".new")
    tmp.write_bytes(good)
    os.chmod(tmp, 0o600)
    tmp.rename(path)  # its writer stores the key again: another file under the name
    b._scan()
    assert b.lookup(b"k") and _run(b, "load", 3, [b"k"], [1]).success
    assert (mem[ROW:] != 0xEE).any()
    a.close()
    b.close()


def test_eviction_removes_own_files_and_dead_writers_files_never_a_live_writers(tmp_path: Path) -> None:
    a = _store(tmp_path, _rows(8), chunks=4)
    assert _run(a, "store", 1, [b"a0", b"a1", b"a2", b"a3"], [0, 1, 2, 3]).done_keys == (b"a0", b"a1", b"a2", b"a3")
    b = _store(tmp_path, _rows(8), chunks=4, dead_after_s=3600.0)
    r = _run(b, "store", 2, [b"b0"], [4])  # full of a live writer's files: b skips, a keeps its chunks
    assert r.success and r.done_keys == () and b.stats.skipped == 1
    assert all(a.owns(k) for k in (b"a0", b"a1", b"a2", b"a3"))
    assert _run(a, "store", 3, [b"a4"], [4]).done_keys == (b"a4",)  # a evicts its own oldest
    assert not a.owns(b"a0") and a.owns(b"a4")
    a.close()
    old = time.time() - 7200
    os.utime(a._lease, (old, old))  # a's lease is old: a is dead
    b._scan()
    assert _run(b, "store", 4, [b"b0"], [4]).done_keys == (b"b0",)
    names = {p.name.split(".")[0] for p in b.folder.iterdir() if p.suffix == ".kvc"}
    assert len(names) <= 4 and b"b0".hex() in names
    b.close()


def test_a_single_engine_store_opens_as_before_beside_a_shared_one(tmp_path: Path) -> None:
    mem = _rows(2)
    s = _store(tmp_path, mem)
    cs = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 4 * ROW, "durability": "none"}, mem, ROW, IDENTITY)
    try:
        assert cs.folder == s.folder.parent and (cs.folder / "chunks.kvx.index").is_file()
        cs.submit_store(1, [b"k"], [0])
        cs.drain()
        assert cs.poll()[0].success and not s.lookup(b"k")  # the two formats never read each other's files
    finally:
        cs.close()
        s.close()


def _writer(root: Path, seed: int, jobs: int, capacity: int) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, str(STRESS), str(root), str(seed), str(jobs), str(capacity)],
                            stdout=subprocess.PIPE, text=True)


def test_several_processes_store_load_and_evict_with_a_kill(tmp_path: Path) -> None:
    """Five writers on one store of 48 chunks (one SIGKILLed mid-run, a sixth started after): 0 wrong bytes, 0
    lost acknowledged stores, every job answered; afterwards the store is back within its capacity."""
    capacity = 48 * (ROW + HEADER_BYTES)
    procs = [_writer(tmp_path, seed, 500, capacity) for seed in range(5)]
    victim = procs[0]
    assert victim.stdout is not None
    for _ in range(40):  # killed in the middle of its stores
        victim.stdout.readline()
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    late = _writer(tmp_path, 99, 300, capacity)
    totals: dict[str, int] = {}
    for p in [*procs[1:], late]:
        out, _ = p.communicate(timeout=600)
        assert p.returncode == 0
        counts = json.loads(out.strip().splitlines()[-1])
        assert counts["jobs"] == counts["results"] >= 300
        for k, v in counts.items():
            totals[k] = totals.get(k, 0) + v
    assert totals["wrong_bytes"] == 0 and totals["lost"] == 0 and totals["hangs"] == 0
    assert totals["acked"] > 0 and totals["loaded"] > 0  # it stored and loaded across writers
    after = _store(tmp_path, np.zeros(ROW, np.uint8), chunks=48, dead_after_s=3600.0)  # dead by pid: reaped
    try:
        files = [p for p in after.folder.iterdir() if p.is_file()]
        assert sum(p.stat().st_size for p in files) <= capacity
        assert not [p for p in files if p.name.startswith(".tmp.")]
    finally:
        after.close()


def test_a_dead_writers_temporary_file_and_lease_are_reaped_and_a_live_writer_recreates_its_lease(tmp_path: Path) -> None:
    a = _store(tmp_path, _rows(2))
    dead = a.writer.rsplit("-", 2)[0] + "-999999999-deadbeef"  # a pid of this host that does not exist
    (a.folder / f".tmp.{dead}.1").write_bytes(b"half a chunk")
    (a.folder / "writers" / f"{dead}.lease").write_text("{}")
    old = time.time() - 7200
    os.utime(a.folder / "writers" / f"{dead}.lease", (old, old))
    a._lease.unlink()  # taken for dead by someone (a stall): it comes back at the next listing
    a._scan()
    assert not (a.folder / f".tmp.{dead}.1").exists() and not (a.folder / "writers" / f"{dead}.lease").exists()
    assert a._lease.exists()
    a.close()


@pytest.mark.parametrize("key,value", [("verify", False), ("o_direct", True), ("io_threads", 4),
                                       ("lock_timeout_s", 30.0)])
def test_a_setting_the_shared_store_does_not_carry_out_is_refused_by_name(tmp_path: Path, key: str,
                                                                          value: object) -> None:
    from kvxfer.offload.files.chunk_store import StoreConfigError

    config = {"root_dir": str(tmp_path), "capacity_bytes": 16 * (ROW + HEADER_BYTES), "shared": True, key: value}
    with pytest.raises(StoreConfigError, match=f"{key}.*not with shared"):
        SharedChunkStore(config, _rows(4), ROW, IDENTITY)
    # its default, said out loud, is no refusal
    default = {"verify": True, "o_direct": False, "io_threads": None, "lock_timeout_s": 5.0}[key]
    SharedChunkStore({**config, key: default}, _rows(4), ROW, IDENTITY).close()


def test_memory_the_shared_store_could_only_copy_is_refused(tmp_path: Path) -> None:
    from kvxfer.offload.files.chunk_store import StoreConfigError

    fortran = np.asfortranarray(_rows(4).reshape(4, ROW))
    with pytest.raises(StoreConfigError, match="memory.*C-contiguous"):
        _store(tmp_path, fortran)


class _Stop(BaseException):
    pass


def test_a_shared_store_thread_that_stops_anyway_fails_every_job_and_no_waiter_hangs(tmp_path: Path) -> None:
    import threading

    s = _store(tmp_path, np.zeros(4 * ROW, np.uint8))
    gate = threading.Event()

    def dies(*_: object) -> object:
        gate.wait(10)
        raise _Stop("the thread stops")

    s._store = dies  # type: ignore[method-assign]
    s.submit_store(1, [b"a"], [0])
    s.submit_store(2, [b"b"], [1])
    gate.set()
    waiter = threading.Thread(target=s.drain, daemon=True)
    waiter.start()
    waiter.join(30)
    assert not waiter.is_alive()
    s.submit_load(3, [b"a"], [2])
    results = s.poll()
    assert sorted(r.job_id for r in results) == [1, 2, 3] and not any(r.success for r in results)
    assert all("thread stopped" in str(r.error) for r in results)
    assert not s.pending
    s.close()
