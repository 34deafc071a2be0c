"""kvxfer bench (placeholder until implemented)."""
from __future__ import annotations


def register(app) -> None:
    @app.command("bench")
    def _cmd() -> None:
        """Not implemented yet."""
        raise SystemExit("kvxfer bench: not implemented yet")
