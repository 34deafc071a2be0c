"""kvxfer in vLLM 0.34's device-to-file worker slot: ``KvxferFSWorker``, an ``FSOffloadingWorker``
(``vllm/v1/kv_offload/fs/worker.py``).

vLLM's base class turns each job's DevicePointers and ``FSLoadStoreSpec(keys)`` into one ``(path, [FileOp])``
per key (paths from its ``FileMapper``) and calls ``submit_io(file_ops, is_store, ready_event)``; this class runs
each file as one merged, checked transfer (``fs_io``): ops adjacent in device memory and in the file are one copy,
every file carries kvxfer's integrity record, a store is durable before its completion resolves, and a file that
is missing, torn, stale, foreign or changed fails its completion (vLLM's ``get_finished`` then reports the job
failed: a miss the engine recomputes, never wrong bytes). Completions are ``concurrent.futures.Future``s (vLLM's
``IOCompletion``), resolved on ``io_threads`` threads, each of which waits on ``ready_event`` first.

``backend``: "posix" (host-staged POSIX I/O; the device pointers must be host-addressable: vLLM's CPU build, host
memory) or "gds" (NIXL's GDS backend, GPU memory to file without a host copy: needs a GPU, cuFile and NIXL; not
implemented in this module yet, and refused at construction with the reason). Only "posix" runs on this machine.
"""
from __future__ import annotations

import ctypes.util
import logging
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from .fs_io import ChunkMiss, FileFormat, file_ranges
from .version import import_vllm, traits

__all__ = ["ChunkMiss", "FSWorkerConfigError", "KvxferFSWorker", "gds_unavailable"]

_log = logging.getLogger("kvxfer.offload.vllm")

if not traits(import_vllm().__version__).fs_worker:  # pragma: no cover (0.32, 0.33)
    raise ImportError("kvxfer.offload.vllm.fs_worker needs vLLM 0.34 (vllm/v1/kv_offload/fs/worker.py)")

from vllm.v1.kv_offload.fs.worker import FSOffloadingWorker  # type: ignore[import-not-found, unused-ignore]  # noqa: E402


class FSWorkerConfigError(ValueError):
    """A bad ``KvxferFSWorker`` setting, naming the field and value."""

    def __init__(self, field: str, value: Any, reason: str):
        self.field, self.value = field, value
        super().__init__(f"KvxferFSWorker {field}={value!r}: {reason}")


def gds_unavailable() -> str | None:
    """Why NIXL's GDS backend cannot run here, or None: it needs a CUDA GPU, libcufile and NIXL."""
    try:
        import torch

        if not torch.cuda.is_available():
            return "no CUDA GPU"
    except ImportError:
        return "no torch"
    if ctypes.util.find_library("cufile") is None:
        return "no libcufile (GPUDirect Storage)"
    try:
        import nixl  # type: ignore[import-not-found, unused-ignore]  # noqa: F401
    except ImportError:
        return "no NIXL"
    return "the GDS path is not implemented in kvxfer's file worker yet"


class KvxferFSWorker(FSOffloadingWorker):  # type: ignore[misc]
    """vLLM 0.34's ``FSOffloadingWorker`` over kvxfer's merged, checked, durable file I/O (see the module).

    ``file_mapper``, ``block_size_factor``: vLLM's (the base class's). ``identity``: what the bytes mean; default
    the FileMapper's fields (model, dtype, parallel layout, groups...), so files of another identity are foreign.
    ``io_threads``: files in flight at once. ``backend``: "posix" or "gds" (refused where it cannot run)."""

    def __init__(self, file_mapper: Any, block_size_factor: int, *, identity: Mapping[str, Any] | None = None,
                 io_threads: int = 8, backend: str = "posix"):
        if backend not in ("posix", "gds"):
            raise FSWorkerConfigError("backend", backend, "must be 'posix' or 'gds'")
        if backend == "gds":
            raise FSWorkerConfigError("backend", backend, f"NIXL's GDS backend cannot run: {gds_unavailable()}")
        if isinstance(io_threads, bool) or not isinstance(io_threads, int) or io_threads < 1:
            raise FSWorkerConfigError("io_threads", io_threads, "must be a positive integer")
        super().__init__(file_mapper, block_size_factor)
        fields = dict(identity if identity is not None else getattr(file_mapper, "fields", {}))
        self.format = FileFormat({"format": "kvxfer-fs-1", **fields})
        self._pool = ThreadPoolExecutor(max_workers=io_threads, thread_name_prefix="kvxfer-fs")
        self._keys: list[bytes] | None = None

    def submit_store(self, job_id: int, device_ptrs: Any, dst_spec: Any) -> bool:
        """vLLM's ``submit_store``, with the spec's keys kept for ``submit_io`` (each file's record names its key)."""
        self._keys = [bytes(k) for k in dst_spec.keys]
        try:
            return bool(super().submit_store(job_id, device_ptrs, dst_spec))
        finally:
            self._keys = None

    def submit_load(self, job_id: int, src_spec: Any, device_ptrs: Any, expedited: bool = False) -> bool:
        """vLLM's ``submit_load``, with the keys kept (see ``submit_store``)."""
        self._keys = [bytes(k) for k in src_spec.keys]
        try:
            return bool(super().submit_load(job_id, src_spec, device_ptrs, expedited))
        finally:
            self._keys = None

    def submit_io(self, file_ops: list[tuple[str, list[Any]]], is_store: bool, ready_event: Any) -> list[Future[int]]:
        """One completion per file: its ops merged, then stored durably or loaded after its record checks."""
        keys = self._keys
        if keys is None or len(keys) != len(file_ops):
            raise FSWorkerConfigError("file_ops", len(file_ops), f"one file per key is expected ({keys and len(keys)})")
        run = self.format.store if is_store else self.format.load
        return [self._pool.submit(_io, ready_event, run, path, key, file_ranges(ops))
                for (path, ops), key in zip(file_ops, keys)]

    def shutdown_dispatch(self) -> None:
        """Let the files in flight finish, then stop the I/O threads."""
        self._pool.shutdown(wait=True)


def _io(ready_event: Any, run: Any, path: str, key: bytes, ranges: Any) -> int:
    ready_event.synchronize()  # the device bytes of a store are valid only once it has completed
    try:
        return int(run(path, key, ranges))
    except ChunkMiss as e:
        _log.info("kvxfer file worker: %s", e)
        raise
