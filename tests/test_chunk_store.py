"""ChunkStore, the file tier under host memory, without vLLM: keys to slots in files, restarts, crashes,
identity, capacity and eviction, refusals naming the key.

Rows of a host buffer stand for vLLM's primary-tier chunks; every load is compared byte for byte with the rows
stored. Crashes are real: a subprocess is SIGKILLed at a chosen point of a store (an executor that kills it).
"""
from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors import FileBinding, PosixFileExecutor
from kvxfer.offload.files.chunk_store import (
    ENTRY,
    INDEX_HEADER_BYTES,
    ChunkStore,
    StoreConfigError,
    StoreError,
    namespace,
)

ROOT = Path(__file__).resolve().parents[1]
ROW, ROWS = 8192, 16
IDENTITY = {"model": "org/llama-test", "dtype": "float32", "block_size": 32}


def _memory(seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, ROW * ROWS, dtype=np.uint8)


def _keys(n: int, tag: str = "k") -> list[bytes]:
    return [f"{tag}{i:04d}".encode() + bytes(4) for i in range(n)]


def _store(root: Path, mem: np.ndarray, capacity_rows: int = 32, identity=IDENTITY, **kw) -> ChunkStore:
    return ChunkStore({"root_dir": str(root), "capacity_bytes": capacity_rows * ROW, **kw}, mem, ROW, identity)


def _wait(store: ChunkStore, n: int = 1, timeout_s: float = 30) -> list:
    out, deadline = [], time.monotonic() + timeout_s
    while len(out) < n and time.monotonic() < deadline:
        out += store.poll()
        time.sleep(0.005)
    assert len(out) == n, out
    return out


def _rows(mem: np.ndarray, rows) -> np.ndarray:
    return mem.reshape(ROWS, ROW)[list(rows)]


def test_rows_stored_under_keys_load_back_byte_exact_into_other_rows(tmp_path):
    mem = _memory(1)
    with_ = _store(tmp_path, mem)
    keys = _keys(4)
    assert not any(with_.lookup(k) for k in keys)
    with_.submit_store(1, keys, [0, 1, 2, 3])
    (r,) = _wait(with_)
    assert r.success and r.done_keys == tuple(keys) and r.nbytes == 4 * ROW
    assert all(with_.lookup(k) for k in keys)
    want = _rows(mem, [0, 1, 2, 3]).copy()
    with_.submit_load(2, keys[::-1], [15, 14, 13, 12])
    (r,) = _wait(with_)
    assert r.success and r.done_keys == tuple(keys[::-1])
    assert np.array_equal(_rows(mem, [15, 14, 13, 12]), want[::-1])  # k3 into row 15, ... k0 into row 12
    with_.close()


def test_rows_contiguous_in_memory_and_in_the_file_move_as_one_io(tmp_path):
    mem = _memory(2)
    ex = PosixFileExecutor(threads=2, piece_bytes=1 << 20)
    s = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 32 * ROW}, mem, ROW, IDENTITY, executor=ex)
    order = [5, 2, 7, 0, 3, 6, 1, 4]  # the keys of a job come in any order: their rows still go in one run
    s.submit_store(1, [_keys(8)[i] for i in order], order)
    _wait(s)
    assert s.stats.io_calls == 1 and s.stats.chunks_stored == 8
    s.submit_load(2, _keys(8), range(8, 16))
    _wait(s)
    assert s.stats.io_calls == 2 and np.array_equal(_rows(mem, range(8, 16)), _rows(mem, range(8)))
    s.close()
    ex.close()


def test_a_new_store_on_the_same_directory_finds_the_chunks_of_the_last_one(tmp_path):
    mem = _memory(3)
    s = _store(tmp_path, mem)
    s.submit_store(1, _keys(6), range(6))
    _wait(s)
    s.close()
    want = _rows(mem, range(6)).copy()
    mem[:] = 0
    s = _store(tmp_path, mem)
    assert s.stats.found == 6 and s.stats.discarded == 0
    assert all(s.lookup(k) for k in _keys(6))
    s.submit_load(7, _keys(6), range(10, 16))
    (r,) = _wait(s)
    assert r.success and np.array_equal(_rows(mem, range(10, 16)), want)
    s.close()


def test_another_identity_never_hits(tmp_path):
    mem = _memory(4)
    s = _store(tmp_path, mem)
    s.submit_store(1, _keys(3), range(3))
    _wait(s)
    s.close()
    for other in ({**IDENTITY, "dtype": "bfloat16"}, {**IDENTITY, "block_size": 64}):
        assert namespace(other) != namespace(IDENTITY)
        s = _store(tmp_path, mem, identity=other)
        assert s.stats.found == 0 and not any(s.lookup(k) for k in _keys(3))
        s.close()


def test_capacity_is_bounded_and_the_least_recently_used_keys_go_first(tmp_path):
    mem = _memory(5)
    s = _store(tmp_path, mem, capacity_rows=4)
    s.submit_store(1, _keys(4), range(4))
    _wait(s)
    s.touch([_keys(4)[0]])  # k0 is now the most recently used
    s.submit_store(2, _keys(2, "n"), [4, 5])
    _wait(s)
    hits = {k: s.lookup(k) for k in _keys(4) + _keys(2, "n")}
    assert hits == {**dict.fromkeys(_keys(4), False), _keys(4)[0]: True, _keys(4)[3]: True,
                    **dict.fromkeys(_keys(2, "n"), True)}
    assert s.stats.evictions == 2 and os.path.getsize(s.folder / "chunks.kvx") == 4 * ROW
    s.submit_load(3, [_keys(4)[3]], [9])
    (r,) = _wait(s)
    assert r.success and np.array_equal(_rows(mem, [9]), _rows(mem, [3]))
    s.close()


class _Gate:
    """An executor whose runs wait for ``release`` (a load in flight for as long as the test wants)."""

    def __init__(self):
        import threading

        self.inner, self.release = PosixFileExecutor(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def run(self, plan, memory, stream=None, after=None):
        self.release.wait(30)
        return self.inner.run(plan, memory)


def test_a_slot_being_loaded_is_never_reused_meanwhile(tmp_path):
    mem = _memory(6)
    gate = _Gate()
    gate.release.set()
    s = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 2 * ROW}, mem, ROW, IDENTITY, executor=gate)
    s.submit_store(1, _keys(2), [0, 1])
    _wait(s)
    want = _rows(mem, [0, 1]).copy()
    gate.release.clear()
    s.submit_load(2, _keys(2), [8, 9])
    s.submit_store(3, _keys(2, "n"), [2, 3])  # no slot is free that is not being read: nothing stored
    gate.release.set()
    results = {r.job_id: r for r in _wait(s, 2)}
    assert results[2].success and np.array_equal(_rows(mem, [8, 9]), want)
    assert results[3].success and results[3].done_keys == () and s.stats.skipped == 2
    s.close()
    gate.inner.close()


def test_a_chunk_changed_on_disk_is_a_miss_and_the_others_still_load(tmp_path):
    mem = _memory(7)
    s = _store(tmp_path, mem)
    keys = _keys(4)
    s.submit_store(1, keys, range(4))
    _wait(s)
    s.close()
    data = tmp_path / namespace(IDENTITY) / "chunks.kvx"
    with open(data, "r+b") as f:  # one byte of the third chunk (slot 2)
        f.seek(2 * ROW + 100)
        b = f.read(1)
        f.seek(2 * ROW + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    want = _rows(mem, range(4)).copy()
    s = _store(tmp_path, mem)
    s.submit_load(2, keys, range(12, 16))
    (r,) = _wait(s)
    assert not r.success and set(r.done_keys) == {keys[0], keys[1], keys[3]}
    assert "checksum" in str(r.error) and s.stats.integrity_misses == 1
    assert np.array_equal(_rows(mem, [12, 13, 15]), want[[0, 1, 3]])
    assert not s.lookup(keys[2]) and s.lookup(keys[3])  # dropped: later lookups miss
    s.close()


def test_index_entries_that_do_not_match_their_slot_are_discarded_at_open(tmp_path):
    mem = _memory(8)
    s = _store(tmp_path, mem)
    s.submit_store(1, _keys(3), range(3))
    _wait(s)
    s.close()
    index = tmp_path / namespace(IDENTITY) / "chunks.kvx.index"
    raw = bytearray(index.read_bytes())
    at = INDEX_HEADER_BYTES
    raw[at + 2 * ENTRY.itemsize: at + 3 * ENTRY.itemsize] = raw[at: at + ENTRY.itemsize]  # slot 0's entry at slot 2
    raw[at + ENTRY.itemsize] ^= 0x01  # slot 1's epoch no longer the one its record holds
    index.write_bytes(bytes(raw))
    s = _store(tmp_path, mem)
    assert (s.stats.found, s.stats.discarded) == (1, 2)
    assert [s.lookup(k) for k in _keys(3)] == [True, False, False]
    s.close()


# the child: store 4 keys, then 4 more over an executor that SIGKILLs the process at ``point``
CHILD = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import test_chunk_store as t
    from kvxfer.executors import PosixFileExecutor

    root, point = sys.argv[1], sys.argv[2]

    class Killing:
        def __init__(self): self.inner, self.armed = PosixFileExecutor(), False
        def __getattr__(self, name): return getattr(self.inner, name)
        def run(self, plan, memory, stream=None, after=None):
            if self.armed and point == "before data":
                os.kill(os.getpid(), signal.SIGKILL)
            transfer = self.inner.run(plan, memory)
            if self.armed and point == "after data":
                transfer.wait()
                os.kill(os.getpid(), signal.SIGKILL)
            return transfer

    ex = Killing()
    s = t.ChunkStore({{"root_dir": root, "capacity_bytes": 4 * t.ROW}}, t._memory(9), t.ROW, t.IDENTITY, executor=ex)
    s.submit_store(1, t._keys(4), range(4))
    t._wait(s)
    ex.armed = True
    s.submit_store(2, t._keys(4, "n"), range(4, 8))  # evicts all four: their slots are rewritten
    t._wait(s)
    os.kill(os.getpid(), signal.SIGKILL)
""").format(tests=str(ROOT / "tests"))


@pytest.mark.parametrize("point", ["before data", "after data", "after the index"])
def test_a_store_killed_anywhere_leaves_no_key_naming_other_bytes(tmp_path, point):
    proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), point], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    mem = np.zeros(ROW * ROWS, np.uint8)
    s = _store(tmp_path, mem, capacity_rows=4)
    old, new = [s.lookup(k) for k in _keys(4)], [s.lookup(k) for k in _keys(4, "n")]
    if point == "after the index":
        assert new == [True] * 4 and old == [False] * 4
        s.submit_load(1, _keys(4, "n"), range(8, 12))
        (r,) = _wait(s)
        assert r.success and np.array_equal(_rows(mem, range(8, 12)), _rows(_memory(9), range(4, 8)))
    else:  # the old keys' slots were being rewritten: neither the old keys nor the new ones are found
        assert old == [False] * 4 and new == [False] * 4 and s.stats.discarded == 4
    s.close()


def test_one_store_uses_the_files_at_a_time(tmp_path):
    a = _store(tmp_path, _memory(10))
    with pytest.raises(StoreError, match="held by another store"):
        _store(tmp_path, _memory(10), lock_timeout_s=0.1)
    a.close()
    _store(tmp_path, _memory(10)).close()


@pytest.mark.parametrize("config,field", [
    ({"root_dir": "/no/such/dir"}, "root_dir"),
    ({"root_dir": "/sys"}, "root_dir"),
    ({"capacity_bytes": ROW - 1}, "capacity_bytes"),
    ({"capacity_bytes": 2.5 * ROW}, "capacity_bytes"),
    ({"block_sizes": 4}, "block_sizes"),
    ({"lock_timeout_s": math.nan}, "lock_timeout_s"),
    ({"durability": "sometimes"}, "durability"),
    ({"verify": "yes"}, "verify"),
])
def test_bad_settings_are_refused_naming_the_key(tmp_path, config, field):
    with pytest.raises(StoreConfigError) as e:
        ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 4 * ROW, **config}, _memory(), ROW, IDENTITY)
    assert isinstance(e.value, ValueError) and e.value.field == field and str(e.value).startswith(f"{field} = ")
    assert "\n" not in str(e.value)


def test_links_and_foreign_files_are_refused(tmp_path):
    folder = tmp_path / namespace(IDENTITY)
    folder.symlink_to(tmp_path)
    with pytest.raises(StoreError, match="not a directory"):
        _store(tmp_path, _memory())
    folder.unlink()
    folder.mkdir(mode=0o700)
    (folder / "chunks.kvx").symlink_to(tmp_path / "elsewhere")
    s = _store(tmp_path, _memory())  # the link is set aside, never followed; the store starts beside it
    s.close()
    assert not (tmp_path / "elsewhere").exists() and not (folder / "chunks.kvx").is_symlink()
    assert [p.is_symlink() for p in folder.glob("chunks.kvx.damaged-*")] == [True]
    os.chmod(folder, 0o777)
    with pytest.raises(StoreError, match="writable by others"):
        _store(tmp_path, _memory())
    os.chmod(folder, 0o700)
    (folder / "identity.json").write_text(json.dumps({"model": "another"}))
    with pytest.raises(StoreError, match="another identity"):
        _store(tmp_path, _memory())
    assert FileBinding  # the data file's own refusals (foreign owner, others may write) are FileBinding's


def test_files_are_private_to_their_owner(tmp_path):
    s = _store(tmp_path, _memory(11))
    s.submit_store(1, _keys(1), [0])
    _wait(s)
    s.close()
    modes = {p.name: p.stat().st_mode & 0o777 for p in s.folder.iterdir()}
    assert modes == dict.fromkeys(["identity.json", "chunks.kvx", "chunks.kvx.kvxsum", "chunks.kvx.index"], 0o600)
    assert s.folder.stat().st_mode & 0o777 == 0o700


def test_counters_are_written_after_each_job(tmp_path):
    stats = tmp_path / "store.json"
    s = _store(tmp_path, _memory(12), stats_path=str(stats))
    s.submit_store(1, _keys(2), [0, 1])
    _wait(s)
    s.submit_load(2, _keys(2), [5, 6])
    _wait(s)
    got = json.loads(stats.read_text())
    assert (got["stores"], got["chunks_stored"], got["loads"], got["chunks_loaded"]) == (1, 2, 1, 2)
    assert got["syncs"] == 4 and got["load_timeline"][0]["chunks"] == 2
    s.close()
