"""kvxfer run: numpy and shim-backed batch executors on host memory, --verify, --explain-executor, --replan."""
from __future__ import annotations

import pytest

from kvxfer.cli.main import main
from kvxfer.planner import Case, Target, presets

from .shims.build import build, compiler


@pytest.fixture
def case_file(tmp_path):
    case = Case(layout=presets.kv_layout(3, 64, 512), mapping=presets.mapping("runs8", 24, 64, "d2h"),
                target=Target(platform="cuda", runtime_version=12080))
    return str(case.save(tmp_path / "case.json"))


def _run(args, capsys):
    try:
        main(["run", *args])
        code = 0
    except SystemExit as e:
        code = e.code or 0
    out = capsys.readouterr()
    return code, out.out, out.err


def test_numpy_verify_and_explain(case_file, capsys):
    code, out, _ = _run([case_file, "--executor", "numpy", "--verify", "--explain-executor"], capsys)
    assert code == 0
    assert "executor: numpy (configured)" in out and "TransferPlan(d2h cuda-12.8" in out and "verify: OK" in out


@pytest.mark.skipif(compiler() is None, reason="no C compiler (cc) to build the shims")
def test_batch_executors_on_shims(case_file, tmp_path):
    """The run command's body with batch executors built on the C shims (injected, no CLI flag reaches them)."""
    import ctypes

    from kvxfer.cli.cmd_run import run_case
    from kvxfer.executors import CudaBatchExecutor, HipBatchExecutor, TargetMismatchError
    from kvxfer.executors.config import ExecutorConfig, ExecutorKind

    from .shims.runtime import ShimCudaRuntime, ShimHipRuntime

    cuda, hip = build("fake_cuda", tmp_path), build("fake_hip", tmp_path)
    lines: list[str] = []

    def echo(msg, err=False):
        lines.append(msg)

    cfg = ExecutorConfig(kind="cuda-batch")
    assert run_case(case_file, CudaBatchExecutor(ShimCudaRuntime(cuda, 12080)), cfg, verify=True, echo=echo, on_gpu=False)
    assert lines[-1].startswith("verify: OK")
    with pytest.raises(TargetMismatchError, match="plan target cuda-12.8 does not fit the runtime found, cuda-13.0"):
        run_case(case_file, CudaBatchExecutor(ShimCudaRuntime(cuda, 13000)), cfg, echo=echo, on_gpu=False)
    ctypes.c_long.in_dll(ctypes.CDLL(str(hip)), "shim_version").value = 71600000
    cfg = ExecutorConfig(kind=ExecutorKind.HIP_BATCH, replan=True, max_descriptors=4)
    lines.clear()
    assert run_case(case_file, HipBatchExecutor(ShimHipRuntime(hip), max_descriptors=4), cfg, verify=True, echo=echo,
                    on_gpu=False)
    out = "\n".join(lines)
    assert "d2h rocm-7.16" in out and "6 ranges, 2 calls" in out and "verify: OK" in out


def test_shim_flags_are_gone(case_file, capsys):
    code, _, err = _run([case_file, "-e", "cuda-batch", "--shim", "x.so"], capsys)
    assert code == 2 and "No such option" in err


def test_driver_failures_are_one_line(case_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_HIP_LIBRARY", str(tmp_path / "no-such-libamdhip64.so"))
    code, out, err = _run([case_file, "-e", "hip-batch"], capsys)
    assert code == 1 and err.startswith("kvxfer: ExecutorError:") and "no-such-libamdhip64" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_nixl_needs_a_peer(case_file, capsys):
    code, out, err = _run([case_file, "-e", "nixl"], capsys)
    assert code == 2 and "needs a remote peer" in err and "Traceback" not in err
