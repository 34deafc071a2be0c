"""Address binding: what memory objects resolve to, the checks made before any copy, and the uint64 math."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import BindingError, RawMemory, bind_addresses
from kvxfer.executors.base import check_location, resolve_memory
from kvxfer.planner import COLUMNS, Buffer, Location, PlanError, TransferPlan, plan_transfer, presets


def test_resolves_numpy_torch_raw_and_cuda_array_interface():
    torch = pytest.importorskip("torch")
    a = np.zeros(64, dtype=np.float32)
    b = resolve_memory(a, "a")
    assert (b.address, b.nbytes, b.location, b.writable) == (a.ctypes.data, 256, Location.HOST, True)
    t = torch.zeros(8, 4, dtype=torch.float16)
    b = resolve_memory(t, "t")
    assert (b.address, b.nbytes, b.location, b.pinned) == (t.data_ptr(), 64, Location.HOST, False)
    assert resolve_memory((4096, 100), "p").location is None
    assert resolve_memory(RawMemory(4096, 10, Location.DEVICE, device=1), "r").device == 1

    class Cai:
        __cuda_array_interface__ = {"data": (8192, False), "shape": (4, 8), "typestr": "<f4", "strides": None, "version": 3}
    b = resolve_memory(Cai(), "c")
    assert (b.address, b.nbytes, b.location) == (8192, 128, Location.DEVICE)
    with pytest.raises(BindingError, match="not contiguous"):
        resolve_memory(t.t(), "t")
    with pytest.raises(BindingError, match="not C-contiguous"):
        resolve_memory(a.reshape(8, 8)[:, ::2], "a")
    with pytest.raises(BindingError, match="null address"):
        resolve_memory((0, 16), "z")
    with pytest.raises(BindingError, match="64-bit address space"):
        resolve_memory((2**64 - 8, 16), "w")
    with pytest.raises(BindingError, match="expected a torch tensor"):
        resolve_memory([1, 2, 3], "l")


def test_location_policy():
    dev = Buffer(name="g", nbytes=16, location=Location.DEVICE, device=1)
    host = Buffer(name="h", nbytes=16, location=Location.HOST)
    mem = resolve_memory(np.zeros(16, np.uint8), "x")
    with pytest.raises(BindingError, match="places this buffer in device memory"):
        check_location(dev, mem)
    check_location(dev, mem, host_as_device=True)  # host-memory stand-ins
    check_location(host, mem)
    with pytest.raises(BindingError, match="on device 1"):
        check_location(dev, resolve_memory(RawMemory(4096, 16, Location.DEVICE, device=0), "g"))
    check_location(dev, resolve_memory((4096, 16), "g"))  # unknown location: not checked


def test_addresses_are_base_plus_offset_vectorized():
    layout = presets.kv_layout(3, 32, 256, shared_device=True)
    plan = plan_transfer(layout, presets.mapping("fragmented", 10, 32, "h2d"))
    bindings = {"gpu": (1 << 40, layout.buffers[0].nbytes), "cpu": (3 << 40, layout.buffers[1].nbytes)}
    a = bind_addresses(plan, bindings)
    assert a.src.dtype == a.dst.dtype == np.uint64
    base = np.array([1 << 40, 3 << 40], dtype=np.uint64)
    assert np.array_equal(a.src, base[plan.src_buf] + plan.src_offset)
    assert np.array_equal(a.dst, base[plan.dst_buf] + plan.dst_offset)
    top = 2**64 - layout.buffers[1].nbytes  # the highest base that still fits
    a = bind_addresses(plan, dict(bindings, cpu=(top, layout.buffers[1].nbytes)))
    assert int(a.src.max()) + int(plan.nbytes[int(np.argmax(a.src))]) <= 2**64
    with pytest.raises(BindingError, match="64-bit address space"):
        bind_addresses(plan, dict(bindings, cpu=(top + 1, layout.buffers[1].nbytes)))


def test_malformed_plan_range_past_buffer_is_refused():
    layout = presets.kv_layout(1, 8, 64)
    plan = plan_transfer(layout, presets.mapping("contiguous", 2, 8, "d2h"))
    d = plan.to_dict()
    d.pop("fingerprint")
    dst = plan.buffers[int(plan.dst_buf[0])]
    d["columns"]["dst_offset"][0] = dst.nbytes - 8  # runs 120 bytes past the buffer
    with pytest.raises(PlanError, match=r"dst_offset\[0\]"):  # reading such a plan fails
        TransferPlan.from_dict(d)
    cols = {c: np.asarray(d["columns"][c]) for c in COLUMNS}  # a plan built by hand reaches the executor
    bad = TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                       regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                       call_offsets=plan.call_offsets, columns=cols)
    with pytest.raises(BindingError, match=rf"range 0 .*dst range runs past the buffer's {dst.nbytes} bytes \(malformed plan\)"):
        bind_addresses(bad, {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}, lambda buf, mem: None)
