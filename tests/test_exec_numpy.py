"""The NumPy executor's copy paths (window groups, memmove, torch's foreach copy) equal one slice assignment per
range, byte for byte, sentinels included.

Hand-made plans mix sizes on both sides of SMALL_RANGE_BYTES (and of a bulk threshold) within one segment, odd offsets and sizes, buffer
pairs that change mid-call, several calls, and a source and destination in one buffer; the reference is a
Python loop over the plan's ranges written here.
"""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import ConfigError, ExecutorConfig, ExecutorError, NumpyExecutor
from kvxfer.executors._ops_numpy import GATHER_BYTES, HELD_PIECE_BYTES, SMALL_RANGE_BYTES, WINDOW_STEP, HostPath
from kvxfer.executors.config import build_executor
from kvxfer.planner import COLUMNS, Buffer, Layout, Location, Placement, Region, TransferPlan, plan_transfer

SIZE = 1 << 20
LAYOUT = Layout(buffers=(Buffer(name="h", nbytes=SIZE, location=Location.HOST), Buffer(name="d0", nbytes=SIZE),
                         Buffer(name="d1", nbytes=SIZE)),
                regions=(Region(name="r", page_bytes=64, device=Placement(buffer="d0"), host=Placement(buffer="h")),))
TEMPLATE = plan_transfer(LAYOUT, {"direction": "h2d", "src_ids": [0], "dst_ids": [0]})
SIZES = (1, 7, 64, 64, 64, 512, 4096, SMALL_RANGE_BYTES - 1, SMALL_RANGE_BYTES, 20000, GATHER_BYTES + 3)


def random_plan(seed: int, segments: int = 6, calls: int = 3) -> TransferPlan:
    """Ranges in ``segments`` runs of one (source, destination) buffer pair, destinations never overlapping each
    other or any source in the same buffer; ``calls`` calls cut across the runs."""
    rng = np.random.default_rng(seed)
    rows = []
    free = {0: [0], 1: [0], 2: [0]}  # per buffer: the next free destination byte (destinations in the upper half)
    for _ in range(segments):
        src, dst = (int(x) for x in rng.choice(3, 2, replace=bool(rng.integers(0, 2))))
        for _ in range(int(rng.integers(1, 40))):
            n = int(rng.choice(SIZES))
            if free[dst][0] + n > SIZE // 2:
                continue
            do = SIZE // 2 + free[dst][0] + int(rng.integers(0, 3))
            free[dst][0] = do - SIZE // 2 + n
            so = int(rng.integers(0, SIZE // 2 - n))  # sources in the lower half: never a destination
            rows.append((src, so, dst, do, n))
    cols = {c: np.array(v) for c, v in zip(("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes"), zip(*rows))}
    cols["region"] = np.zeros(len(rows), np.int32)
    cols["attr"] = np.zeros(len(rows), np.uint16)
    cuts = np.unique(np.concatenate(([0, len(rows)], rng.integers(1, len(rows), calls - 1))))
    return TransferPlan(direction=TEMPLATE.direction, target=TEMPLATE.target, options=TEMPLATE.options,
                        buffers=LAYOUT.buffers, regions=TEMPLATE.regions, attrs=TEMPLATE.attrs,
                        requested_copies=len(rows), call_offsets=cuts, columns={c: cols[c] for c in COLUMNS})


def reference(plan: TransferPlan, bufs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    out = {k: v.copy() for k, v in bufs.items()}
    names = [b.name for b in plan.buffers]
    for sb, so, db, do, n in zip(*(plan.column(c).tolist() for c in ("src_buf", "src_offset", "dst_buf", "dst_offset", "nbytes"))):
        out[names[db]][do:do + n] = out[names[sb]][so:so + n]
    return out


FALLBACK = {HostPath.WINDOW, HostPath.MEMMOVE, HostPath.TORCH}  # the paths without the copier
EXECUTORS = {  # name -> (executor, the paths it must take on every random plan)
    "default": (lambda: NumpyExecutor(copier=False), {HostPath.WINDOW, HostPath.MEMMOVE}),
    "torch": (lambda: NumpyExecutor(bulk_range_bytes=SMALL_RANGE_BYTES + 1, copier=False), FALLBACK),
    "windows-only": (lambda: NumpyExecutor(small_range_bytes=1 << 20, copier=False), {HostPath.WINDOW}),  # steps of one range
    "memmove-only": (lambda: NumpyExecutor(small_range_bytes=0, bulk_range_bytes=None, copier=False), {HostPath.MEMMOVE}),
    "torch-only": (lambda: NumpyExecutor(small_range_bytes=0, bulk_range_bytes=1, copier=False), {HostPath.TORCH}),
    "copier": (lambda: NumpyExecutor(), {HostPath.COPIER}),  # where numba is installed (kvxfer[fast])
    "copier-3-threads": (lambda: NumpyExecutor(copier_threads=3), {HostPath.COPIER}),  # ranges cut between threads
}


@pytest.mark.parametrize("name", EXECUTORS)
@pytest.mark.parametrize("seed", range(8))
def test_every_path_equals_one_slice_assignment_per_range(seed, name):
    pytest.importorskip("torch")  # the torch path runs only where torch is imported
    if name.startswith("copier"):
        pytest.importorskip("numba")  # the copier runs only where numba is installed
    plan = random_plan(seed)
    rng = np.random.default_rng(100 + seed)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}  # random bytes: sentinels
    want = reference(plan, bufs)
    make, paths = EXECUTORS[name]
    ex = make()
    taken = {p for p, (n, _) in ex.paths(plan).items() if n}
    assert paths <= taken <= paths | {HostPath.MEMMOVE}, ex.explain(plan)  # short segments go by memmove
    assert sum(n for n, _ in ex.paths(plan).values()) == plan.num_ranges
    assert sum(b for _, b in ex.paths(plan).values()) == plan.total_bytes
    ex.run(plan, bufs)
    for k in bufs:
        assert np.array_equal(bufs[k], want[k]), k


def test_ranges_of_several_memmove_pieces_move_each_piece_from_its_own_source_bytes():
    """A memmove range above HELD_PIECE_BYTES goes in pieces of it (the GIL is kept for each): every piece reads
    its own part of the source, at odd offsets and a size that is no multiple of the piece, in two buffer pairs."""
    n = 2 * HELD_PIECE_BYTES + 12345
    size = 3 * HELD_PIECE_BYTES + (1 << 16)
    buffers = (Buffer(name="h", nbytes=size, location=Location.HOST), Buffer(name="d0", nbytes=size),
               Buffer(name="d1", nbytes=size))
    cols = {"src_buf": [0, 1], "src_offset": [7, 5], "dst_buf": [1, 2], "dst_offset": [HELD_PIECE_BYTES - 3, 1],
            "nbytes": [n, HELD_PIECE_BYTES + 1], "region": [0, 0], "attr": [0, 0]}
    plan = TransferPlan(direction=TEMPLATE.direction, target=TEMPLATE.target, options=TEMPLATE.options, buffers=buffers,
                        regions=TEMPLATE.regions, attrs=TEMPLATE.attrs, requested_copies=2, call_offsets=[0, 2],
                        columns={c: np.array(cols[c], dtype=COLUMNS[c]) for c in COLUMNS})
    ex = NumpyExecutor(copier=False)
    assert ex.paths(plan)[HostPath.MEMMOVE] == (2, n + HELD_PIECE_BYTES + 1)
    rng = np.random.default_rng(7)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in buffers}  # no two pieces alike
    want = reference(plan, bufs)
    ex.run(plan, bufs)
    assert all(np.array_equal(bufs[k], want[k]) for k in bufs)


def test_a_window_group_longer_than_one_step_and_torch_tensors_made_once_per_bind():
    torch = pytest.importorskip("torch")
    n = 3 * WINDOW_STEP + 5
    layout = Layout(buffers=(Buffer(name="h", nbytes=n * 128, location=Location.HOST), Buffer(name="d", nbytes=n * 128)),
                    regions=(Region(name="r", page_bytes=64, device=Placement(buffer="d"), host=Placement(buffer="h")),))
    ids = np.arange(n)
    plan = plan_transfer(layout, {"direction": "h2d", "src_ids": ids * 2, "dst_ids": ids[::-1] * 2})
    assert plan.num_ranges == n and NumpyExecutor(copier=False).paths(plan)[HostPath.WINDOW][0] == n
    h = torch.arange(n * 128, dtype=torch.int32).to(torch.uint8)
    d = torch.zeros(n * 128, dtype=torch.uint8)
    ex = NumpyExecutor(bulk_range_bytes=1, copier=False)
    bound = ex.bind(layout, {"h": h, "d": d})
    NumpyExecutor(copier=False).run(plan, bound)
    want = torch.zeros_like(d)
    for i in range(n):
        want[(n - 1 - i) * 128:(n - 1 - i) * 128 + 64] = h[i * 128:i * 128 + 64]
    assert torch.equal(d, want)
    d.zero_()
    ex.run(plan, bound)
    ex.run(plan, bound)
    assert torch.equal(d, want) and len(bound.extra["tensors"]) == 2  # one tensor per buffer, made once


def test_explain_and_repr_name_the_paths_and_options_are_checked():
    plan = random_plan(4)
    ex = build_executor("numpy", ExecutorConfig.model_validate({"kind": "numpy", "numpy": {"bulk_range_bytes": 20000,
                                                                                           "copier": False}}))
    assert ex.bulk_range_bytes == 20000
    line = ex.explain(plan)
    for path, (n, _) in ex.paths(plan).items():
        assert (f"{path.value} {n} ranges" in line) == bool(n), line
    assert "bulk_range_bytes=20000" in repr(ex)
    with pytest.raises(ConfigError, match="small_range_bytes"):
        NumpyExecutor(small_range_bytes=-1)
    with pytest.raises(ConfigError, match="bulk_range_bytes"):
        ExecutorConfig.model_validate({"kind": "numpy", "numpy": {"bulk_range_bytes": 0}})


def test_a_read_only_source_can_be_read_and_any_buffer_pair_copies():
    plan = random_plan(99)
    rng = np.random.default_rng(5)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    want = reference(plan, bufs)
    ro = {k: v.copy() for k, v in bufs.items()}
    written = set(np.unique(plan.dst_buf).tolist())
    for i, b in enumerate(LAYOUT.buffers):
        if i not in written:
            ro[b.name].flags.writeable = False
    NumpyExecutor().run(plan, ro)
    assert all(np.array_equal(ro[k], want[k]) for k in ro)


def test_a_failure_while_copying_names_the_call_and_leaves_later_calls_uncopied():
    plan = random_plan(3)
    assert plan.num_calls >= 2
    bufs = {b.name: np.zeros(b.nbytes, np.uint8) + 1 for b in LAYOUT.buffers}
    k = plan.num_calls - 1
    first = int(plan.call_offsets[k])

    class RunsOutOfMemory(NumpyExecutor):
        def move(self, path, sides, src, dst, low, index):
            if int(index.max()) >= first:
                raise MemoryError("no memory for the temporary")
            super().move(path, sides, src, dst, low, index)
    with pytest.raises(ExecutorError, match=rf"^numpy copy failed at chunk {k}, descriptor \d+: MemoryError: no memory"):
        RunsOutOfMemory(copier=False).run(plan, bufs)


def test_the_environment_sets_the_numpy_thresholds():
    c = ExecutorConfig.load(env={"KVXFER_NUMPY_BULK_RANGE_BYTES": "off", "KVXFER_NUMPY_SMALL_RANGE_BYTES": "4096"})
    assert c.numpy.bulk_range_bytes is None and c.numpy.small_range_bytes == 4096
    with pytest.raises(ConfigError, match="KVXFER_NUMPY_BULK_RANGE_BYTES"):
        ExecutorConfig.load(env={"KVXFER_NUMPY_BULK_RANGE_BYTES": "-5"})


def test_an_executor_survives_pickling_and_copying_and_still_copies():
    import copy
    import pickle
    plan = random_plan(5)
    for ex in (pickle.loads(pickle.dumps(NumpyExecutor(small_range_bytes=4096))), copy.deepcopy(NumpyExecutor())):
        bufs = {b.name: np.random.default_rng(1).integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
        want = reference(plan, bufs)
        ex.run(plan, bufs)
        assert all(np.array_equal(bufs[k], want[k]) for k in bufs)
    assert pickle.loads(pickle.dumps(NumpyExecutor(small_range_bytes=4096))).small_range_bytes == 4096
