"""Differential property: every plain case gives the identical plan through the fast path and the general path.

``plan_transfer`` sends plain cases (one group, whole pages, k == 1, no writer rotation, no per-layer calls)
down the fast path; ``plan_transfer_general`` forces the general path. Both must produce the same fingerprint
(header, every column, call offsets), or refuse the same input with the same error.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    Location,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    Target,
    hip_version,
    plan_transfer,
)
from kvxfer.planner.planning import plan_transfer_general
from kvxfer.testing import assert_plan_matches

from .test_planner_props import cases, general_cases, layouts

OPTIONS = [PlanOptions(), PlanOptions(coalesce=False), PlanOptions(max_descriptors=3), PlanOptions(max_range_bytes=5),
           PlanOptions(prefer_overlap_with_compute=True), PlanOptions(num_writers=2, writer_index=1)]
TARGETS = [Target(), Target(platform="rocm", runtime_version=hip_version(7, 16)), Target(platform="cuda", runtime_version=13000)]


def _outcome(plan_fn, *args):  # a plan's fingerprint, or the error's type and message
    try:
        return plan_fn(*args).fingerprint
    except (PlanError, ValueError) as e:
        return type(e).__name__, str(e)


@given(cases(), st.sampled_from(OPTIONS), st.sampled_from(TARGETS))
def test_fast_and_general_paths_give_identical_plans(case, options, target):
    layout, mapping = case
    if options.num_writers > 1 and mapping.direction.value == "d2h":
        options = PlanOptions()  # writer rotation on stores always takes the general path
    fast = _outcome(plan_transfer, layout, mapping, target, options)
    general = _outcome(plan_transfer_general, layout, mapping, target, options)
    if isinstance(fast, str) and isinstance(general, str):
        assert fast == general
    else:  # both refuse, with the same error class (the general path may word a repeated page differently)
        assert not isinstance(fast, str) and not isinstance(general, str), (fast, general)
        assert fast[0] == general[0]


@given(layouts(), st.data())
def test_paths_agree_on_repeated_and_out_of_range_ids(drawn, data):
    layout, nb_dev, nb_host = drawn
    n = data.draw(st.integers(1, 6))
    src = data.draw(st.lists(st.integers(0, nb_host + 2), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, nb_dev + 2), min_size=n, max_size=n))
    mapping = BlockMapping(direction="h2d", src_ids=np.array(src), dst_ids=np.array(dst))
    fast = _outcome(plan_transfer, layout, mapping)
    general = _outcome(plan_transfer_general, layout, mapping)
    assert isinstance(fast, str) == isinstance(general, str), (fast, general)
    if isinstance(fast, str):
        assert fast == general
    elif fast[0] != general[0]:  # an input with several write conflicts: each path may name a different one first
        assert all("written twice" in m or "also writes" in m for _, m in (fast, general)), (fast, general)


def test_the_fast_path_is_taken_for_plain_cases():
    """The differential test compares two different code paths: plain cases really take the fast one."""
    import kvxfer.planner.planning as planning

    calls = []
    original = planning.plan_plain

    def spy(*args):
        calls.append(1)
        return original(*args)

    from kvxfer.planner import presets
    layout = presets.kv_layout(4, 16, 64)
    planning.plan_plain = spy
    try:
        plan_transfer(layout, presets.mapping("runs8", 8, 16))
        plan_transfer_general(layout, presets.mapping("runs8", 8, 16))
    finally:
        planning.plan_plain = original
    assert calls == [1]


@settings(max_examples=150, deadline=None)
@given(general_cases())
def test_general_cases_agree_with_the_general_path(case):
    """Every case of the general strategy plans, or refuses, through plan_transfer exactly as through the
    general path (the few that are paged take the fast path over page ids)."""
    layout, mapping, options = case
    fast = _outcome(plan_transfer, layout, mapping, None, options)
    assert fast == _outcome(plan_transfer_general, layout, mapping, None, options)


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
@given(paged_cases(), st.booleans())
def test_paged_cases_agree_with_the_general_path(case, as_dict):
    """Paged cases take the fast path over page ids; they plan, or refuse, exactly as the general path does,
    through a BlockMapping or the dict hot path; plans copy what the oracle copies."""
    layout, mapping, options = case
    assert layout.info.paged
    arg = mapping if not as_dict else {"direction": mapping.direction, "src_ids": mapping.src_ids,
                                       "dst_ids": mapping.dst_ids, "group_sizes": mapping.group_sizes,
                                       "group_starts": mapping.group_starts}
    fast = _outcome(plan_transfer, layout, arg, None, options)
    general = _outcome(plan_transfer_general, layout, mapping, None, options)
    if isinstance(fast, str) or not (layout.info.plain and mapping.plain):
        assert fast == general  # paged refusals come from the general path itself: word for word
    else:  # the plain path words an id past its buffer by block, the general path by chunk (same class)
        assert not isinstance(general, str) and fast[0] == general[0]
    if isinstance(fast, str) and len(mapping) <= 8:
        assert_plan_matches(plan_transfer(layout, arg, options=options), layout, mapping, options)


def test_paged_layouts_take_the_fast_path(monkeypatch):
    """k = 4 host chunks without padding plan through plan_plain, and match the general path and the oracle."""
    import kvxfer.planner.planning as planning

    regions = tuple(Region(name=f"kv{r}", page_bytes=64, device=Placement(buffer=f"g{r}"),
                           host=Placement(buffer=f"h{r}", blocks_per_chunk=4)) for r in range(3))
    buffers = tuple(b for r in range(3) for b in (Buffer(name=f"g{r}", nbytes=64 * 40, location=Location.DEVICE),
                                                  Buffer(name=f"h{r}", nbytes=64 * 4 * 10, location=Location.HOST)))
    layout = Layout(buffers=buffers, regions=regions)
    assert layout.info.paged and not layout.info.plain
    calls = []
    original = planning.plan_plain
    monkeypatch.setattr(planning, "plan_plain", lambda *a: calls.append(1) or original(*a))
    for direction, dev, host in (("h2d", [5, 6, 7, 8, 9, 20, 30], [2, 7]), ("d2h", [1, 2, 3], [9])):
        s, d = (host, dev) if direction == "h2d" else (dev, host)
        mapping = BlockMapping(direction=direction, src_ids=s, dst_ids=d, group_sizes=[len(dev)], group_starts=[1])
        plan = plan_transfer(layout, mapping)
        assert plan.fingerprint == plan_transfer_general(layout, mapping).fingerprint
        assert_plan_matches(plan, layout, mapping)
    assert len(calls) == 2
