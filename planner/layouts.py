"""The full KV layout model: sub-block chunks, KV-cache groups, canonical fragments, writer rotation and
layer-wise call boundaries.

Every requested piece is expanded to an elementary copy (one page, or one fragment of a page), then the
general merge joins byte-contiguous neighbours. Cost grows with the elementary copies and output ranges.
"""
from __future__ import annotations

import numpy as np

from .coalesce import Ranges, _dense_all, _merge, _split_large, _take
from .errors import LayoutError, MappingError
from .spec import BlockMapping, Direction, Layout, LayoutInfo
from .target import PlanOptions


def group_pages(info: LayoutInfo, regs: np.ndarray, ids: np.ndarray, used: int, count: int, start: int,
                side: str, field: str, group: int, layout: Layout) -> tuple[np.ndarray, np.ndarray, int]:
    """Canonical page ids of one group on one side, the index into ``ids`` each came from, and ids consumed.

    Chunk c with k pages enumerates pages c*k .. c*k+k-1; the group's pages are that flattened list from
    ``start % k`` on, ``count`` long (the first and last chunks may be partial).
    """
    ks = np.unique(info.side[side]["k"][regs])
    if len(ks) > 1:
        r = int(regs[np.argmax(info.side[side]["k"][regs] != ks[0])])
        raise LayoutError(f"regions[{r}].{side}.blocks_per_chunk", int(info.side[side]["k"][r]),
                          f"regions of group {group} must share blocks_per_chunk on the {side} side ({int(ks[0])})")
    k = int(ks[0])
    skip = start % k
    need = -(-(skip + count) // k) if count else 0
    if used + need > len(ids):
        raise MappingError(field, f"length {len(ids)}", f"group {group} (size {count}, start {start}, {k} blocks per "
                           f"chunk) needs {field}[{used}:{used + need}], past the end of the list")
    chunks = ids[used:used + need]
    pages = (chunks[:, None] * k + np.arange(k)).ravel()[skip:skip + count]
    index = used + (np.arange(count) + skip) // k
    return pages, index, used + need


def _offsets(info: LayoutInfo, side: str, r: int, pages: np.ndarray) -> np.ndarray:
    col = info.side[side]
    k = int(col["k"][r])
    return col["base"][r] + (pages // k) * col["stride"][r] + (pages % k) * col["page"][r]


def _check_fit(layout: Layout, info: LayoutInfo, side: str, r: int, off: np.ndarray, index: np.ndarray,
               ids: np.ndarray, field: str) -> None:
    col = info.side[side]
    page, cap = int(col["page"][r]), int(col["cap"][r])
    bad = np.flatnonzero(off + page > cap)
    if bad.size:
        i = int(index[bad[0]])
        buf = layout.buffers[int(col["buf"][r])]
        raise MappingError(field, int(ids[i]), f"block of region {layout.regions[r].name!r} ({side} side) ends at byte "
                           f"{int(off[bad[0]]) + page}, past buffer {buf.name!r} of {buf.nbytes} bytes", i)


def _fragment_table(layout: Layout, r: int, direction: Direction) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src piece offsets, dst piece offsets, piece sizes) within a page; loads read canonical, write local."""
    reg = layout.regions[r]
    if not reg.fragments:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([reg.page_bytes], np.int64)
    local = np.concatenate([f.local_offset + np.arange(f.count) * f.local_stride for f in reg.fragments])
    canon = np.concatenate([f.canonical_offset + np.arange(f.count) * f.canonical_stride for f in reg.fragments])
    size = np.concatenate([np.full(f.count, f.fragment_bytes) for f in reg.fragments]).astype(np.int64)
    return (canon, local, size) if direction is Direction.H2D else (local, canon, size)


def plan_extended(layout: Layout, mapping: BlockMapping, options: PlanOptions,
                  cap: int | None) -> tuple[Ranges, int, np.ndarray]:
    """Ranges (canonical order within each call), the number of elementary copies requested, call offsets."""
    info = layout.info
    direction = mapping.direction
    src_side, dst_side = direction.src_side, direction.dst_side
    s_ids, d_ids = mapping.src_ids, mapping.dst_ids
    sizes = mapping.group_sizes if mapping.group_sizes is not None else (len(s_ids),)
    starts = mapping.group_starts if mapping.group_starts is not None else (0,) * len(sizes)
    if len(sizes) != info.num_groups:
        raise MappingError("group_sizes", list(sizes), f"the layout has {info.num_groups} KV-cache groups")
    region_pos = np.arange(info.nregions)
    cgroup_of = region_pos // options.regions_per_call if options.regions_per_call else np.zeros(info.nregions, np.int64)
    parts: list[Ranges] = []
    used_s = used_d = 0
    for g, (count, start) in enumerate(zip(sizes, starts)):
        regs = np.flatnonzero(info.group == g)
        if not len(regs):
            if count:
                raise MappingError("group_sizes", count, f"group {g} has no regions", g)
            continue
        sp, si, used_s = group_pages(info, regs, s_ids, used_s, count, start, src_side, "src_ids", g, layout)
        dp, di, used_d = group_pages(info, regs, d_ids, used_d, count, start, dst_side, "dst_ids", g, layout)
        if direction is Direction.D2H and options.num_writers > 1:  # replicated data: one writer per canonical page
            keep = dp % options.num_writers == options.writer_index
            sp, si, dp, di = sp[keep], si[keep], dp[keep], di[keep]
        for r in regs.tolist():
            so, do = _offsets(info, src_side, r, sp), _offsets(info, dst_side, r, dp)
            _check_fit(layout, info, src_side, r, so, si, s_ids, "src_ids")
            _check_fit(layout, info, dst_side, r, do, di, d_ids, "dst_ids")
            fs, fd, fb = _fragment_table(layout, r, direction)
            n = len(so) * len(fb)
            parts.append({"src_buf": np.full(n, info.side[src_side]["buf"][r], np.int32),
                          "src_offset": (so[:, None] + fs).ravel(),
                          "dst_buf": np.full(n, info.side[dst_side]["buf"][r], np.int32),
                          "dst_offset": (do[:, None] + fd).ravel(), "nbytes": np.tile(fb, len(so)),
                          "region": np.full(n, r, np.int32)})
    for field, used, ids in (("src_ids", used_s, s_ids), ("dst_ids", used_d, d_ids)):
        if used != len(ids):
            raise MappingError(field, f"length {len(ids)}", f"the groups (sizes {list(sizes)}, starts {list(starts)}) "
                               f"consume {used} ids; the lists must add up exactly")
    if parts:
        r = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    else:
        r = {k: np.zeros(0, np.int64) for k in ("src_offset", "dst_offset", "nbytes")}
        r |= {k: np.zeros(0, np.int32) for k in ("src_buf", "dst_buf", "region")}
    requested = len(r["nbytes"])
    _check_extended_overlaps(layout, direction, r)
    if options.coalesce and requested:
        r = _merge(r, cgroup_of[r["region"]])
    cg = cgroup_of[r["region"]]
    r = _take(r, np.lexsort((r["dst_offset"], r["dst_buf"], cg)))
    r = _split_large(r, options.max_range_bytes)
    return r, requested, _call_offsets(cgroup_of[r["region"]], cap)


def _call_offsets(cgroup: np.ndarray, cap: int | None) -> np.ndarray:
    """Calls end where the call group changes and every ``cap`` descriptors within a group."""
    n = len(cgroup)
    if n == 0:
        return np.zeros(1, np.int64)
    bounds = np.append(np.flatnonzero(np.concatenate(([True], cgroup[1:] != cgroup[:-1]))), n)
    out = [np.arange(a, b, cap or (b - a), dtype=np.int64) for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    return np.append(np.concatenate(out), n)


def _check_extended_overlaps(layout: Layout, direction: Direction, r: Ranges) -> None:
    """No destination byte written twice and no range reading bytes another writes (same buffer)."""
    r = _dense_all(r)
    o = np.lexsort((r["dst_offset"], r["dst_buf"]))
    db, do, nb, reg = r["dst_buf"][o], r["dst_offset"][o], r["nbytes"][o], r["region"][o]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        i = int(bad[0])
        a, b = layout.regions[int(reg[i])].name, layout.regions[int(reg[i + 1])].name
        buf = layout.buffers[int(db[i])].name
        what = f"region {a!r} writes them twice" if a == b else f"region {a!r} also writes them"
        raise MappingError("dst_ids", f"{buf}[{int(do[i + 1])}:{int(do[i + 1] + nb[i + 1])}]",
                           f"destination bytes of region {b!r} are written twice: {what}")
    for b in layout.info.shared_buffers(direction):
        sm, dm = r["src_buf"] == b, r["dst_buf"] == b
        if not sm.any() or not dm.any():
            continue
        ss, se = r["src_offset"][sm], r["src_offset"][sm] + r["nbytes"][sm]
        k = np.argsort(ss, kind="stable")
        ss, se = ss[k], np.maximum.accumulate(se[k])
        dst_o, dst_e = r["dst_offset"][dm], r["dst_offset"][dm] + r["nbytes"][dm]
        j = np.searchsorted(ss, dst_e, side="left") - 1
        hit = (j >= 0) & (se[np.maximum(j, 0)] > dst_o)
        if hit.any():
            name = layout.buffers[b].name
            raise LayoutError("regions", name, f"destination bytes of buffer {name!r} overlap source bytes of the same transfer")
