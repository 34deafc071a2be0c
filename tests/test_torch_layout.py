"""Layouts built from torch tensors, bound and run with the NumPy executor on CPU tensors."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import BlockMapping, LayoutError, plan_transfer

torch = pytest.importorskip("torch")
from kvxfer.executors.torch_layout import layout_from_tensors  # noqa: E402

LAYERS, BLOCKS, TOK, HEADS, DIM = 4, 16, 4, 2, 8


def test_views_of_one_allocation_merge_across_layers():
    gpu = torch.randn(LAYERS, BLOCKS, TOK, HEADS, DIM, dtype=torch.bfloat16)
    cpu = torch.zeros(LAYERS, BLOCKS, TOK, HEADS, DIM, dtype=torch.bfloat16)
    layout, bind = layout_from_tensors({f"l{i}": gpu[i] for i in range(LAYERS)}, {f"l{i}": cpu[i] for i in range(LAYERS)})
    assert [b.name for b in layout.buffers] == ["device.l0", "host.l0"]
    assert layout.regions[1].device.byte_offset == BLOCKS * TOK * HEADS * DIM * 2
    ids = np.arange(BLOCKS)
    plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=ids, dst_ids=ids))
    assert plan.num_ranges == 1  # whole layers back to back on both sides: one range
    NumpyExecutor().run(plan, bind)
    assert torch.equal(cpu, gpu)


def test_kv_split_and_separate_tensors():
    gpu = {f"l{i}": torch.randn(2, BLOCKS, TOK, HEADS, DIM) for i in range(LAYERS)}
    cpu_all = torch.zeros(LAYERS, 2, BLOCKS, TOK, HEADS, DIM)
    layout, bind = layout_from_tensors(gpu, {f"l{i}": cpu_all[i] for i in range(LAYERS)}, kv_split=True)
    assert [r.name for r in layout.regions][:2] == ["l0.k", "l0.v"] and len(layout.regions) == 2 * LAYERS
    # a buffer holding both K and V of a layer is named after the layer, not after its K half
    assert [b.name for b in layout.buffers] == [f"device.l{i}" for i in range(LAYERS)] + ["host.l0"]
    assert layout.regions[1].device.buffer == "device.l0" and layout.regions[1].host.buffer == "host.l0"
    src, dst = np.array([3, 4, 5, 9]), np.array([0, 1, 2, 7])
    plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=src, dst_ids=dst))
    assert plan.num_ranges == 2 * LAYERS * 2  # a run of 3 and a single block, per K and V of each layer
    NumpyExecutor().run(plan, bind)
    for i in range(LAYERS):
        assert torch.equal(cpu_all[i][:, dst], gpu[f"l{i}"][:, src])
        untouched = np.setdiff1d(np.arange(BLOCKS), dst)
        assert torch.count_nonzero(cpu_all[i][:, untouched]) == 0


def test_padded_blocks_keep_their_stride():
    big = torch.randn(BLOCKS, TOK * HEADS * DIM + 8)
    gpu = big[:, : TOK * HEADS * DIM]  # page of 256 B inside rows of 288 B
    cpu = torch.zeros(BLOCKS, TOK * HEADS * DIM)
    layout, bind = layout_from_tensors({"l": gpu}, {"l": cpu})
    assert layout.regions[0].device.stride_bytes == (TOK * HEADS * DIM + 8) * 4
    plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[1, 2, 3], dst_ids=[5, 6, 7]))
    assert plan.num_ranges == 3  # device rows are padded, so nothing merges
    NumpyExecutor().run(plan, bind)
    assert torch.equal(cpu[5:8], gpu[1:4])


def test_errors():
    g = torch.zeros(BLOCKS, 8)
    with pytest.raises(LayoutError, match=r"host\['l'\] = 'torch.float16': dtype differs from the device tensor's torch.float32"):
        layout_from_tensors({"l": g}, {"l": torch.zeros(BLOCKS, 8, dtype=torch.float16)})
    with pytest.raises(LayoutError, match=r"not row-major contiguous"):
        layout_from_tensors({"l": torch.zeros(BLOCKS, 8, 4).transpose(1, 2)}, {"l": torch.zeros(BLOCKS, 4, 8)})
    with pytest.raises(LayoutError, match=r"device\['l'\] = 'cpu': expected a cuda tensor"):
        layout_from_tensors({"l": g}, {"l": g.clone()}, device_type="cuda")
    with pytest.raises(LayoutError, match=r"host\['l'\] = 'meta': host tensors must be in CPU memory"):
        layout_from_tensors({"l": g}, {"l": torch.zeros(BLOCKS, 8, device="meta")})
    with pytest.raises(LayoutError, match=r"kv_split needs a leading K/V dimension of 2"):
        layout_from_tensors({"l": g}, {"l": g.clone()}, kv_split=True)
    with pytest.raises(LayoutError, match=r"host\['l'\] = '128 B pages': device pages are 32 B"):
        layout_from_tensors({"l": g}, {"l": torch.zeros(BLOCKS, 32)})
    with pytest.raises(LayoutError, match=r"blocks overlap"):
        layout_from_tensors({"l": torch.zeros(BLOCKS * 4 + 8).as_strided((BLOCKS, 8), (4, 1))}, {"l": torch.zeros(BLOCKS, 8)})
    with pytest.raises(LayoutError, match=r"layers must match"):
        layout_from_tensors({"l": g}, {"m": g})
