"""kvxfer.testing itself: the oracle's expansion of the spec, its helpers, and the golden pytest plugin."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Case,
    Fragment,
    Layout,
    Placement,
    PlanOptions,
    Region,
    Target,
    golden,
    hip_version,
    plan_transfer,
    presets,
)
from kvxfer.testing import (
    OracleError,
    apply_copies,
    assert_plan_matches,
    expected_copies,
    independent,
    min_ranges,
    random_buffers,
    run_reference,
)

pytest_plugins = ["pytester"]


def _layout(host_k: int = 4, host_stride: int | None = None, page: int = 8, **region) -> Layout:
    return Layout(buffers=[Buffer(name="g", nbytes=64 * page), Buffer(name="h", nbytes=64 * 2 * page, location="host")],
                  regions=[Region(name="r", page_bytes=page, device=Placement(buffer="g"),
                                  host=Placement(buffer="h", blocks_per_chunk=host_k, stride_bytes=host_stride), **region)])


# ---- the expansion, checked against the spec's own worked examples -------------------------------------------
def test_chunks_with_a_skip_enumerate_as_the_spec_says():
    """Chunks [3, 7, 9] with k = 4, count 10 and skip 2 give pages [14, 15, 28..31, 36..39]."""
    m = BlockMapping(direction="d2h", src_ids=np.arange(10), dst_ids=[3, 7, 9], group_sizes=[10], group_starts=[2])
    c = expected_copies(_layout(), m)
    assert (c.dst_offset // 8).tolist() == [14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    assert c.src_offset.tolist() == (np.arange(10) * 8).tolist() and set(c.nbytes.tolist()) == {8}
    assert min_ranges(c) == 3


def test_padded_rows_put_sub_blocks_at_row_stride():
    m = BlockMapping(direction="h2d", src_ids=[2, 3], dst_ids=np.arange(8), group_sizes=[8])
    c = expected_copies(_layout(host_stride=40), m)
    assert c.src_offset.tolist() == [80, 88, 96, 104, 120, 128, 136, 144]
    assert min_ranges(c) == 2


def test_groups_take_their_own_slices_and_skips_per_side():
    regions = [Region(name="full", page_bytes=16, device=Placement(buffer="g"), host=Placement(buffer="h", blocks_per_chunk=2)),
               Region(name="swa", page_bytes=8, group=1, device=Placement(buffer="g", byte_offset=2048, blocks_per_chunk=2),
                      host=Placement(buffer="h", byte_offset=2048, blocks_per_chunk=4))]
    layout = Layout(buffers=[Buffer(name="g", nbytes=4096), Buffer(name="h", nbytes=4096, location="host")], regions=regions)
    # group 0: 3 pages from logical 1 -> host chunks [5, 6] give pages 11, 12, 13; device ids 10, 11, 12
    # group 1: 2 pages from logical 3 -> host skip 3 (k=4): chunks [9, 2] give 39, 8; device skip 1 (k=2): chunk [20, 21] give 41, 42
    m = BlockMapping(direction="h2d", src_ids=[5, 6, 9, 2], dst_ids=[10, 11, 12, 20, 21], group_sizes=[3, 2], group_starts=[1, 3])
    c = expected_copies(layout, m)
    assert c.region.tolist() == [0, 0, 0, 1, 1]
    assert c.src_offset.tolist() == [11 * 16, 12 * 16, 13 * 16, 2048 + 39 * 8, 2048 + 8 * 8]
    assert c.dst_offset.tolist() == [10 * 16, 11 * 16, 12 * 16, 2048 + 41 * 8, 2048 + 42 * 8]
    assert_plan_matches(plan_transfer(layout, m), layout, m)


def test_fragments_swap_sides_on_load():
    frag = Fragment(local_offset=0, local_stride=2, canonical_offset=1, canonical_stride=4, fragment_bytes=2, count=2)
    layout = _layout(host_k=1, page=4, host_page_bytes=8, fragments=(frag,))
    store = expected_copies(layout, BlockMapping(direction="d2h", src_ids=[3], dst_ids=[5]))
    assert list(store) == [("g", 12, "h", 41, 2), ("g", 14, "h", 45, 2)]
    load = expected_copies(layout, BlockMapping(direction="h2d", src_ids=[5], dst_ids=[3]))
    assert list(load) == [("h", 41, "g", 12, 2), ("h", 45, "g", 14, 2)]


def test_writer_rotation_per_region_and_per_plan():
    """Issue 10's repro: a replicated region (2 writers, index 0) and a private one (every rank writes), whole
    32-byte pages into 64-byte host rows, device pages 0-3 to host pages 0-3: 6 pages written."""
    R = Region
    if "num_writers" not in Region.model_fields:  # the oracle reads the settings with getattr; a planner
        class R(Region):                          # without them gets them from a subclass here
            num_writers: int | None = None
            writer_index: int | None = None
    regions = [R(name="mla", page_bytes=32, num_writers=2, writer_index=0, device=Placement(buffer="g"),
                      host=Placement(buffer="h", stride_bytes=64)),
               R(name="private", page_bytes=32, num_writers=1, device=Placement(buffer="g", byte_offset=512),
                      host=Placement(buffer="h", byte_offset=32, stride_bytes=64))]
    layout = Layout(buffers=[Buffer(name="g", nbytes=1024), Buffer(name="h", nbytes=1024, location="host")], regions=regions)
    m = BlockMapping(direction="d2h", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3])
    c = expected_copies(layout, m, PlanOptions(num_writers=4, writer_index=1))
    assert [(r, o // 64) for r, o in zip(c.region.tolist(), c.dst_offset.tolist())] == [
        (0, 0), (0, 2), (1, 0), (1, 1), (1, 2), (1, 3)]
    assert len(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3]))) == 8


def test_plan_level_writer_rotation_filters_on_the_host_page():
    m = BlockMapping(direction="d2h", src_ids=np.arange(8), dst_ids=[3, 4], group_sizes=[8])
    c = expected_copies(_layout(), m, PlanOptions(num_writers=3, writer_index=2))
    assert (c.dst_offset // 8).tolist() == [14, 17]  # host pages 12..19, those = 2 mod 3


def test_wrong_group_counts_are_refused():
    m = BlockMapping(direction="d2h", src_ids=np.arange(4), dst_ids=[3], group_sizes=[2, 2])
    with pytest.raises(OracleError, match="2 groups given, the layout has 1"):
        expected_copies(_layout(), m)
    with pytest.raises(OracleError, match="dst_ids: the groups consume 1 ids, the list has 2"):
        expected_copies(_layout(), BlockMapping(direction="d2h", src_ids=np.arange(4), dst_ids=[3, 4], group_sizes=[4]))


# ---- helpers --------------------------------------------------------------------------------------------------
def test_apply_copies_is_a_memmove_per_piece_in_order():
    buf = {"m": np.arange(16, dtype=np.uint8)}
    apply_copies([("m", 0, "m", 2, 8)], buf)  # overlapping source and destination: read first, then write
    assert buf["m"].tolist() == [0, 1, 0, 1, 2, 3, 4, 5, 6, 7, 10, 11, 12, 13, 14, 15]
    buf = {"m": np.arange(8, dtype=np.uint8)}
    apply_copies([("m", 0, "m", 4, 2), ("m", 4, "m", 6, 2)], buf)  # the second piece reads what the first wrote
    assert buf["m"].tolist() == [0, 1, 2, 3, 0, 1, 0, 1]
    with pytest.raises(OracleError, match=r"copies\[0\]: dst m\[7:\+2\] runs past the buffer of 8 bytes"):
        apply_copies([("m", 0, "m", 7, 2)], buf)


def test_the_gather_path_and_the_loop_agree():
    layout = presets.tp_fragment_layout(4, 32, tokens=4, heads=4, head_bytes=2, tp=2, rank=1)
    m = presets.mapping("fragmented", 12, 32, "d2h", seed=1)
    copies = expected_copies(layout, m)
    assert independent(copies) and len(copies) > 100
    fast = random_buffers(layout, 3)
    slow = {k: v.copy() for k, v in fast.items()}
    apply_copies(copies, fast)
    for sb, so, db, do, n in copies:
        slow[db][do:do + n] = slow[sb][so:so + n]
    for k in fast:
        np.testing.assert_array_equal(fast[k], slow[k])


def test_independent_sees_double_writes_and_read_write_overlap():
    layout = presets.kv_layout(1, 8, 4)
    ok = expected_copies(layout, BlockMapping(direction="h2d", src_ids=[0, 0], dst_ids=[1, 2]))
    twice = expected_copies(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[2, 2]))
    assert independent(ok) and not independent(twice)
    one = Layout(buffers=[Buffer(name="m", nbytes=64)],
                 regions=[Region(name="r", page_bytes=4, device=Placement(buffer="m"), host=Placement(buffer="m", byte_offset=32))])
    assert independent(expected_copies(one, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[0])))
    assert not independent(expected_copies(one, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[8])))


def test_min_ranges_counts_runs_of_bytes():
    layout = presets.kv_layout(1, 16, 4)
    assert min_ranges(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[9, 8, 7], dst_ids=[4, 3, 2]))) == 1
    assert min_ranges(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[1, 2, 3], dst_ids=[2, 4, 6]))) == 3
    assert min_ranges(expected_copies(layout, BlockMapping(direction="h2d", src_ids=[], dst_ids=[]))) == 0


def test_random_buffers_are_seeded_and_distinct():
    layout = presets.kv_layout(2, 8, 16)
    a, b, c = random_buffers(layout, 1), random_buffers(layout, 1), random_buffers(layout, 2)
    assert all(np.array_equal(a[k], b[k]) for k in a) and not all(np.array_equal(a[k], c[k]) for k in a)
    assert {k: v.nbytes for k, v in a.items()} == {x.name: x.nbytes for x in layout.buffers}


def test_run_reference_leaves_its_inputs_alone():
    layout = presets.kv_layout(2, 8, 16)
    m = presets.mapping("runs8", 4, 8)
    before = random_buffers(layout)
    keep = {k: v.copy() for k, v in before.items()}
    after = run_reference(layout, m, before)
    assert all(np.array_equal(before[k], keep[k]) for k in keep)
    assert not all(np.array_equal(after[k], keep[k]) for k in keep)


def test_assert_plan_matches_catches_a_plan_of_another_mapping():
    layout = presets.kv_layout(2, 16, 8)
    m = presets.mapping("runs8", 8, 16)
    other = BlockMapping(direction="h2d", src_ids=m.src_ids, dst_ids=np.roll(m.dst_ids, 1))
    assert_plan_matches(plan_transfer(layout, m), layout, m)
    with pytest.raises(AssertionError, match=r"buffer 'gpu.kv0': \d+ bytes differ, first at offset \d+"):
        assert_plan_matches(plan_transfer(layout, other), layout, m)


def test_assert_plan_matches_catches_a_stray_write():
    """A plan that also writes a byte nobody asked for (sentinel) fails."""
    layout = presets.kv_layout(1, 16, 8)
    m = BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[2, 3])
    wider = BlockMapping(direction="h2d", src_ids=[0, 1, 9], dst_ids=[2, 3, 5])
    with pytest.raises(AssertionError, match=r"buffer 'gpu.kv0': [78] bytes differ, first at offset 4[01]"):
        assert_plan_matches(plan_transfer(layout, wider), layout, m)


# ---- the golden pytest plugin ---------------------------------------------------------------------------------
def _case(minor: int) -> Case:
    return Case(layout=presets.kv_layout(2, 32, 4096), mapping=presets.mapping("runs8", 16, 32),
                target=Target(platform="rocm", runtime_version=hip_version(7, minor)))


PLUGIN_TESTS = """
from kvxfer.planner import Case, Target, hip_version, presets

def make(minor):
    return Case(layout=presets.kv_layout(2, 32, 4096), mapping=presets.mapping("runs8", 16, 32),
                target=Target(platform="rocm", runtime_version=hip_version(7, minor)))

def test_twice(golden_plan):
    golden_plan(make(16))
    golden_plan(make(2))
    golden_plan(make(13))

def test_named(golden_plan):
    golden_plan(make(16), "named")
"""


@pytest.fixture
def golden_project(pytester):
    pytester.makeini("[pytest]\ntestpaths = tests\nkvxfer_golden_dir = tests/goldens\n")
    (pytester.path / "tests").mkdir()
    (pytester.path / "tests" / "test_g.py").write_text(PLUGIN_TESTS)
    folder = pytester.path / "tests" / "goldens"
    folder.mkdir()
    return pytester, folder


def test_repeated_unnamed_snapshots_are_numbered(golden_project):
    pytester, folder = golden_project
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=2)
    assert sorted(p.name for p in folder.glob("*.json")) == ["named.json", "test_twice.1.json", "test_twice.2.json",
                                                       "test_twice.json"]
    assert golden.load(folder / "test_twice.json").case == _case(16)
    assert golden.load(folder / "test_twice.1.json").case == _case(2)
    assert golden.load(folder / "test_twice.2.json").case == _case(13)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)  # and they check clean afterwards


def test_unused_goldens_are_reported_and_pruned_only_on_a_whole_run(golden_project):
    pytester, folder = golden_project
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=2)
    golden.save(folder / "stale.json", _case(7))
    narrow = pytester.runpytest("-p", "no:cacheprovider", "-k", "named", "--prune-golden")
    narrow.assert_outcomes(passed=1, deselected=1)
    assert "golden file(s) unused" not in narrow.stdout.str() and (folder / "stale.json").exists()
    one_file = pytester.runpytest("-p", "no:cacheprovider", "tests/test_g.py::test_named", "--prune-golden")
    assert "golden file(s) unused" not in one_file.stdout.str() and (folder / "stale.json").exists()
    whole = pytester.runpytest("-p", "no:cacheprovider")
    whole.assert_outcomes(passed=2)
    whole.stdout.fnmatch_lines(["*kvxfer: 1 golden file(s) unused (delete them with --prune-golden)*", "*stale.json"])
    assert (folder / "stale.json").exists()
    pruned = pytester.runpytest("-p", "no:cacheprovider", "--prune-golden")
    pruned.stdout.fnmatch_lines(["*kvxfer: 1 golden file(s) deleted*", "*stale.json"])
    assert not (folder / "stale.json").exists()
    assert sorted(p.name for p in folder.glob("*.json")) == ["named.json", "test_twice.1.json", "test_twice.2.json",
                                                       "test_twice.json"]
    clean = pytester.runpytest("-p", "no:cacheprovider")
    assert "golden file(s) unused" not in clean.stdout.str()


def test_a_whole_run_leaves_the_record_that_the_cli_prunes_by(golden_project, capsys):
    from kvxfer.cli.main import main as cli_main

    pytester, folder = golden_project
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=2)
    golden.save(folder / "stale.json", _case(7))
    (folder / golden.USED_RECORD).unlink()
    pytester.runpytest("-p", "no:cacheprovider", "-k", "named").assert_outcomes(passed=1, deselected=1)
    assert not (folder / golden.USED_RECORD).exists()  # a narrow run records nothing
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)
    assert (folder / golden.USED_RECORD).read_text().split() == ["named.json", "test_twice.1.json",
                                                                 "test_twice.2.json", "test_twice.json"]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["golden", "check", str(folder), "--prune"])
    assert exit_info.value.code in (0, None) and "deleted" in capsys.readouterr().out
    assert not (folder / "stale.json").exists() and (folder / "named.json").exists()


def test_a_run_stopped_early_reports_nothing(golden_project):
    pytester, folder = golden_project
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=2)
    golden.save(folder / "stale.json", _case(7))
    (pytester.path / "tests" / "test_a_fail.py").write_text("def test_fail():\n    assert False\n")
    result = pytester.runpytest("-p", "no:cacheprovider", "-x", "--prune-golden")
    assert "golden file(s) unused" not in result.stdout.str() and "golden file(s) deleted" not in result.stdout.str()
    assert (folder / "stale.json").exists()


PLAN_TESTS = """
from kvxfer.planner import PlanOptions, plan_transfer, presets

def test_plan(golden_plan):
    layout = presets.kv_layout(2, 128, 4096)
    golden_plan(plan_transfer(layout, presets.mapping("runs8", 48, 128), options=PlanOptions(coalesce=COALESCE)))
"""


def test_golden_plan_takes_a_plan_alone(pytester):
    import json

    pytester.makeini("[pytest]\nkvxfer_golden_dir = goldens\n")
    pytester.makepyfile(test_p=PLAN_TESTS.replace("COALESCE", "True"))
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=1)
    path = pytester.path / "goldens" / "test_plan.json"
    stored = golden.load(path)
    assert json.loads(path.read_text())["case"] is None and stored.case is None and stored.plan.num_ranges == 12
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=1)
    pytester.makepyfile(test_p=PLAN_TESTS.replace("COALESCE", "False"))  # 12 merged ranges -> 96 single blocks
    failed = pytester.runpytest("-p", "no:cacheprovider")
    failed.assert_outcomes(failed=1)
    failed.stdout.fnmatch_lines(["*plan differs from*test_plan.json*", "*ranges 12 -> 96 (+84)*",
                                 "*... 68 changed ranges not shown (pytest -vv shows all) ...*"])
    every = pytester.runpytest("-p", "no:cacheprovider", "-vv")  # the hint holds: every row is shown
    every.assert_outcomes(failed=1)
    shown = [line for line in every.stdout.lines if line[:1] in "-+" and line.split()[-1:] in (["kv0"], ["kv1"])]
    assert "changed ranges not shown" not in every.stdout.str() and len(set(shown)) == 12 + 96
    assert golden.check_file(path).status == "plan-only" and golden.check_file(path).ok
    assert golden.update_file(path) is False  # no case to re-plan: the file is left as it is


def test_golden_plan_refuses_a_plan_given_twice(pytester):
    pytester.makeini("[pytest]\nkvxfer_golden_dir = goldens\n")
    pytester.makepyfile(test_p="""
from kvxfer.planner import plan_transfer, presets

def test_twice(golden_plan):
    p = plan_transfer(presets.kv_layout(2, 32, 4096), presets.mapping("runs8", 16, 32))
    golden_plan(p, plan=p)
""")
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*ValueError: golden_plan(plan, plan=...): pass a plan once*"])


def test_the_oracles_names_are_real_attributes_and_loading_the_plugin_loads_no_planner():
    """Documentation tools and IDEs read a module's attributes; the plugin loads in every pytest run."""
    import subprocess
    import sys

    import kvxfer.testing as testing

    assert set(testing.__all__) <= set(vars(testing))
    code = ("import sys, kvxfer.testing.pytest_plugin, kvxfer.testing; "
            "print(sorted(m for m in sys.modules if m.startswith('kvxfer.planner')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "[]"
