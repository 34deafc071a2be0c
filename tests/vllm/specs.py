"""Test-only offloading specs, loaded by the engine through ``spec_module_path="tests.vllm.specs"``.

``SwappedLoadsSpec`` is the negative control: kvxfer's spec whose loads read other host chunks than the
scheduler asked for (chunks stored earlier for other blocks, never the requested ones), so the engine
attends over another prompt's KV. Tokens that still matched would mean the tests do not depend on the bytes
kvxfer moves.

The failure doubles, for kvxfer's connector: ``FailFirstStoreSpec`` and ``FailFirstLoadSpec`` run an executor
whose first store (load) raises; ``CorruptLoadsSpec`` inverts the host bytes of every chunk just before a load
reads it (host bytes changed at rest, after their store finished).
"""
from __future__ import annotations

import copy
from typing import Any

import numpy as np

from kvxfer.offload.vllm import KvxferOffloadingSpec

from .doubles import FailingRuns, flip_chunks


class SwappedLoadsSpec(KvxferOffloadingSpec):  # type: ignore[misc, valid-type]
    """Loads copy in the bytes of other stored chunks (the earliest stored ones not in the load)."""

    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        if getattr(worker, "kvxfer_negative_control", False):
            return worker
        stored: list[int] = []
        store, load = worker.submit_store, worker.submit_load

        def submit_store(job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            stored.extend(int(c) for c in dst_spec.block_ids if int(c) not in stored)
            return bool(store(job_id, src_spec, dst_spec))

        def submit_load(job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            wanted = {int(c) for c in src_spec.block_ids}
            others = [c for c in stored if c not in wanted][:len(wanted)]
            if len(others) < len(wanted):
                raise RuntimeError(f"negative control: {len(others)} other stored chunks, {len(wanted)} needed")
            swapped = copy.copy(src_spec)
            swapped.block_ids = np.asarray(others, dtype=np.int32)
            return bool(load(job_id, swapped, dst_spec))

        worker.submit_store, worker.submit_load, worker.kvxfer_negative_control = submit_store, submit_load, True
        return worker


class FailFirstStoreSpec(KvxferOffloadingSpec):  # type: ignore[misc, valid-type]
    """kvxfer's spec whose executor fails its first store."""

    def make_executor(self) -> Any:
        return FailingRuns({("d2h", 1)})


class FailFirstLoadSpec(KvxferOffloadingSpec):  # type: ignore[misc, valid-type]
    """kvxfer's spec whose executor fails its first load."""

    def make_executor(self) -> Any:
        return FailingRuns({("h2d", 1)})


class CorruptLoadsSpec(KvxferOffloadingSpec):  # type: ignore[misc, valid-type]
    """kvxfer's spec whose host chunks are inverted just before the first load that reads them is submitted."""

    def get_worker(self, kv_caches: Any) -> Any:
        worker = super().get_worker(kv_caches)
        if getattr(worker, "_corrupting", False):
            return worker
        load, inner = worker.submit_load, worker.worker
        flipped: set[int] = set()

        def submit_load(job_id: int, src_spec: Any, dst_spec: Any) -> bool:
            fresh = {int(c) for c in src_spec.block_ids} - flipped
            flip_chunks(inner.layout, inner.host, fresh)
            flipped.update(fresh)
            return bool(load(job_id, src_spec, dst_spec))

        worker.submit_load, worker._corrupting = submit_load, True
        return worker
