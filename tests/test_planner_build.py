"""The builder (``kvxfer.planner.build``): checked pages become the fewest ranges, in canonical order, cut into
calls. Merging within and across regions (ascending, descending, interleaved runs; back-to-back regions; page-
first layouts; fragments that chain across pages), splitting at ``max_range_bytes``, no merging when
``coalesce`` is off or across call boundaries, and one assembler: a paged layout's rows give the plan every
other route gives. Expected results come from the oracle (``kvxfer.testing``) or are worked out here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Fragment,
    Layout,
    Placement,
    PlanOptions,
    Region,
    plan_transfer,
    presets,
)
from kvxfer.testing import assert_plan_matches, expected_copies, min_ranges, random_buffers

from .test_layouts import run_and_compare
from .test_planner_props import check_case


# ---- merging: the examples of the issue, runs in any order -------------------------------------------------
def two_region_layout(blocks: int = 20) -> Layout:
    """Two regions with 3- and 5-byte pages, each in its own pair of buffers."""
    return Layout(
        buffers=[Buffer(name="g0", nbytes=3 * blocks), Buffer(name="g1", nbytes=5 * blocks),
                 Buffer(name="h0", nbytes=3 * blocks, location="host"), Buffer(name="h1", nbytes=5 * blocks, location="host")],
        regions=[Region(name="a", page_bytes=3, device=Placement(buffer="g0"), host=Placement(buffer="h0")),
                 Region(name="b", page_bytes=5, device=Placement(buffer="g1"), host=Placement(buffer="h1"))])


@pytest.mark.parametrize("src,dst,calls", [
    ([1], [2], [2]),
    ([1, 2, 3], [5, 6, 7], [2]),
    ([1, 2, 3], [2, 4, 6], [3, 3]),
    ([3, 2, 1], [6, 5, 4], [2]),
    ([1, 1, 2], [2, 4, 5], [3, 1]),
    ([0, 2, 1, 3], [10, 12, 11, 13], [2]),
])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_issue_examples(src, dst, calls, direction):
    layout = two_region_layout()
    mapping = BlockMapping(direction=direction, src_ids=src, dst_ids=dst)
    plan = plan_transfer(layout, mapping, options=PlanOptions(max_descriptors=3))
    assert plan.call_sizes.tolist() == calls
    assert plan.num_ranges == min_ranges(expected_copies(layout, mapping))
    assert_plan_matches(plan, layout, mapping)


def test_descending_run_starts_at_lower_endpoints():
    plan = plan_transfer(two_region_layout(), BlockMapping(direction="h2d", src_ids=[9, 8, 7], dst_ids=[4, 3, 2]))
    assert plan.num_ranges == 2
    assert plan.src_offset.tolist() == [7 * 3, 7 * 5] and plan.dst_offset.tolist() == [2 * 3, 2 * 5]
    assert plan.nbytes.tolist() == [9, 15]


def test_max_range_bytes_splits_exactly():
    layout = presets.kv_layout(2, 64, 96)
    mapping = presets.mapping("contiguous", 20, 64)
    whole = plan_transfer(layout, mapping)
    split = plan_transfer(layout, mapping, options=PlanOptions(max_range_bytes=500))
    assert whole.num_ranges == 2 and split.num_ranges == 2 * -(-20 * 96 // 500)
    assert int(split.nbytes.max()) == 500 and split.total_bytes == whole.total_bytes
    bufs_a, bufs_b = random_buffers(layout, 1), random_buffers(layout, 1)
    NumpyExecutor().run(whole, bufs_a)
    NumpyExecutor().run(split, bufs_b)
    for k in bufs_a:
        np.testing.assert_array_equal(bufs_a[k], bufs_b[k])


def test_no_coalesce_gives_one_range_per_block_copy():
    layout = presets.kv_layout(3, 32, 16)
    plan = plan_transfer(layout, presets.mapping("contiguous", 10, 32), options=PlanOptions(coalesce=False))
    assert plan.num_ranges == plan.requested_copies == 30


def test_cross_region_merge_in_one_allocation():
    # regions back to back in one device allocation and one host allocation: block 15 of region r and
    # block 0 of region r+1 are adjacent on both sides, so a full-region copy becomes one range
    layout = presets.kv_layout(4, 16, 32, shared_device=True, shared_host=True)
    ids = np.arange(16)
    plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids))
    assert plan.num_ranges == 1 and plan.total_bytes == 4 * 16 * 32
    # separate device tensors: nothing merges across buffers
    layout2 = presets.kv_layout(4, 16, 32, shared_device=False, shared_host=True)
    assert plan_transfer(layout2, BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids)).num_ranges == 4


def test_order_independence_and_determinism():
    layout = presets.kv_layout(5, 64, 8)
    s, d = presets.block_pattern("runs8", 24, 64, seed=3)
    p = np.random.default_rng(0).permutation(24)
    a = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=s, dst_ids=d))
    b = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=s[p], dst_ids=d[p]))
    assert a == b and a.fingerprint == b.fingerprint
    assert a.fingerprint == plan_transfer(layout, BlockMapping(direction="h2d", src_ids=s.tolist(), dst_ids=d.tolist())).fingerprint


# ---- chunks, pieces and layouts whose ranges cross regions ------------------------------------------------------
def test_padded_rows_do_not_merge_across_chunks():
    layout = Layout(buffers=[Buffer(name="g", nbytes=64 * 8), Buffer(name="h", nbytes=64 * 12, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                    host=Placement(buffer="h", blocks_per_chunk=4, stride_bytes=40))])
    m = BlockMapping(direction="h2d", src_ids=[2, 3], dst_ids=np.arange(8), group_sizes=[8])
    plan, _, best = run_and_compare(layout, m)
    assert plan.num_ranges == best == 2
    dense = layout.model_copy(update={"regions": (layout.regions[0].model_copy(update={"host": Placement(buffer="h", blocks_per_chunk=4)}),)})
    assert plan_transfer(dense, m).num_ranges == 1


def test_unmerged_plans_keep_every_declared_piece():
    frags = tuple(Fragment(local_offset=4 * i, local_stride=0, canonical_offset=4 * i, canonical_stride=0, fragment_bytes=4)
                  for i in range(4))  # four pieces that touch: one whole page when merged
    layout = Layout(buffers=[Buffer(name="g", nbytes=256), Buffer(name="h", nbytes=256, location="host")],
                    regions=[Region(name="r", page_bytes=16, device=Placement(buffer="g"), host=Placement(buffer="h"),
                                    fragments=frags)])
    m = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[2, 3])
    assert plan_transfer(layout, m, options=PlanOptions(coalesce=False)).num_ranges == 8
    assert plan_transfer(layout, m).num_ranges == 1


def test_page_first_layout_merges_across_layers():
    layers, page, blocks = 6, 16, 32
    row = layers * page
    layout = Layout(buffers=[Buffer(name="g", nbytes=row * blocks), Buffer(name="h", nbytes=row * blocks, location="host")],
                    regions=[Region(name=f"l{i}", page_bytes=page, device=Placement(buffer="g", byte_offset=i * page, stride_bytes=row),
                                    host=Placement(buffer="h", byte_offset=i * page, stride_bytes=row)) for i in range(layers)])
    m = BlockMapping(direction="h2d", src_ids=np.arange(4, 12), dst_ids=np.arange(20, 28))
    plan, copies, best = run_and_compare(layout, m)
    assert plan.num_ranges == best == 1 and plan.requested_copies == layers * 8
    per_layer = plan_transfer(layout, m, options=PlanOptions(regions_per_call=1))
    assert per_layer.num_calls == layers and per_layer.num_ranges == layers * 8  # no merge across calls
    two = plan_transfer(layout, m, options=PlanOptions(regions_per_call=2, max_descriptors=5))
    assert two.call_sizes.tolist() == [5, 3, 5, 3, 5, 3]  # 8 merged ranges per 2-layer call, capped at 5
    assert set(two.region[two.call_offsets[1]:two.call_offsets[2]].tolist()) <= {0, 1}


@pytest.mark.parametrize("per_call, cap", [(1, 3), (2, 5), (3, 4), (2, 7), (4, 16)])
@pytest.mark.parametrize("pattern", ["fragmented", "runs8"])
def test_calls_are_cut_at_each_call_group_and_every_cap_ranges_from_its_start(pattern, per_call, cap):
    """The documented cut rule, computed here from the plan's regions: a call ends where the call group (region //
    regions_per_call) changes and after every ``cap`` ranges counted from that group's first range, never from
    the plan's start."""
    from kvxfer.planner import presets

    layout = presets.kv_layout(8, 32, 64)
    plan = plan_transfer(layout, presets.mapping(pattern, 13, 32, seed=per_call),
                         options=PlanOptions(regions_per_call=per_call, max_descriptors=cap))
    group = plan.region // per_call
    starts = np.flatnonzero(np.concatenate(([True], group[1:] != group[:-1])))
    ends = np.append(starts[1:], plan.num_ranges)
    want = [int(c) for a, b in zip(starts.tolist(), ends.tolist()) for c in range(a, b, cap)] + [plan.num_ranges]
    assert any((b - a) % cap for a, b in zip(starts, ends)), "no group whose size is off the cap: the rule is untested"
    assert plan.call_offsets.tolist() == want


def test_layer_wise_calls_follow_region_order():
    from kvxfer.planner import presets
    layout = presets.kv_layout(8, 32, 64)
    plan = plan_transfer(layout, presets.mapping("runs8", 12, 32), options=PlanOptions(regions_per_call=2))
    assert plan.num_calls == 4
    for c, sl in enumerate(plan.calls()):
        assert set(plan.region[sl].tolist()) <= {2 * c, 2 * c + 1}
    run_and_compare(layout, presets.mapping("runs8", 12, 32), PlanOptions(regions_per_call=2))


# ---- fragments that chain across pages ----------------------------------------------------------------------
def test_ranges_merge_across_region_boundaries():
    """Two regions back to back on both sides, host chunks of 2 pages: one range covers both regions."""
    regions = [Region(name=f"r{i}", page_bytes=8, device=Placement(buffer="d", byte_offset=32 * i),
                      host=Placement(buffer="h", byte_offset=32 * i, blocks_per_chunk=2)) for i in range(2)]
    layout = Layout(buffers=[Buffer(name="d", nbytes=64), Buffer(name="h", nbytes=64, location="host")], regions=regions)
    m = BlockMapping(direction="h2d", src_ids=[1, 0], dst_ids=[2, 3, 0, 1], group_sizes=[4])
    plan = check_case(layout, m)
    assert plan is not None and plan.num_ranges == 1 and plan.nbytes.tolist() == [64]


def test_fragments_of_one_repeated_source_page_chain_across_destination_pages():
    """Found by the merged property: a page cut in two pieces whose device halves swap places on the host, and
    one device page stored to four host pages. The second piece of host page c and the first of page c+1 are
    contiguous on both sides (device bytes [0, 4), host bytes [8c + 6, 8c + 10)), so 5 ranges suffice."""
    def piece(local: int, canonical: int) -> Fragment:
        return Fragment(local_offset=local, local_stride=0, canonical_offset=canonical, canonical_stride=0, fragment_bytes=2)
    layout = Layout(buffers=[Buffer(name="d", nbytes=64), Buffer(name="h", nbytes=64, location="host")],
                    regions=[Region(name="r", page_bytes=4, host_page_bytes=8, fragments=(piece(2, 0), piece(0, 6)),
                                    device=Placement(buffer="d", stride_bytes=8), host=Placement(buffer="h"))])
    m = BlockMapping(direction="d2h", src_ids=[0, 0, 0, 0], dst_ids=[0, 1, 2, 3])
    assert min_ranges(expected_copies(layout, m)) == 5
    plan = check_case(layout, m)
    assert plan is not None and plan.num_ranges == 5


@pytest.mark.parametrize("src_ids", [[0, 1, 0, 0], [0, 1, 2, 3], [3, 3, 1, 1], [0, 0, 0, 0]])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_fragments_chain_only_where_neighbouring_pages_read_one_source_page(src_ids, direction):
    """The same page shape as above with source pages repeated on some neighbouring destination pages only
    (or on none): the plan has the fewest ranges the oracle's copies allow, in both directions."""
    def piece(local: int, canonical: int) -> Fragment:
        return Fragment(local_offset=local, local_stride=0, canonical_offset=canonical, canonical_stride=0, fragment_bytes=2)
    if direction == "d2h":
        dev, host, pieces = Placement(buffer="d", stride_bytes=8), Placement(buffer="h"), (piece(2, 0), piece(0, 6))
    else:  # device pages back to back now; the second device half reads the first host half of the same page
        dev, host, pieces = Placement(buffer="d"), Placement(buffer="h", stride_bytes=16), (piece(0, 2), piece(2, 0))
    layout = Layout(buffers=[Buffer(name="d", nbytes=64), Buffer(name="h", nbytes=64, location="host")],
                    regions=[Region(name="r", page_bytes=4, host_page_bytes=8, fragments=pieces, device=dev, host=host)])
    m = BlockMapping(direction=direction, src_ids=src_ids, dst_ids=[0, 1, 2, 3])
    check_case(layout, m)


# ---- one assembler ------------------------------------------------------------------------------------------
PATTERNS = ["contiguous", "runs8", "fragmented", "descending", "interleaved"]


def _ids(pattern: str, n: int, blocks: int) -> tuple[np.ndarray, np.ndarray]:
    if pattern == "descending":
        return np.arange(n)[::-1] + 7, np.arange(n)[::-1] + 3
    if pattern == "interleaved":  # two ascending runs, alternating in the list
        a, b = np.arange(0, n, 2), np.arange(1, n, 2)
        return np.concatenate([a, b + blocks // 2])[np.argsort(np.concatenate([a, b]))], np.arange(n)
    return presets.block_pattern(pattern, n, blocks, seed=5)


@pytest.mark.parametrize("pattern", PATTERNS)
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("coalesce", [True, False])
@pytest.mark.parametrize("shared", [False, True], ids=["a buffer per region", "regions back to back"])
def test_a_paged_layouts_rows_give_the_plan_the_general_route_gives(pattern, direction, coalesce, shared):
    """A paged layout takes its regions as one block of rows; declaring a second KV-cache group with no regions
    sends the same transfer through the general route (page runs per writer set, parts in region order). Both
    go through the one assembler and must give the same plan, which moves the oracle's bytes."""
    paged = presets.kv_layout(6, 64, 32, shared_device=shared, shared_host=shared)
    general = paged.model_copy(update={"num_groups": 2})
    s, d = _ids(pattern, 16, 64)
    src, dst = (s, d) if direction == "h2d" else (d, s)
    options = PlanOptions(coalesce=coalesce)
    rows = plan_transfer(paged, BlockMapping(direction=direction, src_ids=src, dst_ids=dst), options=options)
    parts = plan_transfer(general, BlockMapping(direction=direction, src_ids=src, dst_ids=dst, group_sizes=[16, 0]),
                          options=options)
    assert [rows.column(c).tolist() for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region")] \
        == [parts.column(c).tolist() for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes", "region")]
    assert rows.call_offsets.tolist() == parts.call_offsets.tolist()
    assert_plan_matches(rows, paged, BlockMapping(direction=direction, src_ids=src, dst_ids=dst), options)
