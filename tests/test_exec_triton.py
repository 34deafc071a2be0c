"""Triton executor: tile tables (pure numpy), byte-exact runs under the interpreter (in a subprocess, since
TRITON_INTERPRET must be set before triton is imported), and ahead-of-time compiles for sm_90 and gfx942."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors._ops_triton import launch_tables

TESTS = Path(__file__).parent
needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None or importlib.util.find_spec("torch") is None,
                                  reason="triton and torch are not installed (pip install 'kvxfer[triton,torch]')")


def test_tile_tables_cover_each_range_exactly():
    rng = np.random.default_rng(0)
    nbytes = rng.integers(1, 700, 50).astype(np.uint64)
    src = (rng.integers(1, 1 << 30, 50) * rng.choice([1, 2, 4, 8, 16], 50)).astype(np.uint64)
    dst = (rng.integers(1, 1 << 30, 50) * 16).astype(np.uint64)
    seen = []
    for g in launch_tables(src, dst, nbytes, 64):
        w = g["word"]
        assert np.all((g["src"] | g["dst"] | g["nbytes"].view(np.int64)) % w == 0)
        if g["align16"]:
            assert w == 8 and np.all((g["src"] | g["dst"] | g["nbytes"]) % 16 == 0)
        starts = g["tile_start"]
        assert np.all(starts % 64 == 0) and np.all(starts < g["nbytes"][g["tile_range"]])
        counts = np.bincount(g["tile_range"], minlength=len(g["nbytes"]))
        assert counts.tolist() == (-(-g["nbytes"] // 64)).tolist()  # one tile per started 64 bytes
        seen += list(zip(g["src"].tolist(), g["nbytes"].tolist()))
    assert sorted(seen) == sorted(zip(src.astype(np.int64).tolist(), nbytes.astype(np.int64).tolist()))


@needs_triton
@pytest.mark.parametrize("seed", [1, 2])
def test_interpreter_matches_numpy_byte_for_byte(seed):
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, str(TESTS / "shims" / "triton_interp_check.py"), str(seed)], env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(r.stdout.strip().splitlines()[-1])
    assert report["mismatches"] == []
    assert report["plans"] == 16 and report["ranges"] > 0
    assert set(report["widths"]) >= {"1", "2", "4", "8", "8a16"}  # every element width was exercised
    assert report["synchronous"] is True and report["after"] == [False] * 16  # copies began after each wait
    assert report["bad stream"].startswith("stream = <object object at ")


SIGNATURE = {"src_addr": "*i64", "dst_addr": "*i64", "nbytes": "*i64", "tile_range": "*i64", "tile_start": "*i64",
             "num_tiles": "i64", "ELEM": "constexpr", "WORD": "constexpr", "BLOCK": "constexpr", "ALIGN16": "constexpr"}


@needs_triton
@pytest.mark.parametrize("backend,arch,warp,binary", [("cuda", 90, 32, "cubin"), ("hip", "gfx942", 64, "hsaco")])
def test_compiles_ahead_of_time(backend, arch, warp, binary):
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set in this process; the compiler needs a JIT function")
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kvxfer.executors._triton_kernel import copy_ranges
    k = triton.compile(ASTSource(copy_ranges, signature=SIGNATURE, constexprs={
        "ELEM": tl.int64, "WORD": 8, "BLOCK": 1024, "ALIGN16": True}), target=GPUTarget(backend, arch, warp))
    assert len(k.asm[binary]) > 0
    if backend == "cuda":  # full aligned tiles use 128-bit accesses
        assert "ld.global.v2.b64" in k.asm["ptx"] and "st.global.v2.b64" in k.asm["ptx"]


@pytest.mark.gpu
def test_round_trip_on_gpu_and_refuses_pageable():
    from kvxfer.executors import BindingError, TritonExecutor
    from kvxfer.planner import plan_transfer, presets

    from .shims.cases import gpu_buffers, gpu_round_trip
    ex = TritonExecutor()
    layout = presets.kv_layout(4, 128, 4096)
    mem = gpu_buffers(layout)
    for direction in ("h2d", "d2h"):
        plan = plan_transfer(layout, presets.mapping("fragmented", 32, 128, direction), ex.target)
        gpu_round_trip(ex, plan, mem)
    pageable = dict(mem, cpu=mem["cpu"].clone())
    with pytest.raises(BindingError, match="pinned"):
        ex.run(plan, pageable)
