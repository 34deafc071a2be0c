"""The transfer map: one band per range on the (source block, destination block) plane, calls marked."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.planner import PlanOptions, Target, hip_version, plan_transfer, presets

pytest.importorskip("matplotlib", reason="the transfer map needs matplotlib (the viz extra)")


def test_bands_follow_the_ranges(tmp_path):
    from matplotlib.collections import LineCollection

    from kvxfer.planner.viz import save_transfer_map, transfer_map

    layout = presets.kv_layout(3, 64, 4096)
    plan = plan_transfer(layout, presets.mapping("interleaved", 16, 64), Target(platform="rocm",
                         runtime_version=hip_version(7, 16)), PlanOptions(max_descriptors=5))
    fig = transfer_map(plan)
    ax = fig.axes[0]
    bands = [c for c in ax.collections if isinstance(c, LineCollection)][0]
    segs = np.array(bands.get_segments())
    assert segs.shape == (plan.num_ranges, 2, 2)
    # source axis: the one host buffer; destination axis: device buffers back to back (64 blocks each)
    assert np.allclose(segs[:, 0, 0], plan.src_offset / 4096)
    assert np.allclose(segs[:, 0, 1], (plan.dst_buf - 1) * 64 + plan.dst_offset / 4096)
    assert np.allclose(segs[:, 1] - segs[:, 0], (plan.nbytes / 4096)[:, None])
    colours = bands.get_colors()
    assert len({tuple(c) for c in colours}) == len(plan.regions)  # one colour per region
    assert [t.get_text() for t in ax.texts] == [f"call {i}" for i in range(plan.num_calls)]
    assert [t.get_text() for t in ax.get_yticklabels(minor=True)] == ["gpu.kv0", "gpu.kv1", "gpu.kv2"]
    out = save_transfer_map(plan, tmp_path / "map.png")
    assert out.read_bytes()[:4] == b"\x89PNG"


def _picture(direction="h2d", regions=3):
    from kvxfer.planner.viz import transfer_map

    layout = presets.kv_layout(regions, 64, 4096)
    plan = plan_transfer(layout, presets.mapping("contiguous", 16, 64, direction),
                         Target(platform="rocm", runtime_version=hip_version(7, 16)), PlanOptions(max_descriptors=2))
    fig = transfer_map(plan)
    fig.canvas.draw()  # lay out, so extents are final
    return plan, fig, fig.axes[0]


def test_block_numbers_on_both_axes():
    plan, _, ax = _picture()
    # y: three device buffers of 64 blocks back to back; ticks are block numbers within each buffer
    ticks, labels = ax.get_yticks(), [t.get_text() for t in ax.get_yticklabels()]
    assert labels and all(lab.isdigit() for lab in labels)
    assert [int(lab) for lab in labels] == [int(t) % 64 for t in ticks]
    assert labels.count("0") == 3  # one run of numbers per buffer
    assert [t.get_text() for t in ax.get_yticklabels(minor=True)] == ["gpu.kv0", "gpu.kv1", "gpu.kv2"]
    # x: the one host buffer; plain numeric ticks are its block numbers
    assert "block of cpu" in ax.get_xlabel()


def test_legend_sits_outside_the_axes():
    _, fig, ax = _picture()
    legend = ax.get_legend()
    assert legend is not None
    box, axes_box = legend.get_window_extent(), ax.get_window_extent()
    assert box.x0 >= axes_box.x1  # right of the plotting area: it covers no band
    many = _picture(regions=20)[2]  # past the legend's region limit: a note instead, also outside
    assert "20 regions" in many.get_legend().get_title().get_text()
    assert many.get_legend().get_window_extent().x0 >= many.get_window_extent().x1


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_call_markers_sit_on_their_ranges_inside_the_axes(direction):
    plan, _, ax = _picture(direction)
    marks = [c for c in ax.collections if c.get_label().startswith("start of a call")][0].get_offsets()
    assert len(marks) == plan.num_calls
    ymin, xmin = ax.get_ylim()[0], ax.get_xlim()[0]
    assert np.all(marks[:, 1] > ymin) and np.all(marks[:, 0] > xmin)  # never on an axis line, even at block 0
    from matplotlib.collections import LineCollection

    bands = [c for c in ax.collections if isinstance(c, LineCollection)][0].get_segments()
    starts = np.array([seg[0] for seg in bands])[plan.call_offsets[:-1]]
    assert np.allclose(marks, starts)  # each marker is where its call's first range begins
