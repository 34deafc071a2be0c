"""kvxfer's file worker for vLLM 0.34 (``KvxferFSWorker``, host-staged POSIX path) beside vLLM 0.34's own fs
tier I/O (``vllm/v1/kv_offload/tiering/fs/io.py``: ``batch_store_block`` / ``batch_load_block``, its Python path:
the wheel's C extension needs the GPU build) and one sequential write / read of the same bytes, on host memory.

Same bytes everywhere: ``--files`` files of 2 layers x ``--blocks`` blocks x ``--page`` bytes. vLLM's tier writes
each file from one slice of its host buffer (no record, no sync); kvxfer's worker gathers each file from the
device tensors (2 merged ranges a file here), writes its integrity record with it and syncs each file and its
directory before a store completes, and checks the record on load. Calls are counted by wrapping the ``os``
functions both use (one system call each). Loads read the page cache (the files were just written).

    PYTHONPATH=/work/vllmv/0.34.0 .venv-vllm/bin/python benchmarks/bench_fs_worker.py --dir /var/tmp
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import tempfile
import time
import types
from typing import Any

import numpy as np
import torch

_CALLS: collections.Counter[str] = collections.Counter()
_NAMES = ("open", "close", "write", "pwrite", "readv", "preadv", "read", "replace", "fsync", "fdatasync", "stat",
          "lstat", "fstat", "mkdir", "makedirs")


def _count() -> None:
    for name in _NAMES:
        real = getattr(os, name)

        def wrapped(*a: Any, _real: Any = real, _name: str = name, **kw: Any) -> Any:
            _CALLS[_name] += 1
            return _real(*a, **kw)

        setattr(os, name, wrapped)
    real_exists = os.path.exists

    def exists(p: Any) -> bool:
        _CALLS["stat"] += 1
        return real_exists(p)

    os.path.exists = exists


class _Event:
    def record(self, stream: Any = None) -> None: ...
    def synchronize(self) -> None: ...
    def query(self) -> bool: return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp")
    ap.add_argument("--files", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=4)
    ap.add_argument("--page", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=3)
    a = ap.parse_args()

    from vllm.v1.kv_offload import pointer_utils
    from vllm.v1.kv_offload.base import (
        CanonicalKVCacheRef,
        CanonicalKVCaches,
        CanonicalKVCacheTensor,
        GPULoadStoreSpec,
        make_offload_key,
    )
    from vllm.v1.kv_offload.file_mapper import FileMapper
    from vllm.v1.kv_offload.fs import worker as fs
    from vllm.v1.kv_offload.tiering.fs import io as vio

    from kvxfer.offload.vllm.fs_worker import KvxferFSWorker

    proxy = types.ModuleType("torch_proxy")
    proxy.__getattr__ = lambda name: getattr(torch, name)  # type: ignore[method-assign]
    proxy.Event = _Event  # type: ignore[attr-defined]
    fs.torch = proxy
    _count()

    k, page, n = a.blocks, a.page, a.files
    per_file = 2 * k * page
    total = n * per_file
    blocks = n * k
    tensors = [torch.randint(-128, 127, (blocks, page), dtype=torch.int8) for _ in range(2)]
    kv = CanonicalKVCaches([CanonicalKVCacheTensor(t, page) for t in tensors],
                           [[CanonicalKVCacheRef(0, page), CanonicalKVCacheRef(1, page)]])
    keys = [make_offload_key(i.to_bytes(8, "big") * 4, 0) for i in range(n)]
    ptrs = pointer_utils.resolve_device_pointers(
        GPULoadStoreSpec(np.arange(blocks, dtype=np.int32), group_sizes=(blocks,), block_indices=(0,)), kv)
    host = np.random.default_rng(0).integers(0, 256, total, dtype=np.uint8)  # vLLM's tier: one host buffer
    rows: dict[str, list[float]] = collections.defaultdict(list)
    calls: dict[str, dict[str, int]] = {}

    def timed(name: str, fn: Any) -> None:
        _CALLS.clear()
        t0 = time.perf_counter()
        fn()
        rows[name].append(time.perf_counter() - t0)
        calls[name] = {k2: v for k2, v in sorted(_CALLS.items()) if v}

    for _ in range(a.repeat):
        root = tempfile.mkdtemp(dir=a.dir, prefix="kvxfer-bench-fs-")
        try:
            mapper = FileMapper(root_dir=root + "/k", model_name="org/m", tokens_per_hash=16, blocks_per_file=k,
                                tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, rank=0, dtype="float16")
            w = KvxferFSWorker(mapper, k)

            def k_store() -> None:
                w.submit_store(1, ptrs, fs.FSLoadStoreSpec(keys))
                w.wait({1})

            def k_load() -> None:
                w.submit_load(2, fs.FSLoadStoreSpec(keys), ptrs)
                w.wait({2})

            timed("kvxfer store (record, fdatasync, rename, dir fsync)", k_store)
            timed("kvxfer load (record checked)", k_load)
            assert all(r.success for r in w.get_finished())
            w.shutdown()

            vpaths = [mapper.get_file_name(key).replace("/k/", "/v/", 1) for key in keys]
            offsets = [i * per_file for i in range(n)]
            view = memoryview(host)
            timed("vLLM fs tier store (no record, no sync)", lambda: vio.batch_store_block(
                vpaths, view, offsets, per_file, use_o_direct=False))
            timed("vLLM fs tier load", lambda: vio.batch_load_block(vpaths, view, offsets, per_file,
                                                                    use_o_direct=False))
            seq = os.path.join(root, "seq.bin")

            def s_write(sync: bool) -> None:
                fd = os.open(seq, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.write(fd, view)
                if sync:
                    os.fdatasync(fd)
                os.close(fd)

            def s_read() -> None:
                fd = os.open(seq, os.O_RDONLY)
                os.readv(fd, [view])
                os.close(fd)

            timed("sequential write, one file", lambda: s_write(False))
            timed("sequential write + fdatasync", lambda: s_write(True))
            timed("sequential read", s_read)
        finally:
            shutil.rmtree(root, ignore_errors=True)
    out = {name: {"median_s": float(np.median(t)), "GB/s": total / float(np.median(t)) / 1e9, "calls": calls[name]}
           for name, t in rows.items()}
    print(json.dumps({"files": n, "bytes": total, "file_bytes": per_file, "dir": a.dir, "results": out}, indent=1))


if __name__ == "__main__":
    main()
