"""The transfer's inputs: buffers, regions and their placements (the layout), and the block mapping."""
from __future__ import annotations

import functools
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator, model_serializer, model_validator

from ._model import Spec
from .errors import LayoutError, MappingError

_MISSING = object()
MAX_NBYTES = 2**63 - 1  # keeps every offset and difference inside int64
U64 = 2**64


class Location(StrEnum):
    DEVICE = "device"
    HOST = "host"
    FILE = "file"  # a file (storage tier); where it lives is the binding's business, not the plan's


class Direction(StrEnum):
    H2D = "h2d"  # load: host placement -> device placement
    D2H = "d2h"  # store: device placement -> host placement

    @property
    def src_side(self) -> str:
        return "host" if self is Direction.H2D else "device"

    @property
    def dst_side(self) -> str:
        return "device" if self is Direction.H2D else "host"


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
        d = handler(self)
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
    """

    _error: ClassVar = LayoutError
    name: str = Field(min_length=1)
    page_bytes: int = Field(gt=0)
    device: Placement
    host: Placement
    host_page_bytes: int | None = Field(default=None, gt=0)
    fragments: tuple[Fragment, ...] = ()
    group: int = Field(default=0, ge=0)

    @model_validator(mode="after")
    def _strides(self) -> Region:
        for side in ("device", "host"):
            p: Placement = getattr(self, side)
            page = self.side_page(side)
            if p.byte_offset + page > U64:
                raise LayoutError(f"{side}.byte_offset", p.byte_offset, f"block 0 ends past 2^64 (page_bytes {page})")
            row = page * p.blocks_per_chunk
            if p.stride_bytes is not None and p.stride_bytes < row:
                k = p.blocks_per_chunk
                what = "page_bytes" if k == 1 else f"blocks_per_chunk x page_bytes ({k} x {page})"
                raise LayoutError(f"{side}.stride_bytes", p.stride_bytes, f"stride is smaller than {what} {row}")
        if not self.fragments and self.side_page("host") != self.page_bytes:
            raise LayoutError("host_page_bytes", self.host_page_bytes,
                              f"differs from page_bytes {self.page_bytes}; fragments must say which bytes correspond")
        for side, off, stride, page in (("local", "local_offset", "local_stride", self.page_bytes),
                                        ("canonical", "canonical_offset", "canonical_stride", self.side_page("host"))):
            spans = []
            for j, f in enumerate(self.fragments):
                start, step = getattr(f, off), getattr(f, stride)
                end = start + (f.count - 1) * step + f.fragment_bytes
                if end > page:
                    raise LayoutError(f"fragments[{j}].{off}", start, f"{side} fragments end at byte {end}, past the "
                                      f"{side} page of {page} bytes")
                if f.count > 1 and step < f.fragment_bytes:
                    raise LayoutError(f"fragments[{j}].{stride}", step, f"pieces of {f.fragment_bytes} bytes overlap")
                spans += [(start + i * step, start + i * step + f.fragment_bytes, j) for i in range(f.count)]
            spans.sort()
            for (_, a1, ja), (b0, _, jb) in zip(spans, spans[1:]):
                if b0 < a1:
                    raise LayoutError(f"fragments[{jb}].{off}", b0, f"{side} bytes [{b0}, {a1}) overlap fragments[{ja}]")
        return self

    def side_page(self, side: str) -> int:
        """Page size on ``side``: page_bytes on the device, host_page_bytes (default page_bytes) on the host."""
        return self.host_page_bytes or self.page_bytes if side == "host" else self.page_bytes

    def stride(self, side: str) -> int:
        p: Placement = getattr(self, side)
        return self.side_page(side) * p.blocks_per_chunk if p.stride_bytes is None else p.stride_bytes


class Layout(Spec):
    """Named buffers and the regions placed in them. Derived arrays are computed once per layout (cached)."""

    _error: ClassVar = LayoutError
    buffers: tuple[Buffer, ...]
    regions: tuple[Region, ...]

    @model_validator(mode="after")
    def _names(self) -> Layout:
        seen: dict[str, int] = {}
        for i, b in enumerate(self.buffers):
            if b.name in seen:
                raise LayoutError("buffers", b.name, f"duplicate buffer name (also buffers[{seen[b.name]}])", i)
            seen[b.name] = i
        rseen: dict[str, int] = {}
        for i, r in enumerate(self.regions):
            if r.name in rseen:
                raise LayoutError("regions", r.name, f"duplicate region name (also regions[{rseen[r.name]}])", i)
            rseen[r.name] = i
            for side in ("device", "host"):
                p: Placement = getattr(r, side)
                if p.buffer not in seen:
                    raise LayoutError(f"regions[{i}].{side}.buffer", p.buffer, f"unknown buffer (known: {sorted(seen)})")
                b = self.buffers[seen[p.buffer]]
                page = r.side_page(side)
                if p.byte_offset + page > b.nbytes:
                    raise LayoutError(
                        f"regions[{i}].{side}.byte_offset", p.byte_offset,
                        f"block 0 of {page} bytes runs past buffer {b.name!r} of {b.nbytes} bytes")
        return self

    @functools.cached_property
    def info(self) -> LayoutInfo:
        return LayoutInfo(self)

    def model_copy(self, *, update: dict[str, Any] | None = None, deep: bool = False) -> Layout:
        """A copy, validated again when ``update`` changes fields (derived arrays are rebuilt, never shared)."""
        if update:
            return type(self).model_validate(self.model_dump() | update)
        copy = super().model_copy(deep=deep)
        copy.__dict__.pop("info", None)
        return copy

    def buffer_index(self, name: str) -> int:
        return self.info.buffer_index[name]


class LayoutInfo:
    """Per-side numpy columns derived from a Layout; pure, computed once and then read-only."""

    def __init__(self, layout: Layout):
        self.buffer_index = {b.name: i for i, b in enumerate(layout.buffers)}
        regs = layout.regions
        self.nregions = len(regs)
        self.page = np.array([r.page_bytes for r in regs], dtype=np.int64)
        self.side: dict[str, dict[str, np.ndarray]] = {}
        self.group = np.array([r.group for r in regs], dtype=np.int64)
        self.pieces = np.array([max(sum(f.count for f in r.fragments), 1) for r in regs], dtype=np.int64)
        self.num_groups = int(self.group.max()) + 1 if regs else 1
        # plain: one group, k == 1, no fragments -- the fast path in coalesce.py applies
        self.plain = self.num_groups == 1 and all(
            not r.fragments and r.device.blocks_per_chunk == 1 and r.host.blocks_per_chunk == 1 for r in regs)
        for side in ("device", "host"):
            buf = np.array([self.buffer_index[getattr(r, side).buffer] for r in regs], dtype=np.int32)
            base = np.array([getattr(r, side).byte_offset for r in regs], dtype=np.int64)
            stride = np.array([r.stride(side) for r in regs], dtype=np.int64)
            page = np.array([r.side_page(side) for r in regs], dtype=np.int64)
            k = np.array([getattr(r, side).blocks_per_chunk for r in regs], dtype=np.int64)
            cap = np.array([layout.buffers[i].nbytes for i in buf], dtype=np.int64)
            max_id = (cap - base - page * k) // stride  # last chunk (block when k == 1) that fits whole
            cols = dict(buf=buf, base=base, stride=stride, max_id=max_id, page=page, k=k, cap=cap,
                        dense=stride == page * k)
            for a in cols.values():
                a.flags.writeable = False
            self.side[side] = cols
        self.memo: dict[tuple, object] = {}  # other per-layout results, keyed by their caller

    def shared_buffers(self, direction: Direction) -> tuple[int, ...]:
        """Buffers that some region reads and some region writes in this direction (rare; needs overlap checks)."""
        return self.cached(("shared", direction.value), lambda: tuple(
            np.intersect1d(self.side[direction.src_side]["buf"], self.side[direction.dst_side]["buf"]).tolist()))

    def extent_end(self, side: str, top: int) -> np.ndarray:
        """Per region: the end byte of page ``top`` on ``side`` -- the extent of a transfer whose ids stay <= top."""
        c = self.side[side]
        return c["base"] + (top // c["k"]) * c["stride"] + (top % c["k"]) * c["page"] + c["page"]

    def cached(self, key: tuple, make: Any) -> Any:
        """``memo[key]``, made once. Safe when threads plan on one layout: a value read is never evicted under
        the reader, and two threads making the same value make equal values."""
        value = self.memo.get(key, _MISSING)
        if value is _MISSING:
            value = make()
            if len(self.memo) > 64:  # per-transfer keys: keep the memo small
                for k in [k for k in list(self.memo) if k[0] in ("links", "disjoint")]:
                    self.memo.pop(k, None)
            self.memo[key] = value
        return value

    def linked_regions(self, direction: Direction, top_src: int, top_dst: int) -> np.ndarray:
        """Mask of regions whose ranges might merge with another region's: same buffers on both sides and
        extents (up to the transfer's largest page ids) touching on both sides."""
        def make() -> np.ndarray:
            s, d = self.side[direction.src_side], self.side[direction.dst_side]
            mask = np.zeros(self.nregions, dtype=bool)
            if self.nregions > 1:
                es, ed = self.extent_end(direction.src_side, top_src), self.extent_end(direction.dst_side, top_dst)
                pair = (s["buf"][:, None] == s["buf"][None, :]) & (d["buf"][:, None] == d["buf"][None, :])
                pair &= (s["base"][:, None] <= es[None, :]) & (s["base"][None, :] <= es[:, None])
                pair &= (d["base"][:, None] <= ed[None, :]) & (d["base"][None, :] <= ed[:, None])
                np.fill_diagonal(pair, False)
                mask = pair.any(axis=1)
            mask.flags.writeable = False
            return mask
        return self.cached(("links", direction.value, top_src, top_dst), make)

    def dst_order(self, direction: Direction, top_dst: int) -> tuple[np.ndarray, bool]:
        """Regions ordered by destination (buffer, base), and whether their destination extents (up to page id
        ``top_dst``) are pairwise disjoint."""
        order = self.cached(("order", direction.value), lambda: np.lexsort(
            (self.side[direction.dst_side]["base"], self.side[direction.dst_side]["buf"])))

        def make() -> bool:
            d = self.side[direction.dst_side]
            b, lo, hi = d["buf"][order], d["base"][order], self.extent_end(direction.dst_side, top_dst)[order]
            return bool(np.all((b[1:] != b[:-1]) | (hi[:-1] <= lo[1:])))
        return order, self.cached(("disjoint", direction.value, top_dst), make)


def _as_ids(value: Any, field: str) -> np.ndarray:
    """Block ids as a read-only int64 array; rejects non-integers and negatives naming the index."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        arr = value
    else:
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise MappingError(field, value, f"not an array of integers ({e})") from None
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iuf" and arr.size:
            idx = 0 if arr.ndim else None
            raise MappingError(field, arr.flat[0].item() if arr.size else value, "block ids must be integers", idx)
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
        i = int(np.argmax(out < 0))
        raise MappingError(field, int(out[i]), "block ids must be non-negative", i)
    out.flags.writeable = False
    return out


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
    def _non_negative(cls, v: tuple[int, ...] | None, info: Any) -> tuple[int, ...] | None:
        for i, x in enumerate(v or ()):
            if x < 0:
                raise MappingError(info.field_name, x, "must be non-negative", i)
        return v

    @field_validator("src_ids", "dst_ids", mode="plain")
    @classmethod
    def _ids(cls, v: Any, info: Any) -> np.ndarray:
        return _as_ids(v, info.field_name)

    @model_validator(mode="after")
    def _lengths(self) -> BlockMapping:
        if self.group_starts is not None and self.group_sizes is None:
            raise MappingError("group_starts", self.group_starts, "needs group_sizes")
        if self.group_starts is not None and len(self.group_starts) != len(self.group_sizes or ()):
            raise MappingError("group_starts", f"length {len(self.group_starts)}",
                               f"group_sizes has {len(self.group_sizes or ())} groups")
        if self.group_sizes is None and len(self.src_ids) != len(self.dst_ids):
            raise MappingError("dst_ids", f"length {len(self.dst_ids)}",
                               f"src_ids has {len(self.src_ids)} ids; the lists must have equal length")
        return self

    def model_dump(self, **kw: Any) -> dict[str, Any]:  # arrays -> lists so JSON round-trips
        d = {"direction": self.direction.value, "src_ids": self.src_ids.tolist(), "dst_ids": self.dst_ids.tolist()}
        if self.group_sizes is not None:
            d["group_sizes"] = list(self.group_sizes)
        if self.group_starts is not None:
            d["group_starts"] = list(self.group_starts)
        return d

    def model_dump_json(self, **kw: Any) -> str:
        import json
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
        if self.group_sizes is None:
            return True
        return (len(self.group_sizes) == 1 and not any(self.group_starts or ())
                and self.group_sizes[0] == len(self.src_ids) == len(self.dst_ids))
