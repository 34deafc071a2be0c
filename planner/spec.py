"""The transfer's inputs, piece by piece: buffers, placements, fragments, regions and the block mapping.

The Layout that gathers buffers and regions lives in ``layout.py`` (it carries the derived ``LayoutInfo``).
"""
from __future__ import annotations

import json
from collections.abc import Callable
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, ValidationInfo, field_validator, model_serializer, model_validator

from ._model import Spec
from .errors import LayoutError, MappingError

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
    """

    _error: ClassVar = LayoutError
    buffer: str = Field(min_length=1)
    byte_offset: int = Field(default=0, ge=0)
    stride_bytes: int | None = Field(default=None, gt=0, le=MAX_NBYTES)
    blocks_per_chunk: int = Field(default=1, ge=1)


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

    def alias_key(self) -> tuple[Any, ...]:
        """Equal for two regions exactly when they name the same bytes on both sides for every block id, in the
        same group with the same writers (aliases: layers sharing one KV tensor). Defaults are resolved."""
        sides = tuple((p.buffer, p.byte_offset, self.stride(s), p.blocks_per_chunk)
                      for s, p in ((Location.DEVICE, self.device), (Location.HOST, self.host)))
        return (sides, self.page_bytes, self.side_page(Location.HOST), self.fragments, self.group,
                self.num_writers, self.writer_index)


def _as_ids(value: Any, field: str) -> np.ndarray:
    """Block ids as a read-only int64 array; rejects non-integers and negatives naming the index."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        arr = value
    else:
        if value is None or isinstance(value, (dict, str, bytes)) or not hasattr(value, "__len__"):
            raise MappingError(field, type(value).__name__, "expected a list or array of integer block ids")
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise MappingError(field, type(value).__name__, f"not an array of integers ({e})") from None
        if arr.dtype.kind == "O" and arr.ndim == 1:  # Python ints beyond int64, None, objects
            for i, v in enumerate(arr.tolist()):
                shown = v if isinstance(v, (int, float, str, type(None))) else type(v).__name__
                if not isinstance(v, int) or isinstance(v, bool):
                    raise MappingError(field, shown, "block ids must be integers", i)
                if not 0 <= v <= np.iinfo(np.int64).max:
                    raise MappingError(field, v, "block ids must be non-negative" if v < 0 else "block id does not fit int64", i)
            arr = arr.astype(np.int64)
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf" and arr.size:
            idx = 0 if arr.ndim else None
            first = arr.flat[0] if arr.size else value
            raise MappingError(field, first.item() if hasattr(first, "item") else first, "block ids must be integers", idx)
        if arr.dtype.kind == "f":
            bad = np.flatnonzero(~np.isfinite(arr) | (arr != np.floor(arr)))
            if bad.size:
                raise MappingError(field, float(arr[bad[0]]), "block ids must be integers", int(bad[0]))
    if arr.ndim != 1:
        raise MappingError(field, f"shape {arr.shape}", "block ids must be one-dimensional")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
        i = int(np.argmax(arr))
        raise MappingError(field, int(arr[i]), "block id does not fit int64", i)
    if arr.dtype.kind == "f" and arr.size and np.abs(arr).max() > 2.0**62:
        i = int(np.argmax(np.abs(arr)))
        raise MappingError(field, float(arr[i]), "block id out of range", i)
    out = np.array(arr, dtype=np.int64, copy=True)  # own copy: the caller may reuse its array
    if out.size and out.min() < 0:
        refuse_negative(out, field)
    out.flags.writeable = False
    return out


def refuse_negative(ids: np.ndarray, field: str) -> None:
    """Raise MappingError naming the first negative id of ``ids`` (the error path of every non-negativity check,
    whichever pass found it)."""
    i = int(np.argmax(ids < 0))
    raise MappingError(field, int(ids[i]), "block ids must be non-negative", i)


_DIRECTIONS = frozenset(d.value for d in Direction)
_MAPPING_KEYS = frozenset(("direction", "src_ids", "dst_ids", "group_sizes", "group_starts"))


def _fast_mapping(data: dict[str, Any], ids: Callable[[np.ndarray, str], np.ndarray] | None = None) -> dict[str, Any] | None:
    """BlockMapping's fields from integer id arrays, a Direction (or its value) and group lists of non-negative
    integers, checked as the validators check them; None for anything else (pydantic then validates it and
    names what is wrong)."""
    if not (data.keys() <= _MAPPING_KEYS and "direction" in data):
        return None
    src, dst = data.get("src_ids"), data.get("dst_ids")
    if not (isinstance(src, np.ndarray) and isinstance(dst, np.ndarray) and src.dtype.kind in "iu"
            and dst.dtype.kind in "iu"):
        return None
    direction = data["direction"]
    if not isinstance(direction, Direction):
        if not isinstance(direction, str) or direction not in _DIRECTIONS:
            return None
        direction = Direction(direction)
    groups = []
    for name in ("group_sizes", "group_starts"):
        v = data.get(name)
        if v is not None:
            if not isinstance(v, (tuple, list)) or not all(
                    isinstance(x, (int, np.integer)) and not isinstance(x, bool) and x >= 0 for x in v):
                return None
            v = tuple(int(x) for x in v)
        groups.append(v)
    take = ids or _as_ids
    return {"direction": direction, "src_ids": take(src, "src_ids"), "dst_ids": take(dst, "dst_ids"),
            "group_sizes": groups[0], "group_starts": groups[1]}


def _borrow_ids(arr: np.ndarray, field: str) -> np.ndarray:
    """An integer id array as int64 without copying it when it is int64 already (values unchecked)."""
    if arr.ndim != 1:
        raise MappingError(field, f"shape {arr.shape}", "block ids must be one-dimensional")
    if arr.dtype != np.int64:
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > np.iinfo(np.int64).max:
            i = int(np.argmax(arr))
            raise MappingError(field, int(arr[i]), "block id does not fit int64", i)
        arr = arr.astype(np.int64)
    return arr


class BorrowedMapping:
    """BlockMapping's fields over the caller's own id arrays, not copied: what ``plan_transfer`` plans from
    when handed a dict of integer numpy id arrays (the per-job hot path; the plan keeps no ids).

    Direction, dtype, shape, lengths and group fields are checked here as BlockMapping checks them, naming the
    field; the ids' values (non-negative) are checked by the planning path on its way, on id runs, before any
    id is used (``checked`` is False until then). The arrays must not change while the plan is made."""

    __slots__ = ("direction", "src_ids", "dst_ids", "group_sizes", "group_starts")
    checked = False

    def __init__(self, direction: Direction, src_ids: np.ndarray, dst_ids: np.ndarray,
                 group_sizes: tuple[int, ...] | None, group_starts: tuple[int, ...] | None):
        self.direction, self.src_ids, self.dst_ids = direction, src_ids, dst_ids
        self.group_sizes, self.group_starts = group_sizes, group_starts

    @classmethod
    def of(cls, data: Any) -> BorrowedMapping | None:
        """The mapping of ``data`` (a dict with integer numpy id arrays and well-formed other fields), or None
        for anything else (which BlockMapping then validates, naming what is wrong)."""
        values = _fast_mapping(data, _borrow_ids) if isinstance(data, dict) else None
        if values is None:
            return None
        mapping = cls(**values)
        try:
            _check_lengths(values["src_ids"], values["dst_ids"], values["group_sizes"], values["group_starts"])
        except MappingError:
            mapping.check_values()  # a negative id is named first, as BlockMapping names it (rare path)
            raise
        return mapping

    def check_values(self) -> None:
        """Refuse a negative id, naming field, value and index (one pass per list; the plain path does it on
        id runs instead)."""
        for field in ("src_ids", "dst_ids"):
            ids = getattr(self, field)
            if len(ids) and int(ids.min()) < 0:
                refuse_negative(ids, field)

    @property
    def plain(self) -> bool:
        """As ``BlockMapping.plain``."""
        return _plain_groups(self.group_sizes, self.group_starts, len(self.src_ids), len(self.dst_ids))

    def __len__(self) -> int:
        return len(self.src_ids) if self.group_sizes is None else sum(self.group_sizes)


def _plain_groups(sizes: tuple[int, ...] | None, starts: tuple[int, ...] | None, ns: int, nd: int) -> bool:
    if sizes is None:
        return True
    return len(sizes) == 1 and not any(starts or ()) and sizes[0] == ns == nd


def _check_lengths(src: np.ndarray, dst: np.ndarray, sizes: tuple[int, ...] | None,
                   starts: tuple[int, ...] | None) -> None:
    if starts is not None and sizes is None:
        raise MappingError("group_starts", starts, "needs group_sizes")
    if starts is not None and len(starts) != len(sizes or ()):
        raise MappingError("group_starts", f"length {len(starts)}", f"group_sizes has {len(sizes or ())} groups")
    if sizes is None and len(src) != len(dst):
        raise MappingError("dst_ids", f"length {len(dst)}",
                           f"src_ids has {len(src)} ids; the lists must have equal length")


class BlockMapping(Spec):
    """Which blocks move: src_ids[i] -> dst_ids[i] in every region. Ids are read-only int64 arrays."""

    model_config = Spec.model_config | {"arbitrary_types_allowed": True}
    _error: ClassVar = MappingError
    direction: Direction
    src_ids: np.ndarray
    dst_ids: np.ndarray
    group_sizes: tuple[int, ...] | None = None
    group_starts: tuple[int, ...] | None = None

    @field_validator("group_sizes", "group_starts")
    @classmethod
    def _non_negative(cls, v: tuple[int, ...] | None, info: ValidationInfo) -> tuple[int, ...] | None:
        for i, x in enumerate(v or ()):
            if x < 0:
                raise MappingError(str(info.field_name), x, "must be non-negative", i)
        return v

    @field_validator("src_ids", "dst_ids", mode="plain")
    @classmethod
    def _ids(cls, v: Any, info: ValidationInfo) -> np.ndarray:
        return _as_ids(v, str(info.field_name))

    def __init__(self, **data: Any) -> None:
        """Validated as every Spec; integer id arrays with well-formed fields around them (the per-job case)
        take the same checks without pydantic's machinery (``_as_ids`` and ``_check_lengths`` as below)."""
        values = _fast_mapping(data)
        if values is None:
            super().__init__(**data)
            return
        _check_lengths(values["src_ids"], values["dst_ids"], values["group_sizes"], values["group_starts"])
        set_ = object.__setattr__  # what BaseModel.model_construct sets
        set_(self, "__dict__", values)
        set_(self, "__pydantic_fields_set__", set(data))
        set_(self, "__pydantic_extra__", None)
        set_(self, "__pydantic_private__", None)

    @model_validator(mode="after")
    def _lengths(self) -> BlockMapping:
        _check_lengths(self.src_ids, self.dst_ids, self.group_sizes, self.group_starts)
        return self

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
        return len(self.src_ids) if self.group_sizes is None else sum(self.group_sizes)

    @property
    def plain(self) -> bool:
        """One group starting at a chunk boundary whose size is the length of both id lists: ids pair up one
        to one (anything else is checked against the layout's groups and chunks)."""
        return _plain_groups(self.group_sizes, self.group_starts, len(self.src_ids), len(self.dst_ids))
