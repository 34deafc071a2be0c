"""The per-job hot path: a dict of numpy id arrays planned without a BlockMapping (borrowed, not copied), the
id-run helpers it is built on, the layout thresholds that let it skip sorts and merges, the 2-D lowering of
plans to addresses, and plans made by ``TransferPlan.planned``.

Every expected result comes from somewhere else than the code under test: BlockMapping plans and errors, the
oracle (kvxfer.testing), numpy sorts, or brute force written here.
"""
from __future__ import annotations

import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    COLUMNS,
    BlockMapping,
    Buffer,
    Direction,
    Layout,
    Location,
    MappingError,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    TransferPlan,
    plan_transfer,
    presets,
)
from kvxfer.planner.columns import id_runs, order_runs, sort_by
from kvxfer.planner.runs import Runs
from kvxfer.testing import assert_plan_matches, expected_copies

from .test_planner_props import general_cases, layouts

I64_MAX, I64_MIN = 2**63 - 1, -(2**63)


def outcome(fn, layout, mapping, options=None):
    """A plan's fingerprint, or the refusal's class name and message."""
    try:
        return fn(layout, mapping, None, options).fingerprint
    except ValueError as e:
        return type(e).__name__, str(e)


def bm_outcome(fn, layout, direction, s, d, options=None, **groups):
    """As ``outcome`` through a BlockMapping built from the same ids (its construction may refuse them)."""
    try:
        mapping = BlockMapping(direction=direction, src_ids=s, dst_ids=d, **groups)
    except ValueError as e:
        return type(e).__name__, str(e)
    return outcome(fn, layout, mapping, options)


def hot(direction, s, d, **groups):
    return {"direction": direction, "src_ids": s, "dst_ids": d, **groups}


# ---- 1. equivalence with BlockMapping and the oracle ------------------------------------------------------------
@st.composite
def id_lists(draw, n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Distinct destination ids (consecutive or scattered), source ids (a run or random, repeats allowed),
    listed ascending, descending, as shuffled runs or shuffled pairs; now and then one id past its buffer."""
    n = draw(st.integers(0, min(n_dst, 14)))
    if draw(st.booleans()):
        d0 = draw(st.integers(0, n_dst - n))
        d = np.arange(d0, d0 + n)
    else:
        d = np.sort(np.array(draw(st.permutations(range(n_dst)))[:n], dtype=np.int64))
    if n <= n_src and draw(st.booleans()):
        s0 = draw(st.integers(0, n_src - n))
        s = np.arange(s0, s0 + n)
    else:
        s = np.array(draw(st.lists(st.integers(0, n_src - 1), min_size=n, max_size=n)), dtype=np.int64)
    s, d = s.astype(np.int64), d.astype(np.int64)
    order = draw(st.sampled_from(["ascending", "descending", "shuffled-runs", "shuffled"]))
    if order == "descending":
        s, d = s[::-1], d[::-1]
    elif order == "shuffled-runs" and n:
        cuts = sorted(set(draw(st.lists(st.integers(1, max(n - 1, 1)), max_size=4))) - {n})
        pieces = np.split(np.arange(n), cuts)
        perm = draw(st.permutations(range(len(pieces))))
        idx = np.concatenate([pieces[i] for i in perm])
        s, d = s[idx], d[idx]
    elif order == "shuffled" and n:
        idx = np.array(draw(st.permutations(range(n))), dtype=np.int64)
        s, d = s[idx], d[idx]
    if n and draw(st.sampled_from([False] * 9 + [True])):  # an id past the buffer on one side
        which = draw(st.sampled_from(["src", "dst"]))
        i = draw(st.integers(0, n - 1))
        if which == "src":
            s = s.copy()
            s[i] = n_src + draw(st.integers(0, 3))
        elif n_dst + 3 not in d:
            d = d.copy()
            d[i] = n_dst + 3
    return np.ascontiguousarray(s), np.ascontiguousarray(d)


FORMS = {
    "int64": lambda a: a.copy(),
    "int32": lambda a: a.astype(np.int32),
    "uint64": lambda a: a.astype(np.uint64),
    "strided": lambda a: np.repeat(a, 2)[::2],
    "reversed-view": lambda a: a[::-1].copy()[::-1],
}
OPTIONS = [PlanOptions(), PlanOptions(coalesce=False), PlanOptions(max_descriptors=3), PlanOptions(max_range_bytes=5)]


@settings(max_examples=150, deadline=None)
@given(layouts(), st.data())
def test_hot_path_plans_and_refuses_as_blockmapping_does(drawn, data):
    """Any integer array form plans the BlockMapping's plan, or refuses with its message; plans move the
    oracle's bytes."""
    layout, nb_dev, nb_host = drawn
    direction = data.draw(st.sampled_from(["h2d", "d2h"]))
    n_src, n_dst = (nb_host, nb_dev) if direction == "h2d" else (nb_dev, nb_host)
    s, d = data.draw(id_lists(n_src, n_dst))
    options = data.draw(st.sampled_from(OPTIONS))
    form = FORMS[data.draw(st.sampled_from(sorted(FORMS)))]
    src, dst = form(s), form(d)
    assert np.array_equal(src, s) and np.array_equal(dst, d)
    fast = outcome(plan_transfer, layout, hot(direction, src, dst), options)
    assert fast == bm_outcome(plan_transfer, layout, direction, s, d, options)
    if isinstance(fast, str):
        mapping = BlockMapping(direction=direction, src_ids=s, dst_ids=d)
        assert_plan_matches(plan_transfer(layout, hot(direction, src, dst), options=options), layout, mapping, options)


@settings(max_examples=120, deadline=None)
@given(general_cases(), st.sampled_from(["int64", "int32", "strided"]))
def test_hot_path_with_groups_and_chunks_equals_blockmapping(case, form):
    """k > 1, groups, skips, fragments and writers: the dict plans as the BlockMapping does."""
    layout, mapping, options = case
    src, dst = FORMS[form](mapping.src_ids), FORMS[form](mapping.dst_ids)
    groups = {"group_sizes": list(mapping.group_sizes), "group_starts": list(mapping.group_starts)}
    got = outcome(plan_transfer, layout, hot(mapping.direction.value, src, dst, **groups), options)
    assert got == outcome(plan_transfer, layout, mapping, options)
    if isinstance(got, str) and len(mapping) < 12:
        assert_plan_matches(plan_transfer(layout, hot(mapping.direction, src, dst, **groups), options=options),
                            layout, mapping, options)


# ---- 2. refusals on the hot path are BlockMapping's ------------------------------------------------------------
def _dense_layout():
    return presets.kv_layout(3, 16, 16)


def _strided_layout(n: int = 16):
    """Padded rows on the device side: no id run becomes a byte run (one range per pair)."""
    regions = [Region(name=f"r{r}", page_bytes=16, device=Placement(buffer=f"g{r}", stride_bytes=24),
                      host=Placement(buffer="h", byte_offset=r * n * 16)) for r in range(3)]
    buffers = [Buffer(name=f"g{r}", nbytes=n * 24) for r in range(3)] + [Buffer(name="h", nbytes=3 * n * 16,
                                                                                location=Location.HOST)]
    return Layout(buffers=buffers, regions=regions)


def _mixed_layout(n: int = 16):
    """One dense region and one with padded rows: id runs on one, one range per page on the other."""
    regions = [Region(name="dense", page_bytes=16, device=Placement(buffer="g0"), host=Placement(buffer="h0")),
               Region(name="padded", page_bytes=16, device=Placement(buffer="g1", stride_bytes=32),
                      host=Placement(buffer="h1"))]
    buffers = [Buffer(name="g0", nbytes=n * 16), Buffer(name="g1", nbytes=n * 32),
               Buffer(name="h0", nbytes=n * 16, location="host"), Buffer(name="h1", nbytes=n * 16, location="host")]
    return Layout(buffers=buffers, regions=regions)


ERROR_LAYOUTS = {"dense": _dense_layout, "strided": _strided_layout, "mixed": _mixed_layout}
ERROR_CASES = {
    "negative src first": ([-1, 1, 2, 3], [0, 1, 2, 3]),
    "negative src inside a run": ([-2, -1, 0, 1], [4, 5, 6, 7]),
    "negative src middle": ([0, 1, -3, 4], [0, 1, 2, 3]),
    "negative src last": ([5, 1, 2, -7], [0, 1, 2, 3]),
    "negative dst": ([0, 1, 2, 3], [0, 1, -3, 4]),
    "negative dst last of descending": ([3, 2, 1, 0], [4, 3, 2, -1]),
    "negative on both sides": ([0, -1, 2], [0, 1, -2]),
    "negative src and dst past the buffer": ([0, -1], [99, 1]),
    "wrap in src": ([I64_MAX, I64_MIN], [0, 1]),
    "wrap in dst": ([0, 1], [I64_MAX, I64_MIN]),
    "wrap on both sides": ([I64_MAX, I64_MIN], [I64_MAX, I64_MIN]),
    "wrap inside a longer src run": ([I64_MAX - 1, I64_MAX, I64_MIN, I64_MIN + 1], [0, 1, 2, 3]),
    "wrap inside a longer dst run": ([0, 1, 2, 3], [I64_MAX - 2, I64_MAX - 1, I64_MAX, I64_MIN]),
    "wrap after other runs": ([0, 1, 7, I64_MAX, I64_MIN], [2, 3, 9, 10, 11]),
    "src past the buffer": ([0, 1, 16], [0, 1, 2]),
    "dst past the buffer": ([0, 1, 2], [0, 16, 2]),
    "src far past the buffer": ([0, 2**62 + 3], [0, 1]),
    "dst at int64 max, last": ([0, 1], [0, I64_MAX]),
    "src at int64 max": ([I64_MAX, 0], [0, 1]),
    "repeated dst": ([0, 1, 2], [3, 4, 3]),
    "repeated dst in runs": ([0, 1, 2, 3], [5, 6, 6, 7]),
    "repeated dst descending": ([0, 1, 2], [4, 3, 4]),
}


@pytest.mark.parametrize("options", [PlanOptions(), PlanOptions(coalesce=False)], ids=["coalesce", "no-coalesce"])
@pytest.mark.parametrize("layout_name", sorted(ERROR_LAYOUTS))
@pytest.mark.parametrize("name", sorted(ERROR_CASES))
def test_hot_path_refuses_as_blockmapping_does(name, layout_name, options):
    s, d = (np.array(v, dtype=np.int64) for v in ERROR_CASES[name])
    layout = ERROR_LAYOUTS[layout_name]()
    want = bm_outcome(plan_transfer, layout, "h2d", s, d, options)
    got = outcome(plan_transfer, layout, hot("h2d", s, d), options)
    assert not isinstance(want, str), f"BlockMapping planned {name}"
    assert got == want
    assert want[0] == "MappingError"


@pytest.mark.parametrize("field", ["src_ids", "dst_ids"])
def test_wrapping_ids_are_named_by_field_and_index(field):
    """A run that wraps past the int64 maximum hides a negative id: it is named, not planned."""
    layout = _dense_layout()
    ids = {"src_ids": np.arange(4, dtype=np.int64), "dst_ids": np.arange(4, dtype=np.int64) + 4}
    ids[field] = np.array([1, I64_MAX - 1, I64_MAX, I64_MIN], dtype=np.int64)
    with pytest.raises(MappingError) as e:
        plan_transfer(layout, hot("d2h", ids["src_ids"], ids["dst_ids"]))
    assert (e.value.field, e.value.index, e.value.value) == (field, 3, I64_MIN)


@pytest.mark.parametrize("dst", [[3, I64_MAX, 1], [I64_MAX, 0], [I64_MAX - 1, I64_MAX, 2]])
def test_hot_path_refuses_ids_at_int64_max_before_small_ones(dst):
    layout = _dense_layout()
    s = np.arange(len(dst), dtype=np.int64)
    with pytest.raises(MappingError, match=r"dst_ids\[\d\] = 922337203685477580\d: block of region 'kv0' \(device side\)"):
        plan_transfer(layout, hot("h2d", s, np.array(dst, dtype=np.int64)))


@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("dst", [[3, I64_MAX, 1], [I64_MAX, 0]])
def test_blockmapping_refuses_a_destination_id_at_int64_max(dst, coalesce):
    """Regression: the in-order test of destination runs (rd[1:] >= rd[:-1] + rl[:-1]) wraps for an id at int64
    max followed by a smaller one; the largest id must still be found and refused, not planned into offsets
    that wrap."""
    layout = _dense_layout()
    mapping = BlockMapping(direction="h2d", src_ids=np.arange(len(dst)), dst_ids=dst)
    with pytest.raises(MappingError, match=r"dst_ids\[\d\] = 9223372036854775807"):
        plan_transfer(layout, mapping, options=PlanOptions(coalesce=coalesce))


def _odd_inputs():
    big = np.array([0, 2**63 + 5], dtype=np.uint64)
    ok = np.array([0, 1], dtype=np.int64)
    return {
        "uint64 src above int64 max": (big, ok),
        "uint64 dst above int64 max": (ok, big),
        "2-D src": (np.zeros((2, 2), dtype=np.int64), ok),
        "2-D dst": (ok, np.zeros((1, 2), dtype=np.int32)),
        "0-D src": (np.array(3, dtype=np.int64), ok),
        "unequal lengths": (np.arange(3, dtype=np.int64), ok),
    }


@pytest.mark.parametrize("name", sorted(_odd_inputs()))
def test_hot_path_refuses_odd_arrays_as_blockmapping_does(name):
    s, d = _odd_inputs()[name]
    layout = _dense_layout()
    want = bm_outcome(plan_transfer, layout, "h2d", s, d)
    assert not isinstance(want, str) and want[0] == "MappingError"
    assert outcome(plan_transfer, layout, hot("h2d", s, d)) == want


@pytest.mark.parametrize("group_sizes, s, d", [
    ([4], [0, -1], [0, 1, 2, 3]),  # k = 4 on the host side: one chunk id per 4 pages
    ([4], [0], [0, 1, -2, 3]),
    ([3], [0, 1], [0, 1, 2]),  # too many chunk ids for the group
    ([4], [0], [0, 1, 2, 2]),  # a repeated destination page
])
def test_grouped_hot_path_refuses_as_blockmapping_does(group_sizes, s, d):
    layout = presets.chunked_layout(2, 16, 16, blocks_per_chunk=4)
    s, d = np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)
    want = bm_outcome(plan_transfer, layout, "h2d", s, d, group_sizes=group_sizes, group_starts=[0])
    assert not isinstance(want, str)
    assert outcome(plan_transfer, layout, hot("h2d", s, d, group_sizes=group_sizes, group_starts=[0])) == want


@pytest.mark.parametrize("layout_name", sorted(ERROR_LAYOUTS))
def test_int32_ids_plan_like_int64_ids(layout_name):
    layout = ERROR_LAYOUTS[layout_name]()
    s, d = np.array([5, 6, 7, 1, 0], dtype=np.int32), np.array([9, 10, 11, 3, 2], dtype=np.int32)
    plan = plan_transfer(layout, hot("h2d", s, d))
    assert plan == plan_transfer(layout, BlockMapping(direction="h2d", src_ids=s.astype(np.int64), dst_ids=d))
    assert s.dtype == np.int32 and s.tolist() == [5, 6, 7, 1, 0]


# ---- 3. the caller's arrays are neither changed nor kept ---------------------------------------------------------
JOBS = {
    "one run": (np.arange(3, 19), np.arange(10, 26)),
    "no runs": (np.arange(16) * 2, np.arange(16) * 2 + 1),
    "descending": (np.arange(16)[::-1].copy(), np.arange(2, 18)[::-1].copy()),
    "shuffled runs": presets.block_pattern("runs8", 16, 32, seed=3),
}


@pytest.mark.parametrize("options", [PlanOptions(), PlanOptions(coalesce=False)], ids=["coalesce", "no-coalesce"])
@pytest.mark.parametrize("layout_name", ["dense", "strided", "mixed", "chunked"])
@pytest.mark.parametrize("job", sorted(JOBS))
def test_callers_arrays_are_not_modified_nor_kept(job, layout_name, options):
    s, d = (np.array(a, dtype=np.int64, copy=True) for a in JOBS[job])  # fresh: the test overwrites them
    groups = {}
    if layout_name == "chunked":  # host chunks of 2 pages: one chunk id per 2 device ids
        layout, groups = presets.chunked_layout(3, 64, 16, blocks_per_chunk=2, host_chunks=32), {"group_sizes": [16]}
        s = np.ascontiguousarray(s[::2] // 2)
    else:
        layout = {"dense": lambda: presets.kv_layout(3, 32, 16), "strided": lambda: _strided_layout(32),
                  "mixed": lambda: _mixed_layout(32)}[layout_name]()
    direction = "h2d"
    s0, d0 = s.copy(), d.copy()
    counts = sys.getrefcount(s), sys.getrefcount(d)
    plan = plan_transfer(layout, hot(direction, s, d, **groups), options=options)
    assert (sys.getrefcount(s), sys.getrefcount(d)) == counts
    assert np.array_equal(s, s0) and np.array_equal(d, d0)
    assert s.flags.writeable and d.flags.writeable
    want = plan_transfer(layout, BlockMapping(direction=direction, src_ids=s0, dst_ids=d0, **groups), options=options)
    assert plan == want
    s[:] = 0  # the caller reuses its arrays: the plan does not change
    d[:] = 1
    for c in COLUMNS:
        assert np.array_equal(plan.column(c), want.column(c))
    del plan
    assert (sys.getrefcount(s), sys.getrefcount(d)) == counts


def test_callers_arrays_are_not_kept_after_a_refusal():
    layout = _dense_layout()
    s, d = np.array([0, 1, 2], dtype=np.int64), np.array([3, 4, 3], dtype=np.int64)
    counts = sys.getrefcount(s), sys.getrefcount(d)
    for _ in range(3):
        try:
            plan_transfer(layout, hot("h2d", s, d))
        except MappingError:
            pass
        else:
            raise AssertionError("a repeated destination was planned")
    assert (sys.getrefcount(s), sys.getrefcount(d)) == counts
    assert s.tolist() == [0, 1, 2] and d.tolist() == [3, 4, 3]


# ---- 4. link thresholds and destination disjointness against brute force ---------------------------------------
@st.composite
def link_layouts(draw) -> Layout:
    """2-6 regions with k 1-4 and padded or dense rows per side, in 1-3 buffers per side, bases drawn from a
    small set (so bases repeat and extents meet)."""
    nreg = draw(st.integers(2, 6))
    nbuf = {"device": draw(st.integers(1, 3)), "host": draw(st.integers(1, 3))}
    specs = []
    for _ in range(nreg):
        page = draw(st.sampled_from([4, 8, 12]))
        side = {}
        for name in ("device", "host"):
            k = draw(st.integers(1, 4))
            stride = k * page + draw(st.sampled_from([0, 0, 4, 8, 12]))
            base = draw(st.sampled_from([0, 4, 8, 16, 24, 48, 96]))
            side[name] = (draw(st.integers(0, nbuf[name] - 1)), base, stride, k, draw(st.integers(1, 5)))
        specs.append((page, side))
    size = {}
    for name in ("device", "host"):
        for page, side in specs:
            b, base, stride, _, chunks = side[name]
            size[(name, b)] = max(size.get((name, b), 1), base + chunks * stride, base + page)
    buffers = [Buffer(name=f"{name}{b}", nbytes=n, location=Location(name)) for (name, b), n in size.items()]
    regions = [Region(name=f"r{i}", page_bytes=page, **{
        name: Placement(buffer=f"{name}{side[name][0]}", byte_offset=side[name][1], stride_bytes=side[name][2],
                        blocks_per_chunk=side[name][3]) for name in ("device", "host")})
               for i, (page, side) in enumerate(specs)]
    return Layout(buffers=buffers, regions=regions)


def _extent_end(region: Region, side: str, top: int) -> int:
    p = region.placement(side)
    k, page, stride = p.blocks_per_chunk, region.side_page(side), region.stride(side)
    return p.byte_offset + top // k * stride + top % k * page + page


@settings(max_examples=300, deadline=None)
@given(link_layouts(), st.sampled_from(list(Direction)), st.data())
def test_linked_regions_and_disjointness_match_brute_force(layout, direction, data):
    """Per direction of the layout's alias-free regions (the ones planning works on)."""
    info = layout.info
    facts = info.facts(direction)
    S, D = direction.src_side, direction.dst_side
    top_s = data.draw(st.integers(0, int(info.side[S].max_page.max())))
    top_d = data.draw(st.integers(0, int(info.side[D].max_page.max())))
    regs = info.unique.regions
    want = np.zeros(len(regs), dtype=bool)
    for i, a in enumerate(regs):
        for j, b in enumerate(regs):
            if i == j or a.placement(S).buffer != b.placement(S).buffer or a.placement(D).buffer != b.placement(D).buffer:
                continue
            if (a.placement(S).byte_offset <= _extent_end(b, S, top_s) and b.placement(S).byte_offset <= _extent_end(a, S, top_s)
                    and a.placement(D).byte_offset <= _extent_end(b, D, top_d)
                    and b.placement(D).byte_offset <= _extent_end(a, D, top_d)):
                want[i] = True
    assert facts.linked(len(regs), top_s, top_d).tolist() == want.tolist()
    index = {b.name: i for i, b in enumerate(layout.buffers)}
    key = [(index[r.placement(D).buffer], r.placement(D).byte_offset) for r in regs]
    by_dst = sorted(range(len(regs)), key=lambda i: key[i])
    disjoint = all(key[a][0] != key[b][0] or _extent_end(regs[a], D, top_d) <= key[b][1]
                   for a, b in zip(by_dst, by_dst[1:]))
    assert (top_d <= facts.disjoint_top) == disjoint
    order = info.strategy(direction, PlanOptions()).order
    assert [key[i] for i in order.tolist()] == sorted(key)


# ---- 5, 6. sort_by, id_runs and order_runs ------------------------------------------------------------------
@st.composite
def sort_inputs(draw) -> np.ndarray:
    """Small ids with repeats; ids just below and at the packed key's limit for their length; ids near 2**61
    (the index-sort fallback); negative ids; or nothing."""
    n = draw(st.integers(0, 40))
    small = np.array(draw(st.lists(st.integers(0, 12), min_size=n, max_size=n)), dtype=np.int64)
    limit = 1 << (62 - max(n - 1, 1).bit_length())
    mode = draw(st.sampled_from(["small", "below-limit", "at-limit", "near-2**61", "negative"]))
    offset = {"small": 0, "below-limit": limit - 13, "at-limit": limit - 12, "near-2**61": 2**61 - 6,
              "negative": -6}[mode]
    return small + offset


@settings(max_examples=300, deadline=None)
@given(sort_inputs())
def test_sort_by_is_a_stable_sort_carrying_its_partner(d):
    s = np.arange(len(d), dtype=np.int64) * 7 + 1
    o = np.argsort(d, kind="stable")
    got_d, got_s = sort_by(d, s)
    assert got_d.tolist() == d[o].tolist() and got_s.tolist() == s[o].tolist()


def test_sort_by_empty_input():
    d, s = sort_by(np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64))
    assert d.tolist() == [] and s.tolist() == []


@st.composite
def runs_of_pairs(draw) -> tuple[np.ndarray, np.ndarray]:
    """Pairs made of runs (both ids advancing by one) with distinct destinations, listed as they come,
    reversed, as shuffled runs or fully shuffled."""
    free = list(range(60))
    s: list[int] = []
    d: list[int] = []
    for _ in range(draw(st.integers(0, 6))):
        length = draw(st.integers(1, 6))
        d0 = draw(st.sampled_from(free))
        s0 = draw(st.integers(0, 50))
        for k in range(length):
            if d0 + k not in free:
                break
            free.remove(d0 + k)
            d.append(d0 + k)
            s.append(s0 + k)
    idx = np.arange(len(s))
    order = draw(st.sampled_from(["as-is", "reversed", "shuffled"]))
    if order == "reversed":
        idx = idx[::-1]
    elif order == "shuffled":
        idx = np.array(draw(st.permutations(range(len(s)))), dtype=np.int64)
    return np.array(s, dtype=np.int64)[idx], np.array(d, dtype=np.int64)[idx]


@settings(max_examples=300, deadline=None)
@given(runs_of_pairs())
def test_order_runs_equals_runs_of_pairs_sorted_by_destination(pairs):
    s, d = pairs
    got = order_runs(*id_runs(s, d, True))
    o = np.argsort(d, kind="stable")
    want = id_runs(s[o], d[o], True)
    assert [a.tolist() for a in got] == [a.tolist() for a in want]
    rs, rd, rl = order_runs(*id_runs(s, d, False), coalesce=False)
    assert rl.tolist() == [1] * len(s)
    assert rd.tolist() == d[o].tolist() and rs.tolist() == s[o].tolist()


def test_id_runs_finds_runs_in_list_order():
    s = np.array([4, 5, 6, 0, 9, 10], dtype=np.int64)
    d = np.array([1, 2, 3, 7, 5, 6], dtype=np.int64)
    assert [a.tolist() for a in id_runs(s, d, True)] == [[4, 0, 9], [1, 7, 5], [3, 1, 2]]
    assert [a.tolist() for a in id_runs(s, d, False)] == [s.tolist(), d.tolist(), [1] * 6]


# ---- 7. lowering to addresses: the 2-D grid path and the others -----------------------------------------------
def _memory(layout):
    return {b.name: np.zeros(b.nbytes, dtype=np.uint8) for b in layout.buffers}


def _reference(plan, mem):
    base = np.array([mem[b.name].ctypes.data for b in plan.buffers], dtype=np.uint64)
    return base[plan.src_buf] + plan.src_offset, base[plan.dst_buf] + plan.dst_offset


def _hand_made(plan, **columns):
    cols = {c: columns[c] if c in columns else np.asarray(plan.column(c)) for c in COLUMNS}
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=plan.call_offsets, columns=cols)


def _is_grid(plan) -> bool:
    return all(len(set(plan.column_runs(f"{side}_buf")[1].tolist())) == 1 for side in ("src", "dst"))


def _lowering_cases():
    grid = presets.kv_layout(4, 64, 16, shared_host=False)
    shared_host = presets.kv_layout(4, 64, 16)
    mixed = Layout(buffers=[Buffer(name="g0", nbytes=64 * 16), Buffer(name="g1", nbytes=64 * 48),
                            Buffer(name="h", nbytes=2 * 64 * 16, location=Location.HOST)],
                   regions=[Region(name="dense", page_bytes=16, device=Placement(buffer="g0"), host=Placement(buffer="h")),
                            Region(name="padded", page_bytes=16, device=Placement(buffer="g1", stride_bytes=48),
                                   host=Placement(buffer="h", byte_offset=64 * 16))])
    long = Layout(buffers=[Buffer(name="g0", nbytes=20000 * 8), Buffer(name="g1", nbytes=20000 * 16),
                           Buffer(name="h", nbytes=2 * 20000 * 8, location=Location.HOST)],
                  regions=[Region(name="dense", page_bytes=8, device=Placement(buffer="g0"), host=Placement(buffer="h")),
                           Region(name="padded", page_bytes=8, device=Placement(buffer="g1", stride_bytes=16),
                                  host=Placement(buffer="h", byte_offset=20000 * 8))])
    return {
        "grid fragmented": (grid, presets.mapping("fragmented", 16, 64, "h2d"), True),
        "grid shared host store": (shared_host, presets.mapping("fragmented", 20, 64, "d2h"), True),
        "grid runs8": (grid, presets.mapping("runs8", 24, 64, "d2h", seed=2), True),
        "mixed runs8": (mixed, presets.mapping("runs8", 24, 64, "h2d", seed=1), False),
        "long runs": (long, BlockMapping(direction="h2d", src_ids=np.arange(20000), dst_ids=np.arange(20000)), False),
    }


@pytest.mark.parametrize("name", sorted(_lowering_cases()))
def test_lowering_is_base_plus_offset_on_every_path(name):
    layout, mapping, grid = _lowering_cases()[name]
    plan = plan_transfer(layout, mapping)
    assert _is_grid(plan) == grid
    mem = _memory(layout)
    bound = NumpyExecutor().bind(layout, mem)
    want = _reference(plan, mem)
    n = plan.num_ranges
    out = (np.full(n + 5, 7, dtype=np.uint64), np.full(n + 5, 7, dtype=np.uint64))
    src, dst = bound.lower(plan, out)
    assert np.array_equal(src, want[0]) and np.array_equal(dst, want[1])
    assert np.shares_memory(src, out[0]) and np.shares_memory(dst, out[1])
    assert out[0][n:].tolist() == [7] * 5 and out[1][n:].tolist() == [7] * 5
    src, dst = bound.lower(_hand_made(plan))  # the same ranges with every column dense
    assert np.array_equal(src, want[0]) and np.array_equal(dst, want[1])
    assert_plan_matches(plan, layout, mapping)


@pytest.mark.parametrize("grid", [True, False])
def test_lowering_where_the_quick_bound_fails_but_every_range_fits(grid):
    """The largest offset plus the largest size passes the end of a buffer, yet no single range does."""
    layout = presets.kv_layout(2, 8, 16, shared_host=False)
    template = plan_transfer(layout, presets.mapping("fragmented", 2, 8, "h2d"))
    size = layout.buffers[0].nbytes
    lengths = [2, 2] if grid else [1, 3]
    buf = np.repeat([layout.buffer_index("gpu.kv0"), layout.buffer_index("gpu.kv1")], lengths).astype(np.int32)
    src_buf = np.repeat([layout.buffer_index("cpu.kv0"), layout.buffer_index("cpu.kv1")], lengths).astype(np.int32)
    nb = np.array([64, 8, 64, 8], dtype=np.uint64) if grid else np.array([64, 64, 8, 8], dtype=np.uint64)
    off = np.array([0, size - 8, 0, size - 8], dtype=np.uint64) if grid else np.array([0, 0, 64, size - 8], dtype=np.uint64)
    plan = TransferPlan(direction=template.direction, target=template.target, options=template.options,
                        buffers=template.buffers, regions=template.regions, attrs=template.attrs, requested_copies=4,
                        call_offsets=np.array([0, 4]), columns={
                            "src_buf": src_buf, "src_offset": off, "dst_buf": buf, "dst_offset": off, "nbytes": nb,
                            "region": np.repeat([0, 1], lengths).astype(np.int32), "attr": np.zeros(4, np.uint16)})
    assert _is_grid(plan) == grid
    mem = _memory(layout)
    bound = NumpyExecutor().bind(layout, mem)
    bound.check(plan)
    src, dst = bound.lower(plan)
    want = _reference(plan, mem)
    assert np.array_equal(src, want[0]) and np.array_equal(dst, want[1])


def _grid_plan():
    layout = presets.kv_layout(4, 64, 16, shared_host=False)
    plan = plan_transfer(layout, presets.mapping("fragmented", 16, 64, "h2d"))
    assert _is_grid(plan) and plan.num_ranges == 64
    return layout, plan


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("i", [0, 21, 63])
@pytest.mark.parametrize("past", ["8 bytes past", "at 2**63", "near 2**64"])
def test_grid_plan_with_an_offset_past_its_buffer_is_refused(side, i, past):
    layout, plan = _grid_plan()
    col = np.array(plan.column(f"{side}_offset"))
    buf = plan.buffers[int(plan.column(f"{side}_buf")[i])]
    col[i] = {"8 bytes past": buf.nbytes - 8, "at 2**63": 2**63, "near 2**64": 2**64 - 8}[past]
    bad = _hand_made(plan, **{f"{side}_offset": col})
    assert _is_grid(bad)
    bound = NumpyExecutor().bind(layout, _memory(layout))
    message = rf"^{side}_offset\[{i}\] = {int(col[i])}: range of 16 bytes runs past buffer '{buf.name}' of {buf.nbytes} bytes$"
    with pytest.raises(PlanError, match=message):
        bound.lower(bad)
    with pytest.raises(PlanError, match=message):
        bound.check(bad)
    with pytest.raises(PlanError, match=message):
        NumpyExecutor().run(bad, bound)


@pytest.mark.parametrize("runs", [False, True], ids=["dense", "run-length"])
@pytest.mark.parametrize("value, reason", [(0, "empty range"), (2**63, "range too large"), (2**64 - 1, "range too large")])
def test_grid_plan_with_a_bad_size_is_refused(value, reason, runs):
    layout, plan = _grid_plan()
    i = 37
    if runs:  # sizes run-length encoded, as the planner keeps them; the bad range is a run of its own
        nb = Runs(np.array([16, value, 16], dtype=np.uint64), np.array([i, 1, 64 - i - 1]))
    else:
        nb = np.array(plan.nbytes)
        nb[i] = value
    bad = _hand_made(plan, nbytes=nb)
    bound = NumpyExecutor().bind(layout, _memory(layout))
    for refuse in (bound.lower, bound.check):
        with pytest.raises(PlanError, match=rf"^nbytes\[{i}\] = {value}: {reason}$"):
            refuse(bad)


def test_empty_runs_of_zero_bytes_are_not_ranges():
    """A run-length size column may hold a run of length 0 with value 0: no range is empty."""
    layout, plan = _grid_plan()
    nb = Runs(np.array([16, 0, 16], dtype=np.uint64), np.array([30, 0, 34]))
    mem = _memory(layout)
    src, dst = NumpyExecutor().bind(layout, mem).lower(_hand_made(plan, nbytes=nb))
    want = _reference(plan, mem)
    assert np.array_equal(src, want[0]) and np.array_equal(dst, want[1])


# ---- 8. plans made by the planner ------------------------------------------------------------------------------
PLANNED = {
    "fast dense": (lambda: presets.kv_layout(4, 64, 16), lambda: presets.mapping("runs8", 24, 64, "h2d"), PlanOptions()),
    "fast no-coalesce": (lambda: presets.kv_layout(4, 64, 16), lambda: presets.mapping("fragmented", 24, 64, "d2h"),
                         PlanOptions(coalesce=False)),
    "fast split": (lambda: presets.page_first_layout(4, 64, 16), lambda: presets.mapping("contiguous", 24, 64),
                   PlanOptions(max_range_bytes=48)),
    "general chunked": (lambda: presets.chunked_layout(3, 64, 16, 4),
                        lambda: BlockMapping(direction="d2h", src_ids=np.arange(10), dst_ids=[3, 7, 9],
                                             group_sizes=[10], group_starts=[2]), PlanOptions()),
    "general fragments": (lambda: presets.tp_fragment_layout(2, 16, tokens=4, heads=4, head_bytes=8),
                          lambda: presets.mapping("runs8", 8, 16, "h2d"), PlanOptions(regions_per_call=1)),
}


@pytest.mark.parametrize("hot_dict", [False, True], ids=["BlockMapping", "dict"])
@pytest.mark.parametrize("name", sorted(PLANNED))
def test_planned_plans_are_read_only_and_round_trip(name, hot_dict, tmp_path):
    make_layout, make_mapping, options = PLANNED[name]
    layout, mapping = make_layout(), make_mapping()
    if hot_dict:
        groups = {} if mapping.group_sizes is None else {"group_sizes": mapping.group_sizes,
                                                          "group_starts": mapping.group_starts}
        plan = plan_transfer(layout, hot(mapping.direction, mapping.src_ids.copy(), mapping.dst_ids.copy(), **groups),
                             options=options)
    else:
        plan = plan_transfer(layout, mapping, options=options)
    for c, dtype in COLUMNS.items():
        col = plan.column(c)
        assert col.dtype == dtype and col.ndim == 1 and len(col) == plan.num_ranges
        assert not col.flags.writeable
        with pytest.raises(ValueError):
            col[:1] = 0
        assert plan.column(c) is col  # expanded once
    assert not plan.call_offsets.flags.writeable
    assert plan.check() is plan
    assert_plan_matches(plan, layout, mapping, options)
    fp = plan.fingerprint
    assert TransferPlan.from_npz_bytes(plan.to_npz_bytes()).fingerprint == fp
    assert TransferPlan.from_json(plan.to_json()).fingerprint == fp
    for suffix in (".npz", ".json"):
        assert TransferPlan.load(plan.save(tmp_path / f"plan{suffix}")).fingerprint == fp
    rebuilt = TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                           regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                           call_offsets=plan.call_offsets, columns={c: plan.column(c) for c in COLUMNS},
                           region_page_bytes=plan.region_page_bytes, aliases=plan.aliases,
                           region_writers=plan.region_writers)
    assert rebuilt.fingerprint == fp


def test_planned_columns_stay_read_only_when_expanded_by_threads():
    """Run-length columns expand into a cache of their own: the stored runs stay, reads give one array."""
    import threading

    plan = plan_transfer(presets.kv_layout(8, 256, 16), presets.mapping("fragmented", 100, 256))
    stored = plan.stored_nbytes
    got: list[np.ndarray] = []
    threads = [threading.Thread(target=lambda: got.append(plan.column("region"))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 4 and all(np.array_equal(g, got[0]) and not g.flags.writeable for g in got)
    dense = plan.num_ranges * sum(dtype.itemsize for dtype in COLUMNS.values()) + plan.call_offsets.nbytes
    assert plan.stored_nbytes == stored < dense  # still run-length encoded as stored
    assert plan.column("region").tolist() == np.repeat(np.arange(8), 100).tolist()


# ---- review findings: plans made with TransferPlan.planned are checked by executors; error order; huge ids ----
def _planned_copy(plan, **changes):
    fields = dict(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                  regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                  call_offsets=plan.call_offsets.copy(), region_page_bytes=plan.region_page_bytes,
                  aliases=plan.aliases, region_writers=plan.region_writers, api=plan.api,
                  passes_attrs=plan.passes_attrs,
                  columns={c: Runs(*plan.column_runs(c)) if c in ("src_buf", "dst_buf", "region", "attr", "nbytes")
                           else plan.column(c) for c in ("src_buf", "dst_buf", "src_offset", "dst_offset", "nbytes",
                                                         "region", "attr")})
    fields["columns"] |= changes.pop("columns", {})
    return TransferPlan.planned(**(fields | changes))


def _small_plan_and_memory():
    n = 4000
    layout = Layout(buffers=(Buffer(name="h", nbytes=n * 8, location=Location.HOST),
                             Buffer(name="d", nbytes=n * 8, location=Location.DEVICE)),
                    regions=(Region(name="r", page_bytes=8, device=Placement(buffer="d"), host=Placement(buffer="h")),))
    plan = plan_transfer(layout, {"direction": "h2d", "src_ids": np.arange(0, n, 2), "dst_ids": np.arange(0, n, 2)},
                         options=PlanOptions(coalesce=False))
    return layout, plan, {"h": np.zeros(n * 8, np.uint8), "d": np.zeros(n * 8, np.uint8)}


def test_planned_plan_with_short_buffer_runs_is_refused_by_every_executor_path():
    """A column whose runs cover fewer ranges than the offsets is refused, not lowered half-way: a planned plan
    counts as checked (the planner's construction proves it), so the values lowering reads are what refuse it."""
    layout, plan, mem = _small_plan_and_memory()
    n = plan.num_ranges
    bad = _planned_copy(plan, columns={"src_buf": Runs.of(np.array([0], np.int32), np.array([n // 2]))})
    assert bad.checked
    bound = NumpyExecutor().bind(layout, mem)
    for call in (lambda: bound.lower(bad, (np.empty(n, np.uint64), np.empty(n, np.uint64))),
                 lambda: bound.check(bad), lambda: NumpyExecutor().run(bad, bound)):
        with pytest.raises(PlanError, match="src_buf"):
            call()
    assert not mem["d"].any()


@pytest.mark.parametrize("offsets", [[0, 4096 + 2000], [0, 1000], [0, 0, 2000], [1, 2000], [0, 1500, 1000, 2000]])
def test_planned_plan_with_bad_call_offsets_is_refused(offsets):
    """Call offsets that do not rise strictly from 0 to the range count are refused before any copy."""
    layout, plan, mem = _small_plan_and_memory()
    bad = _planned_copy(plan, call_offsets=np.array(offsets, dtype=np.int64))
    bound = NumpyExecutor().bind(layout, mem)
    for call in (lambda: bound.lower(bad), lambda: bound.check(bad), lambda: NumpyExecutor().run(bad, bound)):
        with pytest.raises(PlanError, match="call_offsets"):
            call()


def test_a_planned_copy_of_a_good_plan_lowers_like_the_plan():
    """The helper above builds valid plans when nothing is changed (so the refusals are about the change)."""
    layout, plan, mem = _small_plan_and_memory()
    bound = NumpyExecutor().bind(layout, mem)
    same = _planned_copy(plan)
    assert same.fingerprint == plan.fingerprint
    for a, b in zip(bound.lower(same), bound.lower(plan)):
        assert np.array_equal(a, b)


def test_negative_id_is_named_before_unequal_lengths_on_the_hot_path():
    layout = presets.kv_layout(2, 16, 8)
    m = {"direction": "h2d", "src_ids": np.array([0, -1]), "dst_ids": np.array([0, 1, 2])}
    got = outcome(plan_transfer, layout, m)
    assert got == bm_outcome(plan_transfer, layout, "h2d", m["src_ids"], m["dst_ids"])
    assert got[0] == "MappingError" and "non-negative" in got[1]


def test_negative_id_is_named_before_bad_options_on_the_hot_path():
    layout = presets.kv_layout(2, 16, 8)
    m = {"direction": "h2d", "src_ids": np.array([0, -1]), "dst_ids": np.array([0, 1])}
    bad = {"max_range_bytes": -5}
    got = outcome(plan_transfer, layout, m, bad)
    assert got == bm_outcome(plan_transfer, layout, "h2d", m["src_ids"], m["dst_ids"], bad)
    assert got[0] == "MappingError"


def test_negative_ids_are_refused_on_a_layout_without_regions():
    layout = Layout(buffers=(Buffer(name="a", nbytes=16),), regions=())
    m = {"direction": "h2d", "src_ids": np.array([-3]), "dst_ids": np.array([0])}
    got = outcome(plan_transfer, layout, m)
    assert got == bm_outcome(plan_transfer, layout, "h2d", m["src_ids"], m["dst_ids"]) and got[0] == "MappingError"


def _byte_pairs(buffers, src_buf, src_offset, dst_buf, dst_offset, nbytes) -> list[tuple[str, int, str, int]]:
    return sorted((buffers[int(sb)], int(so) + i, buffers[int(db)], int(do) + i)
                  for sb, so, db, do, n in zip(src_buf, src_offset, dst_buf, dst_offset, nbytes) for i in range(int(n)))


@pytest.mark.parametrize("s, d", [([0, 5], [5, 0]), ([0, 1, 2], [2, 0, 1]), ([7, 8, 9, 1], [3, 4, 5, 0])])
def test_ids_above_2_to_62_plan_alike_in_every_form(s, d):
    """Buffers near 2^63 bytes with 1-byte pages: ids above 2^62 are still put in destination order, and the
    plan copies exactly the oracle's bytes (compared byte pair by byte pair: such buffers cannot be made)."""
    big = 2**63 - 1
    layout = Layout(buffers=(Buffer(name="dev", nbytes=big, location=Location.DEVICE),
                             Buffer(name="host", nbytes=big, location=Location.HOST)),
                    regions=(Region(name="r", page_bytes=1, device=Placement(buffer="dev"),
                                    host=Placement(buffer="host")),))
    top = 2**62
    s, d = np.array(s, np.int64) + top, np.array(d, np.int64) + top
    mapping = BlockMapping(direction="h2d", src_ids=s, dst_ids=d)
    plan = plan_transfer(layout, mapping)
    assert outcome(plan_transfer, layout, {"direction": "h2d", "src_ids": s, "dst_ids": d}) == plan.fingerprint
    assert outcome(plan_transfer, layout, mapping.model_dump()) == plan.fingerprint
    names = [b.name for b in layout.buffers]
    c = expected_copies(layout, mapping)
    assert _byte_pairs(names, plan.src_buf, plan.src_offset, plan.dst_buf, plan.dst_offset, plan.nbytes) == \
        _byte_pairs(names, c.src_buf, c.src_offset, c.dst_buf, c.dst_offset, c.nbytes)
    assert plan.dst_offset.tolist() == sorted(plan.dst_offset.tolist())
