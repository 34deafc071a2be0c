"""The GPU check without a GPU: its figures and byte check (pure), every section run on the CPU over the CUDA
driver shim, the launcher's offline install on a fresh interpreter, and the copy kernel compiled for sm_90 under
the GPU image's triton."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import Target, plan_transfer, presets

from .shims.build import build, compiler

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check  # noqa: E402

needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


# ---- figures ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("pattern,shared", [("runs8", True), ("fragmented", False), ("descending", True)])
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_unit_map_moves_exactly_the_planned_bytes(pattern, shared, direction):
    layout = presets.kv_layout(3, 32, 96, shared_device=shared)
    plan = plan_transfer(layout, presets.mapping(pattern, 12, 32, direction, seed=3), Target())
    rng = np.random.default_rng(0)
    bufs = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers}
    want = {k: v.copy() for k, v in bufs.items()}
    NumpyExecutor().run(plan, want)
    unit, cells = gpu_check.unit_map(plan)
    assert unit >= 32 and all(b.nbytes % unit == 0 for b in plan.buffers)
    got = {k: v.copy() for k, v in bufs.items()}
    for d, by_src in cells.items():
        out = got[plan.buffers[d].name].reshape(-1, unit)
        for s, (dst_cells, src_cells) in by_src.items():
            out[dst_cells] = bufs[plan.buffers[s].name].reshape(-1, unit)[src_cells]
    assert all(np.array_equal(got[k], want[k]) for k in want)


@needs_torch
def test_byte_check_catches_a_wrong_byte_and_a_stray_write():
    import torch
    ck = gpu_check.Check(gpu_check.Device(torch, gpu=False), gpu_check.CPU, None)
    ck.executors = {"dma": NumpyExecutor()}
    layout = presets.kv_layout(2, 16, 256, shared_device=True)
    plan = plan_transfer(layout, presets.mapping("runs8", 6, 16, "h2d"), Target())
    mem = ck.dev.memory(plan, seed=1)
    row = gpu_check.measured(ck, NumpyExecutor(), plan, mem, seed=2)
    assert row["bytes_ok"] and len(row["copy_ms"]["samples"]) == ck.sizes.reps
    before = gpu_check.scramble(ck, plan, mem, seed=3)
    NumpyExecutor().run(plan, mem)
    assert gpu_check.check_bytes(ck, plan, mem, before)
    written = int(plan.dst_offset[0])
    mem["gpu"][written] ^= 1
    assert not gpu_check.check_bytes(ck, plan, mem, before)
    mem["gpu"][written] ^= 1
    untouched = next(i for i in range(0, mem["gpu"].numel(), 256)
                     if not ((plan.dst_offset <= i) & (i < plan.dst_offset + plan.nbytes)).any())
    mem["gpu"][untouched] ^= 1
    assert not gpu_check.check_bytes(ck, plan, mem, before)


@needs_torch
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_c32_check_catches_a_copy_undone_a_wrong_page_and_a_stray_write(direction):
    import torch
    ck = gpu_check.Check(gpu_check.Device(torch, gpu=False), gpu_check.CPU, None)
    entry = gpu_check.c32_plans(Target(), gpu_check.CPU, merged_only=True)[f"{direction} runs8 merged"]
    page = gpu_check.CPU.c32[3]
    dst_page = int(entry[2][0])

    def spoiled(spoil):
        class Spoiled(NumpyExecutor):
            def run(self, plan, memory, stream=None, after=None):
                dst = ck.c32.mem["gpu" if direction == "h2d" else "cpu"]
                before = dst.clone()
                done = super().run(plan, memory, stream, after)
                spoil(dst, before)
                return done
        return Spoiled()

    def undo(dst, before):
        dst.copy_(before)

    def wrong_page(dst, before):
        dst[dst_page * page + 5] ^= 1

    def stray(dst, before):
        dst[3] ^= 1  # page 0 of region 0: a sentinel page

    assert gpu_check.c32_run(ck, NumpyExecutor(), "clean", entry, 0, 1)["bytes_ok"]
    for spoil in (undo, wrong_page, stray):
        assert not gpu_check.c32_run(ck, spoiled(spoil), spoil.__name__, entry, 0, 2)["bytes_ok"], spoil.__name__
    assert gpu_check.c32_run(ck, NumpyExecutor(), "clean again", entry, 1, 3)["bytes_ok"]


@needs_torch
def test_host_fill_through_the_device_covers_every_chunk():
    import torch
    dev = gpu_check.Device(torch, gpu=False)
    t = torch.zeros(10_000, dtype=torch.uint8)
    g = torch.Generator()
    g.manual_seed(0)
    dev.fill_through(t, g, chunk=4096)  # 2 full chunks and a partial one
    chunks = t.split(4096)
    assert len(chunks) == 3 and all(int((c != 0).sum()) > 0.9 * c.numel() for c in chunks)
    assert len(set(bytes(c[:64].tolist()) for c in chunks)) == 3  # each chunk drew new bytes


def test_overlap_counts_only_what_ran_together():
    copies = [(10.0, 30.0, 2 * 10**9), (30.0, 50.0, 2 * 10**9)]  # 100 GB/s each
    ops = [(0.0, 8.0, 4), (8.0, 16.0, 2), (16.0, 28.0, 3), (28.0, 40.0, 3), (40.0, 60.0, 4)]
    r = gpu_check.overlap_figures(copies, ops, alone_op_ms=2.0, alone_copy_gbps=125.0)
    assert r["compute_groups_during_copies"] == 2  # (16, 28) and (28, 40): inside [10, 50]
    assert r["op_ms_during"] == pytest.approx(4.0) and r["slowdown_pct"] == pytest.approx(100.0)
    assert r["transfers_during_compute"] == 2 and r["copy_GB/s_during"] == pytest.approx(100.0)
    assert r["copy_vs_alone"] == pytest.approx(0.8) and r["window_ms"] == pytest.approx(40.0)
    apart = gpu_check.overlap_figures([(100.0, 120.0, 10)], ops, 2.0, None)
    assert apart["op_ms_during"] is None and apart["copy_GB/s_during"] is None and apart["window_ms"] == 0


def test_submit_fit_separates_fixed_and_per_descriptor_cost():
    xs = [100, 100, 1000, 1000, 10000]
    fixed, per = gpu_check.fit_line(xs, [0.05 + 0.0005 * x for x in xs])
    assert fixed == pytest.approx(0.05) and per == pytest.approx(0.0005)


def test_crossover_is_where_dma_stays_ahead():
    rows = {s: {"triton_over_dma": r} for s, r in {4096: 2.0, 8192: 1.5, 16384: 0.9, 32768: 1.1, 65536: 0.5}.items()}
    assert gpu_check.crossover_size(rows) == 65536
    rows[32768]["triton_over_dma"] = 0.8
    assert gpu_check.crossover_size(rows) == 16384
    assert gpu_check.crossover_size({4096: {"triton_over_dma": 3.0}}) is None


def test_dry_run_plans_every_case(tmp_path):
    gpu_check.dry_run(tmp_path / "d.json")
    plans = json.loads((tmp_path / "d.json").read_text())["plans"]
    assert plans["h2d contiguous merged"]["ranges"] == 118 and plans["h2d fragmented per-block"]["ranges"] == 30208
    assert plans["h2d one-copy"]["ranges"] == 1
    assert len({p["bytes"] for k, p in plans.items() if not k.startswith(("submit", "h2d crossover", "c32"))}) == 1
    assert [p["ranges"] for k, p in plans.items() if k.startswith("submit")] == [236, 944, 3776, 15104, 30208]
    assert plans["h2d contiguous per-layer"]["calls"] == 59 and plans["h2d fragmented per-layer"]["ranges"] == 30208
    c32 = {k[4:]: p for k, p in plans.items() if k.startswith("c32 ")}
    assert {p["ranges"] for k, p in c32.items() if k.endswith("per-block")} == {118 * 16128}
    assert c32["h2d contiguous merged"]["ranges"] == 118 and c32["d2h one-copy"]["ranges"] == 1
    assert c32["h2d contiguous merged"]["bytes"] == 118 * 16128 * 32 * 1024
    est = json.loads((tmp_path / "d.json").read_text())["estimate_s"]
    assert set(est) == {n for n, _ in gpu_check.SECTIONS} | {"startup", "total"}
    assert est["total"] <= 300  # the check is sized so a rerun fits in the device budget


@pytest.mark.parametrize("pattern", gpu_check.C32_PATTERNS)
def test_c32_pages_are_what_the_block_ids_name(pattern):
    s = gpu_check.CPU
    regions, moved, slack, page = s.c32
    plans = gpu_check.c32_plans(Target(platform="cuda", runtime_version=13000), s)
    for direction in ("h2d", "d2h"):
        m = gpu_check.c32_mapping(pattern, s, direction)
        assert sorted(m.src_ids) == list(range(moved)) and min(m.dst_ids) >= slack  # the slack pages are sentinels
        merged, src, dst = plans[f"{direction} {pattern} merged"]
        per_block = plans[f"{direction} {pattern} per-block"][0]
        assert per_block.num_ranges == regions * moved and merged.total_bytes == per_block.total_bytes
        layout = gpu_check.c32_layout(s)
        rng = np.random.default_rng(1)
        mem = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers}
        srcbuf, dstbuf = ("cpu", "gpu") if direction == "h2d" else ("gpu", "cpu")
        want = mem[dstbuf].reshape(-1, page).copy()
        want[dst] = mem[srcbuf].reshape(-1, page)[src]
        NumpyExecutor().run(merged, mem)
        assert np.array_equal(mem[dstbuf].reshape(-1, page), want)


# ---- the whole check on the CPU, over the CUDA driver shim ----------------------------------------------------
@needs_torch
@pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the driver shim")
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")
def test_every_section_runs_on_the_cpu_over_the_cuda_shim(tmp_path):
    shim = build("fake_cuda", tmp_path)
    env = dict(os.environ, TRITON_INTERPRET="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "tests" / "shims"), os.environ.get("PYTHONPATH")])))
    r = subprocess.run([sys.executable, str(ROOT / "tests" / "shims" / "gpu_check_cpu.py"), str(shim), str(tmp_path / "r.json")],
                       env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    shim_saw = json.loads(r.stdout.strip().splitlines()[-1])
    # each CUDA path ran on its own driver copy: the newest ABI (no failIdx), the 12.8 ABI (failIdx), per-range copies
    assert shim_saw["13000"]["batch_calls"] > 0 and shim_saw["13000"]["fail_idx_calls"] == 0
    assert shim_saw["12080"]["batch_calls"] > 0 and shim_saw["12080"]["fail_idx_calls"] == shim_saw["12080"]["batch_calls"]
    assert shim_saw["12000"]["batch_calls"] == 0 and shim_saw["12000"]["copies"] > 0
    report = json.loads((tmp_path / "r.json").read_text())
    status = {k: v["status"] for k, v in report["sections"].items()}
    assert list(status) == [name for name, _ in gpu_check.SECTIONS]
    errors = {k: report[k]["error"] for k, v in status.items() if v != "ok" and k != "offload"}
    assert errors == {}, errors
    assert "running" not in report and report["bytes_ok"] is True
    assert report["environment"]["dma_executor"] == "CudaBatchExecutor" and report["environment"]["executor_target"] == "cuda-13.0"
    bw = report["bandwidth"]
    assert len(bw) == 14 and all(r["bytes_ok"] and len(r["GB/s"]["samples"]) == gpu_check.CPU.reps for r in bw.values())
    assert bw["h2d contiguous merged"]["ranges"] == gpu_check.CPU.regions and bw["h2d one-copy"]["vs_one_copy"] == 1
    assert len(report["submit"]["by_descriptors"]) == len(gpu_check.CPU.submit_moved)
    assert all(v is True for k in ("dma-roundtrip", "triton-roundtrip") for v in report[k].values())
    assert report["run-api"] == {"dma then triton bytes_ok": True, "triton then dma bytes_ok": True,
                                 "moved tensor refused": True}
    assert [int(s) for s in report["crossover"]["rows"]] == list(gpu_check.CPU.crossover_sizes)
    for sec in ("dma-interference", "triton-interference"):
        assert {"decode", "gemm"} <= set(report[sec]) and report[sec]["decode"]["op_ms_alone"] > 0
    apis = report["cuda-apis"]
    assert {role: row["target"] for role, row in apis.items()} == {"dma": "cuda-13.0", "dma-12.8": "cuda-12.8",
                                                                   "dma-per-copy": "cuda-12.0"}
    assert apis["dma-per-copy"]["h2d runs8 merged"]["api"] == "cuMemcpyAsync"
    assert all(all(row["round_trips"].values()) for row in apis.values())
    flags = report["copy-flags"]
    assert len(flags) == 6 and {tuple(r["flags"]) for r in flags.values()} == {("0x0",), ("0x1",)}
    lw = report["layerwise"]["fragmented"]
    assert lw["per layer"]["calls"] == gpu_check.CPU.regions // 2 and lw["one call"]["calls"] == 1
    assert len(lw["layer_done_ms"]) == lw["per layer"]["calls"] and lw["consumer_lag_ms"] is not None
    c32 = {k: v for k, v in report["c32"].items() if k not in ("shape", "setup_s")}
    assert len(c32) == 14 + 12 and all("error" not in v and v["bytes_ok"] for v in c32.values()), c32
    assert c32["dma h2d fragmented per-block"]["ranges"] == 4 * 64 and c32["dma-per-copy d2h runs8 merged"]["api"] == "cuMemcpyAsync"
    assert c32["dma h2d contiguous merged"]["sentinel_pages"] == 4 * 8 and "vs_one_copy" in c32["dma d2h runs8 merged"]
    assert len(report["c32-triton"]) == 6 and all(v["bytes_ok"] for v in report["c32-triton"].values())
    assert report["executor-close"] == {"torch_after_close": True}
    assert "## summary" in r.stdout and "restore plan" in r.stdout and "c32 restore plan" in r.stdout


# ---- the launcher's offline install, on a fresh interpreter with no pydantic ----------------------------------
def test_launcher_installs_from_wheels_offline_and_imports(tmp_path):
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    wheels = ROOT / ".whl"
    if not list(wheels.glob(f"pydantic_core-*-{tag}-*.whl")):
        pytest.skip(f"no pydantic-core wheel for {tag} in .whl/ (run 'make wheels', which needs PyPI once)")
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(tmp_path / "venv")], check=True, capture_output=True, timeout=300)
    py = tmp_path / "venv" / "bin" / "python"
    # the image has numpy and pip: lend this interpreter's two packages alone (its site folder holds pydantic;
    # lending pip also skips ensurepip, which takes half a minute on a busy machine)
    import pip
    lent = tmp_path / "lent"
    lent.mkdir()
    for pkg in (Path(np.__file__).parent, Path(pip.__file__).parent):
        for p in (pkg, pkg.with_name(f"{pkg.name}.libs")):
            if p.exists():
                (lent / p.name).symlink_to(p)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PIP_", "PYTHON"))}
    env |= {"PIP_CONFIG_FILE": os.devnull, "http_proxy": "http://127.0.0.1:9", "https_proxy": "http://127.0.0.1:9",
            "PYTHONPATH": str(lent), "PYTHON": str(py), "KVXFER_SITE": str(tmp_path / "site"), "OUT": str(tmp_path / "out")}
    bare = subprocess.run([str(py), "-c", "import pydantic"], env=env, capture_output=True, text=True)
    assert bare.returncode != 0, "the fresh interpreter must start without pydantic"
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_run.sh"), "--setup-only"], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "imports ok" in r.stdout
    probe = ("import kvxfer.planner as kp, pydantic, json; from kvxfer.planner import presets; "
             "p = kp.plan_transfer(presets.kv_layout(4, 16, 64), presets.mapping('runs8', 6, 16, 'h2d'), kp.Target()); "
             "print(json.dumps([pydantic.__file__, kp.__path__[0], p.num_ranges]))")
    out = subprocess.run([str(py), "-c", probe], env=dict(env, PYTHONPATH=f"{tmp_path / 'site'}:{lent}"),
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    pyd, planner_dir, ranges = json.loads(out.stdout)
    assert pyd.startswith(str(tmp_path / "site")) and Path(planner_dir).resolve() == ROOT / "planner" and ranges > 0


# ---- the copy kernel under the image's triton ---------------------------------------------------------------
AOT = """
import json, triton, triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvxfer.executors._triton_kernel import copy_ranges
sig = {"src_addr": "*i64", "dst_addr": "*i64", "nbytes": "*i64", "tile_range": "*i64", "tile_start": "*i64",
       "num_tiles": "i64", "ELEM": "constexpr", "WORD": "constexpr", "BLOCK": "constexpr", "ALIGN16": "constexpr"}
out = {}
for word, elem, align in ((8, tl.int64, True), (1, tl.uint8, False)):
    k = triton.compile(ASTSource(copy_ranges, signature=sig, constexprs={"ELEM": elem, "WORD": word,
                       "BLOCK": 8192 // word, "ALIGN16": align}), target=GPUTarget("cuda", 90, 32))
    out[word] = {"cubin": len(k.asm["cubin"]), "v2_b64": "ld.global.v2.b64" in k.asm["ptx"]}
print(json.dumps({"triton": triton.__version__, "kernels": out}))
"""


def test_kernel_compiles_for_sm90_under_the_image_triton():
    site = ROOT / "build" / "triton-aot"
    if not (site / ".complete").is_file():
        pytest.skip("the image's triton (3.6) is not prepared: run 'make triton-aot' (downloads it once)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")]))
    r = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["triton"].startswith("3.6")
    assert got["kernels"]["8"]["cubin"] > 0 and got["kernels"]["1"]["cubin"] > 0
    assert got["kernels"]["8"]["v2_b64"]  # full aligned tiles use 128-bit accesses under 3.6 too
