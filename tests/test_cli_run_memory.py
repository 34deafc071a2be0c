"""kvxfer run's memory: in proportion to the bytes a plan moves, and one line when it runs out (both as the
command runs, in a child process)."""
from __future__ import annotations

import os
import resource
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.planner import Case, golden, presets

GOLDEN_DIR = Path(__file__).resolve().parent / "golden"
LARGE = GOLDEN_DIR / "kimi-61x135-fragmented-h2d-rocm7.2.2-cap4096.json"  # 1.9 GiB of buffers, 257 MiB moved
MiB = 1 << 20

# Runs the command in a child and prints the peak resident memory of its children (this wrapper's only one),
# so other tests' subprocesses never count.
PEAK = """
import resource, subprocess, sys
r = subprocess.run(sys.argv[1:], capture_output=True, text=True)
print(r.returncode, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
sys.stderr.write(r.stdout + r.stderr)
"""


def kvxfer_cmd(*args: object) -> list[str]:
    return [sys.executable, "-c", "from kvxfer.cli.main import main; main()", *map(str, args)]


def peak_bytes(*args: object) -> int:
    r = subprocess.run([sys.executable, "-c", PEAK, *kvxfer_cmd(*args)], capture_output=True, text=True, timeout=600)
    code, kib = r.stdout.split()
    assert code == "0", r.stderr
    assert "verify: OK" in r.stderr
    return int(kib) * 1024  # ru_maxrss is in KiB on Linux


@pytest.fixture
def small_case(tmp_path) -> Path:
    case = Case(layout=presets.kv_layout(3, 64, 4096), mapping=presets.mapping("runs8", 24, 64))
    return case.save(tmp_path / "small.json")


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB and lazily mapped pages: Linux")
def test_peak_memory_of_a_large_golden_stays_within_twice_the_bytes_it_moves(small_case):
    """The old command filled every buffer (1.9 GiB here) with random bytes and kept a second copy to verify:
    about 4 GiB. Now only the pages the plan reads or writes hold memory: its sources and destinations, each
    the bytes it moves; the check walks the buffers a few MiB at a time."""
    moved = golden.load(LARGE).plan.total_bytes
    baseline = peak_bytes("run", small_case, "-e", "numpy", "--verify")  # the interpreter and the imports
    peak = peak_bytes("run", LARGE, "-e", "numpy", "--verify")
    assert peak - baseline <= 2 * moved + 16 * MiB, f"{(peak - baseline) / MiB:.0f} MiB for {moved / MiB:.0f} MiB moved"


@pytest.mark.skipif(not hasattr(resource, "RLIMIT_AS"), reason="no address-space limit on this platform")
def test_running_out_of_memory_is_one_line_naming_the_buffer_and_its_size():
    def limit() -> None:  # 1 GiB of address space: the interpreter fits, the golden's 976 MiB host buffer does not
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))

    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}
    r = subprocess.run(kvxfer_cmd("run", LARGE, "-e", "numpy", "--verify"), capture_output=True, text=True,
                       preexec_fn=limit, env=env, timeout=300)
    lines = [line for line in r.stderr.splitlines() if line.startswith("kvxfer: ")]
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert lines == ["kvxfer: error: buffer 'cpu': cannot allocate 976.0 MiB of host memory (ENOMEM)"]
