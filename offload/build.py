"""Building a worker from device KV tensors and a host tier: the layout, the host memory, pinning.

The seam for other tiers: OffloadWorker itself only needs a Layout, its bindings and an executor. A tier is
whatever produces those three (this module: host rows in private or shared memory, run by a DMA or NumPy
executor); a file tier would place its regions in file buffers and hand the worker a NIXL executor.
"""
from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, LayoutError, Location

from .shared import SharedRegion
from .tier import Geometry, HostTier, KVTensor, Sharing, TPRank, build_layout, make_geometry
from .worker import ExecutorSpec, OffloadWorker


@dataclass(frozen=True)
class DeviceKV:
    """The device side: buffers, the KV tensors placed in them, and each buffer's memory."""

    buffers: tuple[Buffer, ...]
    tensors: tuple[KVTensor, ...]
    bindings: Mapping[str, Any]


def device_from_tensors(tensors: Mapping[str, Any], sharing: Mapping[str, Sharing | str] | None = None,
                        shard_rows: Mapping[str, int] | None = None, groups: Mapping[str, int] | None = None) -> DeviceKV:
    """DeviceKV from per-layer torch tensors shaped [num_blocks, ...] (a page is one block's bytes, row-major
    contiguous). Views of one storage become one buffer. ``sharing``/``shard_rows``/``groups``: per layer
    (defaults: private, 1, group 0). Raises LayoutError naming the layer."""
    from kvxfer.executors.torch_layout import storage_bytes

    sharing, shard_rows, groups = sharing or {}, shard_rows or {}, groups or {}
    buffers: dict[int, Buffer] = {}
    bindings: dict[str, Any] = {}
    out = []
    for name, t in tensors.items():
        if t.dim() < 1 or not t[0].is_contiguous():
            raise LayoutError(f"tensors[{name!r}]", f"shape {tuple(t.shape)}", "a block must be one contiguous page")
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in buffers:
            buffers[ptr] = Buffer(name=f"device.{name}", nbytes=storage.nbytes(),
                                  location=Location.HOST if t.device.type == "cpu" else Location.DEVICE,
                                  device=t.device.index or 0)
            bindings[buffers[ptr].name] = storage_bytes(t)
        page = t[0].numel() * t.element_size()
        out.append(KVTensor(name=name, buffer=buffers[ptr].name, page_bytes=page, byte_offset=t.data_ptr() - ptr,
                            stride_bytes=t.stride(0) * t.element_size() if t.shape[0] > 1 else None,
                            group=groups.get(name, 0), sharing=Sharing(sharing.get(name, Sharing.PRIVATE)),
                            shard_rows=shard_rows.get(name, 1)))
    return DeviceKV(tuple(buffers.values()), tuple(out), bindings)


def _on_gpu(executor: Any) -> bool:
    if executor is not None and hasattr(executor, "target"):
        return bool(executor.target.platform.value != "cpu")
    if callable(executor):  # a factory: unknown until built; pin only when the tier asks (tier.pin=True)
        return False
    from kvxfer.executors import ExecutorConfig, choose_executor

    config = executor if isinstance(executor, ExecutorConfig) else ExecutorConfig.load(executor)
    return choose_executor(config)[0].value in ("cuda-batch", "hip-batch", "triton")


def host_memory(device: DeviceKV, tier: HostTier, tp: TPRank) -> tuple[Geometry, np.ndarray, SharedRegion | None]:
    """The host rows: a shared region created or attached by name (row-major), or private memory for this
    rank only (tensor-major: each tensor's chunks back to back, as one host tensor per KV tensor would be)."""
    if tier.shared is None:
        geometry = make_geometry(device.tensors, tier, tp, ranks=[tp.rank], tensor_major=True)
        return geometry, np.zeros(geometry.nbytes, dtype=np.uint8), None
    s = tier.shared
    if s.create:
        region = SharedRegion.create(s.name, make_geometry(device.tensors, tier, tp), attachers=s.attachers,
                                     directory=s.directory)
    else:
        region = SharedRegion.attach(s.name, s.directory, allow_foreign=s.allow_foreign)
    g = region.geometry
    checks = (("num_chunks", tier.num_chunks, g.num_chunks), ("blocks_per_chunk", tier.blocks_per_chunk, g.blocks_per_chunk),
              ("layout", tier.layout, g.layout))
    for field, want, have in checks:
        if want != have:
            region.close()
            raise LayoutError(f"tier.{field}", want, f"the shared region {s.name!r} was created with {have}")
    return g, region.data, region


def create_worker(device: DeviceKV, tier: HostTier, executor: ExecutorSpec = None, *, tp: TPRank | None = None,
                  registrar: Any = None, **kw: Any) -> OffloadWorker:
    """An OffloadWorker over ``device`` and a host tier: builds the layout (canonical cells for replicated
    and sharded tensors in the canonical layout), maps or allocates the host rows and pins them when the
    executor runs on a GPU (``tier.pin``; ``registrar`` overrides cudaHostRegister). ``kw`` goes to
    OffloadWorker. The worker's ``host`` attribute is the host rows; ``shutdown`` releases them last."""
    tp = tp or TPRank()
    geometry, memory, region = host_memory(device, tier, tp)
    closers: list[Any] = []
    try:
        layout = build_layout(device.buffers, device.tensors, geometry, tp)
        pin = tier.pin if tier.pin is not None else _on_gpu(executor)
        if pin:
            if region is not None:
                pinned = region.pin(registrar)
            else:
                from kvxfer.executors import pin_host_memory
                pinned = pin_host_memory(memory, geometry.row_stride_bytes, registrar)
                closers.append(pinned.close)
            if not pinned.pinned and tier.pin:
                raise RuntimeError(f"pinning the host tier failed: {pinned.reason}")
        if region is not None:
            closers.append(region.close)
        worker = OffloadWorker(layout, {**device.bindings, "host": memory}, executor, tp=tp, on_close=closers, **kw)
    except BaseException:
        for c in closers:
            c()
        if region is not None and region.close not in closers:
            region.close()
        raise
    worker.host = memory
    worker.geometry = geometry
    return worker
