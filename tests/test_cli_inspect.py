"""kvxfer plan / diff / golden / schema through typer's runner, and as a subprocess for exit codes and errors."""
from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("typer", reason="the CLI needs the cli extra")
from typer.testing import CliRunner

from kvxfer.cli.main import build_app
from kvxfer.planner import (
    Case,
    PlanOptions,
    Target,
    TransferPlan,
    golden,
    hip_version,
    presets,
)

GOLDEN_DIR = Path(__file__).parent / "golden"


def make_case(minor: int = 16, **options) -> Case:
    return Case(layout=presets.kv_layout(3, 64, 4096), mapping=presets.mapping("runs8", 16, 64),
                target=Target(platform="rocm", runtime_version=hip_version(7, minor)), options=PlanOptions(**options))


@pytest.fixture
def cases(tmp_path):
    paths = {"716": tmp_path / "c716.json", "72": tmp_path / "c72.json", "single": tmp_path / "single.json"}
    make_case(16).save(paths["716"])
    make_case(2).save(paths["72"])
    make_case(16, coalesce=False).save(paths["single"])
    return paths


def invoke(*args: str):
    return CliRunner().invoke(build_app(), [str(a) for a in args])


def test_plan_summary_explain_json_stats(cases):
    plan = make_case(16).plan()
    r = invoke("plan", cases["716"])
    assert r.exit_code == 0 and repr(plan) in r.stdout and "hip>=7.16 prefer-ce: yes" in r.stdout
    assert "destination" not in r.stdout  # the summary has no range table
    r = invoke("plan", cases["716"], "--explain", "--full")
    assert r.exit_code == 0 and r.stdout == plan.explain(full=True, layout=make_case(16).layout)
    r = invoke("plan", cases["716"], "--json")
    assert TransferPlan.from_json(r.stdout) == plan
    r = invoke("plan", cases["716"], "--stats")
    assert json.loads(r.stdout)["ranges"] == plan.num_ranges


def test_plan_writes_html_and_png(cases, tmp_path):
    pytest.importorskip("matplotlib", reason="the transfer map needs the viz extra")
    html, png = tmp_path / "p.html", tmp_path / "p.png"
    r = invoke("plan", cases["716"], "--html", html, "--png", png)
    assert r.exit_code == 0, r.output
    assert "<table" in html.read_text() and "gpu.kv2:" in html.read_text()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_png_without_the_viz_extra_writes_nothing(cases, tmp_path):
    """Without matplotlib, --png is refused before the HTML (or anything else) is written."""
    html, png = tmp_path / "p.html", tmp_path / "p.png"
    code = ("import sys; sys.modules['matplotlib'] = None  # as if the viz extra were not installed\n"
            "from kvxfer.cli.main import main; main()")
    r = subprocess.run([sys.executable, "-c", code, "plan", str(cases["716"]), "--html", str(html), "--png", str(png)],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "pip install 'kvxfer[viz]'" in r.stderr and "Traceback" not in r.stderr
    assert not html.exists() and not png.exists()


def test_diff_exit_codes(cases, tmp_path):
    r = invoke("diff", cases["716"], cases["716"])
    assert r.exit_code == 0 and r.stdout.startswith("identical: TransferPlan(")
    r = invoke("diff", cases["72"], cases["716"])
    assert r.exit_code == 1
    assert ("target rocm-7.2 -> rocm-7.16, ranges 6 -> 6, calls 1 -> 1, bytes equal,\n"
            "  attrs: flags 0x0 -> 0x100, passed no -> yes, same bytes moved\n" in r.stdout)  # wrapped at 80
    r = invoke("diff", cases["716"], cases["single"], "--max-rows", "4")
    assert r.exit_code == 1 and "changed ranges not shown" in r.stdout
    assert invoke("diff", cases["716"], cases["single"], "--equivalent").exit_code == 0
    # a plan file and a case file compare
    plan_file = tmp_path / "p.npz"
    make_case(16).plan().save(plan_file)
    assert invoke("diff", plan_file, cases["716"]).exit_code == 0


def test_golden_check_and_update(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    for name in ("hip-7.16-runs8-h2d", "cuda-13.0-runs8-h2d"):
        shutil.copy(GOLDEN_DIR / f"{name}.json", folder)
    r = invoke("golden", "check", folder)
    assert r.exit_code == 0 and "2 golden files: 2 ok, 0 failing" in r.stdout
    g = golden.load(folder / "hip-7.16-runs8-h2d.json")
    golden.save(folder / "hip-7.16-runs8-h2d.json", g.case, Case(**{**dict(g.case), "options": PlanOptions(
        coalesce=False)}).plan())
    r = invoke("golden", "check", folder, "-v")
    assert r.exit_code == 1 and "differs       hip-7.16-runs8-h2d.json" in r.stdout and "same bytes moved" in r.stdout
    r = invoke("golden", "update", folder)
    assert r.exit_code == 0 and "updated       hip-7.16-runs8-h2d.json" in r.stdout
    assert "1 of 2 golden file(s) rewritten" in r.stdout
    assert invoke("golden", "check", folder).exit_code == 0


def test_one_broken_golden_file_does_not_stop_the_others(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    for name in ("a-hip-7.16", "c-cuda-13.0"):
        shutil.copy(GOLDEN_DIR / f"{name[2:]}-runs8-h2d.json", folder / f"{name}.json")
    text = (folder / "a-hip-7.16.json").read_text()
    (folder / "b-broken.json").write_text(text.replace('"nbytes": 262144', '"nbytes": -5', 1))
    r = invoke("golden", "check", folder)
    assert r.exit_code == 1 and "unreadable    b-broken.json" in r.stdout and "c-cuda-13.0.json" not in r.stdout
    assert "3 golden files: 2 ok, 1 failing" in r.stdout and "rewrites" not in r.stdout
    r = invoke("golden", "update", folder)
    assert r.exit_code == 1 and "unreadable    b-broken.json" in r.stdout and "c-cuda-13.0.json" not in r.stdout
    assert "0 of 3 golden file(s) rewritten, 1 could not be read or written" in r.stdout


def test_project_goldens_check_clean():
    r = invoke("golden", "check", GOLDEN_DIR)
    assert r.exit_code == 0, r.stdout


def test_schema_is_the_case_schema(tmp_path):
    r = invoke("schema", "--json")
    assert json.loads(r.stdout) == Case.json_schema()
    outline = invoke("schema").stdout  # the readable form: every definition and field of the schema, named
    schema = Case.json_schema()
    for name, d in schema["$defs"].items():
        assert f"\n{name}: " in outline
        for field in d.get("properties", {}):
            assert f"    {field} " in outline, (name, field)
    out = tmp_path / "s.json"
    assert invoke("schema", "--out", out).exit_code == 0 and json.loads(out.read_text()) == Case.json_schema()


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", "from kvxfer.cli.main import main; main()", *map(str, args)],
                          capture_output=True, text=True)


def test_subprocess_exit_codes_and_one_line_errors(cases, tmp_path):
    assert run("diff", cases["716"], cases["716"]).returncode == 0
    assert run("diff", cases["72"], cases["716"]).returncode == 1
    bad = tmp_path / "bad.json"
    bad.write_text('{"layout": {"buffers": [], "regions": []}, "mapping": {"direction": "sideways", '
                   '"src_ids": [], "dst_ids": []}}')
    for args, message in [(("plan", tmp_path / "missing.json"), "no such file"),
                          (("plan", bad), "mapping.direction"),
                          (("diff", cases["716"], tmp_path / "missing.json"), "no such file"),
                          (("golden", "check", tmp_path / "nowhere"), "no such folder")]:
        r = run(*args)
        assert r.returncode == 2, (args, r.stderr)
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1 and message in r.stderr
        assert r.stderr.startswith("kvxfer: error: ")
