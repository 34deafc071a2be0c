"""Executor conformance: every executor that runs here passes the same checks (tests/shims/conformance.py).

Executors: NumPy; CUDA batch on the C shim with the 13.0 and 12.8 ABIs and the per-range path (12.4); HIP
batch on the C shim (7.16); Triton under the interpreter (in a fresh process, since TRITON_INTERPRET must be
set before triton is imported); NIXL over UCX loopback (two agents in this process).
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .shims import conformance
from .shims.build import build, compiler
from .shims.conformance import CHECKS, NixlAdapter, NumpyAdapter, Skip

TESTS = Path(__file__).parent
SHIMS = ["cuda-13.0-shim", "cuda-12.8-shim", "cuda-per-range-shim", "hip-7.16-shim"]
EXECUTORS = ["numpy", *SHIMS, "nixl-loopback", "triton-interpreter"]


@pytest.fixture(scope="module")
def shim_libs(tmp_path_factory):
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shims")
    d = tmp_path_factory.mktemp("conformance_shims")
    return str(build("fake_cuda", d)), str(build("fake_hip", d))


@pytest.fixture(scope="module")
def triton_results():
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None:
        pytest.skip("triton and torch are not installed (pip install 'kvxfer[triton,torch]')")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS.parent), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "tests.shims.conformance", "triton"], env=env, cwd=TESTS.parent,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def _adapter(name, shim_libs):
    if name == "numpy":
        return NumpyAdapter()
    if name == "nixl-loopback":
        for k, v in {"UCX_TLS": "self,sm,tcp", "UCX_NET_DEVICES": "lo"}.items():
            os.environ.setdefault(k, v)  # loopback only; before nixl loads UCX
        pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install 'kvxfer[nixl]')")
        return NixlAdapter()
    return conformance.shim_adapters(*shim_libs)[name]()


@pytest.mark.parametrize("check", list(CHECKS))
@pytest.mark.parametrize("executor", EXECUTORS)
def test_conformance(executor, check, request):
    if executor == "triton-interpreter":
        result = request.getfixturevalue("triton_results")[check]
        if result.startswith("skip: "):
            pytest.skip(result[6:])
        assert result == "pass", result
        return
    libs = request.getfixturevalue("shim_libs") if executor in SHIMS else None
    adapter = _adapter(executor, libs)
    try:
        CHECKS[check](adapter)
    except Skip as e:
        pytest.skip(str(e))
    finally:
        adapter.close()
