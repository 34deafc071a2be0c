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
    assert [t.get_text() for t in ax.get_yticklabels()] == ["gpu.kv0", "gpu.kv1", "gpu.kv2"]
    out = save_transfer_map(plan, tmp_path / "map.png")
    assert out.read_bytes()[:4] == b"\x89PNG"
