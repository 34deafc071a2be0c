"""The per-copy reference: every requested piece of a transfer, expanded from the layout model's spec.

This module reads the layout and the mapping as values and walks them in plain code. It never calls the
planner, so a planner bug cannot hide in its own expected result. The model it implements:

* Direction: a load (``h2d``) reads the host placement and writes the device placement; a store (``d2h``)
  the other way round.
* KV-cache groups: ``group_sizes[g]`` pages of group ``g``, starting at logical page ``group_starts[g]``
  (default one group holding every id, starting at 0). Groups consume consecutive slices of each id list.
* Blocks per chunk: with ``blocks_per_chunk`` k on a side, that side's ids are chunk ids. The group's pages
  there are ``flatten([c*k + j for j in range(k)] for c in chunks)[skip : skip + count]`` with
  ``skip = start % k``, computed per group and per side; the group consumes ``ceil((skip + count) / k)`` ids.
* Offsets: page p of a region on a side sits at
  ``byte_offset + (p // k) * stride + (p % k) * side_page`` (stride defaults to ``k * side_page``).
* Fragments: each piece i of a fragment run is ``fragment_bytes`` at ``local_offset + i*local_stride`` in the
  device page and ``canonical_offset + i*canonical_stride`` in the host page. No fragments: the whole page.
* Writer rotation: on a store only pages whose canonical (host) page id satisfies
  ``page % num_writers == writer_index`` are written; a region's own setting wins over the plan options,
  and ``num_writers == 1`` writes every page. Loads read everything.
* Regions that alias each other simply yield their copies twice (the bytes written are the same).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # the planner's value types, imported where a function needs them (see kvxfer.testing)
    from kvxfer.planner import BlockMapping, Layout, PlanOptions, Region


class OracleError(ValueError):
    """The layout and mapping do not describe a transfer the spec can expand (names the field and value)."""


@dataclass(frozen=True)
class Copies:
    """Expected copies as columns, one row per piece: ``buffers[src_buf[i]][src_offset[i]:+nbytes[i]]`` goes to
    ``buffers[dst_buf[i]][dst_offset[i]:+nbytes[i]]``. ``region[i]`` is the index of the region it belongs to.

    ``buffers`` are the layout's buffer names; the index columns point into it. Iterating yields
    ``(src name, src offset, dst name, dst offset, nbytes)`` tuples.
    """

    buffers: tuple[str, ...]
    src_buf: np.ndarray
    src_offset: np.ndarray
    dst_buf: np.ndarray
    dst_offset: np.ndarray
    nbytes: np.ndarray
    region: np.ndarray

    def __len__(self) -> int:
        return len(self.nbytes)

    def __iter__(self) -> Iterator[tuple[str, int, str, int, int]]:
        names = self.buffers
        for sb, so, db, do, n in zip(self.src_buf.tolist(), self.src_offset.tolist(), self.dst_buf.tolist(),
                                     self.dst_offset.tolist(), self.nbytes.tolist()):
            yield names[sb], so, names[db], do, n

    @property
    def total_bytes(self) -> int:
        """Bytes copied, counting every piece (aliased regions count twice)."""
        return int(self.nbytes.sum())


def _group_count(layout: Layout) -> int:
    declared = getattr(layout, "num_groups", None)
    if declared is not None:
        return int(declared)
    return max((r.group for r in layout.regions), default=0) + 1


def _side_k(layout: Layout, regions: Sequence[Region], side: str, group: int) -> int:
    """Blocks per chunk on ``side`` for one group: its regions must agree. A group with no regions takes the
    value every region of the layout agrees on (one chunk size per engine, as in vLLM); 1 without regions."""
    ks = {getattr(r, side).blocks_per_chunk for r in regions or layout.regions}
    if len(ks) > 1:
        whose = "its regions" if regions else "it has no regions and the layout's regions"
        raise OracleError(f"group {group} {side}.blocks_per_chunk: {whose} disagree ({sorted(ks)})")
    return ks.pop() if ks else 1


def _group_pages(ids: list[int], used: int, count: int, start: int, k: int, field: str, group: int) -> tuple[list[int], int]:
    """The group's page ids on one side, and how many ids the group consumed."""
    skip = start % k
    need = -(-(skip + count) // k) if count else 0
    if used + need > len(ids):
        raise OracleError(f"{field}: group {group} needs ids [{used}:{used + need}], the list has {len(ids)}")
    flat = [c * k + j for c in ids[used:used + need] for j in range(k)]
    return flat[skip:skip + count], need


def _page_offset(region: Region, side: str, page: np.ndarray) -> np.ndarray:
    p = getattr(region, side)
    size = region.page_bytes if side == "device" else (region.host_page_bytes or region.page_bytes)
    k = p.blocks_per_chunk
    stride = p.stride_bytes if p.stride_bytes is not None else size * k
    offset: np.ndarray = p.byte_offset + (page // k) * stride + (page % k) * size
    return offset


def _pieces(region: Region) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(device offsets, host offsets, sizes) of the pieces of one page."""
    if not region.fragments:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([region.page_bytes], np.int64)
    local, canon, size = [], [], []
    for f in region.fragments:
        for i in range(f.count):
            local.append(f.local_offset + i * f.local_stride)
            canon.append(f.canonical_offset + i * f.canonical_stride)
            size.append(f.fragment_bytes)
    return np.array(local, np.int64), np.array(canon, np.int64), np.array(size, np.int64)


def _writers(region: Region, options: PlanOptions) -> tuple[int, int]:
    n = getattr(region, "num_writers", None)
    i = getattr(region, "writer_index", None)
    return (options.num_writers if n is None else n), (options.writer_index if i is None else i)


def expected_copies(layout: Layout, mapping: BlockMapping, options: PlanOptions | None = None) -> Copies:
    """Every piece the transfer must copy, in region order then pair order, expanded from the spec.

    ``options`` matters only through writer rotation (``num_writers``/``writer_index``); merging, caps and
    call boundaries do not change which bytes move. Raises OracleError (a ValueError) when the group sizes
    do not match the layout's groups or the id lists are not consumed exactly.
    """
    from kvxfer.planner import PlanOptions

    options = options or PlanOptions()
    store = mapping.direction.value == "d2h"
    sides = ("device", "host") if store else ("host", "device")
    pages_of = _pages_by_group(layout, mapping, sides)
    names = tuple(b.name for b in layout.buffers)
    index = {n: i for i, n in enumerate(names)}
    per_region = [_region_copies(region, r, *pages_of[region.group], sides, store, options, index)
                  for r, region in enumerate(layout.regions)]
    out = {c: np.concatenate([p[c] for p in per_region]) if per_region else np.zeros(0, np.int64) for c in _COLUMNS}
    for v in out.values():
        v.flags.writeable = False
    return Copies(buffers=names, **out)


_COLUMNS = ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region")


def _pages_by_group(layout: Layout, mapping: BlockMapping, sides: tuple[str, str]) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Per KV-cache group: its (source pages, destination pages), each group consuming its slice of both id
    lists (chunks of k blocks entered at ``start % k``). Raises OracleError when the group sizes do not match
    the layout's groups or the lists are not consumed exactly."""
    ngroups = _group_count(layout)
    sizes = list(mapping.group_sizes) if mapping.group_sizes is not None else [len(mapping.src_ids)]
    starts = list(mapping.group_starts) if mapping.group_starts is not None else [0] * len(sizes)
    if len(sizes) != ngroups:
        raise OracleError(f"group_sizes: {len(sizes)} groups given, the layout has {ngroups}")
    ids = {"src": mapping.src_ids.tolist(), "dst": mapping.dst_ids.tolist()}
    used = {"src": 0, "dst": 0}
    pages_of: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    for g, (count, start) in enumerate(zip(sizes, starts)):
        regions = [r for r in layout.regions if r.group == g]
        pages = {}
        for key, side in zip(("src", "dst"), sides):
            k = _side_k(layout, regions, side, g) if count or regions else 1  # no ids: no chunk size needed
            pages[key], need = _group_pages(ids[key], used[key], count, start, k, f"{key}_ids", g)
            used[key] += need
        pages_of[g] = np.array(pages["src"], np.int64), np.array(pages["dst"], np.int64)
    for key in ("src", "dst"):
        if used[key] != len(ids[key]):
            raise OracleError(f"{key}_ids: the groups consume {used[key]} ids, the list has {len(ids[key])}")
    return pages_of


def _region_copies(region: Region, r: int, sp: np.ndarray, dp: np.ndarray, sides: tuple[str, str], store: bool,
                   options: PlanOptions, index: dict[str, int]) -> dict[str, np.ndarray]:
    """The pieces region ``r`` copies for page pairs ``sp`` -> ``dp`` (a store keeps this rank's writer share
    of the canonical pages), page-major, as the oracle's columns."""
    src_side, dst_side = sides
    writers, windex = _writers(region, options)
    if store and writers > 1:
        keep = dp % writers == windex  # the host (canonical) page decides who writes it
        sp, dp = sp[keep], dp[keep]
    local, canon, size = _pieces(region)
    s_piece, d_piece = (local, canon) if store else (canon, local)
    so = _page_offset(region, src_side, sp)[:, None] + s_piece[None, :]
    do = _page_offset(region, dst_side, dp)[:, None] + d_piece[None, :]
    n = so.size
    return {"src_buf": np.full(n, index[getattr(region, src_side).buffer], np.int64), "src_offset": so.ravel(),
            "dst_buf": np.full(n, index[getattr(region, dst_side).buffer], np.int64), "dst_offset": do.ravel(),
            "nbytes": np.broadcast_to(size, so.shape).ravel(), "region": np.full(n, r, np.int64)}


def _as_copies(copies: Copies | Iterable[tuple[str, int, str, int, int]]) -> Copies:
    if isinstance(copies, Copies):
        return copies
    rows = list(copies)
    names = tuple(dict.fromkeys([r[0] for r in rows] + [r[2] for r in rows]))
    index = {n: i for i, n in enumerate(names)}
    col = [np.array([r[j] for r in rows], np.int64) for j in (1, 3, 4)]
    return Copies(buffers=names, src_buf=np.array([index[r[0]] for r in rows], np.int64), src_offset=col[0],
                  dst_buf=np.array([index[r[2]] for r in rows], np.int64), dst_offset=col[1], nbytes=col[2],
                  region=np.zeros(len(rows), np.int64))


def independent(copies: Copies) -> bool:
    """True when no destination byte is written twice and no piece reads a byte that any piece writes (itself
    included): then the order of the pieces cannot change the result. The planner refuses any other transfer,
    except aliased regions (the same copies listed twice), which this check counts as dependent."""
    c = copies
    for b in np.unique(c.dst_buf).tolist():
        w = c.dst_buf == b
        o = np.argsort(c.dst_offset[w], kind="stable")
        start, end = c.dst_offset[w][o], (c.dst_offset[w] + c.nbytes[w])[o]
        if np.any(start[1:] < end[:-1]):
            return False
        r = c.src_buf == b
        s0, s1 = c.src_offset[r], c.src_offset[r] + c.nbytes[r]
        j = np.searchsorted(start, s1, side="left") - 1  # the last write starting before each read ends
        if np.any((j >= 0) & (end[np.maximum(j, 0)] > s0)):
            return False
    return True


def apply_copies(copies: Copies | Iterable[tuple[str, int, str, int, int]], buffers: Mapping[str, np.ndarray]) -> None:
    """Apply ``copies`` in order to ``buffers`` ({name: 1-D uint8 array}), each piece as a memmove: the piece's
    source bytes are read in full before its destination is written, so a piece may overlap itself.

    Raises OracleError, before writing anything, when a piece runs past its buffer. When the pieces are
    independent (see ``independent``) they are applied as one byte gather per buffer pair, which gives the
    same bytes as the loop.
    """
    c = _as_copies(copies)
    size = np.array([len(buffers[n]) for n in c.buffers] or [0], np.int64)
    for side in ("src", "dst"):
        buf, off = getattr(c, f"{side}_buf"), getattr(c, f"{side}_offset")
        bad = np.flatnonzero((off < 0) | (off + c.nbytes > size[buf]))
        if bad.size:
            i = int(bad[0])
            raise OracleError(f"copies[{i}]: {side} {c.buffers[int(buf[i])]}[{int(off[i])}:+{int(c.nbytes[i])}] "
                              f"runs past the buffer of {int(size[buf[i]])} bytes")
    if not independent(c):
        for sb, so, db, do, n in c:
            buffers[db][do:do + n] = buffers[sb][so:so + n].copy()
        return
    large = c.nbytes >= 512  # a slice per large piece, one byte gather per buffer pair for the small ones
    for i in np.flatnonzero(large).tolist():
        so, do, n = int(c.src_offset[i]), int(c.dst_offset[i]), int(c.nbytes[i])
        buffers[c.buffers[int(c.dst_buf[i])]][do:do + n] = buffers[c.buffers[int(c.src_buf[i])]][so:so + n]
    small = np.flatnonzero(~large)
    pairs = np.unique(np.stack([c.src_buf[small], c.dst_buf[small]], axis=1), axis=0).tolist() if small.size else []
    for sb, db in pairs:
        sel = small[(c.src_buf[small] == sb) & (c.dst_buf[small] == db)]
        for part in np.array_split(sel, max(1, int(c.nbytes[sel].sum()) // (1 << 22))):  # bounded index arrays
            n = c.nbytes[part]
            within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
            src = buffers[c.buffers[sb]]
            buffers[c.buffers[db]][np.repeat(c.dst_offset[part], n) + within] = src[np.repeat(c.src_offset[part], n) + within]


def random_buffers(layout: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """One array of random bytes per buffer of ``layout`` (anything with ``.buffers``: a Layout or a plan).
    The random bytes are both the source data and the sentinels that show an untouched destination byte."""
    rng = np.random.default_rng(seed)
    return {b.name: np.frombuffer(rng.bytes(b.nbytes), dtype=np.uint8).copy() for b in layout.buffers}


def run_reference(layout: Layout, mapping: BlockMapping, buffers: Mapping[str, np.ndarray],
                  options: PlanOptions | None = None) -> dict[str, np.ndarray]:
    """What ``buffers`` hold after the transfer: copies of them with ``expected_copies`` applied (the inputs
    stay unchanged)."""
    out = {k: np.array(v, dtype=np.uint8, copy=True) for k, v in buffers.items()}
    apply_copies(expected_copies(layout, mapping, options), out)
    return out


def min_ranges(copies: Copies) -> int:
    """The fewest byte ranges that perform ``copies``: destination bytes (deduplicated) that do not continue
    the previous destination byte's range (same buffers, source and destination both one byte further)."""
    if not len(copies):
        return 0
    n = copies.nbytes.astype(np.int64)
    piece = np.repeat(np.arange(len(n)), n)
    within = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
    db, dx = copies.dst_buf[piece], copies.dst_offset[piece] + within
    sb, sx = copies.src_buf[piece], copies.src_offset[piece] + within
    o = np.lexsort((sx, sb, dx, db))
    db, dx, sb, sx = db[o], dx[o], sb[o], sx[o]
    first = np.concatenate(([True], (db[1:] != db[:-1]) | (dx[1:] != dx[:-1])))
    db, dx, sb, sx = db[first], dx[first], sb[first], sx[first]
    cont = (db[1:] == db[:-1]) & (dx[1:] == dx[:-1] + 1) & (sb[1:] == sb[:-1]) & (sx[1:] == sx[:-1] + 1)
    return int(len(dx) - cont.sum())


def _first_difference(got: np.ndarray, want: np.ndarray) -> str:
    bad = np.flatnonzero(got != want)
    i = int(bad[0])
    return f"{bad.size} bytes differ, first at offset {i} (got {int(got[i])}, want {int(want[i])})"


def assert_buffers_equal(got: Mapping[str, np.ndarray], want: Mapping[str, np.ndarray]) -> None:
    """Every buffer byte for byte; raises AssertionError naming the buffer and the first differing offset."""
    if set(got) != set(want):
        raise AssertionError(f"buffer names differ: {sorted(got)} vs {sorted(want)}")
    for name in want:
        g, w = np.asarray(got[name]).reshape(-1).view(np.uint8), np.asarray(want[name]).reshape(-1).view(np.uint8)
        if g.shape != w.shape:
            raise AssertionError(f"buffer {name!r}: {g.size} bytes, want {w.size}")
        if not np.array_equal(g, w):
            raise AssertionError(f"buffer {name!r}: {_first_difference(g, w)}")


def assert_plan_matches(plan: Any, layout: Layout, mapping: BlockMapping, options: PlanOptions | None = None,
                        seed: int = 0) -> None:
    """Run ``plan`` with the NumPy executor on random buffers and compare every byte, including the bytes
    nobody asked for (the random bytes are sentinels), with ``run_reference``. ``options`` defaults to the
    plan's own. Raises AssertionError naming the buffer and the first differing offset."""
    from kvxfer.executors import NumpyExecutor

    before = random_buffers(layout, seed)
    want = run_reference(layout, mapping, before, plan.options if options is None else options)
    got = {k: v.copy() for k, v in before.items()}
    NumpyExecutor().run(plan, got)
    assert_buffers_equal(got, want)
