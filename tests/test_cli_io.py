"""The CLI's input handling and output shape, run through the real ``kvxfer`` entry point."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from kvxfer.planner import Case, TransferPlan, golden

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
SAMPLE = GOLDEN_DIR / "cuda-13.0-runs8-h2d.json"


def kvxfer(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The installed console script when present, else the same entry point through the interpreter."""
    exe = shutil.which("kvxfer", path=str(Path(sys.executable).parent))
    cmd = [exe] if exe else [sys.executable, "-m", "kvxfer.cli"]
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)


def main(capsys, *args: object) -> tuple[int, str, str]:
    from kvxfer.cli.main import main as entry

    with pytest.raises(SystemExit) as info:
        entry([str(a) for a in args])
    out, err = capsys.readouterr()
    return info.value.code, out, err


def test_version_flag_and_attribute():
    from kvxfer import cli

    r = kvxfer("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"kvxfer {version('kvxfer')}" == f"kvxfer {cli.__version__}"


def test_help_keeps_bracketed_extras():
    r = kvxfer("plan", "--help", env={"COLUMNS": "200"})
    assert r.returncode == 0 and "kvxfer[viz]" in r.stdout


def test_explain_and_json_together_are_refused(capsys):
    code, out, err = main(capsys, "plan", SAMPLE, "--json", "--explain")
    assert code == 2 and out == "" and "choose one" in err and len(err.strip().splitlines()) == 1


def test_max_rows_all_and_zero_show_every_range(capsys):
    big = GOLDEN_DIR / "cap8192-65x128-fragmented-h2d-rocm7.16.json"
    full = main(capsys, "plan", big, "--explain", "--full")[1]
    assert main(capsys, "plan", big, "--explain", "--max-rows", "all")[1] == full
    assert main(capsys, "plan", big, "--explain", "--max-rows", "0")[1] == full
    assert len(main(capsys, "plan", big, "--explain", "--max-rows", "5")[1]) < len(full)


def test_run_accepts_case_plan_and_golden_files(capsys, tmp_path):
    g = golden.load(SAMPLE)
    case = g.case.save(tmp_path / "case.json")
    plan_json = g.plan.save(tmp_path / "plan.json")
    plan_npz = g.plan.save(tmp_path / "plan.npz")
    for path in (SAMPLE, case, plan_json, plan_npz):
        code, out, err = main(capsys, "run", path, "-e", "numpy", "--verify")
        assert code == 0 and repr(g.plan) in out and "verify: OK" in out, (path, err)
        assert max(map(len, (out + err).splitlines())) <= 300
    code, _, err = main(capsys, "run", plan_json, "-e", "numpy", "--max-descriptors", "4")
    assert code == 2 and "plan file, which runs as stored" in err


def test_diff_exit_codes(capsys, tmp_path):
    assert main(capsys, "diff", SAMPLE, SAMPLE)[0] == 0
    assert main(capsys, "diff", SAMPLE, GOLDEN_DIR / "cuda-12.8-runs8-h2d.json")[0] == 1
    (tmp_path / "empty.npz").write_bytes(b"")
    code, out, err = main(capsys, "diff", SAMPLE, tmp_path / "empty.npz")
    assert code == 2 and "empty.npz" in err and "Traceback" not in err and "Aborted" not in err


def test_every_problem_one_short_line_then_a_count(capsys, tmp_path):
    d = golden.load(SAMPLE).case.to_dict()
    d["layout"]["buffers"] = [{**b, "nbytes": True} for b in d["layout"]["buffers"]] * 3
    d["mapping"]["src_id"] = d["mapping"].pop("src_ids")
    path = tmp_path / "case.json"
    path.write_text(json.dumps(d))
    code, out, err = main(capsys, "plan", path)
    lines = err.strip().splitlines()
    n = len(d["layout"]["buffers"]) + 1
    assert code == 2 and lines[0] == f"kvxfer: error: {path}: {n} problems"
    assert len(lines) == 1 + 10 + 1 and lines[-1] == f"  ... and {n - 10} more"
    assert all(line.startswith("  layout.buffers[") for line in lines[1:11])
    assert "field required" not in err and "required key missing" not in err  # the typo is not reported twice
    code, _, err = main(capsys, "plan", _only_typo(tmp_path))
    assert code == 2 and "unknown key 'src_id' (did you mean 'src_ids'?)" in err and len(err.splitlines()) == 1


def _only_typo(tmp_path: Path) -> Path:
    d = golden.load(SAMPLE).case.to_dict()
    d["mapping"]["src_id"] = d["mapping"].pop("src_ids")
    path = tmp_path / "typo.json"
    path.write_text(json.dumps(d))
    return path


def test_no_multi_kilobyte_lines(capsys, tmp_path):
    d = json.loads(SAMPLE.read_text())
    d["case"]["layout"]["colour"] = list(range(2000))
    path = tmp_path / "g.json"
    path.write_text(json.dumps(d))
    code, out, err = main(capsys, "run", path, "-e", "numpy")
    assert code == 2 and "colour" in err and max(map(len, err.splitlines())) <= 300


def test_string_runtime_versions_in_case_files(capsys, tmp_path):
    d = golden.load(SAMPLE).case.to_dict()
    d["target"] = {"platform": "rocm", "runtime_version": "7.16"}
    path = tmp_path / "case.json"
    path.write_text(json.dumps(d))
    code, out, err = main(capsys, "plan", path, "--json")
    assert code == 0 and TransferPlan.from_json(out).target.label == "rocm-7.16"


# ---- golden commands --------------------------------------------------------------------------------------
@pytest.fixture
def folder(tmp_path) -> Path:
    f = tmp_path / "golden"
    f.mkdir()
    for name in ("cuda-13.0-runs8-h2d", "hip-7.16-runs8-h2d"):
        shutil.copy(GOLDEN_DIR / f"{name}.json", f)
    return f


def test_golden_check_prints_only_failures_and_a_summary(capsys, folder):
    code, out, _ = main(capsys, "golden", "check", folder)
    assert code == 0 and out.splitlines() == ["2 golden files: 2 ok, 0 failing"]
    (folder / "broken.json").write_text("[]")
    code, out, _ = main(capsys, "golden", "check", folder)
    lines = [line for line in out.splitlines() if not line.startswith(" ")]  # a long message continues indented
    assert code == 1 and len(lines) == 2 and lines[0].startswith("unreadable    broken.json: ")
    assert lines[1] == "3 golden files: 2 ok, 1 failing" and max(map(len, out.splitlines())) <= 80


def test_golden_commands_never_follow_links_out_of_their_folder(capsys, folder, tmp_path):
    outside = tmp_path / "outside.json"
    text = (folder / "cuda-13.0-runs8-h2d.json").read_text().replace('"nbytes": 262144', '"nbytes": 131072', 1)
    outside.write_text(text.replace("\n", "\n ", 3))  # a different formatting: update would rewrite it
    (folder / "link.json").symlink_to(outside)
    before = outside.read_bytes()
    code, out, _ = main(capsys, "golden", "check", folder)
    assert code == 1 and "outside       link.json" in out and "not followed" in out
    code, out, _ = main(capsys, "golden", "update", folder)
    assert code == 1 and "outside       link.json" in out and outside.read_bytes() == before


def test_golden_update_never_writes_through_a_link(capsys, folder):
    target = folder / "cuda-13.0-runs8-h2d.json"
    target.write_text(target.read_text().replace("\n", "\n ", 3))  # needs a rewrite
    (folder / "alias.json").symlink_to(target.name)
    before = target.read_bytes()
    with pytest.raises(golden.GoldenError, match="symbolic link"):
        golden.update_file(folder / "alias.json")
    assert target.read_bytes() == before
    code, out, _ = main(capsys, "golden", "update", folder)
    assert code == 1 and "alias.json" in out and "symbolic link" in out
    assert golden.load(target) and target.read_bytes() != before  # the real file itself is rewritten in place


# ---- demo and bench ---------------------------------------------------------------------------------------
def test_demo_fits_80_columns_without_cutting_numbers():
    r = kvxfer("demo", "--regions", "4", "--blocks", "32", env={"COLUMNS": "80"})
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert max(map(len, lines)) <= 80 and "…" not in r.stdout
    assert "hipMemcpyBatchAsync" in r.stdout and "cuMemcpyBatchAsync_v2" in r.stdout
    assert sum(line.rstrip().endswith("yes") for line in lines) == 15 + 5


def test_demo_hands_over_each_row_as_it_is_verified():
    from kvxfer.cli.demo import run_demo, run_layout_demo

    seen: list[dict] = []
    rows = run_demo(page_bytes=64, regions=2, blocks=16, on_row=seen.append)
    assert seen == rows and len(rows) == 15
    seen.clear()
    assert run_layout_demo(page_bytes=128, regions=2, blocks=16, on_row=seen.append) == seen


def test_bench_reports_progress(capsys, monkeypatch, tmp_path):
    from kvxfer.cli import bench

    calls = []
    for name in ("bench_plan", "bench_layouts", "bench_memory", "bench_executor"):
        monkeypatch.setattr(bench, name, lambda *a, _n=name, **k: calls.append(_n) or [])
    monkeypatch.setattr(bench, "format_tables", lambda res: "tables")
    code, out, err = main(capsys, "bench", "--quick", "--out", tmp_path / "r.json")
    assert code == 0 and len(calls) == 4 and "tables" in out
    assert [line.split("]")[0] for line in err.splitlines()] == ["[1/4", "[1/4", "[2/4", "[2/4", "[3/4", "[3/4",
                                                                  "[4/4", "[4/4"]


def test_diff_helpers_are_exported():
    from kvxfer.planner import diff_plans, equivalent

    g = golden.load(SAMPLE)
    assert not diff_plans(g.plan, Case.model_validate(g.case.to_dict()).plan()) and equivalent(g.plan, g.plan)


def test_golden_check_reports_and_prunes_unused_files(capsys, folder, tmp_path):
    code, _, err = main(capsys, "golden", "check", folder, "--prune")
    assert code == 2 and "no record" in err and len(list(folder.glob("*.json"))) == 2
    keep = tmp_path / "keep.json"
    keep.write_text("{}")
    (folder / "old-link.json").symlink_to(keep)
    golden.write_used(folder, ["cuda-13.0-runs8-h2d.json"])
    code, out, _ = main(capsys, "golden", "check", folder)
    assert "unused        hip-7.16-runs8-h2d.json" in out and "unused        old-link.json" in out
    assert "2 unused (--prune deletes them)" in out and (folder / "hip-7.16-runs8-h2d.json").exists()
    code, out, _ = main(capsys, "golden", "check", folder, "--prune")
    assert code == 0 and "deleted       hip-7.16-runs8-h2d.json" in out
    assert sorted(p.name for p in folder.glob("*.json")) == ["cuda-13.0-runs8-h2d.json"] and keep.exists()


def test_golden_check_on_an_empty_or_missing_folder_is_bad_input(capsys, tmp_path):
    assert main(capsys, "golden", "check", tmp_path)[0] == 2
    code, _, err = main(capsys, "golden", "update", tmp_path / "absent")
    assert code == 2 and "no such folder" in err
