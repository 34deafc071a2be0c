"""Building a worker from device KV tensors and a host tier: the layout, the host memory, pinning.

The seam for other tiers: OffloadWorker itself only needs a Layout, its bindings and an executor. A tier is
whatever produces those three (this module: host rows in private or shared memory, run by a DMA or NumPy
executor); a file tier would place its regions in file buffers and hand the worker a NIXL executor.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, LayoutError, Location

from .shared import SharedRegion
from .tier import HOST_BUFFER, Geometry, HostTier, KVTensor, Sharing, TPRank, build_layout, make_geometry
from .worker import ExecutorSpec, OffloadWorker


@dataclass(frozen=True)
class DeviceKV:
    """The device side: buffers, the KV tensors placed in them (each stating the blocks it holds, which bound
    the device block ids a worker accepts), and each buffer's memory."""

    buffers: tuple[Buffer, ...]
    tensors: tuple[KVTensor, ...]
    bindings: Mapping[str, Any]


def device_from_tensors(tensors: Mapping[str, Any], sharing: Mapping[str, Sharing | str] | None = None,
                        shard_rows: Mapping[str, int] | None = None, groups: Mapping[str, int] | None = None, *,
                        kv_split: bool | None = None, num_blocks: int | None = None) -> DeviceKV:
    """DeviceKV from per-layer torch tensors, read by their shape.

    A tensor is ``[num_blocks, ...]`` (``kv_split=False``: K and V packed inside each block, or one tensor per
    layer) or ``[2, num_blocks, ...]`` (``kv_split=True``: a leading K/V dimension; the layer becomes the
    tensors ``<name>.k`` and ``<name>.v``, two views of one buffer). ``kv_split=None`` reads it from
    ``num_blocks``: a leading dimension of ``num_blocks`` is packed, a leading 2 followed by ``num_blocks`` is
    split; without ``num_blocks`` a leading dimension of 2 is refused as ambiguous (2 blocks, or K and V?).
    A block's page is the bytes of one index of the block dimension, so the dimensions inside it must be
    row-major contiguous. Views of one storage become one buffer. ``sharing``/``shard_rows``/``groups``: per
    layer (defaults: private, 1, group 0). Raises LayoutError naming the layer and the dimension it cannot read.
    """
    from kvxfer.executors import torch_layout

    if num_blocks is not None and (isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1):
        raise LayoutError("num_blocks", num_blocks, "must be a positive integer")
    sharing, shard_rows, groups = sharing or {}, shard_rows or {}, groups or {}
    buffers: dict[int, Buffer] = {}
    bindings: dict[str, Any] = {}
    out = []
    for name, t in tensors.items():
        for part, view in _kv_parts(name, t, kv_split, num_blocks):
            page, stride = torch_layout.block_page(view, f"tensors[{name!r}]", 1 if len(part) > len(name) else 0)
            storage = view.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in buffers:
                buffers[ptr] = Buffer(name=f"device.{part}", nbytes=storage.nbytes(),
                                      location=Location.HOST if view.device.type == "cpu" else Location.DEVICE,
                                      device=view.device.index or 0)
                bindings[buffers[ptr].name] = torch_layout.storage_bytes(view)
            out.append(KVTensor(name=part, buffer=buffers[ptr].name, page_bytes=page, byte_offset=view.data_ptr() - ptr,
                                stride_bytes=stride, num_blocks=int(view.shape[0]), group=groups.get(name, 0),
                                sharing=Sharing(sharing.get(name, Sharing.PRIVATE)), shard_rows=shard_rows.get(name, 1)))
    return DeviceKV(tuple(buffers.values()), tuple(out), bindings)


def _kv_parts(name: str, t: Any, kv_split: bool | None, num_blocks: int | None) -> list[tuple[str, Any]]:
    """The [num_blocks, ...] views of layer ``name``: itself (packed) or its K and V halves (split)."""
    field = f"tensors[{name!r}]"
    if not hasattr(t, "untyped_storage") or not hasattr(t, "dim"):
        raise LayoutError(field, type(t).__name__, "expected a torch.Tensor")
    shape = tuple(int(n) for n in t.shape)
    if not shape:
        raise LayoutError(f"{field}.shape", shape, "a 0-d tensor has no block dimension")
    if kv_split is None:
        if num_blocks is not None and shape[0] == num_blocks:
            kv_split = False
        elif num_blocks is not None and len(shape) >= 2 and shape[:2] == (2, num_blocks):
            kv_split = True
        elif num_blocks is not None:
            raise LayoutError(f"{field}.shape[0]", shape[0], f"neither num_blocks ({num_blocks}) nor a K/V dimension of 2 "
                              f"followed by num_blocks (shape {shape})")
        elif shape[0] == 2:
            raise LayoutError(f"{field}.shape[0]", 2, f"ambiguous in shape {shape}: 2 blocks, or a leading K/V "
                              "dimension? pass kv_split=True/False or num_blocks")
        else:
            kv_split = False
    if kv_split:
        if len(shape) < 2 or shape[0] != 2:
            raise LayoutError(f"{field}.shape[0]", shape[0], f"kv_split needs a leading K/V dimension of 2 and a block "
                              f"dimension after it (shape {shape})")
        parts = [(f"{name}.k", t[0]), (f"{name}.v", t[1])]
    else:
        parts = [(name, t)]
    block_dim = 1 if kv_split else 0
    if num_blocks is not None and shape[block_dim] != num_blocks:
        raise LayoutError(f"{field}.shape[{block_dim}]", shape[block_dim],
                          f"the block dimension holds {shape[block_dim]} blocks, not num_blocks {num_blocks} (shape {shape})")
    return parts


def _on_gpu(executor: Any) -> bool:
    """Whether ``executor`` (an executor, a factory or a config) is a GPU executor: ``Backend.gpu`` of the
    entry that runs it (``backend_for``). A factory is unknown until built, and an executor of a class the
    backend table does not list (a wrapper) is not taken for one: their tier is pinned when it asks
    (``tier.pin=True``)."""
    from kvxfer.executors import ExecutorConfig, backend_for

    if hasattr(executor, "run") and not isinstance(executor, type):
        runs = backend_for(executor)
    elif callable(executor):
        return False
    else:
        runs = backend_for(executor if isinstance(executor, ExecutorConfig) else ExecutorConfig.load(executor))
    return runs is not None and runs.gpu


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
    executor runs on a GPU (``tier.pin``; ``registrar`` overrides the platform's host registration,
    cudaHostRegister or hipHostRegister). ``kw`` goes to
    OffloadWorker. The worker's ``host`` is the host rows (``geometry`` their shape); ``shutdown`` releases them
    last."""
    tp = tp or TPRank()
    geometry, memory, region = host_memory(device, tier, tp)
    try:
        layout = build_layout(device.buffers, device.tensors, geometry, tp)
    except BaseException:
        if region is not None:
            region.close()
        raise
    pin = tier.pin if tier.pin is not None else _on_gpu(executor)
    return assemble_worker(layout, device, (geometry, memory, region), executor, tp=tp, pin=pin,
                           registrar=registrar, strict_pin=bool(tier.pin), **kw)


def assemble_worker(layout: Layout, device: DeviceKV, host: tuple[Geometry, np.ndarray, SharedRegion | None],
                    executor: ExecutorSpec, *, tp: TPRank, pin: bool, registrar: Any = None, strict_pin: bool = True,
                    on_unpinned: Callable[[str], None] | None = None, **kw: Any) -> OffloadWorker:
    """The OffloadWorker over ``layout``, ``device``'s bindings and ``host`` (what ``host_memory`` returned):
    pins the host rows when ``pin`` (a failure raises when ``strict_pin``, else goes to ``on_unpinned`` with the
    reason), and hands the worker what releases them. Everything acquired, the shared region included, is
    released if a step fails."""
    geometry, memory, region = host
    closers: list[Any] = []
    try:
        if pin:
            if region is not None:
                pinned = region.pin(registrar)
            else:
                from kvxfer.executors import pin_host_memory
                pinned = pin_host_memory(memory, geometry.row_stride_bytes, registrar)
                closers.append(pinned.close)
            if not pinned.pinned:
                if strict_pin:
                    raise RuntimeError(f"pinning the host tier failed: {pinned.reason}")
                if on_unpinned is not None:
                    on_unpinned(str(pinned.reason))
        if region is not None:
            closers.append(region.close)
        worker = OffloadWorker(layout, {**device.bindings, HOST_BUFFER: memory}, executor, tp=tp, on_close=closers,
                               host=memory, geometry=geometry, **kw)
    except BaseException:
        for c in closers:
            c()
        if region is not None and region.close not in closers:
            region.close()
        raise
    return worker
