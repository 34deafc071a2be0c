"""Building a worker from device KV tensors (``tier.DeviceKV``) and a host tier: the layout, the host memory, pinning.

OffloadWorker itself only needs a Layout, its bindings and an executor; this module produces them for host rows in
private or shared memory, run by a DMA or NumPy executor. A tier below host memory plugs into the worker built
here (``OffloadWorker.attach_tier``: the files wing's ``attach_files``).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.executors import ExecutorSpec, coerce_executor
from kvxfer.planner import Layout, LayoutError

from .shared import SharedRegion
from .tier import HOST_BUFFER, DeviceKV, Geometry, HostTier, TPRank, build_layout, make_geometry
from .worker import OffloadWorker


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
    executor runs on a GPU (``tier.pin``; None: when the backend that runs it, known without making one, is a GPU
    executor; a factory's is not known, nor a wrapper's: pin such a tier with ``tier.pin=True``; ``registrar``
    overrides the platform's host registration,
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
    source = coerce_executor(executor)  # read once: whether it runs on a GPU, then the worker's executors
    pin = tier.pin if tier.pin is not None else bool(source.backend and source.backend.gpu)
    return assemble_worker(layout, device, (geometry, memory, region), source, tp=tp, pin=pin,
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
        worker = OffloadWorker(layout, {**device.bindings, HOST_BUFFER: memory}, executor, on_close=closers,
                               host=memory, geometry=geometry, **kw)
    except BaseException:
        for c in closers:
            c()
        if region is not None and region.close not in closers:
            region.close()
        raise
    return worker
