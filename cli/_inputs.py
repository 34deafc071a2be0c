"""Reading what the commands accept: a case file, a plan file (.json or .npz) or a golden file."""
from __future__ import annotations

import json
from pathlib import Path

from kvxfer.planner import Case, PlanError, TransferPlan, golden


def read_plan(path: str | Path) -> tuple[Case | None, TransferPlan]:
    """(case or None, plan) from ``path``: a case is planned now, a plan file is loaded, a golden file gives its
    case and stored plan. Raises PlanError (a ValueError) naming the file when it is none of these."""
    path = Path(path)
    if not path.is_file():
        raise PlanError("path", str(path), "no such file")
    if path.suffix == ".npz":
        return None, TransferPlan.load(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise PlanError("path", str(path), f"not JSON ({e.msg} at line {e.lineno})") from None
    if isinstance(d, dict) and "kvxfer_golden" in d:
        g = golden.from_dict(d, str(path))
        return g.case, g.plan
    if isinstance(d, dict) and "columns" in d and "call_offsets" in d:
        return None, TransferPlan.from_dict(d)
    if isinstance(d, dict) and "layout" in d:
        case = Case.model_validate(d)
        return case, case.plan()
    raise PlanError("path", str(path), "not a case (layout, mapping, ...), a plan (columns, call_offsets) "
                    "or a golden file (kvxfer_golden)")
