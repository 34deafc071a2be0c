"""Independent oracles for tests: per-block copies and a byte-level minimum range count.

Nothing here uses the planner's merging code; it walks the layout directly.
"""
from __future__ import annotations

import numpy as np

from kvxfer.planner import BlockMapping, Direction, Layout


def block_copies(layout: Layout, mapping: BlockMapping) -> list[tuple[str, int, str, int, int]]:
    """Every requested copy as (src buffer, src offset, dst buffer, dst offset, nbytes)."""
    out = []
    src_side, dst_side = ("host", "device") if mapping.direction is Direction.H2D else ("device", "host")
    for reg in layout.regions:
        sp, dp = getattr(reg, src_side), getattr(reg, dst_side)
        ss, ds = sp.stride_bytes or reg.page_bytes, dp.stride_bytes or reg.page_bytes
        for s, d in zip(mapping.src_ids.tolist(), mapping.dst_ids.tolist()):
            out.append((sp.buffer, sp.byte_offset + s * ss, dp.buffer, dp.byte_offset + d * ds, reg.page_bytes))
    return out


def apply_copies(copies, arrays: dict[str, np.ndarray]) -> None:
    for sb, so, db, do, n in copies:
        arrays[db][do:do + n] = arrays[sb][so:so + n]


def min_ranges(copies) -> int:
    """Fewest byte ranges covering the copies: count destination bytes that do not continue the previous byte."""
    src_of: dict[tuple[str, int], tuple[str, int]] = {}
    for sb, so, db, do, n in copies:
        for k in range(n):
            src_of[(db, do + k)] = (sb, so + k)
    count = 0
    for (db, x), (sb, y) in src_of.items():
        prev = src_of.get((db, x - 1))
        if prev != (sb, y - 1):
            count += 1
    return count


def filled_buffers(layout: Layout, seed: int = 0) -> dict[str, np.ndarray]:
    """Random bytes in every buffer (sources and sentinels alike)."""
    rng = np.random.default_rng(seed)
    return {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in layout.buffers}
