"""kvxfer store show|verify|purge|resize: look inside a file tier's store and maintain it.

PATH is a store folder (``kvxfer-<label>-<digest>``) or the tier's ``root_dir`` holding stores. ``show`` reads
without a lock, so it is safe beside a running engine; ``verify``, ``purge`` and ``resize`` need the store to
themselves and refuse (exit 1, one line) while an engine holds it. Exit codes: 0 done (verify: every chunk
checked good), 1 a "no" (chunks that fail, a store in use), 2 bad input.
"""
from __future__ import annotations

import datetime
import json
import re
from pathlib import Path
from typing import Any

import typer

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]i?B?|B)?\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """``"64GiB"``, ``"512M"``, ``"1048576"`` -> bytes (binary units: K = KiB = 1024). ValueError naming the
    option otherwise."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"--capacity = {text!r}: a size in bytes, or with a unit (K, M, G, T; binary), like 64GiB")
    unit = (m.group(2) or "B")[0].upper()
    return int(m.group(1)) << {"B": 0, "K": 10, "M": 20, "G": 30, "T": 40}[unit]


def _when(us: int) -> str:
    if not us:
        return "-"
    return datetime.datetime.fromtimestamp(us / 1e6, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC")


def _identity_line(identity: dict[str, Any]) -> str:
    keys = ("model", "dtype", "vllm", "parallel", "kv_cache_layout", "blocks_per_chunk")
    parts = [f"{k} {json.dumps(identity[k]) if isinstance(identity[k], (dict, list)) else identity[k]}"
             for k in keys if k in identity]
    if "groups" in identity:
        parts.append(f"groups {len(identity['groups'])}")
    return ", ".join(parts) or json.dumps(identity, sort_keys=True)


def register(app: typer.Typer) -> None:
    """Add the ``store`` command group to ``app``."""
    store = typer.Typer(no_args_is_help=True, help="Look inside a file tier's store and maintain it.")
    app.add_typer(store, name="store")
    where = typer.Argument(..., metavar="PATH", help="a store folder, or the tier's root_dir holding stores")

    @store.command("show")
    def show_cmd(path: Path = where,
                 as_json: bool = typer.Option(False, "--json", help="print the reports as JSON")) -> None:
        """Identity, capacity, chunks, bytes, oldest and newest chunk, whether an engine holds it (no lock taken)."""
        from kvxfer.cli.run_memory import size_text
        from kvxfer.offload import files

        reports = [files.describe(f) for f in files.find_stores(path)]
        if as_json:
            typer.echo(json.dumps([{**{k: v for k, v in vars(r).items() if k != "folder"}, "folder": str(r.folder),
                                    "capacity_bytes": r.capacity_bytes, "nbytes": r.nbytes} for r in reports],
                                  indent=1))
            return
        for i, r in enumerate(reports):
            if i:
                typer.echo("")
            typer.echo(f"store      {r.folder}")
            typer.echo(f"identity   {_identity_line(r.identity)}")
            typer.echo(f"capacity   {r.slots} chunks of {r.row_bytes} B ({size_text(r.capacity_bytes)})")
            typer.echo(f"chunks     {r.chunks} ({size_text(r.nbytes)}), {r.discarded} discarded (stores that never "
                       "finished, slots reused)")
            typer.echo(f"oldest     {_when(r.oldest_us)}")
            typer.echo(f"newest     {_when(r.newest_us)}")
            typer.echo(f"in use     {'yes: held by a running store (an engine)' if r.in_use else 'no'}")

    @store.command("verify")
    def verify_cmd(path: Path = where) -> None:
        """Read every chunk back and check its record, epoch and checksum (writes nothing); exit 1 if any fails."""
        from kvxfer.offload import files

        bad = 0
        for folder in files.find_stores(path):
            r = files.verify(folder)
            typer.echo(f"{folder}: {r.checked} chunks checked, {r.failed} failed, {r.discarded} index entries "
                       "discarded when opened")
            for e in r.errors:
                typer.echo(f"  {e}")
            bad += r.failed
        raise typer.Exit(1 if bad else 0)

    @store.command("purge")
    def purge_cmd(path: Path = where,
                  yes: bool = typer.Option(False, "--yes", help="really remove (without it: say what would go)")) -> None:
        """Remove the store's chunks and files (every store under a root_dir)."""
        from kvxfer.cli.run_memory import size_text
        from kvxfer.offload import files

        folders = files.find_stores(path)
        if not yes:
            for f in folders:
                r = files.describe(f)
                typer.echo(f"would remove {f}: {r.chunks} chunks, {size_text(r.capacity_bytes)} of slots (--yes to do it)")
            raise typer.Exit(1)
        for f in folders:
            typer.echo(f"removed {f} ({size_text(files.purge(f))} on disk)")

    @store.command("resize")
    def resize_cmd(path: Path = where,
                   capacity: str = typer.Option(..., "--capacity", metavar="SIZE",
                                                help="new capacity in bytes or with a unit: 64GiB, 512M")) -> None:
        """Change the store's capacity, keeping the most recently used chunks that fit. Set the tier's
        capacity_bytes to the same value, or the engine starts the store over."""
        from kvxfer.offload import files

        nbytes = parse_size(capacity)
        folders = files.find_stores(path)
        if len(folders) != 1:
            raise ValueError(f"PATH = {str(path)!r}: holds {len(folders)} stores; name one store folder")
        kept, dropped = files.resize(folders[0], nbytes)
        typer.echo(f"{folders[0]}: capacity {nbytes} bytes, {kept} chunks kept, {dropped} dropped; set the tier's "
                   f"capacity_bytes to {nbytes}")
