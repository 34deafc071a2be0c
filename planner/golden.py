"""Golden plans: a case and the plan it must produce, in one JSON file formatted for code review.

A golden file holds ``kvxfer_golden`` (this format's version), the case (layout, mapping, target, options)
and the plan: its header, call offsets and one range per line. A file made from a plan alone holds
``"case": null``: its test pins the plan, and ``kvxfer golden check`` has nothing to re-plan. Pure:
functions take paths and values and never read the environment; the pytest plugin and the CLI decide when
to update.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .case import Case
from .diff import DEFAULT_DIFF_ROWS, TEXT_HINT, PlanDiff, diff_plans
from .errors import PlanError
from .files import PlanFileError, golden_columns, parse_json, read_json
from .plan import COLUMNS, TransferPlan
from .render import EXPLAIN_HINT

GOLDEN_SCHEMA = 1
_WIDTH = 120  # containers whose one-line form is longer are broken, one element per line
# version -> function turning a golden dict of that version into one of the next version
MIGRATIONS: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] = {}


class GoldenError(PlanFileError):
    """A golden file cannot be read: not JSON, not a golden file, or a schema this kvxfer cannot migrate."""


# ---- stable formatting ------------------------------------------------------------------------------------
def _scalar(x: Any) -> bool:
    return not isinstance(x, (dict, list, tuple))


def _format(obj: Any, indent: str = "") -> str:
    """JSON where lists of scalars stay on one line, lists of lists (the ranges) put one per line, and other
    containers break when longer than _WIDTH."""
    one = json.dumps(obj)
    if _scalar(obj) or (isinstance(obj, (list, tuple)) and all(_scalar(x) for x in obj)):
        return one
    rows = isinstance(obj, (list, tuple)) and all(isinstance(x, (list, tuple)) for x in obj)
    if len(indent) + len(one) <= _WIDTH and not rows:
        return one
    inner = indent + " "
    if isinstance(obj, dict):
        items = [f"{inner}{json.dumps(str(k))}: {_format(v, inner)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + indent + "}"
    return "[\n" + ",\n".join(inner + _format(v, inner) for v in obj) + "\n" + indent + "]"


def _plan_of(case: Case | None, plan: TransferPlan | None) -> TransferPlan:
    if plan is not None:
        return plan
    if case is None:
        raise GoldenError("plan", None, "a golden file needs a case, a plan or both")
    return case.plan()


def golden_dict(case: Case | None, plan: TransferPlan | None = None) -> dict[str, Any]:
    """The golden file's content for ``case`` and its ``plan`` (planned now when not given; ``case`` None: the
    plan alone). Raises GoldenError when both are None."""
    plan = _plan_of(case, plan)
    d = plan.to_dict()
    columns = d.pop("columns")
    ranges = [list(r) for r in zip(*(columns[name] for name in COLUMNS))] if plan.num_ranges else []
    plan_part = {"summary": repr(plan), **d, "range_columns": list(COLUMNS), "ranges": ranges}
    return {"kvxfer_golden": GOLDEN_SCHEMA, "case": None if case is None else case.to_dict(), "plan": plan_part}


def dumps(case: Case | None, plan: TransferPlan | None = None) -> str:
    """The golden file's text: stable key order, one range per line, trailing newline."""
    return _format(golden_dict(case, plan)) + "\n"


# ---- reading ----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Golden:
    """A golden file's case (None in a file made from a plan alone) and stored plan."""

    case: Case | None
    plan: TransferPlan


def migrate(d: dict[str, Any], source: str = "golden file") -> dict[str, Any]:
    """Bring a golden dict to GOLDEN_SCHEMA through MIGRATIONS. Raises GoldenError naming the version."""
    version = d.get("kvxfer_golden")
    if not isinstance(version, int) or isinstance(version, bool):
        raise GoldenError("kvxfer_golden", version, "not a kvxfer golden file (no schema version)", source=source)
    if version > GOLDEN_SCHEMA:
        raise GoldenError("kvxfer_golden", version, f"written by a newer kvxfer (this one reads golden schema "
                          f"{GOLDEN_SCHEMA}); upgrade kvxfer", source=source)
    while version < GOLDEN_SCHEMA:
        step = MIGRATIONS.get(version)
        if step is None:
            raise GoldenError("kvxfer_golden", version, f"golden schema {version}, which this kvxfer cannot "
                              f"migrate to {GOLDEN_SCHEMA}; regenerate it (kvxfer golden update DIR, "
                              f"or pytest --update-golden)", source=source)
        d = step(d)
        version = d.get("kvxfer_golden", version + 1)
    return d


def from_dict(d: dict[str, Any], source: str = "golden file") -> Golden:
    """Read a golden dict (any migratable schema). Raises GoldenError naming the file, field and value."""
    d = migrate(d, source)
    case = _case(d, source)
    p = d.get("plan")
    if not isinstance(p, dict):
        raise GoldenError("plan", type(p).__name__, "expected the stored plan as an object", source=source)
    p = dict(p)
    try:
        p["columns"] = golden_columns(p.pop("ranges", None), p.pop("range_columns", None), None)
        p.pop("summary", None)
        # the stored fingerprint is for readers; a newer planner may hash new header fields differently
        p.pop("fingerprint", None)
        plan = TransferPlan.from_dict(p)
    except PlanError as e:
        raise GoldenError(e.field if e.field.startswith("plan.") else f"plan.{e.field}", e.value, e.reason, e.index,
                          source) from None
    return Golden(case, plan)


def _case(d: dict[str, Any], source: str) -> Case | None:
    if "case" not in d:
        raise GoldenError("case", None, "missing from the golden file", source=source)
    if d["case"] is None:  # a golden file made from a plan alone
        return None
    try:
        return Case.model_validate(d["case"])
    except PlanError as e:
        raise GoldenError.wrap(e, source) from None


def _parse(text: str | bytes, source: str) -> dict[str, Any]:
    try:
        return parse_json(text, source)
    except PlanFileError as e:
        raise GoldenError.wrap(e, None) from None


def _read(path: str | Path) -> dict[str, Any]:
    try:
        return read_json(path, "golden file")
    except PlanFileError as e:
        raise GoldenError.wrap(e, None) from None


def loads(text: str, source: str = "golden file") -> Golden:
    """A golden file's content from its JSON text; ``source`` names it in errors. Raises GoldenError."""
    return from_dict(_parse(text, source), source)


def load(path: str | Path) -> Golden:
    """Read a golden file. Raises GoldenError when it is missing or unreadable."""
    return from_dict(_read(path), str(path))


def load_case(path: str | Path) -> Case | None:
    """Only the case of a golden file (readable even when the stored plan's schema is not); None when the file
    was made from a plan alone."""
    return _case(migrate(_read(path), str(path)), str(path))


def save(path: str | Path, case: Case | None, plan: TransferPlan | None = None) -> bool:
    """Write the golden file for ``case`` (and ``plan``; ``case`` None: the plan alone); returns False when the
    file already had this text. Raises GoldenError for a path that is a link, or neither a case nor a plan."""
    path = Path(path)
    if path.is_symlink():
        raise GoldenError("path", str(path), "is a symbolic link; golden files are written in place, never "
                          "through a link")
    text = dumps(case, plan)
    if path.is_file() and path.read_text() == text:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return True


# ---- comparing --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GoldenCheck:
    """Outcome of comparing a plan with a golden file. ``status``: ok, missing, unreadable, unplannable,
    case-changed, differs; or plan-only (``check_file`` on a file made from a plan alone: nothing to re-plan).

    ``message`` says what differs (with the plan diff) in a form ready to print; ``diff`` is the plan diff
    (stored -> current) when both plans are known.
    """

    path: Path
    status: str
    message: str
    diff: PlanDiff | None = None

    @property
    def ok(self) -> bool:
        """Whether the plan matches the golden file (a plan-only file, which nothing re-plans, counts as ok)."""
        return self.status in ("ok", "plan-only")


def check(path: str | Path, case: Case | None, plan: TransferPlan | None = None, *,
          max_rows: int | None = DEFAULT_DIFF_ROWS, hint: str | None = None) -> GoldenCheck:
    """Compare ``case`` and its ``plan`` (planned now when not given) with the golden file at ``path``; with
    ``case`` None, the ``plan`` alone (the stored case, if any, is then not compared). The message shows at
    most ``max_rows`` changed ranges (None: all); ``hint`` says what shows them all where the message is read
    (default: the Python call). Raises GoldenError when both ``case`` and ``plan`` are None."""
    path = Path(path)
    if case is None and plan is None:
        _plan_of(case, plan)  # raises
    try:
        plan = _plan_of(case, plan)
    except PlanError as e:
        return GoldenCheck(path, "unplannable", f"the case of {path} no longer plans: {e}")
    if not path.is_file():
        shown = plan.explain(max_rows=None if max_rows is None else min(max_rows, 10),
                             hint=EXPLAIN_HINT if hint is None else hint)
        return GoldenCheck(path, "missing", f"no golden file at {path}; the plan is:\n{shown}")
    try:
        stored = load(path)
        diff = diff_plans(stored.plan, plan)
    except PlanError as e:
        return GoldenCheck(path, "unreadable", f"golden file {path} cannot be read: {e}")
    rows = diff.text(max_rows, hint=TEXT_HINT if hint is None else hint)
    if case is not None and stored.case != case:
        what = "; the plans are identical" if not diff else f"; stored plan -> new plan:\n{rows}"
        return GoldenCheck(path, "case-changed", f"the case differs from the one stored in {path}{what}", diff)
    if diff:
        return GoldenCheck(path, "differs", f"plan differs from {path} (stored -> new):\n{rows}", diff)
    return GoldenCheck(path, "ok", f"{path}: ok", diff)


def check_file(path: str | Path, *, max_rows: int | None = DEFAULT_DIFF_ROWS, hint: str | None = None) -> GoldenCheck:
    """Re-plan the case stored in the golden file at ``path`` with this kvxfer and compare with its plan
    (``max_rows`` and ``hint`` as for ``check``)."""
    path = Path(path)
    try:
        case = load_case(path)
        if case is None:
            load(path)  # the stored plan must still read
            return GoldenCheck(path, "plan-only", "made from a plan alone: no case to re-plan (its test pins it)")
    except PlanError as e:
        return GoldenCheck(path, "unreadable", f"golden file {path} cannot be read: {e}")
    return check(path, case, max_rows=max_rows, hint=hint)


def folder_files(folder: str | Path) -> tuple[list[Path], list[GoldenCheck]]:
    """The golden files (``*.json``) directly in ``folder``, and a failed check for each entry that is not
    read: a link that leads outside the folder (never followed), a dangling link, or something not a file.
    Raises GoldenError when ``folder`` is not a folder."""
    folder = Path(folder)
    if not folder.is_dir():
        raise GoldenError("DIR", str(folder), "no such folder")
    root = folder.resolve()
    files, refused = [], []
    for path in sorted(folder.glob("*.json")):
        target = path.resolve()
        if path.is_symlink() and not target.is_relative_to(root):
            refused.append(GoldenCheck(path, "outside", f"not followed: a link out of the folder (to {target})"))
        elif not path.is_file():
            refused.append(GoldenCheck(path, "unreadable", "not a file (a dangling link or a folder)"))
        else:
            files.append(path)
    return files, refused


USED_RECORD = ".kvxfer-golden-used"  # in a golden folder: the names a whole test run used, one per line


def write_used(folder: str | Path, names: Iterable[str]) -> Path:
    """Record which golden files (names in ``folder``) a whole test run used, for ``unused_files``."""
    path = Path(folder) / USED_RECORD
    path.write_text("".join(f"{n}\n" for n in sorted(set(names))))
    return path


def unused_files(folder: str | Path) -> list[Path] | None:
    """Golden files in ``folder`` that the recorded test run did not use (links included, never followed);
    None when there is no record (a test run with the kvxfer pytest plugin writes it). Raises GoldenError naming
    the record when it cannot be read as text."""
    folder = Path(folder)
    record = folder / USED_RECORD
    if not record.is_file() or record.is_symlink():
        return None
    try:
        used = set(record.read_bytes().decode("utf-8").split())
    except UnicodeDecodeError as e:
        raise GoldenError("record", f"byte {e.start}", "not UTF-8 text: not a record of the golden files used (delete "
                          "it; the next whole test run writes it again)", source=str(record)) from None
    except OSError as e:
        raise GoldenError("record", str(record), f"cannot read it ({e.strerror or e})", source=str(record)) from None
    return [p for p in sorted(folder.glob("*.json")) if p.name not in used]


def prune(paths: Iterable[Path]) -> list[Path]:
    """Delete ``paths`` (a link is removed itself, never its target); returns what was deleted."""
    gone = []
    for p in paths:
        p.unlink(missing_ok=True)
        gone.append(p)
    return gone


def update_file(path: str | Path) -> bool:
    """Rewrite the golden file at ``path`` with the plan its case gives now; True when the text changed (never
    for a file made from a plan alone, which has no case). Raises GoldenError when the file cannot be read."""
    case = load_case(path)
    return False if case is None else save(path, case)


__all__ = ["GOLDEN_SCHEMA", "Golden", "GoldenCheck", "GoldenError", "MIGRATIONS", "USED_RECORD", "check", "check_file", "dumps",
           "folder_files", "from_dict", "golden_dict", "load", "load_case", "loads", "migrate", "prune", "save",
           "unused_files", "update_file", "write_used"]
