"""kvxfer demo: plan, run and verify MiniMax-M3-shaped restores (118 regions) on host memory.

Rows print as each plan is verified (``--full`` takes tens of seconds), in fixed-width columns that fit
an 80-column terminal; the driver call and attributes of each target are listed once, below the table.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import typer

Row = dict[str, Any]
Column = tuple[str, int, str | Callable[[Row], str]]  # header, width (< 0: left-aligned), key or formatter

# the widths add up to well under 80 columns
PATTERN_COLUMNS: tuple[Column, ...] = (("pattern", -12, "pattern"), ("target", -10, "target"), ("copies", 8, "requested"),
                   ("ranges", 8, "ranges"), ("calls", 6, "calls"), ("plan ms", 9, lambda r: f"{r['plan_ms']:.2f}"))
LAYOUT_COLUMNS: tuple[Column, ...] = (("layout", -28, "layout"), ("copies", 7, "requested"), ("ranges", 7, "ranges"),
                  ("calls", 6, "calls"), ("MiB", 6, lambda r: f"{r['bytes'] / 2**20:.1f}"),
                  ("plan ms", 8, lambda r: f"{r['plan_ms']:.2f}"))


def _cells(columns: tuple[Column, ...], row: Row | None) -> str:
    out = []
    for header, width, key in columns:
        text = header if row is None else (key(row) if callable(key) else str(row[key]))
        out.append(f"{text:<{-width}}" if width < 0 else f"{text:>{width}}")
    return " ".join(out)


def register(app: typer.Typer) -> None:
    """Add the ``demo`` command to ``app``."""

    @app.command("demo")
    def demo(full: bool = typer.Option(False, "--full", help="32 KiB pages (944 MiB moved per pattern) instead of 1 KiB"),
             page_bytes: int = typer.Option(0, help="page size in bytes (overrides --full)"),
             regions: int = typer.Option(118, help="KV regions (MiniMax-M3 TP4: 118)"),
             blocks: int = typer.Option(256, help="blocks per restore")) -> None:
        """Plan restores for five block patterns and three runtimes, run each with the NumPy executor, verify."""
        from rich.console import Console
        from rich.markup import escape

        from kvxfer.cli.demo import run_demo, run_layout_demo

        page = page_bytes or (32 * 1024 if full else 1024)
        console = Console(highlight=False, width=None if Console().is_terminal else 80)

        def show(columns: tuple[Column, ...]) -> Callable[[Row], None]:
            def row(r: Row) -> None:
                verdict = "[green]yes[/]" if r["verified"] else "[red]NO[/]"
                console.print(f"{escape(_cells(columns, r))}  {verdict}")
            return row

        console.print(f"[bold]kvxfer demo[/]: h2d restores of {blocks} blocks x {regions} regions x {page} B pages")
        console.print(f"(a pool of {2 * blocks} blocks per region; each plan run on host memory and verified)")
        console.print(f"[bold]{escape(_cells(PATTERN_COLUMNS, None))}  verified[/]")
        rows = run_demo(page_bytes=page, regions=regions, blocks=blocks, on_row=show(PATTERN_COLUMNS))
        apis = {r["target"]: f"{r['api']}, attrs {r['attrs']}" for r in rows}
        for target, api in apis.items():
            console.print(f"  {target:<10} {escape(api)}", soft_wrap=False)
        console.print("\n[bold]layout features[/] (cuda-13.0 target; verified against the unmerged plan)")
        console.print(f"[bold]{escape(_cells(LAYOUT_COLUMNS, None))}  verified[/]")
        lrows = run_layout_demo(page_bytes=page, regions=regions, blocks=blocks, on_row=show(LAYOUT_COLUMNS))
        rows = rows + lrows
        bad = [r for r in rows if not r["verified"]]
        if bad:
            console.print(f"[red]{len(bad)} plans did not reproduce per-block copies[/]")
            raise typer.Exit(1)
        console.print(f"all {len(rows)} plans verified byte for byte against per-block copies")
