"""The full KV layout model: sub-block chunks, KV-cache groups, canonical fragments, writer rotation and
layer-wise call boundaries.

Every requested piece is expanded to an elementary copy (one page, or one fragment of a page), then the
general merge joins byte-contiguous neighbours. Cost grows with the elementary copies and output ranges.
"""
from __future__ import annotations

import numpy as np

from .coalesce import Ranges, _dense_all, _id_runs, _merge, _split_large, _take, check_reads_vs_writes, chunk_calls
from .errors import LayoutError, MappingError
from .plan import Runs, dense
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
    col = info.side[side]
    # the last chunk whose first page fits, per region: bounding ids here keeps every later product in int64
    limit = (col["cap"][regs] - col["base"][regs] - col["page"][regs]) // col["stride"][regs]
    if len(chunks) and int(chunks.max()) > int(limit.min()):
        r = int(regs[np.argmin(limit)])
        i = used + int(np.argmax(chunks > limit.min()))
        buf = layout.buffers[int(col["buf"][r])]
        raise MappingError(field, int(ids[i]), f"chunk of region {layout.regions[r].name!r} ({side} side) starts past "
                           f"buffer {buf.name!r} of {buf.nbytes} bytes (last chunk that fits: {int(limit.min())})", i)
    pages = (chunks[:, None] * k + np.arange(k)).ravel()[skip:skip + count]
    index = used + (np.arange(count) + skip) // k
    return pages, index, used + need


def _offsets(info: LayoutInfo, side: str, r: int, pages: np.ndarray) -> np.ndarray:
    col = info.side[side]
    k = int(col["k"][r])
    if k == 1:
        return col["base"][r] + pages * col["stride"][r]
    return col["base"][r] + (pages // k) * col["stride"][r] + (pages % k) * col["page"][r]


def _check_fit(layout: Layout, info: LayoutInfo, side: str, r: int, pages: np.ndarray, index: np.ndarray,
               ids: np.ndarray, field: str) -> None:
    """Every page must end inside its buffer. Offsets grow with the page id, so the largest page decides."""
    col = info.side[side]
    page, cap = int(col["page"][r]), int(col["cap"][r])
    off = _offsets(info, side, r, pages)
    if not np.any(off + page > cap):
        return
    i = int(index[np.argmax(off + page > cap)])
    end = int(off[np.argmax(off + page > cap)]) + page
    buf = layout.buffers[int(col["buf"][r])]
    raise MappingError(field, int(ids[i]), f"block of region {layout.regions[r].name!r} ({side} side) ends at byte "
                       f"{end}, past buffer {buf.name!r} of {buf.nbytes} bytes", i)


def _fragment_table(layout: Layout, r: int, direction: Direction) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(src piece offsets, dst piece offsets, piece sizes) within a page; loads read canonical, write local."""
    reg = layout.regions[r]
    if not reg.fragments:
        return np.zeros(1, np.int64), np.zeros(1, np.int64), np.array([reg.page_bytes], np.int64)
    local = np.concatenate([f.local_offset + np.arange(f.count) * f.local_stride for f in reg.fragments])
    canon = np.concatenate([f.canonical_offset + np.arange(f.count) * f.canonical_stride for f in reg.fragments])
    size = np.concatenate([np.full(f.count, f.fragment_bytes) for f in reg.fragments]).astype(np.int64)
    return (canon, local, size) if direction is Direction.H2D else (local, canon, size)


PAGE, PIECES, GENERAL = 0, 1, 2  # how a region's pages become ranges (see _region_kinds)


def _region_kinds(layout: Layout, direction: Direction, coalesce: bool) -> tuple[np.ndarray, list]:
    """Per region: its kind and its fragment table (src piece offsets, dst piece offsets, sizes, in dst order).

    PAGE: whole pages, offsets linear in the page id -- id runs give the ranges, as for plain layouts.
    PIECES: real fragments whose table cannot join across pages -- pages x pieces are the ranges.
    GENERAL: anything else (padded chunk rows, pieces that chain across pages) -- expanded, then merged.
    With ``coalesce`` the table's touching pieces are merged first; without it every declared piece stays.
    Depends on the layout alone, so it is computed once per layout, direction and coalesce flag.
    """
    return layout.info.cached(("kinds", direction.value, coalesce), lambda: _classify(layout, direction, coalesce))


def _classify(layout: Layout, direction: Direction, coalesce: bool) -> tuple[np.ndarray, list]:
    info = layout.info
    kinds = np.zeros(info.nregions, dtype=np.int64)
    tables = []
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    for r in range(info.nregions):
        fs, fd, fb = _fragment_table(layout, r, direction)
        if coalesce:
            t = _merge({"src_buf": np.zeros(len(fb), np.int32), "dst_buf": np.zeros(len(fb), np.int32),
                        "src_offset": fs, "dst_offset": fd, "nbytes": fb, "region": np.zeros(len(fb), np.int32)})
            fs, fd, fb = t["src_offset"], t["dst_offset"], t["nbytes"]
        o = np.argsort(fd, kind="stable")
        fs, fd, fb = fs[o], fd[o], fb[o]
        tables.append((fs, fd, fb))
        linear = all(int(c["k"][r]) == 1 or bool(c["dense"][r]) for c in (S, D))
        pages_chain = bool(coalesce and S["dense"][r] and D["dense"][r])
        ps, pd = int(S["page"][r]), int(D["page"][r])
        whole = len(fb) == 1 and fs[0] == 0 and fd[0] == 0 and fb[0] == ps == pd
        if linear and whole:
            kinds[r] = PAGE
        elif linear and not (pages_chain and bool(np.isin(fs + fb - ps, fs).any() and np.isin(fd + fb - pd, fd).any())):
            kinds[r] = PIECES
        else:
            kinds[r] = GENERAL
    return kinds, tables


def _linear_stride(info: LayoutInfo, side: str, regs: np.ndarray) -> np.ndarray:
    col = info.side[side]
    return np.where(col["k"][regs] == 1, col["stride"][regs], col["page"][regs])


def _page_ranges(info: LayoutInfo, direction: Direction, regs: np.ndarray, sp: np.ndarray, dp: np.ndarray,
                 coalesce: bool) -> list[Ranges]:
    """PAGE regions: runs of page ids advancing together on both sides, one broadcast per run set."""
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    dense = S["dense"][regs] & D["dense"][regs]
    out = []
    for sel, merge in ((regs[dense], coalesce), (regs[~dense], False)):
        if not len(sel):
            continue
        rs, rd, rl = _id_runs(sp, dp, merge)
        so = S["base"][sel][:, None] + np.multiply.outer(_linear_stride(info, direction.src_side, sel), rs)
        do = D["base"][sel][:, None] + np.multiply.outer(_linear_stride(info, direction.dst_side, sel), rd)
        k = len(rs)
        out.append({"src_buf": np.repeat(S["buf"][sel], k), "src_offset": so.ravel(), "dst_buf": np.repeat(D["buf"][sel], k),
                    "dst_offset": do.ravel(), "nbytes": np.multiply.outer(S["page"][sel], rl).ravel(),
                    "region": np.repeat(sel.astype(np.int32), k)})
    return out


def _by_region(r: Ranges) -> dict[int, Ranges]:
    """Split region-major ranges into one slice (a view) per region."""
    reg = r["region"]
    cut = np.flatnonzero(np.concatenate(([True], reg[1:] != reg[:-1], [True])))
    return {int(reg[a]): {k: v[a:b] for k, v in r.items()} for a, b in zip(cut[:-1].tolist(), cut[1:].tolist())}


class _Pieces:
    """Pages x pieces of one region, written straight into the plan's columns when they are assembled."""

    def __init__(self, info: LayoutInfo, direction: Direction, r: int, sp: np.ndarray, dp: np.ndarray,
                 table: tuple[np.ndarray, np.ndarray, np.ndarray]):
        o = np.argsort(dp, kind="stable")  # pages in destination order; pieces are in destination order already
        self.so = _offsets(info, direction.src_side, r, sp[o])
        self.do = _offsets(info, direction.dst_side, r, dp[o])
        self.table = table

    def __len__(self) -> int:
        return len(self.so) * len(self.table[2])

    def fill(self, so: np.ndarray, do: np.ndarray, nb: np.ndarray) -> None:
        fs, fd, fb = self.table
        shape = (len(self.so), len(fb))
        np.add(self.so[:, None], fs, out=so.reshape(shape))
        np.add(self.do[:, None], fd, out=do.reshape(shape))
        nb.reshape(shape)[:] = fb


def _assemble(info: LayoutInfo, direction: Direction, parts: list[tuple[int, Ranges | _Pieces]]) -> Ranges:
    """One set of columns from per-region parts, in the given order; buffer and region columns as runs."""
    lengths = np.array([len(p["nbytes"]) if isinstance(p, dict) else len(p) for _, p in parts], dtype=np.int64)
    total = int(lengths.sum())
    so, do, nb = (np.empty(total, dtype=np.int64) for _ in range(3))
    at = 0
    for (_, p), n in zip(parts, lengths.tolist()):
        if isinstance(p, dict):
            so[at:at + n], do[at:at + n], nb[at:at + n] = p["src_offset"], p["dst_offset"], p["nbytes"]
        else:
            p.fill(so[at:at + n], do[at:at + n], nb[at:at + n])
        at += n
    regs = np.array([r for r, _ in parts], dtype=np.int32)
    return {"src_buf": Runs(info.side[direction.src_side]["buf"][regs], lengths), "src_offset": so,
            "dst_buf": Runs(info.side[direction.dst_side]["buf"][regs], lengths), "dst_offset": do,
            "nbytes": nb, "region": Runs(regs, lengths)}


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
    cgroup_of = (np.arange(info.nregions) // options.regions_per_call if options.regions_per_call
                 else np.zeros(info.nregions, np.int64))
    kinds, tables = _region_kinds(layout, direction, options.coalesce)
    parts: dict[int, Ranges | _Pieces] = {}  # region -> its ranges
    repeated_page = False
    top_s = top_d = 0
    requested = 0
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
        for side, pages, index, ids, field in ((src_side, sp, si, s_ids, "src_ids"), (dst_side, dp, di, d_ids, "dst_ids")):
            if len(pages) and not np.all(info.extent_end(side, int(pages.max()))[regs] <= info.side[side]["cap"][regs]):
                for r in regs.tolist():  # slow path, only on error: name the region and the id
                    _check_fit(layout, info, side, r, pages, index, ids, field)
        requested += len(sp) * int(info.pieces[regs].sum())
        if len(sp):
            sd = np.sort(dp)
            repeated_page |= bool(np.any(sd[1:] == sd[:-1]))
            top_s, top_d = max(top_s, int(sp.max())), max(top_d, int(sd[-1]))
            for block in _page_ranges(info, direction, regs[kinds[regs] == PAGE], sp, dp, options.coalesce):
                parts |= _by_region(block)
            parts |= {r: _Pieces(info, direction, r, sp, dp, tables[r]) for r in regs[kinds[regs] != PAGE].tolist()}
    for field, used, ids in (("src_ids", used_s, s_ids), ("dst_ids", used_d, d_ids)):
        if used != len(ids):
            raise MappingError(field, f"length {len(ids)}", f"the groups (sizes {list(sizes)}, starts {list(starts)}) "
                               f"consume {used} ids; the lists must add up exactly")
    order, disjoint = info.dst_order(direction, top_d)
    r = _assemble(info, direction, [(i, parts[i]) for i in order.tolist() if i in parts])
    # Regions in destination order, each in destination order: canonical already when the transfer keeps
    # regions' destinations apart; then only a repeated page could write a byte twice.
    if not (disjoint and not cgroup_of.any() and not info.shared_buffers(direction) and not repeated_page):
        r = _canonical(_dense_all(r), cgroup_of)
        _check_extended_overlaps(layout, direction, r, cgroup_of)
    mergeable = (kinds == GENERAL) | info.linked_regions(direction, top_s, top_d)  # the only regions that can still merge
    if options.coalesce and len(r["nbytes"]) and mergeable.any():
        r = _dense_all(r)
        m = mergeable[r["region"]]
        if m.any():
            merged = _merge(_take(r, m), cgroup_of[r["region"][m]])
            r = _canonical({k: np.concatenate((r[k][~m], merged[k])) for k in r}, cgroup_of)
    r = _split_large(r, options.max_range_bytes)
    if not options.regions_per_call:
        return r, requested, chunk_calls(len(r["nbytes"]), cap)
    return r, requested, _call_offsets(cgroup_of[dense(r["region"])], cap)


def _canonical(r: Ranges, cgroup_of: np.ndarray) -> Ranges:
    """Sort by (call group, destination buffer, destination offset), skipping the sort when already in order."""
    if len(r["nbytes"]) < 2:
        return r
    cg, db, do = cgroup_of[r["region"]], r["dst_buf"], r["dst_offset"]
    up = (cg[1:] > cg[:-1]) | ((cg[1:] == cg[:-1]) & ((db[1:] > db[:-1]) | ((db[1:] == db[:-1]) & (do[1:] >= do[:-1]))))
    return r if up.all() else _take(r, np.lexsort((do, db, cg)))


def _call_offsets(cgroup: np.ndarray, cap: int | None) -> np.ndarray:
    """Calls end where the call group changes and every ``cap`` descriptors within a group."""
    n = len(cgroup)
    if n == 0:
        return chunk_calls(0, cap)
    bounds = np.append(np.flatnonzero(np.concatenate(([True], cgroup[1:] != cgroup[:-1]))), n)
    out = [chunk_calls(b - a, cap)[:-1] + a for a, b in zip(bounds[:-1].tolist(), bounds[1:].tolist())]
    return np.append(np.concatenate(out), n)


def _check_extended_overlaps(layout: Layout, direction: Direction, r: Ranges, cgroup_of: np.ndarray) -> None:
    """No destination byte written twice and no range reading bytes another writes (same buffer).

    ``r`` is in canonical order; with one call group that is destination order, so no sort is needed.
    """
    o = slice(None) if not cgroup_of.any() else np.lexsort((r["dst_offset"], r["dst_buf"]))
    db, do, nb, reg = r["dst_buf"][o], r["dst_offset"][o], r["nbytes"][o], r["region"][o]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        i = int(bad[0])
        a, b = layout.regions[int(reg[i])].name, layout.regions[int(reg[i + 1])].name
        buf = layout.buffers[int(db[i])].name
        what = f"region {a!r} writes them twice" if a == b else f"region {a!r} also writes them"
        raise MappingError("dst_ids", f"{buf}[{int(do[i + 1])}:{int(do[i + 1] + nb[i + 1])}]",
                           f"destination bytes of region {b!r} are written twice: {what}")
    check_reads_vs_writes(layout, direction, r)
