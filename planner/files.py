"""Strict readers of plan, case and golden files: one loader for ``TransferPlan.load``, ``Case.load``, golden
files and every CLI command.

A file (or a dict read from one) becomes checked values or numpy columns, or a :class:`PlanFileError` that
names the file, the field, the index and the value. Nothing is coerced silently: an offset of 1.5, a
``call_offsets`` of strings, a ``(n, 1)`` column, a bool where a count belongs or a value outside its
column's dtype is refused, never truncated or wrapped. This module sits below ``plan.py`` (which imports
it) and imports only errors, values and numpy.
"""
from __future__ import annotations

import io
import json
import zipfile
from pathlib import Path
from typing import Any

import numpy as np

from .errors import PlanError

PLAN_COLUMNS: dict[str, np.dtype] = {
    "src_buf": np.dtype("<i4"), "src_offset": np.dtype("<u8"),
    "dst_buf": np.dtype("<i4"), "dst_offset": np.dtype("<u8"),
    "nbytes": np.dtype("<u8"), "region": np.dtype("<i4"), "attr": np.dtype("<u2"),
}
# header fields of a serialized plan and the Python types each must have (bool is not an int here)
_HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "direction": (str,), "target": (dict,), "options": (dict,), "api": (str,), "passes_attrs": (bool,),
    "buffers": (list,), "regions": (list,), "attrs": (list,), "requested_copies": (int,),
}
_SHOWN = 40  # characters of a bad value shown in a message


class PlanFileError(PlanError):
    """A plan, case or golden file (or the dict read from one) is malformed. ``source`` names the file.

    ``details`` holds one short line per problem found (several for a case that breaks several rules).
    """

    def __init__(self, field: str, value: Any, reason: str, index: int | None = None, source: str | None = None,
                 details: tuple[str, ...] = ()):
        super().__init__(field, shorten(value), reason, index)
        self.source, self.details = source, tuple(details)
        if source:
            self.args = (f"{source}: {self.args[0]}",)

    @classmethod
    def wrap(cls, err: PlanError, source: str | None) -> PlanFileError:
        """The same complaint as ``err`` (a model's validation error), said about the file ``source``."""
        if isinstance(err, PlanFileError) and (err.source or not source):
            return err
        details = tuple(getattr(err, "details", ()) or ())
        out = cls(err.field, err.value, err.reason, err.index, source, details)
        out.args = (f"{source}: {err.args[0]}" if source else err.args[0],)  # keeps "(and N more: ...)"
        return out


def shorten(value: Any) -> Any:
    """Values longer than a line are cut, so a message never dumps a whole object."""
    if isinstance(value, (str, int, float, bool, type(None))) and len(repr(value)) <= _SHOWN:
        return value
    text = repr(value)
    return _Cut(text if len(text) <= _SHOWN else text[:_SHOWN - 3] + "...")


class _Cut(str):
    def __repr__(self) -> str:
        return str(self)


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


# ---- reading bytes ----------------------------------------------------------------------------------------
def read_bytes(path: str | Path, what: str = "file") -> bytes:
    """The content of ``path``. Raises PlanFileError when it is missing, a folder or unreadable."""
    path = Path(path)
    if not path.is_file():
        raise PlanFileError("path", str(path), f"no such {what}" if not path.exists() else f"not a {what}")
    try:
        return path.read_bytes()
    except OSError as e:
        raise PlanFileError("path", str(path), f"cannot read the {what} ({e.strerror or e})") from None


def parse_json(text: str | bytes, source: str | None) -> dict[str, Any]:
    """A JSON object from ``text``; a top-level list, string or number is refused."""
    try:
        d = json.loads(text.decode("utf-8") if isinstance(text, bytes) else text)
    except UnicodeDecodeError as e:
        raise PlanFileError("json", f"byte {e.start}", "not UTF-8 text", source=source) from None
    except json.JSONDecodeError as e:
        raise PlanFileError("json", f"line {e.lineno} column {e.colno}", f"not valid JSON ({e.msg})",
                            source=source) from None
    except RecursionError:
        raise PlanFileError("json", "nesting", "nested too deeply", source=source) from None
    if not isinstance(d, dict):
        raise PlanFileError("json", _type_name(d), "expected a JSON object at the top level", source=source)
    return d


def read_json(path: str | Path, what: str = "file") -> dict[str, Any]:
    """The JSON object in the file at ``path``. Raises PlanFileError naming the file."""
    return parse_json(read_bytes(path, what), str(path))


def read_npz(data: bytes, source: str | None = None) -> dict[str, Any]:
    """A plan dict (header fields, ``call_offsets``, ``columns``) from ``TransferPlan.to_npz_bytes`` output.

    A missing member, a truncated or empty archive, or a header that is not JSON raises PlanFileError.
    """
    members = ("header", "call_offsets", *PLAN_COLUMNS)
    try:
        with np.load(io.BytesIO(data), allow_pickle=False) as z:
            if not hasattr(z, "files"):
                raise PlanFileError("npz", "array", "expected an .npz archive, not a single .npy array", source=source)
            missing = [m for m in members if m not in z.files]
            if missing:
                raise PlanFileError("npz", missing[0], f"member missing from the archive ({len(missing)} missing)",
                                    source=source)
            arrays = {m: z[m] for m in members}
    except PlanFileError:
        raise
    except (zipfile.BadZipFile, EOFError, ValueError, OSError, KeyError, zipfile.LargeZipFile) as e:
        reason = "empty file" if not data else f"not a readable .npz archive ({type(e).__name__})"
        raise PlanFileError("npz", f"{len(data)} bytes", reason, source=source) from None
    header = arrays.pop("header")
    if header.dtype != np.uint8 or header.ndim != 1:
        raise PlanFileError("npz.header", str(header.dtype), "expected the JSON header as uint8 bytes", source=source)
    d = parse_json(header.tobytes(), source)
    d["call_offsets"] = arrays.pop("call_offsets")
    d["columns"] = arrays
    return d


# ---- checked values ---------------------------------------------------------------------------------------
def int_array(value: Any, field: str, dtype: np.dtype, source: str | None, ndim: int = 1) -> np.ndarray:
    """``value`` (a list or an integer array) as a contiguous array of ``dtype`` with ``ndim`` dimensions.

    Refuses floats (even 2.0), bools, strings, nulls, nested or ragged lists, other shapes and values outside
    ``dtype``'s range, naming the first bad index and its value.
    """
    arr = _array_of(value, field, source, ndim)
    if arr.ndim != ndim:
        raise PlanFileError(field, f"shape {arr.shape}", f"expected {ndim} dimension{'s' * (ndim > 1)}", source=source)
    if arr.size == 0:
        return np.zeros(arr.shape, dtype=dtype)
    if arr.dtype.kind not in "iuO":  # bools, floats (even 2.0) and strings: the first entry is already one
        first = arr.ravel()[0]
        raise PlanFileError(field, first.item() if hasattr(first, "item") else first,
                            f"expected an integer, got {arr.dtype.name}", 0, source)
    _refuse_outside(arr, field, dtype, source, ndim)
    return np.ascontiguousarray(arr.astype(dtype))


def _array_of(value: Any, field: str, source: str | None, ndim: int) -> np.ndarray:
    """``value`` as an array: an array as it is, a list of plain ints as integers (ints past int64 and any other
    entry as objects, for ``_refuse_outside`` to name). Refuses a cell that is not a plain int, ragged rows and
    anything that is not a list."""
    if isinstance(value, np.ndarray):
        return value
    if not isinstance(value, (list, tuple)):
        raise PlanFileError(field, _type_name(value), "expected a list of integers", source=source)
    if ndim == 1 and set(map(type, value)) <= {int}:  # the common case, checked without a Python loop
        try:
            arr = np.asarray(value) if value else np.zeros(0, dtype=np.int64)
        except OverflowError:
            arr = np.zeros(0, dtype=np.float64)
        return arr if arr.dtype.kind in "iu" else np.array(value, dtype=object)  # ints past int64: named later
    bad = _first_non_int(value, ndim)
    if bad is not None:
        i, v = bad
        raise PlanFileError(field, v, f"expected an integer, got {_type_name(v)}", i, source)
    try:
        return np.array(value, dtype=object) if value else np.zeros((0,) * ndim, dtype=np.int64)
    except ValueError as e:
        raise PlanFileError(field, "ragged", f"rows of unequal length ({e})", source=source) from None


def _refuse_outside(arr: np.ndarray, field: str, dtype: np.dtype, source: str | None, ndim: int) -> None:
    """Refuse the first entry of ``arr`` (integers, or objects) that is not an integer in ``dtype``'s range,
    naming its row."""
    lo, hi = 0, int(np.iinfo(dtype).max)
    if arr.dtype.kind == "O":
        flat = arr.ravel()
        for i, v in enumerate(flat):
            if not isinstance(v, (int, np.integer)) or isinstance(v, (bool, np.bool_)):
                raise PlanFileError(field, v, f"expected an integer, got {_type_name(v)}",
                                    i if ndim == 1 else i // arr.shape[1], source)
        out_of = [i for i, v in enumerate(flat) if not lo <= v <= hi]
    else:
        outside = (arr < lo) | (arr > hi) if arr.dtype.kind == "i" or int(arr.max()) > hi else np.zeros(arr.shape, bool)
        out_of = np.flatnonzero(outside.ravel()).tolist()[:1]
    if out_of:
        i = out_of[0]
        raise PlanFileError(field, int(arr.ravel()[i]), f"out of range for {dtype.name} (must be {lo}..{hi})",
                            i if ndim == 1 else i // arr.shape[1], source)


def _first_non_int(value: Any, ndim: int) -> tuple[int, Any] | None:
    """(row index, value) of the first cell that is not a plain int, or None."""
    for i, v in enumerate(value):
        for cell in (v if ndim == 2 and isinstance(v, (list, tuple)) else (v,)):
            if not isinstance(cell, int) or isinstance(cell, bool):
                return i, cell
    return None


def check_int(value: Any, field: str, source: str | None, lo: int = 0, hi: int = 2**63 - 1) -> int:
    """A plain integer in ``lo..hi``; bools, floats and strings are refused."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise PlanFileError(field, value, f"expected an integer, got {_type_name(value)}", source=source)
    if not lo <= int(value) <= hi:
        raise PlanFileError(field, int(value), f"out of range (must be {lo}..{hi})", source=source)
    return int(value)


def plan_fields(d: Any, source: str | None = None) -> dict[str, Any]:
    """Checked raw fields of a serialized plan: JSON types verified, columns as checked numpy arrays.

    Returns the header fields as read (``target``, ``options``, ``buffers`` and ``attrs`` still dicts for the
    models to validate), ``region_page_bytes`` as a tuple, ``call_offsets`` and ``columns``. Raises
    PlanFileError naming the first bad field.
    """
    if not isinstance(d, dict):
        raise PlanFileError("plan", _type_name(d), "expected a JSON object (dict)", source=source)
    _check_header(d, source)
    rpb = d.get("region_page_bytes") or []
    if not isinstance(rpb, (list, np.ndarray)):
        raise PlanFileError("region_page_bytes", rpb, "expected a list of integers", source=source)
    rpb = tuple(int(x) for x in int_array(list(rpb), "region_page_bytes", np.dtype("<i8"), source))
    fp = d.get("fingerprint")
    if fp is not None and not isinstance(fp, str):
        raise PlanFileError("fingerprint", fp, f"expected a string, got {_type_name(fp)}", source=source)
    columns = _columns(d["columns"], source)
    pairs = {key: _pairs(d.get(key), key, kind, source) for key, kind in _OPTIONAL_PAIRS.items()}
    return {**{k: d[k] for k in _HEADER_TYPES}, **pairs, "region_page_bytes": rpb, "fingerprint": fp,
            "call_offsets": int_array(d["call_offsets"], "call_offsets", np.dtype("<i8"), source),
            "columns": columns, "schema_version": d.get("schema_version")}


def _check_header(d: dict[str, Any], source: str | None) -> None:
    """Refuse unknown and missing keys, header fields of the wrong JSON type, a bad ``requested_copies``,
    region names that are not strings and buffers or attributes that are not objects."""
    unknown = sorted(set(d) - set(_HEADER_TYPES) - {"schema_version", "fingerprint", "region_page_bytes",
                                                       "call_offsets", "columns", "summary", *_OPTIONAL_PAIRS})
    if unknown:
        raise PlanFileError(unknown[0], d[unknown[0]], f"unknown key {unknown[0]!r}{suggest(unknown[0], _PLAN_KEYS)}",
                            source=source)
    missing = [k for k in (*_HEADER_TYPES, "call_offsets", "columns") if k not in d]
    if missing:
        raise PlanFileError(missing[0], None, "missing from the serialized plan", source=source)
    for key, types in _HEADER_TYPES.items():
        v = d[key]
        if not isinstance(v, types) or (bool not in types and isinstance(v, bool)):
            raise PlanFileError(key, v, f"expected {' or '.join(t.__name__ for t in types)}, got {_type_name(v)}",
                                source=source)
    check_int(d["requested_copies"], "requested_copies", source)
    for i, name in enumerate(d["regions"]):
        if not isinstance(name, str):
            raise PlanFileError("regions", name, f"region names are strings, got {_type_name(name)}", i, source)
    for key in ("buffers", "attrs"):
        for i, item in enumerate(d[key]):
            if not isinstance(item, dict):
                raise PlanFileError(key, item, f"expected an object, got {_type_name(item)}", i, source)


def _columns(cols: Any, source: str | None) -> dict[str, np.ndarray]:
    """A serialized plan's ``columns``: every plan column, no other, each a checked array of its dtype."""
    if not isinstance(cols, dict):
        raise PlanFileError("columns", _type_name(cols), "expected an object of columns", source=source)
    extra = sorted(set(cols) - set(PLAN_COLUMNS))
    if extra:
        raise PlanFileError(f"columns.{extra[0]}", None, f"unknown column {extra[0]!r}{suggest(extra[0], PLAN_COLUMNS)}",
                            source=source)
    columns = {}
    for name, dtype in PLAN_COLUMNS.items():
        if name not in cols:
            raise PlanFileError(f"columns.{name}", None, "missing from the serialized plan", source=source)
        columns[name] = int_array(cols[name], f"columns.{name}", dtype, source)
    return columns


_OPTIONAL_PAIRS: dict[str, type] = {"aliases": str, "region_writers": int}  # (alias, region); (writers, index)
_PLAN_KEYS = (*_HEADER_TYPES, "schema_version", "fingerprint", "region_page_bytes", "call_offsets", "columns",
              *_OPTIONAL_PAIRS)


def _pairs(v: Any, key: str, kind: type, source: str | None) -> tuple[tuple[Any, Any], ...] | None:
    """An optional list of two-element lists whose items are all ``kind`` (bools are not ints)."""
    if v is None:
        return None
    if not isinstance(v, list):
        raise PlanFileError(key, _type_name(v), "expected a list of pairs", source=source)
    for i, pair in enumerate(v):
        if (not isinstance(pair, list) or len(pair) != 2
                or not all(isinstance(x, kind) and not isinstance(x, bool) for x in pair)):
            raise PlanFileError(key, pair, f"expected a pair of {kind.__name__}s", i, source)
    return tuple((a, b) for a, b in v)


def golden_columns(ranges: Any, names: Any, source: str | None) -> dict[str, np.ndarray]:
    """A golden file's ``ranges`` (one row per range, in ``names`` order) as checked plan columns."""
    if not isinstance(names, list) or names != list(PLAN_COLUMNS):
        raise PlanFileError("plan.range_columns", names, f"expected {list(PLAN_COLUMNS)}", source=source)
    if not isinstance(ranges, list):
        raise PlanFileError("plan.ranges", _type_name(ranges), "expected a list of rows", source=source)
    for i, row in enumerate(ranges):
        if not isinstance(row, list) or len(row) != len(names):
            raise PlanFileError("plan.ranges", row, f"expected a row of {len(names)} integers", i, source)
    rows = int_array(ranges, "plan.ranges", np.dtype("<u8"), source, ndim=2) if ranges else np.zeros((0, len(names)),
                                                                                                   np.uint64)
    out = {}
    for j, (name, dtype) in enumerate(PLAN_COLUMNS.items()):
        col = rows[:, j]
        hi = np.iinfo(dtype).max
        if len(col) and int(col.max()) > hi:
            i = int(np.argmax(col > hi))
            raise PlanFileError(f"plan.ranges.{name}", int(col[i]), f"out of range for {dtype.name}", i, source)
        out[name] = col.astype(dtype)
    return out


def validate(model: Any, value: Any, field: str, source: str | None, index: int | None = None) -> Any:
    """``model.model_validate(value)``, its error said about ``field`` (and ``index``) of the file ``source``."""
    try:
        return model.model_validate(value)
    except PlanError as e:
        where = field if index is None else f"{field}[{index}]"
        raise PlanFileError(f"{where}.{e.field}", e.value, e.reason, e.index, source,
                            tuple(f"{where}.{line}" for line in getattr(e, "details", ()))) from None


def suggest(key: object, known: Any) -> str:
    """`` (did you mean 'x'?)`` for the closest known name, or ''."""
    import difflib
    close = difflib.get_close_matches(str(key), [str(k) for k in known], n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


__all__ = ["PLAN_COLUMNS", "PlanFileError", "check_int", "golden_columns", "int_array", "parse_json", "plan_fields",
           "read_bytes", "read_json", "read_npz", "suggest",
           "validate"]
