"""The transfer's inputs: buffers, regions and their placements (the layout), and the block mapping."""
from __future__ import annotations

import functools
from enum import StrEnum
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator, model_validator

from ._model import Spec
from .errors import LayoutError, MappingError

MAX_NBYTES = 2**63 - 1  # keeps every offset and difference inside int64
U64 = 2**64


class Location(StrEnum):
    DEVICE = "device"
    HOST = "host"


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
    """One allocation or registered segment, addressed by name; executors bind the name to memory."""

    _error: ClassVar = LayoutError
    name: str = Field(min_length=1)
    nbytes: int = Field(gt=0, le=MAX_NBYTES)
    location: Location = Location.DEVICE
    device: int = Field(default=0, ge=0)


class Placement(Spec):
    """Where a region's block 0 sits in a buffer, and the distance between consecutive blocks."""

    _error: ClassVar = LayoutError
    buffer: str = Field(min_length=1)
    byte_offset: int = Field(default=0, ge=0)
    stride_bytes: int | None = Field(default=None, gt=0)


class Region(Spec):
    """One KV tensor: every block is page_bytes, placed once on the device side and once on the host side."""

    _error: ClassVar = LayoutError
    name: str = Field(min_length=1)
    page_bytes: int = Field(gt=0)
    device: Placement
    host: Placement

    @model_validator(mode="after")
    def _strides(self) -> Region:
        for side in ("device", "host"):
            p: Placement = getattr(self, side)
            if p.byte_offset + self.page_bytes > U64:
                raise LayoutError(f"{side}.byte_offset", p.byte_offset, f"block 0 ends past 2^64 (page_bytes {self.page_bytes})")
            if p.stride_bytes is not None and p.stride_bytes < self.page_bytes:
                raise LayoutError(f"{side}.stride_bytes", p.stride_bytes, f"stride is smaller than page_bytes {self.page_bytes}")
        return self

    def stride(self, side: str) -> int:
        p: Placement = getattr(self, side)
        return self.page_bytes if p.stride_bytes is None else p.stride_bytes


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
                if p.byte_offset + r.page_bytes > b.nbytes:
                    raise LayoutError(
                        f"regions[{i}].{side}.byte_offset", p.byte_offset,
                        f"block 0 of {r.page_bytes} bytes runs past buffer {b.name!r} of {b.nbytes} bytes")
        return self

    @functools.cached_property
    def info(self) -> LayoutInfo:
        return LayoutInfo(self)

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
        for side in ("device", "host"):
            buf = np.array([self.buffer_index[getattr(r, side).buffer] for r in regs], dtype=np.int32)
            base = np.array([getattr(r, side).byte_offset for r in regs], dtype=np.int64)
            stride = np.array([r.stride(side) for r in regs], dtype=np.int64)
            cap = np.array([layout.buffers[i].nbytes for i in buf], dtype=np.int64)
            max_id = (cap - base - self.page) // stride  # last block that fits; >= 0 by validation
            cols = dict(buf=buf, base=base, stride=stride, max_id=max_id,
                        end=base + max_id * stride + self.page, dense=stride == self.page)
            for a in cols.values():
                a.flags.writeable = False
            self.side[side] = cols
        self._links: dict[str, np.ndarray] = {}
        self._disjoint: dict[str, bool] = {}
        self.memo: dict[tuple, object] = {}  # other per-layout results, keyed by their caller

    def shared_buffers(self, direction: Direction) -> tuple[int, ...]:
        """Buffers that some region reads and some region writes in this direction (rare; needs overlap checks)."""
        key = ("shared", direction.value)
        if key not in self.memo:
            both = np.intersect1d(self.side[direction.src_side]["buf"], self.side[direction.dst_side]["buf"])
            self.memo[key] = tuple(both.tolist())
        return self.memo[key]

    def linked_regions(self, direction: Direction) -> np.ndarray:
        """Boolean mask of regions whose ranges might merge with another region's (same buffers, touching extents on both sides)."""
        if direction.value not in self._links:
            s, d = self.side[direction.src_side], self.side[direction.dst_side]
            n = self.nregions
            mask = np.zeros(n, dtype=bool)
            if n > 1:
                same = (s["buf"][:, None] == s["buf"][None, :]) & (d["buf"][:, None] == d["buf"][None, :])
                touch_s = (s["base"][:, None] <= s["end"][None, :]) & (s["base"][None, :] <= s["end"][:, None])
                touch_d = (d["base"][:, None] <= d["end"][None, :]) & (d["base"][None, :] <= d["end"][:, None])
                pair = same & touch_s & touch_d
                np.fill_diagonal(pair, False)
                mask = pair.any(axis=1)
            mask.flags.writeable = False
            self._links[direction.value] = mask
        return self._links[direction.value]

    def dst_order(self, direction: Direction) -> tuple[np.ndarray, bool]:
        """Regions ordered by destination (buffer, base), and whether their destination extents are pairwise disjoint."""
        d = self.side[direction.dst_side]
        order = np.lexsort((d["base"], d["buf"]))
        if direction.value not in self._disjoint:
            b, lo, hi = d["buf"][order], d["base"][order], d["end"][order]
            self._disjoint[direction.value] = bool(np.all((b[1:] != b[:-1]) | (hi[:-1] <= lo[1:])))
        return order, self._disjoint[direction.value]


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

    @field_validator("src_ids", "dst_ids", mode="plain")
    @classmethod
    def _ids(cls, v: Any, info: Any) -> np.ndarray:
        return _as_ids(v, info.field_name)

    @model_validator(mode="after")
    def _lengths(self) -> BlockMapping:
        if len(self.src_ids) != len(self.dst_ids):
            raise MappingError("dst_ids", f"length {len(self.dst_ids)}",
                               f"src_ids has {len(self.src_ids)} ids; the lists must have equal length")
        return self

    def model_dump(self, **kw: Any) -> dict[str, Any]:  # arrays -> lists so JSON round-trips
        return {"direction": self.direction.value, "src_ids": self.src_ids.tolist(), "dst_ids": self.dst_ids.tolist()}

    def model_dump_json(self, **kw: Any) -> str:
        import json
        return json.dumps(self.model_dump(), **({"indent": kw["indent"]} if kw.get("indent") else {}))

    def __eq__(self, other: object) -> bool:
        return (isinstance(other, BlockMapping) and self.direction == other.direction
                and np.array_equal(self.src_ids, other.src_ids) and np.array_equal(self.dst_ids, other.dst_ids))

    def __hash__(self) -> int:
        return hash((self.direction, self.src_ids.tobytes(), self.dst_ids.tobytes()))

    def __len__(self) -> int:
        return len(self.src_ids)
