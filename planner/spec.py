"""The transfer's inputs, piece by piece: buffers, placements, fragments, regions and the block mapping.

The Layout that gathers buffers and regions lives in ``layout.py`` (it carries the derived ``LayoutInfo``).
"""
from __future__ import annotations

import json
from enum import StrEnum
from typing import TYPE_CHECKING, Annotated, Any, ClassVar

import numpy as np
from pydantic import Field, PlainSerializer, WithJsonSchema, field_validator, model_serializer, model_validator

from ._model import Spec
from .errors import LayoutError, MappingError
from .ids import as_ids, check_lengths, count_of, group_ints, refuse_negative_entry

MAX_NBYTES = 2**63 - 1  # keeps every offset and difference inside int64
U64 = 2**64


class Location(StrEnum):
    """Where a buffer lives: device memory, host memory or a file."""

    DEVICE = "device"
    HOST = "host"
    FILE = "file"  # a file (storage tier); where it lives is the binding's business, not the plan's


class Direction(StrEnum):
    """Which way blocks move: ``h2d`` loads host pages into device blocks, ``d2h`` stores device blocks to host pages."""

    H2D = "h2d"  # load: host placement -> device placement
    D2H = "d2h"  # store: device placement -> host placement

    @property
    def src_side(self) -> Location:
        """The placement copies read from: host for loads, device for stores."""
        return Location.HOST if self is Direction.H2D else Location.DEVICE

    @property
    def dst_side(self) -> Location:
        """The placement copies write to: device for loads, host for stores."""
        return Location.DEVICE if self is Direction.H2D else Location.HOST


class Buffer(Spec):
    """One allocation or registered segment, addressed by name; executors bind the name to memory.

    ``align_bytes`` (a power of two, default 1): every range's offset and size in this buffer must be a
    multiple of it -- for files read or written with O_DIRECT, the device's logical block size.
    """

    _error: ClassVar = LayoutError
    name: str = Field(min_length=1)
    nbytes: int = Field(gt=0, le=MAX_NBYTES)
    location: Location = Location.DEVICE
    device: int = Field(default=0, ge=0)
    align_bytes: int = Field(default=1, gt=0, le=2**62)

    @field_validator("align_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise LayoutError("align_bytes", v, "must be a power of two")
        return v

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """The default alignment is left out, so plans, goldens and fingerprints without one are unchanged."""
        d: dict[str, Any] = handler(self)
        if self.align_bytes == 1:
            d.pop("align_bytes", None)
        return d


class Placement(Spec):
    """Where a region's block 0 sits in a buffer, and the distance between consecutive blocks.

    With ``blocks_per_chunk`` k > 1 the ids on this side are chunk ids: chunk c holds k pages back to back
    at ``byte_offset + c * stride_bytes`` (stride defaults to k pages; a larger stride means padded rows).

    ``num_blocks`` (None: as many as the buffer holds) is how many blocks (pages) the placement holds: the
    planner refuses an id whose block on this side is at or past it (with k > 1, a chunk holds blocks c*k ..
    c*k + k - 1). It bounds a tensor that shares its buffer with others (views of one storage, or cells of
    one host row), where a block past its end is still inside the buffer.
    """

    _error: ClassVar = LayoutError
    buffer: str = Field(min_length=1)
    byte_offset: int = Field(default=0, ge=0)
    stride_bytes: int | None = Field(default=None, gt=0, le=MAX_NBYTES)
    blocks_per_chunk: int = Field(default=1, ge=1)
    num_blocks: int | None = Field(default=None, ge=1, le=MAX_NBYTES)

    @model_serializer(mode="wrap")
    def _dump(self, handler: Any) -> dict[str, Any]:
        """An unstated block count is left out, so layouts without one dump as before (and older readers read them)."""
        d: dict[str, Any] = handler(self)
        if self.num_blocks is None:
            d.pop("num_blocks", None)
        return d


class Fragment(Spec):
    """A run of ``count`` pieces of ``fragment_bytes``: piece i sits at ``local_offset + i*local_stride`` in the
    device (local, per-rank) page and at ``canonical_offset + i*canonical_stride`` in the host (canonical) page."""

    _error: ClassVar = LayoutError
    local_offset: int = Field(ge=0)
    local_stride: int = Field(ge=0)
    canonical_offset: int = Field(ge=0)
    canonical_stride: int = Field(ge=0)
    fragment_bytes: int = Field(gt=0)
    count: int = Field(default=1, ge=1)


class Region(Spec):
    """One KV tensor: every block is page_bytes, placed once on the device side and once on the host side.

    ``host_page_bytes`` (default page_bytes) is the host (canonical) page size; when it differs, or when a
    rank's page is a slice of the canonical page, ``fragments`` say which bytes correspond. ``group`` is the
    region's KV-cache group (hybrid models), which consumes its own slice of the mapping's id lists.

    ``num_writers`` / ``writer_index`` (None: the plan's ``PlanOptions`` values) set writer rotation for this
    region alone: on stores only canonical pages with ``page % num_writers == writer_index`` are written, so a
    replicated layer (``num_writers`` = replicas) and a rank-private one (``num_writers=1``) mix in one plan.
    Loads read everything. Two regions naming exactly the same bytes on both sides are aliases: planned once.
    """

    _error: ClassVar = LayoutError
    name: str = Field(min_length=1)
    page_bytes: int = Field(gt=0)
    device: Placement
    host: Placement
    host_page_bytes: int | None = Field(default=None, gt=0)
    fragments: tuple[Fragment, ...] = ()
    group: int = Field(default=0, ge=0)
    num_writers: int | None = Field(default=None, ge=1)
    writer_index: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _strides(self) -> Region:
        if self.num_writers is not None and self.writer_index is not None and self.writer_index >= self.num_writers:
            raise LayoutError("writer_index", self.writer_index, f"must be below num_writers {self.num_writers}")
        for side in (Location.DEVICE, Location.HOST):
            p = self.placement(side)
            page = self.side_page(side)
            if p.byte_offset + page > U64:
                raise LayoutError(f"{side}.byte_offset", p.byte_offset, f"block 0 ends past 2^64 (page_bytes {page})")
            row = page * p.blocks_per_chunk
            if p.stride_bytes is not None and p.stride_bytes < row:
                k = p.blocks_per_chunk
                what = "page_bytes" if k == 1 else f"blocks_per_chunk x page_bytes ({k} x {page})"
                raise LayoutError(f"{side}.stride_bytes", p.stride_bytes, f"stride is smaller than {what} {row}")
        if not self.fragments and self.side_page(Location.HOST) != self.page_bytes:
            raise LayoutError("host_page_bytes", self.host_page_bytes,
                              f"differs from page_bytes {self.page_bytes}; fragments must say which bytes correspond")
        for kind, off, stride, page in (("local", "local_offset", "local_stride", self.page_bytes),
                                        ("canonical", "canonical_offset", "canonical_stride", self.side_page(Location.HOST))):
            spans: list[tuple[int, int, int]] = []
            for j, f in enumerate(self.fragments):
                start, step = getattr(f, off), getattr(f, stride)
                end = start + (f.count - 1) * step + f.fragment_bytes
                if end > page:
                    raise LayoutError(f"fragments[{j}].{off}", start, f"{kind} fragments end at byte {end}, past the "
                                      f"{kind} page of {page} bytes")
                if f.count > 1 and step < f.fragment_bytes:
                    raise LayoutError(f"fragments[{j}].{stride}", step, f"pieces of {f.fragment_bytes} bytes overlap")
                spans += [(start + i * step, start + i * step + f.fragment_bytes, j) for i in range(f.count)]
            spans.sort()
            for (_, a1, ja), (b0, _, jb) in zip(spans, spans[1:]):
                if b0 < a1:
                    raise LayoutError(f"fragments[{jb}].{off}", b0, f"{kind} bytes [{b0}, {a1}) overlap fragments[{ja}]")
        return self

    def placement(self, side: Location | str) -> Placement:
        """The region's placement on ``side``: ``host`` for the host side, else ``device``."""
        return self.host if side == Location.HOST else self.device

    def side_page(self, side: Location | str) -> int:
        """Page size on ``side``: page_bytes on the device, host_page_bytes (default page_bytes) on the host."""
        return self.host_page_bytes or self.page_bytes if side == Location.HOST else self.page_bytes

    def stride(self, side: Location | str) -> int:
        """Bytes between consecutive chunks (blocks when one per chunk) on ``side``: ``stride_bytes`` when set, else page
        bytes times blocks per chunk."""
        p = self.placement(side)
        return self.side_page(side) * p.blocks_per_chunk if p.stride_bytes is None else p.stride_bytes

    def block_end(self, side: Location | str, block: int) -> int:
        """The end byte of block (page) ``block`` on ``side``, in its buffer (Python integers: no overflow)."""
        p, page = self.placement(side), self.side_page(side)
        k = p.blocks_per_chunk
        return p.byte_offset + block // k * self.stride(side) + block % k * page + page

    def alias_key(self) -> tuple[Any, ...]:
        """Equal for two regions exactly when they name the same bytes on both sides for every block id, in the
        same group with the same writers (aliases: layers sharing one KV tensor). Defaults are resolved; the
        block counts may differ (the planner bounds the ids by the smallest)."""
        sides = tuple((p.buffer, p.byte_offset, self.stride(s), p.blocks_per_chunk)
                      for s, p in ((Location.DEVICE, self.device), (Location.HOST, self.host)))
        return (sides, self.page_bytes, self.side_page(Location.HOST), self.fragments, self.group,
                self.num_writers, self.writer_index)


_IDS_SCHEMA = WithJsonSchema({"type": "array", "items": {"type": "integer", "minimum": 0}})
# ids serialize as lists wherever a mapping is dumped, alone or inside another model (a Case's model_dump_json)
_IDS_AS_LIST = PlainSerializer(lambda ids: ids.tolist(), return_type=list)


class BlockMapping(Spec):
    """Which blocks move: src_ids[i] -> dst_ids[i] in every region. Ids are read-only int64 arrays of the mapping's
    own (``ids.as_ids``); a refusal names one field, index and value, the ids' first."""

    model_config = Spec.model_config | {"arbitrary_types_allowed": True}
    _error: ClassVar = MappingError
    direction: Direction
    src_ids: Annotated[np.ndarray, _IDS_SCHEMA, _IDS_AS_LIST]
    dst_ids: Annotated[np.ndarray, _IDS_SCHEMA, _IDS_AS_LIST]
    group_sizes: tuple[int, ...] | None = None
    group_starts: tuple[int, ...] | None = None

    if TYPE_CHECKING:  # what callers may pass (lists or arrays of integers); validated as ``Spec.__init__`` does
        def __init__(self, **data: Any) -> None: ...

    @model_validator(mode="wrap")
    @classmethod
    def _checked(cls, data: Any, handler: Any) -> BlockMapping:
        """The id lists converted and checked first (``as_ids``), group fields of plain integers taken as tuples;
        then pydantic checks the rest (other group values, the direction, unknown and missing keys); then the
        groups are non-negative and the lengths agree (``check_lengths``)."""
        if isinstance(data, dict):
            data = dict(data)
            for name in ("src_ids", "dst_ids"):
                if name in data:
                    data[name] = as_ids(data[name], name)
            for name in ("group_sizes", "group_starts"):
                value = data.get(name)
                ints = None if value is None else group_ints(value, name)
                if ints is not None:
                    data[name] = ints
        m: BlockMapping = handler(data)
        for name in ("group_sizes", "group_starts"):
            refuse_negative_entry(getattr(m, name) or (), name)
        check_lengths(m.src_ids, m.dst_ids, m.group_sizes, m.group_starts)
        return m

    def model_dump(self, **kw: Any) -> dict[str, Any]:  # arrays -> lists so JSON round-trips
        """direction, src_ids and dst_ids (and the group fields when set) as JSON-ready values; keyword arguments are ignored."""
        d: dict[str, Any] = {"direction": self.direction.value, "src_ids": self.src_ids.tolist(),
                             "dst_ids": self.dst_ids.tolist()}
        if self.group_sizes is not None:
            d["group_sizes"] = list(self.group_sizes)
        if self.group_starts is not None:
            d["group_starts"] = list(self.group_starts)
        return d

    def model_dump_json(self, **kw: Any) -> str:
        """``model_dump()`` as JSON text; of the keyword arguments only ``indent`` is used."""
        return json.dumps(self.model_dump(), **({"indent": kw["indent"]} if kw.get("indent") else {}))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockMapping) and self.direction == other.direction
                and self.group_sizes == other.group_sizes and self.group_starts == other.group_starts
                and np.array_equal(self.src_ids, other.src_ids) and np.array_equal(self.dst_ids, other.dst_ids))

    def __hash__(self) -> int:
        return hash((self.direction, self.src_ids.tobytes(), self.dst_ids.tobytes(), self.group_sizes, self.group_starts))

    def __len__(self) -> int:
        return count_of(self.group_sizes, self.src_ids)
