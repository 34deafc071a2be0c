"""A plan's bound rules, written once, over arrays: ``TransferPlan.check`` applies them to a plan's columns, and
executors' lowering to its own copies of the columns, read once (a column can be written after the check, so
lowering bounds exactly the values it goes on to use, not the plan's).

The rules, each with one wording (``note`` is appended after a colon: lowering says there why a checked plan
fails them):

1. **shape**: a column holds integers of its dtype; a run-length column has one length per value, none negative,
   covering as many ranges as the other columns (``check_dtype``, ``check_runs``, ``check_length``);
2. **calls**: call offsets rise strictly from 0 to the range count (``check_call_offsets``);
3. **indices**: every buffer, region and attribute index lies inside its table (``check_indices``);
4. **sizes**: no range is empty or of 2^63 bytes or more, so no offset and end of a range inside its buffer wrap
   uint64 (``check_sizes``);
5. **inside**: every range lies inside its buffer's declared size, a sum that wraps uint64 included
   (``check_inside``).

Each raises PlanError naming the column, the range index (the first range of a run) and the value. The checks
run on runs where a column comes in runs (one comparison per run), and look for the offending index only once
a rule fails.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from .errors import PlanError

MAX_RANGE_BYTES = 1 << 63  # no range is this large: offsets and ends of smaller ones cannot wrap uint64 once bounded
SHORT = 16  # arrays up to this long are reduced through a Python list (cheaper than numpy's reductions)


def span(a: np.ndarray) -> tuple[int, int]:
    """(smallest, largest) of a non-empty integer array, as Python ints (short arrays through a list)."""
    if len(a) <= SHORT:
        values = a.tolist()
        return min(values), max(values)
    return int(np.minimum.reduce(a)), int(np.maximum.reduce(a))


def _refuse(field: str, value: Any, reason: str, index: int | None, note: str) -> PlanError:
    return PlanError(field, value, f"{reason}: {note}" if note else reason, index)


def check_dtype(name: str, a: Any, dtype: np.dtype, note: str = "") -> None:
    """Refuse ``a`` unless it is a one-dimensional numpy array of ``dtype`` (the column ``name``'s)."""
    if not isinstance(a, np.ndarray) or a.dtype != dtype or a.ndim != 1:
        what = f"{a.dtype} array of {a.ndim} dimensions" if isinstance(a, np.ndarray) else type(a).__name__
        raise _refuse(name, what, f"expected a one-dimensional {np.dtype(dtype)} column", None, note)


def check_length(name: str, length: int, n: int, note: str = "") -> None:
    """Refuse a column of ``length`` entries in a plan whose other columns have ``n``."""
    if length != n:
        raise _refuse(name, length, f"column length differs from the other columns' ({n})", None, note)


def check_runs(name: str, values: Any, lengths: Any, dtype: np.dtype, n: int | None = None, note: str = "") -> None:
    """Refuse the runs of column ``name`` (``values[i]`` repeated ``lengths[i]`` times) unless ``values`` are of
    ``dtype``, ``lengths`` int64, one length per value and none negative, and (``n`` given) they cover ``n``
    ranges."""
    check_dtype(f"{name}.values", values, dtype, note)
    check_dtype(f"{name}.lengths", lengths, np.dtype(np.int64), note)
    if len(lengths) != len(values):
        raise _refuse(f"{name}.lengths", len(lengths), f"expected one length per run value ({len(values)})", None, note)
    if len(lengths) and span(lengths)[0] < 0:
        i = int(np.argmax(lengths < 0))
        raise _refuse(f"{name}.lengths", int(lengths[i]), "negative run length", i, note)
    if n is not None:
        total = int(np.add.reduce(lengths)) if len(lengths) > SHORT else sum(lengths.tolist())
        check_length(name, total, n, note)


def check_call_offsets(offsets: Any, n: int, note: str = "") -> None:
    """Refuse call offsets (int64) unless they rise strictly from 0 to ``n`` (a plan of no ranges has no call)."""
    check_dtype("call_offsets", offsets, np.dtype(np.int64), note)
    co = offsets
    ok = len(co) >= 1 and int(co[0]) == 0 and int(co[-1]) == n
    if ok and len(co) >= 2:
        ok = span(np.diff(co))[0] > 0
    if not ok:
        raise _refuse("call_offsets", co.tolist()[:8], f"must rise strictly from 0 to {n}", None, note)


def check_indices(name: str, values: np.ndarray, lengths: np.ndarray, limit: int, note: str = "") -> None:
    """Refuse the runs ``values``/``lengths`` of index column ``name`` unless every value lies in [0, ``limit``)
    (its table's size); the index named is the first range of the run."""
    if not len(values):
        return
    lo, hi = span(values)
    if lo < 0 or hi >= limit:
        i = int(np.argmax((values < 0) | (values >= limit)))
        raise _refuse(name, int(values[i]), f"out of range (the plan has {limit})", int(lengths[:i].sum()), note)


def check_sizes(values: np.ndarray, lengths: np.ndarray, note: str = "") -> tuple[int, int]:
    """(smallest, largest) range size of the runs ``values``/``lengths`` of ``nbytes`` ((0, 0) for none), after
    refusing an empty range or one of 2^63 bytes or more."""
    if not len(values):
        return 0, 0
    lo, hi = span(values)
    for bad, reason in ((lo == 0, "empty range"), (hi >= MAX_RANGE_BYTES, "range too large")):
        if bad:
            j = int(np.argmax((values == 0) if lo == 0 else (values >= MAX_RANGE_BYTES)))
            raise _refuse("nbytes", int(values[j]), reason, int(lengths[:j].sum()), note)
    return lo, hi


def check_inside(side: str, offsets: np.ndarray, nbytes: np.ndarray, buffers: np.ndarray, buffer_nbytes: np.ndarray,
                 names: Sequence[str], first: int = 0, note: str = "") -> None:
    """Refuse the first range (``offsets``, ``nbytes``: uint64 per range; ``buffers``: each range's buffer index
    on ``side``) that does not lie inside its buffer's declared size (``buffer_nbytes``, uint64 per buffer; their
    ``names``), an offset + size that wraps uint64 included. ``first``: the plan's index of the first range given."""
    limit = buffer_nbytes[buffers]
    bad = (offsets > limit) | (nbytes > limit - offsets)  # the second term is only read where the first is False
    if bad.any():
        i = int(np.argmax(bad))
        b = int(buffers[i])
        raise _refuse(f"{side}_offset", int(offsets[i]), f"range of {int(nbytes[i])} bytes runs past buffer "
                      f"{names[b]!r} of {int(buffer_nbytes[b])} bytes", first + i, note)
