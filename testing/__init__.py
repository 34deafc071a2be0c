"""kvxfer.testing: the test oracle and the golden-plan pytest plugin, for kvxfer's tests and your own.

    from kvxfer.testing import assert_plan_matches, expected_copies, run_reference

    assert_plan_matches(plan_transfer(layout, mapping), layout, mapping)

The oracle (``oracle.py``) expands a transfer into per-piece copies straight from the layout model's spec and
never calls the planner. Its names are real attributes here; the oracle reads the planner's value types only
when a function runs, so loading the pytest plugin (``kvxfer.testing.pytest_plugin``, which pytest imports at
start-up in every project that installs kvxfer) costs numpy and no planner import.

``write_llama`` (``llama.py``) writes a small Llama that vLLM loads, to try kvxfer in an engine with no download.
"""
from __future__ import annotations

from .llama import write_llama  # imports torch and the planner only when it runs
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
           "independent", "min_ranges", "random_buffers", "run_reference", "write_llama"]

