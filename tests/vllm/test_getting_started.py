"""The getting-started page is a script that works: its Python blocks, run as they stand (one file, in a fresh
process with vLLM's CPU build), start an engine with kvxfer's host and storage tiers under kvxfer's connector,
store a prefix, and serve it from disk after a restart; kvxfer's start-up lines reach the engine's log."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="needs vLLM's CPU build: run with `make test-vllm` (.venv-vllm)")

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "getting-started.md"


def script() -> str:
    return "\n\n".join(re.findall(r"^```python\n(.*?)^```", PAGE.read_text(), re.M | re.S))


def test_the_getting_started_page_runs_as_written(tmp_path: Path) -> None:
    path = tmp_path / "getting_started.py"
    path.write_text(script())
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST")}
    r = subprocess.run([sys.executable, str(path)], cwd=tmp_path, capture_output=True, text=True, timeout=900, env=env)
    log = r.stdout + r.stderr
    assert r.returncode == 0, log[-6000:]
    stored = int(re.search(r"chunks stored: (\d+)", r.stdout)[1])
    found, loaded = map(int, re.search(r"found on disk: (\d+) loaded: (\d+)", r.stdout).groups())
    assert stored >= 8 and found >= 8 and loaded >= 8, r.stdout  # 256 tokens = 8 blocks of 32, from disk
    shown = re.search(r"^```text\n(engine 1:.*?)^```", PAGE.read_text(), re.M | re.S)[1].splitlines()
    assert [line for line in r.stdout.splitlines() if line.startswith(("engine ", "chunks stored"))] == shown
    assert "kvxfer is active (KvxferTieringOffloadingSpec)" in log and "cpu_bytes_to_use=16777216" in log
    assert re.search(r"kvxfer file tier: .*slots of \d+ bytes \(\d+ found\)", log)


def test_the_vllm_pages_python_snippets_run_where_vllm_is() -> None:
    """The docs' blocks that import vLLM (skipped by tests/test_docs_snippets.py without it) run here, as modules
    imported by a spawned process would (``__name__`` not ``"__main__"``: no engine starts)."""
    pages = [p for p in sorted((ROOT / "docs").rglob("*.md")) if p != PAGE]
    ran = 0
    for page in pages:
        code = re.findall(r"^(?<!-->\n)```(?:python|py)\n(.*?)^```", page.read_text(), re.M | re.S)
        if not any(re.search(r"^\s*(from|import) vllm", c, re.M) for c in code):
            continue
        namespace: dict = {"__name__": "__docs__", "MODEL": "unused"}
        for i, c in enumerate(code):
            exec(compile(c, f"{page.relative_to(ROOT)} python block {i}", "exec"), namespace)
        ran += 1
    assert ran >= 1
