"""Layouts from torch tensors, and bindings for the plans made from them.

Views of one allocation become one buffer with byte offsets, so neighbouring layer views can merge
across regions. A K/V outer dimension (shape[0] == 2) can be split into two regions.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kvxfer.planner import Buffer, Layout, LayoutError, Location, Placement, Region, import_optional


def _torch() -> Any:
    return import_optional("torch", "building layouts from tensors")


class _Buffers:
    """Storages seen so far on one side, each one named buffer: ``<side>.<layer>`` after the first layer found
    in it (a storage behind K and V of one layer is named after the layer, not after its K half)."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self.by_ptr: dict[int, str] = {}
        self.buffers: list[Buffer] = []
        self.tensors: dict[str, Any] = {}

    def place(self, t: Any, layer: str) -> tuple[str, int]:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.by_ptr:
            name = f"{self.prefix}.{layer}"
            dev = t.device
            self.by_ptr[ptr] = name
            self.buffers.append(Buffer(name=name, nbytes=storage.nbytes(),
                                       location=Location.HOST if dev.type == "cpu" else Location.DEVICE,
                                       device=dev.index or 0))
            self.tensors[name] = t
        return self.by_ptr[ptr], t.data_ptr() - ptr


def block_page(t: Any, field: str, first_dim: int = 0) -> tuple[int, int | None]:
    """(page bytes, block stride bytes; None for a single block) of a [num_blocks, ...] tensor whose dimensions
    inside a block are row-major contiguous: the one reader of a tensor's pages. ``field`` names the tensor in
    errors; ``first_dim`` is where its block dimension sits in the shape the caller was given (1 for the K or V
    half of a [2, num_blocks, ...] layer). Raises LayoutError naming the dimension it cannot read."""
    if t.dim() < 1:
        raise LayoutError(f"{field}.shape", (), "a 0-d tensor has no block dimension")
    elt = t.element_size()
    expect = 1
    for d in range(t.dim() - 1, 0, -1):
        size, stride = int(t.shape[d]), int(t.stride(d))
        if size != 1 and stride != expect:
            raise LayoutError(f"{field}.stride[{d + first_dim}]", stride,
                              f"dimension {d + first_dim} (size {size}) is not row-major contiguous inside a block "
                              f"(expected stride {expect}), so a page is not one byte range")
        expect *= size
    page = expect * elt
    if int(t.shape[0]) < 2:
        return page, None
    stride = int(t.stride(0)) * elt
    if stride < page:
        raise LayoutError(f"{field}.stride[{first_dim}]", int(t.stride(0)),
                          f"blocks overlap: the block stride is {stride} B but a page is {page} B")
    return page, stride


def layout_from_tensors(device: Mapping[str, Any], host: Mapping[str, Any], *, kv_split: bool = False,
                        device_type: str | None = None) -> tuple[Layout, dict[str, Any]]:
    """A Layout and its bindings from per-layer tensors.

    ``device`` and ``host`` map a layer name to a tensor shaped [num_blocks, ...] (or [2, num_blocks, ...]
    with ``kv_split``, giving regions ``<name>.k`` and ``<name>.v``). Host tensors must be on the CPU; device
    tensors must be on ``device_type`` when given (CPU tensors are accepted otherwise, for testing).
    Layers that share one tensor storage at the same offset and strides (layers sharing a KV tensor) become
    aliased regions of one buffer, which a plan copies once.
    Returns (layout, bindings) where bindings map each buffer name to a tensor over its whole storage; a
    buffer is named ``device.<layer>`` or ``host.<layer>`` after the first layer placed in it.
    Raises LayoutError naming the layer for mismatched keys, devices, dtypes, page sizes or strides.
    """
    torch = _torch()
    if set(device) != set(host):
        missing = sorted(set(device) ^ set(host))
        raise LayoutError("host" if set(device) - set(host) else "device", missing, "layers must match on both sides")
    dev_bufs, host_bufs = _Buffers("device"), _Buffers("host")
    regions = []
    for name in device:
        d, h = device[name], host[name]
        for side, t in (("device", d), ("host", h)):
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{side}[{name!r}]", type(t).__name__, "expected a torch.Tensor")
        if h.device.type != "cpu":
            raise LayoutError(f"host[{name!r}]", str(h.device), "host tensors must be in CPU memory")
        if device_type is not None and d.device.type != device_type:
            raise LayoutError(f"device[{name!r}]", str(d.device), f"expected a {device_type} tensor")
        if d.dtype != h.dtype:
            raise LayoutError(f"host[{name!r}]", str(h.dtype), f"dtype differs from the device tensor's {d.dtype}")
        parts = [(name, d, h)]
        if kv_split:
            for side, t in (("device", d), ("host", h)):
                if t.dim() < 2 or t.shape[0] != 2:
                    raise LayoutError(f"{side}[{name!r}]", f"shape {tuple(t.shape)}",
                                      "kv_split needs a leading K/V dimension of 2")
            parts = [(f"{name}.k", d[0], h[0]), (f"{name}.v", d[1], h[1])]
        for rname, dt, ht in parts:
            dpage, dstride = block_page(dt, f"device[{name!r}]", int(kv_split))
            hpage, hstride = block_page(ht, f"host[{name!r}]", int(kv_split))
            if dpage != hpage:
                raise LayoutError(f"host[{name!r}]", f"{hpage} B pages", f"device pages are {dpage} B")
            dbuf, doff = dev_bufs.place(dt, name)
            hbuf, hoff = host_bufs.place(ht, name)
            regions.append(Region(name=rname, page_bytes=dpage,
                                  device=Placement(buffer=dbuf, byte_offset=doff, stride_bytes=dstride),
                                  host=Placement(buffer=hbuf, byte_offset=hoff, stride_bytes=hstride)))
    layout = Layout(buffers=tuple(dev_bufs.buffers + host_bufs.buffers), regions=tuple(regions))
    bindings = {n: storage_bytes(t) for n, t in (dev_bufs.tensors | host_bufs.tensors).items()}
    return layout, bindings


def storage_bytes(t: Any) -> Any:
    """A flat uint8 tensor over the whole storage behind ``t`` (no copy)."""
    torch = _torch()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
