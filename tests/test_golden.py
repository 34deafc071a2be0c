"""Golden files (planner/golden.py) and the golden_plan pytest fixture (pass, fail and update paths)."""
from __future__ import annotations

import json

import pytest

from kvxfer.planner import Case, PlanOptions, Target, golden, hip_version, presets

pytest_plugins = ["pytester"]


def make_case(minor: int = 16, **options) -> Case:
    return Case(layout=presets.kv_layout(2, 32, 4096), mapping=presets.mapping("runs8", 16, 32),
                target=Target(platform="rocm", runtime_version=hip_version(7, minor)), options=PlanOptions(**options))


def test_round_trip_and_one_range_per_line(tmp_path):
    case = make_case()
    path = tmp_path / "g.json"
    assert golden.save(path, case) is True
    assert golden.save(path, case) is False  # same text: not rewritten
    text = path.read_text()
    g = golden.load(path)
    assert g.case == case and g.plan == case.plan()
    range_lines = [line for line in text.splitlines() if line.startswith("   [") and line.rstrip(",").count(",") == 6]
    assert len(range_lines) == case.plan().num_ranges
    d = json.loads(text)
    assert d["kvxfer_golden"] == golden.GOLDEN_SCHEMA and d["plan"]["summary"] == repr(case.plan())
    assert golden.dumps(case) == text  # stable


def test_check_statuses(tmp_path):
    case = make_case()
    path = tmp_path / "g.json"
    assert golden.check(path, case).status == "missing"
    assert "no golden file" in golden.check(path, case).message and "TransferPlan(" in golden.check(path, case).message
    golden.save(path, case)
    assert golden.check(path, case).ok and golden.check_file(path).ok
    r = golden.check(path, make_case(2))
    assert r.status == "case-changed" and "attrs: flags 0x100 -> 0x0" in r.message
    golden.save(path, case, make_case(coalesce=False).plan())  # stored plan is not what the case plans to
    r = golden.check_file(path)
    assert r.status == "differs" and "ranges 32 -> 4 (-28)" in r.message and r.diff.equivalent
    assert golden.update_file(path) is True and golden.check_file(path).ok and golden.update_file(path) is False
    path.write_text("{not json")
    assert golden.check(path, case).status == "unreadable"


def test_schema_versions(tmp_path, monkeypatch):
    case = make_case()
    d = golden.golden_dict(case)
    with pytest.raises(golden.GoldenError, match="newer kvxfer"):
        golden.from_dict({**d, "kvxfer_golden": golden.GOLDEN_SCHEMA + 1})
    with pytest.raises(golden.GoldenError, match="cannot migrate.*regenerate"):
        golden.from_dict({**d, "kvxfer_golden": 0})
    with pytest.raises(golden.GoldenError, match="not a kvxfer golden file"):
        golden.from_dict({"case": d["case"]})
    # a registered migration is applied: version 0 stored the ranges under another key
    old = {**d, "kvxfer_golden": 0, "plan": {k if k != "ranges" else "rows": v for k, v in d["plan"].items()}}

    def v0_to_v1(x):
        plan = dict(x["plan"])
        plan["ranges"] = plan.pop("rows")
        return {**x, "plan": plan, "kvxfer_golden": 1}

    monkeypatch.setitem(golden.MIGRATIONS, 0, v0_to_v1)
    assert golden.from_dict(old).plan == case.plan()


def test_a_stored_plan_of_another_plan_schema_is_reported(tmp_path):
    case = make_case()
    d = golden.golden_dict(case)
    d["plan"]["schema_version"] = 99
    path = tmp_path / "g.json"
    path.write_text(json.dumps(d))
    r = golden.check(path, case)
    assert r.status == "unreadable" and "plan.schema_version" in r.message
    assert golden.load_case(path) == case  # the case still reads, so update can rewrite the file
    assert golden.update_file(path) and golden.check(path, case).ok


TEST_FILE = """
from kvxfer.planner import Case, PlanOptions, Target, hip_version, presets

def make(minor, **options):
    return Case(layout=presets.kv_layout(2, 32, 4096), mapping=presets.mapping("runs8", 16, 32),
                target=Target(platform="rocm", runtime_version=hip_version(7, minor)), options=PlanOptions(**options))

def test_pinned(golden_plan):
    plan = golden_plan(make(MINOR), "pinned")
    assert plan.num_ranges == 4

def test_default_name(golden_plan):
    golden_plan(make(16))
"""


@pytest.fixture
def project(pytester):
    pytester.makeini("[pytest]\nkvxfer_golden_dir = goldens\n")
    folder = pytester.path / "goldens"
    golden.save(folder / "pinned.json", make_case(16))
    golden.save(folder / "test_default_name.json", make_case(16))
    return pytester, folder


def test_fixture_passes_on_a_match(project):
    pytester, _ = project
    pytester.makepyfile(test_x=TEST_FILE.replace("MINOR", "16"))
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_fixture_fails_with_the_diff_and_the_update_command(project):
    pytester, folder = project
    before = (folder / "pinned.json").read_text()
    pytester.makepyfile(test_x=TEST_FILE.replace("MINOR", "2"))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*golden plan 'pinned': the case differs from the one stored in*pinned.json*",
                                 "*target rocm-7.16 -> rocm-7.2, ranges 4 -> 4, calls 1 -> 1, bytes equal,",
                                 "  attrs: flags 0x100 -> 0x0, passed yes -> no, same bytes moved*",
                                 "*to accept the new plan: pytest --update-golden 'test_x.py::test_pinned'",
                                 "*KVXFER_UPDATE_GOLDEN=1*"])
    assert (folder / "pinned.json").read_text() == before


@pytest.mark.parametrize("how", ["flag", "env"])
def test_fixture_updates_only_when_asked(project, monkeypatch, how):
    pytester, folder = project
    pytester.makepyfile(test_x=TEST_FILE.replace("MINOR", "2"))
    monkeypatch.delenv("KVXFER_UPDATE_GOLDEN", raising=False)
    if how == "env":
        monkeypatch.setenv("KVXFER_UPDATE_GOLDEN", "1")
    result = pytester.runpytest("-p", "no:cacheprovider", *(["--update-golden"] if how == "flag" else []))
    result.assert_outcomes(passed=2)
    result.stdout.fnmatch_lines(["*kvxfer: 1 golden file(s) written*", "*pinned.json"])
    assert golden.load(folder / "pinned.json").case == make_case(2)
    monkeypatch.delenv("KVXFER_UPDATE_GOLDEN", raising=False)
    pytester.runpytest("-p", "no:cacheprovider").assert_outcomes(passed=2)


def test_fixture_fails_on_a_missing_file_and_creates_it_on_update(project):
    pytester, folder = project
    (folder / "test_default_name.json").unlink()
    pytester.makepyfile(test_x=TEST_FILE.replace("MINOR", "16"))
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["*no golden file at*test_default_name.json; the plan is:*"])
    pytester.runpytest("-p", "no:cacheprovider", "--update-golden").assert_outcomes(passed=2)
    assert golden.load(folder / "test_default_name.json").case == make_case(16)
