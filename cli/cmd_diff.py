"""kvxfer diff A B: compare two plans (from case, plan or golden files). Exit 0 identical, 1 different."""
from __future__ import annotations

from pathlib import Path

import typer

from .cmd_plan import CLI_HINT


def register(app: typer.Typer) -> None:
    """Add the ``diff`` command to ``app``."""

    @app.command("diff")
    def diff_cmd(
        a: Path = typer.Argument(..., metavar="A", help="case, plan or golden file"),
        b: Path = typer.Argument(..., metavar="B", help="case, plan or golden file"),
        full: bool = typer.Option(False, "--full", help="show every changed range"),
        max_rows: str = typer.Option("40", "--max-rows", metavar="N|all",
                                     help="changed ranges shown before eliding the middle ('all' or 0: every range)"),
        html: Path | None = typer.Option(None, "--html", metavar="OUT", help="also write the HTML view to this file"),
        equivalent: bool = typer.Option(False, "--equivalent",
                                        help="exit 0 when the plans move the same bytes, even if they differ"),
    ) -> None:
        """Print what differs (summary line, -/+ ranges); exit 0 identical, 1 different, 2 bad input."""
        from rich.console import Console
        from rich.text import Text

        from kvxfer.planner import diff_plans

        from ._inputs import max_rows as parse_rows
        from ._inputs import read_plan

        rows = None if full else parse_rows(max_rows)
        d = diff_plans(read_plan(a)[1], read_plan(b)[1])
        if html is not None:
            page = d.to_html(rows, hint="kvxfer diff --full shows all")
            html.write_text(f"<!doctype html>\n<meta charset=\"utf-8\">\n{page}\n")
        if not d:
            typer.echo(f"identical: {d.a!r}")
            return
        console = Console(highlight=False, soft_wrap=True)
        styles = {"-": "red", "+": "green"}
        for line in d.text(rows, hint=CLI_HINT).splitlines():
            console.print(Text(line, style=styles.get(line[:1], "") if line[:3] not in ("---", "+++") else "bold"))
        raise typer.Exit(0 if equivalent and d.equivalent else 1)
