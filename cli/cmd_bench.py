"""kvxfer bench: planner and reference-executor benchmarks as ratios against same-run baselines."""
from __future__ import annotations

import json
from pathlib import Path

import typer


def register(app: typer.Typer) -> None:
    @app.command("bench")
    def bench(out: Path = typer.Option(Path("bench-results.json"), help="where to write the JSON results"),
              quick: bool = typer.Option(False, help="fewer 16,128-block patterns")) -> None:
        """Plan time vs naive per-block descriptors, planning memory, NumPy executor vs memcpy."""
        from kvxfer.cli.bench import format_tables, run_all

        res = run_all(full=not quick)
        print(format_tables(res))
        out.write_text(json.dumps(res, indent=1))
        print(f"\nwrote {out}")
