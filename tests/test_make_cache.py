"""`make test` fetches the GPU image's wheels and the image's triton once per machine: a fresh clone copies them from
the cache (``KVXFER_CACHE``) without a download; a failed download leaves nothing behind (the tests that need it
skip), and the next run tries again."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(shutil.which("make") is None, reason="needs make")


def make(clone: Path, cache: Path, *targets: str) -> subprocess.CompletedProcess[str]:
    # PY=false: any download or install attempted fails, so a success means the cache served it
    shutil.copy(ROOT / "Makefile", clone / "Makefile")
    return subprocess.run(["make", *targets, f"KVXFER_CACHE={cache}", "PY=false"],
                          cwd=clone, capture_output=True, text=True, timeout=120)


def test_a_fresh_clone_takes_the_wheels_and_triton_from_the_cache(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    wheels = cache / "wheels-pydantic-2.13.4-py3.12-3.11"
    triton = cache / "triton-aot-triton-3.6.0"
    for folder in (wheels, triton):
        folder.mkdir(parents=True)
        (folder / ".complete").touch()
    (wheels / "pydantic-2.13.4-cp312-none-any.whl").write_text("a wheel")
    (triton / "triton").mkdir()
    clone = tmp_path / "clone"
    clone.mkdir()
    r = make(clone, cache, "wheels", "triton-aot")
    assert r.returncode == 0, r.stdout + r.stderr
    assert (clone / ".whl" / "pydantic-2.13.4-cp312-none-any.whl").read_text() == "a wheel"
    assert (clone / ".whl" / ".complete").is_file()
    assert (clone / "build" / "triton-aot" / "triton").is_dir()


def test_a_failed_fetch_leaves_nothing_and_is_tried_again(tmp_path: Path) -> None:
    cache, clone = tmp_path / "cache", tmp_path / "clone"
    clone.mkdir()
    r = make(clone, cache, "wheels", "triton-aot")
    assert r.returncode == 0, r.stdout + r.stderr  # offline: make test still runs
    assert not (clone / ".whl" / ".complete").exists() and not (clone / "build" / "triton-aot").exists()
    assert not list(cache.glob("*/.complete"))
