"""Run-length encoded columns, and the column sets (``Ranges``) that planning passes between steps."""
from __future__ import annotations

from collections.abc import Iterator, Mapping

import numpy as np
from numpy.typing import DTypeLike

CHUNK = 1 << 16  # elements expanded at a time where a run-length column is streamed (512 KiB of int64)


class Runs:
    """A run-length encoded column: ``values[i]`` repeated ``lengths[i]`` times."""

    __slots__ = ("values", "lengths", "_total")

    def __init__(self, values: np.ndarray, lengths: np.ndarray):
        self.values, self.lengths = np.asarray(values), np.asarray(lengths, dtype=np.int64)
        self._total: int | None = None

    @classmethod
    def of(cls, values: np.ndarray, lengths: np.ndarray, total: int | None = None) -> Runs:
        """A Runs over arrays that already are arrays (``lengths`` int64), taken as they are; ``total``, when
        the caller knows it, is the sum of ``lengths``."""
        runs = object.__new__(cls)
        runs.values, runs.lengths, runs._total = values, lengths, total
        return runs

    def __len__(self) -> int:
        if self._total is None:  # columns are not changed once made: the sum is taken once
            self._total = int(self.lengths.sum())
        return self._total

    def dense(self, dtype: DTypeLike | None = None) -> np.ndarray:
        """The expanded column (as ``dtype`` when given)."""
        return np.repeat(self.values if dtype is None else self.values.astype(dtype), self.lengths)

    def chunks(self, size: int = CHUNK) -> Iterator[np.ndarray]:
        """The dense column in consecutive pieces of at most ``size`` elements (never all of it at once)."""
        ends = np.cumsum(self.lengths)
        starts = ends - self.lengths
        total = int(ends[-1]) if len(ends) else 0
        for lo in range(0, total, size):
            hi = min(lo + size, total)
            a, b = np.searchsorted(ends, [lo, hi - 1], side="right").tolist()  # runs covering lo and hi - 1
            take = np.minimum(ends[a:b + 1], hi) - np.maximum(starts[a:b + 1], lo)
            yield np.repeat(self.values[a:b + 1], take)


Column = np.ndarray | Runs
# Columns src_buf, dst_buf, region (int32) and src_offset, dst_offset, nbytes (int64 while planning), each a
# dense array or Runs. Read-only in type (steps return new sets); DenseRanges is the all-dense form.
Ranges = Mapping[str, Column]
DenseRanges = dict[str, np.ndarray]


def dense(col: Column, dtype: DTypeLike | None = None) -> np.ndarray:
    """``col`` as a dense array; ``dtype`` converts run-length columns only (a dense array is returned as is)."""
    return col.dense(dtype) if isinstance(col, Runs) else col


def dense_all(r: Ranges) -> DenseRanges:
    """Every column of ``r`` dense (see ``dense``)."""
    return {k: dense(v) for k, v in r.items()}


def runs_of(col: Column) -> tuple[np.ndarray, np.ndarray]:
    """(values, lengths) of a column's runs of equal values, without expanding a run-length column."""
    if isinstance(col, Runs):
        keep = col.lengths > 0
        return col.values[keep], col.lengths[keep]
    if len(col) == 0:
        return col, np.zeros(0, dtype=np.int64)
    starts = np.flatnonzero(np.concatenate(([True], col[1:] != col[:-1])))
    return col[starts], np.diff(np.append(starts, len(col)))
