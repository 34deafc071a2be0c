"""The planner's modules import in one order: no cycle but the documented lazy edge plan -> render, and no
module imports another module's private (underscore) name."""
from __future__ import annotations

import ast
from pathlib import Path

PLANNER = Path(__file__).resolve().parents[1] / "planner"
LAZY = {("plan", "render")}  # TransferPlan.explain / _repr_html_ / __rich__ / stats


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


def test_no_cycle_but_the_documented_lazy_edge():
    edges = {m: {t for t, _ in found if t != m} for m, found in imports().items()}
    edges = {m: ts - {b for a, b in LAZY if a == m} for m, ts in edges.items()}
    state: dict[str, int] = {}

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges.get(m, ())):
            if state.get(t) == 1:
                raise AssertionError(f"import cycle: {' -> '.join(path + [m, t])}")
            if t not in state:
                visit(t, path + [m])
        state[m] = 2

    for m in sorted(edges):
        if m not in state:
            visit(m, [])
    assert ("render", ()) not in {(t, ()) for t, _ in imports()["render"]}
    assert "plan" in {t for t, _ in imports()["render"]}  # the lazy edge really is the only way back


def test_no_private_names_cross_modules():
    bad = [(m, t, n) for m, found in imports().items() for t, names in found for n in names
           if n.startswith("_") and not t.startswith("_")]
    assert not bad, bad


def test_old_module_names_are_gone():
    names = {f.stem for f in PLANNER.glob("*.py")}
    assert not names & {"inspect", "coalesce", "layouts", "_views"}  # inspect shadowed the standard library
