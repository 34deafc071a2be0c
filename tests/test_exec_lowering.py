"""Lowering, range by range: addresses are base + offset on every strategy (one 2-D broadcast, per-run additions,
one per-range base array), a range leaving its buffer is refused wherever it sits in its run, bounds come from
the plan's declared buffer sizes, and an index equal to its table's size is refused before any call is issued.

Plans here are built by hand with buffer runs of unequal lengths, which the planner rarely makes; expected
addresses are computed range by range in Python.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvxfer.executors import BindingError, CudaBatchExecutor, NumpyExecutor, RawMemory, bind
from kvxfer.executors import _lowering as lowering
from kvxfer.executors._lowering import LONG_RUN, lowering_strategy
from kvxfer.planner import COLUMNS, Location, PlanError, Target, TransferPlan, cuda_version, plan_transfer, presets

from .shims.build import ShimState, build, compiler

PAGE = 16
LAYOUT = presets.kv_layout(4, 64, PAGE, shared_host=False)  # cpu.kv0..3, gpu.kv0..3
TARGET = Target(platform="cuda", runtime_version=cuda_version(13, 0))
TEMPLATE = plan_transfer(LAYOUT, presets.mapping("fragmented", 4, 64, "h2d"), TARGET)
HOST = [i for i, b in enumerate(LAYOUT.buffers) if b.location is Location.HOST]
DEVICE = [i for i, b in enumerate(LAYOUT.buffers) if b.location is Location.DEVICE]
BASES = {b.name: (1 << 40) + (i << 32) for i, b in enumerate(LAYOUT.buffers)}
RUNS = {"4, 2, 2, 8": [4, 2, 2, 8], "4, 4, 4, 4": [4, 4, 4, 4], "1, 8, 6, 1": [1, 8, 6, 1]}

pytestmark = pytest.mark.usefixtures("lowering_path")  # every test on each lowering path (conftest)


def hand_plan(lengths: list[int], seed: int = 0, buffers: int | None = None) -> TransferPlan:
    """A one-call h2d plan whose buffer runs have ``lengths``: run r reads cpu.kv<r> and writes gpu.kv<r>, pages at
    distinct random offsets inside each buffer (of ``buffers`` bytes each when given, as declared sizes)."""
    rng = np.random.default_rng(seed)
    layout = LAYOUT if buffers is None else presets.kv_layout(4, buffers // PAGE, PAGE, shared_host=False)
    pages = (buffers or LAYOUT.buffers[0].nbytes) // PAGE
    cols = {c: [] for c in COLUMNS}
    for r, n in enumerate(lengths):
        cols["src_buf"].append(np.full(n, HOST[r], np.int32))
        cols["dst_buf"].append(np.full(n, DEVICE[r], np.int32))
        cols["src_offset"].append(rng.choice(pages, n, replace=False).astype(np.uint64) * PAGE)
        cols["dst_offset"].append(np.sort(rng.choice(pages, n, replace=False)).astype(np.uint64) * PAGE)
        cols["nbytes"].append(np.full(n, PAGE, np.uint64))
        cols["region"].append(np.full(n, r, np.int32))
        cols["attr"].append(np.zeros(n, np.uint16))
    total = sum(lengths)
    return TransferPlan(direction=TEMPLATE.direction, target=TARGET, options=TEMPLATE.options,
                        buffers=tuple(layout.buffers), regions=TEMPLATE.regions, attrs=TEMPLATE.attrs,
                        requested_copies=total, call_offsets=np.array([0, total]),
                        columns={c: np.concatenate(v) for c, v in cols.items()})


def with_column(plan: TransferPlan, name: str, index: int, value: int) -> TransferPlan:
    cols = {c: np.array(plan.column(c)) for c in COLUMNS}
    cols[name][index] = value
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=plan.call_offsets, columns=cols)


def expected_addresses(plan: TransferPlan, bases: dict[str, int], side: str) -> list[int]:
    names = [b.name for b in plan.buffers]
    return [bases[names[b]] + o for b, o in zip(plan.column(f"{side}_buf").tolist(), plan.column(f"{side}_offset").tolist())]


CASES = {  # name -> (run lengths, scale): the strategy each must take is asserted, so all three are covered
    "unequal runs whose first length times the run count is the range count": (RUNS["4, 2, 2, 8"], 1, "repeat"),
    "unequal runs, long": (RUNS["4, 2, 2, 8"], LONG_RUN, "long runs"),
    "other unequal runs": (RUNS["1, 8, 6, 1"], 1, "repeat"),
    "equal runs": (RUNS["4, 4, 4, 4"], 1, "grid"),
    "equal runs, long": (RUNS["4, 4, 4, 4"], LONG_RUN, "long runs"),
}


def _case(name: str) -> tuple[TransferPlan, str]:
    lengths, scale, strategy = CASES[name]
    buffers = None if scale == 1 else 2 * 8 * scale * PAGE
    return hand_plan([n * scale for n in lengths], seed=len(name), buffers=buffers), strategy


def test_the_cases_cover_every_lowering_strategy():
    assert {s for _, _, s in CASES.values()} == {"grid", "long runs", "repeat"}


@pytest.mark.parametrize("name", list(CASES))
def test_lowering_is_base_plus_offset_whatever_the_run_lengths(name, monkeypatch):
    plan, strategy = _case(name)
    for side in ("src", "dst"):
        assert lowering_strategy(plan.column_runs(f"{side}_buf")[1], plan.num_ranges) == strategy
    memory = {b.name: RawMemory(BASES[b.name], b.nbytes) for b in plan.buffers}
    bound = bind(plan.buffers, memory)
    n = plan.num_ranges
    out = (np.full(n + 3, 7, np.uint64), np.full(n + 3, 7, np.uint64))
    low = bound.descriptors(plan, out)
    assert low.src.tolist() == expected_addresses(plan, BASES, "src")
    assert low.dst.tolist() == expected_addresses(plan, BASES, "dst")
    assert low.nbytes.tolist() == plan.nbytes.tolist()
    assert out[0][n:].tolist() == [7, 7, 7] and np.shares_memory(low.src, out[0])
    sizes = np.full(n + 3, 7, np.uint64)  # a third array takes the sizes (the DMA executors reuse all three)
    monkeypatch.setattr(lowering, "FRESH_RANGES", 0)  # as large plans do (small ones take a fresh array)
    low3 = bound.descriptors(plan, (*out, sizes))
    assert low3.nbytes.tolist() == plan.nbytes.tolist() and sizes[n:].tolist() == [7, 7, 7]
    assert np.shares_memory(low3.nbytes, sizes)
    assert low3.src.tolist() == low.src.tolist() and low3.dst.tolist() == low.dst.tolist()
    mixed = with_column(with_column(plan, "nbytes", 0, PAGE // 2), "nbytes", n - 1, PAGE // 4)  # sizes in 3 runs
    for lowered in (bound.descriptors(mixed, (*out, sizes)), bound.descriptors(mixed), bound.offsets(mixed)):
        assert lowered.nbytes.tolist() == mixed.nbytes.tolist()
    offsets = bound.offsets(plan)  # the check-only lowering keeps offsets
    assert offsets.src.tolist() == plan.src_offset.tolist() and offsets.dst.tolist() == plan.dst_offset.tolist()
    assert offsets.nbytes.tolist() == plan.nbytes.tolist() and len(offsets.nbytes) == n
    # offsets are read once into the executor's own memory (a plan's column may still be written through torch),
    # and stay read-only for whoever holds them
    assert not np.shares_memory(offsets.src, plan.column("src_offset"))
    assert not np.shares_memory(offsets.dst, plan.column("dst_offset"))
    for col in (offsets.src, offsets.dst, offsets.nbytes):
        with pytest.raises(ValueError):
            col.flags.writeable = True


def _positions(lengths: list[int]) -> list[tuple[int, int]]:
    """(run, index) of the first, a middle and the last range of every run."""
    out, at = [], 0
    for r, n in enumerate(lengths):
        out += sorted({(r, at), (r, at + n // 2), (r, at + n - 1)})
        at += n
    return out


@pytest.mark.parametrize("side", ["src", "dst"])
@pytest.mark.parametrize("lengths", list(RUNS))
def test_a_range_past_its_buffer_is_refused_wherever_it_sits_in_its_run(side, lengths):
    plan = hand_plan(RUNS[lengths])
    bound = bind(plan.buffers, {b.name: RawMemory(BASES[b.name], b.nbytes) for b in plan.buffers})
    for _, i in _positions(RUNS[lengths]):
        buf = plan.buffers[int(plan.column(f"{side}_buf")[i])]
        bad = with_column(plan, f"{side}_offset", i, buf.nbytes - PAGE + 8)  # 8 bytes inside, 8 past the end
        msg = rf"^{side}_offset\[{i}\] = {buf.nbytes - 8}: range of {PAGE} bytes runs past buffer '{buf.name}'"
        with pytest.raises(PlanError, match=msg):
            bound.lower(bad)
        with pytest.raises(PlanError, match=msg):
            bound.check(bad)


@pytest.mark.parametrize("side", ["src", "dst"])
def test_bounds_are_the_plans_declared_sizes_even_when_the_bound_memory_is_larger(side):
    plan = hand_plan(RUNS["4, 2, 2, 8"])
    memory = {b.name: np.zeros(4 * b.nbytes, np.uint8) for b in plan.buffers}  # 4x what the plan declares
    before = {k: v.copy() for k, v in memory.items()}
    i = 5
    buf = plan.buffers[int(plan.column(f"{side}_buf")[i])]
    bad = with_column(plan, f"{side}_offset", i, buf.nbytes)  # inside the memory, past the declared buffer
    msg = rf"^{side}_offset\[{i}\] = {buf.nbytes}: range of {PAGE} bytes runs past buffer '{buf.name}' of {buf.nbytes} bytes"
    with pytest.raises(PlanError, match=msg):
        NumpyExecutor().run(bad, memory)
    with pytest.raises(PlanError, match=msg):
        bind(plan.buffers, {k: RawMemory(BASES[k], 4 * b.nbytes) for k, b in zip(memory, plan.buffers)}).lower(bad)
    assert all(np.array_equal(memory[k], before[k]) for k in memory)


@pytest.fixture(scope="module")
def shim_path(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return build("fake_cuda", tmp_path_factory.mktemp("lowering_shim"))


@pytest.mark.parametrize("column, table", [("region", "regions"), ("attr", "attrs")])
@pytest.mark.parametrize("where", ["first", "last"])
def test_an_index_equal_to_its_tables_size_is_refused_before_any_call_is_issued(shim_path, column, table, where):
    from .shims.runtime import ShimCudaRuntime
    state = ShimState(ctypes.CDLL(str(shim_path)))
    state.reset()
    state.set(null_batch=0)
    ex = CudaBatchExecutor(ShimCudaRuntime(shim_path, TARGET.runtime_version))
    plan = hand_plan(RUNS["4, 2, 2, 8"])
    i = 0 if where == "first" else plan.num_ranges - 1
    size = len(getattr(plan, table))
    bad = with_column(plan, column, i, size)
    memory = {b.name: np.zeros(b.nbytes, np.uint8) for b in plan.buffers}
    for run in (lambda: ex.run(bad, memory), lambda: NumpyExecutor().run(bad, memory)):
        with pytest.raises(PlanError, match=rf"^{column}\[{i}\] = {size}: out of range \(the plan has {size}\)"):
            run()
    assert state.counts == [] and not [op for op in state.log if op[0] in ("batch", "copy")]
    assert not any(m.any() for m in memory.values())
    ex.close()


def test_a_buffer_index_equal_to_the_table_size_is_refused():
    plan = hand_plan(RUNS["4, 2, 2, 8"])
    bound = bind(plan.buffers, {b.name: RawMemory(BASES[b.name], b.nbytes) for b in plan.buffers})
    for side in ("src", "dst"):
        bad = with_column(plan, f"{side}_buf", 6, len(plan.buffers))
        with pytest.raises(PlanError, match=rf"^{side}_buf\[6\] = {len(plan.buffers)}: out of range"):
            bound.lower(bad)


def test_a_plan_touching_an_unbound_or_read_only_buffer_is_refused_naming_it():
    plan = hand_plan(RUNS["4, 2, 2, 8"])
    memory = {b.name: np.zeros(b.nbytes, np.uint8) for b in plan.buffers}
    dst = plan.buffers[DEVICE[3]].name
    frozen = dict(memory)
    frozen[dst] = memory[dst].copy()
    frozen[dst].flags.writeable = False
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = ndarray\(\d+,\): read-only, but the plan writes to it"):
        NumpyExecutor().run(plan, frozen)
    with pytest.raises(BindingError, match=rf"^bindings\['{dst}'\] = missing"):
        NumpyExecutor().run(plan, {k: v for k, v in memory.items() if k != dst})
