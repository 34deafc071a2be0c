"""kvxfer bench: planner and reference-executor benchmarks as ratios against same-run baselines."""
from __future__ import annotations

import json
import platform
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer


def register(app: typer.Typer) -> None:
    """Add the ``bench`` command to ``app``."""

    @app.command("bench")
    def bench(out: Path = typer.Option(Path("bench-results.json"), metavar="OUT", help="where to write the JSON results"),
              quick: bool = typer.Option(False, "--quick", help="fewer 16,128-block patterns")) -> None:
        """Plan time vs naive per-block descriptors, planning memory, NumPy executor vs memcpy."""
        import numpy as np

        from kvxfer.cli import bench as b

        steps: tuple[tuple[str, str, Callable[[], Any]], ...] = (
            ("plan", "planner vs naive descriptors", lambda: b.bench_plan(not quick)),
            ("layouts", "layout model vs naive pieces", b.bench_layouts),
            ("memory", "planning memory", b.bench_memory),
            ("executor", "NumPy executor vs memcpy", b.bench_executor))
        res: dict[str, Any] = {"date": time.strftime("%Y-%m-%d"), "numpy": np.__version__,
               "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}
        for i, (key, what, run) in enumerate(steps, 1):  # progress on stderr, so stdout stays the tables
            typer.echo(f"[{i}/{len(steps)}] {what} ...", err=True)
            t0 = time.perf_counter()
            res[key] = run()
            typer.echo(f"[{i}/{len(steps)}] {what}: done in {time.perf_counter() - t0:.1f} s", err=True)
        typer.echo(b.format_tables(res))
        out.write_text(json.dumps(res, indent=1))
        typer.echo(f"\nwrote {out}")
