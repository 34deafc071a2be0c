"""The host tier's shape: which KV tensors there are (``DeviceKV``, read from torch tensors by
``device_from_tensors``), how ranks share them, and where each one's cells sit in a row of host memory. Values and
functions over them (no memory is touched here).

A host row holds one chunk (``blocks_per_chunk`` pages) of every tensor. Cells are carved from the start of
the row: first the cells every rank shares (canonical layout: replicated and head-sharded tensors, in their
rank-independent canonical page size), then each rank's own cells (rank-private tensors, and every tensor in
the direct layout). Rows are padded to ``row_align_bytes`` (4 KiB), so chunked pinning can end on rows.
"""
from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, ClassVar

from pydantic import Field, field_validator, model_validator

from kvxfer.planner import Buffer, Fragment, Layout, LayoutError, Location, Placement, Region

# the planner's frozen model base, whose validation errors are the project's own (PlanError subclasses naming the
# field)
from kvxfer.planner import Spec as _PlannerSpec

HOST_BUFFER = "host"  # the one host buffer every region's host placement points into
_REGION_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,199}")


class Spec(_PlannerSpec):
    """Frozen, extra-forbidding value: a typo or a bad value fails at construction with a LayoutError (a ValueError)
    naming the field and the value."""

    _error: ClassVar = LayoutError


def region_name(name: object) -> str | None:
    """Why ``name`` cannot name a shared region, or None: it must be a plain file name of 1 to 200 letters, digits,
    ``_``, ``.`` and ``-``, not starting with ``.`` or ``-`` (so it never leaves its directory). The one check the
    SharedSpec model and SharedRegion share."""
    if not isinstance(name, str) or not _REGION_NAME.fullmatch(name):
        return ("must be 1 to 200 of A-Z a-z 0-9 _ . - and start with a letter, digit or _ (a file name in the region "
                "directory, never a path)")
    return None


class Sharing(StrEnum):
    """How TP ranks hold a KV tensor."""

    PRIVATE = "private"  # each rank's own bytes: stored per rank, loaded by the same rank only
    REPLICATED = "replicated"  # identical on every rank (MLA latent, replicated heads): one canonical copy
    SHARDED = "sharded"  # heads split across ranks: each rank holds one slice of every canonical row


class HostLayout(StrEnum):
    """How host rows hold the tensors: ``direct`` per-rank cells for every tensor; ``canonical`` rank-independent cells
    shared by all ranks for replicated and sharded tensors."""
    DIRECT = "direct"  # every tensor in per-rank cells, as the device holds it
    CANONICAL = "canonical"  # replicated and sharded tensors in rank-independent cells shared by all ranks


class KVTensor(Spec):
    """One device KV tensor (a region): its place in a device buffer and how ranks share it.

    ``page_bytes`` is this rank's page. A SHARDED page is ``shard_rows`` equal slices (for example one per
    token), and rank r's slice of row i sits at ``(i * tp_size + r) * slice`` in the canonical page.
    ``num_blocks``: the blocks the tensor holds (None: as many as its buffer holds); the planner refuses device
    block ids at or past it, since views of one storage share a buffer and a block past one view is the next
    view's.
    """

    name: str = Field(min_length=1)
    buffer: str = Field(min_length=1)
    page_bytes: int = Field(gt=0)
    byte_offset: int = Field(default=0, ge=0)
    stride_bytes: int | None = Field(default=None, gt=0)
    num_blocks: int | None = Field(default=None, ge=1)
    group: int = Field(default=0, ge=0)
    sharing: Sharing = Sharing.PRIVATE
    shard_rows: int = Field(default=1, ge=1)

    @model_validator(mode="after")
    def _rows(self) -> KVTensor:
        if self.page_bytes % self.shard_rows:
            raise LayoutError("shard_rows", self.shard_rows, f"does not divide page_bytes {self.page_bytes}")
        return self


class TPRank(Spec):
    """This process's tensor-parallel rank."""

    size: int = Field(default=1, ge=1)
    rank: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _rank(self) -> TPRank:
        if self.rank >= self.size:
            raise LayoutError("rank", self.rank, f"must be below size {self.size}")
        return self


class SharedSpec(Spec):
    """A host region several processes map: created by one (``create``), attached by name by the others.
    ``attachers`` is how many attach calls to expect; the name is unlinked after the last one. ``allow_foreign``:
    attach a region owned by another user, writable by others or with another name (a hard link): refused by
    default."""

    name: str
    directory: str = "/dev/shm"
    create: bool = False
    attachers: int = Field(default=0, ge=0, le=63)
    allow_foreign: bool = False

    @field_validator("name")
    @classmethod
    def _name(cls, name: str) -> str:
        why = region_name(name)
        if why is not None:
            raise LayoutError("name", name, why)
        return name


class HostTier(Spec):
    """Host memory for offloaded blocks: ``num_chunks`` rows of ``blocks_per_chunk`` pages of every tensor.
    ``shared``: map one region with other ranks instead of private memory. ``pin``: register with the GPU
    driver (None: when the executor runs on a GPU)."""

    num_chunks: int = Field(gt=0)
    blocks_per_chunk: int = Field(default=1, ge=1)
    layout: HostLayout = HostLayout.DIRECT
    shared: SharedSpec | None = None
    row_align_bytes: int = Field(default=4096, ge=1)
    pin: bool | None = None


class Cell(Spec):
    """Where one tensor's chunk 0 sits: ``rank`` None = shared by every rank (canonical). ``stride_bytes``
    None: chunk c is c rows further (row-major); else the tensor's chunks are back to back (tensor-major)."""

    tensor: str
    rank: int | None
    offset_bytes: int = Field(ge=0)
    page_bytes: int = Field(gt=0)
    stride_bytes: int | None = None


class Geometry(Spec):
    """The host rows: how many, their stride, and every cell in them. Stored in a shared region's header,
    so a rank attaching with another TP size finds the canonical cells where the creator put them."""

    num_chunks: int = Field(gt=0)
    blocks_per_chunk: int = Field(ge=1)
    row_stride_bytes: int = Field(gt=0)
    layout: HostLayout
    cells: tuple[Cell, ...]
    data_bytes: int = Field(default=0, ge=0)  # tensor-major: the total (rows: num_chunks * row_stride_bytes)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the cells need: ``data_bytes`` when set (tensor-major), else rows times row stride."""
        return self.data_bytes or self.num_chunks * self.row_stride_bytes

    def cell(self, tensor: str, rank: int | None) -> Cell:
        """The cell of ``tensor`` for ``rank`` (None: the shared, canonical cell). Raises LayoutError naming the tensor when
        there is none."""
        for c in self.cells:
            if c.tensor == tensor and c.rank == rank:
                return c
        where = "the shared cells" if rank is None else f"rank {rank}'s cells"
        raise LayoutError("tensors", tensor, f"the host region has no cell for it in {where} "
                          f"(cells: {sorted({(c.tensor, c.rank) for c in self.cells}, key=str)[:8]} ...)")


def canonical_page(t: KVTensor, tp: TPRank) -> int:
    """Bytes of ``t``'s canonical page: the whole row across ``tp.size`` ranks for a sharded tensor, else its own page."""
    return t.page_bytes * tp.size if t.sharing is Sharing.SHARDED else t.page_bytes


def _shared(t: KVTensor, layout: HostLayout) -> bool:
    return layout is HostLayout.CANONICAL and t.sharing is not Sharing.PRIVATE


def make_geometry(tensors: Sequence[KVTensor], tier: HostTier, tp: TPRank, ranks: Sequence[int] | None = None, *,
                  tensor_major: bool = False) -> Geometry:
    """Cells for ``tensors`` with private cells for ``ranks`` (default: every rank of ``tp``).

    Row-major (shared regions): a row holds chunk c of every cell, padded to ``row_align_bytes``.
    ``tensor_major`` (private memory): each cell's chunks are back to back, so runs of chunks merge into one
    range per tensor; ``row_stride_bytes`` is then the largest chunk (the pinning granularity)."""
    k, n = tier.blocks_per_chunk, tier.num_chunks
    ranks = list(range(tp.size)) if ranks is None else list(ranks)
    slots: list[tuple[KVTensor, int | None, int]] = [(t, None, canonical_page(t, tp)) for t in tensors
                                                       if _shared(t, tier.layout)]
    slots += [(t, r, t.page_bytes) for r in ranks for t in tensors if not _shared(t, tier.layout)]
    cells, at = [], 0
    for t, r, page in slots:
        cells.append(Cell(tensor=t.name, rank=r, offset_bytes=at, page_bytes=page,
                          stride_bytes=k * page if tensor_major else None))
        at += k * page * (n if tensor_major else 1)
    align = tier.row_align_bytes
    padded = max(-(-at // align) * align, align)
    if tensor_major:
        return Geometry(num_chunks=n, blocks_per_chunk=k, row_stride_bytes=max(k * p for _, _, p in slots) if slots else 1,
                        layout=tier.layout, cells=tuple(cells), data_bytes=padded)
    return Geometry(num_chunks=n, blocks_per_chunk=k, row_stride_bytes=padded, layout=tier.layout, cells=tuple(cells))


def host_region(t: KVTensor, geometry: Geometry, tp: TPRank) -> Region:
    """The Region for tensor ``t`` on rank ``tp.rank``: its device placement (``t.num_blocks`` blocks), its cell
    in the host rows (``geometry.num_chunks`` chunks: a chunk id past them would land in the next cell or in
    padding) and who stores it: a replicated tensor in shared canonical cells rotates writers over the ranks
    (rank r writes canonical pages ``page % tp.size == r``); every other tensor is written by each rank."""
    shared = _shared(t, geometry.layout)
    rotate = shared and t.sharing is Sharing.REPLICATED
    cell = geometry.cell(t.name, None if shared else tp.rank)
    want = canonical_page(t, tp) if shared else t.page_bytes
    if cell.page_bytes != want:
        raise LayoutError(f"tensors[{t.name!r}].page_bytes", t.page_bytes,
                          f"the host cell holds {cell.page_bytes}-byte pages; at TP {tp.size} this tensor needs {want}")
    fragments: tuple[Fragment, ...] = ()
    if shared and t.sharing is Sharing.SHARDED and tp.size > 1:
        piece = t.page_bytes // t.shard_rows
        fragments = (Fragment(local_offset=0, local_stride=piece, canonical_offset=tp.rank * piece,
                              canonical_stride=piece * tp.size, fragment_bytes=piece, count=t.shard_rows),)
    return Region(name=t.name, page_bytes=t.page_bytes, group=t.group, fragments=fragments,
                  host_page_bytes=cell.page_bytes if fragments else None,
                  num_writers=tp.size if rotate else 1, writer_index=tp.rank if rotate else 0,
                  device=Placement(buffer=t.buffer, byte_offset=t.byte_offset, stride_bytes=t.stride_bytes,
                                   num_blocks=t.num_blocks),
                  host=Placement(buffer=HOST_BUFFER, byte_offset=cell.offset_bytes,
                                 stride_bytes=cell.stride_bytes or geometry.row_stride_bytes,
                                 blocks_per_chunk=geometry.blocks_per_chunk,
                                 num_blocks=geometry.num_chunks * geometry.blocks_per_chunk))


def build_layout(device_buffers: Sequence[Buffer], tensors: Sequence[KVTensor], geometry: Geometry, tp: TPRank) -> Layout:
    """The worker's Layout: the device buffers, one host buffer of ``geometry.nbytes``, one region per tensor."""
    host = Buffer(name=HOST_BUFFER, nbytes=geometry.nbytes, location=Location.HOST)
    return Layout(buffers=(*device_buffers, host), regions=tuple(host_region(t, geometry, tp) for t in tensors))


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
