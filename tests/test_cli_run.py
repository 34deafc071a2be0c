"""kvxfer run: --verify catching every kind of wrong byte a faulty executor can leave, seeded contents only
where the plan reads or writes, and progress on long runs (memory: test_cli_run_memory.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvxfer.cli import run_memory as rm
from kvxfer.cli.cmd_run import run_case
from kvxfer.executors import ExecutorConfig, NumpyExecutor
from kvxfer.planner import Case, golden, presets

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
MiB = 1 << 20


@pytest.fixture
def small_case(tmp_path) -> Path:
    case = Case(layout=presets.kv_layout(3, 64, 4096), mapping=presets.mapping("runs8", 24, 64))
    return case.save(tmp_path / "small.json")


# ---- --verify against a faulty executor ---------------------------------------------------------------------
class FaultyExecutor(NumpyExecutor):
    """Runs the plan, then leaves one kind of wrong byte behind (``fault``)."""

    def __init__(self, fault: str, seed: int = 0):
        super().__init__()
        self.fault, self.seed = fault, seed

    def run(self, plan, memory, stream=None):  # type: ignore[override]
        t = super().run(plan, memory)
        names = [b.name for b in plan.buffers]
        sb, so, db, do, n = (int(c[0]) for c in (plan.src_buf, plan.src_offset, plan.dst_buf, plan.dst_offset,
                                                  plan.nbytes))
        dst, src = memory[names[db]], memory[names[sb]]
        if self.fault == "skipped range":  # the first range's destination keeps its initial bytes
            dst[do:do + n] = rm.pattern(self.seed, db, do, do + n)
        elif self.fault == "torn range":  # its last byte never arrives
            dst[do + n - 1] = rm.pattern(self.seed, db, do + n - 1, do + n)[0]
        elif self.fault == "stray write far away":  # a byte in a page nothing touches (it held zero)
            dst[_unwritten(plan, db, rm.PAGE_BYTES)] = 7
        elif self.fault == "stray write beside a range":  # a byte no range writes, in a page one writes
            dst[_unwritten(plan, db, 1)] ^= 0xFF
        elif self.fault == "source overwritten":  # the executor wrote into what it read (after reading it)
            src[so] ^= 0xFF
        return t


def _unwritten(plan, b: int, grain: int) -> int:
    """The first byte of buffer ``b`` in a ``grain``-byte unit that no range of ``plan`` reads or writes (with
    grain 1: the first byte no range writes that follows a written one)."""
    size = plan.buffers[b].nbytes
    used = np.zeros(-(-size // grain), bool)
    for side in ("src", "dst") if grain > 1 else ("dst",):
        for i in np.flatnonzero(getattr(plan, f"{side}_buf") == b).tolist():
            o = int(getattr(plan, f"{side}_offset")[i])
            used[o // grain:-(-(o + int(plan.nbytes[i])) // grain)] = True
    free = np.flatnonzero(~used[1:] & used[:-1]) + 1 if grain == 1 else np.flatnonzero(~used)
    return int(free[0]) * grain


@pytest.mark.parametrize("fault, written", [("skipped range", True), ("torn range", True),
                                            ("stray write far away", False), ("stray write beside a range", False),
                                            ("source overwritten", False)])
def test_verify_catches_every_kind_of_wrong_byte(small_case, fault, written):
    lines: list[str] = []
    ok = run_case(small_case, FaultyExecutor(fault), ExecutorConfig(kind="numpy"), verify=True,
                  echo=lambda m, err=False: lines.append(m), on_gpu=False)
    assert ok is False
    head = next(i for i, line in enumerate(lines) if line.startswith("verify: FAILED against the test oracle"))
    found = lines[head + 1:]
    assert found and all(line.startswith("  ") and " bytes differ, first at offset " in line for line in found)
    # the buffer where the fault is, named with what the byte is (an overwritten source also makes its copy's
    # destination differ from it: that buffer is named too)
    assert any(line.endswith("(a copy's destination)" if written else "(a byte no copy writes)") for line in found)


def test_verify_passes_a_correct_run_and_says_what_it_checked(small_case, tmp_path):
    lines: list[str] = []
    echo = lambda m, err=False: lines.append(m)  # noqa: E731
    assert run_case(small_case, NumpyExecutor(), ExecutorConfig(kind="numpy"), verify=True, echo=echo, on_gpu=False)
    total = sum(b.nbytes for b in Case.load(small_case).layout.buffers)
    assert lines[-1] == f"verify: OK, all {total} bytes match the test oracle"
    plan_file = Case.load(small_case).plan().save(tmp_path / "plan.npz")
    assert run_case(plan_file, NumpyExecutor(), ExecutorConfig(kind="numpy"), verify=True, echo=echo, on_gpu=False)
    assert lines[-1].endswith("match the plan's own ranges (a plan file holds no mapping)")


def test_contents_are_seeded_and_only_where_the_plan_reads_or_writes(small_case):
    seen: dict[str, np.ndarray] = {}

    class Spy(NumpyExecutor):
        def run(self, plan, memory, stream=None):  # type: ignore[override]
            seen.update({k: np.array(v) for k, v in memory.items()})  # before the copies
            return super().run(plan, memory)

    case = Case.load(small_case)
    plan = case.plan()
    run_case(small_case, Spy(), ExecutorConfig(kind="numpy"), seed=3, echo=lambda m, err=False: None, on_gpu=False)
    for b, buf in enumerate(plan.buffers):
        touched = np.zeros(buf.nbytes, bool)
        for side in ("src", "dst"):
            for i in np.flatnonzero(getattr(plan, f"{side}_buf") == b).tolist():
                lo = int(getattr(plan, f"{side}_offset")[i]) // rm.PAGE_BYTES * rm.PAGE_BYTES
                hi = -(-(int(getattr(plan, f"{side}_offset")[i]) + int(plan.nbytes[i])) // rm.PAGE_BYTES) * rm.PAGE_BYTES
                touched[lo:hi] = True
        assert touched.any() and not seen[buf.name][~touched].any()  # never written: zero, never backed
        for s, e in _runs(touched):
            assert np.array_equal(seen[buf.name][s:e], rm.pattern(3, b, s, e))  # the seeded pattern, reproducible


def _runs(mask: np.ndarray) -> list[tuple[int, int]]:
    edges = np.flatnonzero(np.diff(np.concatenate(([0], mask.astype(np.int8), [0]))))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist()))


def test_pattern_is_the_same_whatever_window_covers_a_byte():
    whole = rm.pattern(5, 2, 1000, 9000)
    assert np.array_equal(whole[3000:4001], rm.pattern(5, 2, 4000, 5001))
    assert np.array_equal(whole[:1], rm.pattern(5, 2, 1000, 1001))
    assert not np.array_equal(rm.pattern(5, 2, 0, 64), rm.pattern(5, 3, 0, 64))  # buffers differ
    assert not np.array_equal(rm.pattern(5, 2, 0, 64), rm.pattern(6, 2, 0, 64))  # seeds differ


def test_long_runs_report_their_stages_on_stderr(small_case, monkeypatch):
    from kvxfer.cli import cmd_run

    monkeypatch.setattr(cmd_run, "PROGRESS_BYTES", 1)
    lines: list[tuple[str, bool]] = []
    run_case(small_case, NumpyExecutor(), ExecutorConfig(kind="numpy"), verify=True,
             echo=lambda m, err=False: lines.append((m, err)), on_gpu=False)
    stages = [m.split(":")[0].split()[0] for m, err in lines if err]
    assert stages == ["memory", "running", "verifying"]
    assert not [m for m, err in lines if not err and m.startswith(("memory", "running", "verifying"))]


def test_every_golden_runs_and_verifies():
    """Every golden file of the project that moves under 16 MiB: its stored plan (goldens made from a case are
    checked against the oracle's copies of that case) verifies byte for byte."""
    small = sorted(p for p in GOLDEN_DIR.glob("*.json") if golden.load(p).plan.total_bytes < 16 * MiB)
    assert len(small) >= 20
    for path in small:
        lines: list[str] = []
        ok = run_case(path, NumpyExecutor(), ExecutorConfig(kind="numpy"), verify=True,
                      echo=lambda m, err=False: lines.append(m), on_gpu=False)
        assert ok and lines[-1].startswith("verify: OK") and lines[-1].endswith("the test oracle"), (path.name, lines)


def test_run_help_names_every_executor_kind():
    from typer.testing import CliRunner

    from kvxfer.cli.main import build_app
    from kvxfer.executors import ExecutorKind
    text = " ".join(CliRunner().invoke(build_app(), ["run", "--help"], terminal_width=200).output.split())
    missing = [k.value for k in ExecutorKind if k.value not in text]
    assert missing == [], f"kvxfer run --help does not name {missing}"
