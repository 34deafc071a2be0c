# mypy: disable-error-code="untyped-decorator, no-untyped-def, unused-ignore"
"""The Triton copy kernel (imported only by ops_triton, which needs triton anyway).

Programs loop over tiles of the plan's ranges. A tile is ``BLOCK`` elements of ``ELEM`` (``WORD`` bytes)
starting ``tile_start`` bytes into range ``tile_range``. Full tiles copy unmasked (so, with ALIGN16, the
compiler can emit 128-bit accesses); a range's last, partial tile is masked. Addresses are raw int64 values
cast to pointers, so host memory is reached through unified addressing and must be pinned.
"""
import triton  # type: ignore[import-untyped, import-not-found, unused-ignore]
import triton.language as tl  # type: ignore[import-untyped, import-not-found, unused-ignore]


@triton.jit
def copy_ranges(src_addr, dst_addr, nbytes, tile_range, tile_start, num_tiles,
                ELEM: tl.constexpr, WORD: tl.constexpr, BLOCK: tl.constexpr, ALIGN16: tl.constexpr):
    """Copy every range (addresses ``src_addr``/``dst_addr``, sizes ``nbytes``) tile by tile: ``num_tiles`` tiles, each
    ``BLOCK`` elements of ``WORD`` bytes starting ``tile_start`` bytes into range ``tile_range``."""
    pid = tl.program_id(0)
    nprog = tl.num_programs(0)
    lanes = tl.arange(0, BLOCK)
    for t in range(pid, num_tiles, nprog):
        r = tl.load(tile_range + t)
        start = tl.load(tile_start + t)
        n = tl.load(nbytes + r)
        src = (tl.load(src_addr + r) + start).to(tl.pointer_type(ELEM))
        dst = (tl.load(dst_addr + r) + start).to(tl.pointer_type(ELEM))
        if ALIGN16:  # every address and size in this launch is a multiple of 16 bytes
            src = tl.multiple_of(src, 16)
            dst = tl.multiple_of(dst, 16)
        count = (n - start) // WORD
        if count >= BLOCK:
            tl.store(dst + lanes, tl.load(src + lanes))
        else:
            mask = lanes < count
            tl.store(dst + lanes, tl.load(src + lanes, mask=mask), mask=mask)
