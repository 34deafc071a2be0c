"""A store can cost the cache, never its user: ChunkStore under damage and bad input, without vLLM.

Whatever is found in the store's folder (a truncated data file, a read that fails, records that are not the
data file's, files swapped, links), the store opens and serves; a chunk that cannot be read and checked is a
miss from then on (``lookup`` stops answering it); what was found is logged once and set aside, never deleted or
followed. Bad jobs are refused at submission naming the field, index and value, and nothing a side task does
stops the store's thread or hangs a waiter.
"""
from __future__ import annotations

import errno
import json
import logging
import mmap
import os
import threading

import numpy as np
import pytest

from kvxfer.executors import ExecutorError, PosixFileExecutor
from kvxfer.offload.files import chunk_store as cs
from kvxfer.offload.files.chunk_store import ChunkStore, StoreConfigError, StoreError, StoreJobError, namespace
from tests.test_chunk_store import IDENTITY, ROW, ROWS, _keys, _memory, _rows, _store, _wait

LOG = "kvxfer.offload.files.chunk_store"


def _stored(tmp_path, n: int = 4, seed: int = 1, **kw) -> tuple[ChunkStore, np.ndarray, list[bytes]]:
    mem = _memory(seed)
    s = _store(tmp_path, mem, **kw)
    keys = _keys(n)
    s.submit_store(1, keys, list(range(n)))
    assert _wait(s)[0].success
    return s, mem, keys


def _reopen(tmp_path, seed: int = 2, **kw) -> ChunkStore:
    return _store(tmp_path, _memory(seed), **kw)


# ---- 1: a chunk that cannot be read is a miss from then on ------------------------------------------------------
def test_a_truncated_data_file_makes_the_chunks_past_its_end_misses_and_the_others_still_load(tmp_path, caplog):
    s, mem, keys = _stored(tmp_path)
    s.close()
    os.truncate(s.folder / "chunks.kvx", 2 * ROW)  # slots 2 and 3 are gone
    s = _reopen(tmp_path)
    with caplog.at_level(logging.WARNING, LOG):
        s.submit_load(2, keys, [8, 9, 10, 11])
        (r,) = _wait(s)
    assert not r.success and set(r.done_keys) == set(keys[:2])
    assert np.array_equal(_rows(s.memory, [8, 9]), _rows(mem, [0, 1]))
    assert [s.lookup(k) for k in keys] == [True, True, False, False]  # vLLM asks no more for what cannot be read
    assert sum("refused and dropped" in m for m in caplog.messages) == 1
    s.submit_load(3, keys[:2], [12, 13])
    assert _wait(s)[0].success
    s.close()


class _FailingReads:
    """PosixFileExecutor whose reads of one file offset fail as a disk with a bad sector fails them (EIO)."""

    def __init__(self, bad_offset: int):
        self.inner, self.bad, self.calls = PosixFileExecutor(), bad_offset, 0

    def register(self, *a, **kw):
        return self.inner.register(*a, **kw)

    def bind(self, *a, **kw):
        return self.inner.bind(*a, **kw)

    def run(self, plan, memory, stream=None):
        if plan.direction.value == "h2d":
            lo, hi = plan.src_offset, plan.src_offset + plan.nbytes
            if np.any((lo <= self.bad) & (self.bad < hi)):
                raise ExecutorError("pread", 0, 0, "Input/output error (errno 5)", 0)
        return self.inner.run(plan, memory, stream)

    def close(self):
        self.inner.close()


def test_a_persistent_read_error_makes_that_chunk_a_miss_once_and_never_a_hit_again(tmp_path):
    s, mem, keys = _stored(tmp_path)
    s.close()
    ex = _FailingReads(bad_offset=1 * ROW)
    s = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 32 * ROW}, _memory(3), ROW, IDENTITY, executor=ex)
    s.submit_load(2, keys, [8, 9, 10, 11])
    (r,) = _wait(s)
    assert not r.success and set(r.done_keys) == {keys[0], keys[2], keys[3]} and "errno 5" in str(r.error)
    assert np.array_equal(_rows(s.memory, [8, 10, 11]), _rows(mem, [0, 2, 3]))
    assert not s.lookup(keys[1]) and s.lookup(keys[0])
    s.close()
    ex.close()


# ---- 2, 15: bad jobs refused at submission, naming field, index and value ------------------------------------
def test_a_key_twice_in_a_job_or_a_job_id_in_use_is_refused_and_no_other_job_is_lost(tmp_path):
    s, mem, keys = _stored(tmp_path)
    s.submit_load(2, keys[:2], [8, 9])
    with pytest.raises(StoreJobError) as e:
        s.submit_load(2, keys[2:], [10, 11])
    assert e.value.field == "job_id" and e.value.value == 2
    with pytest.raises(StoreJobError) as e:
        s.submit_store(3, [b"new", b"other", b"new"], [4, 5, 6])
    assert (e.value.field, e.value.index, e.value.value) == ("keys", 2, b"new")
    with pytest.raises(StoreJobError) as e:
        s.submit_load(4, [keys[0], keys[0]], [8, 9])
    assert (e.value.field, e.value.index) == ("keys", 1)
    s.submit_store(5, [b"new"], [4])
    results = _wait(s, 2)
    assert sorted(r.job_id for r in results) == [2, 5] and all(r.success for r in results)
    assert s.lookup(b"new") and s._nfree == s.slots - 5
    s.close()


@pytest.mark.parametrize("rows,index,value", [
    ([0, float("nan")], 1, "nan"), ([2**70], 0, 2**70), ([1.7], 0, 1.7), ([0, -1], 1, -1), ([ROWS], 0, ROWS),
    ([True], 0, True),
])
def test_rows_that_are_not_row_numbers_are_refused_naming_the_index_and_value(tmp_path, rows, index, value):
    s = _store(tmp_path, _memory())
    for submit in (s.submit_store, s.submit_load):
        with pytest.raises(StoreJobError) as e:
            submit(1, _keys(len(rows)), rows)
        assert e.value.field == "rows" and e.value.index == index and "\n" not in str(e.value)
        assert str(e.value.value) == str(value)
    s.close()


def test_a_load_of_keys_never_stored_says_how_many_of_those_asked(tmp_path):
    s, mem, keys = _stored(tmp_path, n=1)
    s.submit_load(2, [keys[0], b"unknown"], [8, 9])
    (r,) = _wait(s)
    assert not r.success and r.done_keys == (keys[0],)
    assert "1 of the 2 keys asked are not stored" in str(r.error) and "unknown" in str(r.error)
    s.close()


# ---- 3: the store's thread never dies of a side task; if it dies, waiters get errors --------------------------
@pytest.mark.parametrize("path", ["a\0b.json", "stats-\udc80\ud800.json", "x" * 300 + ".json"])
def test_a_stats_path_the_system_cannot_take_is_refused_at_construction(tmp_path, path):
    with pytest.raises(StoreConfigError) as e:
        _store(tmp_path, _memory(), stats_path=str(tmp_path / path))
    assert e.value.field == "stats_path" and "\n" not in str(e.value)


def test_a_counters_write_that_raises_anything_never_stops_the_jobs(tmp_path, monkeypatch, caplog):
    s = _store(tmp_path, _memory(), stats_path=str(tmp_path / "stats.json"))

    def broken(path, data, sync=False):
        raise ValueError("embedded null byte")

    monkeypatch.setattr(cs, "replace_file", broken)
    with caplog.at_level(logging.WARNING, LOG):
        for job in range(3):
            s.submit_store(job, _keys(1, f"j{job}"), [job])
            assert _wait(s)[0].success
    s.drain()
    assert sum("cannot write the counters" in m for m in caplog.messages) == 1
    s.close()


class _Stop(BaseException):
    pass


def test_a_store_thread_that_stops_anyway_fails_every_job_and_no_waiter_hangs(tmp_path, caplog):
    s = _store(tmp_path, _memory())
    gate = threading.Event()

    def dies(job):
        gate.wait(10)
        raise _Stop("the thread stops")

    s._store = dies
    with caplog.at_level(logging.ERROR, LOG):
        s.submit_store(1, _keys(1, "a"), [0])
        s.submit_store(2, _keys(1, "b"), [1])
        gate.set()
        done = threading.Thread(target=s.drain, daemon=True)
        done.start()
        done.join(30)
        assert not done.is_alive()
        s.submit_store(3, _keys(1, "c"), [2])
        results = _wait(s, 3)
    assert sorted(r.job_id for r in results) == [1, 2, 3] and not any(r.success for r in results)
    assert all(isinstance(r.error, StoreError) for r in results)
    assert any("thread stopped" in m for m in caplog.messages)
    s.close()


# ---- 4: no private copy of the caller's memory ---------------------------------------------------------------
@pytest.mark.parametrize("memory", [
    np.zeros((ROW, ROWS), np.uint8, order="F"), np.zeros(2 * ROW * ROWS, np.uint8)[::2],
])
def test_memory_that_cannot_be_viewed_without_a_copy_is_refused(tmp_path, memory):
    with pytest.raises(StoreConfigError) as e:
        ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 4 * ROW}, memory, ROW, IDENTITY)
    assert e.value.field == "memory"


# ---- 5, 11: file-level damage: the store opens, says what it found and set aside, never deletes ------------------
def _copy_under_a_new_inode(path):
    copy = path.with_name("copy")  # made while the original exists: another inode
    copy.write_bytes(path.read_bytes())
    copy.chmod(0o600)
    os.rename(copy, path)


def _link_to_a_copy(path):
    target = path.with_name("planted")
    target.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(target)


def _random_records(path):
    sums = path.with_name(path.name + ".kvxsum")
    sums.write_bytes(np.random.default_rng(5).integers(0, 256, sums.stat().st_size, dtype=np.uint8).tobytes())


def _swap_index_and_records(path):
    index, sums = path.with_name(path.name + ".index"), path.with_name(path.name + ".kvxsum")
    tmp = path.with_name("swap")
    os.rename(index, tmp)
    os.rename(sums, index)
    os.rename(tmp, sums)


@pytest.mark.parametrize("damage", [_copy_under_a_new_inode, _link_to_a_copy, _random_records, _swap_index_and_records])
def test_damage_to_a_whole_file_opens_a_store_that_serves_and_logs_what_was_set_aside(tmp_path, caplog, damage):
    s, mem, keys = _stored(tmp_path)
    s.close()
    before = sorted(p.name for p in s.folder.iterdir())
    damage(s.folder / "chunks.kvx")
    with caplog.at_level(logging.WARNING, LOG):
        s = _reopen(tmp_path, seed=4)
    (line,) = [m for m in caplog.messages if "starts over" in m]
    assert "found" in line and "set aside as" in line
    aside = [p for p in s.folder.iterdir() if ".damaged-" in p.name]
    assert aside and all(p.name in line for p in aside)  # nothing deleted: every damaged file kept, named
    assert not any(s.lookup(k) for k in keys)  # nothing of what was found is trusted
    s.submit_store(2, keys, [4, 5, 6, 7])
    assert _wait(s)[0].success
    s.submit_load(3, keys, [8, 9, 10, 11])
    assert _wait(s)[0].success and np.array_equal(_rows(s.memory, [8, 9, 10, 11]), _rows(s.memory, [4, 5, 6, 7]))
    assert not (s.folder / "chunks.kvx").is_symlink() and set(before) <= {p.name for p in s.folder.iterdir()}
    s.close()
    caplog.clear()
    with caplog.at_level(logging.WARNING, LOG):
        s = _reopen(tmp_path, seed=4)
    assert all(s.lookup(k) for k in keys) and not [m for m in caplog.messages if "starts over" in m]
    s.close()


# ---- 6: counters files never follow a planted link -----------------------------------------------------------
def test_the_counters_file_never_follows_a_link_planted_at_a_temporary_name(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep")
    stats = tmp_path / "stats.json"
    for name in (f"{stats.name}.{os.getpid()}.tmp", f".{stats.name}.{os.getpid()}.tmp"):
        os.symlink(victim, tmp_path / name)
    s = _store(tmp_path, _memory(), stats_path=str(stats))
    s.submit_store(1, _keys(1), [0])
    _wait(s)
    s.close()
    assert victim.read_text() == "keep" and json.loads(stats.read_text())["stores"] == 1
    assert not stats.is_symlink()


# ---- 7, 14: the identity file -------------------------------------------------------------------------------
def test_a_full_disk_at_the_first_open_leaves_nothing_that_blocks_the_next(tmp_path, monkeypatch):
    real_write, real_fsync = os.write, os.fsync

    def full(*a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full)
    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(StoreError, match="No space left"):
        _store(tmp_path, _memory())
    monkeypatch.setattr(os, "write", real_write)
    monkeypatch.setattr(os, "fsync", real_fsync)
    folder = tmp_path / namespace(IDENTITY)
    assert [p.name for p in folder.iterdir()] == []
    s, _, keys = _stored(tmp_path)
    s.close()


def test_an_empty_identity_left_by_an_older_release_is_written_anew(tmp_path):
    folder = tmp_path / namespace(IDENTITY)
    folder.mkdir(mode=0o700)
    (folder / "identity.json").touch(mode=0o600)
    s = _store(tmp_path, _memory())
    s.close()
    assert json.loads((folder / "identity.json").read_text()) == IDENTITY


@pytest.mark.parametrize("plant", ["symlink", "fifo", "directory"])
def test_an_identity_that_is_not_a_regular_file_is_refused_as_a_store_error(tmp_path, plant):
    folder = tmp_path / namespace(IDENTITY)
    folder.mkdir(mode=0o700)
    path = folder / "identity.json"
    if plant == "symlink":
        (tmp_path / "real.json").write_text(json.dumps(IDENTITY, sort_keys=True, indent=1))
        path.symlink_to(tmp_path / "real.json")
    elif plant == "fifo":
        os.mkfifo(path, 0o600)
    else:
        path.mkdir()
    with pytest.raises(StoreError) as e:
        _store(tmp_path, _memory())
    assert "identity.json" in str(e.value) and "\n" not in str(e.value)


# ---- 12: nothing of the caller's memory is viewed after close -------------------------------------------------
def test_close_keeps_no_view_of_the_callers_memory(tmp_path):
    region = mmap.mmap(-1, ROW * ROWS)
    rows = np.frombuffer(region, np.uint8)
    s = _store(tmp_path, rows)
    s.submit_store(1, _keys(2), [0, 1])
    _wait(s)
    s.submit_load(2, _keys(2), [2, 3])
    _wait(s)
    s.close()
    del rows
    region.close()  # BufferError while any view of it is alive


# ---- test gap: slots found on reopening are in use ------------------------------------------------------------
def test_slots_found_on_reopening_are_never_given_to_a_later_store(tmp_path):
    s, mem, keys = _stored(tmp_path, n=2, capacity_rows=4)
    s.close()
    s = _reopen(tmp_path, seed=6, capacity_rows=4)
    other = _keys(2, "o")
    s.submit_store(2, other, [0, 1])
    assert _wait(s)[0].success
    s.submit_load(3, keys, [8, 9])
    (r,) = _wait(s)
    assert r.success and np.array_equal(_rows(s.memory, [8, 9]), _rows(mem, [0, 1]))
    s.close()
