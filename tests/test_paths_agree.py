"""Every input form of a mapping plans or refuses alike, and every outcome is the one an independent check predicts.

A mapping reaches ``plan_transfer`` as a ``BlockMapping``, a dict of int64 or int32 numpy arrays (the per-job
hot path, not copied), a dict of lists, or a JSON file. All must give the same plan (fingerprint) or the same
refusal (class and message, word for word). Which outcome is right is decided here without the planner:
- a negative id is refused first, naming the first one (source list first);
- groups that do not fit the id lists are refused (the oracle, ``kvxfer.testing``, cannot expand them);
- an id whose chunk's first page, or whose page used by some region, ends past that region's buffer is
  refused, naming such an id (brute force over regions and pages, written from the layout model);
- copies that write a byte twice or over bytes the transfer reads are refused (the oracle's copies);
- anything else plans, and the plan moves exactly the oracle's bytes.
"""
from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
from hypothesis import event, given, settings
from hypothesis import strategies as st

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    Location,
    Placement,
    PlanOptions,
    Region,
    Target,
    hip_version,
    plan_transfer,
)
from kvxfer.testing import OracleError, assert_plan_matches, expected_copies, independent

from .test_planner_props import cases, general_cases, layouts

OPTIONS = [PlanOptions(), PlanOptions(coalesce=False), PlanOptions(max_descriptors=3), PlanOptions(max_range_bytes=5),
           PlanOptions(prefer_overlap_with_compute=True), PlanOptions(num_writers=2, writer_index=1)]
TARGETS = [Target(), Target(platform="rocm", runtime_version=hip_version(7, 16)), Target(platform="cuda", runtime_version=13000)]
GROUPS_REFUSED = r"KV-cache groups|past the end of the list|must add up exactly|must share blocks_per_chunk|cannot be counted"
OVERLAP_REFUSED = r"written twice|also writes|overlap source bytes"


def outcome(layout: Layout, mapping: Any, target: Any = None, options: Any = None) -> Any:
    """A plan's fingerprint, or the refusal's class name, message and (field, index) where it names them."""
    try:
        return plan_transfer(layout, mapping, target, options).fingerprint
    except ValueError as e:
        return type(e).__name__, str(e), (getattr(e, "field", None), getattr(e, "index", None))


def forms(s: list[int], d: list[int], direction: str, groups: dict[str, Any], folder: Path) -> dict[str, Any]:
    """The mapping as each input form takes it (a BlockMapping is built lazily: its construction may refuse)."""
    path = folder / "mapping.json"
    path.write_text(json.dumps({"direction": direction, "src_ids": s, "dst_ids": d} | groups))
    out = {"BlockMapping": lambda: BlockMapping(direction=direction, src_ids=s, dst_ids=d, **groups),
           "dict int64": {"direction": direction, "src_ids": np.array(s, np.int64), "dst_ids": np.array(d, np.int64)}
           | groups,
           "dict of lists": {"direction": direction, "src_ids": list(s), "dst_ids": list(d)} | groups,
           "JSON file": str(path)}
    if all(abs(v) < 2**31 for v in s + d):
        out["dict int32"] = {"direction": direction, "src_ids": np.array(s, np.int32),
                             "dst_ids": np.array(d, np.int32)} | groups
    return out


def agreed_outcome(layout: Layout, s: list[int], d: list[int], direction: str, groups: dict[str, Any],
                   target: Any = None, options: Any = None) -> Any:
    """The one outcome every input form gives (asserted), and the arrays that produced it."""
    with tempfile.TemporaryDirectory() as tmp:
        got = {}
        for name, form in forms(s, d, direction, groups, Path(tmp)).items():
            try:
                mapping = form() if callable(form) else form
            except ValueError as e:
                got[name] = (type(e).__name__, str(e), (getattr(e, "field", None), getattr(e, "index", None)))
                continue
            got[name] = outcome(layout, mapping, target, options)
    first = got["BlockMapping"]
    assert all(v == first for v in got.values()), got
    return first


# ---- the independent verdict ---------------------------------------------------------------------------------
def _page_end(region: Region, side: str, page: int) -> int:
    p = region.placement(side)
    k, size, stride = p.blocks_per_chunk, region.side_page(side), region.stride(side)
    return p.byte_offset + page // k * stride + page % k * size + size


def _writes(region: Region, options: PlanOptions, direction: str, host_page: int) -> bool:
    if direction == "h2d":
        return True
    n = options.num_writers if region.num_writers is None else region.num_writers
    i = options.writer_index if region.writer_index is None else region.writer_index
    return n == 1 or host_page % n == i


def past_buffer(layout: Layout, mapping: BlockMapping, options: PlanOptions) -> set[tuple[str, int]]:
    """(field, index) of every id whose chunk's first page ends past the buffer of some region of its group, or
    one of whose pages a region uses (writer rotation applied) ends past that region's buffer."""
    sizes = {b.name: b.nbytes for b in layout.buffers}
    direction = mapping.direction.value
    sides = {"src_ids": "host" if direction == "h2d" else "device", "dst_ids": "device" if direction == "h2d" else "host"}
    counts = list(mapping.group_sizes) if mapping.group_sizes is not None else [len(mapping.src_ids)]
    starts = list(mapping.group_starts) if mapping.group_starts is not None else [0] * len(counts)
    ids = {"src_ids": mapping.src_ids.tolist(), "dst_ids": mapping.dst_ids.tolist()}
    used = {"src_ids": 0, "dst_ids": 0}
    flagged = set()
    for g, (count, start) in enumerate(zip(counts, starts)):
        regions = [r for r in layout.regions if r.group == g]
        pages = {}
        for field, side in sides.items():
            k = (regions or layout.regions)[0].placement(side).blocks_per_chunk if (regions or layout.regions) else 1
            skip = start % k
            need = -(-(skip + count) // k) if count else 0
            chunks = ids[field][used[field]:used[field] + need]
            for i, c in enumerate(chunks):
                if any(_page_end(r, side, c * k) > sizes[r.placement(side).buffer] for r in regions):
                    flagged.add((field, used[field] + i))
            flat = [(c * k + j, used[field] + i) for i, c in enumerate(chunks) for j in range(k)]
            pages[field] = flat[skip:skip + count]
            used[field] += need
        host = "src_ids" if direction == "h2d" else "dst_ids"
        for r in regions:
            for j in range(len(pages["src_ids"])):
                if not _writes(r, options, direction, pages[host][j][0]):
                    continue
                for field, side in sides.items():
                    page, at = pages[field][j]
                    if _page_end(r, side, page) > sizes[r.placement(side).buffer]:
                        flagged.add((field, at))
    return flagged


def check_outcome(layout: Layout, mapping: BlockMapping | None, s: list[int], d: list[int], got: Any,
                  options: PlanOptions) -> None:
    """``got`` is the outcome the verdict predicts (see the module docstring)."""
    negative = [(f, i) for f, ids in (("src_ids", s), ("dst_ids", d)) for i, v in enumerate(ids) if v < 0]
    event("refused: negative id" if negative else "planned" if isinstance(got, str) else f"refused: {got[0]}")
    if negative:
        field, i = negative[0]
        assert got[0] == "MappingError" and got[2] == (field, i) and "must be non-negative" in got[1], got
        return
    assert mapping is not None, got  # only a negative id is refused as the mapping is made
    try:
        copies = expected_copies(layout, mapping, options)
    except OracleError:
        assert not isinstance(got, str) and re.search(GROUPS_REFUSED, got[1]), got
        return
    except OverflowError:  # ids near 2**63: no offset of them fits int64, let alone a buffer
        copies = None
    past = past_buffer(layout, mapping, options)
    conflict = False
    if copies is not None:
        firsts: dict[Any, int] = {}  # aliases (the same bytes under two names) move once: their copies are left out
        keep = np.isin(copies.region, [firsts.setdefault(r.alias_key(), i) for i, r in enumerate(layout.regions)])
        kept = [c[keep] for c in (copies.src_buf, copies.src_offset, copies.dst_buf, copies.dst_offset, copies.nbytes,
                                  copies.region)]
        conflict = not independent(type(copies)(copies.buffers, *kept))
    if isinstance(got, str):
        assert copies is not None and not past and not conflict, (past, conflict)
        assert_plan_matches(plan_transfer(layout, mapping, options=options), layout, mapping, options)
        return
    if "past buffer" in got[1]:
        assert got[2] in past, (got, past)
    else:
        assert conflict and re.search(OVERLAP_REFUSED, got[1]), (got, past, conflict)


# ---- the properties ------------------------------------------------------------------------------------------
@st.composite
def spoiled(draw, case: tuple[Layout, BlockMapping, PlanOptions]) -> dict[str, Any]:
    """``case`` as drawn, or with one mistake: an id past its buffer (just past, or far), a negative id, an id
    too many, or a group size off by one. Returns the layout, the ids, the direction, the group fields, the
    options and the mapping (None where BlockMapping refuses the ids as they are made: a negative id)."""
    layout, mapping, options = case
    s, d = mapping.src_ids.tolist(), mapping.dst_ids.tolist()
    sizes = None if mapping.group_sizes is None else list(mapping.group_sizes)
    kind = draw(st.sampled_from(["none", "none", "past", "far", "negative", "extra id", "size"]))
    ids = draw(st.sampled_from([s, d]))
    if kind in ("past", "far", "negative") and ids:
        i = draw(st.integers(0, len(ids) - 1))
        ids[i] = {"past": max(ids) + draw(st.integers(1, 40)), "far": 2**40 + draw(st.integers(0, 9)),
                  "negative": -draw(st.integers(1, 3))}[kind]
    elif kind == "extra id" and sizes is not None:
        ids.append(draw(st.integers(0, 3)))
    elif kind == "size" and sizes is not None:
        sizes[draw(st.integers(0, len(sizes) - 1))] += draw(st.sampled_from([-1, 1]))
        sizes = [max(x, 0) for x in sizes]
    groups = {} if sizes is None else {"group_sizes": sizes,
                                       "group_starts": list(mapping.group_starts or [0] * len(sizes))}
    try:
        spoilt: BlockMapping | None = BlockMapping(direction=mapping.direction, src_ids=s, dst_ids=d, **groups)
    except ValueError:
        spoilt = None
    return {"layout": layout, "s": s, "d": d, "direction": mapping.direction.value, "groups": groups,
            "options": options, "mapping": spoilt}


def _check_spoiled(case: dict[str, Any], target: Any = None, options: PlanOptions | None = None) -> None:
    options = case["options"] if options is None else options
    got = agreed_outcome(case["layout"], case["s"], case["d"], case["direction"], case["groups"], target, options)
    check_outcome(case["layout"], case["mapping"], case["s"], case["d"], got, options)


def _groups(mapping: BlockMapping) -> dict[str, Any]:
    if mapping.group_sizes is None:
        return {}
    return {"group_sizes": list(mapping.group_sizes), "group_starts": list(mapping.group_starts or ())}


@settings(max_examples=150, deadline=None)
@given(cases().flatmap(lambda c: spoiled((*c, PlanOptions()))), st.sampled_from(OPTIONS), st.sampled_from(TARGETS))
def test_plain_cases_plan_or_refuse_alike_in_every_form(case, options, target):
    _check_spoiled(case, target, options)


@settings(max_examples=150, deadline=None)
@given(general_cases().flatmap(spoiled))
def test_general_cases_plan_or_refuse_alike_in_every_form(case):
    """Groups, chunks with skips, padded rows, fragments, writers, per-layer calls; one mistake or none."""
    _check_spoiled(case)


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_repeated_and_out_of_range_ids_refuse_alike_in_every_form(drawn, data):
    layout, nb_dev, nb_host = drawn
    n = data.draw(st.integers(1, 6))
    s = data.draw(st.lists(st.integers(0, nb_host + 2), min_size=n, max_size=n))
    d = data.draw(st.lists(st.integers(0, nb_dev + 2), min_size=n, max_size=n))
    got = agreed_outcome(layout, s, d, "h2d", {})
    check_outcome(layout, BlockMapping(direction="h2d", src_ids=s, dst_ids=d), s, d, got, PlanOptions())


@st.composite
def paged_cases(draw):
    """Paged layouts (one group, k pages per chunk on each side without padding, no fragments): regions in
    separate buffers, back to back in one buffer per side (ranges merge across regions), or both sides in one
    buffer (overlapping or not); groups that skip into a chunk; chunk ids out of range or repeated."""
    nreg, page = draw(st.integers(1, 3)), draw(st.sampled_from([4, 8]))
    k = {"device": draw(st.sampled_from([1, 1, 2])), "host": draw(st.sampled_from([1, 2, 3, 4]))}
    chunks = {"device": draw(st.integers(3, 8)), "host": draw(st.integers(3, 8))}
    mode = draw(st.sampled_from(["separate", "back-to-back", "one-buffer"]))
    size = {side: chunks[side] * k[side] * page for side in k}
    places: dict[str, list[Placement]] = {"device": [], "host": []}
    buffers = []
    shift = draw(st.sampled_from([nreg * size["device"], 0]))  # one-buffer: host after the device part, or on it
    for side in ("device", "host"):
        for r in range(nreg):
            name = {"separate": f"{side[0]}{r}", "back-to-back": side[0], "one-buffer": "m"}[mode]
            off = 0 if mode == "separate" else r * size[side] + (shift if mode == "one-buffer" and side == "host" else 0)
            places[side].append(Placement(buffer=name, byte_offset=off, blocks_per_chunk=k[side]))
            if mode == "separate":
                buffers.append(Buffer(name=name, nbytes=size[side], location=Location(side)))
        if mode == "back-to-back":
            buffers.append(Buffer(name=side[0], nbytes=nreg * size[side], location=Location(side)))
    if mode == "one-buffer":
        buffers.append(Buffer(name="m", nbytes=max(nreg * size["device"], shift + nreg * size["host"])))
    layout = Layout(buffers=tuple(buffers), regions=tuple(
        Region(name=f"r{r}", page_bytes=page, device=places["device"][r], host=places["host"][r]) for r in range(nreg)))
    direction = draw(st.sampled_from(["h2d", "d2h"]))
    count, start = draw(st.integers(0, 12)), draw(st.integers(0, 7))
    src, dst = ("host", "device") if direction == "h2d" else ("device", "host")
    ids = {}
    for side in (src, dst):
        need = -(-((start % k[side]) + count) // k[side]) if count else 0
        top = chunks[side] + (1 if draw(st.booleans()) else -1)
        ids[side] = draw(st.lists(st.integers(0, top), min_size=need, max_size=need,
                                  unique=need <= top + 1 and draw(st.booleans())))
    mapping = BlockMapping(direction=direction, src_ids=np.array(ids[src], dtype=np.int64),
                           dst_ids=np.array(ids[dst], dtype=np.int64), group_sizes=[count], group_starts=[start])
    options = draw(st.sampled_from([PlanOptions(), PlanOptions(coalesce=False), PlanOptions(max_descriptors=3),
                                    PlanOptions(max_range_bytes=5)]))
    return layout, mapping, options


@settings(max_examples=300, deadline=None)
@given(paged_cases())
def test_paged_cases_plan_or_refuse_alike_in_every_form(case):
    """Chunks of k pages without padding: ids become pages, planned as runs; plans or refusals as predicted."""
    layout, mapping, options = case
    s, d = mapping.src_ids.tolist(), mapping.dst_ids.tolist()
    got = agreed_outcome(layout, s, d, mapping.direction.value, _groups(mapping), None, options)
    check_outcome(layout, mapping, s, d, got, options)


def test_an_id_past_its_buffer_is_worded_once_whatever_the_chunks():
    """The same block past the same buffer: one message whether the ids are blocks, chunks of one block, or
    a group of them (the wording the plain and the chunked routes used to differ in)."""
    layout = Layout(buffers=[Buffer(name="g", nbytes=64), Buffer(name="h", nbytes=64, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h"))])
    want = ("MappingError", "dst_ids[1] = 9: block of region 'r' (device side) ends at byte 80, past buffer 'g' of "
            "64 bytes (last block that fits: 7)", ("dst_ids", 1))
    for groups in ({}, {"group_sizes": [2]}, {"group_sizes": [2], "group_starts": [0]}):
        assert agreed_outcome(layout, [0, 1], [0, 9], "h2d", groups) == want
    chunked = layout.model_copy(update={"regions": [Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                                           host=Placement(buffer="h", blocks_per_chunk=2))]})
    # chunk 4 of two 8-byte pages starts at byte 64, its first page ends at byte 72
    assert agreed_outcome(chunked, [0, 4], [0, 1, 2, 3], "h2d", {"group_sizes": [4]}) == (
        "MappingError", "src_ids[1] = 4: block of region 'r' (host side) ends at byte 72, past buffer 'h' of 64 "
        "bytes (last block that fits: 7)", ("src_ids", 1))
