"""Every command's output fits an 80-column terminal (COLUMNS=80), help shows no ``<bool>`` after flags, the
hints name what works where they are read, and ``kvxfer --version`` / ``--help`` load no planner.

Machine-readable output (``plan --json``, ``schema --json``) is JSON for programs and is checked for being
valid JSON instead: a 64-digit fingerprint cannot be broken.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("typer", reason="the CLI needs the cli extra")

from kvxfer.planner import Case, PlanOptions, Target, golden, hip_version, presets

from .notebook import cell_html

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
WIDTH = 80
# goldens with the longest names, targets and tables: what is widest to print
WIDE = ["kimi-61x135-fragmented-h2d-rocm7.2.2-cap4096.json", "hip-7.13-26193-runs8-h2d.json",
        "layout-tp2-rank1-fragments-d2h-writers2-cuda13.json", "layout-mixed-writers-d2h-cuda13.json",
        "cap8192-65x128-fragmented-h2d-rocm7.16.json", "layout-aliased-regions-d2h-cuda13.json"]


def kvxfer(*args: object, columns: int = WIDTH) -> subprocess.CompletedProcess:
    """The CLI in a child process, as a terminal of ``columns`` columns would run it."""
    env = {**os.environ, "COLUMNS": str(columns), "TERM": "xterm"}
    return subprocess.run([sys.executable, "-c", "from kvxfer.cli.main import main; main()", *map(str, args)],
                          capture_output=True, text=True, env=env, timeout=300)


def assert_fits(r: subprocess.CompletedProcess, what: str) -> None:
    wide = [line for line in (r.stdout + r.stderr).splitlines() if len(line) > WIDTH]
    assert not wide, f"{what}: {len(wide)} lines wider than {WIDTH}, e.g. {wide[0]!r} ({len(wide[0])})"


@pytest.fixture(scope="module")
def cases(tmp_path_factory) -> dict[str, Path]:
    """Case files whose diffs differ in everything a summary names."""
    d = tmp_path_factory.mktemp("cases")
    layout = presets.kv_layout(3, 64, 4096)
    load = Case(layout=layout, mapping=presets.mapping("runs8", 24, 64),
                target=Target(platform="rocm", runtime_version=hip_version(7, 2, 53211)))
    store = Case(layout=layout, mapping=presets.mapping("fragmented", 20, 64, "d2h"),
                 target=Target(platform="cuda", runtime_version=12080),
                 options=PlanOptions(max_descriptors=4, prefer_overlap_with_compute=True, max_range_bytes=8192))
    return {"load": load.save(d / "load.json"), "store": store.save(d / "store.json")}


def _commands() -> list[list[str]]:
    """Every command path of the app: [], ["plan"], ..., ["golden", "check"]."""
    from typer.main import get_command

    from kvxfer.cli.main import build_app

    out: list[list[str]] = []

    def walk(cmd, path):
        out.append(path)
        for name, sub in sorted(getattr(cmd, "commands", {}).items()):
            walk(sub, [*path, name])

    walk(get_command(build_app()), [])
    return out


@pytest.mark.parametrize("path", _commands(), ids=lambda p: " ".join(p) or "kvxfer")
def test_help_fits_and_shows_no_bool_type_after_flags(path):
    r = kvxfer(*path, "--help")
    assert r.returncode == 0, r.stderr
    assert_fits(r, f"kvxfer {' '.join(path)} --help")
    assert "<bool>" not in r.stdout and "--help" in r.stdout


@pytest.mark.parametrize("name", WIDE)
def test_plan_views_fit(name):
    path = GOLDEN_DIR / name
    for args in ([], ["--explain"], ["--explain", "--full"], ["--stats"]):
        r = kvxfer("plan", path, *args)
        assert r.returncode == 0, r.stderr
        assert_fits(r, f"kvxfer plan {name} {' '.join(args)}")
    r = kvxfer("plan", path, "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["fingerprint"]


def test_diff_of_plans_that_differ_in_everything_fits(cases):
    r = kvxfer("diff", cases["load"], cases["store"])
    assert r.returncode == 1, r.stderr
    assert_fits(r, "kvxfer diff")
    summary = r.stdout.splitlines()[2:]
    assert "direction h2d -> d2h" in summary[0] and summary[1].startswith("  ")  # wrapped, continued indented
    assert "... " in r.stdout and "changed ranges not shown (--full shows all) ..." in r.stdout  # the CLI's hint
    every = kvxfer("diff", cases["load"], cases["store"], "--full")  # and the hint holds
    assert "not shown" not in every.stdout and len(every.stdout.splitlines()) > len(r.stdout.splitlines())


def test_golden_commands_fit(tmp_path):
    folder = tmp_path / "golden"
    folder.mkdir()
    for name in WIDE:
        shutil.copy(GOLDEN_DIR / name, folder / name)
    g = golden.load(folder / WIDE[1])  # a stored plan that no longer matches its case
    golden.save(folder / WIDE[1], g.case, Case(**{**dict(g.case), "options": PlanOptions(coalesce=False)}).plan())
    (folder / "unreadable-file-with-a-rather-long-name-for-a-golden.json").write_text("[]")
    golden.write_used(folder, WIDE[2:])
    for args in (["check", folder], ["check", folder, "-v"], ["update", folder]):
        r = kvxfer("golden", *args)
        assert r.returncode == 1, r.stderr
        assert_fits(r, f"kvxfer golden {' '.join(map(str, args))}")
    r = kvxfer("golden", "check", folder, "-v")
    assert "changed ranges not shown (--max-rows all shows all)" in r.stdout or "not shown" not in r.stdout


def test_schema_outline_fits_and_the_json_schema_is_valid():
    r = kvxfer("schema")
    assert r.returncode == 0 and "BlockMapping:" in r.stdout
    assert_fits(r, "kvxfer schema")
    assert json.loads(kvxfer("schema", "--json").stdout) == Case.json_schema()


def test_run_output_fits(cases):
    r = kvxfer("run", cases["load"], "-e", "numpy", "--verify", "--explain-executor")
    assert r.returncode == 0 and "verify: OK" in r.stdout, r.stderr
    assert_fits(r, "kvxfer run")


def test_demo_output_fits():
    r = kvxfer("demo", "--regions", "4", "--blocks", "32")
    assert r.returncode == 0, r.stderr
    assert_fits(r, "kvxfer demo")


def test_bench_tables_fit(monkeypatch, tmp_path, capsys):
    """The tables with the widest values the benchmarks produce (1.9M copies, multi-second timings)."""
    from kvxfer.cli import bench
    from kvxfer.cli.main import main

    plan_row = {"case": "118x16128 interleaved", "requested": 1903104, "ranges": 1903104, "calls": 233,
                "plan_ms": 12345.678, "naive_ms": 1234.567, "ratio": 123.456}
    monkeypatch.setattr(bench, "bench_plan", lambda full=True: [plan_row])
    monkeypatch.setattr(bench, "bench_layouts", lambda: [plan_row | {"case": "118x256 tp2 fragments contiguous"}])
    monkeypatch.setattr(bench, "bench_memory", lambda: {"case": "118x16128 fragmented", "peak_mb": 12345.6,
                                                       "plan_arrays_mb": 1234.5, "dense_columns_mb": 99999.9,
                                                       "ratio": 10.0})
    monkeypatch.setattr(bench, "bench_executor", lambda: [{
        "case": "118x256 interleaved", "ranges": 30208, "bytes": 989855744, "exec_ms": 99999.99, "memcpy_ms": 9999.99,
        "speed_vs_memcpy": 99.99, "ranges_memmove_ms": 99999.99, "speed_vs_ranges": 99.99, "exec_gbps": 999.9}])
    with pytest.raises(SystemExit) as e:
        main(["bench", "--quick", "--out", str(tmp_path / "r.json")])
    out, err = capsys.readouterr()
    assert e.value.code == 0
    wide = [line for line in (out + err).splitlines() if len(line) > WIDTH]
    assert not wide, wide
    assert "1903104" in out and "99999.99" in out  # nothing cut


def test_hints_name_what_works_where_they_are_read():
    from kvxfer.planner import diff_plans, plan_transfer, render

    layout = presets.kv_layout(2, 128, 4096)
    a = plan_transfer(layout, presets.mapping("runs8", 48, 128))
    b = plan_transfer(layout, presets.mapping("fragmented", 48, 128))
    assert "(full=True shows all)" in a.explain(max_rows=4)  # an argument of the call that printed it
    assert "(plan.explain(full=True) shows all)" in cell_html(b)  # a notebook cell shows the plan itself
    assert "(text(max_rows=None) shows all)" in diff_plans(a, b).text(max_rows=4)
    assert "(print(diff.text(max_rows=None)) shows all)" in diff_plans(a, b).to_html(max_rows=4)
    assert "(--full shows all)" in render.explain(a, max_rows=4, hint="--full shows all")
    r = kvxfer("plan", GOLDEN_DIR / WIDE[0], "--explain")
    assert "ranges not shown (--full shows all)" in r.stdout and "full=True" not in r.stdout


@pytest.mark.parametrize("args", [["--version"], ["--help"], ["plan", "--help"]])
def test_version_and_help_load_no_planner_and_no_numpy(args):
    code = f"from kvxfer.cli.main import main; main({args!r})"
    r = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    loaded = {line.split("|")[-1].strip() for line in r.stderr.splitlines() if line.startswith("import time:")}
    assert not {m for m in loaded if m.startswith("kvxfer.planner")}, "the planner was imported"
    assert "numpy" not in loaded
