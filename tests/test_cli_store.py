"""``kvxfer store show|verify|purge|resize`` on real stores written by ``ChunkStore``: one intact, one damaged on
purpose, one held by a running store (the commands that need it to themselves refuse, ``show`` still reads)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvxfer.cli.cmd_store import parse_size
from kvxfer.cli.main import main
from kvxfer.offload.files.chunk_store import ChunkStore

ROW = 4096
IDENTITY = {"format": "test", "model": "sha256:0123", "dtype": "float32"}


def _store(root: Path, n: int = 6, slots: int = 8, identity: dict | None = None) -> tuple[Path, np.ndarray]:
    rows = np.random.default_rng(n).integers(0, 255, (slots, ROW), dtype=np.uint8)
    s = ChunkStore({"root_dir": str(root), "capacity_bytes": slots * ROW}, rows, ROW, identity or IDENTITY)
    for i in range(n):  # one job per chunk: each its own epoch, key i the i-th most recent
        s.submit_store(i, [bytes([i]) * 8], [i])
        s.drain()
        s.poll()
    s.close()
    return s.folder, rows


def _run(capsys, *args: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as e:
        main(list(args))
    out = capsys.readouterr()
    return int(e.value.code or 0), out.out, out.err


def test_show_reads_identity_capacity_chunks_and_times_from_a_root_or_a_folder(tmp_path, capsys):
    folder, _ = _store(tmp_path)
    code, out, _ = _run(capsys, "store", "show", str(tmp_path))
    assert code == 0 and f"store      {folder}" in out
    assert "capacity   8 chunks of 4096 B (32.0 KiB)" in out and "chunks     6 (24.0 KiB), 0 discarded" in out
    assert "model sha256:0123" in out and "UTC" in out and "in use     no" in out
    code, out, _ = _run(capsys, "store", "show", str(folder), "--json")
    (r,) = json.loads(out)
    assert r["chunks"] == 6 and r["identity"] == IDENTITY and r["oldest_us"] < r["newest_us"]


def test_verify_counts_every_chunk_and_the_damaged_ones_and_writes_nothing(tmp_path, capsys):
    folder, _ = _store(tmp_path)
    code, out, _ = _run(capsys, "store", "verify", str(folder))
    assert code == 0 and "6 chunks checked, 0 failed" in out
    with open(folder / "chunks.kvx", "r+b") as f:  # damage two chunks' bytes (slots 1 and 4)
        for slot in (1, 4):
            f.seek(slot * ROW + 7)
            f.write(b"\x00\xff\x00\xff")
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    code, out, _ = _run(capsys, "store", "verify", str(folder))
    assert code == 1 and "6 chunks checked, 2 failed" in out and "checksum" in out
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before  # read-only


def test_resize_keeps_the_most_recent_chunks_and_their_bytes(tmp_path, capsys):
    folder, rows = _store(tmp_path)
    code, out, _ = _run(capsys, "store", "resize", str(folder), "--capacity", "16KiB")
    assert code == 0 and "4 chunks kept, 2 dropped" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == [folder.name]  # nothing left aside
    scratch = np.zeros((4, ROW), np.uint8)
    s = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 4 * ROW}, scratch, ROW, IDENTITY)
    try:
        assert list(s.index) == [bytes([i]) * 8 for i in (2, 3, 4, 5)]  # newest kept, LRU order kept
        s.submit_load(9, list(s.index), [0, 1, 2, 3])
        s.drain()
        (r,) = s.poll()
        assert r.success and np.array_equal(scratch, rows[2:6])
    finally:
        s.close()


def test_purge_asks_for_yes_then_removes_the_store(tmp_path, capsys):
    folder, _ = _store(tmp_path)
    code, out, _ = _run(capsys, "store", "purge", str(tmp_path))
    assert code == 1 and "would remove" in out and folder.exists()
    code, out, _ = _run(capsys, "store", "purge", str(tmp_path), "--yes")
    assert code == 0 and "removed" in out and not folder.exists()


def test_a_store_an_engine_holds_is_shown_but_never_verified_purged_or_resized(tmp_path, capsys):
    folder, _ = _store(tmp_path)
    live = ChunkStore({"root_dir": str(tmp_path), "capacity_bytes": 8 * ROW}, np.zeros((8, ROW), np.uint8), ROW,
                      IDENTITY)
    try:
        code, out, _ = _run(capsys, "store", "show", str(folder))
        assert code == 0 and "in use     yes" in out and "chunks     6" in out
        for args in (("verify",), ("purge", "--yes"), ("resize", "--capacity", "4K")):
            code, _, err = _run(capsys, "store", args[0], str(folder), *args[1:])
            assert code == 1 and "in use by a running store" in err and err.count("\n") == 1
        assert folder.exists() and len(live.index) == 6
    finally:
        live.close()


def test_bad_paths_and_sizes_are_refused_in_one_line(tmp_path, capsys):
    code, _, err = _run(capsys, "store", "show", str(tmp_path / "none"))
    assert code == 2 and "no such directory" in err
    code, _, err = _run(capsys, "store", "show", str(tmp_path))
    assert code == 2 and "neither a kvxfer store" in err
    assert parse_size("64GiB") == 64 << 30 and parse_size("512m") == 512 << 20 and parse_size("4096") == 4096
    with pytest.raises(ValueError, match="--capacity"):
        parse_size("lots")
