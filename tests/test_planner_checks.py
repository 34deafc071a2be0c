"""What a plan must hold to, each checked against an expectation computed here (brute force or the oracle):
aliases are only exact aliases, a store never writes bytes it reads, ranges come in canonical (buffer-major)
order and overlapping writes are found wherever they sit in it, writer indices stay below their writer
counts, and the packed sort keys stay exact up to their documented limit and past it."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Fragment,
    Layout,
    LayoutError,
    Location,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    TargetError,
    plan_transfer,
)
from kvxfer.planner.columns import packed_limit, sort_by
from kvxfer.testing import assert_plan_matches, expected_copies, independent

from .test_planner_props import general_cases


# ---- aliases ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_regions_that_differ_only_in_their_fragments_both_move(direction):
    """Two regions on the same bytes of the same buffers whose fragments take different halves of the page are
    not aliases: each half moves."""
    halves = [(Fragment(local_offset=0, local_stride=0, canonical_offset=0, canonical_stride=0, fragment_bytes=8),),
              (Fragment(local_offset=8, local_stride=0, canonical_offset=8, canonical_stride=0, fragment_bytes=8),)]
    layout = Layout(buffers=[Buffer(name="g", nbytes=16 * 8), Buffer(name="h", nbytes=16 * 8, location=Location.HOST)],
                    regions=[Region(name=f"half{i}", page_bytes=16, host_page_bytes=16, fragments=f,
                                    device=Placement(buffer="g"), host=Placement(buffer="h"))
                             for i, f in enumerate(halves)])
    mapping = BlockMapping(direction=direction, src_ids=[1, 2, 5], dst_ids=[0, 3, 4])
    plan = plan_transfer(layout, mapping)
    assert plan.aliases == ()
    assert plan.total_bytes == 3 * 16 and plan.requested_copies == 6
    assert_plan_matches(plan, layout, mapping)


def test_exact_aliases_move_once():
    region = Region(name="a", page_bytes=16, device=Placement(buffer="g"), host=Placement(buffer="h"))
    layout = Layout(buffers=[Buffer(name="g", nbytes=16 * 8), Buffer(name="h", nbytes=16 * 8, location=Location.HOST)],
                    regions=[region, region.model_copy(update={"name": "b"})])
    plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[1, 2], dst_ids=[0, 3]))
    assert plan.aliases == (("b", "a"),) and plan.total_bytes == 2 * 16


# ---- a store never writes bytes it reads ------------------------------------------------------------------------
def _one_buffer_store(pages: list[int], reads: list[int], writes: list[int], size: int) -> Layout:
    """Regions that read X[reads[r], +pages[r]) (device side) and write X[writes[r], +pages[r]) (host side)."""
    return Layout(buffers=[Buffer(name="X", nbytes=size, location=Location.HOST)],
                  regions=[Region(name=f"r{r}", page_bytes=p, device=Placement(buffer="X", byte_offset=a),
                                  host=Placement(buffer="X", byte_offset=b))
                           for r, (p, a, b) in enumerate(zip(pages, reads, writes))])


def test_a_store_over_bytes_a_long_earlier_read_covers_is_refused():
    """Write X[48, 144) while one copy reads X[0, 96) and another, starting later, reads X[10, 20): the later
    read ends before the write, the long earlier one does not."""
    layout = _one_buffer_store([96, 96, 10], [0, 200, 10], [300, 48, 400], 500)
    mapping = BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0])
    assert not independent(expected_copies(layout, mapping))
    with pytest.raises(LayoutError, match=r"destination bytes \[48, 144\) of buffer 'X' overlap source bytes"):
        plan_transfer(layout, mapping)
    apart = _one_buffer_store([96, 96, 10], [0, 200, 10], [300, 96, 400], 500)  # the write moved past the read
    assert_plan_matches(plan_transfer(apart, mapping), apart, mapping)


@st.composite
def one_buffer_stores(draw) -> tuple[Layout, BlockMapping]:
    """2-5 regions of pages 4-96 bytes in one buffer: writes side by side (never over each other), reads anywhere,
    long and short; one or two blocks each."""
    n = draw(st.integers(2, 5))
    pages = [draw(st.sampled_from([4, 8, 16, 48, 96])) for _ in range(n)]
    blocks = draw(st.integers(1, 2))
    at = draw(st.integers(0, 64))
    writes = []
    for p in pages:
        writes.append(at)
        at += p * 2 + draw(st.sampled_from([0, 0, 4, 32]))
    size = max(at, 8) + 200
    reads = [draw(st.integers(0, size - 2 * p)) for p in pages]
    ids = draw(st.permutations([0, 1]))[:blocks]
    return _one_buffer_store(pages, reads, writes, size), BlockMapping(direction="d2h", src_ids=ids, dst_ids=sorted(ids))


def _reads_meet_writes(layout: Layout, mapping: BlockMapping) -> bool:
    """Brute force: some byte a copy writes is a byte some copy reads."""
    written, read = set(), set()
    for region in layout.regions:
        p = region.page_bytes
        for s, d in zip(mapping.src_ids.tolist(), mapping.dst_ids.tolist()):
            read |= set(range(region.device.byte_offset + s * p, region.device.byte_offset + (s + 1) * p))
            written |= set(range(region.host.byte_offset + d * p, region.host.byte_offset + (d + 1) * p))
    return bool(written & read)


@settings(max_examples=300, deadline=None)
@given(one_buffer_stores(), st.booleans())
def test_a_store_is_refused_exactly_when_its_writes_meet_its_reads(case, coalesce):
    layout, mapping = case
    options = PlanOptions(coalesce=coalesce)
    if _reads_meet_writes(layout, mapping):
        with pytest.raises(LayoutError, match="overlap source bytes of the same transfer"):
            plan_transfer(layout, mapping, options=options)
    else:
        assert_plan_matches(plan_transfer(layout, mapping, options=options), layout, mapping)


# ---- canonical order, and overlapping writes wherever they sit in it ---------------------------------------------
def _canonical(plan) -> bool:
    rpc = plan.options.regions_per_call
    group = plan.region // rpc if rpc else np.zeros(plan.num_ranges, np.int64)
    key = list(zip(group.tolist(), plan.dst_buf.tolist(), plan.dst_offset.tolist()))
    return key == sorted(key)


@settings(max_examples=200, deadline=None)
@given(general_cases())
def test_plans_come_in_canonical_order(case):
    """(call group, destination buffer, destination offset) rises through every plan: buffer-major, not
    offset-major, so ranges of one buffer are neighbours wherever the other buffers' ranges fall."""
    layout, mapping, options = case
    try:
        plan = plan_transfer(layout, mapping, options=options)
    except PlanError:
        assert not independent(expected_copies(layout, mapping, options))  # refused only for conflicting copies
        return
    assert _canonical(plan)
    for sl in plan.calls():  # calls never mix call groups
        if options.regions_per_call:
            assert len(set((plan.region[sl] // options.regions_per_call).tolist())) <= 1


def test_overlapping_writes_with_another_buffers_range_between_them_are_refused():
    """a writes X[0, 100), b writes X[50, 150); c writes Y[20, 30), whose offset falls between theirs: in
    offset-major order c would separate a and b; in buffer-major order they are neighbours and refused."""
    layout = Layout(
        buffers=[Buffer(name="X", nbytes=200, location=Location.HOST), Buffer(name="Y", nbytes=200, location=Location.HOST),
                 *(Buffer(name=f"g{r}", nbytes=1000) for r in range(3))],
        regions=[Region(name="a", page_bytes=100, device=Placement(buffer="g0"), host=Placement(buffer="X")),
                 Region(name="b", page_bytes=100, device=Placement(buffer="g1"), host=Placement(buffer="X", byte_offset=50)),
                 Region(name="c", page_bytes=10, device=Placement(buffer="g2"), host=Placement(buffer="Y", byte_offset=20))])
    mapping = BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0])
    assert not independent(expected_copies(layout, mapping))
    with pytest.raises(LayoutError, match=r"regions\[1\] = 'b': writes bytes at offset 50 of buffer 'X' that region 'a' also writes"):
        plan_transfer(layout, mapping)


# ---- writer indices ---------------------------------------------------------------------------------------------
def _writers_layout(**region_writers: int) -> Layout:
    return Layout(buffers=[Buffer(name="g", nbytes=64), Buffer(name="h", nbytes=64, location=Location.HOST)],
                  regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h"),
                                  **region_writers)])


@pytest.mark.parametrize("writers", [1, 2, 3])
def test_a_writer_index_equal_to_the_writer_count_is_refused(writers):
    with pytest.raises(LayoutError, match=rf"writer_index = {writers}: must be below num_writers {writers}"):
        _writers_layout(num_writers=writers, writer_index=writers)
    with pytest.raises(TargetError, match=rf"writer_index = {writers}: must be below num_writers {writers}"):
        PlanOptions(num_writers=writers, writer_index=writers)
    _writers_layout(num_writers=writers, writer_index=writers - 1)  # the last index that is a writer
    mapping = BlockMapping(direction="d2h", src_ids=[0, 1, 2], dst_ids=[0, 1, 2])
    # the region's count with the plan's index (the plan allows one more writer): refused on stores, except
    # that one writer means every rank writes the region (rank-private), whatever the index
    region = _writers_layout(num_writers=writers)
    options = PlanOptions(num_writers=writers + 1, writer_index=writers)
    if writers == 1:
        assert_plan_matches(plan_transfer(region, mapping, options=options), region, mapping, options)
    else:
        with pytest.raises(LayoutError, match=rf"regions\[0\]\.writer_index = {writers}: must be below num_writers {writers}"):
            plan_transfer(region, mapping, options=options)
    options = PlanOptions(num_writers=writers + 1, writer_index=writers - 1)
    assert_plan_matches(plan_transfer(region, mapping, options=options), region, mapping, options)


# ---- packed sort keys -------------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.integers(1, 64), st.data())
def test_packed_sort_keys_stay_exact_between_the_limit_and_four_times_it(n, data):
    limit = packed_limit(n)
    top = min(4 * limit, 2**63 - 1)  # ids are int64: a limit near 2^63 leaves less than 4x above it
    d = np.array(data.draw(st.lists(st.integers(limit // 2, top), min_size=n, max_size=n)), dtype=np.int64)
    d[data.draw(st.integers(0, n - 1))] = data.draw(st.sampled_from([limit - 1, min(limit, top), top - 1]))
    s = np.arange(n, dtype=np.int64) * 3 + 1
    o = np.argsort(d, kind="stable")
    got_d, got_s = sort_by(d, s)
    assert got_d.tolist() == d[o].tolist() and got_s.tolist() == s[o].tolist()


@pytest.mark.parametrize("scale", [1, 2, 3, 4])
def test_ids_around_the_packed_limit_plan_in_destination_order(scale):
    """Ids from just below the packed limit to 4x it, listed out of order, on buffers near 2^63 bytes with
    1-byte pages: the plan copies the oracle's byte pairs, in destination order."""
    n = 6
    limit = packed_limit(n)
    big = 2**63 - 1
    layout = Layout(buffers=[Buffer(name="dev", nbytes=big), Buffer(name="host", nbytes=big, location=Location.HOST)],
                    regions=[Region(name="r", page_bytes=1, device=Placement(buffer="dev"), host=Placement(buffer="host"))])
    base = scale * limit - 3
    d = np.array([5, 0, 3, 1, 4, 2], dtype=np.int64) * 7 + base
    s = np.array([2, 9, 4, 0, 7, 1], dtype=np.int64) + base
    mapping = BlockMapping(direction="h2d", src_ids=s, dst_ids=d)
    plan = plan_transfer(layout, mapping)
    assert plan.dst_offset.tolist() == sorted(d.tolist())
    want = expected_copies(layout, mapping)
    assert sorted(zip(plan.src_offset.tolist(), plan.dst_offset.tolist())) == \
        sorted(zip(want.src_offset.tolist(), want.dst_offset.tolist()))
