"""Every snippet of the documentation site runs (docs/**/*.md): a page's Python blocks in order, in one namespace,
in a temporary directory; shell blocks line by line. A block is left out only with its reason beside it, an HTML
comment on the line before the fence: ``<!-- not run: REASON -->``. Blocks that import vLLM run under
``make test-vllm`` (tests/vllm/test_getting_started.py); here they are skipped, saying so."""
from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
BLOCK = re.compile(r"^(?:<!-- not run: (?P<reason>.+?) -->\n)?```(?P<lang>\w*)[^\n]*\n(?P<code>.*?)^```", re.M | re.S)
PYTHON, SHELL = {"python", "py"}, {"sh", "bash", "shell", "console"}


def blocks(page: Path) -> list[tuple[str, str, str | None]]:
    """(language, code, the reason it is not run or None) for each fenced block of ``page``."""
    return [(m["lang"], m["code"], m["reason"]) for m in BLOCK.finditer(page.read_text())]


def needs_vllm(code: str) -> bool:
    return bool(re.search(r"^\s*(from vllm|import vllm)", code, re.M))


PAGES = sorted(DOCS.rglob("*.md"))


def test_the_site_has_snippets_and_every_one_left_out_says_why():
    found = [(p, lang) for p in PAGES for lang, _, _ in blocks(p) if lang in PYTHON | SHELL]
    assert len(found) >= 8, found
    for page in PAGES:
        for lang, code, reason in blocks(page):
            assert lang, f"{page.relative_to(ROOT)}: a fenced block without a language: {code[:60]!r}"
            if reason is not None:
                assert len(reason.split()) >= 3, f"{page.relative_to(ROOT)}: 'not run' needs a real reason"


@pytest.mark.parametrize("page", [p for p in PAGES if any(lang in PYTHON and r is None for lang, _, r in blocks(p))],
                         ids=lambda p: str(p.relative_to(DOCS)))
def test_python_snippets_run(page: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    code = [c for lang, c, r in blocks(page) if lang in PYTHON and r is None]
    if any(needs_vllm(c) for c in code) and importlib.util.find_spec("vllm") is None:
        pytest.skip("imports vLLM: run under `make test-vllm` (tests/vllm/test_getting_started.py)")
    if page.name == "getting-started.md":
        pytest.skip("starts engines: run as a script by tests/vllm/test_getting_started.py (make test-vllm)")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {"__name__": "__docs__", "MODEL": str(tmp_path / "model")}
    with contextlib.redirect_stdout(io.StringIO()):
        for i, c in enumerate(code):
            exec(compile(c, f"{page.relative_to(ROOT)} python block {i}", "exec"), namespace)


SHELL_PAGES = [p for p in PAGES if any(lang in SHELL and r is None for lang, _, r in blocks(p))]


@pytest.mark.parametrize("page", SHELL_PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_shell_snippets_run(page: Path, tmp_path: Path):
    bindir = Path(sys.executable).parent
    env = dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ['PATH']}")
    for lang, code, reason in blocks(page):
        if lang not in SHELL or reason is not None:
            continue
        for line in code.replace("\\\n", " ").splitlines():
            line = line.split(" #")[0].strip()
            if not line or line.startswith("#"):
                continue
            argv = shlex.split(line.replace("$ ", "", 1))
            if argv[0] == "python":
                argv[0] = sys.executable
            if argv[0] == "kvxfer" and importlib.util.find_spec("typer") is None:
                pytest.skip("the kvxfer command needs the cli extra")
            r = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
            assert r.returncode in (0, 1) if argv[:2] == ["kvxfer", "diff"] else r.returncode == 0, \
                f"{page.relative_to(ROOT)}: {line}\n{r.stdout}\n{r.stderr}"
