"""Alignment of ranges in buffers that declare ``align_bytes`` (files read or written with O_DIRECT).

Checked once per plan, vectorized over the ranges; layouts without an alignment pay one scan of the buffer
table. A misaligned range is refused while planning, naming the range, never left to fail as an I/O error.
"""
from __future__ import annotations

import numpy as np

from .errors import LayoutError
from .plan import TransferPlan
from .spec import Buffer


def align_table(buffers: tuple[Buffer, ...]) -> np.ndarray:
    """Each buffer's ``align_bytes`` (uint64), one entry at least."""
    return np.array([b.align_bytes for b in buffers] or [1], dtype=np.uint64)


def check_alignment(plan: TransferPlan, align: np.ndarray | None = None) -> TransferPlan:
    """Raise LayoutError unless every range's offset and size honour ``align_bytes`` of both its buffers.

    The error names the column (``src_offset``, ``dst_offset`` or ``nbytes``), the range index, the value,
    the buffer and the region. Returns ``plan``. ``align`` is ``align_table(plan.buffers)`` where the caller
    keeps it (one per layout), None to build it here.
    """
    if align is None:
        align = align_table(plan.buffers)
    if plan.num_ranges == 0 or not np.any(align > 1):
        return plan
    nb = plan.nbytes
    found: list[tuple[int, str, np.ndarray, str, np.ndarray]] = []  # (first bad range, column, values, side, bufs)
    for side in ("src", "dst"):
        buf = getattr(plan, f"{side}_buf")
        mask = align[buf] - np.uint64(1)  # powers of two: x % a == x & (a - 1)
        if not np.any(mask):
            continue
        off = getattr(plan, f"{side}_offset")
        for field, col in ((f"{side}_offset", off), ("nbytes", nb)):
            bad = (col & mask) != 0
            if bad.any():
                found.append((int(np.argmax(bad)), field, col, side, buf))
    if found:
        i, field, col, side, buf = min(found, key=lambda f: (f[0], f[1] == "nbytes"))  # the first range; offset first
        b = plan.buffers[int(buf[i])]
        region = plan.regions[int(plan.region[i])] if len(plan.regions) else "?"
        raise LayoutError(field, int(col[i]), f"range of region {region!r} in buffer {b.name!r} ({side} side) is "
                          f"not a multiple of its align_bytes {b.align_bytes}", i)
    return plan
