"""HIP batch executor end to end against the fake HIP runtime (host memory): version gates as recorded by
the shim, the 8,192-descriptor cap, per-range fallback, errors and library loading."""
from __future__ import annotations

import ctypes

import pytest

from kvxfer.executors import ExecutorError, TargetMismatchError
from kvxfer.executors._dma import ATTR_DTYPE
from kvxfer.executors._ops_hip import HIP_LIBRARIES, HipBatchExecutor, load_hip
from kvxfer.planner import PlanError, PlanOptions, Target, hip_version, plan_transfer, presets

from .shims.build import ShimState, build, compiler
from .shims.cases import assert_same, expected, gpu_buffers, gpu_round_trip, host_buffers
from .shims.runtime import ShimHipRuntime

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the HIP shim")


@pytest.fixture(scope="module")
def lib_path(tmp_path_factory):
    return build("fake_hip", tmp_path_factory.mktemp("hip_shim"))


@pytest.fixture
def make(lib_path):
    """make(version, **shim controls) -> (executor, shim state); the version is set before the executor reads it."""
    state = ShimState(ctypes.CDLL(str(lib_path)))

    def _make(version: int, max_descriptors: int | None = 8192, **controls):
        state.reset()
        state.set(version=version, **controls)
        return HipBatchExecutor(ShimHipRuntime(lib_path), max_descriptors=max_descriptors), state
    return _make


def _run(ex, version, direction="h2d", pattern="runs8", options=None, regions=3, blocks=64, page=256, n=24):
    layout = presets.kv_layout(regions, blocks, page)
    plan = plan_transfer(layout, presets.mapping(pattern, n, blocks, direction, seed=1),
                         Target(platform="rocm", runtime_version=version), options)
    bufs = host_buffers(layout, seed=5)
    want = expected(plan, bufs)
    t = ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    return plan, t


@pytest.mark.parametrize("version,num_attrs,flags", [
    (hip_version(7, 2, 2), 0, None), (hip_version(7, 12), 0, None), (hip_version(7, 13), 1, 0x0),
    (hip_version(7, 13, 26193), 1, 0x0), (hip_version(7, 16), 1, 0x100), (hip_version(8, 0), 1, 0x100)])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_version_gates_as_recorded(make, version, num_attrs, flags, direction):
    # below 7.13 the shim rejects any attribute, as ROCm 7.2.1-7.2.3 do
    ex, st = make(version, reject_attrs_code=1 if version < hip_version(7, 13) else 0)
    plan, t = _run(ex, version, direction)
    assert st.counts == plan.call_sizes.tolist() and st.has_fail_idx == [1] * plan.num_calls
    assert st.num_attrs == [num_attrs] * plan.num_calls
    recs, idx = st.attrs(ATTR_DTYPE)
    assert len(recs) == num_attrs * plan.num_calls
    if num_attrs:
        assert set(recs["flags"].tolist()) == {flags} and set(idx.tolist()) == {0}
        assert set(recs["srcAccessOrder"].tolist()) == {3 if direction == "h2d" else 1}
    assert t.elapsed_s is not None


def test_cap_chunks_at_8192_and_shim_faults_above(make):
    v = hip_version(7, 16)
    ex, st = make(v, max_count=8192, max_count_code=700)  # like ROCm: a larger batch faults
    plan, _ = _run(ex, v, pattern="fragmented", regions=1, blocks=20000, page=16, n=9000)
    assert plan.num_ranges == 9000 and st.counts == [8192, 808]

    unlimited = PlanOptions(max_descriptors=0)
    with pytest.raises(PlanError, match=r"call_sizes\[0\] = 9000: call 0 exceeds this executor's cap of 8192"):
        _run(ex, v, pattern="fragmented", regions=1, blocks=20000, page=16, n=9000, options=unlimited)
    assert st.counts == [8192, 808]  # refused before the driver saw it

    ex0, st = make(v, max_descriptors=0, max_count=8192, max_count_code=700)
    with pytest.raises(ExecutorError, match=r"hipMemcpyBatchAsync failed at chunk 0: hipErrorIllegalAddress \(700\); "
                                            "nothing was issued before it") as e:
        _run(ex0, v, pattern="fragmented", regions=1, blocks=20000, page=16, n=9000, options=unlimited)
    assert e.value.descriptor is None and st.counts == [9000]


def test_per_range_below_7_1_and_unknown_version(make):
    ex, st = make(hip_version(7, 0))
    plan, _ = _run(ex, hip_version(7, 0))
    assert st.counts == [] and sum(op[0] == "copy" for op in st.log) == plan.num_ranges
    ex, st = make(hip_version(7, 16), version_fails=1)  # hipRuntimeGetVersion fails: unknown = oldest
    assert ex.target.runtime_version == 0 and ex.target.label == "rocm-unknown"
    plan, _ = _run(ex, 0, "d2h")
    assert st.counts == [] and sum(op[0] == "copy" for op in st.log) == plan.num_ranges


def test_descriptor_error_with_fail_idx(make):
    v = hip_version(7, 16)
    ex, st = make(v, fail_at=5, fail_code=1)
    with pytest.raises(ExecutorError) as e:
        _run(ex, v, pattern="fragmented", options=PlanOptions(max_descriptors=4))
    assert e.value.chunk == 1 and e.value.descriptor == 5 and e.value.issued_chunks == 1
    assert "hipErrorInvalidValue (1); descriptor 5 is index 1 of the call" in str(e.value)
    assert "chunks 0..0 were issued before it" in str(e.value)


def test_gate_mismatch_names_both(make):
    ex, _ = make(hip_version(7, 2, 2))
    with pytest.raises(TargetMismatchError, match=r"rocm-7.16 .* rocm-7.2.2: .*'hip>=7.13 attrs'"):
        _run(ex, hip_version(7, 16))
    ex, _ = make(hip_version(7, 13))  # 7.13 and 7.14 sit on the same side of every gate
    _run(ex, hip_version(7, 14))


def test_library_load_errors_name_every_candidate(tmp_path):
    with pytest.raises(ExecutorError, match="tried .*nowhere.so"):
        load_hip(tmp_path / "nowhere.so")
    try:
        load_hip()
    except ExecutorError as e:
        for name in HIP_LIBRARIES:
            assert f"{name}:" in str(e)
    else:
        pytest.skip("a real HIP runtime is installed here")


@pytest.mark.rocm
def test_round_trip_on_rocm():
    ex = HipBatchExecutor()
    layout = presets.kv_layout(4, 128, 4096)
    mem = gpu_buffers(layout)
    for direction in ("d2h", "h2d"):
        gpu_round_trip(ex, plan_transfer(layout, presets.mapping("runs8", 32, 128, direction), ex.target), mem)


def test_the_callers_device_is_restored(make, lib_path):
    ex, st = make(hip_version(7, 16))
    lib = ctypes.CDLL(str(lib_path))
    assert lib.hipSetDevice(2) == 0  # the caller works on device 2; the executor copies on device 0
    layout = presets.kv_layout(2, 16, 256)
    plan = plan_transfer(layout, presets.mapping("runs8", 6, 16), ex.target)
    bufs = host_buffers(layout)
    want = expected(plan, bufs)
    ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    dev = ctypes.c_int(-1)
    assert lib.hipGetDevice(ctypes.byref(dev)) == 0 and dev.value == 2
