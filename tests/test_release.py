"""A release a user can install: the version in pyproject.toml is the one ``kvxfer --version`` prints and the
package metadata holds; a wheel built from the repository (``python -m build``) carries every package and runs the
demo from outside the source tree; the changelog has a section for the version."""
from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]


def test_the_changelog_has_a_section_for_this_version():
    assert re.search(rf"^## \[{re.escape(VERSION)}\]", (ROOT / "CHANGELOG.md").read_text(), re.M)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if importlib.util.find_spec("build") is None or importlib.util.find_spec("build.__main__") is None:
        pytest.skip("the build package is not installed (the dev extra has it)")
    out = tmp_path_factory.mktemp("dist")
    r = subprocess.run([sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
                       cwd=out, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    (whl,) = out.glob("kvxfer-*.whl")
    return whl


def test_the_wheel_is_this_version_and_carries_every_package(wheel: Path):
    assert wheel.name.startswith(f"kvxfer-{VERSION}-")
    names = zipfile.ZipFile(wheel).namelist()
    packages = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    for pkg in packages:
        assert f"{pkg.replace('.', '/')}/__init__.py" in names, pkg
    assert "kvxfer/testing/llama.py" in names and "kvxfer/offload/vllm/logs.py" in names
    assert any(n.endswith("entry_points.txt") for n in names)


def test_the_installed_wheel_says_its_version_and_runs_the_demo(wheel: Path, tmp_path: Path):
    pytest.importorskip("typer", reason="the demo is the kvxfer command (the cli extra)")
    site = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    env = dict(os.environ, PYTHONPATH=str(site))  # ahead of this checkout's editable install
    probe = ("import importlib.metadata as m, kvxfer.cli as c, kvxfer.planner as p; "
             "print(m.version('kvxfer'), c.__version__, p.__file__)")
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    meta, cli, where = out.stdout.split()
    assert meta == cli == VERSION and where.startswith(str(site)), out.stdout + out.stderr
    v = subprocess.run([sys.executable, "-m", "kvxfer.cli", "--version"], cwd=tmp_path, env=env, capture_output=True,
                       text=True, timeout=120)
    assert v.stdout.strip() == f"kvxfer {VERSION}"
    demo = subprocess.run([sys.executable, "-m", "kvxfer.cli", "demo"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=600)
    assert demo.returncode == 0, demo.stdout[-3000:] + demo.stderr[-3000:]
