"""kvxfer schema: what a case file holds, as a readable outline (80 columns) or as its JSON Schema."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import typer

WIDTH = 80


def _type(prop: dict[str, Any]) -> str:
    """A property's type in a few words: a definition's name, a JSON type, ``list of X``, ``a | b``."""
    if "$ref" in prop:
        return str(prop["$ref"]).rsplit("/", 1)[-1]
    if "anyOf" in prop:
        return " | ".join(_type(p) for p in prop["anyOf"])
    if "enum" in prop:
        return " | ".join(json.dumps(v) for v in prop["enum"])
    kind = prop.get("type", "any")
    if kind == "array":
        return f"list of {_type(prop.get('items', {}))}"
    return str(kind)


def _wrap(text: str, first: str, indent: str) -> list[str]:
    """``text`` wrapped at WIDTH, paragraph by paragraph: the first line starts with ``first``, every other
    line with ``indent``."""
    out: list[str] = []
    for para in text.strip().split("\n\n"):
        out += textwrap.wrap(" ".join(para.split()), WIDTH, initial_indent=indent if out else first,
                             subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return out


def _definition(name: str, d: dict[str, Any]) -> list[str]:
    if "enum" in d:
        return _wrap(f"{name}: one of {_type(d)}. {d.get('description', '')}", "", "  ") + [""]
    lines = _wrap(f"{name}: {d.get('description', '')}", "", "  ")
    props: dict[str, dict[str, Any]] = d.get("properties", {})
    required = set(d.get("required", ()))
    width = max((len(p) for p in props), default=0)
    for p, spec in props.items():
        what = _type(spec) + ("; required" if p in required else
                              f"; default {json.dumps(spec['default'])}" if "default" in spec else "")
        lines += textwrap.wrap(f"    {p:<{width}}  {what}", WIDTH, subsequent_indent=" " * (width + 8),
                               break_long_words=False, break_on_hyphens=False)
    return lines + [""]


def outline(schema: dict[str, Any]) -> str:
    """The JSON Schema of a case file as text of at most WIDTH columns: the case, then each definition it
    uses, with the definition's description and every field's type and default (or ``required``)."""
    head = ["A case file is JSON holding a Case (kvxfer schema --json: its JSON Schema).", ""]
    body = _definition(schema.get("title", "Case"), schema)
    for name, d in schema.get("$defs", {}).items():
        body += _definition(name, d)
    return "\n".join(head + body).rstrip() + "\n"


def register(app: typer.Typer) -> None:
    """Add the ``schema`` command to ``app``."""

    @app.command("schema")
    def schema_cmd(as_json: bool = typer.Option(False, "--json", help="print the JSON Schema itself (for editors "
                                                "and validators; descriptions stay on one line each)"),
                   out: Path | None = typer.Option(None, "--out", "-o", metavar="OUT",
                                                   help="write the JSON Schema to this file")) -> None:
        """Print what case files hold (what kvxfer plan, diff and run read): an outline, or --json."""
        from kvxfer.planner import Case

        schema = Case.json_schema()
        text = json.dumps(schema, indent=1) + "\n"
        if out is not None:
            out.write_text(text)
            typer.echo(f"wrote {out}", err=True)
        else:
            typer.echo(text if as_json else outline(schema), nl=False)
