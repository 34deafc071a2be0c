"""pytest plugin (entry point ``pytest11``): the ``golden_plan`` fixture pins plans in golden files.

    def test_restore(golden_plan):
        golden_plan(case, "restore-rocm-7.16")   # compares with tests/golden/restore-rocm-7.16.json
        golden_plan(other_case)                  # tests/golden/test_restore.json
        golden_plan(plan_transfer(layout, m))    # tests/golden/test_restore.1.json (numbered, never overwritten)

``golden_plan`` takes a ``Case`` (or a case dict or file), which it plans, or a ``TransferPlan``. A file made
from a case holds the case too, so ``kvxfer golden check`` can re-plan it outside pytest; one made from a plan
holds the plan alone. A mismatch fails the test with the plan diff (``pytest -vv`` shows every changed
range) and the command that accepts the new plan. Files are written
only with ``--update-golden`` or ``KVXFER_UPDATE_GOLDEN=1``. The folder is the ini option
``kvxfer_golden_dir`` (default ``tests/golden``, relative to the rootdir).

At the end of a run that exercised the whole golden folder (every collected test ran: no ``-k``, ``-m``,
node-id or file selection, no early stop), golden files no test used are listed; ``--prune-golden`` deletes
them. Such a run also records the names it used in ``<folder>/.kvxfer-golden-used``, which ``kvxfer golden
check --prune`` reads. A narrower run never reports, records or deletes anything. This module is test tooling, so it may read the
environment; the golden logic itself (kvxfer.planner's golden module) stays pure.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

__all__ = ["golden_plan", "GoldenPlan", "golden_folder", "ENV_UPDATE"]  # the pytest hooks are pytest's to call

ENV_UPDATE = "KVXFER_UPDATE_GOLDEN"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UPDATED = pytest.StashKey[list[str]]()
_USED = pytest.StashKey[set[Path]]()
_DESELECTED = pytest.StashKey[int]()
_UNUSED = pytest.StashKey[list[Path]]()


def pytest_addoption(parser: pytest.Parser) -> None:
    """Register ``--update-golden``, ``--prune-golden`` and the ``kvxfer_golden_dir`` ini option."""
    group = parser.getgroup("kvxfer")
    group.addoption("--update-golden", action="store_true", default=False,
                    help=f"rewrite kvxfer golden plan files that differ (or set {ENV_UPDATE}=1)")
    group.addoption("--prune-golden", action="store_true", default=False,
                    help="delete kvxfer golden files that no test used (only on a run of the whole suite)")
    parser.addini("kvxfer_golden_dir", "folder of kvxfer golden plan files, relative to the rootdir",
                  default="tests/golden")


def _update_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--update-golden")) or os.environ.get(ENV_UPDATE, "") not in ("", "0")


def golden_folder(config: pytest.Config) -> Path:
    """The golden folder of this pytest run: the ``kvxfer_golden_dir`` ini option under the rootdir."""
    return Path(config.rootpath) / str(config.getini("kvxfer_golden_dir"))


class GoldenPlan:
    """Callable fixture value: ``golden_plan(case_or_plan, name=None, plan=None) -> plan``."""

    def __init__(self, request: pytest.FixtureRequest):
        self._request = request
        self.folder = golden_folder(request.config)
        self.update = _update_requested(request.config)
        self._unnamed = 0

    def path(self, name: str) -> Path:
        """The file for golden ``name``; raises ValueError for a name that is not a plain file name."""
        if not _NAME.match(name):
            raise ValueError(f"golden name = {name!r}: use letters, digits, '.', '_' and '-' (it names a file)")
        return self.folder / f"{name}.json"

    def default_name(self) -> str:
        """The test's name for the first unnamed snapshot of a test, then ``<name>.1``, ``<name>.2``, ..."""
        base = re.sub(r"[^A-Za-z0-9._-]+", "-", self._request.node.name).strip("-")
        name = base if self._unnamed == 0 else f"{base}.{self._unnamed}"
        self._unnamed += 1
        return name

    def __call__(self, case: Any, name: str | None = None, plan: Any = None) -> Any:
        """Compare with ``<golden dir>/<name>.json``: ``case`` is a Case (or a case dict or file path), planned
        now unless ``plan`` is given, or a TransferPlan (then ``plan`` must be None), compared alone. The
        default name is the test's name, numbered from the second unnamed call on. Returns the plan. Fails the
        test on a mismatch unless updating; raises ValueError (naming the argument) for anything else."""
        from kvxfer.planner import Case, TransferPlan, golden

        if isinstance(case, TransferPlan):
            if plan is not None:
                raise ValueError("golden_plan(plan, plan=...): pass a plan once, or a case and its plan")
            subject, plan = None, case
        else:
            subject = Case.coerce(case, "case")
            plan = subject.plan() if plan is None else plan
        name = name or self.default_name()
        path = self.path(name)
        self._request.config.stash.setdefault(_USED, set()).add(path.resolve())
        every_row = {"max_rows": None} if self._request.config.get_verbosity() >= 2 else {}  # pytest -vv
        result = golden.check(path, subject, plan, hint="pytest -vv shows all", **every_row)
        if result.ok:
            return plan
        if self.update:
            if golden.save(path, subject, plan):
                self._request.config.stash.setdefault(_UPDATED, []).append(str(path))
            return plan
        hint = (f"to accept the new plan: pytest --update-golden {self._request.node.nodeid!r}\n"
                f"  (or {ENV_UPDATE}=1); the file is {path}")
        pytest.fail(f"golden plan {name!r}: {result.message}\n{hint}", pytrace=False)


@pytest.fixture
def golden_plan(request: pytest.FixtureRequest) -> GoldenPlan:
    """The fixture: ``golden_plan(case_or_plan, name=None, plan=None) -> plan`` compares with
    ``<kvxfer_golden_dir>/<name>.json``.

    ``case_or_plan`` is a ``Case`` (or a case dict or a case file path), planned now unless ``plan`` is given,
    or a ``TransferPlan``, compared alone. ``name`` defaults to the test's name, numbered from the second
    unnamed call in one test (``test_x``, ``test_x.1``, ...). Returns the plan. A mismatch fails the test with
    the diff and the command that accepts the new plan; ``--update-golden`` (or ``KVXFER_UPDATE_GOLDEN=1``)
    writes the file instead. See the module's description for unused files and ``--prune-golden``.
    """
    return GoldenPlan(request)


def pytest_deselected(items: list[pytest.Item]) -> None:
    """Count deselected tests (``-k``, ``-m``, ``--lf``): such a run does not exercise the whole folder."""
    if items:
        config = items[0].config
        config.stash[_DESELECTED] = config.stash.get(_DESELECTED, 0) + len(items)


def _whole_suite(session: pytest.Session) -> bool:
    """True when this run collected and ran everything under the configured test paths."""
    config = session.config
    if config.stash.get(_DESELECTED, 0) or session.shouldstop or session.shouldfail or session.testscollected == 0:
        return False
    if session.testsfailed and config.getoption("maxfail", 0):
        return False
    root = Path(config.rootpath)
    default = [root / p for p in config.getini("testpaths")] or [root]
    asked = [Path(str(a).split("::")[0]).resolve() for a in config.args]
    if any("::" in str(a) for a in config.args):
        return False
    return {p.resolve() for p in default} == set(asked) or asked == [root.resolve()]


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """After a whole-suite run: find golden files no test used, and delete them with ``--prune-golden``."""
    config = session.config
    folder = golden_folder(config)
    used = config.stash.get(_USED, set())
    if not used or not folder.is_dir() or not _whole_suite(session):
        return
    unused = sorted(p for p in folder.glob("*.json") if p.resolve() not in used)
    from kvxfer.planner import golden

    record = folder / golden.USED_RECORD
    if not record.is_symlink():  # what ``kvxfer golden check --prune`` reads; never written through a link
        golden.write_used(folder, [p.name for p in folder.glob("*.json") if p.resolve() in used])
    if config.getoption("--prune-golden"):
        for p in unused:
            p.unlink()
    config.stash[_UNUSED] = unused


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    """List the golden files written and the unused ones (and whether they were deleted)."""
    updated = config.stash.get(_UPDATED, [])
    if updated:
        terminalreporter.write_sep("-", f"kvxfer: {len(updated)} golden file(s) written")
        for written in updated:
            terminalreporter.write_line(f"  {written}")
    unused = config.stash.get(_UNUSED, [])
    if unused:
        pruned = config.getoption("--prune-golden")
        what = "deleted" if pruned else "unused (delete them with --prune-golden)"
        terminalreporter.write_sep("-", f"kvxfer: {len(unused)} golden file(s) {what}")
        for path in unused:
            terminalreporter.write_line(f"  {path}")
