"""Layout: named buffers and the regions placed in them, with its planning cache (``info``) made once."""
from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import Field, model_validator

from ._model import Spec
from .errors import LayoutError
from .layout_cache import LayoutCache
from .spec import Buffer, Location, Region


class Layout(Spec):
    """Named buffers and the regions placed in them. What planning derives from them is made once per layout
    (``info``, built on first use or by ``prepare``).

    ``num_groups`` declares the number of KV-cache groups (None: one more than the largest ``region.group``), so
    a group with no regions still exists: it consumes its slice of the mapping's ids and copies nothing.
    """

    _error: ClassVar = LayoutError
    buffers: tuple[Buffer, ...]
    regions: tuple[Region, ...]
    num_groups: int | None = Field(default=None, ge=1)

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
            if self.num_groups is not None and r.group >= self.num_groups:
                raise LayoutError(f"regions[{i}].group", r.group, f"the layout declares {self.num_groups} KV-cache groups")
            for side in (Location.DEVICE, Location.HOST):
                p = r.placement(side)
                if p.buffer not in seen:
                    raise LayoutError(f"regions[{i}].{side}.buffer", p.buffer, f"unknown buffer (known: {sorted(seen)})")
                b = self.buffers[seen[p.buffer]]
                page = r.side_page(side)
                if p.byte_offset + page > b.nbytes:
                    raise LayoutError(
                        f"regions[{i}].{side}.byte_offset", p.byte_offset,
                        f"block 0 of {page} bytes runs past buffer {b.name!r} of {b.nbytes} bytes")
                if p.num_blocks is not None and r.block_end(side, p.num_blocks - 1) > b.nbytes:
                    raise LayoutError(
                        f"regions[{i}].{side}.num_blocks", p.num_blocks,
                        f"block {p.num_blocks - 1} ends at byte {r.block_end(side, p.num_blocks - 1)}, past buffer "
                        f"{b.name!r} of {b.nbytes} bytes")
        return self

    @functools.cached_property
    def info(self) -> LayoutCache:
        """The layout's planning cache (per-region columns, groups, per-direction facts), built on first use."""
        return LayoutCache(self.buffers, self.regions, self.num_groups)

    @property
    def group_count(self) -> int:
        """The number of KV-cache groups: ``num_groups`` when declared, else one more than the largest
        ``region.group`` (1 for a layout without regions)."""
        return self.info.num_groups

    @property
    def chunked(self) -> bool:
        """Whether some region holds more than one block per chunk on some side (its ids there are chunk ids)."""
        return self.info.chunked

    def prepare(self) -> Layout:
        """Build every per-layout structure planning needs now (both directions, default options), so the first
        plan pays no per-layout cost; returns the layout. Other option settings are made on first use."""
        self.info.prepare()
        return self

    def model_copy(self, *, update: Mapping[str, Any] | None = None, deep: bool = False) -> Layout:
        """A copy, validated again when ``update`` changes fields (derived arrays are rebuilt, never shared)."""
        if update:
            return type(self).model_validate(self.model_dump() | dict(update))
        copy = super().model_copy(deep=deep)
        copy.__dict__.pop("info", None)
        return copy

    def buffer_index(self, name: str) -> int:
        """The index of buffer ``name`` in ``buffers``; KeyError for an unknown name."""
        return self.info.buffer_index[name]
