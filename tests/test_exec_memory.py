"""No executor writes to memory its binding does not keep alive, and lowering uses the values it checked.

Bound memory holds the memory itself (a tensor's storage) and each run refuses a bound tensor that no longer
points at it (``set_``, ``.data = ...``); on the CPU torch refuses to grow a bound storage at all, so a resized
tensor's memory stays where it was and is the only memory written. Whatever chain of views leads from the object
bound to what owns the memory (an array a view or ``torch.from_numpy`` shows, the buffer under ``np.frombuffer``
or ``torch.frombuffer``, a ctypes buffer), that owner is held or probed, or the binding refused saying what to
bind, and a closed binding holds nothing. A plan column that changes right after its first read (as a racing thread could change it)
never makes an executor write past a binding: every byte outside the bound buffers is a guard that must stay.
Run on the NumPy executor and on the CUDA batch executor over the C driver shim (host memory).
"""
from __future__ import annotations

import ctypes
import gc

import numpy as np
import pytest

from kvxfer.executors import BindingError, CudaBatchExecutor, NumpyExecutor, bind
from kvxfer.planner import COLUMNS, PlanError, Target, TransferPlan, cuda_version, plan_transfer, presets
from kvxfer.testing import apply_copies, expected_copies

from .shims.build import ShimState, build, compiler

torch = pytest.importorskip("torch")

V13 = cuda_version(13, 0)
LAYOUT = presets.kv_layout(2, 64, 64, shared_host=False)  # host cpu.kv0/kv1, device gpu.kv0/kv1: 4 KiB each
GUARD = 4096


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return build("fake_cuda", tmp_path_factory.mktemp("memory_shim"))


@pytest.fixture(params=["numpy", "cuda-shim"])
def executor(request):
    if request.param == "numpy":
        return NumpyExecutor()
    from .shims.runtime import ShimCudaRuntime
    path = request.getfixturevalue("shim_path")
    state = ShimState(ctypes.CDLL(str(path)))
    state.reset()
    state.set(null_batch=0)
    return CudaBatchExecutor(ShimCudaRuntime(path, V13))


def _plan(direction: str = "h2d") -> TransferPlan:
    return plan_transfer(LAYOUT, presets.mapping("fragmented", 16, 64, direction, seed=3),
                         Target(platform="cuda", runtime_version=V13))


def _tensors(seed: int = 0) -> dict[str, object]:
    g = torch.Generator().manual_seed(seed)
    return {b.name: torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8, generator=g) for b in LAYOUT.buffers}


def _want(plan: TransferPlan, tensors: dict) -> dict[str, np.ndarray]:
    """Every buffer after ``plan``, from the oracle's per-piece copies (not from an executor)."""
    out = {k: _bytes(v) for k, v in tensors.items()}
    apply_copies(expected_copies(LAYOUT, _mapping(plan)), out)
    return out


def _bytes(t) -> np.ndarray:
    """A copy of a tensor's bytes (``t.numpy()`` itself would fix the size of ``t``'s storage)."""
    return t.clone().numpy()


def _mapping(plan: TransferPlan):
    return presets.mapping("fragmented", 16, 64, plan.direction.value, seed=3)


MOVED = {  # the bound tensor ends up pointing at other memory: the run must be refused, naming it
    "set_": lambda t: t.set_(torch.zeros(t.numel(), dtype=t.dtype)),
    ".data =": lambda t: setattr(t, "data", torch.zeros(t.numel(), dtype=t.dtype)),
}
RESIZED = {  # the bound memory stays where it was: shrinking keeps it, growing a bound CPU storage is refused by torch
    "resize_ smaller": (lambda t: t.resize_(t.numel() // 2), None),
    "resize_ larger": (lambda t: t.resize_(t.numel() * 64), "not resizable"),
    "untyped_storage().resize_": (lambda t: t.untyped_storage().resize_(t.untyped_storage().nbytes() * 64), "not resizable"),
}


@pytest.mark.parametrize("ran_before", [False, True], ids=["first run", "after a run"])
@pytest.mark.parametrize("how", list(MOVED))
def test_a_run_over_a_tensor_that_moved_since_bind_is_refused_and_touches_nothing(executor, how, ran_before):
    plan = _plan()
    tensors = _tensors()
    bound = executor.bind(LAYOUT, tensors)
    if ran_before:  # the same plan ran fine before the move: what the binding learnt then must not hide it
        executor.run(plan, bound).wait()
    dst = plan.buffers[int(plan.dst_buf[0])].name
    MOVED[how](tensors[dst])
    gc.collect()
    unrelated = [torch.zeros(LAYOUT.buffers[0].nbytes, dtype=torch.uint8) for _ in range(16)]  # may reuse freed memory
    before = {k: _bytes(v) for k, v in tensors.items()}
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = Tensor.* no longer the memory bound, .*bind it again"):
        executor.run(plan, bound).wait()
    assert all(not u.any() for u in unrelated)
    assert all(np.array_equal(_bytes(tensors[k]), before[k]) for k in tensors)
    executor.close()


@pytest.mark.parametrize("how", list(RESIZED))
def test_a_resized_bound_tensor_keeps_its_memory_and_runs_write_only_that_memory(executor, how):
    plan = _plan()
    tensors = _tensors()
    want = _want(plan, tensors)
    bound = executor.bind(LAYOUT, tensors)
    dst = plan.buffers[int(plan.dst_buf[0])].name
    storage = tensors[dst].untyped_storage()
    address, nbytes = storage.data_ptr(), storage.nbytes()
    resize, refusal = RESIZED[how]
    if refusal is None:
        resize(tensors[dst])
    else:
        with pytest.raises(RuntimeError, match=refusal):
            resize(tensors[dst])
    assert (storage.data_ptr(), storage.nbytes()) == (address, nbytes)  # the memory bound was never freed
    unrelated = [torch.zeros(LAYOUT.buffers[0].nbytes, dtype=torch.uint8) for _ in range(16)]
    executor.run(plan, bound).wait()
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    assert np.array_equal(_bytes(whole), want[dst])
    assert all(np.array_equal(_bytes(tensors[k]), want[k]) for k in tensors if k != dst)
    assert all(not u.any() for u in unrelated)
    executor.close()


def test_bound_memory_outlives_every_reference_the_caller_held(executor):
    plan = _plan()
    tensors = _tensors(seed=5)
    want = _want(plan, tensors)
    views = {k: v[:] for k, v in tensors.items()}  # the bound objects are views; the caller drops the bases
    bound = executor.bind(LAYOUT, views)
    addresses = {k: v.data_ptr() for k, v in tensors.items()}
    del tensors
    gc.collect()
    executor.run(plan, bound).wait()
    assert {k: v.data_ptr() for k, v in views.items()} == addresses
    assert all(np.array_equal(_bytes(views[k]), want[k]) for k in views)
    executor.close()


def test_a_one_off_run_checks_the_tensors_as_a_bound_run_does(executor):
    plan = _plan()
    tensors = _tensors()
    want = _want(plan, tensors)
    executor.run(plan, tensors).wait()  # bound for this run only
    assert all(np.array_equal(_bytes(tensors[k]), want[k]) for k in tensors)
    with pytest.raises(RuntimeError, match="not resizable"):
        tensors["gpu.kv0"].resize_(1 << 20)  # the run fixed the storage's size
    executor.close()


def test_numpy_arrays_are_held_and_a_view_of_a_tensor_keeps_the_tensors_storage():
    t = torch.arange(64, dtype=torch.uint8)
    view = t.numpy()  # holds the tensor object, not its storage
    layout = presets.kv_layout(1, 4, 16)
    host, device = (b.name for b in sorted(layout.buffers, key=lambda b: b.location.value != "host"))
    bound = bind(layout, {host: view, device: np.zeros(64, np.uint8)}, check=lambda buf, mem: None)
    t.set_(torch.zeros(8, dtype=torch.uint8))  # the storage behind ``view`` now has no other holder
    gc.collect()
    storages = [h for held in bound.held for h in (held if isinstance(held, tuple) else (held,))
                if isinstance(h, torch.UntypedStorage)]
    assert [s.data_ptr() for s in storages] == [view.ctypes.data]
    assert view.tolist() == list(range(64))  # still readable: the memory was kept


# ---- lowering reads each value once -------------------------------------------------------------------------
class ChangesAfterFirstRead(np.ndarray):
    """A plan column that changes one value right after the first ufunc reads it, as a racing thread could."""

    change: dict

    def __array_finalize__(self, obj: object) -> None:
        self.change = getattr(obj, "change", None)

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        plain = [np.asarray(x) if isinstance(x, ChangesAfterFirstRead) else x for x in inputs]
        if out is not None:
            kw["out"] = tuple(np.asarray(o) if isinstance(o, ChangesAfterFirstRead) else o for o in out)
        result = getattr(ufunc, method)(*plain, **kw)
        c = self.change
        if not c["done"]:
            c["done"] = True
            c["target"][c["index"]] = c["value"]
        return result


def racing(plan: TransferPlan, column: str, index: int, value: int) -> TransferPlan:
    """``plan`` whose ``column`` changes at ``index`` to ``value`` right after its first read."""
    raw = np.array(plan.column(column))
    col = raw.view(ChangesAfterFirstRead)
    col.change = {"done": False, "target": raw, "index": index, "value": value}

    class Racing(TransferPlan):
        def column(self, name: str) -> np.ndarray:
            return col if name == column else super().column(name)

    out = object.__new__(Racing)
    for slot in TransferPlan.__slots__:
        object.__setattr__(out, slot, getattr(plan, slot))
    return out


def _subset(plan: TransferPlan, keep: np.ndarray | None) -> TransferPlan:
    """The ranges ``keep`` selects of a one-call ``plan`` (all of them for None), every column a dense array."""
    assert plan.num_calls == 1
    keep = np.ones(plan.num_ranges, dtype=bool) if keep is None else keep
    cols = {c: np.array(plan.column(c))[keep] for c in COLUMNS}
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=int(keep.sum()),
                        call_offsets=np.array([0, int(keep.sum())]), columns=cols)


def _arena(seed: int = 0) -> tuple[np.ndarray, dict[str, np.ndarray], np.ndarray]:
    """One array holding every buffer with GUARD bytes around each; (arena, bindings, guard mask)."""
    sizes = [b.nbytes for b in LAYOUT.buffers]
    arena = np.random.default_rng(seed).integers(0, 256, sum(sizes) + GUARD * (len(sizes) + 1), dtype=np.uint8)
    guard = np.ones(len(arena), dtype=bool)
    bindings, at = {}, GUARD
    for b in LAYOUT.buffers:
        bindings[b.name] = arena[at:at + b.nbytes]
        guard[at:at + b.nbytes] = False
        at += b.nbytes + GUARD
    return arena, bindings, guard


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("pattern", ["fragmented", "uneven"])
def test_an_offset_changed_right_after_lowering_read_it_never_moves_a_byte_past_a_binding(executor, side, pattern):
    plan = _plan()
    if pattern == "uneven":  # buffer runs of unequal lengths: the per-range path instead of the 2-D one
        plan = _subset(plan, np.arange(plan.num_ranges) >= 3)
    arena, bindings, guard = _arena()
    i = plan.num_ranges - 1
    buf = plan.buffers[int(plan.column(f"{side}_buf")[i])]
    n = int(plan.nbytes[i])
    bad = racing(plan, f"{side}_offset", i, buf.nbytes - n + 64)  # 64 bytes past the end of its buffer
    want_guard = arena[guard].copy()
    want = {k: v.copy() for k, v in bindings.items()}
    NumpyExecutor().run(plan, want)  # the plan as it was when lowering read the offset
    bound = executor.bind(LAYOUT, bindings)
    try:
        executor.run(bad, bound).wait()
    except PlanError:
        want = {k: v.copy() for k, v in bindings.items()}  # refusing the changed value is as good: nothing moved
    assert np.array_equal(arena[guard], want_guard), "bytes outside every binding changed"
    assert all(np.array_equal(bindings[k], want[k]) for k in want), "the bytes moved are not those of the offset checked"
    executor.close()


def test_a_size_changed_after_its_first_read_is_the_size_checked_and_used(executor):
    plan = _subset(_plan(), None)  # every column dense
    arena, bindings, guard = _arena(seed=1)
    i = plan.num_ranges - 1
    buf = plan.buffers[int(plan.dst_buf[i])]
    grown = buf.nbytes - int(plan.dst_offset[i]) + 64  # would end 64 bytes past the buffer
    want_guard = arena[guard].copy()
    bound = executor.bind(LAYOUT, bindings)
    try:
        executor.run(racing(plan, "nbytes", i, grown), bound).wait()
    except PlanError as e:
        assert e.field == "dst_offset" and e.index == i  # the grown size was read, so it was checked
    assert np.array_equal(arena[guard], want_guard), "bytes outside every binding changed"
    executor.close()


# ---- frozen in fact: a column written through torch, unpickled plans, numpy arrays that move ----------------
def _writable_view(col: np.ndarray):
    """A torch tensor over a plan column's memory: torch has no read-only tensors, so it writes what numpy won't."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "The given NumPy array is not writable"
        return torch.from_numpy(col)


class RestoresAfterAdd(np.ndarray):
    """An ``out`` array for ``descriptors`` that runs a callback right after the first ufunc writes into it: a
    racing thread's write landing between the addition that makes the addresses and anything after it."""

    hook: dict  # {"then": callable or None}, shared by the views lowering takes of it

    def __array_finalize__(self, obj: object) -> None:
        self.hook = getattr(obj, "hook", {"then": None})

    def __array_ufunc__(self, ufunc, method, *inputs, out=None, **kw):
        plain = tuple(np.asarray(o) if isinstance(o, RestoresAfterAdd) else o for o in (out or ()))
        inputs = tuple(np.asarray(x) if isinstance(x, RestoresAfterAdd) else x for x in inputs)
        result = getattr(ufunc, method)(*inputs, out=plain or None, **kw)
        then, self.hook["then"] = self.hook["then"], None
        if then is not None:
            then()
        return result


@pytest.mark.parametrize("side", ["src", "dst"])
def test_an_offset_written_through_torch_between_the_addition_and_the_bound_is_never_used(side):
    """The addresses used are the addresses bounded: a checked plan's frozen column, written through torch to run
    64 bytes past its buffer and written back right after the addresses are made, is refused."""
    plan = _plan()
    memory = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers}
    bound = bind(LAYOUT, memory, check=lambda buf, mem: None)  # host arrays stand in for device memory
    col = plan.column(f"{side}_offset")
    i = plan.num_ranges - 1
    buf = plan.buffers[int(plan.column(f"{side}_buf")[i])]
    good, t = int(col[i]), _writable_view(col)
    t[i] = buf.nbytes - int(plan.nbytes[i]) + 64
    out = [np.empty(plan.num_ranges, np.uint64).view(RestoresAfterAdd) for _ in range(2)]
    out[0 if side == "src" else 1].hook["then"] = lambda: t.__setitem__(i, good)
    with pytest.raises(PlanError, match=rf"^{side}_offset\[{i}\] = {buf.nbytes - int(plan.nbytes[i]) + 64}: range .* runs past"):
        bound.descriptors(plan, out)


def test_offsets_are_read_once_into_memory_no_plan_column_shares(executor):
    """The NumPy executor copies with the offsets it bounded: a column written through torch after lowering read
    it changes nothing the run does; written before, to leave its buffer, the run is refused and nothing moves."""
    plan = _plan()
    arena, bindings, guard = _arena(seed=2)
    want = {k: v.copy() for k, v in bindings.items()}
    NumpyExecutor().run(plan, want)
    bound = executor.bind(LAYOUT, bindings)
    col = plan.column("dst_offset")
    t, i = _writable_view(col), plan.num_ranges - 1
    good = int(col[i])
    before = arena.copy()
    t[i] = plan.buffers[int(plan.dst_buf[i])].nbytes  # starts at the end of its buffer
    with pytest.raises(PlanError, match=rf"dst_offset\[{i}\]"):
        executor.run(plan, bound).wait()
    assert np.array_equal(arena, before), "a refused run moved bytes"
    t[i] = good
    executor.run(plan, bound).wait()
    assert all(np.array_equal(bindings[k], want[k]) for k in want)
    low = bound.offsets(plan)
    assert not np.shares_memory(low.dst, col) and not np.shares_memory(low.src, plan.column("src_offset"))
    executor.close()


@pytest.mark.parametrize("holder", ["bytearray", "shared memory"])
def test_an_unpickled_plan_owns_its_columns_whatever_buffers_the_unpickler_was_given(holder):
    """Pickle protocol 5 hands large columns out of band: the caller's buffers (a bytearray, shared memory) stay
    theirs to write, so the plan copies them; writing them afterwards changes nothing in the plan."""
    import pickle
    from multiprocessing import shared_memory

    plan = plan_transfer(presets.kv_layout(4, 8192, 64), presets.mapping("fragmented", 4096, 8192), Target())
    assert plan.column("src_offset").nbytes >= 1 << 16  # large enough to travel out of band
    pieces: list = []
    data = pickle.dumps(plan, protocol=5, buffer_callback=pieces.append)
    assert pieces, "nothing went out of band"
    shms, held = [], []
    for p in pieces:
        raw = p.raw()
        if holder == "bytearray":
            held.append(bytearray(raw))
        else:
            shm = shared_memory.SharedMemory(create=True, size=raw.nbytes)
            shm.buf[:raw.nbytes] = raw
            shms.append(shm)
            held.append(shm.buf[:raw.nbytes])
    try:
        copy = pickle.loads(data, buffers=held)
        assert copy == plan
        want = {c: copy.column(c).copy() for c in COLUMNS}
        for h in held:
            h[:] = bytes(len(h))  # the holder zeroes its buffers
        del h
        assert all(np.array_equal(copy.column(c), want[c]) for c in COLUMNS), "the holder's writes reached the plan"
        assert copy.fingerprint == plan.fingerprint
    finally:
        del held[:]
        for shm in shms:
            shm.close()
            shm.unlink()


MOVES_NUMPY = {  # an array that owns its memory moves it: resize (refcheck=False) and __setstate__
    "resize twice, back to the bound size": lambda a: (a.resize(2 * a.size, refcheck=False), a.resize(a.size // 2, refcheck=False)),
    "__setstate__ of another array": lambda a: a.__setstate__(np.zeros(a.size, a.dtype).__reduce__()[2]),
}


@pytest.mark.parametrize("how", list(MOVES_NUMPY))
def test_a_numpy_array_bound_cannot_move_unnoticed(executor, how):
    """numpy frees an array's memory on resize and __setstate__ whatever views it: the binding keeps a weak
    reference (numpy then refuses to resize), and each run compares the array's data pointer (never its size),
    so a run over an array that moved is refused and nothing is written."""
    plan = _plan()
    bindings = {b.name: np.random.default_rng(4).integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    bound = executor.bind(LAYOUT, bindings)
    executor.run(plan, bound).wait()
    dst = plan.buffers[int(plan.dst_buf[0])].name
    try:
        MOVES_NUMPY[how](bindings[dst])
    except ValueError as e:  # numpy refused: the memory did not move
        assert "resize" in str(e) and how.startswith("resize")
        executor.run(plan, bound).wait()
        executor.close()
        return
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = ndarray.* no longer the memory bound"):
        executor.run(plan, bound)
    executor.close()


def test_a_numpy_array_can_be_resized_again_once_unbound():
    a = np.zeros(4096, np.uint8)
    layout = presets.kv_layout(1, 64, 64, shared_host=False)
    memory = {b.name: (a if i == 0 else np.zeros(b.nbytes, np.uint8)) for i, b in enumerate(layout.buffers)}
    bound = bind(layout, memory, check=lambda buf, mem: None)
    with pytest.raises(ValueError, match="resize"):
        a.resize(8192, refcheck=False)
    bound.close()
    del bound
    gc.collect()
    a.resize(8192, refcheck=False)
    assert a.size == 8192


def test_a_view_made_through_a_pooled_columns_frozen_base_keeps_its_memory_out_of_the_pool():
    """np.asarray of the object a pooled column's frozen twin is made over views the same memory: while such a
    view lives, later plans of the layout get other memory, so the view never shows another plan's offsets."""
    layout = presets.kv_layout(4, 8192, 64)
    first = plan_transfer(layout, presets.mapping("fragmented", 4096, 8192, seed=1))
    col = first.column("src_offset")
    view = np.asarray(col.base.base)[:len(col)]  # through the base object itself, not through the column
    want = view.copy()
    del first, col
    gc.collect()
    for seed in (2, 3, 4):
        plan_transfer(layout, presets.mapping("fragmented", 4096, 8192, seed=seed))
    assert np.array_equal(view, want), "a later plan was written into memory a live view shows"


def test_each_plan_is_bounded_with_its_own_largest_range_size():
    """The last start offsets are kept for the largest size last asked: a plan with larger ranges must not be
    bounded with a smaller plan's. A 4-page range moved (after its check) to end 12 KiB past its buffer is refused
    after a 1-page plan ran on the same binding."""
    layout = presets.kv_layout(2, 16, 4096, shared_host=False)
    memory = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    bound = bind(layout, memory, check=lambda buf, mem: None)
    small = plan_transfer(layout, {"direction": "h2d", "src_ids": [3], "dst_ids": [5]})
    big = plan_transfer(layout, {"direction": "h2d", "src_ids": [0, 1, 2, 3], "dst_ids": [4, 5, 6, 7]})
    assert set(big.nbytes.tolist()) == {4 * 4096} and set(small.nbytes.tolist()) == {4096}
    bound.descriptors(small)
    bound.descriptors(big)
    col = big.column("dst_offset")
    i = 0
    buf = big.buffers[int(big.dst_buf[i])]
    _writable_view(col)[i] = buf.nbytes - 4096  # a 4-page range there ends 12 KiB past the buffer
    bound.descriptors(small)
    with pytest.raises(PlanError, match=rf"dst_offset\[{i}\] = {buf.nbytes - 4096}: range of 16384 bytes runs past"):
        bound.descriptors(big)


@pytest.mark.parametrize("mode", ["descriptors", "offsets", "check"])
def test_a_range_written_past_its_buffer_in_a_late_block_of_a_large_plan_is_refused_at_its_index(mode, monkeypatch):
    """Large plans are lowered in blocks of whole buffer runs: a range in the last block, written (after the check)
    to run past its buffer, is refused and named by its index in the plan, not in its block."""
    from kvxfer.executors import RawMemory
    from kvxfer.executors import _lowering as lowering

    monkeypatch.setattr(lowering, "BLOCK", 64)  # blocks of a few runs, on a plan small enough for a test
    layout = presets.kv_layout(8, 256, 64, shared_host=False)
    bound = bind(layout, {b.name: RawMemory((1 << 40) + (k << 32), b.nbytes) for k, b in enumerate(layout.buffers)})
    plan = plan_transfer(layout, presets.mapping("fragmented", 64, 256))
    assert plan.num_ranges == 8 * 64
    i = plan.num_ranges - 5
    buf = plan.buffers[int(plan.dst_buf[i])]
    _writable_view(plan.column("dst_offset"))[i] = buf.nbytes - 32
    with pytest.raises(PlanError, match=rf"^dst_offset\[{i}\] = {buf.nbytes - 32}: range of 64 bytes runs past"):
        getattr(bound, mode)(plan)


@pytest.mark.parametrize("mode", ["descriptors", "offsets"])
def test_an_offset_that_wraps_its_base_is_refused(mode):
    """base + offset past 2^64 wraps to an address below the base: refused (an offset written after the check)."""
    layout = presets.kv_layout(1, 64, 64, shared_host=False)
    base = 1 << 40
    from kvxfer.executors import RawMemory
    bound = bind(layout, {b.name: RawMemory(base + (k << 32), b.nbytes) for k, b in enumerate(layout.buffers)})
    plan = plan_transfer(layout, {"direction": "h2d", "src_ids": [1, 5, 9], "dst_ids": [2, 6, 10]})
    col = plan.column("dst_offset")
    b = int(bound.base[int(plan.dst_buf[1])])
    _writable_view(col.view(np.int64))[1] = (2**64 - b + 8) - 2**64  # the same bits as the uint64 2^64 - base + 8
    assert int(col[1]) == 2**64 - b + 8
    with pytest.raises(PlanError, match=r"dst_offset\[1\]"):
        getattr(bound, mode)(plan)


@pytest.mark.gpu
def test_cuda_tensors_that_moved_are_refused_and_kept_alive():
    if not torch.cuda.is_available():
        pytest.skip("no NVIDIA GPU visible to torch on this machine")
    ex = CudaBatchExecutor()
    plan = plan_transfer(LAYOUT, _mapping(_plan()), ex.target)
    mem = {b.name: (torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8).cuda() if b.location.value == "device"
                    else torch.randint(0, 256, (b.nbytes,), dtype=torch.uint8).pin_memory()) for b in LAYOUT.buffers}
    bound = ex.bind(LAYOUT, mem)
    ex.run(plan, bound).wait()
    for how in ("set_", "resize_ larger"):  # on a GPU torch cannot fix a storage's size: growing reallocates
        t = mem["gpu.kv0"]
        (t.set_(torch.zeros(t.numel(), dtype=t.dtype, device=t.device)) if how == "set_" else t.resize_(t.numel() * 64))
        with pytest.raises(BindingError, match=r"^bindings\['gpu.kv0'\] = Tensor.* no longer the memory bound"):
            ex.run(plan, bound)
        bound = ex.bind(LAYOUT, mem)
    ex.close()


# ---- memory its owner frees: held, probed or refused, whatever chain of views leads to the owner -------------
def _memory(**bound: object) -> dict[str, object]:
    """Bindings for LAYOUT: ``bound`` for some buffers, zeroed tensors torch allocates for the others."""
    return {b.name: bound.get(b.name.replace(".", "_"), torch.zeros(b.nbytes, dtype=torch.uint8)) for b in LAYOUT.buffers}


def _dst(plan: TransferPlan) -> str:
    return plan.buffers[int(plan.dst_buf[0])].name


def _unrelated() -> list:
    """Arrays allocated after an owner freed memory: they may be given that memory; nothing may write them."""
    return [np.zeros(LAYOUT.buffers[0].nbytes, np.uint8) for _ in range(16)]


def test_the_array_that_owns_a_bound_views_memory_cannot_resize_it_and_a_setstate_refuses_the_run(executor):
    """A view is bound; the array owning its memory is what numpy frees: the binding keeps a weak reference to that
    owner (numpy then refuses to resize it, refcheck=False too) and each run reads the owner's data pointer
    (``__setstate__`` frees the memory whatever views it)."""
    plan = _plan()
    dst = _dst(plan)
    owner = np.random.default_rng(1).integers(0, 256, 2 * LAYOUT.buffers[0].nbytes, dtype=np.uint8)
    view = owner[:LAYOUT.buffers[0].nbytes][::1]  # a view of a view
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): view}))
    with pytest.raises(ValueError, match="cannot resize"):
        owner.resize(8 * owner.size, refcheck=False)
    executor.run(plan, bound).wait()  # the memory bound is still the owner's
    owner.__setstate__(np.zeros(owner.size, np.uint8).__reduce__()[2])
    unrelated = _unrelated()
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = ndarray.* no longer the memory bound, .*: the data "
                       "pointer of the array that owns the memory changed since bind .*bind it again$"):
        executor.run(plan, bound).wait()
    assert all(not u.any() for u in unrelated)
    executor.close()


def test_a_ctypes_buffer_resized_under_a_bound_array_refuses_the_run(executor):
    """``ctypes.resize`` moves a ctypes buffer's memory whatever exports it has: each run reads its address."""
    plan = _plan()
    dst = _dst(plan)
    buffer = (ctypes.c_uint8 * LAYOUT.buffers[0].nbytes)()
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): np.ctypeslib.as_array(buffer)}))
    executor.run(plan, bound).wait()
    ctypes.resize(buffer, 1 << 20)
    unrelated = _unrelated()
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = ndarray.* no longer the memory bound, .*: the "
                       "address of the ctypes buffer that owns the memory changed"):
        executor.run(plan, bound).wait()
    assert all(not u.any() for u in unrelated)
    executor.close()


GROWS = {  # a buffer under a bound array, and what would move or unmap its memory
    "bytearray": (lambda n: bytearray(n), lambda b: b.extend(bytes(1 << 20))),
    "array.array": (lambda n: __import__("array").array("B", bytes(n)), lambda b: b.extend(bytes(1 << 20))),
    "mmap": (lambda n: __import__("mmap").mmap(-1, n), lambda b: b.close()),
}


@pytest.mark.parametrize("kind", list(GROWS))
def test_a_buffer_under_a_bound_array_cannot_grow_or_close_while_bound_and_can_once_unbound(executor, kind):
    """np.frombuffer's own memoryview can be released behind the array (``a.base.release()``), after which the
    buffer may grow or close: the binding holds an export of its own, released at close."""
    plan = _plan()
    dst = _dst(plan)
    make, move = GROWS[kind]
    buf = make(LAYOUT.buffers[0].nbytes)
    array = np.frombuffer(buf, np.uint8)
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): array}))
    array.base.release()  # numpy's export goes; the binding's stays
    with pytest.raises(BufferError):
        move(buf)
    executor.run(plan, bound).wait()
    bound.close()
    del array
    gc.collect()
    move(buf)  # the binding let go of it
    executor.close()


def test_a_memmap_bound_keeps_its_mapping_until_the_binding_is_closed(executor, tmp_path):
    """np.memmap holds its mmap without an export: its ``_mmap.close()`` would unmap the bound memory."""
    plan = _plan()
    dst = _dst(plan)
    (tmp_path / "kv").write_bytes(bytes(LAYOUT.buffers[0].nbytes))
    mapped = np.memmap(tmp_path / "kv", np.uint8, "r+")
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): mapped}))
    with pytest.raises(BufferError):
        mapped._mmap.close()
    executor.run(plan, bound).wait()
    bound.close()
    mapped._mmap.close()
    executor.close()


def test_the_array_under_a_tensor_from_numpy_cannot_resize_it_and_a_setstate_refuses_the_run(executor):
    """torch.from_numpy keeps its array without saying which it is; the binding finds it behind the storage and
    holds it as any array bound: no resize (a weak reference), and its data pointer read on each run."""
    plan = _plan()
    dst = _dst(plan)
    owner = np.random.default_rng(2).integers(0, 256, 2 * LAYOUT.buffers[0].nbytes, dtype=np.uint8)
    tensor = torch.from_numpy(owner[LAYOUT.buffers[0].nbytes:])  # over a view: the owner is the view's base
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): tensor}))
    with pytest.raises(ValueError, match="cannot resize"):
        owner.resize(8 * owner.size, refcheck=False)
    executor.run(plan, bound).wait()
    owner.__setstate__(np.zeros(owner.size, np.uint8).__reduce__()[2])
    unrelated = _unrelated()
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = Tensor.* no longer the memory bound, .*: the data "
                       "pointer of the array that owns the memory changed"):
        executor.run(plan, bound).wait()
    assert all(not u.any() for u in unrelated)
    executor.close()


@pytest.mark.parametrize("kind", list(GROWS))
def test_the_buffer_under_a_tensor_from_buffer_cannot_grow_or_close_while_bound_and_can_once_unbound(executor, kind):
    """torch.frombuffer keeps its buffer but no export of it (a bytearray could grow, an mmap close: the tensor
    would point at freed or unmapped memory); the binding finds it behind the storage and holds an export."""
    plan = _plan()
    dst = _dst(plan)
    make, move = GROWS[kind]
    buf = make(LAYOUT.buffers[0].nbytes)
    tensor = torch.frombuffer(buf, dtype=torch.uint8)
    bound = executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): tensor}))
    with pytest.raises(BufferError):
        move(buf)
    executor.run(plan, bound).wait()
    bound.close()
    del tensor
    gc.collect()
    move(buf)
    executor.close()


def test_a_tensor_over_memory_whose_owner_is_not_found_is_refused_saying_what_to_bind(executor):
    """DLPack hands torch memory with a capsule, not an owner kvxfer can hold: refused at bind, naming what to bind
    instead; the array itself binds."""
    dst = _dst(_plan())
    owner = np.zeros(LAYOUT.buffers[0].nbytes, np.uint8)
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = Tensor\(4096,\): a CPU tensor over memory torch did "
                       r"not allocate, whose owner is not found \(torch.from_dlpack, .*\); bind the memory's owner instead"):
        executor.bind(LAYOUT, _memory(**{dst.replace(".", "_"): torch.from_dlpack(owner)}))
    executor.run(_plan(), _memory(**{dst.replace(".", "_"): owner}))
    executor.close()


@pytest.mark.parametrize("how", ["ctypes from_address", "np.ctypeslib.as_array of a pointer"])
def test_an_array_over_memory_no_object_owns_is_refused_saying_bind_raw_memory(how):
    buffer = (ctypes.c_uint8 * LAYOUT.buffers[0].nbytes)()
    if how == "ctypes from_address":
        array = np.ctypeslib.as_array((ctypes.c_uint8 * LAYOUT.buffers[0].nbytes).from_address(ctypes.addressof(buffer)))
    else:
        array = np.ctypeslib.as_array(ctypes.cast(buffer, ctypes.POINTER(ctypes.c_uint8)), (LAYOUT.buffers[0].nbytes,))
    dst = _dst(_plan())
    with pytest.raises(BindingError, match=r"a ctypes object over memory it does not own.*; bind it as RawMemory\(address, "
                       r"nbytes\) if you keep that memory alive while it is bound$"):
        bind(LAYOUT, _memory(**{dst.replace(".", "_"): array}), check=lambda buf, mem: None)


@pytest.mark.parametrize("bound_as", ["Tensor.numpy() of the region", "a tensor view of the region"])
def test_views_of_a_shared_region_made_as_vllm_makes_them_run_and_are_let_go_at_close(executor, bound_as):
    """vLLM's shared offload region is an mmap under torch.frombuffer(memoryview(mmap)); kvxfer binds
    ``region.base_tensor.numpy()`` (or a view of it). Accepted (held: the storage keeps vLLM's export, so the
    region cannot be unmapped while bound; probed: the mapping is still there), byte-exact, and once the binding
    is closed it holds nothing: vLLM's cleanup closes the mmap without "exported pointers exist"."""
    import mmap

    plan = _plan()
    host = next(b for b in LAYOUT.buffers if b.location.value == "host")
    region = mmap.mmap(-1, 2 * host.nbytes)
    base = torch.frombuffer(memoryview(region), dtype=torch.int8)
    base.view(torch.uint8)[:] = torch.randint(0, 256, (2 * host.nbytes,), dtype=torch.uint8)
    view = base[host.nbytes:].view(torch.uint8)
    bindings = _tensors(seed=9)
    bindings[host.name] = view.numpy() if bound_as.startswith("Tensor.numpy") else view
    want = _want(plan, {k: (torch.from_numpy(np.array(v)) if isinstance(v, np.ndarray) else v) for k, v in bindings.items()})
    bound = executor.bind(LAYOUT, bindings)
    executor.run(plan, bound).wait()
    assert all(np.array_equal(np.array(bindings[k]) if isinstance(bindings[k], np.ndarray) else _bytes(bindings[k]),
                              want[k]) for k in bindings)
    del view, base
    bindings.pop(host.name)
    gc.collect()
    with pytest.raises(BufferError):
        region.close()  # bound: the storage holds vLLM's export of the region
    bound.close()
    gc.collect()
    region.close()  # closed binding: nothing of it is held
    executor.close()


def test_a_tensor_torch_allocated_stays_accepted_after_its_numpy_view_was_taken(executor):
    """``Tensor.numpy()`` makes a storage non-resizable for good (as binding itself does): the storage is still
    torch's own memory, held by keeping it, and a second binding of the same tensors is accepted."""
    plan = _plan()
    tensors = _tensors(seed=11)
    want = _want(plan, tensors)
    for t in tensors.values():
        t.numpy()
    first = executor.bind(LAYOUT, tensors)
    second = executor.bind(LAYOUT, {k: v.numpy() for k, v in tensors.items()})
    executor.run(plan, second).wait()
    assert all(np.array_equal(_bytes(tensors[k]), want[k]) for k in tensors)
    first.close()
    second.close()
    executor.close()


CHILD = """
import mmap, warnings
import numpy as np, torch
from kvxfer.executors import BindingError, NumpyExecutor
from kvxfer.planner import plan_transfer, presets
warnings.simplefilter("ignore")
layout = presets.kv_layout(2, 64, 64, shared_host=False)
plan = plan_transfer(layout, presets.mapping("fragmented", 16, 64, "h2d", seed=3))
dst = plan.buffers[int(plan.dst_buf[0])].name
src = plan.buffers[int(plan.src_buf[0])].name
n = layout.buffers[0].nbytes
memory = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
ex = NumpyExecutor()
try:
%s
except BindingError as e:
    print("REFUSED", e)
"""


def _in_child(body: str) -> str:
    """Run ``body`` (indented into CHILD) in a fresh process: what would fault must never take the tests down with
    it. Returns its output; a child that died (a segfault: the memory was written) fails the test."""
    import subprocess
    import sys
    import textwrap

    out = subprocess.run([sys.executable, "-c", CHILD % textwrap.indent(textwrap.dedent(body), "    ")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, f"the child process died (code {out.returncode}): {out.stderr[-2000:]}"
    return out.stdout


READ_ONLY = {  # a CPU tensor over read-only memory (torch has no read-only tensors: it warns, and would write)
    "torch.frombuffer of a read-only mmap": "torch.frombuffer(ro, dtype=torch.uint8)",
    "torch.from_numpy of a read-only mmap's array": "torch.from_numpy(np.frombuffer(ro, np.uint8))",
    "torch.from_numpy of a read-only array": "torch.from_numpy(np.frombuffer(bytes(n), np.uint8))",
}


@pytest.mark.parametrize("how", list(READ_ONLY))
def test_a_tensor_over_read_only_memory_is_refused_as_a_destination_and_reads_as_a_source(how):
    """Bound as a destination, refused (BindingError) before anything is written: the write would fault on a
    read-only mapping (run in a child process, so a regression fails this test instead of ending the run); as a
    source it reads."""
    make = READ_ONLY[how]
    out = _in_child(f"""
        ro = mmap.mmap(-1, n, prot=mmap.PROT_READ)
        ex.run(plan, dict(memory, **{{src: {make}}}))
        print("READ")
        ex.run(plan, dict(memory, **{{dst: {make}}}))
        print("WROTE")
    """)
    assert "READ" in out and "WROTE" not in out, out
    assert f"REFUSED bindings['{_dst(_plan())}'] = Tensor(4096,): read-only, but the plan writes to it" in out, out


def test_a_buffer_stays_pinned_while_a_transfer_over_it_is_in_flight_though_its_binding_was_closed(shim_path):
    """A DMA transfer keeps what it copies until it is seen finished: for a buffer the binding holds by an export,
    an export of its own, so closing the binding first does not let the buffer grow under the copies."""
    from .shims.runtime import ShimCudaRuntime

    ex = CudaBatchExecutor(ShimCudaRuntime(shim_path, V13))
    plan = _plan()
    buf = bytearray(LAYOUT.buffers[0].nbytes)
    array = np.frombuffer(buf, np.uint8)
    bound = ex.bind(LAYOUT, _memory(**{_dst(plan).replace(".", "_"): array}))
    array.base.release()  # numpy's own export goes: the binding's, then the transfer's, pin the buffer
    transfer = ex.run(plan, bound)
    bound.close()
    with pytest.raises(BufferError):
        buf.extend(bytes(1 << 20))
    transfer.wait()
    del array
    gc.collect()
    buf.extend(bytes(1 << 20))
    ex.close()
