"""What a Jupyter cell shows for a value: IPython's own HTML formatter, so tests reach a plan's notebook view
through the display protocol a notebook uses, never by naming the protocol's method."""
from __future__ import annotations

from typing import Any

import pytest


def cell_html(obj: Any) -> str:
    """The HTML a notebook cell shows for ``obj`` (IPython's HTMLFormatter); skips without IPython."""
    formatters = pytest.importorskip("IPython.core.formatters", reason="IPython renders notebook cells")
    html = formatters.HTMLFormatter()(obj)
    assert isinstance(html, str), f"{type(obj).__name__} has no HTML view"
    return html
