"""Entry point for the ``kvxfer`` console script. Each ``cmd_*`` module registers its commands on ``app``.

Exit codes: 0 success, 1 a result that is "no" (plans differ, golden files fail, bytes differ, a driver
failed), 2 bad input (one short line per problem, never a traceback; running out of memory included).

The command modules import the planner, numpy and the executors inside their commands, so ``kvxfer
--version`` and ``--help`` load typer alone (tests/test_cli_width.py checks it).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any

COMMAND_MODULES = ("cmd_demo", "cmd_plan", "cmd_diff", "cmd_golden", "cmd_schema", "cmd_run", "cmd_bench", "cmd_store")
MAX_ERRORS = 10  # problems listed one per line before the rest are counted
MAX_LINE = 300  # characters of one message line; a message never dumps a whole object


def _plain_flags(cls: type) -> type:
    """``cls`` (a typer command or group class) whose help shows an on/off flag without a ``<bool>`` type."""

    class PlainFlags(cls):  # type: ignore[misc]
        def get_params(self, ctx: Any) -> list[Any]:
            params: list[Any] = super().get_params(ctx)
            for p in params:  # the help option (made on demand) included
                if getattr(p, "is_flag", False) and p.metavar is None:
                    p.metavar = ""
            return params

    PlainFlags.__name__ = PlainFlags.__qualname__ = f"PlainFlags{cls.__name__}"
    return PlainFlags


def _use_plain_flags(app: Any, command: type, group: type) -> None:
    """Make every command and group of ``app`` (recursively) use the plain-flag classes."""
    app.info.cls = group
    for info in app.registered_commands:
        if info.cls is None or info.cls is command.__base__:  # the default class, not one a command chose
            info.cls = command
    for sub in app.registered_groups:
        _use_plain_flags(sub.typer_instance, command, group)


def _version(value: bool) -> None:
    import typer

    if value:
        from kvxfer.cli import __version__
        typer.echo(f"kvxfer {__version__}")
        raise typer.Exit()


def build_app() -> Any:
    """The typer app with every command of COMMAND_MODULES registered. Exits (SystemExit with the install line of
    ``kvxfer.planner.MissingDependencyError``) without typer."""
    try:
        import typer  # a plain import: --version and --help load no planner
        from typer.core import TyperCommand, TyperGroup
    except ImportError as e:
        from kvxfer.planner import MissingDependencyError
        raise SystemExit(str(MissingDependencyError("typer", "kvxfer's command line", e))) from None
    app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                      help="Plan, inspect and run KV-cache block transfers.")

    @app.callback()
    def _root(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                           help="print kvxfer's version and exit")) -> None:
        """Plan, inspect and run KV-cache block transfers."""

    for name in COMMAND_MODULES:
        importlib.import_module(f"kvxfer.cli.{name}").register(app)
    _use_plain_flags(app, _plain_flags(TyperCommand), _plain_flags(TyperGroup))
    return app


def clip(line: str, width: int = MAX_LINE) -> str:
    """One line of at most ``width`` characters."""
    line = " ".join(str(line).split())
    return line if len(line) <= width else line[:width - 3] + "..."


def error_lines(err: BaseException) -> list[str]:
    """The lines that report ``err``: one per problem (at most MAX_ERRORS, then a count), each clipped."""
    details = list(getattr(err, "details", ()) or ())
    source = getattr(err, "source", None)
    if len(details) <= 1:
        return [clip(f"kvxfer: error: {err}")]
    head = f"kvxfer: error: {source}: {len(details)} problems" if source else f"kvxfer: error: {len(details)} problems"
    lines = [clip(head)] + ["  " + clip(d) for d in details[:MAX_ERRORS]]
    if len(details) > MAX_ERRORS:
        lines.append(f"  ... and {len(details) - MAX_ERRORS} more")
    return lines


def main(argv: list[str] | None = None) -> None:
    """Run the CLI. Bad input prints one line per problem (no traceback) and exits 2; a failed driver or
    transfer prints one line and exits 1."""
    import typer

    app = build_app()
    code: object = 0
    try:
        code = app(args=argv, standalone_mode=False, prog_name="kvxfer")
    except typer.Exit as e:
        code = e.exit_code
    except typer.Abort:
        print("kvxfer: interrupted", file=sys.stderr)
        code = 130
    except (ValueError, OSError, ImportError, LookupError, TypeError, EOFError, MemoryError) as e:
        # bad input, files, extras, memory the machine (or its limits) cannot give
        print("\n".join(error_lines(e) if str(e) else [f"kvxfer: error: out of memory ({type(e).__name__})"]),
              file=sys.stderr)
        code = 2
    except (RuntimeError, TimeoutError) as e:  # ExecutorError: no driver, a failed call, a transfer that hung
        print(clip(f"kvxfer: {type(e).__name__}: {e}"), file=sys.stderr)
        code = 1
    except Exception as e:
        if not (hasattr(e, "format_message") and hasattr(e, "exit_code") and hasattr(e, "show")):
            raise
        code = e.exit_code
        if type(e).__name__ == "NoArgsIsHelpError":  # a bare group: its help, as typer would print it
            e.show()
        else:  # typer's usage errors (a bad option value, a missing argument): one line, like ours
            ctx = getattr(e, "ctx", None)
            hint = f" (see {ctx.command_path} --help)" if ctx is not None else ""
            print(clip(f"kvxfer: error: {e.format_message()}{hint}"), file=sys.stderr)
    raise SystemExit(code if isinstance(code, int) else 0)
