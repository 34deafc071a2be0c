"""benchmarks/bench_hostpath.py stays runnable and its baseline builds what vLLM's worker builds (no timings
are asserted: the figures live in benchmarks/NOTES.md)."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np

from .shims.build import compiler

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "bench_hostpath.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_hostpath", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


def test_baseline_enumerates_sub_blocks_with_skip_as_the_worker_does():
    b = _bench()
    # chunks [3, 7, 9], k = 4, count 10, skip 2 -> canonical pages [14, 15, 28..31, 36..39] (page = 1 byte)
    t = b.TensorAddrs(gpu_base=1000, cpu_base=0, cpu_row_stride=4, page_bytes=1, k=4)
    job = b.Job(b.Direction.H2D, np.arange(10), np.array([3, 7, 9]), k=4, skip=2)
    src, dst, size = b.vllm_style_descriptors([t], job, b.DescriptorPool(), [10], [2])
    assert src.tolist() == [14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    assert dst.tolist() == list(range(1000, 1010)) and size.tolist() == [1] * 10
    # a store with two writers keeps the pages whose canonical id % 2 == writer_index, on both sides
    store = b.Job(b.Direction.D2H, np.arange(10), np.array([3, 7, 9]), k=4, skip=2)
    src, dst, _ = b.vllm_style_descriptors([t], store, b.DescriptorPool(), [10], [2], num_writers=2, writer_index=1)
    assert dst.tolist() == [15, 29, 31, 37, 39] and src.tolist() == [1001, 1003, 1005, 1007, 1009]


def test_run_based_build_emits_one_descriptor_per_run_per_tensor():
    b = _bench()
    tensors = [b.TensorAddrs(gpu_base=g, cpu_base=c, cpu_row_stride=8, page_bytes=8, k=1) for g, c in ((0, 500), (100, 900))]
    job = b.Job(b.Direction.H2D, np.array([0, 1, 2, 7, 8]), np.array([4, 5, 6, 1, 2]), k=1)
    src, dst, size = b.run_based_descriptors(tensors, job)
    assert src.tolist() == [532, 508, 932, 908]
    assert dst.tolist() == [0, 56, 100, 156]
    assert size.tolist() == [24, 16, 24, 16]


def test_the_script_runs_every_shape_and_checks_it_against_the_baseline():
    out = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--tensors", "3", "--sizes", "16",
                          "--c32-blocks", "32"], capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert out.returncode == 0, out.stderr
    rows = [line for line in out.stdout.splitlines() if line.startswith("3x16 ")]
    assert len(rows) == 2 * 3 * 2  # k in (1, 4) x 3 patterns x 2 directions
    assert "lower[numpy]:" in out.stdout
    assert ("lower[cuda-shim]:" in out.stdout) == (compiler() is not None)  # the shim needs a C compiler
    assert "3x32 fragmented h2d" in out.stdout and "run-based build" in out.stdout
