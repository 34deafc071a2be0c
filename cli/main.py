"""Entry point for the ``kvxfer`` console script. Each ``cmd_*`` module registers its commands on ``app``."""
from __future__ import annotations

import importlib
import sys

COMMAND_MODULES = ("cmd_demo", "cmd_plan", "cmd_diff", "cmd_golden", "cmd_schema", "cmd_run", "cmd_bench")


def build_app():
    try:
        import typer
    except ImportError as e:
        raise SystemExit(f"kvxfer's CLI needs typer and rich: pip install 'kvxfer[cli]' ({e})") from None
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="Plan, inspect and run KV-cache block transfers.")
    for name in COMMAND_MODULES:
        importlib.import_module(f"kvxfer.cli.{name}").register(app)
    return app


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. Bad input prints one line (no traceback) and exits 2; a failed driver or transfer prints
    one line and exits 1."""
    app = build_app()
    try:
        app(args=argv, standalone_mode=True)
    except (ValueError, OSError, ImportError) as e:  # bad input, unreadable files, a missing optional extra
        print(f"kvxfer: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    except (RuntimeError, TimeoutError) as e:  # ExecutorError: no driver, a failed call, a transfer that hung
        print(f"kvxfer: {type(e).__name__}: {e}", file=sys.stderr)
        raise SystemExit(1) from None
