"""kvxfer.planner: pure planning of KV-cache block transfers. Imports numpy and pydantic only.

The public API is ``__all__``: the values (layouts, mappings, targets, options, plans), ``plan_transfer``,
the errors, the strict file loader other layers read files with (``read_bytes``, ``read_json``), the optional-import
helper every layer imports optional modules through (``import_optional``, ``MissingDependencyError``, and the
one table of optional modules, ``DEPENDENCIES``), the
message helpers models of other layers word their errors with (``Spec`` to subclass; ``shorten``,
``suggest``), ``check_alignment`` for plans over aligned (O_DIRECT) buffers, and the public submodules
``bounds`` (a plan's bound rules over arrays, which ``TransferPlan.check`` and executors' lowering apply),
``presets`` (example layouts and patterns), ``render`` (explain, HTML, rich, stats), ``diff``, ``golden`` and
``viz`` (the transfer map; matplotlib is imported only when drawing). Submodules not imported here load on
first use, so ``import kvxfer.planner`` stays cheap.
"""
from __future__ import annotations

import importlib
from typing import Any

from . import bounds, diff, render
from ._model import Spec
from .alignment import check_alignment
from .bounds import MAX_RANGE_BYTES
from .case import Case
from .column_pool import ColumnPool
from .diff import diff_plans, equivalent
from .errors import LayoutError, MappingError, PlanError, TargetError
from .files import PlanFileError, read_bytes, read_json, shorten, suggest
from .frozen import freeze, is_frozen
from .layout import Layout
from .optional import DEPENDENCIES, MissingDependencyError, import_optional
from .plan import COLUMNS, SCHEMA_VERSION, TransferPlan, format_bytes
from .planning import plan_transfer
from .spec import BlockMapping, Buffer, Direction, Fragment, Location, Placement, Region
from .target import (
    AccessOrder,
    CopyApi,
    CopyAttributes,
    LocationHint,
    PlanOptions,
    Platform,
    Target,
    cuda_version,
    hip_version,
)

_LAZY = ("golden", "presets", "viz")  # public submodules imported on first use

__all__ = [
    "AccessOrder", "BlockMapping", "Buffer", "COLUMNS", "Case", "ColumnPool", "CopyApi", "CopyAttributes",
    "DEPENDENCIES", "Direction", "Fragment", "Layout", "LayoutError", "Location", "LocationHint", "MAX_RANGE_BYTES",
    "MappingError", "MissingDependencyError", "Placement", "PlanError", "PlanFileError", "PlanOptions", "Platform",
    "Region", "SCHEMA_VERSION", "Spec", "Target", "TargetError", "TransferPlan", "bounds", "check_alignment",
    "cuda_version", "diff", "diff_plans", "equivalent", "format_bytes", "freeze", "golden", "hip_version",
    "import_optional", "is_frozen", "plan_transfer", "presets", "read_bytes", "read_json", "render", "shorten",
    "suggest", "viz",
]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
