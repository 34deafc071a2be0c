"""Pinning helper: chunking on row boundaries, rollback on a failed chunk, unregister on close (the HIP
registrar on the HIP shim, and a Python fake registrar); the platform's driver chosen by default."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvxfer.executors import ExecutorError
from kvxfer.executors._pinning import MAX_CHUNK_BYTES, Registrar, chunk_bounds, hip_registrar, pin_host_memory
from kvxfer.planner import Platform

from .shims.build import ShimState, build, compiler


def test_chunk_bounds_end_on_rows():
    assert chunk_bounds(1000, 100, 350) == [(0, 300), (300, 300), (600, 300), (900, 100)]
    rows = 118 * 32 * 1024  # one block of 118 regions
    bounds = chunk_bounds(300 * 2**30, rows)
    assert all(size <= MAX_CHUNK_BYTES and size % rows == 0 for _, size in bounds[:-1])
    assert sum(s for _, s in bounds) == 300 * 2**30 and bounds[1][0] == bounds[0][1]
    with pytest.raises(ValueError, match="row_bytes = 400"):
        chunk_bounds(1000, 400, 350)


def _fake(fail_at: int | None = None):
    calls = []
    def register(addr, n):
        calls.append(("reg", addr, n))
        return 2 if len([c for c in calls if c[0] == "reg"]) - 1 == fail_at else 0
    def unregister(addr):
        calls.append(("unreg", addr))
        return 0
    return Registrar("fakeRegister", register, unregister, lambda c: f"E{c}"), calls


def test_failed_chunk_rolls_back_and_reports_pageable():
    mem = np.zeros(1000, dtype=np.uint8)
    base = mem.ctypes.data
    reg, calls = _fake(fail_at=2)
    region = pin_host_memory(mem, 100, reg, max_chunk_bytes=350)
    assert not region.pinned and region.chunks == []
    assert region.reason.startswith("fakeRegister failed on chunk 2 [600, +300): E2 (2); unregistered the 2 chunk(s)")
    assert calls == [("reg", base, 300), ("reg", base + 300, 300), ("reg", base + 600, 300),
                     ("unreg", base + 300), ("unreg", base)]


def test_success_and_close_unregisters():
    mem = np.zeros(1000, dtype=np.uint8)
    reg, calls = _fake()
    with pin_host_memory(mem, 100, reg, max_chunk_bytes=350) as region:
        assert region.pinned and len(region.chunks) == 4 and region.reason is None
    assert not region.pinned and [c[0] for c in calls] == ["reg"] * 4 + ["unreg"] * 4


@pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the HIP shim")
def test_with_hip_shim(tmp_path):
    lib = build("fake_hip", tmp_path)
    st = ShimState(ctypes.CDLL(str(lib)))
    st.reset()
    mem = np.zeros(4096, dtype=np.uint8)
    region = pin_host_memory(mem, 512, hip_registrar(library=lib), max_chunk_bytes=1024)
    assert region.pinned and st.registered == 4
    region.close()
    assert st.registered == 0
    st.reset()
    st.set(register_fail_at=1, register_fail_code=712)
    region = pin_host_memory(mem, 512, hip_registrar(library=lib), max_chunk_bytes=1024)
    assert not region.pinned and "hipErrorHostMemoryAlreadyRegistered (712)" in region.reason
    assert st.registered == 0 and [op for op, _, _ in st.log] == ["register", "register", "unregister"]


def test_pinning_on_rocm_goes_through_hip_host_register():
    """The default registrar is the platform's driver: on ROCm hipHostRegister (libamdhip64), never
    cudaHostRegister; here no HIP runtime loads, and the error says which libraries were tried."""
    from kvxfer.executors._ops_hip import load_hip

    try:
        load_hip()
    except ExecutorError:
        pass
    else:
        pytest.skip("a HIP runtime is installed: this checks what pinning on ROCm reports without one")
    mem = np.zeros(4096, dtype=np.uint8)
    with pytest.raises(ExecutorError, match="could not load the HIP runtime; tried libamdhip64.so"):
        pin_host_memory(mem, 512, platform=Platform.ROCM, max_chunk_bytes=1024)
