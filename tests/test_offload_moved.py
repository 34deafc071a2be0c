"""Modules that moved into an offload wing keep their old dotted paths: importing one gives the module at its new
path (the same object), after a DeprecationWarning naming the new path and pointing at the importing line."""
from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import kvxfer.offload as offload

# the old paths whose modules need no vLLM to import (the connector's, spec's and tiers' classes subclass vLLM's)
NO_VLLM = [old for old, new in offload.MOVED.items() if new.rsplit(".", 1)[1] not in ("connector", "spec", "tiers")]


@pytest.mark.parametrize("old", NO_VLLM)
def test_an_old_path_imports_the_moved_module_with_a_warning_naming_the_new_path(old):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import {old}\nexcept DeprecationWarning as w:\n    print('WARNED', w)\n"
            f"warnings.simplefilter('ignore')\nimport {old} as a, {offload.MOVED[old]} as b\nprint(a is b, a.__name__)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    new = offload.MOVED[old]
    assert p.stdout.splitlines() == [f"WARNED {old} moved to {new}; import it from there", f"True {new}"]


def test_the_warning_points_at_the_line_that_imports_the_old_path():
    old = NO_VLLM[0]
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {offload.MOVED[old]}") as caught:
        importlib.import_module(old)
    assert caught[0].filename == __file__


def test_an_old_path_read_as_an_attribute_of_the_package_is_the_moved_module():
    sys.modules.pop("kvxfer.offload.file_tier", None)
    vars(offload).pop("file_tier", None)  # as before its first import
    with pytest.warns(DeprecationWarning):
        module = offload.file_tier  # type: ignore[attr-defined]
    assert module is importlib.import_module("kvxfer.offload.files.file_tier")


def test_every_moved_module_exists_at_its_new_path():
    for new in offload.MOVED.values():
        assert importlib.util.find_spec(new) is not None, new
