"""Build kvxfer's API reference with pdoc: ``python tests/reference/reference.py OUT`` (what ``make docs`` runs).

What it documents, and how it differs from a bare ``pdoc`` run:

- **Pages.** Every package in pyproject's ``package-dir`` but the CLI, each public submodule (a module its
  package lists in ``__all__``, which pdoc follows, or one the README has users import by its dotted path:
  ``SUBMODULES``, skipped while a module does not exist), and one page per ``kvxfer`` command, generated from
  the typer app.
- **The index** opens on the entry points (``ENTRY_POINTS``, in that order; one that does not exist yet is
  left out), then the packages, the command line and the pytest plugin.
- **Entry points first.** On each page the entry points it holds come before its other names.
- **Real defaults.** pdoc reads a pydantic model's required fields as ``= PydanticUndefined``; they are shown
  without a default, and fields with a default factory with the factory's value.
- **Every public name.** A package's ``__all__`` names that load on first use (PEP 562 ``__getattr__``) are
  resolved before pdoc looks, so they are documented like the others.
"""
from __future__ import annotations

import ast
import dataclasses
import html
import importlib
import importlib.util
import sys
from collections.abc import Iterable
from pathlib import Path
from types import ModuleType
from typing import Any

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TEMPLATES = Path(__file__).resolve().parent / "templates"
ENTRY_POINTS = ("kvxfer.planner.plan_transfer", "kvxfer.planner.TransferPlan", "kvxfer.executors.get_executor",
                "kvxfer.offload.create_worker", "kvxfer.offload.vllm.KvxferOffloadingSpec")
# submodules users import by path (README, docstrings) whether or not their package's __all__ lists them
SUBMODULES = ("kvxfer.planner.presets", "kvxfer.planner.viz", "kvxfer.planner.render", "kvxfer.planner.diff",
              "kvxfer.planner.golden", "kvxfer.planner.files", "kvxfer.executors.config", "kvxfer.executors.torch_layout",
              "kvxfer.executors.file_tier", "kvxfer.executors.nixl_memory", "kvxfer.executors.nixl_peer",
              "kvxfer.offload.files.spill", "kvxfer.offload.files.file_tier", "kvxfer.offload.files.chunk_store",
              "kvxfer.offload.graph", "kvxfer.offload.vllm", "kvxfer.offload.vllm.checks", "kvxfer.offload.checksums",
              "kvxfer.testing.pytest_plugin")
CLI_FOLDER = "cli"


def packages() -> list[str]:
    """The documented packages: pyproject's ``package-dir`` in its order, the CLI left out (it has its own pages)."""
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [name for name in config["tool"]["setuptools"]["package-dir"] if name != "kvxfer.cli"]


def exists(name: str) -> bool:
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:  # only the module itself missing counts as "not yet"; other errors surface
        if e.name is not None and (name == e.name or name.startswith(e.name + ".")):
            return False
        raise
    return True


def _resolve_lazy_names(module: Any) -> None:
    """Put every ``__all__`` name of ``module`` that loads on first use into its namespace, so pdoc sees it."""
    for name in getattr(module, "__all__", ()):
        if name not in vars(module):
            try:
                setattr(module, name, getattr(module, name))
            except ImportError as e:  # needs an optional dependency this machine lacks (vLLM's classes)
                doc = _class_doc(module, name)
                if doc is not None:
                    setattr(module, name, _stand_in(module.__name__, name, doc, str(e)))
            except AttributeError:
                pass  # a submodule pdoc imports itself, or a name that cannot load here: the check reports it
        value = vars(module).get(name)
        if isinstance(value, ModuleType) and hasattr(value, "__path__") and value.__name__ == f"{module.__name__}.{name}":
            _resolve_lazy_names(value)  # a subpackage (a wing): pdoc reads its __all__ while walking


def _class_doc(module: Any, name: str) -> str | None:
    """The docstring of class ``name`` that ``module`` loads on first access from the submodule its ``CLASSES`` table
    names, read from that submodule's source (importing it needs what this machine lacks)."""
    sub = getattr(module, "CLASSES", {}).get(name)
    spec = importlib.util.find_spec(f"{module.__name__}.{sub}") if isinstance(sub, str) else None
    if spec is None or spec.origin is None:
        return None
    tree = ast.parse(Path(spec.origin).read_text())
    return next((ast.get_docstring(n) for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name), None)


def _stand_in(module: str, name: str, doc: str, missing: str) -> type:
    """A class that documents ``module.name`` where it cannot be built (its base class needs a package this
    machine lacks): its docstring, read from its source, and what building it needs."""
    return type(name, (), {"__doc__": f"{doc}\n\nLoaded on first access; it needs: {missing}", "__module__": module})


def _entry_rank(fullname: str) -> int:
    return ENTRY_POINTS.index(fullname) if fullname in ENTRY_POINTS else len(ENTRY_POINTS)


def _real_defaults(doc: Any) -> None:
    """Replace pdoc's PydanticUndefined defaults of pydantic fields (in ``doc``, a class, and its members)."""
    import pdoc.doc
    from pydantic import BaseModel
    from pydantic_core import PydanticUndefined

    if not (isinstance(doc, pdoc.doc.Class) and isinstance(doc.obj, type) and issubclass(doc.obj, BaseModel)):
        return
    fields = doc.obj.model_fields
    for member in doc.own_members:
        if isinstance(member, pdoc.doc.Variable) and member.default_value is PydanticUndefined:
            field = fields.get(member.name)
            factory = getattr(field, "default_factory", None)
            member.default_value = factory() if callable(factory) else pdoc.doc.empty  # type: ignore[call-arg]
            member.__dict__.pop("default_value_str", None)


def _order_members(module: Any) -> None:
    """Entry points first (in ENTRY_POINTS order), the other names as pdoc ordered them."""
    members = module.members
    ranked = sorted(members, key=lambda name: (_entry_rank(f"{module.modulename}.{name}"), list(members).index(name)))
    module.members = {name: members[name] for name in ranked}
    for cached in ("own_members", "flattened_own_members"):
        module.__dict__.pop(cached, None)


def _walk(doc: Any) -> Iterable[Any]:
    yield doc
    for member in getattr(doc, "own_members", ()):
        if hasattr(member, "own_members"):
            yield from _walk(member)


def load_modules() -> dict[str, Any]:
    """The pdoc ``Module`` of every documented module, by name, ready to render (see the module docstring)."""
    import pdoc.doc
    import pdoc.extract

    names: list[str] = []
    for pkg in packages():
        _resolve_lazy_names(importlib.import_module(pkg))
        names += list(pdoc.extract.walk_specs([pkg]))  # the package and the submodules its __all__ lists
    names += [m for m in SUBMODULES if m not in names and m.rsplit(".", 1)[0] in names and exists(m)]
    for name in names:  # submodules may load names on first use too (vLLM's classes)
        _resolve_lazy_names(importlib.import_module(name))
    modules = {name: pdoc.doc.Module.from_name(name) for name in names}
    for name, module in modules.items():
        subs = [modules[m] for m in names if m.rsplit(".", 1)[0] == name and "._" not in m]
        if subs:  # the package page lists the submodules users import by path too
            module.submodules = subs
        _order_members(module)
        for doc in _walk(module):
            _real_defaults(doc)
    return modules


# ---- the command line -------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class CliParam:
    """One argument or option of a command, as its page shows it."""

    names: str
    value: str
    default: str
    help: str


@dataclasses.dataclass(frozen=True)
class CliCommand:
    """One ``kvxfer`` command: its path (``golden check``), usage line, description and parameters."""

    path: str
    usage: str
    help: str
    params: tuple[CliParam, ...]
    subcommands: tuple[str, ...]

    @property
    def page(self) -> str:
        """The page's file name under the CLI folder."""
        return ("-".join(self.path.split()) or "index") + ".html"


def cli_commands() -> list[CliCommand]:
    """Every command of the typer app, depth first, read from the click objects typer builds."""
    from typer.main import get_command

    from kvxfer.cli.main import build_app

    out: list[CliCommand] = []

    def walk(cmd: Any, path: list[str], parent: Any) -> None:
        ctx = cmd.context_class(cmd, info_name=" ".join(["kvxfer", *path]), parent=parent)
        params = []
        for p in cmd.get_params(ctx):
            flag = getattr(p, "is_flag", False)
            names = ", ".join([*p.opts, *getattr(p, "secondary_opts", [])]) if p.param_type_name == "option" \
                else (p.metavar or p.name.upper())
            shown_type = p.display_type(ctx) if hasattr(p, "display_type") else getattr(p.type, "name", "")
            value = "" if flag else (p.metavar or str(shown_type).strip("<>").upper())
            default = p.default
            unset = default is None or default is False or default == () or callable(default)
            shown = "" if unset or p.param_type_name == "argument" else str(getattr(default, "value", default))
            text = (p.help or "").replace("\\[", "[")  # rich markup escapes a bracket in typer's help strings
            params.append(CliParam(names, value if p.param_type_name == "option" else "", shown,
                                   text + (" (required)" if p.required else "")))
        subs = sorted(getattr(cmd, "commands", {}))
        usage = " ".join(["kvxfer", *path, *cmd.collect_usage_pieces(ctx)]).replace("{", "").replace("}", "")
        out.append(CliCommand(" ".join(path), usage, (cmd.help or "").strip(), tuple(params), tuple(subs)))
        for name in subs:
            walk(cmd.commands[name], [*path, name], ctx)

    walk(get_command(build_app()), [], None)
    return out


# ---- rendering --------------------------------------------------------------------------------------------
def _first_paragraph(doc: Any) -> str:
    """The first paragraph of ``doc``'s docstring as HTML (converted as pdoc converts docstrings)."""
    import markupsafe
    import pdoc.docstrings
    import pdoc.render_helpers

    text = (doc.docstring or "").strip().split("\n\n")[0]
    markdown = pdoc.docstrings.convert(text, "google", doc.source_file)
    return markupsafe.Markup(pdoc.render_helpers.to_html(markdown))  # type: ignore[no-any-return]


def _signature(doc: Any) -> str:
    """A function's signature; for a class, none (the class's page shows how it is made)."""
    return str(doc.signature) if doc.kind == "function" else ""


def _entry_points(modules: dict[str, Any]) -> list[dict[str, str]]:
    found = []
    for full in ENTRY_POINTS:
        module_name, name = full.rsplit(".", 1)
        module = modules.get(module_name)
        doc = module.get(name) if module is not None else None
        if doc is None:
            continue  # not written yet: the index picks it up once its module exists
        sig = _signature(doc)
        found.append({"name": full, "href": f"{module_name.replace('.', '/')}.html#{name}", "kind": doc.kind,
                      "signature": f"{name}{sig}" if sig else f"class {name}", "summary": _first_paragraph(doc)})
    return found


def render(out: Path) -> list[Path]:
    """Write the reference into ``out``: a page per module, the index, the search index, and a page per command
    under ``cli/``. Returns the files written."""
    import pdoc.render

    pdoc.render.configure(docformat="google", template_directory=TEMPLATES, show_source=False,
                          footer_text="kvxfer API reference")
    modules = load_modules()
    written = []
    for module in modules.values():
        page = out / f"{module.fullname.replace('.', '/')}.html"
        page.parent.mkdir(parents=True, exist_ok=True)
        page.write_text(pdoc.render.html_module(module, modules))
        written.append(page)
    commands = cli_commands()
    env = pdoc.render.env
    env.globals["kvxfer_entry_points"] = _entry_points(modules)
    env.globals["kvxfer_packages"] = [
        {"name": p, "href": f"{p.replace('.', '/')}.html", "summary": _first_paragraph(modules[p]),
         "submodules": [{"name": s.modulename, "href": f"{s.modulename.replace('.', '/')}.html"}
                        for s in modules[p].submodules]} for p in packages()]
    env.globals["kvxfer_commands"] = commands
    index = out / "index.html"
    index.write_text(pdoc.render.html_index(modules))
    search = pdoc.render.search_index(modules)
    if search:
        (out / "search.js").write_text(search)
    written += [index, out / "search.js"]
    (out / CLI_FOLDER).mkdir(parents=True, exist_ok=True)
    template = env.get_template("cli.html.jinja2")
    for cmd in commands:
        page = out / CLI_FOLDER / cmd.page
        page.write_text(template.render(command=cmd, commands=commands, all_modules=modules, escape=html.escape))
        written.append(page)
    return written


if __name__ == "__main__":
    target = Path(sys.argv[1] if len(sys.argv) > 1 else "build/docs")
    files = render(target)
    print(f"API reference: {target / 'index.html'} ({len(files)} files)")
