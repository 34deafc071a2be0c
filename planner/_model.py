"""Shared base for the frozen pydantic values, and edge coercion (model, dict or JSON path)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import PlanError

M = TypeVar("M", bound="Spec")


def _loc(loc: tuple[Any, ...]) -> tuple[str, int | None]:
    """('regions', 3, 'host', 'stride_bytes') -> ('regions[3].host.stride_bytes', None)."""
    text, last_index = "", None
    for part in loc:
        if isinstance(part, int):
            text, last_index = f"{text}[{part}]", part
        else:
            text = f"{text}.{part}" if text else str(part)
    return text, last_index


def _reraise(err: ValidationError, error_cls: type[PlanError]) -> PlanError:
    """Turn pydantic's first error into a PlanError whose field is the full path to the bad value."""
    first = err.errors(include_url=False)[0]
    path, _ = _loc(tuple(first["loc"]))
    cause = (first.get("ctx") or {}).get("error")
    if isinstance(cause, PlanError):
        field = cause.field or path
        if path and cause.field:  # field validators already name their field, which ends the path
            last = path.rsplit(".", 1)[-1]
            field = path + cause.field[len(last):] if cause.field.split(".")[0] == last else f"{path}.{cause.field}"
        return type(cause)(field, cause.value, cause.reason, cause.index)
    msg = first["msg"]
    return error_cls(path or error_cls.__name__, first.get("input"), msg[0].lower() + msg[1:])


class Spec(BaseModel):
    """Frozen, extra-forbidding model whose validation errors are PlanError subclasses naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)
    _error: ClassVar[type[PlanError]] = PlanError

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _reraise(e, self._error) from e

    @classmethod
    def model_validate(cls: type[M], obj: Any, **kw: Any) -> M:
        try:
            return super().model_validate(obj, **kw)
        except ValidationError as e:
            raise _reraise(e, cls._error) from e

    @classmethod
    def model_validate_json(cls: type[M], data: Any, **kw: Any) -> M:  # type: ignore[override]
        try:
            return super().model_validate_json(data, **kw)
        except ValidationError as e:
            raise _reraise(e, cls._error) from e

    @classmethod
    def coerce(cls: type[M], value: Any, field: str | None = None) -> M:
        """Accept an instance, a dict, or a path to a JSON file; return an instance."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, Path)):
            path = Path(value)
            if not path.is_file():
                raise cls._error(field or cls.__name__, str(value), "no such file")
            value = json.loads(path.read_text())
        if isinstance(value, dict):
            return cls.model_validate(value)
        raise cls._error(field or cls.__name__, type(value).__name__, f"expected {cls.__name__}, dict or JSON path")
