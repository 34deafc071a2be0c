"""The full layout model: sub-block chunks, groups, canonical fragments, writer rotation (how their ranges merge
and split into calls: test_planner_build.py)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    LayoutError,
    MappingError,
    Placement,
    PlanOptions,
    Region,
    TargetError,
    plan_transfer,
)
from kvxfer.planner.spec import Fragment
from kvxfer.testing import assert_plan_matches, expected_copies, min_ranges


def run_and_compare(layout, mapping, options=PlanOptions(), seed=0):
    plan = plan_transfer(layout, mapping, options=options)
    assert_plan_matches(plan, layout, mapping, options, seed)
    copies = expected_copies(layout, mapping, options)
    return plan, copies, min_ranges(copies)


def test_sub_block_enumeration_matches_context_example():
    layout = Layout(buffers=[Buffer(name="g", nbytes=64 * 8), Buffer(name="h", nbytes=64 * 8, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                    host=Placement(buffer="h", blocks_per_chunk=4))])
    m = BlockMapping(direction="d2h", src_ids=np.arange(10), dst_ids=[3, 7, 9], group_sizes=[10], group_starts=[2])
    plan = plan_transfer(layout, m, options=PlanOptions(coalesce=False))
    assert (plan.dst_offset // 8).tolist() == [14, 15, 28, 29, 30, 31, 36, 37, 38, 39]
    merged, copies, best = run_and_compare(layout, m)
    assert merged.num_ranges == best == 3  # host pages [14,15], [28..31], [36..39]


def test_groups_take_their_own_slices():
    layout = Layout(buffers=[Buffer(name="g", nbytes=4096), Buffer(name="h", nbytes=4096, location="host")],
                    regions=[Region(name="full", page_bytes=16, device=Placement(buffer="g"),
                                    host=Placement(buffer="h", blocks_per_chunk=2), group=0),
                             Region(name="swa", page_bytes=8, device=Placement(buffer="g", byte_offset=2048),
                                    host=Placement(buffer="h", byte_offset=2048, blocks_per_chunk=2), group=1)])
    # group 0: 3 blocks starting at logical index 1 -> skip 1, chunks [5, 6]; group 1: 2 blocks, start 0 -> chunk [9]
    m = BlockMapping(direction="h2d", src_ids=[5, 6, 9], dst_ids=[10, 11, 12, 20, 21], group_sizes=[3, 2], group_starts=[1, 0])
    plan, copies, best = run_and_compare(layout, m)
    assert plan.requested_copies == 5 and plan.num_ranges == best == 2
    with pytest.raises(MappingError, match=r"src_ids = 'length 4'.*consume 3 ids; the lists must add up exactly"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[5, 6, 9, 1], dst_ids=[10, 11, 12, 20, 21],
                                           group_sizes=[3, 2], group_starts=[1, 0]))
    with pytest.raises(MappingError, match=r"group 1 \(size 3, start 0, 1 blocks per chunk\) needs dst_ids\[3:6\]"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[5, 6, 9, 10], dst_ids=[10, 11, 12, 20, 21],
                                           group_sizes=[3, 3], group_starts=[1, 0]))
    with pytest.raises(MappingError, match=r"group_sizes = \[5\]: the layout has 2 KV-cache groups"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[5, 6, 9], dst_ids=[10, 11, 12, 20, 21], group_sizes=[5]))


def test_chunk_id_past_host_buffer():
    def layout(host_nbytes):
        return Layout(buffers=[Buffer(name="g", nbytes=256), Buffer(name="h", nbytes=host_nbytes, location="host")],
                      regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                      host=Placement(buffer="h", blocks_per_chunk=4))])
    # chunk 8 starts past a 256-byte buffer: its first page (32) ends at byte 264
    with pytest.raises(MappingError, match=r"dst_ids\[1\] = 8: block of region 'r' \(host side\) ends at byte 264, past buffer 'h' of 256 bytes \(last block that fits: 31\)"):
        plan_transfer(layout(256), BlockMapping(direction="d2h", src_ids=np.arange(8), dst_ids=[0, 8], group_sizes=[8]))
    # chunk 7 starts inside a 250-byte buffer, but its last page (31) ends at byte 256
    with pytest.raises(MappingError, match=r"dst_ids\[1\] = 7: block of region 'r' \(host side\) ends at byte 256, past buffer 'h' of 250"):
        plan_transfer(layout(250), BlockMapping(direction="d2h", src_ids=np.arange(8), dst_ids=[0, 7], group_sizes=[8]))
    plan_transfer(layout(250), BlockMapping(direction="d2h", src_ids=np.arange(6), dst_ids=[0, 7], group_sizes=[6]))


def test_huge_ids_are_rejected_before_any_arithmetic():
    layout = Layout(buffers=[Buffer(name="g", nbytes=256), Buffer(name="h", nbytes=256, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                    host=Placement(buffer="h", blocks_per_chunk=2))])
    with pytest.raises(MappingError, match=r"src_ids\[0\] = 4611686018427387904: block of region 'r' \(host side\) ends at byte 73786976294838206472, past"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[2**62], dst_ids=[0, 1], group_sizes=[2]))
    wide = Layout(buffers=[Buffer(name="g", nbytes=256), Buffer(name="h", nbytes=2**40, location="host")],
                  regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                  host=Placement(buffer="h", stride_bytes=2**36))])
    with pytest.raises(MappingError, match=r"dst_ids\[0\] = 16: block of region 'r' \(host side\) ends at byte 1099511627784, past"):
        plan_transfer(wide, BlockMapping(direction="d2h", src_ids=[1], dst_ids=[16]), options=PlanOptions(num_writers=2))
    with pytest.raises(LayoutError, match=r"stride_bytes = 18446744073709551616"):
        Placement(buffer="h", stride_bytes=2**64)


def test_single_group_sizes_must_match_the_lists():
    layout = Layout(buffers=[Buffer(name="g", nbytes=256), Buffer(name="h", nbytes=256, location="host")],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h"))])
    with pytest.raises(MappingError, match=r"src_ids = 'length 4'.*consume 2 ids; the lists must add up exactly"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3], dst_ids=[4, 5, 6, 7], group_sizes=[2]))
    with pytest.raises(MappingError, match=r"group 0 \(size 3.*needs dst_ids\[0:3\]"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1, 3, 1, 2], dst_ids=[3, 0], group_sizes=[3]))
    plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[4, 5], group_sizes=[2]))
    assert plan.num_ranges == 1


def test_fragment_errors():
    def region(*frags, host_page=32):
        return Region(name="r", page_bytes=16, host_page_bytes=host_page, device=Placement(buffer="g"),
                      host=Placement(buffer="h"), fragments=frags)
    f = dict(local_offset=0, local_stride=4, canonical_offset=0, canonical_stride=8, fragment_bytes=4, count=4)
    region(Fragment(**f))
    with pytest.raises(LayoutError, match=r"fragments\[0\].local_offset = 4: local fragments end at byte 20, past the local page of 16"):
        region(Fragment(**(f | {"local_offset": 4})))
    with pytest.raises(LayoutError, match=r"fragments\[0\].canonical_offset = 8: canonical fragments end at byte 36, past the canonical page of 32"):
        region(Fragment(**(f | {"canonical_offset": 8})))
    with pytest.raises(LayoutError, match=r"fragments\[1\].canonical_offset = 8: canonical bytes \[8, 12\) overlap fragments\[0\]"):
        region(Fragment(**(f | {"count": 2})), Fragment(**(f | {"local_offset": 8, "canonical_offset": 8, "count": 2})))
    with pytest.raises(LayoutError, match=r"local_stride = 2: pieces of 4 bytes overlap"):
        region(Fragment(**(f | {"local_stride": 2})))
    with pytest.raises(LayoutError, match=r"host_page_bytes = 32: differs from page_bytes 16"):
        region()


def test_writer_index_must_be_below_num_writers():
    with pytest.raises(TargetError, match=r"writer_index = 2: must be below num_writers 2"):
        PlanOptions(num_writers=2, writer_index=2)


# ---- tensor-parallel round trips: every rank of one size stores, every rank of another loads ----------------
TOKENS, HEADS, DIM, ELT, LAYERS, BLOCKS = 4, 2, 4, 2, 3, 12
CANON = TOKENS * HEADS * DIM * ELT  # canonical page bytes (all heads)


def tp_layout(tp: int, rank: int, k: int) -> tuple[Layout, int, int, int]:
    """A rank's layout: local pages hold its heads; the host holds canonical pages in chunks of k."""
    local_heads = max(HEADS // tp, 1)
    replicas = max(tp // HEADS, 1)  # ranks sharing each head (replicated KV)
    head0 = (rank // replicas) * local_heads
    piece = local_heads * DIM * ELT
    page = TOKENS * piece
    frag = Fragment(local_offset=0, local_stride=piece, canonical_offset=head0 * DIM * ELT,
                    canonical_stride=HEADS * DIM * ELT, fragment_bytes=piece, count=TOKENS)
    chunks = BLOCKS // k
    buffers = [Buffer(name="gpu", nbytes=LAYERS * BLOCKS * page), Buffer(name="cpu", nbytes=LAYERS * chunks * k * CANON, location="host")]
    regions = [Region(name=f"layer{i}", page_bytes=page, host_page_bytes=CANON, fragments=(frag,),
                      device=Placement(buffer="gpu", byte_offset=i * BLOCKS * page),
                      host=Placement(buffer="cpu", byte_offset=i * chunks * k * CANON, blocks_per_chunk=k)) for i in range(LAYERS)]
    return Layout(buffers=buffers, regions=regions), replicas, rank % replicas, head0


def local_view(canonical: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """What rank ``rank`` of ``tp`` holds for canonical pages shaped (layers, blocks, tokens, heads, dim*elt)."""
    _, _, _, head0 = tp_layout(tp, rank, 1)
    h = max(HEADS // tp, 1)
    return np.ascontiguousarray(canonical[:, :, :, head0:head0 + h, :])


@pytest.mark.parametrize("tp_store,tp_load", [(2, 4), (4, 2), (2, 1), (4, 4)])
@pytest.mark.parametrize("k", [1, 2])
def test_tensor_parallel_round_trip(tp_store, tp_load, k):
    rng = np.random.default_rng(tp_store * 10 + tp_load + k)
    truth = rng.integers(0, 256, (LAYERS, BLOCKS, TOKENS, HEADS, DIM * ELT), dtype=np.uint8)
    gpu_ids = rng.permutation(BLOCKS)[:6]  # device blocks holding logical blocks 2..7 of a request
    start = 2
    chunk_ids = rng.permutation(BLOCKS // k)[: -(-(start % k + 6) // k)]
    host = np.full(LAYERS * BLOCKS * CANON, 0xEE, dtype=np.uint8)
    writes = 0
    for rank in range(tp_store):  # store: device -> canonical host pages
        layout, writers, windex, _ = tp_layout(tp_store, rank, k)
        gpu = np.zeros((LAYERS, BLOCKS) + local_view(truth, tp_store, rank).shape[2:], np.uint8)
        gpu[:, gpu_ids] = local_view(truth, tp_store, rank)[:, start:start + 6]
        m = BlockMapping(direction="d2h", src_ids=gpu_ids, dst_ids=chunk_ids, group_sizes=[6], group_starts=[start])
        opts = PlanOptions(num_writers=writers, writer_index=windex)
        plan = plan_transfer(layout, m, options=opts)
        writes += plan.total_bytes
        NumpyExecutor().run(plan, {"gpu": gpu, "cpu": host})
    assert writes == LAYERS * 6 * CANON  # writer rotation: every canonical byte written exactly once overall
    for rank in range(tp_load):  # load: canonical host pages -> each rank's local slice
        layout, _, _, _ = tp_layout(tp_load, rank, k)
        dst_ids = np.array([11, 0, 7, 8, 9, 2])
        shape = (LAYERS, BLOCKS) + local_view(truth, tp_load, rank).shape[2:]
        gpu = np.full(shape, 0x5A, np.uint8)
        m = BlockMapping(direction="h2d", src_ids=chunk_ids, dst_ids=dst_ids, group_sizes=[6], group_starts=[start])
        NumpyExecutor().run(plan_transfer(layout, m), {"cpu": host, "gpu": gpu})
        np.testing.assert_array_equal(gpu[:, dst_ids], local_view(truth, tp_load, rank)[:, start:start + 6])
        untouched = np.setdiff1d(np.arange(BLOCKS), dst_ids)
        assert np.all(gpu[:, untouched] == 0x5A)


# ---- property test over chunks, skips and groups ------------------------------------------------------------
@st.composite
def fragment_tables(draw, page: int) -> tuple[tuple[Fragment, ...], int]:
    """No fragments, or a page cut into pieces placed at distinct slots of a canonical page 1-3x as large
    (in order, shuffled, or chaining into the next page)."""
    if draw(st.booleans()):
        return (), page
    piece = draw(st.sampled_from([p for p in (1, 2, 4) if page % p == 0]))
    n = page // piece
    scale = draw(st.integers(1, 3))
    slots = draw(st.permutations(list(range(n * scale))))[:n]
    if draw(st.booleans()):
        slots = sorted(slots)
    local = draw(st.permutations(list(range(n))))
    frags = tuple(Fragment(local_offset=lo * piece, local_stride=0, canonical_offset=c * piece, canonical_stride=0,
                           fragment_bytes=piece) for lo, c in zip(local, slots))
    return frags, n * scale * piece


@st.composite
def chunked_cases(draw):
    ngroups = draw(st.integers(1, 3))
    regions, buffers = [], [Buffer(name="g", nbytes=1 << 14), Buffer(name="h", nbytes=1 << 14, location="host")]
    k_dev = [draw(st.sampled_from([1, 1, 2])) for _ in range(ngroups)]
    k_host = [draw(st.sampled_from([1, 2, 3, 4])) for _ in range(ngroups)]
    off_d = off_h = 0
    for g in range(ngroups):
        for j in range(draw(st.integers(1, 3))):
            page = draw(st.sampled_from([4, 8, 12]))
            frags, host_page = draw(fragment_tables(page))
            pad_h = draw(st.sampled_from([0, 0, 4]))
            stride_h = k_host[g] * host_page + pad_h
            regions.append(Region(name=f"g{g}r{j}", page_bytes=page, group=g, fragments=frags,
                                  host_page_bytes=host_page if frags else None,
                                  device=Placement(buffer="g", byte_offset=off_d, blocks_per_chunk=k_dev[g]),
                                  host=Placement(buffer="h", byte_offset=off_h, blocks_per_chunk=k_host[g], stride_bytes=stride_h)))
            off_d += 16 * 4 * page
            off_h += 16 * stride_h
    layout = Layout(buffers=buffers, regions=regions)
    m = draw(group_mappings(k_dev, k_host))
    writers = draw(st.sampled_from([1, 1, 2, 3]))
    return layout, m, PlanOptions(num_writers=writers, writer_index=draw(st.integers(0, writers - 1)))


@st.composite
def group_mappings(draw, k_dev: list[int], k_host: list[int]) -> BlockMapping:
    """Per group: a size, a logical start (so a skip) and distinct chunk ids on each side (64 device pages and
    16 host chunks per region), in either direction."""
    direction = draw(st.sampled_from(["h2d", "d2h"]))
    sizes, starts, dev_ids, host_ids = [], [], [], []
    for g in range(len(k_dev)):
        count, start = draw(st.integers(0, 7)), draw(st.integers(0, 9))
        sizes.append(count)
        starts.append(start)
        for k, out, n_chunks in ((k_dev[g], dev_ids, 16 * 4 // k_dev[g]), (k_host[g], host_ids, 16)):
            need = -(-(start % k + count) // k) if count else 0
            out += draw(st.lists(st.integers(0, n_chunks - 1), min_size=need, max_size=need, unique=True))
    src, dst = (host_ids, dev_ids) if direction == "h2d" else (dev_ids, host_ids)
    return BlockMapping(direction=direction, src_ids=src, dst_ids=dst, group_sizes=sizes, group_starts=starts)


@given(chunked_cases())
def test_chunked_groups_equal_per_fragment_copies(case):
    layout, mapping, options = case
    plan, copies, best = run_and_compare(layout, mapping, options)
    assert plan.num_ranges == best
    assert plan.requested_copies == len(copies)
