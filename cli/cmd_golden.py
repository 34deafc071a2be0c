"""kvxfer golden check|update DIR: re-plan every golden file's case and compare with (or rewrite) its plan.

Both commands go through every file: a broken one is reported and the rest still run. Links that lead out
of DIR are never followed and no file is written through a link.
"""
from __future__ import annotations

from pathlib import Path

import typer

from .main import clip


def _first_line(message: str) -> str:
    return clip(message.splitlines()[0] if message else "", 240)


def register(app: typer.Typer) -> None:
    """Add the ``golden`` command group (``check``, ``update``) to ``app``."""
    group = typer.Typer(no_args_is_help=True, help="Check or rewrite golden plan files.")
    app.add_typer(group, name="golden")

    @group.command("check")
    def check_cmd(folder: Path = typer.Argument(..., help="folder of golden files"),
                  verbose: bool = typer.Option(False, "--verbose", "-v", help="print each failure's diff"),
                  prune: bool = typer.Option(False, "--prune", help="delete the golden files the last whole test run "
                                             "did not use (its record: DIR/.kvxfer-golden-used)")) -> None:
        """Print each failing golden file and a summary; exit 0 when every case still plans to its stored plan.
        Golden files the last whole test run did not use are listed (and deleted with --prune)."""
        from kvxfer.planner import PlanError, golden

        unused = golden.unused_files(folder) if folder.is_dir() else []
        if prune and unused is None:
            raise PlanError("--prune", str(folder / golden.USED_RECORD), "no record of which golden files the tests "
                            "use; a whole-suite pytest run writes it (pytest --prune-golden prunes directly)")
        for p in golden.prune(unused or ()) if prune else unused or ():
            typer.echo(f"{'deleted' if prune else 'unused':12}  {p.name}")
        files, refused = golden.folder_files(folder)
        if not files and not refused:
            raise PlanError("DIR", str(folder), "holds no golden files (*.json)")
        failures = refused + [r for r in map(golden.check_file, files) if not r.ok]
        for r in sorted(failures, key=lambda r: r.path.name):
            typer.echo(f"{r.status:12}  {r.path.name}: {_first_line(r.message)}")
            if verbose and "\n" in r.message:
                typer.echo(r.message.split("\n", 1)[1])
        total = len(files) + len(refused)
        rewritable = sum(r.status in ("differs", "case-changed") for r in failures)
        typer.echo(f"{total} golden files: {total - len(failures)} ok, {len(failures)} failing"
                   + (f" (kvxfer golden update {folder} rewrites {rewritable})" if rewritable else "")
                   + (f"; {len(unused)} unused (--prune deletes them)" if unused and not prune else ""))
        if failures:
            raise typer.Exit(1)

    @group.command("update")
    def update_cmd(folder: Path = typer.Argument(..., help="folder of golden files")) -> None:
        """Rewrite every golden file whose plan (or formatting) changed; its case is kept."""
        from kvxfer.planner import PlanError, golden

        files, refused = golden.folder_files(folder)
        for r in refused:
            typer.echo(f"{r.status:12}  {r.path.name}: {_first_line(r.message)}")
        changed = 0
        failed = len(refused)
        for path in files:
            try:
                wrote = golden.update_file(path)
            except PlanError as e:  # one broken file does not stop the others
                failed += 1
                typer.echo(f"{'unreadable':12}  {path.name}: {clip(str(e), 240)}")
                continue
            changed += wrote
            if wrote:
                typer.echo(f"{'updated':12}  {path.name}")
        typer.echo(f"{changed} of {len(files) + len(refused)} golden file(s) rewritten"
                   + (f", {failed} could not be read or written" if failed else ""))
        if failed:
            raise typer.Exit(1)
