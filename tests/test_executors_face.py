"""kvxfer.executors' face: public names flat in ``__all__``, five public submodules, every other module private,
and every import path the README or the API reference documented before the modules became private still
importing (an old submodule path with a DeprecationWarning naming ``kvxfer.executors``)."""
from __future__ import annotations

import importlib
import subprocess
import sys
import types
import warnings

import pytest

import kvxfer.executors as ex
from kvxfer.executors import _moved

PUBLIC_SUBMODULES = {"config", "file_trust", "nixl_memory", "nixl_peer", "torch_layout"}


def test_the_face_is_flat_names_and_five_public_submodules():
    subs = {n for n in ex.__all__ if isinstance(getattr(ex, n), types.ModuleType)}
    assert subs == PUBLIC_SUBMODULES
    assert not [n for n in ex.__all__ if n.startswith("_")]
    assert len(ex.__all__) == len(set(ex.__all__))


@pytest.mark.parametrize("old", sorted(_moved.MOVED))
def test_an_old_submodule_path_imports_the_private_module_with_a_deprecation_warning(old):
    code = (f"import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            f"try:\n    import kvxfer.executors.{old}\nexcept DeprecationWarning as e:\n    print(e)\n"
            f"warnings.simplefilter('ignore')\n"
            f"import kvxfer.executors.{old} as m, kvxfer.executors.{_moved.MOVED[old]} as p\n"
            f"print(m is p)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines() == [_moved.message(old), "True"]
    assert "import its public names from kvxfer.executors" in _moved.message(old)


def test_the_names_the_old_paths_documented_are_the_same_objects_and_flat():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from kvxfer.executors.binding import BoundMemory, bind
        from kvxfer.executors.lowering import Lowered
        from kvxfer.executors.memory import BindingError, RawMemory, resolve
        from kvxfer.executors.ops_numpy import NumpyExecutor
        from kvxfer.executors.options import CudaOptions
        from kvxfer.executors.pinning import pin_host_memory
    assert (BoundMemory, bind, Lowered, BindingError, RawMemory, resolve, NumpyExecutor, CudaOptions, pin_host_memory) == (
        ex.BoundMemory, ex.bind, ex.Lowered, ex.BindingError, ex.RawMemory, ex.resolve, ex.NumpyExecutor, ex.CudaOptions,
        ex.pin_host_memory)


def test_file_binding_lives_beside_the_file_trust_checks_and_keeps_its_old_path():
    from kvxfer.executors import file_trust, nixl_memory
    assert ex.FileBinding is file_trust.FileBinding is nixl_memory.FileBinding
    assert ex.FileBinding.__module__ == "kvxfer.executors.file_trust"


def test_importing_the_package_imports_no_deprecated_path_and_no_backend():
    code = ("import warnings; warnings.simplefilter('error', DeprecationWarning)\n"
            "import sys, kvxfer.executors as e\n"
            "[getattr(e, n) for n in e.__all__ if n not in ('CudaBatchExecutor', 'HipBatchExecutor', 'TritonExecutor', "
            "'NixlExecutor')]\n"
            "print(sorted(m for m in sys.modules if m.startswith('kvxfer.executors.') and not m.split('.')[-1].startswith('_')))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert set(eval(r.stdout)) <= {f"kvxfer.executors.{m}" for m in PUBLIC_SUBMODULES}


def test_the_registry_names_private_modules_that_exist():
    for b in ex.BACKENDS.values():
        assert b.module.startswith("_") and importlib.import_module(f"kvxfer.executors.{b.module}")


def test_the_readmes_architecture_section_names_every_executors_module_as_public_or_private():
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    text = (root / "docs" / "architecture.md").read_text()  # the README's architecture section, moved there
    section = text[text.index("# Architecture"):text.index("Inside `offload/`")]
    files = {p.stem for p in (root / "executors").glob("*.py") if p.stem != "__init__"}
    named = {m for m in files if f"`{m}`" in section}
    assert named == files, f"not in docs/architecture.md: {sorted(files - named)}"
    assert {m for m in files if not m.startswith("_")} == PUBLIC_SUBMODULES
