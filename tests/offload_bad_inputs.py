"""Bad inputs of the offload layer for the catalogue in test_bad_inputs.py: the worker's submissions and models,
shared regions (names, planted and crafted region files), and files (planted links, foreign files, integrity
records that belong elsewhere). Each row is ``(name, act, error, fragment)``; ``act(env)`` works in ``env.folder``
(plain files only: the harness reads back every entry) and must raise ``error`` (a ValueError subclass) with
``fragment`` in its one-line message. Non-regular files and other users' files are in test_file_tier_nixl.py."""
from __future__ import annotations

import os
import struct
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.executors import BindingError, NumpyExecutor
from kvxfer.executors.nixl_memory import FileBinding
from kvxfer.offload import (
    DeviceKV,
    FileTier,
    HostTier,
    KVTensor,
    OffloadWorker,
    SharedRegion,
    SharedRegionError,
    SharedSpec,
    SubmissionError,
    TPRank,
    create_worker,
    make_geometry,
    tier_layout,
)
from kvxfer.planner import Buffer, LayoutError, Location

Act = Callable[[Any], Any]


def worker(call: Callable[[OffloadWorker], Any]) -> Act:
    """Run ``call`` on a fresh worker (two 64-byte layers of 8 blocks, 4 host chunks of 2), then shut it down."""
    def act(env: Any) -> Any:
        bind = {f"d{i}": np.zeros(8 * 64, np.uint8) for i in range(2)}
        device = DeviceKV(tuple(Buffer(name=n, nbytes=8 * 64, location=Location.DEVICE) for n in bind),
                          tuple(KVTensor(name=f"L{i}", buffer=f"d{i}", page_bytes=64) for i in range(2)), bind)
        w = create_worker(device, HostTier(num_chunks=4, blocks_per_chunk=2, pin=False), NumpyExecutor())
        try:
            return call(w)
        finally:
            w.shutdown()
    return act


def twice(w: OffloadWorker) -> None:
    w.submit_store(1, [0, 1], [0])
    w.submit_load(1, [0], [2, 3])


GEOMETRY = make_geometry((KVTensor(name="t", buffer="d", page_bytes=256),), HostTier(num_chunks=2), TPRank())


def region(change: Callable[[Path], Any], name: str = "bad") -> Act:
    """Create region ``name`` in the folder (expecting one attacher), let ``change(path)`` plant or corrupt its
    file, then attach to it."""
    def act(env: Any) -> Any:
        SharedRegion.create(name, GEOMETRY, attachers=1, directory=env.folder).close()
        change(Path(env.folder) / f"kvxfer-{name}")
        return SharedRegion.attach(name, env.folder, lock_timeout_s=1.0)
    return act


def header(offset: int, fmt: str, value: Any) -> Callable[[Path], Any]:
    def change(path: Path) -> None:
        raw = bytearray(path.read_bytes())
        struct.pack_into(fmt, raw, offset, value)
        path.write_bytes(bytes(raw))
    return change


def planted_link(path: Path) -> None:
    real = path.with_name("elsewhere")
    path.rename(real)
    path.symlink_to(real)


def cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size - 100)


def second_name(path: Path) -> None:
    """Give the region file another name (a hard link): a write through one name changes the file under both."""
    os.link(path, path.with_name("kvxfer-alias"))


def pid_past_pid_t(path: Path) -> None:
    """One recorded attacher whose pid no process can have (pid_t is 32 bits)."""
    raw = bytearray(path.read_bytes())
    struct.pack_into("<q", raw, 32, 1)  # attached count
    struct.pack_into("<qq", raw, 64 + 16, 2**31, 0)  # pids[1]
    path.write_bytes(bytes(raw))


def name_taken_by_another_file(env: Any) -> Any:
    (Path(env.folder) / "kvxfer-taken").write_bytes(b"not a region")
    return SharedRegion.create("taken", GEOMETRY, attachers=1, directory=env.folder)


def hard_link_to_a_file(path: Path) -> None:
    target = path.with_name("precious")
    target.write_bytes(b"keep me")
    target.chmod(0o600)
    os.link(target, path)


FILE_LAYOUT = tier_layout(1, 4, 4096)


def file_binding(change: Callable[[Path], Any]) -> Act:
    """Open a FileBinding (create=True) for the spill buffer at a path ``change`` prepared first."""
    def act(env: Any) -> Any:
        path = Path(env.folder) / "spill.kv"
        change(path)
        return FileBinding(path, create=True).open(FILE_LAYOUT.buffers[1])
    return act


def link_to_a_file(path: Path) -> None:
    target = path.with_name("precious")
    target.write_bytes(b"keep me")
    path.symlink_to(target)


def other_writable(path: Path) -> None:
    path.write_bytes(bytes(4 * 4096))
    path.chmod(0o666)


class LocalFiles:
    """What a FileTier asks of its storage executor, without NIXL: registering opens the files, binding binds the
    memory (and stand-ins for the files). Enough for tiers refused while they open; nothing runs."""

    def register(self, files: Any, buffers: Any) -> Any:
        table = {b.name: b for b in buffers}
        for name, fb in files.items():
            fb.open(table[name])
        return types.SimpleNamespace(deregister=lambda: None)

    def bind(self, buffers: Any, bindings: Any) -> Any:
        return NumpyExecutor().bind(buffers, {b.name: bindings[b.name] if b.location is not Location.FILE else
                                              np.zeros(b.nbytes, np.uint8) for b in buffers})

    def run(self, plan: Any, memory: Any, stream: Any = None) -> Any:
        raise AssertionError("nothing runs in these rows")


def tier(prepare: Callable[[Path], Any] = lambda folder: None, layout: Any = FILE_LAYOUT, **kw: Any) -> Act:
    """Open a FileTier over ``folder/file0.kv`` after ``prepare(folder)``; ``kw`` goes to FileTier."""
    def act(env: Any) -> Any:
        folder = Path(env.folder)
        prepare(folder)
        mem = np.zeros(layout.buffers[0].nbytes, np.uint8)
        return FileTier(LocalFiles(), layout, {"file0": FileBinding(folder / "file0.kv", create=True)}, {"mem": mem}, **kw)
    return act


def old_records(folder: Path) -> None:
    for name, data in (("file0.kv", bytes(4 * 4096)), ("file0.kv.kvxsum", b"KVXSUM01" + bytes(56))):
        (folder / name).write_bytes(data)
        (folder / name).chmod(0o600)


def records_from_elsewhere(folder: Path) -> None:
    mem = np.zeros(FILE_LAYOUT.buffers[0].nbytes, np.uint8)
    FileTier(LocalFiles(), FILE_LAYOUT, {"file0": FileBinding(folder / "other.kv", create=True)}, {"mem": mem}).close()
    for suffix in (".kv", ".kv.kvxsum"):
        (folder / f"other{suffix}").rename(folder / f"file0{suffix}")


def records_writable_by_others(folder: Path) -> None:
    mem = np.zeros(FILE_LAYOUT.buffers[0].nbytes, np.uint8)
    FileTier(LocalFiles(), FILE_LAYOUT, {"file0": FileBinding(folder / "file0.kv", create=True)}, {"mem": mem}).close()
    (folder / "file0.kv.kvxsum").chmod(0o666)


def records_with_a_second_name(folder: Path) -> None:
    hard_link_to_a_file(folder / "file0.kv.kvxsum")


def memory_as_a_file(env: Any) -> Any:
    mem = np.zeros(FILE_LAYOUT.buffers[0].nbytes, np.uint8)
    return FileTier(LocalFiles(), FILE_LAYOUT, {}, {"file0": mem})


ROWS: list[tuple[str, Act, type[BaseException], str]] = [
    # the worker
    ("job id given as a bool", worker(lambda w: w.submit_store(True, [0, 1], [0])), SubmissionError, "must be an integer"),
    ("job id given as a word", worker(lambda w: w.submit_load("7", [0], [0, 1])), SubmissionError, "job_id = '7'"),
    ("job id still pending", worker(twice), SubmissionError, "still pending"),
    ("device block past the device buffer", worker(lambda w: w.submit_store(1, [0, 8], [0])), SubmissionError,
     "device_ids"),
    ("host chunk past the host rows", worker(lambda w: w.submit_store(1, [0, 1], [4])), SubmissionError,
     "host_ids[0] = 4: past the 4 chunks of 2 blocks of region 'L0' (host side, buffer 'host')"),
    ("negative device block", worker(lambda w: w.submit_load(1, [0], [-1, 1])), SubmissionError, "non-negative"),
    ("device blocks as whole-number floats", worker(lambda w: w.submit_store(1, [0.0, 1.0], [0])), SubmissionError,
     "job 1: device_ids[0] = 0.0: block ids must be integers"),
    ("host chunk as negative zero", worker(lambda w: w.submit_load(1, [-0.0], [0, 1])), SubmissionError,
     "job 1: host_ids[0] = -0.0: block ids must be integers"),
    ("group sizes for two groups of one", worker(lambda w: w.submit_store(1, [0, 1], [0], (1, 1))), SubmissionError,
     "1 KV-cache groups"),
    ("spill with no file tier", worker(lambda w: w.submit_spill(1, [0])), SubmissionError, "no file tier attached"),
    ("host tier of zero chunks", lambda env: HostTier(num_chunks=0), LayoutError, "num_chunks"),
    ("host tier chunks given as a bool", lambda env: HostTier(num_chunks=True), LayoutError, "got bool"),
    ("TP rank past its size", lambda env: TPRank(size=2, rank=2), LayoutError, "must be below size 2"),
    ("shard rows that do not divide the page", lambda env: KVTensor(name="t", buffer="d", page_bytes=100, shard_rows=3),
     LayoutError, "does not divide page_bytes 100"),
    ("typo'd KV tensor field", lambda env: KVTensor(name="t", buffer="d", page_bytes=64, shardrows=2), LayoutError,
     "unknown key 'shardrows'"),
    # shared regions
    ("region name with a slash", lambda env: SharedSpec(name="a/b"), LayoutError, "name = 'a/b'"),
    ("region name that climbs out", lambda env: SharedRegion.create("../x", GEOMETRY, directory=env.folder),
     SharedRegionError, "name = '../x'"),
    ("region name starting with a dot", lambda env: SharedRegion.attach(".x", env.folder), SharedRegionError,
     "name = '.x'"),
    ("region expecting 64 attachers", lambda env: SharedRegion.create("many", GEOMETRY, attachers=64, directory=env.folder),
     SharedRegionError, "attachers = 64"),
    ("region writable by others", region(lambda p: p.chmod(0o666)), SharedRegionError, "writable by others"),
    ("region reached through a planted link", region(planted_link), SharedRegionError, "symbolic link"),
    ("region header with a foreign magic", region(header(0, "<8s", b"NOTKVXF0")), SharedRegionError, "magic"),
    ("region rows over the header", region(header(8, "<q", 0)), SharedRegionError, "data_offset = 0"),
    ("region geometry of 2**62 bytes of JSON", region(header(16, "<q", 2**62)), SharedRegionError, "json_bytes"),
    ("region expecting -1 attachers", region(header(24, "<q", -1)), SharedRegionError, "expected attachers = -1"),
    ("region geometry that is not JSON", region(header(1088, "<5s", b"{no}!")), SharedRegionError, "geometry"),
    ("region rows cut short", region(cut), SharedRegionError, "size = "),
    ("region file with a second name (hard link)", region(second_name), SharedRegionError, "a file with 2 names"),
    ("region attach lock waited on for nan seconds", lambda env: SharedRegion.attach("any", env.folder, lock_timeout_s=float("nan")),
     SharedRegionError, "lock_timeout_s = nan: must be a finite number"),
    ("region header with a pid past pid_t", region(pid_past_pid_t), SharedRegionError, "pids[1] = (2147483648, 0)"),
    ("region name taken by a file that is no region", name_taken_by_another_file, SharedRegionError,
     "not a kvxfer region: remove_stale leaves it alone"),
    # files
    ("spill file through a planted link", file_binding(link_to_a_file), BindingError, "symbolic link"),
    ("spill file writable by others", file_binding(other_writable), BindingError, "writable by others"),
    ("spill file with a second name (hard link)", file_binding(hard_link_to_a_file), BindingError, "a file with 2 names"),
    ("integrity records of an older format", tier(old_records), BindingError, "older format"),
    ("integrity records moved from another file", tier(records_from_elsewhere), BindingError, "files moved or swapped"),
    ("integrity records writable by others", tier(records_writable_by_others), BindingError,
     "integrity records writable by others"),
    ("integrity records with a second name (hard link)", tier(records_with_a_second_name), BindingError,
     "integrity records a file with 2 names"),
    ("integrity chunk not a multiple of the file alignment", tier(layout=tier_layout(1, 4, 4096, align_bytes=4096),
                                                                  chunk_bytes=1000), BindingError, "chunk_bytes 1000"),
    ("tier memory bound to a file buffer", memory_as_a_file, BindingError, "the layout places this buffer in file"),
]
