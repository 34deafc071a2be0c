"""plan_transfer: layout + block mapping -> TransferPlan, with maximal merging of byte-contiguous copies.

How the work stays proportional to block pairs and output ranges:
1. Runs are found once in block-id space (ids advancing together on both sides), independent of regions.
2. Regions that are dense on both sides (stride == page) turn each id run into one byte range; other
   regions keep one range per pair. Expansion to regions is a numpy broadcast.
3. Ranges of different regions can only merge when the layout lets their byte extents touch on both
   sides within the same buffer pair. Only such regions go through the general (sort-based) merge.
4. When the layout keeps regions' destination extents apart, region order already is canonical order and
   no cross-region overlap is possible, so no global sort or check is needed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .errors import LayoutError, MappingError
from .plan import CopyAttributes, LocationHint, TransferPlan
from .spec import BlockMapping, Direction, Layout, LayoutInfo, Location
from .target import AccessOrder, PlanOptions, Target

Ranges = dict[str, np.ndarray]  # src_buf, src_offset, dst_buf, dst_offset, nbytes, region (int64 while planning)


def plan_transfer(layout: Layout | dict | Any, mapping: BlockMapping | dict | Any, target: Target | dict | None = None,
                  options: PlanOptions | dict | None = None) -> TransferPlan:
    """Plan the copies of ``mapping`` over every region of ``layout``.

    Returns a TransferPlan whose ranges cover exactly the requested bytes with the fewest ranges possible
    (or one range per block copy when ``options.coalesce`` is off), split into calls of at most the
    descriptor cap. Raises LayoutError / MappingError / TargetError (ValueError subclasses) on bad input.
    """
    layout = Layout.coerce(layout, "layout")
    mapping = BlockMapping.coerce(mapping, "mapping")
    target = Target() if target is None else Target.coerce(target, "target")
    options = PlanOptions() if options is None else PlanOptions.coerce(options, "options")
    info = layout.info
    direction = mapping.direction
    src_side, dst_side = info.side[direction.src_side], info.side[direction.dst_side]
    s, d = mapping.src_ids, mapping.dst_ids
    _check_ids(layout, s, src_side, "src_ids", direction.src_side)
    _check_ids(layout, d, dst_side, "dst_ids", direction.dst_side)
    attrs, region_attr = _attributes(layout, direction, target, options)

    if len(s) == 0 or info.nregions == 0:
        ranges = {k: np.zeros(0, dtype=np.int64) for k in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region")}
    else:
        ranges = _ranges(info, direction, s, d, options.coalesce)
        _check_overlaps(layout, direction, ranges, s, d)
    ranges = _split_large(ranges, options.max_range_bytes)
    cap = options.descriptor_cap(target)
    n = len(ranges["nbytes"])
    call_offsets = np.append(np.arange(0, n, cap or max(n, 1), dtype=np.int64), n) if n else np.zeros(1, np.int64)
    ranges["attr"] = region_attr[ranges["region"]]
    return TransferPlan(direction=direction, target=target, options=options, buffers=layout.buffers,
                        regions=tuple(r.name for r in layout.regions), attrs=attrs,
                        requested_copies=len(s) * info.nregions, call_offsets=call_offsets, columns=ranges)


# ---- validation -------------------------------------------------------------------------------------------
def _check_ids(layout: Layout, ids: np.ndarray, side: dict[str, np.ndarray], field: str, side_name: str) -> None:
    """Every id must address a block that fits its buffer in every region."""
    if len(ids) == 0 or len(layout.regions) == 0:
        return
    top = int(ids.max())
    if top <= int(side["max_id"].min()):
        return
    r = int(np.argmax(side["max_id"] < top))
    limit = int(side["max_id"][r])
    i = int(np.argmax(ids > limit))
    region = layout.regions[r]
    buf = layout.buffers[int(side["buf"][r])]
    end = int(side["base"][r]) + int(ids[i]) * int(side["stride"][r]) + region.page_bytes
    raise MappingError(field, int(ids[i]), f"block of region {region.name!r} ({side_name} side) ends at byte {end}, "
                       f"past buffer {buf.name!r} of {buf.nbytes} bytes (last block that fits: {limit})", i)


def _check_overlaps(layout: Layout, direction: Direction, r: Ranges, s: np.ndarray, d: np.ndarray) -> None:
    """No destination byte written twice; no range reading bytes another range writes in the same buffer."""
    db, do, nb = r["dst_buf"], r["dst_offset"], r["nbytes"]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        _explain_dst_overlap(layout, r, int(bad[0]), d)
    info = layout.info
    shared = np.intersect1d(info.side[direction.src_side]["buf"], info.side[direction.dst_side]["buf"])
    for b in shared.tolist():
        sm = r["src_buf"] == b
        ss, se = r["src_offset"][sm], r["src_offset"][sm] + nb[sm]
        dm = np.flatnonzero(db == b)
        if not len(ss) or not len(dm):
            continue
        o = np.argsort(ss, kind="stable")
        ss, se = ss[o], np.maximum.accumulate(se[o])
        k = np.searchsorted(ss, do[dm] + nb[dm], side="left") - 1  # last source range starting before dst end
        hit = (k >= 0) & (se[np.maximum(k, 0)] > do[dm])
        if hit.any():
            j = int(dm[np.argmax(hit)])
            name = layout.buffers[b].name
            raise LayoutError(f"regions[{int(r['region'][j])}].{direction.dst_side}", name,
                              f"destination bytes [{int(do[j])}, {int(do[j] + nb[j])}) of buffer {name!r} overlap "
                              f"source bytes of the same transfer")


def _explain_dst_overlap(layout: Layout, r: Ranges, i: int, d: np.ndarray) -> None:
    """Slow path, only on error: say which ids (or which regions) write the same bytes."""
    ra, rb = int(r["region"][i]), int(r["region"][i + 1])
    if ra == rb:
        first: dict[int, int] = {}
        for j, v in enumerate(d.tolist()):
            if v in first:
                raise MappingError("dst_ids", v, f"destination block is written twice (also dst_ids[{first[v]}])", j)
            first[v] = j
    name = layout.buffers[int(r["dst_buf"][i])].name
    na, nb_ = layout.regions[ra].name, layout.regions[rb].name
    raise LayoutError(f"regions[{rb}]", nb_, f"writes bytes at offset {int(r['dst_offset'][i + 1])} of buffer {name!r} "
                      f"that region {na!r} also writes")


# ---- attributes -------------------------------------------------------------------------------------------
def _attributes(layout: Layout, direction: Direction, target: Target,
                options: PlanOptions) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    """The attribute table and each region's entry in it (location hints follow the region's buffers)."""
    order = AccessOrder.ANY if direction is Direction.H2D else AccessOrder.STREAM
    flags = target.flags(options.prefer_overlap_with_compute)
    table: dict[CopyAttributes, int] = {}
    idx = np.zeros(max(len(layout.regions), 1), dtype=np.int64)
    for i, reg in enumerate(layout.regions):
        hints = []
        for side in (direction.src_side, direction.dst_side):
            b = layout.buffers[layout.buffer_index(getattr(reg, side).buffer)]
            hints.append(LocationHint(location=b.location, id=b.device if b.location is Location.DEVICE else 0))
        a = CopyAttributes(src_access_order=order, src_location=hints[0], dst_location=hints[1], flags=flags)
        idx[i] = table.setdefault(a, len(table))
    return tuple(table), idx


# ---- merging ----------------------------------------------------------------------------------------------
def _id_runs(s: np.ndarray, d: np.ndarray, coalesce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs (src id, dst id, length) where both ids advance by one, sorted by dst id.

    Sorting by (dst - src, dst) puts every run's members next to each other whatever the input order;
    ascending and descending inputs are recognised in O(n) and not sorted.
    """
    n = len(s)
    if not coalesce:
        o = _order_by(d)
        return s[o], d[o], np.ones(n, dtype=np.int64)
    diag = d - s
    same = diag[1:] == diag[:-1]
    if np.all((diag[1:] > diag[:-1]) | (same & (d[1:] >= d[:-1]))):
        o = None
    elif np.all((diag[1:] < diag[:-1]) | (same & (d[1:] <= d[:-1]))):
        o = slice(None, None, -1)
    else:
        o = np.lexsort((d, diag))
    if o is not None:
        s, d, diag = s[o], d[o], diag[o]
    brk = (diag[1:] != diag[:-1]) | (d[1:] != d[:-1] + 1)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    length = np.diff(np.append(starts, n))
    rs, rd = s[starts], d[starts]
    o = _order_by(rd)
    return rs[o], rd[o], length[o]


def _order_by(x: np.ndarray) -> slice | np.ndarray:
    if len(x) < 2 or np.all(x[1:] >= x[:-1]):
        return slice(None)
    return np.argsort(x, kind="stable")


def _expand(info: LayoutInfo, direction: Direction, regs: np.ndarray, rs: np.ndarray, rd: np.ndarray,
            rl: np.ndarray) -> Ranges:
    """Every id run in every region of ``regs`` as a byte range, region-major."""
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    k = len(rs)
    so = np.multiply.outer(S["stride"][regs], rs)
    so += S["base"][regs][:, None]
    do = np.multiply.outer(D["stride"][regs], rd)
    do += D["base"][regs][:, None]
    return {"src_buf": np.repeat(S["buf"][regs].astype(np.int64), k), "src_offset": so.ravel(),
            "dst_buf": np.repeat(D["buf"][regs].astype(np.int64), k), "dst_offset": do.ravel(),
            "nbytes": np.multiply.outer(info.page[regs], rl).ravel(), "region": np.repeat(regs.astype(np.int64), k)}


def _ranges(info: LayoutInfo, direction: Direction, s: np.ndarray, d: np.ndarray, coalesce: bool) -> Ranges:
    order, disjoint = info.dst_order(direction)
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    dense = (S["dense"] & D["dense"])[order]
    runs = _id_runs(s, d, coalesce) if coalesce and dense.any() else None
    singles = _id_runs(s, d, False) if not (coalesce and dense.all()) else None
    if runs is not None and singles is None:
        r = _expand(info, direction, order, *runs)
    elif runs is None:
        r = _expand(info, direction, order, *singles)
    else:  # mixed: regions keep their destination order
        parts = [_expand(info, direction, order[i:i + 1], *(runs if dense[i] else singles)) for i in range(len(order))]
        r = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
    linked = info.linked_regions(direction) if coalesce else None
    if linked is not None and linked.any():
        m = linked[r["region"]]
        merged = _merge(_take(r, m))
        r = {k: np.concatenate((r[k][~m], merged[k])) for k in r}
        disjoint = False
    if not disjoint:
        db, do = r["dst_buf"], r["dst_offset"]
        if not np.all((db[1:] > db[:-1]) | ((db[1:] == db[:-1]) & (do[1:] >= do[:-1]))):
            r = _take(r, np.lexsort((do, db)))
    return r


def _take(r: Ranges, sel: Any) -> Ranges:
    return {k: v[sel] for k, v in r.items()}


def _merge(r: Ranges) -> Ranges:
    """General maximal merge of byte ranges: same buffers, contiguous on both sides.

    Two ranges chain only if they share (src buffer, dst buffer, dst - src); within that class the
    destinations are disjoint, so each range has at most one successor and sorting by destination
    offset finds every chain. Region of a merged range = region of its first byte.
    """
    if len(r["nbytes"]) < 2:
        return r
    diag = r["dst_offset"] - r["src_offset"]
    o = np.lexsort((r["dst_offset"], diag, r["dst_buf"], r["src_buf"]))
    r = _take(r, o)
    diag = diag[o]
    do, nb = r["dst_offset"], r["nbytes"]
    link = ((r["src_buf"][1:] == r["src_buf"][:-1]) & (r["dst_buf"][1:] == r["dst_buf"][:-1])
            & (diag[1:] == diag[:-1]) & (do[:-1] + nb[:-1] == do[1:]))
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    out = _take(r, starts)
    out["nbytes"] = np.add.reduceat(nb, starts)
    return out


def _split_large(r: Ranges, cap: int | None) -> Ranges:
    """Cut ranges longer than ``cap`` bytes into cap-sized pieces plus a remainder, in place order."""
    if cap is None or len(r["nbytes"]) == 0 or int(r["nbytes"].max()) <= cap:
        return r
    pieces = -(-r["nbytes"] // cap)
    idx = np.repeat(np.arange(len(pieces)), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(len(idx)) - first[idx]
    out = _take(r, idx)
    out["src_offset"] = out["src_offset"] + k * cap
    out["dst_offset"] = out["dst_offset"] + k * cap
    out["nbytes"] = np.minimum(r["nbytes"][idx] - k * cap, cap)
    return out
