"""The one-call shape of a simple offload path, on plans: ``build_params`` once, ``copy_blocks`` per step.

``build_params(src_caches, dst_caches)`` takes per-layer caches (a list or a dict of tensors shaped
[num_blocks, ...]; one side on the GPU and the other in host memory, or both in host memory for testing),
builds the layout and binds the memory once. ``copy_blocks(src_ids, dst_ids, params, stream)`` copies
block ``src_ids[i]`` to ``dst_ids[i]`` in every layer through one merged plan. ``pin_tensor(t)`` registers a
host tensor with the driver in row-aligned chunks.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.executors import ExecutorSpec, Stream, Transfer, coerce_executor
from kvxfer.planner import BlockMapping, Direction, Layout, PlanOptions, plan_transfer


@dataclass
class CopyParams:
    """What ``build_params`` resolved once: the layout, the direction, the executor and the bound memory."""

    layout: Layout
    direction: Direction
    executor: Any
    bound: Any
    options: PlanOptions

    def close(self) -> None:
        """Release the bound memory, then close the executor."""
        self.bound.close()
        self.executor.close()


def _named(caches: Sequence[Any] | Mapping[str, Any]) -> dict[str, Any]:
    return dict(caches) if isinstance(caches, Mapping) else {str(i): t for i, t in enumerate(caches)}


def build_params(src_caches: Sequence[Any] | Mapping[str, Any], dst_caches: Sequence[Any] | Mapping[str, Any],
                 executor: ExecutorSpec = None, options: PlanOptions | None = None) -> CopyParams:
    """Resolve per-layer base addresses and bytes per block once. The direction is a store (d2h) when the
    destination caches are in host memory and the sources are not, a load (h2d) when the sources are in
    host memory and the destinations are not; all-host caches count as a store. Raises LayoutError naming
    the layer for mismatched layers, dtypes or page sizes."""
    from kvxfer.executors import torch_layout  # a public submodule (CONTRACT: listed in kvxfer.executors.__all__)

    src, dst = _named(src_caches), _named(dst_caches)
    src_host = all(t.device.type == "cpu" for t in src.values())
    load = src_host and not all(t.device.type == "cpu" for t in dst.values())
    device, host = (dst, src) if load else (src, dst)
    layout, bindings = torch_layout.layout_from_tensors(device, host)
    runner, _ = coerce_executor(executor).make()  # any form the worker takes; CopyParams.close closes it
    return CopyParams(layout, Direction.H2D if load else Direction.D2H, runner, runner.bind(layout, bindings),
                      options or PlanOptions())


def copy_blocks(src_ids: Sequence[int] | np.ndarray, dst_ids: Sequence[int] | np.ndarray, params: CopyParams,
                stream: Stream = None) -> Transfer:
    """Copy ``src_ids[i] -> dst_ids[i]`` in every layer; returns the executor's Transfer (asynchronous on a
    GPU: ``stream`` is the compute stream the copy orders after). Raises MappingError naming a bad id."""
    m = BlockMapping(direction=params.direction, src_ids=src_ids, dst_ids=dst_ids)
    plan = plan_transfer(params.layout, m, params.executor.target, params.options)
    transfer: Transfer = params.executor.run(plan, params.bound, stream)
    return transfer


def pin_tensor(t: Any, registrar: Any = None) -> Any:
    """Register host tensor ``t`` with the GPU driver (cudaHostRegister, hipHostRegister on ROCm) in chunks that
    end on block rows; returns the PinnedRegion (``pinned`` False with the reason when the driver refused;
    nothing half pinned)."""
    from kvxfer.executors import pin_host_memory

    row = t.stride(0) * t.element_size() if t.dim() and t.shape[0] > 1 else t.numel() * t.element_size()
    return pin_host_memory(t, row, registrar)
