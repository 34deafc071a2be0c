"""CUDA batch executor end to end against the C driver shim (host memory), and the struct layout vs cuda.h."""
from __future__ import annotations

import ctypes
import subprocess

import numpy as np
import pytest

from kvxfer.executors import CudaBatchExecutor, ExecutorError, NumpyExecutor, TargetMismatchError
from kvxfer.executors._dma import ATTR_DTYPE, MemcpyAttributes, MemLocation
from kvxfer.planner import Case, PlanError, PlanOptions, Target, cuda_version, plan_transfer, presets

from .shims.build import CUDA_INCLUDE, HERE, ShimState, build, compiler, has_cuda_h
from .shims.cases import assert_same, expected, gpu_buffers, gpu_round_trip, host_buffers
from .shims.runtime import ShimCudaRuntime

pytestmark = pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the driver shim")

V13, V128, V124 = cuda_version(13, 0), cuda_version(12, 8), cuda_version(12, 4)


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory):
    return build("fake_cuda", tmp_path_factory.mktemp("cuda_shim"))


@pytest.fixture
def make(shim_path):
    """make(version) -> (executor, shim state), state reset."""
    def _make(version: int = V13, **kw):
        state = ShimState(ctypes.CDLL(str(shim_path)))
        state.reset()
        state.set(null_batch=0)
        return CudaBatchExecutor(ShimCudaRuntime(shim_path, version), **kw), state
    return _make


def _plan(version, direction="h2d", pattern="runs8", n=24, regions=3, blocks=64, page=512, max_desc=None, **kw):
    layout = presets.kv_layout(regions, blocks, page, **kw)
    m = presets.mapping(pattern, n, blocks, direction, seed=n)
    return layout, plan_transfer(layout, m, Target(platform="cuda", runtime_version=version),
                                 PlanOptions(max_descriptors=max_desc))


@pytest.mark.parametrize("version", [V13, V128, V124])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("pattern,shared", [("runs8", False), ("fragmented", True), ("descending", False),
                                            ("interleaved", True), ("contiguous", True)])
def test_matches_numpy_and_lowers_one_to_one(make, version, direction, pattern, shared):
    layout, plan = _plan(version, direction, pattern, max_desc=5, shared_device=shared)
    ex, st = make(version)
    bufs = host_buffers(layout, seed=7)
    want = expected(plan, bufs)
    t = ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    assert (t.nbytes, t.ranges, t.calls) == (plan.total_bytes, plan.num_ranges, plan.num_calls)
    assert t.done() and t.elapsed_s is not None and t.elapsed_s >= 0
    if version == V124:  # per-range fallback: one cuMemcpyAsync per range, nothing batched
        assert st.counts == []
        assert [op for op in st.log if op[0] == "copy"] == [("copy", st.streams[0], int(n)) for n in plan.nbytes]
        return
    assert st.counts == plan.call_sizes.tolist()
    assert st.has_fail_idx == [int(version == V128)] * plan.num_calls  # 12.8 ABI passes failIdx, 13.0 has none
    runs = [plan.attr_runs(c) for c in range(plan.num_calls)]
    assert st.num_attrs == [len(ids) for ids, _ in runs]
    recs, idx = st.attrs(ATTR_DTYPE)
    want_recs = np.concatenate([np.array([(plan.attrs[i].src_access_order.code,
                                           (plan.attrs[i].src_location.code, plan.attrs[i].src_location.id),
                                           (plan.attrs[i].dst_location.code, plan.attrs[i].dst_location.id),
                                           plan.attrs[i].flags) for i in ids], dtype=ATTR_DTYPE) for ids, _ in runs])
    assert recs.tobytes() == want_recs.tobytes()
    assert idx.tolist() == np.concatenate([s for _, s in runs]).tolist()
    order = 3 if direction == "h2d" else 1  # ANY for loads, STREAM for stores
    assert set(recs["srcAccessOrder"].tolist()) == {order}


def test_random_mappings_match_numpy(make):
    ex, _ = make(V128)
    rng = np.random.default_rng(3)
    for trial in range(12):
        blocks = int(rng.integers(8, 64))
        layout = presets.kv_layout(int(rng.integers(1, 4)), blocks, int(rng.choice([64, 96, 256])),
                                   shared_device=bool(trial % 2), shared_host=bool(trial % 3))
        n = int(rng.integers(1, blocks))
        m = dict(direction=["h2d", "d2h"][trial % 2], src_ids=rng.integers(0, blocks, n),
                 dst_ids=rng.permutation(blocks)[:n])
        plan = plan_transfer(layout, m, Target(platform="cuda", runtime_version=V128),
                             PlanOptions(max_descriptors=int(rng.integers(0, 4))))
        bufs = host_buffers(layout, seed=trial)
        want = expected(plan, bufs)
        ex.run(plan, bufs).wait()
        assert_same(bufs, want)


def test_stream_order_compute_then_previous_transfer(make):
    layout, plan = _plan(V13)
    ex, st = make(V13)
    s = st.streams[0]  # the executor's copy stream
    bufs = host_buffers(layout)
    first = ex.run(plan, bufs, stream=77)
    second = ex.run(plan, bufs, stream=77)
    second.wait()
    ev_end_first = first.end
    log = [op for op in st.log if op[0] not in ("sync", "stream")]
    (start1, end1), (start2, end2) = (first.start, first.end), (second.start, second.end)
    ready1, ready2 = start1 - 1, start2 - 1  # events are made ready, start, end, marks...
    assert log == [("record", ready1, 77), ("wait", s, ready1), ("record", start1, s), ("batch", s, plan.num_ranges),
                   ("record", end1, s),
                   ("record", ready2, 77), ("wait", s, ready2), ("wait", s, ev_end_first), ("record", start2, s),
                   ("batch", s, plan.num_ranges), ("record", end2, s)]


@pytest.mark.parametrize("version", [V13, V124])
def test_per_call_completion_for_layer_wise_plans(make, version):
    layout = presets.kv_layout(3, 32, 64)
    plan = plan_transfer(layout, presets.mapping("runs8", 12, 32), Target(platform="cuda", runtime_version=version),
                         PlanOptions(regions_per_call=1))
    assert plan.num_calls == 3
    ex, st = make(version)
    bufs = host_buffers(layout)
    want = expected(plan, bufs)
    t = ex.run(plan, bufs)
    end, (mark0, mark1) = t.end, t.marks[:2]
    s = st.streams[0]
    issue = "batch" if version == V13 else "copy"
    marks = {mark0: "mark0", mark1: "mark1", end: "end"}
    seq = [op[0] if op[0] == issue else marks[op[1]] for op in st.log
           if op[0] == issue or (op[0] == "record" and op[1] in marks)]
    per_call = [1] * 3 if version == V13 else plan.call_sizes.tolist()  # one batch, or one copy per range
    want_seq = []
    for c, name in enumerate(("mark0", "mark1", "end")):
        want_seq += [issue] * per_call[c] + [name]
    assert seq == want_seq  # each layer's event follows that layer's copies and precedes the next layer's
    assert all(op[2] == s for op in st.log if op[0] == "record" and op[1] in marks)
    assert [t.call_done(i) for i in range(3)] == [True, True, True] and t.call_done(-1)
    t.wait_call(1)
    t.stream_wait(99, call=0)
    assert ("wait", 99, mark0) in st.log
    with pytest.raises(IndexError, match="call = 3: the transfer has 3 calls"):
        t.call_done(3)
    t.wait()
    assert_same(bufs, want)


@pytest.mark.parametrize("version,descriptor", [(V128, True), (V13, False), (V124, True)])
def test_driver_error_names_error_call_and_descriptor(make, version, descriptor):
    layout, plan = _plan(version, pattern="fragmented", max_desc=4)
    assert plan.num_calls >= 3
    ex, st = make(version)
    s = st.streams[0]
    st.set(fail_at=9, fail_code=700)  # descriptor 9 = index 1 of call 2
    bufs = host_buffers(layout)
    with pytest.raises(ExecutorError) as e:
        ex.run(plan, bufs)
    msg = str(e.value)
    assert "CUDA_ERROR_ILLEGAL_ADDRESS (700)" in msg and "chunk 2" in msg and "chunks 0..1 were issued" in msg
    assert e.value.chunk == 2 and e.value.issued_chunks == 2
    assert e.value.descriptor == (9 if descriptor else None)
    assert ("descriptor 9 is index 1 of the call" in msg) == descriptor
    # the failed transfer still gets an end event, the last one recorded on the copy stream, and the next
    # transfer waits for it
    failed_end = [a for op, a, stream in st.log if op == "record" and stream == s][-1]
    st.reset()
    ex.run(plan, bufs).wait()
    assert ("wait", s, failed_end) in st.log


def test_null_entry_point_is_unavailable_not_a_crash(make, shim_path):
    ex, st = make(V13)
    st.set(null_batch=1)
    ex2 = CudaBatchExecutor(ShimCudaRuntime(shim_path, V13))  # resolves again, now NULL
    layout, plan = _plan(V13)
    with pytest.raises(ExecutorError, match="NULL: unavailable") as e:
        ex2.run(plan, host_buffers(layout))
    assert e.value.issued_chunks == 0 and st.counts == []


def test_target_mismatch_names_both_and_replan(make):
    ex, st = make(V13)
    layout, plan = _plan(V128)
    with pytest.raises(TargetMismatchError, match=r"cuda-12.8 .* cuda-13.0: .*'cuda>=13.0 batch_v2'"):
        ex.run(plan, host_buffers(layout))
    rocm = plan_transfer(layout, presets.mapping("runs8", 8, 64), Target(platform="rocm", runtime_version=71600000))
    with pytest.raises(TargetMismatchError, match="platforms differ"):
        ex.run(rocm, host_buffers(layout))
    assert st.counts == []
    case = Case(layout=layout, mapping=presets.mapping("runs8", 24, 64, seed=24),
                target=Target(platform="cuda", runtime_version=V128))
    bufs = host_buffers(layout, 1)
    want = expected(case.model_copy(update={"target": ex.target}).plan(), bufs)
    ex.run_case(case, bufs).wait()
    assert_same(bufs, want)
    with pytest.raises(TargetMismatchError, match=r"plan target cuda-12.8 does not fit the runtime found, cuda-13.0"):
        ex.run_case(case, bufs, replan=False)


def test_cap_refused_before_issue(make):
    ex, st = make(V13, max_descriptors=4)
    layout, plan = _plan(V13, pattern="fragmented")
    with pytest.raises(PlanError, match="call_sizes.*exceeds this executor's cap of 4"):
        ex.run(plan, host_buffers(layout))
    assert st.counts == []


def test_binding_errors_before_issue(make):
    from kvxfer.executors import BindingError
    ex, st = make(V13)
    layout, plan = _plan(V13, direction="d2h")
    bufs = host_buffers(layout)
    missing = dict(bufs)
    missing.pop("cpu")
    with pytest.raises(BindingError, match="'cpu'.*missing"):
        ex.run(plan, missing)
    small = dict(bufs, cpu=bufs["cpu"][:-1])
    with pytest.raises(BindingError, match="smaller than"):
        ex.run(plan, small)
    ro = bufs["cpu"].copy()
    ro.flags.writeable = False
    with pytest.raises(BindingError, match="read-only"):
        ex.run(plan, dict(bufs, cpu=ro))
    assert st.counts == []


def test_struct_layout_matches_cuda_h(tmp_path):
    if not has_cuda_h():
        pytest.skip(f"cuda.h not found under {CUDA_INCLUDE}")
    exe = tmp_path / "layout"
    subprocess.run([compiler(), f"-I{CUDA_INCLUDE}", str(HERE / "layout.c"), "-o", str(exe)], check=True)
    c = dict(line.split() for line in subprocess.run([str(exe)], capture_output=True, text=True, check=True).stdout.splitlines())
    c = {k: int(v) for k, v in c.items()}
    assert ctypes.sizeof(MemcpyAttributes) == c["sizeof"] == ATTR_DTYPE.itemsize == 24
    assert ctypes.alignment(MemcpyAttributes) == c["alignof"]
    for f in ("srcAccessOrder", "srcLocHint", "dstLocHint", "flags"):
        assert getattr(MemcpyAttributes, f).offset == c[f] == ATTR_DTYPE.fields[f][1]
    assert (ctypes.sizeof(MemLocation), MemLocation.type.offset, MemLocation.id.offset) == (c["loc.sizeof"], c["loc.type"], c["loc.id"])
    from kvxfer.planner import AccessOrder, Location
    from kvxfer.planner.plan import LocationHint
    from kvxfer.planner.target import FLAG_PREFER_OVERLAP_WITH_COMPUTE
    assert (AccessOrder.ANY.code, AccessOrder.STREAM.code) == (c["enum.ANY"], c["enum.STREAM"])
    assert LocationHint(location=Location.HOST).code == c["enum.HOST"]
    assert LocationHint(location=Location.DEVICE).code == c["enum.DEVICE"]
    assert FLAG_PREFER_OVERLAP_WITH_COMPUTE == c["enum.PREFER_OVERLAP"]


def test_prototype_check_rejects_a_wrong_abi(tmp_path):
    """The shim's compile-time check against cudaTypedefs.h fails when a fake's signature drifts."""
    if not has_cuda_h():
        pytest.skip(f"cuda.h not found under {CUDA_INCLUDE}")
    src = (HERE / "fake_cuda.c").read_text()
    broken = src.replace("size_t *failIdx, CUstream s) {", "CUstream s) {").replace("failIdx, H(s), E_INVALID_VALUE);\n}\n\nCUresult fake_cuMemcpyBatchAsync_v13000", "NULL, H(s), E_INVALID_VALUE);\n}\n\nCUresult fake_cuMemcpyBatchAsync_v13000", 1)
    assert broken != src
    (tmp_path / "broken.c").write_text(broken)
    r = subprocess.run([compiler(), "-shared", "-fPIC", "-Wall", "-Werror", "-DSHIM_WITH_CUDA_H", f"-I{CUDA_INCLUDE}",
                        f"-I{HERE}", str(tmp_path / "broken.c"), "-o", str(tmp_path / "b.so")], capture_output=True, text=True)
    assert r.returncode != 0 and "PFN_cuMemcpyBatchAsync_v12080" in r.stderr


@pytest.mark.gpu
def test_round_trip_on_gpu():
    ex = CudaBatchExecutor(device=0)
    layout = presets.kv_layout(4, 128, 4096)
    mem = gpu_buffers(layout)
    for direction, pattern in (("d2h", "runs8"), ("h2d", "descending")):
        gpu_round_trip(ex, plan_transfer(layout, presets.mapping(pattern, 32, 128, direction), ex.target), mem)


def test_bound_memory_lives_until_the_copies_finish(make):
    import gc
    import weakref

    layout, plan = _plan(V13)
    ex, st = make(V13)
    bufs = host_buffers(layout)
    owner = weakref.ref(bufs[plan.buffers[int(plan.dst_buf[0])].name])
    ex.run(plan, bufs)  # the caller drops the Transfer at once
    del bufs
    gc.collect()
    assert owner() is not None  # the executor still holds the memory
    ex.run(plan, host_buffers(layout))  # the first transfer is seen finished and let go
    gc.collect()
    assert owner() is None


def test_two_devices_and_a_call_cut_mid_run_pass_every_attribute_run(make):
    """Regions on devices 0 and 1; max_descriptors=4 cuts call 0 after device 1's first range, so call 0 carries
    two attribute runs and call 1 one. Expected values are written out from the CUDA headers' enums."""
    from kvxfer.planner import Buffer, Layout, Placement, Region
    layout = Layout(buffers=(Buffer(name="gpu0", nbytes=2048, location="device", device=0),
                             Buffer(name="gpu1", nbytes=2048, location="device", device=1),
                             Buffer(name="cpu", nbytes=4096, location="host")),
                    regions=(Region(name="k0", page_bytes=256, device=Placement(buffer="gpu0"), host=Placement(buffer="cpu")),
                             Region(name="k1", page_bytes=256, device=Placement(buffer="gpu1"),
                                    host=Placement(buffer="cpu", byte_offset=2048))))
    plan = plan_transfer(layout, {"direction": "h2d", "src_ids": [0, 2, 4], "dst_ids": [1, 3, 5]},
                         Target(platform="cuda", runtime_version=V13), PlanOptions(max_descriptors=4))
    ex, st = make(V13)
    bufs = host_buffers(layout, seed=3)
    want = expected(plan, bufs)
    ex.run(plan, bufs).wait()
    assert_same(bufs, want)
    assert st.counts == [4, 2]
    assert st.num_attrs == [2, 1]  # call 0: device 0's three ranges, then device 1's first
    recs, idx = st.attrs(ATTR_DTYPE)
    assert idx.tolist() == [0, 3, 0]  # attrsIdxs are local to each call
    ANY, HOST, DEVICE = 3, 2, 1  # CU_MEMCPY_SRC_ACCESS_ORDER_ANY, CU_MEM_LOCATION_TYPE_HOST / _DEVICE
    assert recs.tolist() == [(ANY, (HOST, 0), (DEVICE, 0), 0), (ANY, (HOST, 0), (DEVICE, 1), 0),
                             (ANY, (HOST, 0), (DEVICE, 1), 0)]
    # each descriptor's destination hint, from the records and attrsIdxs the driver received
    per_descriptor = []
    for call, (count, first) in enumerate(zip(st.counts, (0, 2))):
        starts = idx[first:first + st.num_attrs[call]].tolist() + [count]
        hints = recs[first:first + st.num_attrs[call]]["dstLocHint"]["id"].tolist()
        per_descriptor += [hints[j] for j in range(len(hints)) for _ in range(starts[j], starts[j + 1])]
    assert per_descriptor == [0, 0, 0, 1, 1, 1]


def test_bind_once_then_run_many_plans(make):
    from kvxfer.executors import BindingError
    ex, st = make(V13)
    layout = presets.kv_layout(3, 64, 512)
    bufs = host_buffers(layout, seed=4)
    bound = ex.bind(layout, bufs)
    for pattern in ("runs8", "fragmented", "descending"):
        for direction in ("h2d", "d2h"):
            plan = plan_transfer(layout, presets.mapping(pattern, 24, 64, direction, seed=2),
                                 Target(platform="cuda", runtime_version=V13))
            want = expected(plan, bufs)
            ex.run(plan, bound).wait()
            assert_same(bufs, want)
    other = presets.kv_layout(3, 32, 512)
    with pytest.raises(BindingError, match=r"bindings\['cpu'\].*the bound buffer table has"):
        ex.run(plan_transfer(other, presets.mapping("runs8", 8, 32), Target(platform="cuda", runtime_version=V13)), bound)
    issued = len(st.counts)
    with pytest.raises(BindingError, match="bound by another executor kind"):
        ex.run(plan, NumpyExecutor().bind(layout, bufs))
    assert len(st.counts) == issued


@pytest.mark.parametrize("torch_told", [False, True])
def test_close_keeps_a_copy_stream_torch_was_told_about(make, monkeypatch, torch_told):
    """torch records an event on the copy stream whenever a tensor bound to it is freed, even after close: a
    stream torch was told about must outlive the executor (destroying it aborted the process on an H200)."""
    import kvxfer.executors._dma as dma
    monkeypatch.setattr(dma, "hold_for_stream", lambda bound, stream: torch_told)
    layout, plan = _plan(V13)
    ex, _ = make(V13)
    destroyed = []
    real = ex.runtime.stream_destroy
    monkeypatch.setattr(ex.runtime, "stream_destroy", lambda s: destroyed.append(s) or real(s))
    bound = ex.bind(layout, host_buffers(layout, seed=1))
    ex.run(plan, bound).wait()
    bound.close()
    ex.close()
    assert len(destroyed) == (0 if torch_told else 1)
    with pytest.raises(ExecutorError, match="closed"):
        ex.run(plan, host_buffers(layout, seed=2))


def test_an_attribute_id_equal_to_its_tables_size_written_after_the_check_is_refused_before_any_call(make):
    """The attribute id of the last call's last range is set to the table's size after the plan's check: the run is
    refused (PlanError naming the column and range) before the first batch call is issued, not when the last call
    looks its attributes up with earlier calls already on the stream."""
    layout, plan = _plan(V13, max_desc=3)
    assert plan.check().checked and plan.num_calls >= 3 and len(plan.attrs) == 1
    attr = np.array(plan.attr)
    attr[-1] = len(plan.attrs)
    plan._store["attr"] = attr  # as a holder writing the column through torch would change it
    plan._dense.clear()
    ex, st = make(V13)
    bufs = host_buffers(layout, seed=3)
    before = {k: v.copy() for k, v in bufs.items()}
    with pytest.raises(PlanError, match=rf"^attr\[{plan.num_ranges - 1}\] = 1: out of range \(the plan has 1\)"):
        ex.run(plan, bufs).wait()
    assert st.counts == [], "batch calls were issued before the refusal"
    assert all(np.array_equal(bufs[k], before[k]) for k in bufs)
    ex.close()
