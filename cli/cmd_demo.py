"""kvxfer demo: plan, run and verify MiniMax-M3-shaped restores (118 regions) on host memory."""
from __future__ import annotations

import typer


def register(app: typer.Typer) -> None:
    @app.command("demo")
    def demo(full: bool = typer.Option(False, "--full", help="32 KiB pages (944 MiB moved per pattern) instead of 1 KiB"),
             page_bytes: int = typer.Option(0, help="page size in bytes (overrides --full)"),
             regions: int = typer.Option(118, help="KV regions (MiniMax-M3 TP4: 118)"),
             blocks: int = typer.Option(256, help="blocks per restore")) -> None:
        """Plan restores for five block patterns and three runtimes, run each with the NumPy executor, verify."""
        from rich.console import Console
        from rich.table import Table

        from kvxfer.cli.demo import run_demo, run_layout_demo

        page = page_bytes or (32 * 1024 if full else 1024)
        console = Console(width=None if Console().is_terminal else 120)
        console.print(f"[bold]kvxfer demo[/]: {regions} regions x {blocks} blocks x {page} B pages, "
                      f"h2d restore into a pool of {2 * blocks} blocks per region")
        rows = run_demo(page_bytes=page, regions=regions, blocks=blocks)
        table = Table(show_lines=False)
        for col, just in (("pattern", "left"), ("target", "left"), ("requested", "right"), ("ranges", "right"),
                          ("calls", "right"), ("attrs", "left"), ("driver call", "left"),
                          ("plan ms", "right"), ("verified", "left")):
            table.add_column(col, justify=just, no_wrap=True)
        for r in rows:
            table.add_row(r["pattern"], r["target"], str(r["requested"]), str(r["ranges"]), str(r["calls"]),
                          r["attrs"], r["api"], f"{r['plan_ms']:.2f}", "[green]yes[/]" if r["verified"] else "[red]NO[/]")
        console.print(table)
        console.print("\n[bold]layout features[/] (cuda-13.0 target; verified against the unmerged plan)")
        lrows = run_layout_demo(page_bytes=page, regions=regions, blocks=blocks)
        ltable = Table()
        for col, just in (("layout", "left"), ("requested", "right"), ("ranges", "right"), ("calls", "right"),
                          ("MiB", "right"), ("plan ms", "right"), ("verified", "left")):
            ltable.add_column(col, justify=just, no_wrap=True)
        for r in lrows:
            ltable.add_row(r["layout"], str(r["requested"]), str(r["ranges"]), str(r["calls"]), f"{r['bytes'] / 2**20:.1f}",
                           f"{r['plan_ms']:.2f}", "[green]yes[/]" if r["verified"] else "[red]NO[/]")
        console.print(ltable)
        rows = rows + lrows
        bad = [r for r in rows if not r["verified"]]
        if bad:
            console.print(f"[red]{len(bad)} plans did not reproduce per-block copies[/]")
            raise typer.Exit(1)
        console.print(f"all {len(rows)} plans verified byte for byte against per-block copies")
