"""Bounds the layout states: a placement's ``num_blocks`` bounds the ids on its side, refused by the planner in its
usual words (field, index, value) in every input form, and a layout claiming more blocks than its buffer holds is
refused; ids inside the bounds plan exactly as without them."""
from __future__ import annotations

import json

import numpy as np
import pytest

from kvxfer.planner import BlockMapping, Buffer, Layout, LayoutError, Location, MappingError, Placement, Region, plan_transfer
from kvxfer.testing import assert_plan_matches

PAGE = 64


def two_views(num_blocks: int | None = 8, host_k: int = 1, host_blocks: int | None = None) -> Layout:
    """Two KV tensors as views of one device storage of 2 x 8 blocks (tensor b's block 0 follows a's block 7),
    each with its own host buffer of 16 blocks (in chunks of ``host_k``)."""
    buffers = [Buffer(name="dev", nbytes=16 * PAGE), *(Buffer(name=f"host.{n}", nbytes=16 * PAGE, location=Location.HOST)
                                                       for n in "ab")]
    return Layout(buffers=buffers, regions=[
        Region(name=n, page_bytes=PAGE, device=Placement(buffer="dev", byte_offset=i * 8 * PAGE, num_blocks=num_blocks),
               host=Placement(buffer=f"host.{n}", blocks_per_chunk=host_k, num_blocks=host_blocks))
        for i, n in enumerate("ab")])


FORMS = {
    "BlockMapping": lambda d, s, **g: BlockMapping(direction="h2d", src_ids=s, dst_ids=d, **g),
    "dict of numpy ids": lambda d, s, **g: {"direction": "h2d", "src_ids": np.array(s), "dst_ids": np.array(d), **g},
    "dict of lists": lambda d, s, **g: {"direction": "h2d", "src_ids": s, "dst_ids": d, **g},
}


@pytest.mark.parametrize("form", sorted(FORMS))
@pytest.mark.parametrize("grouped", [False, True], ids=["ids are pages", "grouped"])
def test_a_device_block_past_the_stated_count_is_refused_in_every_form(form, grouped):
    """Block 8 of tensor a lies inside the device buffer (it is b's block 0): the count refuses it."""
    groups = {"group_sizes": [3], "group_starts": [0]} if grouped else {}
    mapping = FORMS[form]([6, 7, 8], [0, 1, 2], **groups)
    with pytest.raises(MappingError) as e:
        plan_transfer(two_views(), mapping)
    assert str(e.value) == "dst_ids[2] = 8: past the 8 blocks of region 'a' (device side, buffer 'dev')"
    assert (e.value.field, e.value.index, e.value.value) == ("dst_ids", 2, 8)


@pytest.mark.parametrize("count", [None, 8])
def test_a_view_whose_neighbour_is_another_ranks_is_bounded_by_its_count_alone(count):
    """This rank plans tensor a only; the storage goes on with another rank's view, so block 8 is inside the
    buffer: without a count it is taken (and would write the other view), with one it is refused."""
    layout = two_views(count)
    layout = layout.model_copy(update={"regions": layout.regions[:1]})
    mapping = BlockMapping(direction="h2d", src_ids=[0], dst_ids=[8])
    if count is None:
        assert plan_transfer(layout, mapping).num_ranges == 1
    else:
        with pytest.raises(MappingError, match=r"^dst_ids\[0\] = 8: past the 8 blocks of region 'a'"):
            plan_transfer(layout, mapping)


def test_chunk_ids_past_the_stated_chunks_are_refused_naming_the_chunks():
    layout = two_views(host_k=2, host_blocks=6)  # 3 chunks of 2 blocks on the host side
    ok = BlockMapping(direction="h2d", src_ids=[1, 2], dst_ids=[0, 1, 2, 3], group_sizes=[4])
    assert_plan_matches(plan_transfer(layout, ok), layout, ok)
    with pytest.raises(MappingError, match=r"^src_ids\[1\] = 3: past the 3 chunks of 2 blocks of region 'a' "
                                           r"\(host side, buffer 'host.a'\)$"):
        plan_transfer(layout, {"direction": "h2d", "src_ids": np.array([2, 3]), "dst_ids": np.arange(4), "group_sizes": [4]})


def test_a_partial_last_chunk_holds_only_its_stated_blocks():
    layout = two_views(host_k=2, host_blocks=5)  # chunks 0, 1 and the first block of chunk 2
    first = BlockMapping(direction="h2d", src_ids=[2], dst_ids=[0], group_sizes=[1])  # block 4: inside
    assert_plan_matches(plan_transfer(layout, first), layout, first)
    with pytest.raises(MappingError, match=r"^src_ids\[1\] = 2: its block 5 is past the 5 blocks \(2 per chunk\) of "
                                           r"region 'a' \(host side, buffer 'host.a'\)$"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[1, 2], dst_ids=[0, 1, 2, 3], group_sizes=[4]))
    with pytest.raises(MappingError, match=r"^src_ids\[0\] = 2: its block 5 is past the 5 blocks"):  # entered mid-chunk
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[2], dst_ids=[0], group_sizes=[1], group_starts=[1]))


@pytest.mark.parametrize("pattern", ["contiguous", "runs", "scattered"])
def test_ids_inside_the_counts_plan_exactly_as_without_them(pattern):
    src, dst = {"contiguous": ([0, 1, 2, 3], [4, 5, 6, 7]), "runs": ([9, 10, 3, 4], [0, 1, 6, 7]),
                "scattered": ([15, 2, 11, 6], [7, 0, 5, 2])}[pattern]
    mapping = BlockMapping(direction="h2d", src_ids=src, dst_ids=dst)
    stated = plan_transfer(two_views(8, host_blocks=16), mapping)
    assert stated.fingerprint == plan_transfer(two_views(None), mapping).fingerprint


def test_a_layout_claiming_more_blocks_than_its_buffer_holds_is_refused():
    with pytest.raises(LayoutError, match=r"^regions\[1\]\.device\.num_blocks = 9: block 8 ends at byte 1088, past "
                                          r"buffer 'dev' of 1024 bytes$"):
        two_views(9)
    with pytest.raises(LayoutError, match=r"num_blocks"):
        two_views(0)


def test_aliases_are_bounded_by_the_fewest_blocks_any_of_them_states():
    a = Region(name="a", page_bytes=PAGE, device=Placement(buffer="dev", num_blocks=8), host=Placement(buffer="host.a"))
    layout = Layout(buffers=[Buffer(name="dev", nbytes=16 * PAGE), Buffer(name="host.a", nbytes=16 * PAGE, location="host")],
                    regions=[a, a.model_copy(update={"name": "a2", "device": a.device.model_copy(update={"num_blocks": 4})})])
    assert plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[3])).aliases == (("a2", "a"),)
    with pytest.raises(MappingError, match=r"^dst_ids\[0\] = 4: past the 4 blocks"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[4]))


def test_a_layout_without_counts_reads_and_dumps_as_before():
    layout = two_views(None)
    assert "num_blocks" not in json.dumps(layout.model_dump(mode="json"))
    assert Layout.model_validate(two_views(8).model_dump()) == two_views(8)
