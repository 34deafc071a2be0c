"""Test doubles of the vLLM tests that need no vLLM: vLLM's classes or stand-ins with their fields, an executor
that fails on chosen runs, and flipping the host bytes of chunks (bit flips at rest). Used by the engine's test
specs (tests/vllm/specs.py), the spec's and worker's unit tests and benchmarks/bench_vllm_worker.py."""
from __future__ import annotations

import threading
from collections.abc import Iterable
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import Layout


class FailingRuns(NumpyExecutor):
    """The NumPy executor whose runs named in ``fail`` raise instead of copying: (direction, n) is the n-th run
    (1-based) of plans of that direction ("d2h" stores, "h2d" loads). One instance may serve both directions."""

    def __init__(self, fail: set[tuple[str, int]]):
        super().__init__()
        self.fail, self.calls, self._lock = fail, {"d2h": 0, "h2d": 0}, threading.Lock()

    def run(self, plan: Any, memory: Any, stream: Any = None, after: Any = None) -> Any:
        with self._lock:  # one lane thread per direction calls this
            self.calls[plan.direction.value] += 1
            n = self.calls[plan.direction.value]
        if (plan.direction.value, n) in self.fail:
            raise RuntimeError(f"test double: {plan.direction.value} run {n} fails")
        return super().run(plan, memory, stream, after)


def flip_chunks(layout: Layout, host: np.ndarray, chunks: Iterable[int]) -> None:
    """Invert every byte of the given host chunks, once per cell (regions that alias one cell flip it once)."""
    cells = {(r.host.byte_offset, r.host.stride_bytes or r.host.blocks_per_chunk * (r.host_page_bytes or r.page_bytes),
              r.host.blocks_per_chunk * (r.host_page_bytes or r.page_bytes)) for r in layout.regions}
    for c in {int(c) for c in chunks}:
        for offset, stride, nbytes in cells:
            start = offset + c * stride
            host[start:start + nbytes] ^= 0xFF


def vllm_types() -> SimpleNamespace:
    """vLLM 0.32's classes the vLLM backend reads (CanonicalKVCaches, load/store specs, TransferResult...) when vLLM is
    installed, else stand-ins with the same fields (``real`` says which)."""
    try:
        from vllm.v1.kv_offload.base import (
            CanonicalKVCacheRef,
            CanonicalKVCaches,
            CanonicalKVCacheTensor,
            CanonicalPageMapping,
            CopyRun,
            GPULoadStoreSpec,
            TransferResult,
        )
        from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
    except ImportError:
        return stand_ins()
    return SimpleNamespace(Tensor=CanonicalKVCacheTensor, Ref=CanonicalKVCacheRef, Caches=CanonicalKVCaches,
                           Mapping=CanonicalPageMapping, Run=CopyRun, GPU=GPULoadStoreSpec, CPU=CPULoadStoreSpec,
                           Result=TransferResult, real=True)


def stand_ins() -> SimpleNamespace:
    """The fields of vLLM 0.32's classes this module reads (for the main suite, where vLLM is absent)."""

    @dataclass
    class Tensor:
        tensor: Any
        page_size_bytes: int

    @dataclass
    class Ref:
        tensor_idx: int
        page_size_bytes: int
        mapping: Any = None

    @dataclass
    class Caches:
        tensors: list[Any]
        group_data_refs: list[list[Any]]

    @dataclass(frozen=True)
    class Run:
        local_offset: int
        canonical_offset: int
        fragment_size: int
        num_fragments: int
        local_stride: int
        canonical_stride: int

    @dataclass(frozen=True)
    class Mapping:
        canonical_page_size_bytes: int
        local_page_size_bytes: int
        runs: tuple[Any, ...]
        num_writers: int
        writer_index: int
        parallelism_agnostic: bool

    class CPU:
        def __init__(self, block_ids: list[int]):
            self.block_ids = np.array(block_ids, dtype=np.int32)

    class GPU(CPU):
        def __init__(self, block_ids: list[int], group_sizes: Any, block_indices: Any):
            super().__init__(block_ids)
            self.group_sizes, self.block_indices = group_sizes, block_indices

    @dataclass
    class Result:
        job_id: int
        success: bool
        transfer_size: int | None = None
        transfer_time: float | None = None

    return SimpleNamespace(Tensor=Tensor, Ref=Ref, Caches=Caches, Mapping=Mapping, Run=Run, GPU=GPU, CPU=CPU,
                           Result=Result, real=False)
