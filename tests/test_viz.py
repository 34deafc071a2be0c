"""The transfer map: ranges laid out per region (merging visible), range sizes, call boundaries and one region's
source/destination plane; legible from 1 region to 118, with nothing clipped and axes that fit the data."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.planner import PlanOptions, Target, hip_version, plan_transfer, presets
from kvxfer.planner.render import block_bytes

pytest.importorskip("matplotlib", reason="the transfer map needs matplotlib (the viz extra)")

from kvxfer.planner.viz import STRIP_COLUMNS, range_strips, save_transfer_map, transfer_map

ROCM = Target(platform="rocm", runtime_version=hip_version(7, 16))


def small(regions: int = 1, pattern: str = "interleaved", cap: int = 3, **options):
    return plan_transfer(presets.kv_layout(regions, 64, 4096), presets.mapping(pattern, 24, 64), ROCM,
                         PlanOptions(max_descriptors=cap, **options))


def large(pattern: str = "runs8", **options):
    return plan_transfer(presets.kv_layout(118, 512), presets.mapping(pattern, 256, 512), ROCM, PlanOptions(**options))


def drawn(plan):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = transfer_map(plan)
    FigureCanvasAgg(fig).draw()  # render as a PNG would be, so extents are final
    strips, sizes, one = fig.axes
    return fig, strips, sizes, one


def test_strips_lay_each_regions_ranges_end_to_end_in_plan_order():
    plan = small(regions=4, cap=6)
    s = range_strips(plan)
    assert np.allclose(s["blocks"], plan.nbytes / 4096)
    for r in range(4):
        mine = np.flatnonzero(s["row"] == r)  # plan order
        assert np.allclose(s["start"][mine], np.concatenate(([0], np.cumsum(s["blocks"][mine])[:-1])))
        assert s["blocks"][mine].sum() == 24  # every copy of the region, once
        assert s["shade"][mine].tolist() == [i % 2 for i in range(len(mine))]
    assert s["call"].tolist() == (np.searchsorted(plan.call_offsets, np.arange(plan.num_ranges), "right") - 1).tolist()


def _row_segments(image: np.ndarray, row: int) -> int:
    """Runs of one colour along a row of the strip raster: what the eye sees as segments."""
    px = image[row]
    return 1 + int(np.any(px[1:] != px[:-1], axis=1).sum())


@pytest.mark.parametrize("make", [small, lambda: large("runs8"), lambda: large("contiguous")],
                         ids=["1 region", "118 regions, runs of 8", "118 regions, merged"])
def test_each_range_is_one_segment_of_its_row(make):
    plan = make()
    _, strips, _, _ = drawn(plan)
    image = strips.get_images()[0].get_array()
    assert image.shape[:2] == (len(plan.regions), STRIP_COLUMNS)
    per_region = np.bincount(plan.region, minlength=len(plan.regions))
    for r in (0, len(plan.regions) - 1):
        assert _row_segments(image, r) == per_region[r]  # merging is visible: fewer ranges, fewer segments


def test_merged_and_unmerged_plans_look_different():
    merged, unmerged = large("runs8"), large("runs8", coalesce=False)
    a = drawn(merged)[1].get_images()[0].get_array()
    b = drawn(unmerged)[1].get_images()[0].get_array()
    assert _row_segments(a, 0) == 32 and _row_segments(b, 0) == 256


@pytest.mark.parametrize("make", [small, lambda: small(regions=4, cap=6), lambda: large("fragmented"),
                                  lambda: large("contiguous", regions_per_call=1)],
                         ids=["1 region", "4 regions", "118 regions fragmented", "118 per-layer calls"])
def test_nothing_is_clipped_and_the_axes_fit_the_data(make):
    plan = make()
    fig, strips, sizes, one = drawn(plan)
    renderer = fig.canvas.get_renderer()
    drawn_box, page = fig.get_tightbbox(renderer), fig.bbox_inches  # everything drawn, in inches
    assert page.x0 - 0.01 <= drawn_box.x0 and drawn_box.x1 <= page.x1 + 0.01
    assert page.y0 - 0.01 <= drawn_box.y0 and drawn_box.y1 <= page.y1 + 0.01
    for ax in fig.axes:  # labels inside an axes (range sizes, counts) stay inside it
        frame = ax.get_window_extent(renderer)
        for t in ax.texts:
            e = t.get_window_extent(renderer)
            assert frame.x0 - 1 <= e.x0 and e.x1 <= frame.x1 + 1 and frame.y0 - 1 <= e.y0 and e.y1 <= frame.y1 + 1
    s = range_strips(plan)
    longest = np.bincount(s["row"], weights=s["blocks"]).max()
    assert strips.get_xlim() == (0, longest)  # the strip axis ends where the longest row does
    r = int(np.argmax(np.bincount(plan.region)))
    sel = plan.region == r
    unit = block_bytes(plan)[sel]
    lo, hi = (plan.src_offset[sel] / unit).min(), ((plan.src_offset[sel] + plan.nbytes[sel]) / unit).max()
    x0, x1 = one.get_xlim()
    assert x0 <= lo and hi <= x1 and (x1 - x0) <= 1.2 * (hi - lo) + 2  # the plane fits its region, not the buffer
    labels = [t for t in strips.get_yticklabels() if t.get_text()]
    extents = sorted((t.get_window_extent(renderer) for t in labels), key=lambda e: e.y0)
    assert all(a.y1 <= b.y0 + 0.5 for a, b in zip(extents, extents[1:]))  # region names never overlap


def test_call_starts_are_marked_and_the_legend_names_the_calls():
    plan = small(cap=3)  # 4 ranges in calls of 3 and 1
    fig, strips, _, _ = drawn(plan)
    ticks = [c for c in strips.collections if c.get_segments()]
    assert len(ticks) == 1 and len(ticks[0].get_segments()) == plan.num_calls - 1
    (x, _), _ = ticks[0].get_segments()[0]
    assert x == range_strips(plan)["start"][plan.call_offsets[1]]
    legend = fig.legends[0]
    assert [t.get_text() for t in legend.get_texts()] == ["call 0: 3 ranges", "call 1: 1 range"]
    many = drawn(large("contiguous", regions_per_call=1))[0].legends[0]
    assert "118 driver calls" in many.get_title().get_text()


def test_range_sizes_count_every_range():
    plan = large("runs8")
    _, _, sizes, _ = drawn(plan)
    heights = [p.get_height() for p in sizes.patches]
    assert heights == [plan.num_ranges] and [t.get_text() for t in sizes.get_xticklabels()] == ["8"]


def test_saved_as_png(tmp_path):
    out = save_transfer_map(small(), tmp_path / "map.png")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
