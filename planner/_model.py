"""Shared base for the frozen pydantic values, and edge coercion (model, dict or JSON path)."""
from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar, TypeVar, get_args

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from .errors import PlanError
from .files import parse_json, shorten, suggest

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


def _model_at(model: Any, loc: tuple[Any, ...]) -> Any:
    """The pydantic model class that the path ``loc`` (below ``model``) points into, or None."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = getattr(model, "model_fields", {}).get(part)
        if field is None:
            return None
        model = next((t for t in _types(field.annotation) if isinstance(t, type) and issubclass(t, BaseModel)), None)
    return model


def _types(annotation: Any) -> list[Any]:
    args = get_args(annotation)
    return [t for a in args for t in _types(a)] if args else [annotation]


def _reraise(err: ValidationError, error_cls: type[PlanError], model: Any = None) -> PlanError:
    """Turn pydantic's errors into one PlanError whose field is the full path to the first bad value.

    Every error becomes one short line in ``.details``; an unknown key says which known key it resembles, and
    the "field required" of the key it was probably meant to be is dropped. Values are never dumped whole.
    """
    errors = err.errors(include_url=False)
    unknown = {_loc(tuple(e["loc"]))[0] for e in errors if e["type"] == "extra_forbidden"}
    made: list[PlanError] = []
    lines: list[str] = []
    for e in errors:
        loc = tuple(e["loc"])
        path, _ = _loc(loc)
        cause = (e.get("ctx") or {}).get("error")
        if isinstance(cause, PlanError):
            field = cause.field or path
            if path and cause.field:  # field validators already name their field, which ends the path
                last = path.rsplit(".", 1)[-1]
                field = path + cause.field[len(last):] if cause.field.split(".")[0] == last else f"{path}.{cause.field}"
            made.append(type(cause)(field, shorten(cause.value), cause.reason, cause.index))
            nested = getattr(cause, "details", ())  # a nested model's own errors, already one line each
            lines += [f"{path}.{d}" if path else d for d in nested] if len(nested) > 1 else [str(made[-1])]
            continue
        known = list(getattr(_model_at(model, loc[:-1]), "model_fields", {}))
        if e["type"] == "extra_forbidden":
            made.append(error_cls(path, shorten(e.get("input")), f"unknown key {loc[-1]!r}{suggest(loc[-1], known)}"))
            lines.append(str(made[-1]))
        elif e["type"] == "missing":
            parent = path.rsplit(".", 1)[0] if "." in path else ""
            siblings = [u.rsplit(".", 1)[-1] for u in unknown if (u.rsplit(".", 1)[0] if "." in u else "") == parent]
            if not any(suggest(s, [loc[-1]]) for s in siblings):  # else reported as the typo'd key
                made.append(error_cls(path, None, "required key missing"))
                lines.append(str(made[-1]))
        else:
            msg = e["msg"]
            made.append(error_cls(path or error_cls.__name__, shorten(e.get("input")), msg[0].lower() + msg[1:]))
            lines.append(str(made[-1]))
    first = made[0]
    first.details = tuple(lines)  # type: ignore[attr-defined]
    if len(lines) > 1:
        first.args = (f"{first.args[0]} (and {len(lines) - 1} more: {'; '.join(lines[1:3])}"
                      f"{'; ...' if len(lines) > 3 else ''})",)
    return first


class IntTuple(tuple[int, ...]):
    """A tuple made of Python ints by its maker (once per layout): values that take a tuple of ints keep it as
    it is instead of converting every entry again on each plan."""

    __slots__ = ()


@functools.cache
def _kind_fields(cls: type) -> tuple[frozenset[str], frozenset[str]]:
    """(names of the fields that take an integer but not a bool, names of the fields that take only a bool)."""
    ints, bools = set(), set()
    for name, field in cls.model_fields.items():  # type: ignore[attr-defined]
        kinds = _types(field.annotation)
        if int in kinds and bool not in kinds:
            ints.add(field.alias or name)
        elif kinds == [bool]:
            bools.add(field.alias or name)
    return frozenset(ints), frozenset(bools)


class Spec(BaseModel):
    """Frozen, extra-forbidding model whose validation errors are PlanError subclasses naming the field."""

    model_config = ConfigDict(frozen=True, extra="forbid", use_enum_values=False)
    _error: ClassVar[type[PlanError]] = PlanError
    _lenient: ClassVar[frozenset[str]] = frozenset()  # integer fields with their own parser (of floats too)

    @model_validator(mode="before")
    @classmethod
    def _strict_kinds(cls, data: Any) -> Any:
        """Refuse what pydantic would coerce silently: True or 2.0 as an integer, "yes" or 1 as a bool. (Digit
        strings stay accepted for integers: configuration read from the environment arrives as text.)"""
        if isinstance(data, dict):
            ints, bools = _kind_fields(cls)
            for name in (ints - cls._lenient) & data.keys():
                v = data[name]
                if isinstance(v, (bool, float)):
                    raise cls._error(name, v, f"expected an integer, got {type(v).__name__}")
            for name in bools & data.keys():
                if not isinstance(data[name], bool):
                    raise cls._error(name, data[name], f"expected true or false, got {type(data[name]).__name__}")
        return data

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as e:
            raise _reraise(e, self._error, type(self)) from None

    @classmethod
    def model_validate(cls: type[M], obj: Any, **kw: Any) -> M:
        try:
            return super().model_validate(obj, **kw)
        except ValidationError as e:
            raise _reraise(e, cls._error, cls) from None

    @classmethod
    def model_validate_json(cls: type[M], data: Any, **kw: Any) -> M:  # type: ignore[override]
        try:
            return super().model_validate_json(data, **kw)
        except ValidationError as e:
            raise _reraise(e, cls._error, cls) from None

    @classmethod
    def coerce(cls: type[M], value: Any, field: str | None = None) -> M:
        """Accept an instance, a dict, or a path to a JSON file; return an instance."""
        if isinstance(value, cls):
            return value
        if isinstance(value, (str, Path)):
            path = Path(value)
            if not path.is_file():
                raise cls._error(field or cls.__name__, str(value), "no such file")
            value = parse_json(path.read_bytes(), str(path))
        if isinstance(value, dict):
            return cls.model_validate(value)
        raise cls._error(field or cls.__name__, type(value).__name__, f"expected {cls.__name__}, dict or JSON path")
