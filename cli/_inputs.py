"""Reading what the commands accept: a case file, a plan file (.json or .npz) or a golden file.

Commands import this module inside their bodies: it loads the planner, which ``kvxfer --version`` and
``--help`` never need.
"""
from __future__ import annotations

from pathlib import Path

import typer

from kvxfer.planner import Case, PlanError, PlanFileError, TransferPlan, golden, read_bytes, read_json


def read_input(path: str | Path) -> tuple[Case | None, TransferPlan | None]:
    """(case or None, stored plan or None) from ``path``: a case file gives its case, a plan file its plan, a
    golden file both (its plan alone when it was made from a plan). Raises PlanFileError (a ValueError) naming
    the file when it is none of these."""
    path = Path(path)
    if path.suffix == ".npz":
        return None, TransferPlan.from_npz_bytes(read_bytes(path, "plan file"), str(path))
    d = read_json(path)
    if "kvxfer_golden" in d:
        g = golden.from_dict(d, str(path))
        return g.case, g.plan
    if "columns" in d or "call_offsets" in d:
        return None, TransferPlan.from_dict(d, str(path))
    if "layout" in d or "mapping" in d:
        try:
            return Case.model_validate(d), None
        except PlanError as e:
            raise PlanFileError.wrap(e, str(path)) from None
    raise PlanFileError("path", str(path), "not a case (layout, mapping, ...), a plan (columns, call_offsets) "
                        "or a golden file (kvxfer_golden)")


def read_plan(path: str | Path) -> tuple[Case | None, TransferPlan]:
    """(case or None, plan) from ``path``: a case is planned now, a plan file is loaded, a golden file gives its
    case and stored plan."""
    case, plan = read_input(path)
    if plan is not None:
        return case, plan
    try:
        return case, Case.model_validate(case).plan()
    except PlanError as e:
        raise PlanFileError.wrap(e, str(path)) from None


def max_rows(value: str) -> int | None:
    """``--max-rows``: a count of rows, or ``all`` (also 0) for every row."""
    text = value.strip().lower()
    if text in ("all", "0"):
        return None
    if not text.isdigit():
        raise typer.BadParameter(f"expected a number of rows or 'all', got {value!r}")
    return int(text)
