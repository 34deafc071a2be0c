"""kvxfer's FSOffloadingWorker (``kvxfer.offload.vllm.fs_worker``) against vLLM 0.34's own classes: its
``FSOffloadingWorker`` base (which builds the per-file FileOps), ``FileMapper`` (keys -> paths),
``FSLoadStoreSpec``, ``resolve_device_pointers`` and ``TransferResult``. Host memory stands for device memory
(the host-staged POSIX path; vLLM's base class records a ``torch.Event``, which the CPU backend lacks: a no-op
stand-in). Run by ``make test-vllm-versions`` with 0.34 on PYTHONPATH; skipped otherwise."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip("vllm")
if not vllm.__version__.startswith("0.34"):
    pytest.skip("the file-worker slot is vLLM 0.34's", allow_module_level=True)

import torch  # noqa: E402
from vllm.v1.kv_offload import pointer_utils  # noqa: E402
from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    make_offload_key,
)
from vllm.v1.kv_offload.file_mapper import FileMapper  # noqa: E402
from vllm.v1.kv_offload.fs import worker as fs  # noqa: E402

from kvxfer.offload.vllm.fs_io import HEADER_BYTES  # noqa: E402
from kvxfer.offload.vllm.fs_worker import FSWorkerConfigError, KvxferFSWorker  # noqa: E402

K, BLOCKS, PAGES, GROUPS = 2, 32, [256, 256, 512], [[0, 1], [2]]
ROOT = Path(__file__).resolve().parents[2]


class _Event:
    def record(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True


@pytest.fixture(autouse=True)
def _cpu_events(monkeypatch: pytest.MonkeyPatch) -> None:
    proxy = types.ModuleType("torch_proxy")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    proxy.Event = _Event  # type: ignore[attr-defined]
    monkeypatch.setattr(fs, "torch", proxy)


def _tensors(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(-128, 127, (BLOCKS, p), dtype=torch.int8, generator=g) for p in PAGES]


def _kv(tensors: list[torch.Tensor]) -> Any:
    return CanonicalKVCaches([CanonicalKVCacheTensor(t, t.shape[1]) for t in tensors],
                             [[CanonicalKVCacheRef(i, tensors[i].shape[1]) for i in refs] for refs in GROUPS])


def _mapper(root: Path, model: str = "org/m") -> FileMapper:
    return FileMapper(root_dir=str(root), model_name=model, tokens_per_hash=16, blocks_per_file=K, tp_size=1,
                      pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="float16")


def _keys(tag: int, n_per_group: tuple[int, int]) -> list[bytes]:
    return [make_offload_key(bytes([tag, g, i]) * 8, g) for g, n in enumerate(n_per_group) for i in range(n)]


def _job(kv: Any, blocks0: list[int], blocks1: list[int]) -> Any:
    gpu = GPULoadStoreSpec(np.array(blocks0 + blocks1, np.int32), group_sizes=(len(blocks0), len(blocks1)),
                           block_indices=(0, 0))
    return pointer_utils.resolve_device_pointers(gpu, kv)


def _finish(w: KvxferFSWorker, job: int) -> Any:
    out: list[Any] = []
    while not out:
        out = [r for r in w.get_finished() if r.job_id == job]
    return out[0]


def _stored(tmp_path: Path, seed: int = 0) -> tuple[KvxferFSWorker, list[torch.Tensor], list[bytes], Any]:
    tensors = _tensors(seed)
    kv = _kv(tensors)
    w = KvxferFSWorker(_mapper(tmp_path), K)
    keys = _keys(1, (2, 1))  # group 0: blocks 4-7 in two files; group 1: blocks 10-11 in one
    assert w.submit_store(1, _job(kv, [4, 5, 6, 7], [10, 11]), fs.FSLoadStoreSpec(keys))
    r = _finish(w, 1)
    assert r.success and r.transfer_size == 4 * (256 + 256) + 2 * 512
    return w, tensors, keys, kv


def _load(w: KvxferFSWorker, tensors: list[torch.Tensor], keys: list[bytes], job: int = 2) -> Any:
    kv = _kv(tensors)
    w.submit_load(job, fs.FSLoadStoreSpec(keys), _job(kv, [20, 21, 22, 23], [28, 29]))
    return _finish(w, job)


def test_a_store_writes_one_file_per_key_where_the_file_mapper_says_and_a_load_returns_its_bytes(tmp_path: Path) -> None:
    w, src, keys, _ = _stored(tmp_path)
    mapper = _mapper(tmp_path)
    paths = [mapper.get_file_name(k) for k in keys]
    assert all(os.path.isfile(p) for p in paths) and len(set(paths)) == 3
    # a file: kvxfer's record, then vLLM's layout (per ref, block_size_factor blocks of its page)
    assert os.path.getsize(paths[0]) == HEADER_BYTES + 2 * K * 256 and os.path.getsize(paths[2]) == HEADER_BYTES + K * 512
    dst = _tensors(9)
    before = [t.clone() for t in dst]
    r = _load(w, dst, keys)
    assert r.success and r.transfer_size == 4 * 512 + 2 * 512
    for t in (0, 1):
        assert torch.equal(dst[t][20:24], src[t][4:8])
    assert torch.equal(dst[2][28:30], src[2][10:12])
    assert torch.equal(dst[0][:20], before[0][:20]) and torch.equal(dst[0][24:], before[0][24:])
    w.shutdown()
    assert not list(tmp_path.rglob("*.tmp"))


def test_ops_adjacent_in_device_memory_and_in_the_file_are_merged(tmp_path: Path) -> None:
    from kvxfer.offload.vllm.fs_io import file_ranges

    seen: list[tuple[int, int]] = []
    w = KvxferFSWorker(_mapper(tmp_path), K)
    real = w.submit_io

    def spy(file_ops: Any, is_store: bool, ev: Any) -> Any:
        seen.extend((len(ops), len(file_ranges(ops))) for _, ops in file_ops)
        return real(file_ops, is_store, ev)

    w.submit_io = spy  # type: ignore[method-assign]
    kv = _kv(_tensors(0))
    w.submit_store(1, _job(kv, [4, 5, 6, 7], [10, 11]), fs.FSLoadStoreSpec(_keys(1, (2, 1))))
    assert _finish(w, 1).success
    assert seen == [(4, 2), (4, 2), (2, 1)]  # per file: 2 refs x 2 adjacent blocks -> one range per ref
    w.shutdown()


@pytest.mark.parametrize("damage", ["missing", "changed", "torn", "stale", "foreign", "not kvxfer's"])
def test_a_damaged_file_fails_its_job_and_loads_no_byte_of_it_while_the_others_load(tmp_path: Path, damage: str) -> None:
    w, src, keys, _ = _stored(tmp_path)
    mapper = _mapper(tmp_path)
    victim = Path(mapper.get_file_name(keys[1]))  # group 0's second file: blocks 6-7 -> 22-23
    if damage == "missing":
        victim.unlink()
    elif damage == "changed":
        data = bytearray(victim.read_bytes())
        data[HEADER_BYTES + 5] ^= 0x01
        victim.write_bytes(bytes(data))
    elif damage == "torn":
        os.truncate(victim, victim.stat().st_size - 100)
    elif damage == "stale":
        victim.write_bytes(Path(mapper.get_file_name(keys[0])).read_bytes())  # another key's whole file
    elif damage == "foreign":
        other = KvxferFSWorker(_mapper(tmp_path), K, identity={"model": "another"})
        kv = _kv(_tensors(3))
        other.submit_store(7, _job(kv, [0, 1, 2, 3], []), fs.FSLoadStoreSpec(_keys(1, (2, 0))))
        assert _finish(other, 7).success  # the same paths (same mapper), another identity
        other.shutdown()
    else:
        victim.write_bytes(bytes(victim.stat().st_size))  # vLLM's own fs tier writes raw blocks
    dst = _tensors(9)
    before = [t.clone() for t in dst]
    r = _load(w, dst, keys)
    assert r.success is False
    for t in (0, 1):
        assert torch.equal(dst[t][22:24], before[t][22:24])  # not one byte of the damaged file
        if damage != "foreign":  # (foreign rewrote both of group 0's files)
            assert torch.equal(dst[t][20:22], src[t][4:6])
    assert torch.equal(dst[2][28:30], src[2][10:12])
    w.shutdown()


def test_a_rewritten_file_is_loaded_as_rewritten(tmp_path: Path) -> None:
    w, _, keys, _ = _stored(tmp_path)
    new = _tensors(5)
    w.submit_store(3, _job(_kv(new), [4, 5, 6, 7], [10, 11]), fs.FSLoadStoreSpec(keys))
    assert _finish(w, 3).success
    dst = _tensors(9)
    assert _load(w, dst, keys).success
    assert torch.equal(dst[0][20:24], new[0][4:8]) and torch.equal(dst[2][28:30], new[2][10:12])
    w.shutdown()


def test_settings_that_cannot_run_are_refused_naming_the_field(tmp_path: Path) -> None:
    with pytest.raises(FSWorkerConfigError, match="backend='gds'.*cannot run: no CUDA GPU"):
        KvxferFSWorker(_mapper(tmp_path), K, backend="gds")
    with pytest.raises(FSWorkerConfigError, match="io_threads=0"):
        KvxferFSWorker(_mapper(tmp_path), K, io_threads=0)


_KILLED = """
import os, signal, sys, types, torch
sys.path.insert(0, {root_dir!r})
import tests.vllm_versions.test_fs_worker as t
proxy = types.ModuleType("p"); proxy.__getattr__ = lambda n: getattr(torch, n); proxy.Event = t._Event
t.fs.torch = proxy
real, count = os.fdatasync, [0]
def fdatasync(fd):
    count[0] += 1
    if count[0] == {after}:  # killed with this file written to its temporary name, before its sync and rename
        os.kill(os.getpid(), signal.SIGKILL)
    return real(fd)
os.fdatasync = fdatasync
w = t.KvxferFSWorker(t._mapper({root!r}), t.K, io_threads=1)
kv = t._kv(t._tensors(int(sys.argv[1])))
w.submit_store(1, t._job(kv, list(range(0, 16)), [20, 21, 22, 23]), t.fs.FSLoadStoreSpec(t._keys(2, (8, 2))))
w.wait({{1}})
w.shutdown()
"""


def test_a_kill_during_a_store_leaves_every_key_whole_old_or_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    root = tmp_path / "fs"
    keys = _keys(2, (8, 2))
    # first generation stored completely, second killed in the middle of its sixth file
    for seed, after in ((11, 10**9), (12, 6)):
        script = tmp_path / f"kill{seed}.py"
        script.write_text(_KILLED.format(root_dir=str(ROOT), root=str(root), after=after))
        p = subprocess.run([sys.executable, str(script), str(seed)], capture_output=True, text=True, timeout=300)
        assert p.returncode == (0 if after > 100 else -signal.SIGKILL), p.stderr[-2000:]
    old, new = _tensors(11), _tensors(12)
    w = KvxferFSWorker(_mapper(root), K)
    good = wrong = 0
    for i, key in enumerate(keys):  # one key at a time: each loads whole (old or new bytes) or is a miss
        g = 0 if i < 8 else 1
        blocks = [2 * i, 2 * i + 1] if g == 0 else [20 + 2 * (i - 8), 21 + 2 * (i - 8)]
        dst = _tensors(99)
        kv = _kv(dst)
        job = _job(kv, blocks if g == 0 else [], blocks if g == 1 else [])
        w.submit_load(100 + i, fs.FSLoadStoreSpec([key]), job)
        r = _finish(w, 100 + i)
        refs = GROUPS[g]
        if r.success:
            got = [dst[t][[int(b) for b in blocks]] for t in refs]
            ok = any(all(torch.equal(x, src[t][blocks]) for x, t in zip(got, refs)) for src in (old, new))
            good += ok
            wrong += not ok
    w.shutdown()
    # files 1-5 hold the new bytes, the sixth and later the old: each key whole, none torn
    assert wrong == 0 and good == len(keys)
    assert len(list(root.rglob("*.tmp"))) <= 1  # the killed file's temporary name, never at the target
