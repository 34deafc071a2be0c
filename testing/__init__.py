"""kvxfer.testing: the test oracle and the golden-plan pytest plugin, for kvxfer's tests and your own.

    from kvxfer.testing import assert_plan_matches, expected_copies, run_reference

    assert_plan_matches(plan_transfer(layout, mapping), layout, mapping)

The oracle (``oracle.py``) expands a transfer into per-piece copies straight from the layout model's spec and
never calls the planner. Names are imported on first use, so loading the pytest plugin stays cheap.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .oracle import (
        Copies,
        OracleError,
        apply_copies,
        assert_buffers_equal,
        assert_plan_matches,
        expected_copies,
        independent,
        min_ranges,
        random_buffers,
        run_reference,
    )

__all__ = ["Copies", "OracleError", "apply_copies", "assert_buffers_equal", "assert_plan_matches", "expected_copies",
           "independent", "min_ranges", "random_buffers", "run_reference"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        return getattr(importlib.import_module(".oracle", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
