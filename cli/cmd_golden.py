"""kvxfer golden check|update DIR: re-plan every golden file's case and compare with (or rewrite) its plan."""
from __future__ import annotations

from pathlib import Path

import typer

from kvxfer.planner import PlanError


def _files(folder: Path) -> list[Path]:
    if not folder.is_dir():
        raise PlanError("DIR", str(folder), "no such folder")
    files = sorted(folder.glob("*.json"))
    if not files:
        raise PlanError("DIR", str(folder), "holds no golden files (*.json)")
    return files


def register(app: typer.Typer) -> None:
    group = typer.Typer(no_args_is_help=True, help="Check or rewrite golden plan files.")
    app.add_typer(group, name="golden")

    @group.command("check")
    def check_cmd(folder: Path = typer.Argument(..., help="folder of golden files"),
                  verbose: bool = typer.Option(False, "--verbose", "-v", help="print each failure's diff")) -> None:
        """Exit 0 when every golden file's case still plans to its stored plan, else 1."""
        from kvxfer.planner import golden

        files = _files(folder)
        statuses = []
        for path in files:
            r = golden.check_file(path)
            statuses.append(r.status)
            typer.echo(f"{r.status:12}  {path.name}")
            if not r.ok and verbose:
                typer.echo(r.message)
        bad = sum(s != "ok" for s in statuses)
        rewritable = sum(s in ("differs", "case-changed") for s in statuses)
        typer.echo(f"{len(files)} golden files: {len(files) - bad} ok, {bad} failing"
                   + (f" (kvxfer golden update {folder} rewrites {rewritable})" if rewritable else ""))
        if bad:
            raise typer.Exit(1)

    @group.command("update")
    def update_cmd(folder: Path = typer.Argument(..., help="folder of golden files")) -> None:
        """Rewrite every golden file whose plan (or formatting) changed; its case is kept."""
        from kvxfer.planner import golden

        changed = failed = 0
        for path in _files(folder):
            try:
                wrote = golden.update_file(path)
            except PlanError as e:  # one broken file does not stop the others
                failed += 1
                typer.echo(f"{'unreadable':12}  {path.name}: {e}")
                continue
            changed += wrote
            typer.echo(f"{'updated' if wrote else 'unchanged':12}  {path.name}")
        typer.echo(f"{changed} golden file(s) rewritten" + (f", {failed} could not be read" if failed else ""))
        if failed:
            raise typer.Exit(1)
