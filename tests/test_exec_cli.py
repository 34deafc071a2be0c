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
def test_batch_executors_on_shims(case_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_SHIM_VERSION", "0")  # restored after the test; the command sets it
    cuda, hip = build("fake_cuda", tmp_path), build("fake_hip", tmp_path)
    code, out, _ = _run([case_file, "-e", "cuda-batch", "--shim", str(cuda), "--shim-version", "12080", "--verify"], capsys)
    assert code == 0 and "verify: OK" in out
    code, _, err = _run([case_file, "-e", "cuda-batch", "--shim", str(cuda), "--shim-version", "13000"], capsys)
    assert code == 2 and "plan target cuda-12.8 does not fit the runtime found, cuda-13.0" in err
    code, out, _ = _run([case_file, "-e", "hip-batch", "--shim", str(hip), "--shim-version", "71600000", "--replan",
                         "--max-descriptors", "4", "--verify"], capsys)
    assert code == 0 and "d2h rocm-7.16" in out and "6 ranges, 2 calls" in out and "verify: OK" in out


def test_driver_failures_are_one_line(case_file, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVXFER_HIP_LIBRARY", str(tmp_path / "no-such-libamdhip64.so"))
    code, out, err = _run([case_file, "-e", "hip-batch"], capsys)
    assert code == 1 and err.startswith("kvxfer: ExecutorError:") and "no-such-libamdhip64" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_nixl_needs_a_peer(case_file, capsys):
    code, out, err = _run([case_file, "-e", "nixl"], capsys)
    assert code == 2 and "needs a remote peer" in err and "Traceback" not in err
