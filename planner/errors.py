"""Exceptions raised by the planner. All are ValueError subclasses so callers can catch bad input broadly."""
from __future__ import annotations

from typing import Any


class PlanError(ValueError):
    """Bad planner input. Carries the offending ``field``, ``index`` (or None) and ``value``."""

    def __init__(self, field: str, value: Any, reason: str, index: int | None = None):
        self.field, self.index, self.value, self.reason = field, index, value, reason
        where = field if index is None else f"{field}[{index}]"
        super().__init__(f"{where} = {value!r}: {reason}")


class LayoutError(PlanError):
    """The layout (buffers, regions, placements) is inconsistent."""


class MappingError(PlanError):
    """The block mapping does not fit the layout."""


class TargetError(PlanError):
    """The target or options are invalid."""
