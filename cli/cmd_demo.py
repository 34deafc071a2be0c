"""kvxfer demo (placeholder until implemented)."""
from __future__ import annotations


def register(app) -> None:
    @app.command("demo")
    def _cmd() -> None:
        """Not implemented yet."""
        raise SystemExit("kvxfer demo: not implemented yet")
