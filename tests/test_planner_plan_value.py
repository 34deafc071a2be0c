"""A plan is a value: its columns are immutable in fact (nobody holding a plan can make one writeable again, however
it reaches the memory), its constructor keeps none of the caller's arrays and refuses values its columns cannot
hold, and it pickles and copies with its fingerprint."""
from __future__ import annotations

import copy
import pickle
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from numpy.lib.stride_tricks import as_strided

from kvxfer.planner import COLUMNS, BlockMapping, PlanError, PlanOptions, TransferPlan, plan_transfer, presets
from kvxfer.planner.runs import Runs


def _plans() -> dict[str, Callable[[], TransferPlan]]:
    big = presets.kv_layout(64, 2048, 256, shared_host=False)  # 64 x 1024 fragmented pairs: pooled offset columns
    job = presets.mapping("fragmented", 1024, 2048)
    small = presets.kv_layout(3, 32, 64)
    return {
        "pooled columns": lambda: plan_transfer(big, {"direction": "h2d", "src_ids": job.src_ids.copy(),
                                                      "dst_ids": job.dst_ids.copy()}),
        "small columns": lambda: plan_transfer(small, presets.mapping("runs8", 12, 32)),
        "one range per region": lambda: plan_transfer(small, presets.mapping("contiguous", 12, 32)),
        "chunked, split": lambda: plan_transfer(presets.chunked_layout(3, 64, 16, 4), BlockMapping(
            direction="d2h", src_ids=np.arange(10), dst_ids=[3, 7, 9], group_sizes=[10], group_starts=[2]),
            options=PlanOptions(max_range_bytes=8)),
        "read from a file": lambda: TransferPlan.from_npz_bytes(plan_transfer(small, presets.mapping(
            "fragmented", 12, 32)).to_npz_bytes()),
    }


PLANS = _plans()


def holds(col: np.ndarray) -> Iterator[tuple[str, Any]]:
    """Every way of holding a column's memory through numpy and the buffer protocol."""
    yield "the column", col
    yield "a slice", col[1:]
    yield "a strided slice", col[::2]
    yield "a view", col.view()
    yield "a view as bytes", col.view(np.uint8)
    yield "a reshape", col.reshape(-1)
    yield "np.asarray", np.asarray(col)
    yield "np.array without a copy", np.array(col, copy=False)
    yield "as_strided", as_strided(col)
    yield "as_strided asking to write", as_strided(col, writeable=True)
    yield "np.frombuffer", np.frombuffer(col, dtype=np.uint8)
    yield "a memoryview", memoryview(col)
    yield "np.frombuffer of a memoryview", np.frombuffer(memoryview(col), dtype=np.uint8)
    base = col.base
    depth = 0
    while base is not None and depth < 8:  # the chain of bases, down to the object that holds the memory
        yield f"base {depth}", base
        if isinstance(base, np.ndarray):
            base = base.base
        else:
            yield f"np.asarray(base {depth})", np.asarray(base)
            base = None
        depth += 1


def _refuses_writes(obj: Any, col: np.ndarray | None = None) -> None:
    """``obj`` cannot be written, nor made writeable; an array holding other memory than ``col`` (a copy, such as
    ``np.asarray`` makes of a bytes object) is harmless."""
    if isinstance(obj, np.ndarray) and col is not None and obj.size and not np.shares_memory(obj, col):
        return
    if isinstance(obj, np.ndarray):
        with pytest.raises(ValueError):
            obj.flags.writeable = True
        with pytest.raises(ValueError):
            obj.setflags(write=True)
        if obj.size:
            with pytest.raises(ValueError):
                obj[...] = 0
    elif isinstance(obj, memoryview):
        assert obj.readonly
        with pytest.raises(TypeError):
            obj[0:1] = bytes(obj.itemsize)
    else:  # the object under the column: no buffer to write through, and numpy reads it read-only
        try:
            view = memoryview(obj)
        except TypeError:
            return
        assert view.readonly


@pytest.mark.parametrize("name", sorted(PLANS))
def test_no_holder_can_make_a_plan_column_writeable(name):
    plan = PLANS[name]()
    want = {c: plan.column(c).copy() for c in COLUMNS}
    fingerprint = plan.fingerprint
    for c in (*COLUMNS, "call_offsets"):
        col = plan.call_offsets if c == "call_offsets" else plan.column(c)
        for way, obj in holds(col):
            try:
                _refuses_writes(obj, col)
            except BaseException as e:
                raise AssertionError(f"{c} held as {way} ({type(obj).__name__}) is writeable: {e!r}") from None
    for c, v in want.items():
        assert np.array_equal(plan.column(c), v)
    assert TransferPlan.from_npz_bytes(plan.to_npz_bytes()).fingerprint == fingerprint


@pytest.mark.parametrize("name", sorted(set(PLANS) - {"read from a file"}))
def test_run_length_columns_are_frozen_too_and_shared_writeable_with_no_layout(name):
    """A plan keeps its per-region columns run-length encoded: those arrays are frozen as its dense columns are,
    so no holder (of this plan, or of a layout's cache that other plans share them with) can write them. They are
    reached as pickling reaches them (``__reduce__``)."""
    plan = PLANS[name]()
    store = next(f for f in plan.__reduce__()[1][0] if isinstance(f, dict))
    runs = {c: col for c, col in store.items() if isinstance(col, Runs)}
    assert runs, "a plan of these layouts keeps run-length columns"
    for c, col in runs.items():
        for part, arr in (("values", col.values), ("lengths", col.lengths)):
            for way, obj in holds(arr):
                try:
                    _refuses_writes(obj, arr)
                except BaseException as e:
                    raise AssertionError(f"{c}.{part} held as {way} ({type(obj).__name__}) is writeable: {e!r}") from None
        assert col.values.dtype == COLUMNS[c]  # in the plan's own dtype: nothing converts them later


def _fields(plan: TransferPlan) -> dict[str, Any]:
    return dict(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                region_page_bytes=plan.region_page_bytes)


def test_the_constructor_keeps_copies_of_the_callers_arrays():
    plan = PLANS["small columns"]()
    columns = {c: np.array(plan.column(c)) for c in COLUMNS}
    offsets = np.array(plan.call_offsets)
    made = TransferPlan(**_fields(plan), columns=columns, call_offsets=offsets)
    assert made.fingerprint == plan.fingerprint
    for c, arr in columns.items():
        assert arr.flags.writeable, f"the caller's {c} was made read-only (kept)"
        assert not np.shares_memory(made.column(c), arr)
        arr[:] = 1  # the caller reuses its arrays: the plan does not change
    offsets[:] = 0
    assert made.fingerprint == plan.fingerprint and made == plan
    _refuses_writes(made.column("dst_offset"))


BAD_VALUES = [
    ("src_buf", 2**32, "out of range for int32"),
    ("dst_buf", -1, "out of range for int32"),
    ("region", 2**31, "out of range for int32"),
    ("attr", 65536, "out of range for uint16"),
    ("attr", -1, "out of range for uint16"),
    ("nbytes", 1.5, "expected an integer"),
    ("nbytes", 2**64, "out of range for uint64"),
    ("src_offset", -8, "out of range for uint64"),
    ("dst_offset", float("nan"), "expected an integer"),
    ("dst_offset", True, "expected an integer"),
    ("nbytes", "64", "expected an integer"),
]


BAD_CELLS = [(c, v, r, form) for c, v, r in BAD_VALUES for form in ("list", "array")
             if not (form == "array" and isinstance(v, bool))]  # numpy itself makes True among integers 1


@pytest.mark.parametrize("column, value, reason, form", BAD_CELLS, ids=[f"{c}={v!r}-{f}" for c, v, _, f in BAD_CELLS])
def test_the_constructor_refuses_values_a_column_cannot_hold(column, value, reason, form):
    plan = PLANS["small columns"]()
    i = 2
    cols: dict[str, Any] = {c: plan.column(c).tolist() for c in COLUMNS}
    cols[column][i] = value
    if form == "array":  # numpy's own conversion, as a caller holding arrays would make it
        try:
            cols[column] = np.array(cols[column])
        except OverflowError:
            cols[column] = np.array(cols[column], dtype=object)
    with pytest.raises(PlanError) as e:
        TransferPlan(**_fields(plan), columns=cols, call_offsets=plan.call_offsets.tolist())
    assert e.value.field == column and reason in e.value.reason, str(e.value)
    if isinstance(cols[column], list) or cols[column].dtype.kind in "iuO":
        assert e.value.index == i
    else:  # a float or string array: every entry is refused, the first is named
        assert e.value.index == 0


@pytest.mark.parametrize("value", [1.5, -1, 2**63, "3"])
def test_the_constructor_refuses_call_offsets_that_are_not_int64(value):
    plan = PLANS["small columns"]()
    offsets = plan.call_offsets.tolist()
    offsets[0] = value
    with pytest.raises(PlanError) as e:
        TransferPlan(**_fields(plan), columns={c: plan.column(c) for c in COLUMNS}, call_offsets=offsets)
    assert e.value.field == "call_offsets" and e.value.index in (0, None)


def test_run_length_columns_are_checked_too():
    plan = PLANS["small columns"]()
    cols: dict[str, Any] = {c: plan.column(c) for c in COLUMNS}
    cols["attr"] = Runs(np.array([0, 70000]), np.array([1, plan.num_ranges - 1]))
    with pytest.raises(PlanError, match=r"attr\.values\[1\] = 70000: out of range for uint16"):
        TransferPlan(**_fields(plan), columns=cols, call_offsets=plan.call_offsets)


@pytest.mark.parametrize("how", ["pickle", "copy", "deepcopy", "TransferPlan.copy"])
@pytest.mark.parametrize("name", sorted(PLANS))
def test_a_plan_pickles_and_copies_with_its_fingerprint(name, how):
    plan = PLANS[name]()
    fingerprint = plan.fingerprint
    plan.column("region")  # expanded and cached: a copy need not carry the cache
    again = {"pickle": lambda p: pickle.loads(pickle.dumps(p)), "copy": copy.copy, "deepcopy": copy.deepcopy,
             "TransferPlan.copy": TransferPlan.copy}[how](plan)
    assert isinstance(again, TransferPlan) and again is not plan
    assert again.fingerprint == fingerprint and again == plan and repr(again) == repr(plan)
    for c in COLUMNS:
        assert np.array_equal(again.column(c), plan.column(c))
        _refuses_writes(again.column(c))
    _refuses_writes(again.call_offsets)
    assert again.check() is again
    with pytest.raises(AttributeError):
        again.direction = plan.direction  # type: ignore[misc]


def test_a_plans_own_copy_shares_no_column_and_no_subclass_stands_in():
    """``TransferPlan.copy`` (a consumer's one read of a plan): every array of the copy is its own, so writing the
    original's columns through torch changes nothing in it, and a subclass's ``column`` cannot lie to it."""
    plan = PLANS["small columns"]()

    class Lying(TransferPlan):
        def column(self, name: str) -> np.ndarray:
            return np.zeros(1, np.uint64)

    liar = object.__new__(Lying)
    for slot in TransferPlan.__slots__:
        object.__setattr__(liar, slot, getattr(plan, slot))
    own = TransferPlan.copy(liar)
    assert type(own) is TransferPlan and own.fingerprint == plan.fingerprint
    for c in COLUMNS:
        assert not np.shares_memory(own.column(c), plan.column(c))
    assert not np.shares_memory(own.call_offsets, plan.call_offsets)
    assert not own.checked and own.check() is own  # checked afresh, never on the original's verdict
