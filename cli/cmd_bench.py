"""kvxfer bench: planner and reference-executor benchmarks as ratios against same-run baselines."""
from __future__ import annotations

import json
import os
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
        _check_out(out)  # before a benchmark runs: a bad path fails at once, not after minutes of timing
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


def _check_out(out: Path) -> None:
    """Refuse (one line, exit 2) an ``--out`` path the results could not be written to: a folder, a path in a
    folder that does not exist or is not one, or a folder this process may not write."""
    folder = out.parent
    if out.is_dir():
        raise typer.BadParameter(f"{out} is a folder; name the file to write", param_hint="--out")
    if not folder.is_dir():
        what = "does not exist" if not folder.exists() else "is not a folder"
        raise typer.BadParameter(f"{out}: the folder {folder} {what}", param_hint="--out")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise typer.BadParameter(f"{out}: the folder {folder} is not writable", param_hint="--out")
