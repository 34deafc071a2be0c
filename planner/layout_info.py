"""LayoutInfo: the numpy columns both planning paths read, derived once from a layout's buffers and regions."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import numpy as np

from ._model import IntTuple
from .scratch import ColumnPool
from .spec import Buffer, Direction, Location, Region

T = TypeVar("T")
_MISSING = object()


@dataclass(frozen=True)
class SideColumns:
    """One side (device or host) of every region, one entry per region; arrays are read-only."""

    buf: np.ndarray  # int32 buffer index
    base: np.ndarray  # byte offset of block 0
    stride: np.ndarray  # bytes between chunks (blocks when k == 1)
    page: np.ndarray  # page bytes on this side
    k: np.ndarray  # blocks per chunk
    cap: np.ndarray  # the buffer's size
    max_page: np.ndarray  # last page id whose bytes end inside the buffer (-1: none)
    dense: np.ndarray  # stride == k * page: consecutive pages are consecutive bytes
    linear_stride: np.ndarray  # bytes between consecutive page ids where offsets are linear in the page id
    lowest_max_page: int  # the smallest max_page: page ids up to it fit every region

    @classmethod
    def of(cls, buffers: tuple[Buffer, ...], regions: tuple[Region, ...], index: dict[str, int],
           side: Location) -> SideColumns:
        """The columns of ``side`` (host or device placement) for ``regions``; ``index`` maps buffer names to indices. The
        arrays are read-only."""
        places = [r.placement(side) for r in regions]
        buf = np.array([index[p.buffer] for p in places], dtype=np.int32)
        base = np.array([p.byte_offset for p in places], dtype=np.int64)
        stride = np.array([r.stride(side) for r in regions], dtype=np.int64)
        page = np.array([r.side_page(side) for r in regions], dtype=np.int64)
        k = np.array([p.blocks_per_chunk for p in places], dtype=np.int64)
        cap = np.array([buffers[i].nbytes for i in buf.tolist()], dtype=np.int64)
        last_chunk = (cap - base - page) // stride  # the last chunk whose first page fits
        last_in_chunk = np.minimum(k - 1, (cap - base - np.maximum(last_chunk, 0) * stride - page) // page)
        max_page = np.where(last_chunk < 0, -1, last_chunk * k + last_in_chunk)
        dense = stride == page * k
        cols = cls(buf=buf, base=base, stride=stride, page=page, k=k, cap=cap, max_page=max_page, dense=dense,
                   linear_stride=np.where(k == 1, stride, page),
                   lowest_max_page=int(max_page.min()) if len(max_page) else 0)
        for a in vars(cols).values():
            if isinstance(a, np.ndarray):
                a.flags.writeable = False
        return cols

    def offsets(self, r: int, pages: np.ndarray) -> np.ndarray:
        """Byte offsets of ``pages`` (page ids) of region ``r``."""
        k = int(self.k[r])
        out: np.ndarray = (self.base[r] + pages * self.stride[r] if k == 1
                           else self.base[r] + (pages // k) * self.stride[r] + (pages % k) * self.page[r])
        return out

    def page_end(self, r: int, page: int) -> int:
        """End byte of page ``page`` of region ``r`` (Python integers: no overflow)."""
        k = int(self.k[r])
        return int(self.base[r]) + page // k * int(self.stride[r]) + page % k * int(self.page[r]) + int(self.page[r])


class LayoutInfo:
    """Per-side numpy columns derived from buffers and regions; pure, computed once and then read-only.

    ``origin[i]`` is region i's index in the layout it came from (an alias-free view keeps the first region of
    each set of aliases). ``alias_of[i]`` is the region whose bytes region i repeats (itself when none).
    """

    def __init__(self, buffers: tuple[Buffer, ...], regions: tuple[Region, ...], num_groups: int | None = None,
                 origin: np.ndarray | None = None):
        self.buffers, self.regions = buffers, regions
        self.buffer_index = {b.name: i for i, b in enumerate(buffers)}
        self.nregions = len(regions)
        self.origin = np.arange(self.nregions, dtype=np.int64) if origin is None else origin
        self.page = np.array([r.page_bytes for r in regions], dtype=np.int64)
        self.group = np.array([r.group for r in regions], dtype=np.int64)
        self.pieces = np.array([max(sum(f.count for f in r.fragments), 1) for r in regions], dtype=np.int64)
        self.num_groups = num_groups if num_groups is not None else int(self.group.max()) + 1 if regions else 1
        # -1: the plan-level PlanOptions value applies
        self.num_writers = np.array([-1 if r.num_writers is None else r.num_writers for r in regions], dtype=np.int64)
        self.writer_index = np.array([-1 if r.writer_index is None else r.writer_index for r in regions], dtype=np.int64)
        self.sets_writers = bool(np.any((self.num_writers >= 0) | (self.writer_index >= 0)))  # some region does
        # plain: one group, k == 1, no fragments -- the fast path applies
        self.plain = self.num_groups == 1 and all(
            not r.fragments and r.device.blocks_per_chunk == 1 and r.host.blocks_per_chunk == 1 for r in regions)
        self.side = {s: SideColumns.of(buffers, regions, self.buffer_index, s) for s in (Location.DEVICE, Location.HOST)}
        # paged: one group, whole pages of one size on both sides, offsets linear in the page id on both sides
        # (k == 1, or chunk rows without padding) -- chunk ids become page ids and the fast path applies
        dev, host = self.side[Location.DEVICE], self.side[Location.HOST]
        self.paged = self.num_groups == 1 and not any(r.fragments for r in regions) and bool(np.all(
            ((dev.k == 1) | dev.dense) & ((host.k == 1) | host.dense) & (dev.page == self.page) & (host.page == self.page)))
        first: dict[tuple[Any, ...], int] = {}
        self.alias_of = np.array([first.setdefault(r.alias_key(), i) for i, r in enumerate(regions)], dtype=np.int64)
        # (alias, region it repeats) name pairs, in region order
        self.aliases = tuple((regions[i].name, regions[a].name) for i, a in enumerate(self.alias_of.tolist()) if a != i)
        self.names = tuple(r.name for r in regions)
        self.page_bytes = IntTuple(int(r.page_bytes) for r in regions)  # plans take it without converting it
        self.align_bytes = np.array([b.align_bytes for b in buffers] or [1], dtype=np.uint64)  # see alignment
        self.align_bytes.flags.writeable = False
        self.aligned = bool(np.any(self.align_bytes > 1))  # some buffer declares an alignment: plans are checked
        self.memo: dict[tuple[Any, ...], object] = {}  # other per-layout results, keyed by their caller
        self.pool = ColumnPool()  # memory for the offset columns of this layout's plans (see scratch)

    def without_aliases(self) -> LayoutInfo:
        """The same layout with each alias dropped (its bytes move once, through the region it repeats)."""
        def make() -> LayoutInfo:
            keep = np.flatnonzero(self.alias_of == np.arange(self.nregions))
            return LayoutInfo(self.buffers, tuple(self.regions[i] for i in keep.tolist()), self.num_groups, keep)
        return self.cached(("without_aliases",), make)

    def writers(self, num_writers: int, writer_index: int) -> tuple[np.ndarray, np.ndarray]:
        """Per region: (writers, this rank's index) for stores; the region's own values, else the plan's. One writer
        means every rank writes the region (rank-private), whatever the index."""
        nw = np.where(self.num_writers < 0, num_writers, self.num_writers)
        wi = np.where(nw == 1, 0, np.where(self.writer_index < 0, writer_index, self.writer_index))
        return nw, wi

    def group_regions(self, group: int) -> np.ndarray:
        """Indices of the regions of KV-cache group ``group`` (made once per group)."""
        return self.cached(("group_regions", group), lambda: np.flatnonzero(self.group == group))

    def call_group(self, regions_per_call: int | None) -> np.ndarray:
        """Per region: its call group (one per ``regions_per_call`` regions of the original layout; 0 when None)."""
        if not regions_per_call:
            return np.zeros(self.nregions, np.int64)
        return self.origin // regions_per_call

    def shared_buffers(self, direction: Direction) -> tuple[int, ...]:
        """Buffers that some region reads and some region writes in this direction (rare; needs overlap checks)."""
        return self.cached(("shared", direction.value), lambda: tuple(
            np.intersect1d(self.side[direction.src_side].buf, self.side[direction.dst_side].buf).tolist()))

    def extent_end(self, side: Location, top: int) -> np.ndarray:
        """Per region: the end byte of page ``top`` on ``side`` -- the extent of a transfer whose ids stay <= top."""
        c = self.side[side]
        out: np.ndarray = c.base + (top // c.k) * c.stride + (top % c.k) * c.page + c.page
        return out

    def last_page_before(self, side: Location, regs: np.ndarray, limit: np.ndarray) -> np.ndarray:
        """Per region of ``regs``: the largest page id whose bytes end at or before byte ``limit`` (-1: none).

        The inverse of ``extent_end``, which grows with the page id: ``extent_end(top) <= limit`` exactly when
        ``top <= last_page_before(limit)``. Turns per-transfer extent tests into thresholds made once per layout."""
        c = self.side[side]
        base, stride, page, k = c.base[regs], c.stride[regs], c.page[regs], c.k[regs]
        chunk = (limit - base - page) // stride  # the last chunk whose first page ends by ``limit``
        within = np.minimum(k - 1, (limit - base - np.maximum(chunk, 0) * stride - page) // page)
        out: np.ndarray = np.where(chunk < 0, -1, chunk * k + within)
        return out

    def cached(self, key: tuple[Any, ...], make: Callable[[], T]) -> T:
        """``memo[key]``, made once. Keys depend on the layout and on plan-level settings (direction, options),
        never on one transfer's ids, so the memo stays small. Safe when threads plan on one layout: a value read
        is never evicted under the reader, and two threads making the same value make equal values."""
        value = self.memo.get(key, _MISSING)
        if value is _MISSING:
            value = self.memo[key] = make()
        return value  # type: ignore[return-value]

    def linked_regions(self, direction: Direction, top_src: int, top_dst: int) -> np.ndarray:
        """Mask of regions whose ranges might merge with another region's: same buffers on both sides and
        extents (up to the transfer's largest page ids) touching on both sides.

        Each pair of regions sharing both buffers touches once the largest ids reach a pair of thresholds, made
        once per layout (``link_thresholds``); a transfer compares its ids with them."""
        a, b, need_s, need_d = self.link_thresholds(direction)
        mask = np.zeros(self.nregions, dtype=bool)
        if len(a):
            hit = (need_s <= top_src) & (need_d <= top_dst)
            mask[a[hit]] = True
            mask[b[hit]] = True
        return mask

    def link_thresholds(self, direction: Direction) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Pairs (a, b) of regions sharing their source and their destination buffer, with the smallest largest
        source and destination page ids at which their extents touch on both sides (made once per direction)."""
        return self.cached(("links", direction.value), lambda: self._link_thresholds(direction))

    def _link_thresholds(self, direction: Direction) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        S, D = self.side[direction.src_side], self.side[direction.dst_side]
        key = S.buf.astype(np.int64) * (len(self.buffers) + 1) + D.buf
        o = np.argsort(key, kind="stable")
        k = key[o]
        cut = np.flatnonzero(np.concatenate(([True], k[1:] != k[:-1], [True])))
        pairs = [np.stack(np.triu_indices(hi - lo, 1)) + lo for lo, hi in zip(cut[:-1].tolist(), cut[1:].tolist())
                 if hi - lo > 1]
        if not pairs:
            empty = np.zeros(0, dtype=np.int64)
            return empty, empty, empty, empty
        ab = o[np.concatenate(pairs, axis=1)]
        a, b = ab[0], ab[1]
        need = []
        for side, col in ((direction.src_side, S), (direction.dst_side, D)):
            # extent of b reaches a's first byte once b's top passes the last page of b ending before it; and back
            ab_ = self.last_page_before(side, b, col.base[a] - 1) + 1
            ba_ = self.last_page_before(side, a, col.base[b] - 1) + 1
            need.append(np.maximum(ab_, ba_))
        return a, b, need[0], need[1]

    def dst_order(self, direction: Direction, top_dst: int,
                  regions_per_call: int | None = None) -> tuple[np.ndarray, bool]:
        """Regions ordered by (call group, destination buffer, base), and whether their destination extents (up
        to page id ``top_dst``) are pairwise disjoint -- then that order, each region in destination order, is
        canonical order and no byte can be written twice by two regions."""
        d = self.side[direction.dst_side]
        order = self.cached(("order", direction.value, regions_per_call), lambda: np.lexsort(
            (d.base, d.buf, self.call_group(regions_per_call))))
        return order, top_dst <= self.disjoint_top(direction)

    def disjoint_top(self, direction: Direction) -> int:
        """The largest destination page id up to which every two regions' destination extents stay apart (-1:
        never; a very large number: always), made once per direction. Regions sorted by (buffer, base) are
        apart when each ends before the next one in its buffer starts."""
        return self.cached(("disjoint", direction.value), lambda: self._disjoint_top(direction))

    def _disjoint_top(self, direction: Direction) -> int:
        d = self.side[direction.dst_side]
        o = np.lexsort((d.base, d.buf))
        b, lo = d.buf[o], d.base[o]
        same = np.flatnonzero(b[1:] == b[:-1])
        if not len(same):
            return int(np.iinfo(np.int64).max)
        return int(self.last_page_before(direction.dst_side, o[same], lo[same + 1]).min())
