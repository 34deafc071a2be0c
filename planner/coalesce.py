"""plan_transfer: layout + block mapping -> TransferPlan, with maximal merging of byte-contiguous copies.

How the work stays proportional to block pairs and output ranges:
1. Runs are found once in block-id space (ids advancing together on both sides), independent of regions.
2. Regions that are dense on both sides (stride == page) turn each id run into one byte range; other
   regions keep one range per pair. Expansion to regions is a numpy broadcast.
3. Ranges of different regions can only merge when their byte extents (up to the transfer's largest ids)
   touch on both sides within the same buffer pair. Only such regions go through the general (sort-based)
   merge.
4. When those extents keep regions' destinations apart, region order already is canonical order and no
   cross-region overlap is possible, so no global sort or check is needed.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .alignment import check_alignment
from .errors import LayoutError, MappingError
from .plan import CopyAttributes, LocationHint, Runs, TransferPlan, dense
from .spec import BlockMapping, Direction, Layout, LayoutInfo, Location
from .target import AccessOrder, PlanOptions, Target

ROW_WISE_MIN = 2048  # ranges per region from which offsets are computed row by row (cache-resident)
Ranges = dict[str, np.ndarray]  # src/dst_buf, region: int32; src/dst_offset, nbytes: int64 while planning


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
    attrs, region_attr = _attributes(layout, direction, target, options)
    cap = options.descriptor_cap(target)
    extended = (not info.plain or not mapping.plain or options.regions_per_call is not None
                or (direction is Direction.D2H and options.num_writers > 1))
    if extended:
        from .layouts import plan_extended  # sub-block chunks, groups, fragments, writer rotation, layer-wise calls

        ranges, requested, call_offsets = plan_extended(layout, mapping, options, cap)
        return _finish(layout, direction, target, options, attrs, region_attr, ranges, requested, call_offsets)
    _check_ids(layout, s, src_side, "src_ids", direction.src_side)
    _check_ids(layout, d, dst_side, "dst_ids", direction.dst_side)

    if len(s) == 0 or info.nregions == 0:
        ranges = {k: np.zeros(0, dtype=np.int64) for k in ("src_offset", "dst_offset", "nbytes")}
        ranges |= {k: np.zeros(0, dtype=np.int32) for k in ("src_buf", "dst_buf", "region")}
    else:
        ranges, disjoint = _ranges(layout, direction, s, d, options.coalesce)
        _check_overlaps(layout, direction, ranges, d, within_regions_only=disjoint)
    ranges = _split_large(ranges, options.max_range_bytes)
    call_offsets = chunk_calls(len(ranges["nbytes"]), cap)
    return _finish(layout, direction, target, options, attrs, region_attr, ranges, len(s) * info.nregions, call_offsets)


def chunk_calls(n: int, cap: int | None) -> np.ndarray:
    """Call offsets cutting ``n`` ranges into calls of at most ``cap`` (None: one call; no ranges: no calls)."""
    return np.append(np.arange(0, n, cap or max(n, 1), dtype=np.int64), n) if n else np.zeros(1, np.int64)


def _finish(layout: Layout, direction: Direction, target: Target, options: PlanOptions, attrs: tuple,
            region_attr: np.ndarray, ranges: Ranges, requested: int, call_offsets: np.ndarray) -> TransferPlan:
    reg = ranges["region"]
    ranges["attr"] = Runs(region_attr[reg.values], reg.lengths) if isinstance(reg, Runs) else region_attr[reg]
    for k in ("src_offset", "dst_offset", "nbytes"):  # non-negative by construction: reinterpret, no copy
        if not isinstance(ranges[k], Runs):
            ranges[k] = ranges[k].view(np.uint64)
    return check_alignment(TransferPlan(direction=direction, target=target, options=options, buffers=layout.buffers,
                                        regions=tuple(r.name for r in layout.regions), attrs=attrs,
                                        region_page_bytes=tuple(r.page_bytes for r in layout.regions),
                                        requested_copies=requested, call_offsets=call_offsets, columns=ranges))


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


def _check_overlaps(layout: Layout, direction: Direction, r: Ranges, d: np.ndarray, within_regions_only: bool) -> None:
    """No destination byte written twice; no range reading bytes another range writes in the same buffer.

    Ranges arrive sorted by (dst buffer, dst offset), so one pass over neighbours finds any overlap. When
    the layout keeps regions' destination extents apart, only repeated destination ids can overlap, and
    those were checked in id space (``within_regions_only``).
    """
    shared = layout.info.shared_buffers(direction)
    if within_regions_only and not shared:
        return
    r = _dense_all(r)
    db, do, nb = r["dst_buf"], r["dst_offset"], r["nbytes"]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        _explain_dst_overlap(layout, r, int(bad[0]), d)
    check_reads_vs_writes(layout, direction, r)


def check_reads_vs_writes(layout: Layout, direction: Direction, r: Ranges) -> None:
    """In a buffer that is both read and written, no destination range may overlap any source range."""
    for b in layout.info.shared_buffers(direction):
        sm, dm = r["src_buf"] == b, np.flatnonzero(r["dst_buf"] == b)
        if not sm.any() or not len(dm):
            continue
        ss, se = r["src_offset"][sm], r["src_offset"][sm] + r["nbytes"][sm]
        o = np.argsort(ss, kind="stable")
        ss, se = ss[o], np.maximum.accumulate(se[o])
        do, de = r["dst_offset"][dm], r["dst_offset"][dm] + r["nbytes"][dm]
        k = np.searchsorted(ss, de, side="left") - 1  # last source range starting before the destination ends
        hit = (k >= 0) & (se[np.maximum(k, 0)] > do)
        if hit.any():
            j = int(np.argmax(hit))
            name = layout.buffers[b].name
            raise LayoutError(f"regions[{int(r['region'][dm[j]])}].{direction.dst_side}", name,
                              f"destination bytes [{int(do[j])}, {int(de[j])}) of buffer {name!r} overlap "
                              f"source bytes of the same transfer")


def _explain_dst_overlap(layout: Layout, r: Ranges | None, i: int, d: np.ndarray) -> None:
    """Slow path, only on error: say which ids (or else which regions) write the same bytes."""
    first: dict[int, int] = {}
    for j, v in enumerate(d.tolist()):
        if v in first:
            raise MappingError("dst_ids", v, f"destination block is written twice (also dst_ids[{first[v]}])", j)
        first[v] = j
    if r is None:
        raise AssertionError("unreachable: an id-space overlap implies a repeated destination id")
    ra, rb = int(r["region"][i]), int(r["region"][i + 1])
    name = layout.buffers[int(r["dst_buf"][i])].name
    na, nb_ = layout.regions[ra].name, layout.regions[rb].name
    raise LayoutError(f"regions[{rb}]", nb_, f"writes bytes at offset {int(r['dst_offset'][i + 1])} of buffer {name!r} "
                      f"that region {na!r} also writes")


# ---- attributes -------------------------------------------------------------------------------------------
def _attributes(layout: Layout, direction: Direction, target: Target,
                options: PlanOptions) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    """The attribute table and each region's entry in it (location hints follow the region's buffers)."""
    flags = target.flags(options.prefer_overlap_with_compute)
    return layout.info.cached(("attrs", direction.value, flags), lambda: _attribute_table(layout, direction, flags))


def _attribute_table(layout: Layout, direction: Direction, flags: int) -> tuple[tuple[CopyAttributes, ...], np.ndarray]:
    order = AccessOrder.ANY if direction is Direction.H2D else AccessOrder.STREAM
    table: dict[CopyAttributes, int] = {}
    idx = np.zeros(max(len(layout.regions), 1), dtype=np.uint16)
    for i, reg in enumerate(layout.regions):
        hints = []
        for side in (direction.src_side, direction.dst_side):
            b = layout.buffers[layout.buffer_index(getattr(reg, side).buffer)]
            hints.append(LocationHint(location=b.location, id=b.device if b.location is Location.DEVICE else 0))
        a = CopyAttributes(src_access_order=order, src_location=hints[0], dst_location=hints[1], flags=flags)
        idx[i] = table.setdefault(a, len(table))
    idx.flags.writeable = False
    return tuple(table), idx


# ---- merging ----------------------------------------------------------------------------------------------
def _id_runs(s: np.ndarray, d: np.ndarray, coalesce: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs (src id, dst id, length) where both ids advance by one, sorted by dst id.

    Destination ids are distinct (repeats are rejected later), so the only possible successor of a pair
    (s, d) is the pair with destination d+1, which sits right after it in destination order. Ascending and
    descending destinations are recognised in O(n) and not sorted.
    """
    o = _order_by(d)
    s, d = s[o], d[o]
    if not coalesce:
        return s, d, np.ones(len(s), dtype=np.int64)
    brk = (d[1:] != d[:-1] + 1) | (s[1:] != s[:-1] + 1)
    starts = np.flatnonzero(np.concatenate(([True], brk)))
    return s[starts], d[starts], np.diff(np.append(starts, len(s)))


def _order_by(x: np.ndarray) -> slice | np.ndarray:
    """Indices that sort ``x`` (stable); a slice when it is already ascending or strictly descending."""
    if len(x) < 2:
        return slice(None)
    step = x[1:] - x[:-1]
    if np.all(step >= 0):
        return slice(None)
    if np.all(step < 0):
        return slice(None, None, -1)
    return np.argsort(x, kind="stable")


def _expand(info: LayoutInfo, direction: Direction, regs: np.ndarray, rs: np.ndarray, rd: np.ndarray,
            rl: np.ndarray) -> Ranges:
    """Every id run in every region of ``regs`` as a byte range, region-major.

    Columns constant within a region stay run-length encoded (one run per region). Offsets are computed
    one region row at a time so the multiply and the add both stay in cache.
    """
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    k = len(rs)
    if k < ROW_WISE_MIN:
        so = np.multiply.outer(S["stride"][regs], rs)
        so += S["base"][regs][:, None]
        do = np.multiply.outer(D["stride"][regs], rd)
        do += D["base"][regs][:, None]
    else:
        so, do = np.empty((len(regs), k), dtype=np.int64), np.empty((len(regs), k), dtype=np.int64)
        for i, r in enumerate(regs.tolist()):  # a loop over regions, not descriptors
            np.multiply(rs, S["stride"][r], out=so[i])
            so[i] += S["base"][r]
            np.multiply(rd, D["stride"][r], out=do[i])
            do[i] += D["base"][r]
    lengths = np.full(len(regs), k, dtype=np.int64)
    uniform = k == 0 or bool(np.all(rl == rl[0]))
    nbytes = Runs(info.page[regs] * (rl[0] if k else 0), lengths) if uniform else np.multiply.outer(info.page[regs], rl).ravel()
    return {"src_buf": Runs(S["buf"][regs], lengths), "src_offset": so.ravel(),
            "dst_buf": Runs(D["buf"][regs], lengths), "dst_offset": do.ravel(),
            "nbytes": nbytes, "region": Runs(regs.astype(np.int32), lengths)}


def _ranges(layout: Layout, direction: Direction, s: np.ndarray, d: np.ndarray, coalesce: bool) -> tuple[Ranges, bool]:
    """All ranges in canonical order, and whether regions' destination extents are disjoint (no global check needed)."""
    info = layout.info
    order, disjoint = info.dst_order(direction, int(d.max()))
    S, D = info.side[direction.src_side], info.side[direction.dst_side]
    merges = (S["dense"] & D["dense"])[order]  # stride == page on both sides: id runs are byte runs
    runs = _id_runs(s, d, coalesce) if coalesce and merges.any() else None
    singles = _id_runs(s, d, False) if not (coalesce and merges.all()) else None
    rd, rl = (runs or singles)[1:]
    if np.any(rd[:-1] + rl[:-1] > rd[1:]):  # some destination id repeats (id runs sorted by destination)
        _explain_dst_overlap(layout, None, 0, d)
    if runs is not None and singles is None:
        r = _expand(info, direction, order, *runs)
    elif runs is None:
        r = _expand(info, direction, order, *singles)
    else:  # mixed: regions keep their destination order
        parts = [_expand(info, direction, order[i:i + 1], *(runs if merges[i] else singles)) for i in range(len(order))]
        r = {k: np.concatenate([dense(p[k]) for p in parts]) for k in parts[0]}
    linked = info.linked_regions(direction, int(s.max()), int(d.max())) if coalesce else None
    if linked is not None and linked.any():
        r = _dense_all(r)
        m = linked[r["region"]]
        merged = _merge(_take(r, m))
        r = {k: np.concatenate((r[k][~m], merged[k])) for k in r}
        disjoint = False
    if not disjoint:
        r = _dense_all(r)
        db, do = r["dst_buf"], r["dst_offset"]
        if not np.all((db[1:] > db[:-1]) | ((db[1:] == db[:-1]) & (do[1:] >= do[:-1]))):
            r = _take(r, np.lexsort((do, db)))
    return r, disjoint


def _take(r: Ranges, sel: Any) -> Ranges:
    return {k: dense(v)[sel] for k, v in r.items()}


def _dense_all(r: Ranges) -> Ranges:
    return {k: dense(v) for k, v in r.items()}


def _merge(r: Ranges, key: np.ndarray | None = None) -> Ranges:
    """General maximal merge of byte ranges: same buffers, contiguous on both sides.

    Two ranges chain only if they share (``key``, src buffer, dst buffer, dst - src); within that class the
    destinations are disjoint, so each range has at most one successor and sorting by destination
    offset finds every chain. Region of a merged range = region of its first byte.
    """
    if len(r["nbytes"]) < 2:
        return r
    diag = r["dst_offset"] - r["src_offset"]
    key = np.zeros(len(diag), dtype=np.int64) if key is None else key
    o = np.lexsort((r["dst_offset"], diag, r["dst_buf"], r["src_buf"], key))
    r = _take(r, o)
    diag, key = diag[o], key[o]
    do, nb = r["dst_offset"], r["nbytes"]
    link = ((r["src_buf"][1:] == r["src_buf"][:-1]) & (r["dst_buf"][1:] == r["dst_buf"][:-1])
            & (diag[1:] == diag[:-1]) & (do[:-1] + nb[:-1] == do[1:]) & (key[1:] == key[:-1]))
    starts = np.flatnonzero(np.concatenate(([True], ~link)))
    out = _take(r, starts)
    out["nbytes"] = np.add.reduceat(nb, starts)
    return out


def _split_large(r: Ranges, cap: int | None) -> Ranges:
    """Cut ranges longer than ``cap`` bytes into cap-sized pieces plus a remainder, in place order."""
    nb = r["nbytes"]
    if cap is None or len(nb) == 0 or int((nb.values if isinstance(nb, Runs) else nb).max()) <= cap:
        return r
    r = _dense_all(r)
    pieces = -(-r["nbytes"] // cap)
    idx = np.repeat(np.arange(len(pieces)), pieces)
    first = np.cumsum(pieces) - pieces
    k = np.arange(len(idx)) - first[idx]
    out = _take(r, idx)
    out["src_offset"] = out["src_offset"] + k * cap
    out["dst_offset"] = out["dst_offset"] + k * cap
    out["nbytes"] = np.minimum(r["nbytes"][idx] - k * cap, cap)
    return out
