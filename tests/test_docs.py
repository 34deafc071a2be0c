"""The API reference builds (``make docs`` runs pdoc over every package; CI builds the planner's here)."""
from __future__ import annotations

import pytest

pdoc = pytest.importorskip("pdoc", reason="pdoc (the API reference tool) is in the dev extra")


def test_api_reference_of_the_planner_builds(tmp_path):
    pdoc.render.configure(docformat="google")
    pdoc.pdoc("kvxfer.planner", output_directory=tmp_path)
    page = tmp_path / "kvxfer" / "planner.html"
    assert page.is_file() and (tmp_path / "index.html").is_file()
    text = page.read_text()
    for name in ("plan_transfer", "TransferPlan", "BlockMapping", "Layout"):
        assert f'id="{name}"' in text, f"{name} is missing from the API reference"
    assert "Plan the copies of" in text  # docstrings are rendered, not only names
