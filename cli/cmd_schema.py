"""kvxfer schema: the JSON Schema of the case file."""
from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    """Add the ``schema`` command to ``app``."""

    @app.command("schema")
    def schema_cmd(out: Path | None = typer.Option(None, "--out", "-o", help="write to this file")) -> None:
        """Print the JSON Schema of case files (what kvxfer plan and kvxfer diff read)."""
        from kvxfer.planner import Case

        text = json.dumps(Case.json_schema(), indent=1) + "\n"
        if out is None:
            typer.echo(text, nl=False)
        else:
            out.write_text(text)
            typer.echo(f"wrote {out}", err=True)
