"""The README's Python snippets run as written (in order, one namespace, in a temporary directory), and the
output they promise in ``print(...)  # Expected(...)`` comments is what they print."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
PROMISE = re.compile(r"^\s*print\(.*\)\s+#\s+(\w+\(.*\))\s*$", re.M)


def snippets() -> list[str]:
    return SNIPPET.findall(README.read_text())


def test_readme_has_python_snippets():
    assert snippets(), "README.md has no ```python blocks (this test would check nothing)"


def test_readme_snippets_run_and_print_what_they_promise(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # snippets may write files (plan.save)
    namespace: dict = {"__name__": "__readme__"}
    out = io.StringIO()
    for i, code in enumerate(snippets()):
        with contextlib.redirect_stdout(out):
            exec(compile(code, f"README.md python block {i}", "exec"), namespace)
    printed = out.getvalue()
    for i, code in enumerate(snippets()):
        for promise in PROMISE.findall(code):
            assert promise in printed, f"README.md python block {i} promises {promise!r}; it printed:\n{printed}"
