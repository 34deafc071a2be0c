"""device_from_tensors reads vLLM's own tensor shapes: explicit K/V packing, refusals naming the dimension."""
from __future__ import annotations

import pytest

from kvxfer.offload import HostTier, create_worker, device_from_tensors
from kvxfer.planner import LayoutError

torch = pytest.importorskip("torch")


def test_a_leading_kv_dimension_becomes_k_and_v_tensors_of_num_blocks_blocks() -> None:
    kv = torch.zeros(2, 16, 4, 32, 8, dtype=torch.float16)  # [2, num_blocks, block_size, heads, head_size]
    dev = device_from_tensors({"l0": kv}, kv_split=True)
    k, v = dev.tensors
    assert (k.name, v.name) == ("l0.k", "l0.v") and len(dev.buffers) == 1
    assert k.page_bytes == v.page_bytes == 4 * 32 * 8 * 2
    assert (k.byte_offset, v.byte_offset) == (0, 16 * k.page_bytes) and k.stride_bytes == k.page_bytes


def test_a_leading_dimension_of_2_is_refused_as_ambiguous_without_kv_split_or_num_blocks() -> None:
    # before: read as 2 blocks of 16 x 32 elements, and the mistake surfaced only at submit time
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].shape\[0\] = 2: ambiguous in shape \(2, 16, 32\)"):
        device_from_tensors({"l0": torch.zeros(2, 16, 32)})


def test_num_blocks_tells_packed_from_split() -> None:
    packed = torch.zeros(16, 2, 8, 64, dtype=torch.int8)  # vLLM's CPU layout: [blocks, kv_heads, block_size, 2 x head]
    split = torch.zeros(2, 16, 8, 64, dtype=torch.int8)
    (p,) = device_from_tensors({"p": packed}, num_blocks=16).tensors
    assert p.page_bytes == 2 * 8 * 64
    assert [t.name for t in device_from_tensors({"s": split}, num_blocks=16).tensors] == ["s.k", "s.v"]


def test_a_block_dimension_that_is_not_num_blocks_is_refused_naming_it() -> None:
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].shape\[1\] = 12: the block dimension holds 12 blocks, not num_blocks 16"):
        device_from_tensors({"l0": torch.zeros(2, 12, 8)}, kv_split=True, num_blocks=16)
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].shape\[0\] = 12: neither num_blocks \(16\)"):
        device_from_tensors({"l0": torch.zeros(12, 8)}, num_blocks=16)


def test_kv_split_without_a_kv_dimension_is_refused() -> None:
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].shape\[0\] = 3: kv_split needs a leading K/V dimension of 2"):
        device_from_tensors({"l0": torch.zeros(3, 16, 8)}, kv_split=True)


def test_dimensions_inside_a_block_that_are_not_row_major_are_refused_naming_the_dimension() -> None:
    t = torch.zeros(16, 8, 4).transpose(1, 2)  # [blocks, 4, 8] with strides (32, 1, 4)
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].stride\[2\] = 4: dimension 2 \(size 8\) is not row-major"):
        device_from_tensors({"l0": t})
    kv = torch.zeros(2, 8, 16, 4).transpose(2, 3)  # split halves, inner dims swapped
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].stride\[3\]"):
        device_from_tensors({"l0": kv}, kv_split=True)


def test_overlapping_blocks_are_refused() -> None:
    t = torch.zeros(80).as_strided((8, 16), (8, 1))  # each block's 16 elements overlap the next
    with pytest.raises(LayoutError, match=r"tensors\['l0'\].stride\[0\] = 8: blocks overlap"):
        device_from_tensors({"l0": t})


def test_split_k_and_v_round_trip_through_the_worker() -> None:
    kv = torch.randint(0, 255, (2, 16, 64), dtype=torch.uint8)
    before = kv.clone()
    w = create_worker(device_from_tensors({"l0": kv}, kv_split=True), HostTier(num_chunks=8, pin=False), {"kind": "numpy"})
    w.submit_store(1, [3, 4], [0, 1])
    w.submit_load(2, [0, 1], [10, 11])
    w.wait([1, 2])
    assert [r.success for r in w.get_finished()] == [True, True]
    assert torch.equal(kv[:, 10:12], before[:, 3:5]) and torch.equal(kv[:, :10], before[:, :10])
    w.shutdown()
