"""The import graph of the installed packages: no cycles but the one documented lazy edge, no private names.

Every module under the folders that pyproject.toml maps to ``kvxfer.*`` packages is parsed with ``ast``
(nothing is imported). An edge A -> B means that running A (at import time or inside one of its functions)
imports B. Imports under ``if TYPE_CHECKING:`` never run and are left out. Importing a submodule also runs
its package's ``__init__``, except when the importer lives inside that package (it is running already).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# The one documented lazy edge: plan.explain() and friends import the rendering module inside the method,
# and the rendering module imports the plan module at its top.
LAZY_EDGES = {("kvxfer.planner.plan", "kvxfer.planner.render")}
# The test oracle may use the planner's values, never its planning code.
ORACLE_FORBIDDEN = {"plan_transfer", "planning", "checks", "build", "layout_cache", "coalesce", "layouts", "columns"}


def package_dirs() -> dict[str, Path]:
    """{package name: folder}, read from pyproject.toml's setuptools package-dir mapping."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return {name: ROOT / folder for name, folder in cfg["package-dir"].items()}


def modules() -> dict[str, tuple[Path, bool]]:
    """{module name: (file, is_package)} for every .py file of every mapped package."""
    out = {}
    for pkg, folder in package_dirs().items():
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("").parts
            if rel[-1] == "__init__":
                out[".".join((pkg, *rel[:-1]))] = (path, True)
            else:
                out[".".join((pkg, *rel))] = (path, False)
    return out


MODULES = modules()


def _type_checking_only(node: ast.AST) -> bool:
    test = node.test if isinstance(node, ast.If) else None
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _walk(tree: ast.AST):
    """ast.walk that skips the bodies of ``if TYPE_CHECKING:`` (their else branches still run)."""
    stack = [tree]
    while stack:
        node = stack.pop()
        yield node
        if _type_checking_only(node):
            stack.extend(node.orelse)
            continue
        stack.extend(ast.iter_child_nodes(node))


def _resolve(module: str, is_pkg: bool, level: int, target: str | None) -> str:
    if level == 0:
        return target or ""
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


class Imports:
    """One module's internal import edges, its imports of private names, and the names it imports."""

    def __init__(self, name: str):
        path, is_pkg = MODULES[name]
        self.name, self.edges, self.private, self.names = name, set(), [], []
        tree = ast.parse(path.read_text(), str(path))
        bound: dict[str, str] = {}  # local name -> internal module it is bound to
        for node in _walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    self._edge(a.name, submodule=True)
                    if a.asname and a.name in MODULES:
                        bound[a.asname] = a.name
            elif isinstance(node, ast.ImportFrom):
                src = _resolve(name, is_pkg, node.level, node.module)
                for a in node.names:
                    full = f"{src}.{a.name}"
                    self.names.append((src, a.name))
                    if full in MODULES:
                        self._edge(full, submodule=True)
                        if src in MODULES and src != self.name:  # `from pkg import sub` reads the package too:
                            self.edges.add(src)  # import a submodule's names from the submodule itself
                        bound[a.asname or a.name] = full
                        continue
                    self._edge(src, submodule=False)
                    if a.name.startswith("_") and not a.name.startswith("__") and src in MODULES:
                        self.private.append(f"line {node.lineno}: from {src} import {a.name}")
        for node in _walk(tree):  # module.attr where the module is internal and attr is private
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in bound
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                self.private.append(f"line {node.lineno}: {bound[node.value.id]}.{node.attr}")

    def _edge(self, target: str, submodule: bool) -> None:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            mod = ".".join(parts[:i])
            if mod not in MODULES or mod == self.name:
                continue
            last = i == len(parts)
            # parents of a submodule import run first, unless the importer is inside them (already running)
            if (not last or submodule) and self.name.startswith(mod + "."):
                continue
            self.edges.add(mod)


IMPORTS = {m: Imports(m) for m in MODULES}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_the_mapped_packages_are_found():
    assert {"kvxfer.planner", "kvxfer.executors", "kvxfer.testing"} <= set(MODULES)
    assert "kvxfer.testing.oracle" in MODULES


def test_no_import_cycles_but_the_documented_lazy_edge():
    graph = {m: {t for t in imp.edges if (m, t) not in LAZY_EDGES} for m, imp in IMPORTS.items()}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_cycle_finder_finds_cycles():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_module_imports_another_modules_private_name():
    bad = [f"{m}: {p}" for m, imp in IMPORTS.items() for p in imp.private]
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


@pytest.mark.parametrize("layer,forbidden", [
    ("kvxfer.planner", ("kvxfer.executors", "kvxfer.cli", "kvxfer.testing", "kvxfer.offload")),
    ("kvxfer.executors", ("kvxfer.cli", "kvxfer.testing", "kvxfer.offload")),
    ("kvxfer.offload", ("kvxfer.cli", "kvxfer.testing")),
    ("kvxfer.testing", ("kvxfer.cli", "kvxfer.offload")),
])
def test_layers_import_only_the_layers_below(layer, forbidden):
    bad = [f"{m} -> {t}" for m, imp in IMPORTS.items() if m == layer or m.startswith(layer + ".")
           for t in imp.edges if t.startswith(forbidden)]
    assert not bad, "\n".join(bad)


def test_the_oracle_imports_no_planning_code():
    """kvxfer.testing may import the planner's values (Layout, BlockMapping, ...), never plan_transfer or
    a planning module, so a planner bug cannot hide in the expected result."""
    bad = []
    for m, imp in IMPORTS.items():
        if not m.startswith("kvxfer.testing"):
            continue
        for src, name in imp.names:
            if src.startswith("kvxfer.planner") and ({name, src.rsplit(".", 1)[-1]} & ORACLE_FORBIDDEN):
                bad.append(f"{m}: from {src} import {name}")
    assert not bad, "\n".join(bad)


def _public_api(pkg: str) -> set[str] | None:
    import importlib
    names = getattr(importlib.import_module(pkg), "__all__", None)
    return None if names is None else set(names)


def test_layers_cross_only_through_the_public_api():
    """An import from one kvxfer package into another names only what the target package's ``__init__``
    exports (its ``__all__``, public submodules included): internals stay free to change."""
    packages = sorted({m for m, (_, is_pkg) in MODULES.items() if is_pkg and m.count(".") == 1})
    api = {p: _public_api(p) for p in packages}
    bad = []
    for m, imp in IMPORTS.items():
        own = ".".join(m.split(".")[:2])
        for src, name in imp.names:
            target = ".".join(src.split(".")[:2])
            if target == own or target not in api:
                continue
            # `from kvxfer.planner import Layout` / `from kvxfer.planner.presets import x` (presets is public)
            pub = api[target]
            public = pub is not None and (name in pub if src == target else src.split(".")[2] in pub)
            if not public:
                bad.append(f"{m}: from {src} import {name}")
    assert not bad, "cross-layer imports outside the target's __all__:\n" + "\n".join(bad)


# ---- offload: a core and wings --------------------------------------------------------------------------------
OFFLOAD = ROOT / "offload"
WINGS = ("kvxfer.offload.files", "kvxfer.offload.vllm")


def _module_dicts(tree: ast.Module) -> dict[str, list[str]]:
    """The module-level dicts of string values (a name table such as a face's CLASSES): name -> values."""
    out = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
            values = [v.value for v in node.value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            out.update({t.id: values for t in node.targets if isinstance(t, ast.Name)})
    return out


def by_name(module: str) -> set[str]:
    """The internal modules ``module`` imports by name through ``importlib.import_module``: a literal name, or an
    f-string whose fields are ``__name__``, entries of a module-level name table (each of its values), or anything
    else (any one dotted part: every module the name could be). A leading dot is relative to this module's package
    (a face passes its own ``__name__``)."""
    path, is_pkg = MODULES[module]
    tree = ast.parse(path.read_text())
    tables, out = _module_dicts(tree), set()
    package = module if is_pkg else module.rsplit(".", 1)[0]
    for node in _walk(tree):
        if not (isinstance(node, ast.Call) and getattr(node.func, "attr", None) == "import_module" and node.args):
            continue
        arg, names = node.args[0], [""]
        for part in (arg.values if isinstance(arg, ast.JoinedStr) else [arg]):
            if isinstance(part, ast.Constant) and isinstance(part.value, str):
                options = [part.value]
            elif isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Name) and part.value.id == "__name__":
                options = [module]
            elif (isinstance(part, ast.FormattedValue) and isinstance(part.value, ast.Subscript)
                  and isinstance(part.value.value, ast.Name) and part.value.value.id in tables):
                options = tables[part.value.value.id]
            else:
                options = ["*"]
            names = [n + o for n in names for o in options]
        for name in names:
            if name.startswith("."):
                name = package + name
            pattern = re.compile(re.escape(name).replace(r"\*", r"[^.]+") + "$")
            out |= {m for m in MODULES if pattern.match(m)}
    return out


def _room(module: str) -> str:
    return next((w for w in WINGS if module == w or module.startswith(w + ".")), "core")


def test_offloads_imports_hold_no_cycle_counting_imports_by_name():
    """Imports by name through importlib (a face loading its wing's classes) count as edges too, so a face and a
    module that imports it can no longer form a circle unseen."""
    offload = [m for m in MODULES if m == "kvxfer.offload" or m.startswith("kvxfer.offload.")]
    graph = {m: {t for t in IMPORTS[m].edges | by_name(m) if t in offload} for m in offload}
    cycles = _cycles(graph)
    assert not cycles, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in cycles)


def test_the_offload_core_imports_no_wing_not_even_by_name():
    """The core (offload's own modules, below its face) knows no engine and no storage kind."""
    core = [m for m in MODULES if m.startswith("kvxfer.offload.") and _room(m) == "core"]
    assert {"kvxfer.offload.worker", "kvxfer.offload.graph", "kvxfer.offload.lanes"} <= set(core)
    bad = [f"{m} -> {t}" for m in core for t in IMPORTS[m].edges | by_name(m) if _room(t) != "core"]
    assert not bad, "\n".join(bad)


def test_the_vllm_wing_builds_no_class_at_run_time():
    """vLLM's classes are ordinary top-level classes: no class statement inside a function, no type(name, bases,
    namespace), no __qualname__ rewritten; and no offload/vllm_*.py module is left beside the wing."""
    assert not sorted(p.name for p in OFFLOAD.glob("vllm_*.py"))
    bad = []
    for path in sorted((OFFLOAD / "vllm").glob("*.py")):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                bad += [f"{path.name}:{c.lineno}: class {c.name} in {node.name}()" for c in ast.walk(node)
                        if isinstance(c, ast.ClassDef)]
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "type" \
                    and len(node.args) == 3:
                bad.append(f"{path.name}:{node.lineno}: type(...) with three arguments")
            if isinstance(node, ast.Attribute) and node.attr in ("__qualname__", "__module__") \
                    and isinstance(node.ctx, ast.Store):
                bad.append(f"{path.name}:{node.lineno}: {node.attr} rewritten")
    assert not bad, "\n".join(bad)


def test_the_by_name_finder_finds_a_faces_name_table():
    assert {"kvxfer.offload.vllm.spec", "kvxfer.offload.vllm.connector", "kvxfer.offload.vllm.tiers"} <= \
        by_name("kvxfer.offload.vllm")
    assert "kvxfer.offload.files" in by_name("kvxfer.offload")
