"""The planner's modules import in the order the architecture page states (docs/architecture.md, moved there from
the README): every module appears once in its "Planner modules, in import order" list, and imports only modules listed before it (the one documented lazy
edge, plan -> render, aside). No module imports another module's private (underscore) name."""
from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PLANNER = ROOT / "planner"
README = ROOT / "docs" / "architecture.md"  # the architecture section, moved out of the README
LAZY = {("plan", "render")}  # TransferPlan.explain / _repr_html_ / __rich__ / stats


def modules() -> set[str]:
    return {f.stem for f in PLANNER.glob("*.py") if f.stem != "__init__"}


def readme_order() -> list[str]:
    """The planner modules in the order the README's list names them: every backticked name of a module, in the
    section from its heading to the paragraph on the lazy edge."""
    text = README.read_text()
    start = text.index("## Planner modules, in import order")
    section = text[start:text.index("One documented lazy edge", start)]
    names = modules()
    return [name for name in re.findall(r"`([A-Za-z_][A-Za-z0-9_]*)`", section) if name in names]


def imports() -> dict[str, set[tuple[str, tuple[str, ...]]]]:
    """module -> {(planner module imported, names imported)} for every relative import, lazy ones included."""
    out: dict[str, set[tuple[str, tuple[str, ...]]]] = {}
    for f in sorted(PLANNER.glob("*.py")):
        found: set[tuple[str, tuple[str, ...]]] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                if node.module:
                    found.add((node.module.split(".")[0], tuple(a.name for a in node.names)))
                else:
                    found |= {(a.name, ()) for a in node.names}
        out[f.stem] = found
    return out


def test_the_readme_lists_every_planner_module_once():
    order = readme_order()
    repeated = sorted({m for m in order if order.count(m) > 1})
    assert not repeated, f"named more than once in the README's list (name each module once): {repeated}"
    assert set(order) == modules(), f"missing from the README's list: {sorted(modules() - set(order))}"


def test_each_module_imports_only_modules_listed_before_it():
    order = readme_order()
    rank = {m: i for i, m in enumerate(order)}
    late = sorted((m, t) for m, found in imports().items() if m in rank for t, _ in found
                  if t in rank and rank[t] >= rank[m] and (m, t) not in LAZY)
    assert not late, f"imports of modules listed at or after the importer (README order): {late}"


def test_the_lazy_edge_is_the_only_way_back():
    assert "plan" in {t for t, _ in imports()["render"]}  # render imports plan at module level
    order = readme_order()
    assert order.index("plan") < order.index("render")


def test_no_private_names_cross_modules():
    bad = [(m, t, n) for m, found in imports().items() for t, names in found for n in names
           if n.startswith("_") and not t.startswith("_")]
    assert not bad, bad


def test_old_module_names_are_gone():
    names = modules()
    assert not names & {"inspect", "coalesce", "layouts", "_views", "plain_path", "general_path", "layout_info",
                        "scratch"}  # inspect shadowed the standard library; the others were routes and a memo
