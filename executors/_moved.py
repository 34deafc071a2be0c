"""The import paths of executor modules that became private still import, with a DeprecationWarning.

``kvxfer.executors.binding``, ``.lowering``, ``.ops_numpy`` and the others in ``MOVED`` were public submodules;
their public names are now re-exported by ``kvxfer.executors`` itself and the modules are private
(``kvxfer.executors._binding`` ...). Importing an old path warns once per process, naming the new one, and
gives the private module itself (so ``from kvxfer.executors.binding import BoundMemory`` is the same class
as ``kvxfer.executors.BoundMemory``). The package installs the finder below when it is imported (once).
"""
from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

PACKAGE = "kvxfer.executors"
MOVED = {name: f"_{name}" for name in ("binding", "dma", "lowering", "memory", "ops_cuda", "ops_hip", "ops_nixl",
                                       "ops_numpy", "ops_posix", "ops_triton", "options", "pinning")}


def message(old: str) -> str:
    """The warning for old submodule ``old``: where its names are now."""
    return (f"{PACKAGE}.{old} is deprecated: import its public names from {PACKAGE} (the module is now the private "
            f"{PACKAGE}.{MOVED[old]})")


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the old paths of ``MOVED`` and loads each as its private module, warning."""

    def find_spec(self, fullname: str, path: Sequence[str] | None = None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        package, _, name = fullname.rpartition(".")
        return importlib.machinery.ModuleSpec(fullname, self) if package == PACKAGE and name in MOVED else None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return None  # a placeholder; exec_module puts the private module in its place

    def exec_module(self, module: ModuleType) -> None:
        old = module.__name__.rpartition(".")[2]
        warnings.warn(message(old), DeprecationWarning, stacklevel=2)  # the importer's line (import frames skipped)
        sys.modules[module.__name__] = importlib.import_module(f"{PACKAGE}.{MOVED[old]}")


FINDER = MovedModules()


def install() -> None:
    """Put the finder on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, MovedModules) for f in sys.meta_path):
        sys.meta_path.append(FINDER)
