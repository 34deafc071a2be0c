"""Each planted bug under tests/planted/ is caught by the test named for it (``tests/planted/check.py``: the patch
applied to a copy of the checkout, its catching test run there, which must fail)."""
from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent / "planted"


def _check():
    spec = importlib.util.spec_from_file_location("planted_check", HERE / "check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_planted_patch_names_the_test_that_catches_it():
    assert sorted(p.name for p in HERE.glob("*.patch")) == sorted(_check().CATCHES)


@pytest.mark.parametrize("patch", sorted(p.name for p in HERE.glob("*.patch")))
def test_the_planted_bug_is_caught(patch):
    if shutil.which("git") is None or not (HERE.parents[1] / ".git").exists():
        pytest.skip("needs a git checkout (the copy is made from git ls-files)")
    ok, what = _check().caught(patch)
    assert ok, f"{patch}: {what}"
