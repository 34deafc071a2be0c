"""Binding: what memory objects resolve to, the checks made before any copy, bind once, and the uint64 math."""
from __future__ import annotations

import ctypes
import struct
import warnings

import numpy as np
import pytest

from kvxfer.executors import BindingError, NumpyExecutor, RawMemory, bind, resolve
from kvxfer.executors._memory import check_location
from kvxfer.planner import COLUMNS, Buffer, Location, PlanError, TransferPlan, plan_transfer, presets


def test_resolves_numpy_torch_raw_and_cuda_array_interface():
    torch = pytest.importorskip("torch")
    a = np.zeros(64, dtype=np.float32)
    b = resolve(a, "a")
    assert (b.address, b.nbytes, b.location, b.writable) == (a.ctypes.data, 256, Location.HOST, True)
    t = torch.zeros(8, 4, dtype=torch.float16)
    b = resolve(t, "t")
    assert (b.address, b.nbytes, b.location, b.pinned) == (t.data_ptr(), 64, Location.HOST, False)
    assert resolve((4096, 100), "p").location is None
    assert resolve(RawMemory(4096, 10, Location.DEVICE, device=1), "r").device == 1

    class Cai:
        __cuda_array_interface__ = {"data": (8192, False), "shape": (4, 8), "typestr": "<f4", "strides": None, "version": 3}
    b = resolve(Cai(), "c")
    assert (b.address, b.nbytes, b.location) == (8192, 128, Location.DEVICE)
    with pytest.raises(BindingError, match="not contiguous"):
        resolve(t.t(), "t")
    with pytest.raises(BindingError, match="not C-contiguous"):
        resolve(a.reshape(8, 8)[:, ::2], "a")
    with pytest.raises(BindingError, match="null address"):
        resolve((0, 16), "z")
    with pytest.raises(BindingError, match="64-bit address space"):
        resolve((2**64 - 8, 16), "w")
    with pytest.raises(BindingError, match="expected a torch tensor"):
        resolve([1, 2, 3], "l")


def test_location_policy():
    dev = Buffer(name="g", nbytes=16, location=Location.DEVICE, device=1)
    host = Buffer(name="h", nbytes=16, location=Location.HOST)
    mem = resolve(np.zeros(16, np.uint8), "x")
    with pytest.raises(BindingError, match="places this buffer in device memory"):
        check_location(dev, mem)
    check_location(host, mem)
    with pytest.raises(BindingError, match="on device 1"):
        check_location(dev, resolve(RawMemory(4096, 16, Location.DEVICE, device=0), "g"))
    check_location(dev, resolve((4096, 16), "g"))  # unknown location: not checked


def _one_range_plan(page=64, blocks=8, direction="d2h"):
    layout = presets.kv_layout(1, blocks, page)
    return layout, plan_transfer(layout, presets.mapping("contiguous", 1, blocks, direction))


def test_matrix_flattens_and_odd_bindings_are_binding_errors():
    layout, plan = _one_range_plan(page=1, blocks=16)  # one 1-byte range
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    src = plan.buffers[int(plan.src_buf[0])].name
    dst = plan.buffers[int(plan.dst_buf[0])].name
    bufs[src][:] = 7
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", PendingDeprecationWarning)
        m = np.asmatrix(np.zeros((4, 4), np.uint8))  # 2-D subclass: slicing would pick rows
    NumpyExecutor().run(plan, dict(bufs, **{dst: m}))
    assert int(np.asarray(m).sum()) == 7 and np.count_nonzero(np.asarray(m)) == 1  # exactly one byte written
    with pytest.raises(BindingError, match="objects holds pointers"):
        NumpyExecutor().run(plan, dict(bufs, **{dst: np.zeros(16, dtype=object)}))
    with pytest.raises(BindingError, match=r"bindings\['bindings'\] = list: expected a mapping"):
        NumpyExecutor().run(plan, list(bufs.values()))


def test_torch_tensorover_immutable_bytes_is_read_only():
    torch = pytest.importorskip("torch")
    layout, plan = _one_range_plan(page=16, blocks=4)
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    dst = plan.buffers[int(plan.dst_buf[0])].name
    frozen = bytes(64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch warns that the buffer is not writable
        t = torch.frombuffer(frozen, dtype=torch.uint8)
    assert resolve(t, "t").writable is False
    with pytest.raises(BindingError, match="read-only, but the plan writes to it"):
        NumpyExecutor().run(plan, dict(bufs, **{dst: t}))
    assert frozen == bytes(64)
    NumpyExecutor().run(plan, dict(bufs, **{dst: torch.frombuffer(bytearray(64), dtype=torch.uint8)}))  # writable


def test_lowering_is_base_plus_offset_and_refuses_wrap():
    layout = presets.kv_layout(3, 32, 256, shared_device=True)
    plan = plan_transfer(layout, presets.mapping("fragmented", 10, 32, "h2d"))
    bindings = {"gpu": (1 << 40, layout.buffers[0].nbytes), "cpu": (3 << 40, layout.buffers[1].nbytes)}
    src, dst = bind(layout, bindings).lower(plan)
    assert src.dtype == dst.dtype == np.uint64
    base = np.array([1 << 40, 3 << 40], dtype=np.uint64)
    assert np.array_equal(src, base[plan.src_buf] + plan.src_offset)
    assert np.array_equal(dst, base[plan.dst_buf] + plan.dst_offset)
    top = 2**64 - layout.buffers[1].nbytes  # the highest base that still fits
    src, _ = bind(layout, dict(bindings, cpu=(top, layout.buffers[1].nbytes))).lower(plan)
    assert int(src.max()) + int(plan.nbytes[int(np.argmax(src))]) <= 2**64
    with pytest.raises(BindingError, match="64-bit address space"):
        bind(layout, dict(bindings, cpu=(top + 1, layout.buffers[1].nbytes)))


def _hand_made(plan, **columns):
    cols = {c: np.asarray(columns.get(c, getattr(plan, c))) for c in COLUMNS}
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=plan.call_offsets, columns=cols)


def test_malformed_plan_range_past_buffer_is_refused():
    layout, plan = _one_range_plan()
    d = plan.to_dict()
    d.pop("fingerprint")
    dst = plan.buffers[int(plan.dst_buf[0])]
    d["columns"]["dst_offset"][0] = dst.nbytes - 8  # runs 56 bytes past the buffer
    with pytest.raises(PlanError, match=r"dst_offset\[0\]"):  # reading such a plan fails
        TransferPlan.from_dict(d)
    bad = _hand_made(plan, dst_offset=[dst.nbytes - 8])  # a plan built by hand reaches the executor
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    with pytest.raises(PlanError, match=rf"dst_offset\[0\] = {dst.nbytes - 8}: range of 64 bytes runs past buffer '{dst.name}' of {dst.nbytes} bytes$"):
        NumpyExecutor().bind(layout, bufs).lower(bad)


@pytest.mark.parametrize("offset", [2**64 - 8, 2**63, 2**64 - 64])
def test_wrapping_ranges_are_refused_by_binding_and_the_numpy_executor(offset):
    layout, plan = _one_range_plan()
    bufs = {b.name: np.full(b.nbytes, 5, np.uint8) for b in layout.buffers}
    before = {k: v.copy() for k, v in bufs.items()}
    bad = _hand_made(plan, src_offset=np.array([offset], dtype=np.uint64))  # offset + 64 wraps (or nearly) uint64
    with pytest.raises(PlanError, match=rf"src_offset\[0\] = {offset}: range of 64 bytes runs past buffer"):
        NumpyExecutor().bind(layout, bufs).lower(bad)
    with pytest.raises(PlanError, match=rf"src_offset\[0\] = {offset}: range of 64 bytes runs past buffer"):
        NumpyExecutor().run(bad, bufs)
    assert all(np.array_equal(bufs[k], before[k]) for k in bufs)


def test_zero_byte_and_out_of_table_ranges_are_refused_up_front():
    layout, plan = _one_range_plan()
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    with pytest.raises(PlanError, match=r"nbytes\[0\] = 0: empty range"):
        NumpyExecutor().run(_hand_made(plan, nbytes=[0]), bufs)
    with pytest.raises(PlanError, match=r"attr\[0\] = 5: out of range"):
        NumpyExecutor().run(_hand_made(plan, attr=[5]), bufs)
    with pytest.raises(PlanError, match=r"dst_buf\[0\] = 9: out of range"):
        NumpyExecutor().run(_hand_made(plan, dst_buf=[9]), bufs)


def test_bind_once_refuses_another_buffer_table_and_a_closed_binding():
    layout, plan = _one_range_plan()
    ex = NumpyExecutor()
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    bound = ex.bind(layout, bufs)
    ex.run(plan, bound)
    other = presets.kv_layout(1, 16, 64)  # same names, other sizes
    plan2 = plan_transfer(other, presets.mapping("contiguous", 1, 16, "d2h"))
    with pytest.raises(BindingError, match=r"bindings\['cpu'\].*nbytes=1024.*the bound buffer table has.*nbytes=512"):
        ex.run(plan2, bound)
    with pytest.raises(BindingError, match="smaller than the plan's buffer"):
        ex.bind(other, bufs)  # rebinding memory that no longer fits the buffer is refused by name
    bound.close()
    with pytest.raises(BindingError, match="was closed; bind again"):
        ex.run(plan, bound)
    with pytest.raises(BindingError, match="missing"):
        ex.bind(layout, {})


def test_verify_refuses_memory_that_moved_since_bind():
    torch = pytest.importorskip("torch")
    layout, plan = _one_range_plan()
    bufs = {b.name: torch.zeros(b.nbytes, dtype=torch.uint8) for b in layout.buffers}
    bound = bind(layout, bufs, check=lambda buf, mem: None)  # as a DMA executor binds
    bound.verify()
    bufs["cpu"].set_(torch.zeros(1 << 20, dtype=torch.uint8))  # the tensor now points elsewhere: the bound address is stale
    with pytest.raises(BindingError, match=r"bindings\['cpu'\] = .*changed since bind .*bind it again"):
        bound.verify()


@pytest.mark.parametrize("blocks", [8, 4096])  # few ranges per buffer run (gathered) and many (checked per run)
@pytest.mark.parametrize("where", ["first", "last"])
def test_range_past_its_buffer_is_refused_whichever_way_ranges_are_lowered(blocks, where):
    layout = presets.kv_layout(2, 2 * blocks, 16, shared_device=False)
    plan = plan_transfer(layout, presets.mapping("fragmented", blocks, 2 * blocks, "h2d"))
    assert plan.num_ranges == 2 * blocks
    bindings = {b.name: (1 << 40 + i, b.nbytes) for i, b in enumerate(layout.buffers)}
    bound = bind(layout, bindings)
    src, dst = bound.lower(plan)
    base = np.array([1 << 40 + i for i in range(len(layout.buffers))], dtype=np.uint64)
    assert np.array_equal(dst, base[plan.dst_buf] + plan.dst_offset)
    i = 0 if where == "first" else plan.num_ranges - 1
    dst_off = plan.dst_offset.copy()
    buf = plan.buffers[int(plan.dst_buf[i])]
    dst_off[i] = buf.nbytes - 8  # 8 bytes inside, 8 past the end
    with pytest.raises(PlanError, match=rf"dst_offset\[{i}\] = {buf.nbytes - 8}: range of 16 bytes runs past buffer '{buf.name}'"):
        bound.lower(_hand_made(plan, dst_offset=dst_off))


def _map_pages(n: int) -> tuple[ctypes.CDLL, int]:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    base = libc.mmap(None, n * 4096, 3, 0x22, -1, 0)  # PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS
    assert base not in (None, ctypes.c_void_p(-1).value)
    return libc, base


@pytest.mark.parametrize("offset", [0, 8, 16, 24, 31])
def test_bytes_data_just_past_a_page_boundary_is_recognised_as_immutable(offset):
    """The header of a bytes object whose data starts within 32 bytes of a page lies on the page before."""
    from kvxfer.executors._memory import over_immutable_bytes
    libc, base = _map_pages(2)
    try:
        data = base + 4096 + offset
        header = data - (bytes.__basicsize__ - bytes.__itemsize__)  # a bytes object's layout, written by hand
        ctypes.memmove(header + object.__basicsize__ - 8, struct.pack("<QQ", id(bytes), 100), 16)
        assert over_immutable_bytes(data, 64) and over_immutable_bytes(data, 100)
        assert not over_immutable_bytes(data, 101)  # more bytes than the object holds: not that object
        libc.munmap(base, 4096)  # the page before is gone: reading the header there must not fault
        fields = header + object.__basicsize__ - 8  # type and size: all that is read
        assert over_immutable_bytes(data, 64) is (fields >= base + 4096)
    finally:
        libc.munmap(base + 4096, 4096)


def test_bytes_data_far_from_a_page_boundary_is_recognised_as_immutable_without_the_slow_read():
    from kvxfer.executors import _memory as memory
    libc, base = _map_pages(1)
    try:
        data = base + 512
        ctypes.memmove(data - 24, struct.pack("<QQ", id(bytes), 64), 16)
        assert memory.over_immutable_bytes(data, 64)
        ctypes.memmove(data - 24, struct.pack("<QQ", id(bytearray), 64), 16)
        assert not memory.over_immutable_bytes(data, 64)  # another type: writable memory
    finally:
        libc.munmap(base, 4096)


def test_torch_tensors_over_bytes_objects_of_many_sizes_are_read_only():
    """torch.frombuffer over bytes objects wherever the allocator put them: every one is refused as a destination."""
    torch = pytest.importorskip("torch")
    from kvxfer.executors._memory import over_immutable_bytes
    objects = [bytes(range(n % 256)) * (1 + n // 256) + b"x" for n in range(1, 400)]  # many sizes: many placements
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for b in objects:
            t = torch.frombuffer(b, dtype=torch.uint8)
            assert over_immutable_bytes(t.data_ptr(), len(b)) and resolve(t, "t").writable is False
