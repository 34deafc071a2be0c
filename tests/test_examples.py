"""The example notebook and its script twin run, so they never rot; the notebook mirrors the script."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES))
import sync_notebook  # noqa: E402


def test_notebook_has_the_scripts_cells():
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the dev extra")
    nb = nbformat.read(EXAMPLES / "inspect_plans.ipynb", as_version=4)
    want = sync_notebook.cells((EXAMPLES / "inspect_plans.py").read_text())
    assert [(c.cell_type, c.source) for c in nb.cells] == want, "run: python examples/sync_notebook.py"


def test_the_getting_started_script_is_the_pages_python_blocks():
    """examples/getting_started.py is what tests/vllm/test_getting_started.py runs: the page's blocks, in order."""
    page = (EXAMPLES.parent / "docs" / "getting-started.md").read_text()
    assert (EXAMPLES / "getting_started.py").read_text() == sync_notebook.getting_started(page), \
        "run: python examples/sync_notebook.py"


def test_notebook_executes_and_renders_html_and_the_map(tmp_path):
    nbformat = pytest.importorskip("nbformat", reason="nbformat is in the dev extra")
    nbclient = pytest.importorskip("nbclient", reason="nbclient is in the dev extra")
    pytest.importorskip("ipykernel", reason="a Python kernel (ipykernel) is in the dev extra")
    pytest.importorskip("matplotlib", reason="the notebook draws the transfer map (viz extra)")
    nb = nbformat.read(EXAMPLES / "inspect_plans.ipynb", as_version=4)
    nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                            resources={"metadata": {"path": str(tmp_path)}}).execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]
    html = [o["data"]["text/html"] for o in outputs if o.output_type == "execute_result" and "text/html" in o["data"]]
    assert any('class="kvxfer kvxfer-plan"' in h for h in html)  # the plan
    assert any('class="kvxfer kvxfer-diff"' in h and "flags 0x0 -&gt; 0x100" in h for h in html)  # the 7.2/7.16 diff
    assert any("image/png" in o.get("data", {}) for o in outputs)  # the transfer map
    assert not list(tmp_path.iterdir())  # writes nothing


def test_script_runs():
    pytest.importorskip("matplotlib", reason="the script draws the transfer map (viz extra)")
    r = subprocess.run([sys.executable, str(EXAMPLES / "inspect_plans.py")], capture_output=True, text=True,
                       env={**os.environ, "MPLBACKEND": "Agg"}, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "target rocm-7.2 -> rocm-7.16, ranges 3776 -> 3776" in r.stdout
    assert "ranges 3776 -> 30208 (+26432), calls 1 -> 8" in r.stdout
