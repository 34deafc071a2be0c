"""kvxfer plan (placeholder until implemented)."""
from __future__ import annotations


def register(app) -> None:
    @app.command("plan")
    def _cmd() -> None:
        """Not implemented yet."""
        raise SystemExit("kvxfer plan: not implemented yet")
