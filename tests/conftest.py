"""Shared test setup: hypothesis profiles, device-test skipping and a scratch directory on disk."""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest

from .budget import EXAMPLES, PROFILE

try:
    from hypothesis import HealthCheck, settings

    for _name, _count in EXAMPLES.items():
        settings.register_profile(_name, max_examples=_count, deadline=None,
                                  suppress_health_check=[] if _name == "dev" else [HealthCheck.too_slow])
    settings.load_profile(PROFILE)
except ImportError:  # hypothesis is in the dev extra
    pass


def _has_cuda() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.version.hip is None
    except ImportError:
        return False


def _has_rocm() -> bool:
    try:
        import torch
        return torch.cuda.is_available() and torch.version.hip is not None
    except ImportError:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    skip_gpu = None if _has_cuda() else pytest.mark.skip(reason="no NVIDIA GPU visible to torch on this machine")
    skip_rocm = None if _has_rocm() else pytest.mark.skip(reason="no AMD GPU visible to torch on this machine")
    for item in items:  # markers, not keywords: a keyword also matches a folder named "gpu" above the tests
        if skip_gpu and item.get_closest_marker("gpu"):
            item.add_marker(skip_gpu)
        if skip_rocm and item.get_closest_marker("rocm"):
            item.add_marker(skip_rocm)


@pytest.fixture
def disk():
    """A directory on a real disk (O_DIRECT works there; tmpfs refuses it), removed afterwards."""
    d = Path(tempfile.mkdtemp(prefix="kvxfer-test-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["numpy passes", "compiled pass", "compiled, two threads"])
def lowering_path(request, monkeypatch):
    """A test using it runs on each way lowering adds bases and bounds them: numpy's passes, the compiled pass
    (``_lower_kernel``, where numba is installed), and the compiled pass with the two sides on two threads."""
    from kvxfer.executors import _binding, _lower_kernel
    from kvxfer.executors import _lowering as lowering
    if request.param == "numpy passes":
        monkeypatch.setattr(_binding, "load_add_bounded", lambda: None)
    elif _lower_kernel.load() is None:
        pytest.skip("numba is not installed (pip install 'kvxfer[fast]')")
    if request.param == "compiled, two threads":
        monkeypatch.setattr(lowering, "TWO_THREADS", 0)
    return request.param
