"""`make demo` and `make test` install what each command uses, with pip's progress shown (dry runs of make)."""
from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")


def dry_run(target: str, tmp_path: Path) -> list[str]:
    """The commands ``make TARGET`` would run on a fresh clone (a .venv that does not exist yet)."""
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}  # under `make test`
    out = subprocess.run(["make", "--no-print-directory", "-n", target, f"VENV={tmp_path / 'venv'}"], cwd=ROOT,
                         capture_output=True, text=True, check=True, env=env).stdout
    return out.splitlines()


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if " -m pip install " in line]


def extras(lines: list[str]) -> set[str]:
    found = set()
    for line in installs(lines):
        for group in re.findall(r'-e "\.\[([^\]]*)\]"', line):
            found |= set(group.split(","))
    return found


def test_demo_installs_the_cli_extra_only(tmp_path):
    lines = dry_run("demo", tmp_path)
    assert extras(lines) == {"cli"}
    assert not any("torch" in line or "triton" in line or "nixl" in line for line in installs(lines))
    assert lines[-2].endswith("kvxfer demo") and lines[-1].endswith("python examples/offload_loop.py")


def test_test_installs_every_extra_the_tests_exercise_with_torch_pinned(tmp_path):
    lines = dry_run("test", tmp_path)
    assert {"dev", "cli", "torch", "triton", "cuda", "nixl", "viz"} <= extras(lines)
    torch_lines = [line for line in installs(lines) if "torch" in line]
    assert torch_lines and all('"torch==2.13.0"' in line for line in torch_lines)
    assert "pytest" in lines[-1]


@pytest.mark.parametrize("target", ["demo", "test"])
def test_installs_show_progress(tmp_path, target):
    for line in installs(dry_run(target, tmp_path)):
        assert not re.search(r"\s-q\b|--quiet", line), f"pip runs silently: {line}"


def test_the_extras_used_exist_in_pyproject(tmp_path):
    defined = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    assert extras(dry_run("test", tmp_path)) | extras(dry_run("demo", tmp_path)) <= defined
