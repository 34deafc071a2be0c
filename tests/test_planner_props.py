"""Property tests: merged plans move exactly the requested bytes, with the fewest ranges, deterministically."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    Location,
    Placement,
    PlanOptions,
    Region,
    TransferPlan,
    plan_transfer,
)

from .reference import apply_copies, block_copies, filled_buffers, min_ranges


@st.composite
def layouts(draw, max_regions: int = 8) -> tuple[Layout, int, int]:
    """Random layouts: 1-8 regions, mixed page sizes, strides >= page, separate / back-to-back / interleaved buffers."""
    nreg = draw(st.integers(1, max_regions))
    pages = draw(st.lists(st.integers(1, 12), min_size=nreg, max_size=nreg))
    nblocks = {"device": draw(st.integers(4, 24)), "host": draw(st.integers(4, 24))}
    buffers: list[Buffer] = []
    places: dict[str, list[Placement]] = {}
    for side in ("device", "host"):
        loc = Location.DEVICE if side == "device" else Location.HOST
        mode = draw(st.sampled_from(["separate", "sequential", "interleaved"]))
        nb = nblocks[side]
        pads = draw(st.lists(st.integers(0, 3), min_size=nreg, max_size=nreg))
        if mode == "separate":
            strides = [p + pad for p, pad in zip(pages, pads)]
            lead = draw(st.lists(st.integers(0, 5), min_size=nreg, max_size=nreg))
            for r in range(nreg):
                buffers.append(Buffer(name=f"{side}{r}", nbytes=lead[r] + strides[r] * nb + draw(st.integers(0, 4)), location=loc))
            places[side] = [Placement(buffer=f"{side}{r}", byte_offset=lead[r], stride_bytes=strides[r]) for r in range(nreg)]
        elif mode == "sequential":  # regions back to back (gap >= 0) in one allocation, as views of one tensor
            gaps = draw(st.lists(st.sampled_from([0, 0, 0, 1, 7]), min_size=nreg, max_size=nreg))
            off, ps = 0, []
            for r in range(nreg):
                stride = pages[r] + pads[r]
                ps.append(Placement(buffer=side, byte_offset=off, stride_bytes=stride))
                off += stride * nb + gaps[r]
            buffers.append(Buffer(name=side, nbytes=off, location=loc))
            places[side] = ps
        else:  # page-first: block b of every region is contiguous
            row = sum(pages) + draw(st.sampled_from([0, 0, 3]))
            offs = np.concatenate(([0], np.cumsum(pages)[:-1])).tolist()
            buffers.append(Buffer(name=side, nbytes=row * nb, location=loc))
            places[side] = [Placement(buffer=side, byte_offset=offs[r], stride_bytes=row) for r in range(nreg)]
    regions = [Region(name=f"r{r}", page_bytes=pages[r], device=places["device"][r], host=places["host"][r])
               for r in range(nreg)]
    return Layout(buffers=buffers, regions=regions), nblocks["device"], nblocks["host"]


@st.composite
def mappings(draw, n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Ascending and descending runs, gaps, repeated sources and interleavings; destinations never repeat."""
    free = list(range(n_dst))
    src: list[int] = []
    dst: list[int] = []
    for _ in range(draw(st.integers(0, 5))):
        if not free:
            break
        length = draw(st.integers(1, 6))
        d0 = draw(st.sampled_from(free))
        s0 = draw(st.integers(0, n_src - 1))
        step_d = draw(st.sampled_from([1, 1, -1, 2]))
        step_s = draw(st.sampled_from([1, 1, -1, 0, 3]))
        for k in range(length):
            d, s = d0 + k * step_d, s0 + k * step_s
            if d not in free or not 0 <= s < n_src:
                break
            free.remove(d)
            src.append(s)
            dst.append(d)
    order = draw(st.sampled_from(["as-is", "reversed", "shuffled"]))
    idx = np.arange(len(src))
    if order == "reversed":
        idx = idx[::-1]
    elif order == "shuffled":
        idx = np.array(draw(st.permutations(list(range(len(src))))), dtype=np.int64)
    return np.array(src, dtype=np.int64)[idx], np.array(dst, dtype=np.int64)[idx]


@st.composite
def cases(draw):
    layout, nb_dev, nb_host = draw(layouts())
    direction = draw(st.sampled_from(["h2d", "d2h"]))
    n_src, n_dst = (nb_host, nb_dev) if direction == "h2d" else (nb_dev, nb_host)
    s, d = draw(mappings(n_src, n_dst))
    return layout, BlockMapping(direction=direction, src_ids=s, dst_ids=d)


def check_plan_against_oracle(layout: Layout, mapping: BlockMapping, plan: TransferPlan) -> None:
    copies = block_copies(layout, mapping)
    bufs = filled_buffers(layout, seed=len(copies))
    want = {k: v.copy() for k, v in bufs.items()}
    apply_copies(copies, want)
    NumpyExecutor().run(plan, bufs)
    for name in bufs:  # requested bytes copied, every other byte (the sentinels) untouched
        np.testing.assert_array_equal(bufs[name], want[name], err_msg=name)
    assert plan.total_bytes == sum(c[4] for c in copies)


@given(cases())
def test_merged_plan_equals_per_block_copies(case):
    layout, mapping = case
    plan = plan_transfer(layout, mapping)
    check_plan_against_oracle(layout, mapping, plan)
    assert plan.num_ranges == min_ranges(block_copies(layout, mapping))


@given(cases(), st.integers(0, 4), st.sampled_from([None, 5, 13]))
def test_plan_shape_and_determinism(case, cap, max_range):
    layout, mapping = case
    options = PlanOptions(max_descriptors=cap, max_range_bytes=max_range)
    plan = plan_transfer(layout, mapping, options=options)
    check_plan_against_oracle(layout, mapping, plan)
    sizes = plan.call_sizes
    assert sizes.sum() == plan.num_ranges and (cap == 0 or np.all(sizes <= cap))
    if max_range:
        assert plan.num_ranges == 0 or int(plan.nbytes.max()) <= max_range
    # order independence: any permutation of the pairs gives the identical plan
    p = np.random.default_rng(len(mapping)).permutation(len(mapping))
    shuffled = BlockMapping(direction=mapping.direction, src_ids=mapping.src_ids[p], dst_ids=mapping.dst_ids[p])
    assert plan_transfer(layout, shuffled, options=options) == plan
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert Layout.model_validate_json(layout.model_dump_json()) == layout


@given(cases())
def test_unmerged_plan_is_one_range_per_copy(case):
    layout, mapping = case
    plan = plan_transfer(layout, mapping, options=PlanOptions(coalesce=False))
    assert plan.num_ranges == len(mapping) * len(layout.regions)
    check_plan_against_oracle(layout, mapping, plan)


def _one_region(ids: int) -> Layout:
    return Layout(buffers=[Buffer(name="g", nbytes=2 * ids), Buffer(name="h", nbytes=2 * ids, location="host")],
                  regions=[Region(name="r", page_bytes=2, device=Placement(buffer="g"), host=Placement(buffer="h"))])


def _brute_force_ranges(src: tuple[int, ...], dst: tuple[int, ...]) -> int:
    """Fewest runs: a pair continues a run iff (s-1, d-1) is also a pair (destinations are distinct)."""
    pairs = set(zip(src, dst))
    return sum((s - 1, d - 1) not in pairs for s, d in pairs) + (len(src) - len(pairs))


def test_exhaustive_short_mappings():
    """Every mapping of up to 3 pairs over 6 ids in every order, and 4 pairs with destinations in both sorted orders."""
    ids = 6
    layout = _one_region(ids)
    checked = 0
    for n in range(1, 5):
        dst_sets = itertools.permutations(range(ids), n) if n < 4 else (
            c[::o] for c in itertools.combinations(range(ids), n) for o in (1, -1))
        for dst in dst_sets:
            for src in itertools.product(range(ids), repeat=n):
                plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=src, dst_ids=dst))
                want = _brute_force_ranges(src, dst)
                if plan.num_ranges != want:
                    pytest.fail(f"src {src} dst {dst}: {plan.num_ranges} ranges, brute force says {want}")
                checked += 1
    assert checked == 6 * 6 + 36 * 30 + 216 * 120 + 1296 * 30
