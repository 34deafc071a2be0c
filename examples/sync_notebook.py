"""Rebuild inspect_plans.ipynb from inspect_plans.py (cells split at '# %%'; outputs left empty), and
getting_started.py from the Python blocks of docs/getting-started.md (tests/test_examples.py checks both).

A code line ``# %matplotlib ...`` is a comment in the script and IPython's magic in the notebook.
"""
from __future__ import annotations

import re
from pathlib import Path

HERE = Path(__file__).parent
SCRIPT, NOTEBOOK = HERE / "inspect_plans.py", HERE / "inspect_plans.ipynb"
PAGE, STARTED = HERE.parent / "docs" / "getting-started.md", HERE / "getting_started.py"
STARTED_HEAD = '''"""docs/getting-started.md as one script: its Python blocks, in order (written by examples/sync_notebook.py).

    make venv-vllm                                     # builds .venv-vllm (vLLM's CPU build and kvxfer)
    .venv-vllm/bin/python examples/getting_started.py  # a few minutes: two engines start
"""
'''


def page_blocks(text: str) -> str:
    """The Python blocks of a Markdown page, in order, one blank line apart (as tests/vllm runs them)."""
    return "\n\n".join(re.findall(r"^```python\n(.*?)^```", text, re.M | re.S))


def getting_started(text: str) -> str:
    """examples/getting_started.py for the getting-started page ``text``."""
    return STARTED_HEAD + page_blocks(text)


def cells(text: str) -> list[tuple[str, str]]:
    """[(kind 'code'|'markdown', source)] of a '# %%' script."""
    out: list[tuple[str, str]] = []
    for chunk in text.split("# %%")[1:]:
        head, _, body = chunk.partition("\n")
        if head.strip() == "[markdown]":
            out.append(("markdown", "\n".join(line[2:] for line in body.strip().splitlines())))
        else:
            out.append(("code", re.sub(r"^# (%matplotlib\b.*)$", r"\1", body.strip(), flags=re.M)))
    return out


def notebook(text: str):
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell(src) if kind == "markdown" else nbformat.v4.new_code_cell(src)
                for kind, src in cells(text)]
    for i, cell in enumerate(nb.cells):
        cell["id"] = f"cell-{i}"  # stable ids keep the file diff-free across rebuilds
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


if __name__ == "__main__":
    import nbformat

    nbformat.write(notebook(SCRIPT.read_text()), NOTEBOOK)
    STARTED.write_text(getting_started(PAGE.read_text()))
    print(f"wrote {NOTEBOOK} and {STARTED}")
