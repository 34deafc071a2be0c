"""kvxfer plan CASE: plan a case file and show it (summary, explain, JSON, stats, HTML, transfer map)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

CLI_HINT = "--full shows all"  # what shows every range, said where the command's output is read


def register(app: typer.Typer) -> None:
    """Add the ``plan`` command to ``app``."""

    @app.command("plan")
    def plan_cmd(
        case: Path = typer.Argument(..., metavar="FILE",
                                    help="case file (kvxfer schema), plan file (.json/.npz) or golden file"),
        as_json: bool = typer.Option(False, "--json", help="print the plan as JSON"),
        explain: bool = typer.Option(False, "--explain", help="print the fixed-width explain() text"),
        stats: bool = typer.Option(False, "--stats", help="print statistics as JSON"),
        full: bool = typer.Option(False, "--full", help="show every range (no elision)"),
        max_rows: str = typer.Option("20", "--max-rows", metavar="N|all",
                                     help="ranges shown before eliding the middle ('all' or 0: every range)"),
        html: Path | None = typer.Option(None, "--html", metavar="OUT", help="write the HTML view to this file"),
        png: Path | None = typer.Option(None, "--png", metavar="OUT",
                                        help="write the transfer map (PNG, SVG or PDF; needs kvxfer\\[viz])"),
    ) -> None:
        """Plan FILE and print a summary (or one of --explain, --json, --stats); --html/--png write files."""
        chosen = [name for name, on in (("--json", as_json), ("--explain", explain), ("--stats", stats)) if on]
        if len(chosen) > 1:
            raise typer.BadParameter(f"{' and '.join(chosen)} each print the whole output; choose one "
                                     "(--explain and --json both? run the command twice)", param_hint=chosen[1])
        from kvxfer.planner import viz

        from ._inputs import max_rows as parse_rows
        from ._inputs import read_plan

        rows_limit = parse_rows(max_rows)  # refused even with --full
        rows = None if full else rows_limit
        if png is not None:
            viz.require_matplotlib()  # before anything is planned or written
        c, plan = read_plan(case)
        layout = c.layout if c is not None else None
        if as_json or explain or stats or (html is None and png is None):
            _print_view(plan, layout, rows, "json" if as_json else "explain" if explain else "stats" if stats else "")
        _write_views(plan, layout, rows, case.name, html, png)


def _print_view(plan: Any, layout: Any, rows: int | None, view: str) -> None:
    """Print ``plan`` as ``view``: "json", "explain", "stats", or "" for the summary (rich, without ranges)."""
    from kvxfer.planner import render

    if view == "json":
        typer.echo(plan.to_json(indent=1))
    elif view == "explain":
        typer.echo(plan.explain(max_rows=rows, layout=layout, hint=CLI_HINT), nl=False)
    elif view == "stats":
        typer.echo(json.dumps(render.stats(plan, layout), indent=1))
    else:
        from rich.console import Console

        Console(highlight=False).print(render.to_rich(plan, ranges=False, layout=layout))


def _write_views(plan: Any, layout: Any, rows: int | None, title: str, html: Path | None, png: Path | None) -> None:
    """Write the HTML view (``html``) and the transfer map (``png``) that were asked for, saying each on stderr."""
    from kvxfer.planner import render, viz

    if html is not None:
        page = f"<!doctype html>\n<meta charset=\"utf-8\">\n<title>{title}</title>\n"
        html.write_text(page + render.to_html(plan, max_rows=rows, layout=layout, hint="kvxfer plan --full "
                                              "shows all") + "\n")
        typer.echo(f"wrote {html}", err=True)
    if png is not None:
        viz.save_transfer_map(plan, png, layout=layout)
        typer.echo(f"wrote {png}", err=True)
