"""Block id lists: the conversions and refusals every input form of a mapping shares, each worded once.

``BlockMapping`` validates with ``as_ids`` (a checked, read-only copy) and the planner's front end borrows a
caller's integer numpy arrays with ``borrow_ids`` (no copy; the values are checked later, on id runs where it
can). Both name a refusal with the same field, index and words, so a mapping refuses alike whatever its form.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import MappingError

INT64_MAX = int(np.iinfo(np.int64).max)
_INT64 = np.dtype(np.int64)  # the native int64 dtype: arrays of it share this object, so most checks are one identity
MAPPING_KEYS = frozenset(("direction", "src_ids", "dst_ids", "group_sizes", "group_starts"))
REQUIRED_KEYS = frozenset(("direction", "src_ids", "dst_ids"))


def as_ids(value: Any, field: str) -> np.ndarray:
    """Block ids as a read-only int64 array of their own (the caller may reuse its array). Refuses, naming the
    field and the index: non-integers (floats too, even whole ones such as 2.0 or -0.0: one rule for every
    input form, as layouts and plan files), more than one dimension, ids past int64, and negative ids (last, so
    a negative id is named after the list's form and before anything else about the mapping)."""
    if isinstance(value, np.ndarray) and value.dtype.kind in "iu":
        arr = value
    else:
        if value is None or isinstance(value, (dict, str, bytes)) or not hasattr(value, "__len__"):
            raise MappingError(field, type(value).__name__, "expected a list or array of integer block ids")
        try:
            arr = np.asarray(value)
        except (TypeError, ValueError, OverflowError) as e:
            raise MappingError(field, type(value).__name__, f"not an array of integers ({e})") from None
        if arr.dtype.kind == "O" and arr.ndim == 1:  # Python ints beyond int64, None, objects
            for i, v in enumerate(arr.tolist()):
                shown = v if isinstance(v, (int, float, str, type(None))) else type(v).__name__
                if not isinstance(v, int) or isinstance(v, bool):
                    raise MappingError(field, shown, "block ids must be integers", i)
                if not 0 <= v <= INT64_MAX:
                    raise MappingError(field, v, "block ids must be non-negative" if v < 0 else "block id does not fit int64", i)
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu" and arr.size:  # bools, floats (even 2.0 and -0.0), strings
            i = _first_not_int(value) if arr.ndim == 1 else 0
            first = arr.flat[i]
            raise MappingError(field, first.item() if hasattr(first, "item") else first, "block ids must be integers",
                               i if arr.ndim else None)
    _check_form(arr, field)
    out = np.array(arr, dtype=np.int64, copy=True)
    if out.size and np.minimum.reduce(out) < 0:
        refuse_negative(out, field)
    out.flags.writeable = False
    return out


def _first_not_int(value: Any) -> int:
    """The index of the first entry of a list that is not a plain integer (0 for an array, whose entries all share
    one kind)."""
    if isinstance(value, (list, tuple)):
        return next((i for i, v in enumerate(value)
                     if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_))), 0)
    return 0


def borrow_ids(arr: np.ndarray, field: str) -> np.ndarray:
    """An integer id array as int64, not copied when it is int64 already; its form is checked as ``as_ids``
    checks it, its values are not (see ``refuse_negative``)."""
    _check_form(arr, field)
    return arr if arr.dtype is _INT64 or arr.dtype == _INT64 else arr.astype(np.int64)


def _check_form(arr: np.ndarray, field: str) -> None:
    if arr.ndim != 1:
        raise MappingError(field, f"shape {arr.shape}", "block ids must be one-dimensional")
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > INT64_MAX:
        i = int(np.argmax(arr))
        raise MappingError(field, int(arr[i]), "block id does not fit int64", i)


def refuse_negative(ids: np.ndarray, field: str) -> None:
    """Raise MappingError naming the first negative id of ``ids`` (the error path of every non-negativity check)."""
    i = int(np.argmax(ids < 0))
    raise MappingError(field, int(ids[i]), "block ids must be non-negative", i)


def plain_ints(value: Any) -> tuple[int, ...] | None:
    """A group field (``group_sizes``, ``group_starts``) given as a list or tuple of plain integers, as a tuple;
    None for anything else (pydantic then validates it)."""
    if not isinstance(value, (tuple, list)):
        return None
    for x in value:
        if not isinstance(x, (int, np.integer)) or isinstance(x, bool):
            return None
    return tuple(int(x) for x in value)


def group_ints(value: Any, field: str) -> tuple[int, ...] | None:
    """``plain_ints`` of a group field, refusing a float (even 2.0) or bool entry as block ids are refused
    (MappingError naming the field, index and value)."""
    ints = plain_ints(value)
    if ints is None and isinstance(value, (tuple, list)):  # something other than plain integers: name a float
        for i, x in enumerate(value):
            if isinstance(x, (bool, float, np.bool_, np.floating)):
                raise MappingError(field, x, "must be an integer", i)
    return ints


def refuse_negative_entry(values: Sequence[int], field: str) -> None:
    """Refuse a negative group size or start, naming the first (MappingError)."""
    for i, x in enumerate(values):
        if x < 0:
            raise MappingError(field, x, "must be non-negative", i)


def check_lengths(src: Sequence[int] | np.ndarray, dst: Sequence[int] | np.ndarray, sizes: Sequence[int] | None,
                  starts: Sequence[int] | None) -> None:
    """The id lists and group fields agree in length: ``group_starts`` needs ``group_sizes`` of as many groups,
    and without groups both lists are equally long. Raises MappingError naming the field."""
    if starts is not None and sizes is None:
        raise MappingError("group_starts", tuple(starts), "needs group_sizes")
    if starts is not None and len(starts) != len(sizes or ()):
        raise MappingError("group_starts", f"length {len(starts)}", f"group_sizes has {len(sizes or ())} groups")
    if sizes is None and len(src) != len(dst):
        raise MappingError("dst_ids", f"length {len(dst)}",
                           f"src_ids has {len(src)} ids; the lists must have equal length")


def count_of(sizes: Sequence[int] | None, src: Sequence[int] | np.ndarray) -> int:
    """Block copies a mapping names: the group sizes' sum, or the list length without groups."""
    return len(src) if sizes is None else sum(sizes)

