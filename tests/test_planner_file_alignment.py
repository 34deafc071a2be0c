"""File buffers in the planner: Location.FILE, Buffer.align_bytes, and the alignment check over planned ranges.

No NIXL needed: plans stay pure and machine-independent.
"""
from __future__ import annotations

import json

import pytest

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    LayoutError,
    Location,
    PlanOptions,
    TransferPlan,
    plan_transfer,
    presets,
)
from kvxfer.planner.alignment import check_alignment


def _layout(page: int, align: int, mem_align: int = 1, blocks: int = 16) -> Layout:
    from kvxfer.offload.files.file_tier import tier_layout

    lay = tier_layout(3, blocks, page, files=2, align_bytes=align)
    bufs = [b.model_copy(update={"align_bytes": mem_align}) if b.name == "mem" else b for b in lay.buffers]
    return Layout(buffers=bufs, regions=lay.regions)


def test_align_bytes_must_be_a_power_of_two():
    with pytest.raises(LayoutError, match=r"align_bytes = 3000: must be a power of two"):
        Buffer(name="f", nbytes=8192, location="file", align_bytes=3000)
    with pytest.raises(LayoutError, match=r"align_bytes"):
        Buffer(name="f", nbytes=8192, location="file", align_bytes=0)


def test_default_alignment_leaves_dumps_and_fingerprints_unchanged():
    b = Buffer(name="cpu", nbytes=64, location=Location.HOST)
    assert "align_bytes" not in b.model_dump()
    assert Buffer(name="f", nbytes=64, location="file", align_bytes=64).model_dump(mode="json") == {
        "name": "f", "nbytes": 64, "location": "file", "device": 0, "align_bytes": 64}
    lay = presets.kv_layout(2, 8, 64)
    plan = plan_transfer(lay, presets.mapping("runs8", 4, 8))
    aligned = Layout(buffers=[x.model_copy(update={"align_bytes": 64}) for x in lay.buffers], regions=lay.regions)
    plan64 = plan_transfer(aligned, presets.mapping("runs8", 4, 8))
    assert plan64.fingerprint != plan.fingerprint  # the alignment is part of the plan's identity
    again = TransferPlan.from_json(plan64.to_json())
    assert again == plan64 and again.buffers[0].align_bytes == 64


def test_aligned_file_plan_passes_and_keeps_file_location_host_like():
    lay = _layout(4096, 4096, 4096)
    plan = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[1, 2, 3], dst_ids=[5, 6, 7]))
    assert plan.num_ranges == 3  # one merged range per region
    assert {plan.buffers[i].location for i in plan.buffers_used("dst").tolist()} == {Location.FILE}
    assert {a.dst_location.code for a in plan.attrs} == {2}  # a file is host-like in attribute hints
    json.loads(plan.to_json())


@pytest.mark.parametrize("coalesce", [True, False])
def test_page_not_a_multiple_of_the_file_alignment_is_refused_naming_the_range(coalesce):
    lay = _layout(1000, 4096)  # region pages of 1000 bytes in a file that wants 4096-byte ranges
    with pytest.raises(LayoutError, match=r"nbytes\[0\] = 1000: range of region 'kv0' in buffer 'file0' \(dst side\) "
                       r"is not a multiple of its align_bytes 4096") as e:
        plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0]),
                      options=PlanOptions(coalesce=coalesce))
    assert (e.value.field, e.value.index, e.value.value) == ("nbytes", 0, 1000)


def test_offset_not_aligned_is_refused_naming_offset_column():
    lay = _layout(4096, 8192)  # pages are 4 KiB but the file wants 8 KiB alignment: block 1 sits at 4096
    with pytest.raises(LayoutError) as e:
        plan_transfer(lay, BlockMapping(direction="h2d", src_ids=[1, 5], dst_ids=[0, 2]))
    assert e.value.field in ("src_offset", "nbytes") and e.value.index is not None


def test_memory_buffer_alignment_is_checked_too():
    lay = _layout(4096, 1, mem_align=8192)
    with pytest.raises(LayoutError, match=r"buffer 'mem' \(src side\)"):
        plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[1], dst_ids=[0]))


def test_split_large_ranges_must_stay_aligned():
    lay = _layout(4096, 4096)
    ok = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3]),
                       options=PlanOptions(max_range_bytes=8192))
    assert ok.num_ranges == 6
    with pytest.raises(LayoutError, match="align_bytes 4096"):
        plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3]),
                      options=PlanOptions(max_range_bytes=6000))


def test_check_alignment_guards_plans_read_from_files():
    lay = _layout(4096, 1)
    plan = plan_transfer(lay, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[1]))
    d = plan.to_dict()
    d["buffers"] = [dict(b, align_bytes=8192) if b["location"] == "file" else b for b in d["buffers"]]
    d.pop("fingerprint")
    loaded = TransferPlan.from_dict(d)
    with pytest.raises(LayoutError, match="dst_offset"):
        check_alignment(loaded)
