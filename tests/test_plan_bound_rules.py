"""A plan's bound rules, written once (``kvxfer.planner.bounds``): ``TransferPlan.check`` applies them to a plan,
lowering to the values it reads once, and both refuse in one wording (lowering adds why a checked plan can fail).

Each adversarial case is refused twice here: by ``check`` on a plan built with the bad value, and by every
lowering mode on a plan that passed ``check`` and had the value written afterwards (its stored column replaced,
as a holder writing a frozen column through torch would change it), with nothing moved.
"""
from __future__ import annotations

import re

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor, RawMemory, bind
from kvxfer.executors._lowering import AFTER_CHECK
from kvxfer.planner import COLUMNS, MAX_RANGE_BYTES, Buffer, Location, PlanError, TransferPlan, bounds, plan_transfer, presets
from kvxfer.planner.runs import Runs

TEMPLATE = plan_transfer(presets.kv_layout(1, 8, 64, shared_host=False), presets.mapping("contiguous", 2, 8, "h2d"))
# a small and a big buffer on each side: range 0 moves 128 bytes big -> big, range 1 64 bytes small -> small
BUFFERS = (Buffer(name="h.small", nbytes=64, location=Location.HOST), Buffer(name="h.big", nbytes=4096, location=Location.HOST),
           Buffer(name="g.small", nbytes=64), Buffer(name="g.big", nbytes=4096))
COLS = {"src_buf": [1, 0], "dst_buf": [3, 2], "src_offset": [0, 0], "dst_offset": [256, 0], "nbytes": [128, 64],
        "region": [0, 0], "attr": [0, 0]}
MODES = ["descriptors", "offsets", "check", "numpy run"]

pytestmark = pytest.mark.usefixtures("lowering_path")  # every test on each lowering path (conftest)


def make(columns: dict | None = None, call_offsets: list[int] | None = None) -> TransferPlan:
    cols = {c: np.array(v, dtype=COLUMNS[c]) for c, v in COLS.items()} | (columns or {})
    return TransferPlan(direction=TEMPLATE.direction, target=TEMPLATE.target, options=TEMPLATE.options, buffers=BUFFERS,
                        regions=TEMPLATE.regions, attrs=TEMPLATE.attrs, requested_copies=2,
                        call_offsets=np.array(call_offsets or [0, 2]), columns=cols)


def written_after_check(plan: TransferPlan, name: str, column: object) -> TransferPlan:
    """``plan`` checked, then its stored column ``name`` replaced by ``column``: the value lowering reads is not the
    value the check saw."""
    assert plan.check().checked
    plan._store[name] = column
    plan._dense.clear()
    return plan


def with_value(name: str, i: int, value: int) -> np.ndarray:
    col = np.array(COLS[name], dtype=COLUMNS[name])
    col[i] = value
    return col


def refused_by_lowering(plan: TransferPlan, mode: str, message: str) -> None:
    """Lowering ``plan`` in ``mode`` raises PlanError matching ``message`` (a regex), with nothing written."""
    if mode == "numpy run":
        memory = {b.name: np.zeros(b.nbytes * 4, np.uint8) for b in BUFFERS}  # 4x the declared sizes
        for k, m in enumerate(memory.values()):
            m[:] = k + 1
        before = {k: v.copy() for k, v in memory.items()}
        with pytest.raises(PlanError, match=message):
            NumpyExecutor().run(plan, memory)
        assert all(np.array_equal(memory[k], before[k]) for k in memory), "a refused run moved bytes"
        return
    bound = bind(BUFFERS, {b.name: RawMemory((1 << 40) + (k << 32), 4 * b.nbytes) for k, b in enumerate(BUFFERS)})
    with pytest.raises(PlanError, match=message):
        getattr(bound, mode)(plan)


def after_check(message: str) -> str:
    return f"{message}: {re.escape(AFTER_CHECK)}$"


def test_the_hand_plan_passes_and_lowers():
    plan = make().check()
    bound = bind(BUFFERS, {b.name: RawMemory((1 << 40) + (k << 32), b.nbytes) for k, b in enumerate(BUFFERS)})
    assert bound.offsets(plan).dst.tolist() == [256, 0]


# ---- the rules over arrays, with their one wording ------------------------------------------------------------
def test_the_rules_over_arrays_name_the_column_the_index_and_the_value():
    u64 = np.dtype(np.uint64)
    with pytest.raises(PlanError, match=r"^attr\[3\] = 2: out of range \(the plan has 2\)$"):
        bounds.check_indices("attr", np.array([0, 2], np.uint16), np.array([3, 1]), 2)
    with pytest.raises(PlanError, match=r"^nbytes\[5\] = 0: empty range: why$"):
        bounds.check_sizes(np.array([8, 0], np.uint64), np.array([5, 1]), "why")
    with pytest.raises(PlanError, match=rf"^nbytes\[0\] = {MAX_RANGE_BYTES}: range too large$"):
        bounds.check_sizes(np.array([MAX_RANGE_BYTES], np.uint64), np.array([1]))
    assert bounds.check_sizes(np.array([8, 64, 16], np.uint64), np.array([1, 1, 1])) == (8, 64)
    with pytest.raises(PlanError, match=r"^call_offsets = \[0, 2, 2\]: must rise strictly from 0 to 2$"):
        bounds.check_call_offsets(np.array([0, 2, 2]), 2)
    with pytest.raises(PlanError, match=r"^call_offsets = \[0, 0\]: must rise strictly from 0 to 0$"):
        bounds.check_call_offsets(np.array([0, 0]), 0)
    bounds.check_call_offsets(np.array([0]), 0)  # a plan of no ranges has no call
    with pytest.raises(PlanError, match=r"^call_offsets = 'float64 array of 1 dimensions': expected a one-dimensional int64"):
        bounds.check_call_offsets(np.array([0.0, 2.0]), 2)
    with pytest.raises(PlanError, match=r"^attr\.lengths = 3: expected one length per run value \(2\)$"):
        bounds.check_runs("attr", np.array([0, 1], np.uint16), np.array([1, 1, 1]), np.dtype(np.uint16))
    with pytest.raises(PlanError, match=r"^attr\.lengths\[1\] = -1: negative run length$"):
        bounds.check_runs("attr", np.array([0, 1], np.uint16), np.array([3, -1]), np.dtype(np.uint16))
    with pytest.raises(PlanError, match=r"^attr = 4: column length differs from the other columns' \(3\)$"):
        bounds.check_runs("attr", np.array([0, 1], np.uint16), np.array([3, 1]), np.dtype(np.uint16), 3)
    with pytest.raises(PlanError, match=r"^src_offset\[1\] = 8: range of 64 bytes runs past buffer 'b' of 64 bytes$"):
        bounds.check_inside("src", np.array([0, 8], np.uint64), np.array([64, 64], np.uint64), np.array([1, 0]),
                            np.array([64, 64], u64), ["a", "b"][::-1])


# ---- the adversarial cases, refused by check and by lowering after the check -----------------------------------
@pytest.mark.parametrize("mode", MODES)
def test_an_offset_written_after_the_check_is_bounded_by_the_declared_size_not_the_memory(mode):
    """The memory bound is 4x the buffer the plan declares: an offset moved past the declared end is refused."""
    message = r"^dst_offset\[1\] = 32: range of 64 bytes runs past buffer 'g.small' of 64 bytes"
    with pytest.raises(PlanError, match=message + "$"):
        make({"dst_offset": with_value("dst_offset", 1, 32)}).check()
    refused_by_lowering(written_after_check(make(), "dst_offset", with_value("dst_offset", 1, 32)), mode, after_check(message))


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("mode", MODES)
def test_an_offset_whose_end_wraps_uint64_is_refused(side, mode):
    value = 2**64 - 8
    message = rf"^{side}_offset\[1\] = {value}: range of 64 bytes runs past buffer '{side[0] == 's' and 'h' or 'g'}.small'"
    with pytest.raises(PlanError, match=message):
        make({f"{side}_offset": with_value(f"{side}_offset", 1, value)}).check()
    plan = written_after_check(make(), f"{side}_offset", with_value(f"{side}_offset", 1, value))
    refused_by_lowering(plan, mode, message + r" of 64 bytes: " + re.escape(AFTER_CHECK))


INDEXED = {"attr": len(TEMPLATE.attrs), "region": len(TEMPLATE.regions), "src_buf": len(BUFFERS), "dst_buf": len(BUFFERS)}


@pytest.mark.parametrize("column", list(INDEXED))
def test_check_refuses_an_index_equal_to_its_tables_size(column):
    size = INDEXED[column]
    with pytest.raises(PlanError, match=rf"^{column}\[1\] = {size}: out of range \(the plan has {size}\)$"):
        make({column: with_value(column, 1, size)}).check()


@pytest.mark.parametrize("column", ["attr", "src_buf", "dst_buf"])  # lowering reads no region: nothing uses it
@pytest.mark.parametrize("mode", MODES)
def test_lowering_refuses_an_index_equal_to_its_tables_size_written_after_the_check(column, mode):
    size = INDEXED[column]
    plan = written_after_check(make(), column, with_value(column, 1, size))
    refused_by_lowering(plan, mode, after_check(rf"^{column}\[1\] = {size}: out of range \(the plan has {size}\)"))


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("mode", MODES)
def test_a_range_longer_than_the_smallest_buffer_it_touches_is_refused_though_the_largest_range_fits_another(side, mode):
    """A 128-byte range into a 64-byte buffer: the plan's largest range (128 bytes) fits the big buffers, so no
    bound taken from the largest range or the largest buffer proves it inside."""
    message = rf"^{side}_offset\[1\] = 0: range of 128 bytes runs past buffer '{'h' if side == 'src' else 'g'}.small' of 64 bytes"
    # for dst, the source of range 1 moves into the big buffer (else the source is refused first)
    base = {} if side == "src" else {"src_buf": np.array([1, 1], np.int32), "src_offset": np.array([0, 512], np.uint64)}
    with pytest.raises(PlanError, match=message + "$"):
        make(base | {"nbytes": with_value("nbytes", 1, 128)}).check()
    refused_by_lowering(written_after_check(make(base), "nbytes", with_value("nbytes", 1, 128)), mode, after_check(message))


@pytest.mark.parametrize("value, reason", [(0, "empty range"), (MAX_RANGE_BYTES, "range too large"),
                                           (2**64 - 1, "range too large")])
@pytest.mark.parametrize("mode", MODES)
def test_a_size_written_after_the_check_is_refused_when_empty_or_of_2_63_bytes_or_more(value, reason, mode):
    message = rf"^nbytes\[1\] = {value}: {reason}"
    with pytest.raises(PlanError, match=message + "$"):
        make({"nbytes": with_value("nbytes", 1, value)}).check()
    refused_by_lowering(written_after_check(make(), "nbytes", with_value("nbytes", 1, value)), mode, after_check(message))


@pytest.mark.parametrize("mode", MODES)
def test_call_offsets_changed_after_the_check_are_refused(mode):
    message = r"^call_offsets = \[0, 1, 1, 2\]: must rise strictly from 0 to 2"
    with pytest.raises(PlanError, match=message + "$"):
        make(call_offsets=[0, 1, 1, 2])
    plan = make().check()
    object.__setattr__(plan, "call_offsets", np.array([0, 1, 1, 2]))  # TransferPlan refuses its own __setattr__
    refused_by_lowering(plan, mode, after_check(message))


@pytest.mark.parametrize("column", ["attr", "src_buf", "nbytes"])
@pytest.mark.parametrize("mode", MODES)
def test_run_length_columns_whose_values_and_lengths_differ_in_length_are_refused(column, mode):
    dtype = COLUMNS[column]
    runs = Runs(np.array([COLS[column][0]] * 2, dtype), np.array([1, 1, 0]))
    message = rf"^{column}\.lengths = 3: expected one length per run value \(2\)$"
    with pytest.raises(PlanError, match=message):
        make({column: runs})
    # tampered after the check: the plan reading its own column refuses it (no IndexError from numpy)
    refused_by_lowering(written_after_check(make(), column, runs), mode, message)


TAMPERED = {  # column -> a stored value of the wrong type (lowering reads every column but region)
    "src_buf": np.array([1.0, 0.0]), "attr": np.array([0, 0], np.int64), "nbytes": np.array([128, 64], np.int64),
    "dst_offset": np.array([256, 0], np.int64), "src_offset": np.array([[0, 0]], np.uint64),
}


def _wrong_type(column: str, bad: np.ndarray) -> str:
    return rf"^{column} = '{bad.dtype} array of {bad.ndim} dimensions': expected a one-dimensional {COLUMNS[column]} column$"


@pytest.mark.parametrize("column, bad", [*TAMPERED.items(), ("region", np.array([[0, 0]], np.int32))])
def test_a_plan_with_private_columns_tampered_with_wrong_dtypes_fails_its_check_with_its_own_error(column, bad):
    plan = make()
    plan._store[column] = bad
    with pytest.raises(PlanError, match=_wrong_type(column, bad)):
        plan.check()


@pytest.mark.parametrize("column", list(TAMPERED))
@pytest.mark.parametrize("mode", MODES)
def test_columns_tampered_with_wrong_dtypes_after_the_check_raise_the_plans_own_error(column, mode):
    refused_by_lowering(written_after_check(make(), column, TAMPERED[column]), mode, _wrong_type(column, TAMPERED[column]))


@pytest.mark.parametrize("mode", MODES)
def test_run_length_columns_tampered_with_wrong_dtypes_raise_the_plans_own_error(mode):
    bad = Runs(np.array([0.5]), np.array([2]))
    refused_by_lowering(written_after_check(make(), "attr", bad), mode,
                        r"^attr\.values = 'float64 array of 1 dimensions': expected a one-dimensional uint16 column$")


# ---- every reader of a tampered plan raises the plan's own error ------------------------------------------------
TAMPERED_FIELDS = {  # a private field replaced after construction: (field, the value stored)
    "a column shorter than the others": ("src_offset", lambda: np.array([0], np.uint64)),
    "a run-length column covering fewer ranges": ("region", lambda: Runs(np.array([0], np.int32), np.array([1]))),
    "run lengths of floats": ("attr", lambda: Runs.of(np.array([0, 0], np.uint16), np.array([1.0, 1.0]))),
    "run lengths in two dimensions": ("dst_buf", lambda: Runs.of(np.array([3, 2], np.int32), np.array([[1, 1]]))),
    "nbytes as a scalar": ("nbytes", lambda: np.uint64(64)),
    "call offsets of floats": ("call_offsets", lambda: np.array([0.0, 2.0])),
    "call offsets in two dimensions": ("call_offsets", lambda: np.array([[0, 2]])),
    "call offsets as a scalar": ("call_offsets", lambda: np.int64(2)),
    "call offsets as a list": ("call_offsets", lambda: [0, 2]),
}
READERS = {
    "check": lambda p: p.check(), "num_ranges": lambda p: p.num_ranges, "num_calls": lambda p: p.num_calls,
    "repr": repr, "fingerprint": lambda p: p.fingerprint, "explain": lambda p: p.explain(),
    "stats": lambda p: p.stats(), "to_dict": lambda p: p.to_dict(), "calls": lambda p: list(p.calls()),
    "call_sizes": lambda p: p.call_sizes, "attr_runs": lambda p: p.attr_runs(0), "html": lambda p: p._repr_html_(),
    "numpy paths": lambda p: NumpyExecutor().paths(p),
    "numpy run": lambda p: NumpyExecutor().run(p, {b.name: np.zeros(b.nbytes, np.uint8) for b in BUFFERS}),
}


@pytest.mark.parametrize("checked", [False, True], ids=["unchecked", "after its check"])
@pytest.mark.parametrize("reader", list(READERS))
@pytest.mark.parametrize("tamper", list(TAMPERED_FIELDS))
def test_every_reader_of_a_plan_with_a_private_field_of_the_wrong_shape_raises_the_plans_own_error(tamper, reader,
                                                                                                   checked):
    """Whatever reads the plan (its check, its sizes, its fingerprint, its views, an executor), a private field
    replaced with a value of the wrong type or length raises PlanError naming it, never numpy's IndexError,
    TypeError or ValueError; a reader the field does not concern returns as usual."""
    plan = make()
    if checked:
        plan.check()
    field, value = TAMPERED_FIELDS[tamper]
    if field == "call_offsets":
        object.__setattr__(plan, "call_offsets", value())
    else:
        plan._store[field] = value()
        plan._dense.clear()
    try:
        READERS[reader](plan)
    except PlanError as e:
        assert e.field.split(".")[0] in (field, *COLUMNS), e
