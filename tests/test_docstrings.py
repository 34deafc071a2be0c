"""Every public class, function and method in the installed package folders has a docstring (issue 15)."""

from __future__ import annotations

import ast
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parent.parent


def _package_dirs() -> list[Path]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [ROOT / folder for folder in config["tool"]["setuptools"]["package-dir"].values()]


def _is_overload(node: ast.FunctionDef | ast.AsyncFunctionDef) -> bool:
    for decorator in node.decorator_list:
        name = decorator.attr if isinstance(decorator, ast.Attribute) else getattr(decorator, "id", None)
        if name == "overload":
            return True
    return False


def _undocumented(body: list[ast.stmt], path: Path, prefix: str = "") -> list[str]:
    found = []
    for node in body:
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) or node.name.startswith("_"):
            continue
        if not isinstance(node, ast.ClassDef) and _is_overload(node):
            continue
        if not ast.get_docstring(node):  # an empty docstring says nothing either
            found.append(f"{path.relative_to(ROOT)}:{node.lineno} {prefix}{node.name}")
        if isinstance(node, ast.ClassDef):
            found += _undocumented(node.body, path, f"{prefix}{node.name}.")
    return found


def _public_modules() -> list[Path]:
    return [
        path
        for folder in _package_dirs()
        for path in sorted(folder.rglob("*.py"))  # subpackages too (the offload wings)
        if path.name == "__init__.py" or not path.name.startswith("_")
    ]


def test_package_folders_are_found() -> None:
    assert _public_modules(), "no modules found under [tool.setuptools.package-dir]"


def test_every_public_name_has_a_docstring() -> None:
    missing = [name for path in _public_modules() for name in _undocumented(ast.parse(path.read_text()).body, path)]
    assert not missing, f"{len(missing)} public names without a docstring:\n" + "\n".join(missing)
