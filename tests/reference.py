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


def expected_copies(layout: Layout, mapping: BlockMapping, options=None) -> list[tuple[str, int, str, int, int]]:
    """Every requested piece as (src buffer, src offset, dst buffer, dst offset, nbytes), from the spec with plain
    loops: KV-cache groups (declared ones included; an empty group consumes its ids), chunks of k pages and
    skips per side, canonical fragments, writer rotation per region (else the plan's), and aliased regions
    copied once per name (as a per-layer worker does). Loads read everything."""
    num_writers = options.num_writers if options is not None else 1
    writer_index = options.writer_index if options is not None else 0
    load = mapping.direction.value == "h2d"
    src_side, dst_side = ("host", "device") if load else ("device", "host")
    declared = getattr(layout, "num_groups", None)
    num_groups = declared or (max((r.group for r in layout.regions), default=0) + 1)
    sizes = list(mapping.group_sizes) if mapping.group_sizes is not None else [len(mapping.src_ids)]
    starts = list(mapping.group_starts) if mapping.group_starts is not None else [0] * len(sizes)
    assert len(sizes) == num_groups, "the planner must refuse this mapping"
    ids = {"src": mapping.src_ids.tolist(), "dst": mapping.dst_ids.tolist()}
    used = {"src": 0, "dst": 0}
    out = []
    for g, (count, start) in enumerate(zip(sizes, starts)):
        regs = [r for r in layout.regions if r.group == g]
        pages = {}
        for key, side in (("src", src_side), ("dst", dst_side)):
            ks = {getattr(r, side).blocks_per_chunk for r in (regs or layout.regions)}
            k = ks.pop() if ks else 1
            skip = start % k
            flat: list[int] = []
            i = used[key]
            while count and len(flat) < skip + count:
                flat += [ids[key][i] * k + j for j in range(k)]
                i += 1
            used[key] = i
            pages[key] = flat[skip:skip + count]
        for reg in regs:
            nw = getattr(reg, "num_writers", None) or num_writers
            wi = getattr(reg, "writer_index", None)
            wi = 0 if nw == 1 else writer_index if wi is None else wi  # one writer: every rank writes it
            frags = [(f.local_offset + i * f.local_stride, f.canonical_offset + i * f.canonical_stride, f.fragment_bytes)
                     for f in reg.fragments for i in range(f.count)] or [(0, 0, reg.page_bytes)]
            for sp, dp in zip(pages["src"], pages["dst"]):
                if not load and dp % nw != wi:
                    continue
                offs = {}
                for key, side, p in (("src", src_side, sp), ("dst", dst_side, dp)):
                    pl = getattr(reg, side)
                    page = reg.side_page(side)
                    stride = pl.stride_bytes or page * pl.blocks_per_chunk
                    offs[key] = pl.byte_offset + (p // pl.blocks_per_chunk) * stride + (p % pl.blocks_per_chunk) * page
                for local, canon, n in frags:
                    so, do = (canon, local) if load else (local, canon)
                    out.append((getattr(reg, src_side).buffer, offs["src"] + so, getattr(reg, dst_side).buffer,
                                offs["dst"] + do, n))
    return out
