"""Runs the storage-tier engine cases (``test_tiers.py``): ``tests/vllm/engine.py``'s cases, one after the other in
this process, with what happens between engines.

``python -m tests.vllm.tier_engine CASES.json`` (from the repository root). A case is ``engine.py``'s, plus:

- ``env``: environment variables for this case's engine (set before it starts, restored after it);
- ``corrupt``: ``{"stats": PATH, "slot": N}``: before the engine starts, flip one byte of slot N of the data
  file of the file tier whose counters an earlier case wrote to PATH (a chunk's bytes changed on disk);
- ``damage``: ``{"stats": PATH, "truncate_slots": N}`` cuts the data file of that file tier to N slots,
  ``{"stats": PATH, "records": "random"}`` overwrites its integrity records with random bytes, before the engine
  starts;
- ``damage_running``: the same, done to this case's own file tier while its engine runs: with ``"before": I``
  (the request), once its counters (``"stats"``) show ``"stored": N`` chunks stored (up to 120 s);
- ``tier_stats``: a file tier's counters file, read after the engine and returned under ``tier``;
- ``crash_marker``: the engine is to kill itself (a test double writes this file, then SIGKILLs the engine
  process): the case runs in a process of its own (vLLM's client would wait forever for a dead engine), which
  is killed once the marker appears; its result has ``error`` "killed".

A case whose engine died leaves vLLM's primary-tier file in /dev/shm behind; the files that appeared during such
a case are removed after it. Prints one ``RESULT`` JSON line per case.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vllm import engine  # noqa: E402

SHM = Path("/dev/shm")


def _corrupt(spec: dict[str, Any]) -> None:
    folder = Path(json.loads(Path(spec["stats"]).read_text())["folder"])
    row = json.loads(Path(spec["stats"]).read_text())["row_bytes"]
    with open(folder / "chunks.kvx", "r+b") as f:
        at = int(spec["slot"]) * int(row) + 100
        f.seek(at)
        byte = f.read(1)
        f.seek(at)
        f.write(bytes([byte[0] ^ 0xFF]))


def _damage(spec: dict[str, Any]) -> None:
    stats = json.loads(Path(spec["stats"]).read_text())
    data = Path(stats["folder"]) / "chunks.kvx"
    if "truncate_slots" in spec:
        os.truncate(data, int(spec["truncate_slots"]) * int(stats["row_bytes"]))
    if spec.get("records") == "random":
        sums = Path(f"{data}.kvxsum")
        sums.write_bytes(os.urandom(sums.stat().st_size))


def _damage_running(spec: dict[str, Any]) -> Callable[[int], None]:
    """``engine.run``'s hook that damages the running engine's file tier before request ``spec["before"]``, once
    its stores have landed (the counters file shows ``spec["stored"]`` chunks stored)."""
    def before(i: int) -> None:
        if i != int(spec["before"]):
            return
        stats = Path(spec["stats"])
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if json.loads(stats.read_text())["chunks_stored"] >= int(spec["stored"]):
                    break
            except (OSError, ValueError, KeyError):
                pass
            time.sleep(0.1)
        else:
            raise TimeoutError(f"{spec['stored']} chunks were not stored within 120 s ({stats})")
        _damage(spec)
    return before


def _killed(case: dict[str, Any], timeout_s: float = 600) -> dict[str, Any]:
    """Run ``case`` in a process of its own until its engine has killed itself (the marker file), then kill it."""
    marker = Path(case["crash_marker"])
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([case], f)
    proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.engine", f.name], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(1.0)  # the engine process is gone; its workers and the client are what is left
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    log = proc.communicate()[0]
    os.unlink(f.name)
    error = "killed" if marker.exists() else f"the engine was not killed (exit {proc.returncode}):\n{log[-4000:]}"
    return {"name": case.get("name"), "error": error, "tokens": [], "stats": [], "log": log[-20000:]}


def run_case(case: dict[str, Any]) -> dict[str, Any]:
    """Run one case (see the module docstring) and return engine.py's result with ``tier`` added."""
    saved = {k: os.environ.get(k) for k in case.get("env", {})}
    before = set(SHM.glob("vllm_offload_*.mmap"))
    os.environ.update(case.get("env", {}))
    try:
        if case.get("corrupt"):
            _corrupt(case["corrupt"])
        if case.get("damage"):
            _damage(case["damage"])
        try:
            hook = _damage_running(case["damage_running"]) if case.get("damage_running") else None
            result = _killed(case) if case.get("crash_marker") else engine.run(case, hook)
        except Exception:
            result = {"name": case.get("name"), "error": traceback.format_exc(), "tokens": [], "stats": []}
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    if result.get("error"):
        for leftover in set(SHM.glob("vllm_offload_*.mmap")) - before:
            leftover.unlink(missing_ok=True)
    stats = case.get("tier_stats")
    result["tier"] = json.loads(Path(stats).read_text()) if stats and Path(stats).exists() else None
    return result


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for case in json.loads(Path(sys.argv[1]).read_text()):
        print("RESULT " + json.dumps(run_case(case)), flush=True)
