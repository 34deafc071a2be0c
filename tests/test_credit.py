"""A range over several regions' pages (K and V of a block side by side) counts for each region in the views, by
its bytes there; the transfer map's one-region panel is drawn in block ids, not buffer offsets."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.planner import BlockMapping, Buffer, Layout, Location, Placement, Region, Target, plan_transfer, presets
from kvxfer.planner.credit import region_credit
from kvxfer.planner.render import explain, run_length_histogram, stats

CUDA = Target(platform="cuda", runtime_version="13.0")
P = 1024
N = 16


def side_by_side(pages: tuple[int, ...] = (P, P), names: str = "KV") -> Layout:
    """Regions whose pages of one block lie back to back on both sides (rows of sum(pages) bytes per block)."""
    row = sum(pages)
    bufs = (Buffer(name="gpu", nbytes=N * row), Buffer(name="cpu", nbytes=N * row, location=Location.HOST))
    at = np.concatenate(([0], np.cumsum(pages)[:-1])).tolist()
    return Layout(buffers=bufs, regions=tuple(
        Region(name=n, page_bytes=p, device=Placement(buffer="gpu", byte_offset=o, stride_bytes=row),
               host=Placement(buffer="cpu", byte_offset=o, stride_bytes=row)) for n, p, o in zip(names, pages, at)))


RUNS = BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3, 9], dst_ids=[4, 5, 6, 7, 1])


def test_k_and_v_side_by_side_merge_into_ranges_that_count_for_both():
    layout = side_by_side()
    plan = plan_transfer(layout, RUNS, CUDA)
    assert set(plan.region.tolist()) == {0}  # the plan records only K: the ranges cross into V's pages
    per = stats(plan, layout)["per_region"]
    assert per == {"K": {"ranges": 2, "bytes": 5 * P}, "V": {"ranges": 2, "bytes": 5 * P}}
    assert sum(v["bytes"] for v in per.values()) == plan.total_bytes
    table = explain(plan, layout=layout).splitlines()[-2:]
    assert [line.split()[-1] for line in table] == ["K+V", "K+V"]
    assert [int(line.split()[-2]) for line in table] == [2, 8]  # blocks: K's and V's copies
    assert run_length_histogram(plan, layout) == {2: 1, 8: 1}
    assert stats(plan)["per_region"] == {"K": {"ranges": 2, "bytes": 10 * P}}  # without the layout: as recorded


def test_regions_with_other_page_sizes_get_their_own_bytes():
    layout = side_by_side((P, 3 * P))
    plan = plan_transfer(layout, RUNS, CUDA)
    per = stats(plan, layout)["per_region"]
    assert per["K"]["bytes"] == 5 * P and per["V"]["bytes"] == 5 * 3 * P
    assert run_length_histogram(plan, layout) == {2: 1, 8: 1}  # one K and one V copy per block, whatever the size


@pytest.mark.parametrize(("names", "label"), [("abc", "a+b+c"), ("abcd", "a+3 more"), ("abcdef", "a+5 more")])
def test_a_block_major_row_of_many_regions_names_them_up_to_three(names, label):
    layout = side_by_side((P,) * len(names), names)
    plan = plan_transfer(layout, RUNS, CUDA)
    assert [" ".join(line.split()[6:]) for line in explain(plan, layout=layout).splitlines()[-2:]] == [label] * 2
    per = stats(plan, layout)["per_region"]
    assert per == {n: {"ranges": 2, "bytes": 5 * P} for n in names}
    pytest.importorskip("pandas", reason="stats_frame needs pandas")
    from kvxfer.planner.render import stats_frame

    assert stats_frame(plan, "range", layout)["region"].tolist() == [label] * 2
    assert stats_frame(plan, "region", layout)["bytes"].sum() == plan.total_bytes


@pytest.mark.parametrize("seed", range(6))
def test_each_region_is_credited_exactly_its_copies(seed):
    """Whatever merges, region r moves (pairs) x (its page) bytes: a count taken from the mapping, not the plan."""
    rng = np.random.default_rng(seed)
    pages = tuple(int(p) for p in rng.choice([P, 2 * P, 512], size=int(rng.integers(2, 5))))
    layout = side_by_side(pages, "abcd"[:len(pages)])
    n = int(rng.integers(1, N))
    src = rng.permutation(N)[:n] if seed % 2 else np.sort(rng.choice(N, n, replace=False))
    dst = np.arange(n) + int(rng.integers(0, N - n + 1))
    plan = plan_transfer(layout, BlockMapping(direction=("h2d", "d2h")[seed % 2], src_ids=src, dst_ids=dst), CUDA)
    credit = region_credit(plan, layout)
    assert np.bincount(credit.region, weights=credit.nbytes, minlength=len(pages)).tolist() == [n * p for p in pages]
    assert np.bincount(credit.range, weights=credit.nbytes, minlength=plan.num_ranges).tolist() == plan.nbytes.tolist()


def test_a_layout_that_is_not_the_plans_is_refused():
    plan = plan_transfer(side_by_side(), RUNS, CUDA)
    with pytest.raises(ValueError, match="layout.buffers"):
        region_credit(plan, side_by_side().model_copy(update={"buffers": side_by_side().buffers[::-1]}))


# ---- the transfer map -------------------------------------------------------------------------------------
def test_the_v_row_of_the_map_shows_its_share():
    pytest.importorskip("matplotlib", reason="the transfer map needs matplotlib (the viz extra)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvxfer.planner.viz import range_strips, transfer_map

    layout = side_by_side()
    plan = plan_transfer(layout, RUNS, CUDA)
    s = range_strips(plan, layout)
    assert np.bincount(s["row"], weights=s["blocks"]).tolist() == [5, 5]  # each region: its 5 copies
    fig = transfer_map(plan, layout=layout)
    FigureCanvasAgg(fig).draw()
    image = fig.axes[0].get_images()[0].get_array()
    assert image[1, :, 3].any() and (image[0, :, 3] > 0).sum() == (image[1, :, 3] > 0).sum()  # V painted like K


def test_the_region_panel_is_in_block_ids_of_each_side():
    pytest.importorskip("matplotlib", reason="the transfer map needs matplotlib (the viz extra)")
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    from kvxfer.planner.viz import region_segments, transfer_map

    layout = presets.kv_layout(4, 64, 4096)  # host: one buffer, region r from block r * 64 of it
    mapping = presets.mapping("interleaved", 24, 64)
    plan = plan_transfer(layout, mapping, CUDA)
    seg = region_segments(plan, 3, layout)
    src, dst = mapping.src_ids, mapping.dst_ids
    pairs = {(int(a), int(b)) for x0, x1, y0, y1 in zip(seg["x0"], seg["x1"], seg["y0"], seg["y1"])
             for a, b in zip(np.arange(x0, x1), np.arange(y0, y1))}
    assert pairs == set(zip(src.tolist(), dst.tolist()))  # every block id pair of the mapping, and only those
    fig = transfer_map(plan, layout=layout, region=3)
    FigureCanvasAgg(fig).draw()
    one = fig.axes[2]
    assert one.get_xlabel().startswith("source block id (cpu") and one.get_ylabel().startswith("destination block id")
    assert -4 <= one.get_xlim()[0] and one.get_xlim()[1] <= 64 + 4  # ids, not region 3's offset in the host buffer
    bare = transfer_map(plan, region=3)
    assert bare.axes[2].get_xlabel().startswith("source page offset")  # without the layout it says what it shows


def test_chunk_ids_where_a_side_holds_chunks():
    pytest.importorskip("matplotlib", reason="the transfer map needs matplotlib (the viz extra)")
    from kvxfer.planner.viz import region_segments, transfer_map

    layout = presets.chunked_layout(4, 32, 1024, blocks_per_chunk=4)
    mapping = BlockMapping(direction="h2d", src_ids=[5, 1, 2], dst_ids=[9, 10, 11, 12, 13, 20, 21, 22],
                           group_sizes=[8], group_starts=[2])
    plan = plan_transfer(layout, mapping, CUDA)
    seg = region_segments(plan, 0, layout)
    # chunk 5 from its page 2, chunk 1 whole, chunk 2's first two pages: in chunk ids, quarter by quarter
    spans = sorted(zip(seg["x0"].tolist(), seg["x1"].tolist()))
    assert spans[0][0] == 1.0 and spans[-1] == (5.5, 6.0) and sum(b - a for a, b in spans) == 2.0
    assert sorted(zip(seg["y0"].tolist(), seg["y1"].tolist())) == [(9.0, 11.0), (11.0, 14.0), (20.0, 23.0)]
    assert transfer_map(plan, layout=layout, region=0).axes[2].get_xlabel().startswith("source chunk id")
