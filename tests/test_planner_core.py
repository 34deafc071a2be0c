"""The core planner: call caps, attribute gates, serialization, refusals (merging is the builder's:
test_planner_build.py)."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import BindingError, NumpyExecutor
from kvxfer.planner import (
    COLUMNS,
    AccessOrder,
    BlockMapping,
    Buffer,
    Case,
    CopyApi,
    Layout,
    LayoutError,
    MappingError,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    Target,
    TargetError,
    TransferPlan,
    hip_version,
    plan_transfer,
    presets,
)
from kvxfer.testing import random_buffers


def unmergeable(regions: int, n: int, page: int = 4) -> tuple[Layout, BlockMapping]:
    layout = presets.kv_layout(regions, 2 * n + 2, page, shared_host=False)
    ids = np.arange(n) * 2
    return layout, BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids)


@pytest.mark.parametrize("regions,n,cap,sizes", [
    (3, 5000, 8192, [8192, 6808]),
    (1, 8192, 8192, [8192]),
    (1, 8193, 8192, [8192, 1]),
    (61, 135, 4096, [4096, 4096, 43]),
    (61, 135, 0, [8235]),
    (61, 135, None, [8235]),  # CUDA's default: unlimited
])
def test_call_caps(regions, n, cap, sizes):
    layout, mapping = unmergeable(regions, n)
    plan = plan_transfer(layout, mapping, Target(platform="cuda", runtime_version=13000), PlanOptions(max_descriptors=cap))
    assert plan.call_sizes.tolist() == sizes
    assert plan.num_calls == len(sizes)


def test_rocm_default_cap_is_8192():
    layout, mapping = unmergeable(3, 5000)
    plan = plan_transfer(layout, mapping, Target(platform="rocm", runtime_version=hip_version(7, 2)))
    assert plan.call_sizes.tolist() == [8192, 6808]


HIP_TABLE = [  # (version, label, api, passes attrs, flags)
    (0, "rocm-unknown", CopyApi.HIP_PER_RANGE, False, 0),
    (hip_version(7, 1), "rocm-7.1", CopyApi.HIP_BATCH, False, 0),
    (hip_version(7, 2), "rocm-7.2", CopyApi.HIP_BATCH, False, 0),
    (hip_version(7, 2, 53211), "rocm-7.2.53211", CopyApi.HIP_BATCH, False, 0),
    (hip_version(7, 3), "rocm-7.3", CopyApi.HIP_BATCH, False, 0),
    (hip_version(7, 12), "rocm-7.12", CopyApi.HIP_BATCH, False, 0),
    (hip_version(7, 13), "rocm-7.13", CopyApi.HIP_BATCH, True, 0),
    (hip_version(7, 13, 26193), "rocm-7.13.26193", CopyApi.HIP_BATCH, True, 0),
    (hip_version(7, 14), "rocm-7.14", CopyApi.HIP_BATCH, True, 0),
    (hip_version(7, 15), "rocm-7.15", CopyApi.HIP_BATCH, True, 0),
    (hip_version(7, 16), "rocm-7.16", CopyApi.HIP_BATCH, True, 0x100),
    (hip_version(8, 0), "rocm-8.0", CopyApi.HIP_BATCH, True, 0x100),
]


def test_hip_version_encoding():
    assert hip_version(7, 2, 53211) == 70253211
    assert hip_version(7, 16) == 71600000


@pytest.mark.parametrize("version,label,api,passes,flags", HIP_TABLE)
@pytest.mark.parametrize("direction,order", [("h2d", AccessOrder.ANY), ("d2h", AccessOrder.STREAM)])
def test_hip_version_table(version, label, api, passes, flags, direction, order):
    layout = presets.kv_layout(2, 16, 64)
    plan = plan_transfer(layout, presets.mapping("contiguous", 4, 16, direction),
                         Target(platform="rocm", runtime_version=version))
    assert plan.target.label == label
    assert plan.api is api
    assert plan.passes_attrs is passes
    assert len(plan.attrs) == 1
    a = plan.attrs[0]
    assert a.flags == flags and a.src_access_order is order and a.src_access_order.code == order.code
    src, dst = ("host", "device") if direction == "h2d" else ("device", "host")
    assert (a.src_location.location.value, a.dst_location.location.value) == (src, dst)


@pytest.mark.parametrize("version,api,passes", [
    (12040, CopyApi.CUDA_PER_RANGE, False), (12080, CopyApi.CUDA_BATCH, True),
    (12090, CopyApi.CUDA_BATCH, True), (13000, CopyApi.CUDA_BATCH_V2, True), (0, CopyApi.CUDA_PER_RANGE, False)])
@pytest.mark.parametrize("overlap", [False, True])
def test_cuda_targets(version, api, passes, overlap):
    plan = plan_transfer(presets.kv_layout(2, 16, 64), presets.mapping("contiguous", 4, 16),
                         Target(platform="cuda", runtime_version=version),
                         PlanOptions(prefer_overlap_with_compute=overlap))
    assert plan.api is api and plan.passes_attrs is passes
    assert plan.attrs[0].flags == (1 if overlap else 0)
    assert plan.num_calls == 1


def test_location_hints_follow_device_ordinals():
    layout = Layout(buffers=[Buffer(name="g", nbytes=64, device=3), Buffer(name="h", nbytes=64, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h"))])
    plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[1]),
                         Target(platform="cuda", runtime_version=13000))
    a = plan.attrs[0]
    assert (a.src_location.code, a.src_location.id, a.dst_location.code) == (1, 3, 2)


def test_empty_mapping_gives_empty_plan():
    plan = plan_transfer(presets.kv_layout(4, 8, 16), BlockMapping(direction="h2d", src_ids=[], dst_ids=[]))
    assert plan.num_ranges == 0 and plan.num_calls == 0 and plan.total_bytes == 0
    assert list(plan.calls()) == []
    assert TransferPlan.from_json(plan.to_json()) == plan
    NumpyExecutor().run(plan, {})


def test_plan_is_immutable():
    plan = plan_transfer(presets.kv_layout(2, 16, 8), presets.mapping("contiguous", 4, 16))
    with pytest.raises(AttributeError, match="TransferPlan is immutable"):
        plan.nbytes = None
    with pytest.raises(ValueError, match="read-only"):
        plan.nbytes[0] = 1


def test_serialization_round_trips(tmp_path):
    case = Case(layout=presets.kv_layout(3, 32, 16, shared_device=True),
                mapping=presets.mapping("interleaved", 12, 32), target=Target(platform="rocm", runtime_version=71600000),
                options=PlanOptions(max_descriptors=2))
    plan = case.plan()
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert TransferPlan.load(plan.save(tmp_path / "p.npz")) == plan
    assert TransferPlan.load(plan.save(tmp_path / "p.json")) == plan
    assert Case.load(case.save(tmp_path / "c.json")) == case
    assert Case.load(tmp_path / "c.json").plan() == plan
    assert "layout" in Case.json_schema()["properties"]


def test_fingerprint_is_stable_across_processes():
    import subprocess
    import sys
    code = ("from kvxfer.planner import presets, plan_transfer;"
            "print(plan_transfer(presets.kv_layout(3, 32, 16), presets.mapping('runs8', 8, 32, seed=1)).fingerprint)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": ""}).stdout.strip()
    assert out == plan_transfer(presets.kv_layout(3, 32, 16), presets.mapping("runs8", 8, 32, seed=1)).fingerprint


def test_repr_is_one_line():
    plan = plan_transfer(presets.kv_layout(118, 512, 32768), presets.mapping("contiguous", 256, 512),
                         Target(platform="rocm", runtime_version=71600000))
    assert repr(plan) == "TransferPlan(h2d rocm-7.16: 30208 -> 118 ranges, 1 call, 944.0 MiB)"


# ---- the bad-input catalogue: one test per error ------------------------------------------------------------
def _one_region(**kw) -> Layout:
    return Layout(buffers=[Buffer(name="g", nbytes=80), Buffer(name="h", nbytes=80, location="host")],
                  regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g", **kw), host=Placement(buffer="h"))])


def _err(exc, match, fn, *a, **kw):
    with pytest.raises(exc, match=match) as info:
        fn(*a, **kw)
    assert isinstance(info.value, ValueError)
    return info.value


def test_err_length_mismatch():
    e = _err(MappingError, r"dst_ids = 'length 2'.*src_ids has 3", BlockMapping, direction="h2d", src_ids=[1, 2, 3], dst_ids=[1, 2])
    assert e.field == "dst_ids"


def test_err_negative_id():
    e = _err(MappingError, r"src_ids\[2\] = -1: block ids must be non-negative", BlockMapping, direction="h2d",
             src_ids=[1, 2, -1], dst_ids=[1, 2, 3])
    assert (e.field, e.index, e.value) == ("src_ids", 2, -1)


def test_err_non_integer_id():
    _err(MappingError, r"dst_ids\[1\] = 2.5: block ids must be integers", BlockMapping, direction="h2d",
         src_ids=[1, 2], dst_ids=[1, 2.5])
    _err(MappingError, r"src_ids\[0\]", BlockMapping, direction="h2d", src_ids=["a"], dst_ids=[1])
    _err(MappingError, r"src_ids\[0\]", BlockMapping, direction="h2d", src_ids=[True], dst_ids=[1])


def test_err_id_past_buffer():
    e = _err(MappingError, r"dst_ids\[1\] = 10: block of region 'r' \(device side\) ends at byte 88, past buffer 'g' of 80",
             plan_transfer, _one_region(), BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[0, 10]))
    assert e.index == 1


def test_err_destination_written_twice():
    _err(MappingError, r"dst_ids\[2\] = 4: destination block is written twice \(also dst_ids\[0\]\)", plan_transfer,
         _one_region(), BlockMapping(direction="h2d", src_ids=[0, 1, 2], dst_ids=[4, 5, 4]))


def test_err_source_and_destination_overlap_in_one_buffer():
    layout = Layout(buffers=[Buffer(name="m", nbytes=160)],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="m"), host=Placement(buffer="m", byte_offset=40))])
    _err(LayoutError, r"overlap source bytes", plan_transfer, layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[5]))
    plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[0]))  # disjoint bytes are fine


def test_err_regions_overlapping_in_destination():
    layout = Layout(buffers=[Buffer(name="g", nbytes=80), Buffer(name="h", nbytes=160, location="host")],
                    regions=[Region(name="a", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h")),
                             Region(name="b", page_bytes=8, device=Placement(buffer="g", byte_offset=8),
                                    host=Placement(buffer="h", byte_offset=80))])
    _err(LayoutError, r"regions\[1\] = 'b': writes bytes at offset 8 of buffer 'g' that region 'a' also writes",
         plan_transfer, layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[0, 1]))


def test_err_page_bytes():
    _err(LayoutError, r"page_bytes = 0", Region, name="r", page_bytes=0, device={"buffer": "g"}, host={"buffer": "h"})


def test_err_stride_smaller_than_page():
    _err(LayoutError, r"device.stride_bytes = 4: stride is smaller than page_bytes 8", _one_region, stride_bytes=4)


def test_err_placement_past_buffer():
    _err(LayoutError, r"regions\[0\].device.byte_offset = 76: block 0 of 8 bytes runs past buffer 'g' of 80",
         _one_region, byte_offset=76)


def test_err_unknown_buffer():
    _err(LayoutError, r"regions\[0\].host.buffer = 'nope': unknown buffer",
         Layout, buffers=[Buffer(name="g", nbytes=8)],
         regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="nope"))])


def test_err_duplicate_names():
    _err(LayoutError, r"buffers\[1\] = 'g': duplicate buffer name", Layout,
         buffers=[Buffer(name="g", nbytes=8), Buffer(name="g", nbytes=8)], regions=[])
    r = Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="g"))
    _err(LayoutError, r"regions\[1\] = 'r': duplicate region name", Layout, buffers=[Buffer(name="g", nbytes=8)], regions=[r, r])


def test_err_offset_end_past_2_64():
    _err(LayoutError, r"regions\[0\].device.byte_offset = 18446744073709551612: block 0 ends past 2\^64",
         Layout.model_validate, {"buffers": [{"name": "g", "nbytes": 8}],
                                 "regions": [{"name": "r", "page_bytes": 8, "device": {"buffer": "g", "byte_offset": 2**64 - 4},
                                              "host": {"buffer": "g"}}]})


def test_err_unknown_platform_and_negative_version():
    _err(TargetError, r"platform = 'tpu'", Target, platform="tpu")
    _err(TargetError, r"runtime_version = -1", Target, platform="cuda", runtime_version=-1)


def test_err_negative_cap():
    _err(TargetError, r"max_descriptors = -1", PlanOptions, max_descriptors=-1)
    _err(TargetError, r"max_range_bytes = 0", PlanOptions, max_range_bytes=0)


def test_err_extra_fields_forbidden():
    _err(TargetError, r"typo", PlanOptions.model_validate, {"coalesce": True, "typo": 1})


# ---- NumPy executor binding checks: nothing copied on failure ------------------------------------------------
def _plan_and_buffers():
    layout = presets.kv_layout(2, 8, 16)
    plan = plan_transfer(layout, presets.mapping("contiguous", 3, 8))
    return plan, random_buffers(layout)


def test_bind_missing_buffer():
    plan, bufs = _plan_and_buffers()
    del bufs["gpu.kv1"]
    before = {k: v.copy() for k, v in bufs.items()}
    _err(BindingError, r"bindings\['gpu.kv1'\] = missing", NumpyExecutor().run, plan, bufs)
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k])


def test_bind_too_small():
    plan, bufs = _plan_and_buffers()
    bufs["cpu"] = bufs["cpu"][:-1]
    _err(BindingError, r"bindings\['cpu'\] = 255 bytes: smaller than the plan's buffer of 256", NumpyExecutor().run, plan, bufs)


def test_bind_non_contiguous():
    plan, bufs = _plan_and_buffers()
    bufs["cpu"] = np.zeros(512, np.uint8)[::2]
    _err(BindingError, r"not C-contiguous", NumpyExecutor().run, plan, bufs)


def test_bind_read_only_destination():
    plan, bufs = _plan_and_buffers()
    bufs["gpu.kv0"].flags.writeable = False
    before = bufs["gpu.kv1"].copy()
    _err(BindingError, r"bindings\['gpu.kv0'\].*read-only", NumpyExecutor().run, plan, bufs)
    np.testing.assert_array_equal(bufs["gpu.kv1"], before)
    bufs["gpu.kv0"].flags.writeable = True
    bufs["cpu"].flags.writeable = False  # a read-only source is fine
    NumpyExecutor().run(plan, bufs)


def test_bind_any_dtype_and_torch():
    torch = pytest.importorskip("torch")
    layout = presets.kv_layout(1, 8, 16)
    plan = plan_transfer(layout, presets.mapping("contiguous", 3, 8))
    src = torch.arange(32, dtype=torch.float32)  # 128 bytes host
    dst = np.zeros(32, dtype=np.float64)  # 256 bytes, larger than needed
    NumpyExecutor().run(plan, {"cpu": src, "gpu.kv0": dst})
    got = dst.view(np.uint8)[5 * 16:8 * 16]
    np.testing.assert_array_equal(got, src.numpy().view(np.uint8)[:48])


def test_malformed_plans_are_refused_before_copying():
    plan, bufs = _plan_and_buffers()
    d = plan.to_dict()
    del d["fingerprint"]
    d["columns"]["src_offset"][0] = 10**6
    with pytest.raises(PlanError, match=r"src_offset\[0\] = 1000000: range of 48 bytes runs past buffer 'cpu' of 256"):
        TransferPlan.from_dict(d)
    d = plan.to_dict()
    del d["fingerprint"]
    d["columns"]["src_buf"][1] = -1
    with pytest.raises(PlanError, match=r"src_buf\[1\] = -1: out of range"):
        TransferPlan.from_dict(d)
    d = plan.to_dict()
    del d["fingerprint"]
    d["columns"]["attr"][0] = 5
    with pytest.raises(PlanError, match=r"attr\[0\] = 5: out of range \(the plan has 1\)"):
        TransferPlan.from_dict(d)
    cols = {c: getattr(plan, c).copy() for c in COLUMNS}
    cols["dst_offset"][-1] = 10**6  # a hand-built plan: the executor refuses it whole
    bad = TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                       regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                       call_offsets=plan.call_offsets, columns=cols)
    before = {k: v.copy() for k, v in bufs.items()}
    with pytest.raises(PlanError, match=r"dst_offset\[1\] = 1000000"):
        NumpyExecutor().run(bad, bufs)
    for k in bufs:
        np.testing.assert_array_equal(bufs[k], before[k])
