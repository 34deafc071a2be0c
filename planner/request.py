"""The request: a transfer checked against a layout, as the builder reads it (page sets, the copies requested,
the largest pages). The front end (``checks``) makes it and refuses whatever does not fit; the builder
(``build``) turns it into ranges. Values only: nothing here refuses.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np

from .columns import PageRuns, id_runs, sort_by
from .layout_cache import WriterSet
from .spec import Direction


class IdsAt(NamedTuple):
    """Where a page set's pages come from: its group's first src and dst id, start, size and blocks per chunk
    on each side, and the pages writer rotation kept (None: all)."""

    first_src: int
    first_dst: int
    start: int
    size: int
    k_src: int
    k_dst: int
    keep: np.ndarray | None

    def positions(self, dst: bool) -> np.ndarray:
        """For each page of the set on one side: the index of its id in that side's list."""
        first, k = (self.first_dst, self.k_dst) if dst else (self.first_src, self.k_src)
        pos = first + (np.arange(self.size) + self.start % k) // k
        return pos if self.keep is None else pos[self.keep]


class PageSet:
    """Page pairs of one KV-cache group for one writer set: ``src[i]`` -> ``dst[i]`` in every region of ``ws``;
    ``top_src`` / ``top_dst`` are the largest pages (-1 until ``measure``, or set by the front end). ``ids_at``
    maps the pages back to their ids, for naming one in a refusal (None where the ids are the pages).
    ``runs``: (coalescing flavour, the pairs' runs in it), when the front end made them already."""

    __slots__ = ("ws", "src", "dst", "top_src", "top_dst", "ids_at", "_runs", "_sorted")

    def __init__(self, ws: WriterSet, src: np.ndarray, dst: np.ndarray, ids_at: IdsAt | None = None,
                 runs: tuple[bool, PageRuns] | None = None):
        self.ws, self.src, self.dst, self.ids_at = ws, src, dst, ids_at
        self.top_src = self.top_dst = -1
        self._runs: dict[bool, PageRuns] = {} if runs is None else {runs[0]: runs[1]}
        self._sorted: tuple[np.ndarray, np.ndarray] | None = None

    def runs(self, coalesce: bool) -> PageRuns:
        """The pairs as runs in destination order (joined where both pages advance, unless ``coalesce`` is off)."""
        made = self._runs.get(coalesce)
        if made is None:
            made = self._runs[coalesce] = PageRuns(*id_runs(self.src, self.dst, coalesce), len(self.dst), coalesce)
        return made

    def dst_order(self) -> tuple[np.ndarray, np.ndarray]:
        """(destination pages sorted, the order that sorts them)."""
        if self._sorted is None:
            self._sorted = sort_by(self.dst, np.arange(len(self.dst)))
        return self._sorted

    def measure(self, coalesce: bool) -> None:
        """Set the largest pages, from the runs the builder takes when the set has whole-page regions (the pages
        must be bounded: checked non-negative, their chunks inside the buffers)."""
        ws = self.ws
        if len(ws.page_dense) or len(ws.page_sparse):
            runs = self.runs(coalesce and len(ws.page_dense) > 0)
            if len(runs.rl) == 1:  # one run (a contiguous job): no arrays to make
                n = int(runs.rl[0]) - 1
                self.top_src, self.top_dst = int(runs.rs[0]) + n, int(runs.rd[0]) + n
                return
            last = runs.rl - 1
            self.top_src = int(np.maximum.reduce(runs.rs + last))
            self.top_dst = int(np.maximum.reduce(runs.rd + last))
        else:
            self.top_src, self.top_dst = int(np.maximum.reduce(self.src)), int(np.maximum.reduce(self.dst))

    def repeated(self, coalesce: bool) -> bool:
        """Whether some destination page repeats; found on what the builder will take anyway."""
        ws = self.ws
        if self._runs or len(ws.page_dense) or len(ws.page_sparse):
            made = next(iter(self._runs.values()), None)
            return (made or self.runs(coalesce and len(ws.page_dense) > 0)).repeated
        sd = self.dst_order()[0]
        return len(sd) > 1 and bool((sd[1:] == sd[:-1]).any())


class Request:
    """A transfer checked against a layout: its page sets, the elementary copies requested, the largest pages,
    and ``touch``: whether ranges of two regions could overlap (destinations that can meet, or a buffer both read
    and written), so the built ranges must be sorted and checked for overlaps (``checks.refuse_overlaps``)."""

    __slots__ = ("direction", "sets", "requested", "top_src", "top_dst", "touch")

    def __init__(self, direction: Direction, sets: list[PageSet], requested: int, top_src: int = -1, top_dst: int = -1,
                 touch: bool = False):
        self.direction, self.sets, self.requested = direction, sets, requested
        self.top_src, self.top_dst, self.touch = top_src, top_dst, touch
