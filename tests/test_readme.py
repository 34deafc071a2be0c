"""The README stays short and true: under 12,000 characters (the detail lives in the docs site), it names the two
setup commands and the command CI runs, its links point at files that exist, and its Python snippets run as written
(in order, one namespace, in a temporary directory), printing what their ``print(...)  # Expected(...)`` comments
promise."""
from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
SNIPPET = re.compile(r"^```python\n(.*?)^```", re.M | re.S)
PROMISE = re.compile(r"^\s*print\(.*\)\s+#\s+(\w+\(.*\))\s*$", re.M)


def snippets() -> list[str]:
    return SNIPPET.findall(README.read_text())


def test_readme_is_short_and_names_the_setup_and_ci_commands():
    text = README.read_text()
    assert len(text) < 12_000, f"README.md is {len(text)} characters: move detail into docs/"
    assert "make demo" in text and "make test" in text and ".ci/run" in text
    ci = (ROOT / ".ci" / "run").read_text()
    assert "make test" in ci  # the command the README says CI calls is the one it calls


def test_readme_links_point_at_files_that_exist():
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README.read_text())
    assert len(links) >= 8
    missing = [link for link in links if "://" not in link and not (ROOT / link).exists()]
    assert not missing, missing


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
