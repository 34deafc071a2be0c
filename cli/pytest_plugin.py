"""pytest plugin (entry point ``pytest11``): the ``golden_plan`` fixture pins plans in golden files.

    def test_restore(golden_plan):
        golden_plan(case, "restore-rocm-7.16")   # compares with tests/golden/restore-rocm-7.16.json

A mismatch fails the test with the plan diff and the command that accepts the new plan. Files are written
only with ``--update-golden`` or ``KVXFER_UPDATE_GOLDEN=1``. The folder is the ini option
``kvxfer_golden_dir`` (default ``tests/golden``, relative to the rootdir). This module is test tooling, so it
may read the environment; the golden logic itself (planner/golden.py) stays pure.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import pytest

ENV_UPDATE = "KVXFER_UPDATE_GOLDEN"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*$")
_UPDATED = pytest.StashKey[list]()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("kvxfer")
    group.addoption("--update-golden", action="store_true", default=False,
                    help=f"rewrite kvxfer golden plan files that differ (or set {ENV_UPDATE}=1)")
    parser.addini("kvxfer_golden_dir", "folder of kvxfer golden plan files, relative to the rootdir",
                  default="tests/golden")


def _update_requested(config: pytest.Config) -> bool:
    return bool(config.getoption("--update-golden")) or os.environ.get(ENV_UPDATE, "") not in ("", "0")


class GoldenPlan:
    """Callable fixture value: ``golden_plan(case, name=None, plan=None) -> plan``."""

    def __init__(self, request: pytest.FixtureRequest):
        self._request = request
        config = request.config
        self.folder = Path(config.rootpath) / str(config.getini("kvxfer_golden_dir"))
        self.update = _update_requested(config)

    def path(self, name: str) -> Path:
        if not _NAME.match(name):
            raise ValueError(f"golden name = {name!r}: use letters, digits, '.', '_' and '-' (it names a file)")
        return self.folder / f"{name}.json"

    def __call__(self, case: Any, name: str | None = None, plan: Any = None) -> Any:
        """Compare ``case`` (a Case, dict or path) and its plan with ``<golden dir>/<name>.json``; the default
        name is the test's name. Returns the plan. Fails the test on a mismatch unless updating."""
        from kvxfer.planner import Case, golden

        case = Case.coerce(case, "case")
        plan = case.plan() if plan is None else plan
        name = name or re.sub(r"[^A-Za-z0-9._-]+", "-", self._request.node.name).strip("-")
        path = self.path(name)
        result = golden.check(path, case, plan)
        if result.ok:
            return plan
        if self.update:
            if golden.save(path, case, plan):
                self._request.config.stash.setdefault(_UPDATED, []).append(str(path))
            return plan
        hint = (f"to accept the new plan: pytest --update-golden {self._request.node.nodeid!r}  "
                f"(or {ENV_UPDATE}=1; the file is {path})")
        pytest.fail(f"golden plan {name!r}: {result.message}\n{hint}", pytrace=False)


@pytest.fixture
def golden_plan(request: pytest.FixtureRequest) -> GoldenPlan:
    """Compare plans with golden files; see kvxfer.cli.pytest_plugin."""
    return GoldenPlan(request)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    updated = config.stash.get(_UPDATED, [])
    if updated:
        terminalreporter.write_sep("-", f"kvxfer: {len(updated)} golden file(s) written")
        for p in updated:
            terminalreporter.write_line(f"  {p}")
