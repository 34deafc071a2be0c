"""Built-in layouts and block patterns shaped like real restores (for the demo, benchmarks, goldens and tests).

Deterministic: every pattern takes an explicit seed.
"""
from __future__ import annotations

import numpy as np

from .layout import Layout
from .spec import BlockMapping, Buffer, Direction, Fragment, Location, Placement, Region

PATTERNS = ("contiguous", "runs8", "fragmented", "descending", "interleaved")


def kv_layout(num_regions: int = 118, num_blocks: int = 512, page_bytes: int = 32 * 1024, *,
              host_blocks: int | None = None, shared_device: bool = False, shared_host: bool = True,
              device: int = 0, prefix: str = "kv") -> Layout:
    """``num_regions`` KV tensors of ``num_blocks`` pages each (MiniMax-M3 at TP4 has 118 per rank).

    Device side: one buffer per region (separate tensors), or one shared allocation when ``shared_device``.
    Host side: one pinned buffer holding every region back to back (``shared_host``), or one per region.
    """
    host_blocks = num_blocks if host_blocks is None else host_blocks
    buffers: list[Buffer] = []
    regions: list[Region] = []
    if shared_device:
        buffers.append(Buffer(name="gpu", nbytes=num_regions * num_blocks * page_bytes, location=Location.DEVICE, device=device))
    if shared_host:
        buffers.append(Buffer(name="cpu", nbytes=num_regions * host_blocks * page_bytes, location=Location.HOST))
    for r in range(num_regions):
        name = f"{prefix}{r}"
        if not shared_device:
            buffers.append(Buffer(name=f"gpu.{name}", nbytes=num_blocks * page_bytes, location=Location.DEVICE, device=device))
        if not shared_host:
            buffers.append(Buffer(name=f"cpu.{name}", nbytes=host_blocks * page_bytes, location=Location.HOST))
        dev = (Placement(buffer="gpu", byte_offset=r * num_blocks * page_bytes) if shared_device
               else Placement(buffer=f"gpu.{name}"))
        host = (Placement(buffer="cpu", byte_offset=r * host_blocks * page_bytes) if shared_host
                else Placement(buffer=f"cpu.{name}"))
        regions.append(Region(name=name, page_bytes=page_bytes, device=dev, host=host))
    return Layout(buffers=tuple(buffers), regions=tuple(regions))


def block_pattern(pattern: str, n: int, num_blocks: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(src ids, dst ids) of ``n`` block pairs drawn from ``num_blocks`` blocks per side.

    contiguous: one ascending run; runs8: runs of 8 at shuffled places; fragmented: no two pairs adjacent on
    both sides; descending: ``[k..1] -> [m..1]`` as lazy eviction produces; interleaved: four runs whose
    members alternate in the input order.
    """
    if n > num_blocks // 2:
        raise ValueError(f"n = {n}: patterns need num_blocks >= 2*n (num_blocks = {num_blocks})")
    rng = np.random.default_rng(seed)
    if pattern == "contiguous":
        return np.arange(n), np.arange(n) + num_blocks - n
    if pattern == "descending":
        return np.arange(n)[::-1].copy(), (np.arange(n) + 3)[::-1].copy()
    if pattern == "runs8":
        runs = -(-n // 8)
        slots_s = rng.permutation(num_blocks // 8)[:runs] * 8
        slots_d = rng.permutation(num_blocks // 8)[:runs] * 8
        s = (slots_s[:, None] + np.arange(8)).ravel()[:n]
        d = (slots_d[:, None] + np.arange(8)).ravel()[:n]
        return s, d
    if pattern == "fragmented":
        s = rng.permutation(num_blocks // 2)[:n] * 2
        d = np.sort(rng.permutation(num_blocks // 2)[:n] * 2)
        return s, d
    if pattern == "interleaved":
        k = 4
        per = -(-n // k)
        s = (np.arange(k)[:, None] * (per + 1) + np.arange(per)).T.ravel()[:n]
        d = (np.arange(k)[:, None] * (per + 2) + np.arange(per) + 1).T.ravel()[:n]
        if max(s.max(), d.max()) >= num_blocks:
            raise ValueError(f"num_blocks = {num_blocks}: too few for {n} interleaved pairs (need {max(s.max(), d.max()) + 1})")
        return s, d
    raise ValueError(f"pattern = {pattern!r}: unknown (known: {', '.join(PATTERNS)})")


def mapping(pattern: str, n: int, num_blocks: int, direction: Direction | str = Direction.H2D, seed: int = 0) -> BlockMapping:
    """A BlockMapping in ``direction`` with the ids of ``block_pattern(pattern, n, num_blocks, seed)``. Raises ValueError for an
    unknown pattern or too few blocks."""
    s, d = block_pattern(pattern, n, num_blocks, seed)
    return BlockMapping(direction=Direction(direction), src_ids=s, dst_ids=d)


def chunked_layout(num_regions: int = 118, num_blocks: int = 512, page_bytes: int = 32 * 1024,
                   blocks_per_chunk: int = 4, host_chunks: int | None = None) -> Layout:
    """Device blocks in one tensor per region; host pages in chunks of ``blocks_per_chunk`` (dense rows)."""
    host_chunks = num_blocks // blocks_per_chunk if host_chunks is None else host_chunks
    row = blocks_per_chunk * page_bytes
    buffers = [Buffer(name="cpu", nbytes=num_regions * host_chunks * row, location=Location.HOST)]
    regions = []
    for r in range(num_regions):
        buffers.append(Buffer(name=f"gpu.kv{r}", nbytes=num_blocks * page_bytes))
        regions.append(Region(name=f"kv{r}", page_bytes=page_bytes, device=Placement(buffer=f"gpu.kv{r}"),
                              host=Placement(buffer="cpu", byte_offset=r * host_chunks * row, blocks_per_chunk=blocks_per_chunk)))
    return Layout(buffers=tuple(buffers), regions=tuple(regions))


def tp_fragment_layout(num_regions: int = 118, num_blocks: int = 512, tokens: int = 16, heads: int = 8,
                       head_bytes: int = 256, tp: int = 2, rank: int = 0) -> Layout:
    """A tensor-parallel rank's slice of canonical host pages: pages are [tokens, heads, head_bytes]; the rank
    holds heads/tp of them, so each page copies as ``tokens`` fragments (one per token)."""
    local_heads = heads // tp
    piece = local_heads * head_bytes

    frag = Fragment(local_offset=0, local_stride=piece, canonical_offset=rank * piece,
                    canonical_stride=heads * head_bytes, fragment_bytes=piece, count=tokens)
    canon = tokens * heads * head_bytes
    buffers = [Buffer(name="cpu", nbytes=num_regions * num_blocks * canon, location=Location.HOST)]
    regions = []
    for r in range(num_regions):
        buffers.append(Buffer(name=f"gpu.kv{r}", nbytes=num_blocks * tokens * piece))
        regions.append(Region(name=f"kv{r}", page_bytes=tokens * piece, host_page_bytes=canon, fragments=(frag,),
                              device=Placement(buffer=f"gpu.kv{r}"),
                              host=Placement(buffer="cpu", byte_offset=r * num_blocks * canon)))
    return Layout(buffers=tuple(buffers), regions=tuple(regions))


def page_first_layout(num_regions: int = 118, num_blocks: int = 512, page_bytes: int = 32 * 1024) -> Layout:
    """Block-major layouts on both sides: block b of every region is contiguous, so a run of blocks is one
    range across all regions."""
    row = num_regions * page_bytes
    buffers = (Buffer(name="gpu", nbytes=num_blocks * row), Buffer(name="cpu", nbytes=num_blocks * row, location=Location.HOST))
    regions = tuple(Region(name=f"kv{r}", page_bytes=page_bytes,
                           device=Placement(buffer="gpu", byte_offset=r * page_bytes, stride_bytes=row),
                           host=Placement(buffer="cpu", byte_offset=r * page_bytes, stride_bytes=row))
                    for r in range(num_regions))
    return Layout(buffers=buffers, regions=regions)
