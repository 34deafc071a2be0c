"""kvxfer golden check|update DIR: re-plan every golden file's case and compare with (or rewrite) its plan.

Both commands go through every file: a broken one is reported and the rest still run. Links that lead out
of DIR are never followed and no file is written through a link. Lines fit 80 columns: a long message is
continued under its file name.
"""
from __future__ import annotations

import textwrap
from pathlib import Path
from typing import Any

import typer

from .main import clip

WIDTH = 80
_STATUS = 12  # the status column, then two spaces


def _report(status: str, path: Path, message: str = "") -> str:
    """One file's line ``status  name: message`` (the file's path in the message said by its name, which the
    line already shows), wrapped at WIDTH with continuation lines under the name."""
    first = message.splitlines()[0] if message else ""
    message = clip(first.replace(f"{path}: ", "").replace(str(path), path.name), 240)
    text = f"{status:{_STATUS}}  {path.name}" + (f": {message}" if message else "")
    return "\n".join(textwrap.wrap(text, WIDTH, subsequent_indent=" " * (_STATUS + 4), break_long_words=False,
                                   break_on_hyphens=False))


def register(app: typer.Typer) -> None:
    """Add the ``golden`` command group (``check``, ``update``) to ``app``."""
    group = typer.Typer(no_args_is_help=True, help="Check or rewrite golden plan files.")
    app.add_typer(group, name="golden")

    @group.command("check")
    def check_cmd(folder: Path = typer.Argument(..., metavar="DIR", help="folder of golden files"),
                  verbose: bool = typer.Option(False, "--verbose", "-v", help="print each failure's diff"),
                  max_rows: str = typer.Option("40", "--max-rows", metavar="N|all",
                                               help="with -v: changed ranges shown per diff ('all': every range)"),
                  prune: bool = typer.Option(False, "--prune", help="delete the golden files the last whole test run "
                                             "did not use (its record: DIR/.kvxfer-golden-used)")) -> None:
        """Print each failing golden file and a summary; exit 0 when every case still plans to its stored plan.
        Golden files the last whole test run did not use are listed (and deleted with --prune)."""
        from ._inputs import max_rows as parse_rows

        if not check_folder(folder, verbose=verbose, max_rows=parse_rows(max_rows), prune=prune):
            raise typer.Exit(1)

    @group.command("update")
    def update_cmd(folder: Path = typer.Argument(..., metavar="DIR", help="folder of golden files")) -> None:
        """Rewrite every golden file whose plan (or formatting) changed; its case is kept. Files made from a
        plan alone have no case to re-plan and are left as they are."""
        if not update_folder(folder):
            raise typer.Exit(1)


def check_folder(folder: Path, *, verbose: bool = False, max_rows: int | None = 40, prune: bool = False) -> bool:
    """``kvxfer golden check``: list (or with ``prune`` delete) the files the last test run did not use, then
    check every golden file and print the failing ones and a summary. True when none fails. Raises PlanError
    for a folder without golden files, or ``prune`` without a record of the files used."""
    from kvxfer.planner import PlanError, golden

    unused = _unused(folder, prune)
    files, refused = golden.folder_files(folder)
    if not files and not refused:
        raise PlanError("DIR", str(folder), "holds no golden files (*.json)")
    results = [golden.check_file(f, max_rows=max_rows, hint="--max-rows all shows all") for f in files]
    failures = refused + [r for r in results if not r.ok]
    for r in sorted(failures, key=lambda r: r.path.name):
        typer.echo(_report(r.status, r.path, r.message))
        if verbose and "\n" in r.message:
            typer.echo(r.message.split("\n", 1)[1])
    _summary(folder, len(files) + len(refused), failures, sum(r.status == "plan-only" for r in results),
             unused if not prune else [])
    return not failures


def _unused(folder: Path, prune: bool) -> list[Path]:
    """The golden files the last whole test run did not use, each reported (and deleted with ``prune``)."""
    from kvxfer.planner import PlanError, golden

    unused = golden.unused_files(folder) if folder.is_dir() else []
    if prune and unused is None:
        raise PlanError("--prune", str(folder / golden.USED_RECORD), "no record of which golden files the tests "
                        "use; a whole-suite pytest run writes it (pytest --prune-golden prunes directly)")
    for p in golden.prune(unused or ()) if prune else unused or ():
        typer.echo(_report("deleted" if prune else "unused", p))
    return unused or []


def _summary(folder: Path, total: int, failures: list[Any], plan_only: int, unused: list[Path]) -> None:
    """The closing line of ``golden check``: files ok and failing, what ``golden update`` would rewrite, the
    unused ones."""
    from kvxfer.planner import render

    rewritable = sum(r.status in ("differs", "case-changed") for r in failures)
    summary = (f"{total} golden files: {total - len(failures)} ok"
               + (f" ({plan_only} made from a plan alone: nothing to re-plan)" if plan_only else "")
               + f", {len(failures)} failing"
               + (f" (kvxfer golden update {folder} rewrites {rewritable})" if rewritable else "")
               + (f"; {len(unused)} unused (--prune deletes them)" if unused else ""))
    typer.echo("\n".join(render.wrap_parts(summary, WIDTH)))


def update_folder(folder: Path) -> bool:
    """``kvxfer golden update``: rewrite every golden file whose plan changed (one broken file does not stop the
    others) and say how many were rewritten. True when every file could be read and written."""
    from kvxfer.planner import PlanError, golden

    files, refused = golden.folder_files(folder)
    for r in refused:
        typer.echo(_report(r.status, r.path, r.message))
    changed = 0
    failed = len(refused)
    for path in files:
        try:
            wrote = golden.update_file(path)
        except PlanError as e:
            failed += 1
            typer.echo(_report("unreadable", path, str(e)))
            continue
        changed += wrote
        if wrote:
            typer.echo(_report("updated", path))
    typer.echo(f"{changed} of {len(files) + len(refused)} golden file(s) rewritten"
               + (f", {failed} could not be read or written" if failed else ""))
    return not failed
