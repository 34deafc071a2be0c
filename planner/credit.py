"""Which regions' bytes each range of a plan moves, and where a range sits in block ids (for the views).

A plan records one region per range: the region of its first byte. Where the pages of several regions lie back
to back on both sides (K and V of a block, or every layer of a block in a block-major host buffer), one range
covers bytes of several regions, and crediting it all to the first would leave the others' rows empty.
``region_credit`` splits each range by the layout's placements: region r's pages on the source side occupy
``[base + c*stride, base + c*stride + k*page)`` for chunks c, so the bytes of r before an offset x have a closed
form, and a range's share of r is that count at its end less that count at its start. The work is numpy over
ranges, plus, for the few ranges that leave their first region, over (range, region in the same buffer) pairs:
never a Python loop per range. Pure: reads the plan's columns and the layout's per-region columns.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .errors import PlanError
from .layout import Layout
from .layout_cache import SideColumns
from .spec import Buffer, Direction


class PlanColumns(Protocol):
    """What the credit reads from a ``TransferPlan`` (named structurally: the views import this module and the
    plan imports the views, so this module does not import the plan)."""

    @property
    def direction(self) -> Direction:
        """The plan's direction (which side is the source)."""
    @property
    def buffers(self) -> tuple[Buffer, ...]:
        """The plan's buffers, in order."""
    @property
    def regions(self) -> tuple[str, ...]:
        """The plan's region names, in order."""
    @property
    def region_page_bytes(self) -> tuple[int, ...]:
        """Bytes of one block per region, where recorded."""
    @property
    def requested_copies(self) -> int:
        """Block copies the mapping asked for."""
    @property
    def num_ranges(self) -> int:
        """Number of ranges."""
    @property
    def total_bytes(self) -> int:
        """Bytes of all ranges."""
    @property
    def src_buf(self) -> np.ndarray:
        """Source buffer index of every range."""
    @property
    def src_offset(self) -> np.ndarray:
        """Source byte offset of every range."""
    @property
    def nbytes(self) -> np.ndarray:
        """Size of every range."""
    @property
    def region(self) -> np.ndarray:
        """Region of every range's first byte."""


@dataclass(frozen=True)
class Credit:
    """Bytes per (range, region), one entry per pair with bytes, sorted by range then region.

    ``range`` indexes the plan's ranges, ``region`` its ``regions``; ``nbytes`` (int64) sum to each range's size,
    so they add up to the plan's total. Without a layout, or where a range's bytes do not fall wholly in the
    unaliased regions of its source buffer (a layout whose regions overlap), a range is credited to its first
    region whole, as the plan records it.
    """

    range: np.ndarray
    region: np.ndarray
    nbytes: np.ndarray

    def regions_per_range(self, num_ranges: int) -> np.ndarray:
        """How many regions each range covers (int64, one per range)."""
        return np.bincount(self.range, minlength=num_ranges)


def check_layout(plan: PlanColumns, layout: Layout) -> None:
    """Raise PlanError unless ``layout`` has the plan's regions and buffers, by name and in order."""
    names = tuple(r.name for r in layout.regions)
    if names != plan.regions:
        raise PlanError("layout.regions", f"{len(names)} regions", f"do not match the plan's {len(plan.regions)} regions")
    bufs = tuple(b.name for b in layout.buffers)
    if bufs != tuple(b.name for b in plan.buffers):
        raise PlanError("layout.buffers", f"{len(bufs)} buffers", f"do not match the plan's {len(plan.buffers)} buffers")


def bytes_before(side: SideColumns, regs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Bytes of region ``regs[i]``'s pages on ``side`` that lie below byte ``x[i]`` of its buffer (int64)."""
    base, stride, k, page = side.base[regs], side.stride[regs], side.k[regs], side.page[regs]
    y = x.astype(np.int64) - base
    row = k * page  # a chunk's pages are back to back; k == 1: one page
    c = np.floor_divide(np.maximum(y, 0), stride)
    inside = c * row + np.minimum(y - c * stride, row)
    out: np.ndarray = np.clip(inside, 0, (side.max_page[regs] + 1) * page)  # pages past the placement's last are not its
    return out


def region_credit(plan: PlanColumns, layout: Layout | None = None) -> Credit:
    """Each range's bytes per region (see ``Credit``). Raises PlanError for a layout that is not the plan's."""
    n = plan.num_ranges
    ranges, own = np.arange(n, dtype=np.int64), plan.region.astype(np.int64)
    nb = plan.nbytes.astype(np.int64)
    if layout is None or n == 0:
        return Credit(ranges, own, nb)
    check_layout(plan, layout)
    info = layout.info
    side = info.side[plan.direction.src_side]
    start = plan.src_offset.astype(np.int64)
    end = start + nb
    mixed = np.flatnonzero(bytes_before(side, own, end) - bytes_before(side, own, start) != nb)
    if not len(mixed):
        return Credit(ranges, own, nb)
    # the (range, region) pairs of the mixed ranges: every unaliased region placed in the range's source buffer
    cands = np.flatnonzero(info.alias_of == np.arange(info.nregions))
    cands = cands[np.argsort(side.buf[cands], kind="stable")]
    cand_buf = side.buf[cands]
    buf = plan.src_buf[mixed].astype(cand_buf.dtype)
    lo, hi = np.searchsorted(cand_buf, buf, "left"), np.searchsorted(cand_buf, buf, "right")
    width = hi - lo
    which = np.repeat(np.arange(len(mixed)), width)
    regs = cands[np.repeat(lo, width) + np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width)]
    share = bytes_before(side, regs, end[mixed][which]) - bytes_before(side, regs, start[mixed][which])
    whole = np.bincount(which, weights=share, minlength=len(mixed)) == nb[mixed]  # else: overlapping regions
    keep = whole[which] & (share > 0)
    split = np.zeros(n, bool)
    split[mixed[whole]] = True
    rng = np.concatenate((ranges[~split], mixed[which[keep]]))
    reg = np.concatenate((own[~split], regs[keep]))
    byt = np.concatenate((nb[~split], share[keep]))
    order = np.lexsort((reg, rng))
    return Credit(rng[order], reg[order], byt[order])


def page_bytes(plan: PlanColumns, layout: Layout | None = None) -> np.ndarray:
    """Bytes of one block per region (float64): the layout's device page, else the plan's ``region_page_bytes``;
    plans saved without them fall back to the mean bytes per requested copy (exact when all regions share one
    page size). Raises PlanError for a layout that is not the plan's."""
    if layout is not None:
        check_layout(plan, layout)
        return layout.info.page.astype(np.float64)
    if plan.region_page_bytes:
        return np.asarray(plan.region_page_bytes, dtype=np.float64)
    unit = plan.total_bytes / plan.requested_copies if plan.requested_copies else 1.0
    return np.full(len(plan.regions), unit or 1.0)


def range_blocks(plan: PlanColumns, credit: Credit, layout: Layout | None = None) -> np.ndarray:
    """Blocks (copies) each range moves, float64: its bytes per region over that region's page, summed."""
    per = credit.nbytes / page_bytes(plan, layout)[credit.region] if len(credit.range) else np.zeros(0)
    return np.bincount(credit.range, weights=per, minlength=plan.num_ranges)


def block_position(side: SideColumns, regs: np.ndarray, x: np.ndarray) -> np.ndarray:
    """Byte ``x[i]`` of region ``regs[i]``'s buffer as a position in that region's block ids on ``side`` (float64):
    id c + the fraction of its page (of its chunk, where ids are chunk ids) below x; 0 before block 0."""
    base, stride, k, page = side.base[regs], side.stride[regs], side.k[regs], side.page[regs]
    y = np.maximum(x.astype(np.int64) - base, 0)
    row = k * page
    c = np.floor_divide(y, stride)
    return c + np.minimum(y - c * stride, row) / row  # type: ignore[no-any-return]


__all__ = ["Credit", "PlanColumns", "block_position", "bytes_before", "check_layout", "page_bytes", "range_blocks",
           "region_credit"]
