"""Property tests: merged plans move exactly the requested bytes, with the fewest ranges, deterministically.

Every expected result comes from the test oracle (kvxfer.testing), which expands the layout model's spec per
piece and never calls the planner. Two strategies: ``cases`` (plain layouts: one group, whole pages, k = 1)
and ``general_cases`` (groups, chunks of k pages with skips, padded rows, fragments, writer rotation,
repeated ids, regions back to back so ranges cross region boundaries, source and destination in one
buffer). A case whose copies conflict (a byte written twice, or read and written by one transfer) must be
refused; any other case must plan and match the oracle byte for byte.
"""
from __future__ import annotations

import functools
import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    COLUMNS,
    BlockMapping,
    Buffer,
    Fragment,
    Layout,
    Location,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    TransferPlan,
    plan_transfer,
    presets,
)
from kvxfer.testing import assert_plan_matches, expected_copies, independent, min_ranges, random_buffers

from .budget import MERGED_EXAMPLES


@functools.lru_cache(maxsize=None, typed=True)
def pick(*values: object) -> st.SearchStrategy:
    """``st.sampled_from(values)``, built once: strategies are drawn from tens of times per example."""
    return st.sampled_from(values)


@functools.lru_cache(maxsize=None, typed=True)
def ints(lo: int, hi: int) -> st.SearchStrategy:
    """``st.integers(lo, hi)``, built once."""
    return st.integers(lo, hi)


@functools.cache  # one strategy object per argument set
@st.composite
def layouts(draw, max_regions: int = 8) -> tuple[Layout, int, int]:
    """Random plain layouts: 1-8 regions, mixed page sizes, strides >= page, separate / back-to-back /
    interleaved buffers per side, or both sides back to back in one buffer (possibly overlapping)."""
    nreg = draw(ints(1, max_regions))
    pages = draw(st.lists(ints(1, 12), min_size=nreg, max_size=nreg))
    nblocks = {"device": draw(ints(4, 24)), "host": draw(ints(4, 24))}
    if draw(pick(False, False, False, True)):
        return one_buffer_layout(draw, pages, nblocks), nblocks["device"], nblocks["host"]
    buffers: list[Buffer] = []
    places: dict[str, list[Placement]] = {}
    for side in ("device", "host"):
        loc = Location.DEVICE if side == "device" else Location.HOST
        mode = draw(pick("separate", "sequential", "interleaved"))
        nb = nblocks[side]
        pads = draw(st.lists(ints(0, 3), min_size=nreg, max_size=nreg))
        if mode == "separate":
            strides = [p + pad for p, pad in zip(pages, pads)]
            lead = draw(st.lists(ints(0, 5), min_size=nreg, max_size=nreg))
            for r in range(nreg):
                buffers.append(Buffer(name=f"{side}{r}", nbytes=lead[r] + strides[r] * nb + draw(ints(0, 4)), location=loc))
            places[side] = [Placement(buffer=f"{side}{r}", byte_offset=lead[r], stride_bytes=strides[r]) for r in range(nreg)]
        elif mode == "sequential":  # regions back to back (gap >= 0) in one allocation, as views of one tensor
            gaps = draw(st.lists(pick(0, 0, 0, 1, 7), min_size=nreg, max_size=nreg))
            off, ps = 0, []
            for r in range(nreg):
                stride = pages[r] + pads[r]
                ps.append(Placement(buffer=side, byte_offset=off, stride_bytes=stride))
                off += stride * nb + gaps[r]
            buffers.append(Buffer(name=side, nbytes=off, location=loc))
            places[side] = ps
        else:  # page-first: block b of every region is contiguous
            row = sum(pages) + draw(pick(0, 0, 3))
            offs = np.concatenate(([0], np.cumsum(pages)[:-1])).tolist()
            buffers.append(Buffer(name=side, nbytes=row * nb, location=loc))
            places[side] = [Placement(buffer=side, byte_offset=offs[r], stride_bytes=row) for r in range(nreg)]
    regions = [Region(name=f"r{r}", page_bytes=pages[r], device=places["device"][r], host=places["host"][r])
               for r in range(nreg)]
    return Layout(buffers=buffers, regions=regions), nblocks["device"], nblocks["host"]


def one_buffer_layout(draw, pages: list[int], nblocks: dict[str, int]) -> Layout:
    """Source and destination in one buffer: the device regions back to back from 0, the host regions back to
    back from an offset that may overlap them (then some mappings read bytes they write, and are refused)."""
    dev_end = sum(pages) * nblocks["device"]
    host_base = draw(pick(dev_end, dev_end, dev_end // 2, 0))
    places: dict[str, list[Placement]] = {"device": [], "host": []}
    for side, off in (("device", 0), ("host", host_base)):
        for p in pages:
            places[side].append(Placement(buffer="m", byte_offset=off, stride_bytes=p))
            off += p * nblocks[side]
    end = max(dev_end, host_base + sum(pages) * nblocks["host"])
    regions = [Region(name=f"r{r}", page_bytes=p, device=places["device"][r], host=places["host"][r])
               for r, p in enumerate(pages)]
    return Layout(buffers=[Buffer(name="m", nbytes=end)], regions=regions)


@functools.cache  # one strategy object per argument set
@st.composite
def mappings(draw, n_src: int, n_dst: int) -> tuple[np.ndarray, np.ndarray]:
    """Ascending and descending runs, gaps, repeated sources and interleavings; now and then a repeated
    destination (which the planner must refuse)."""
    free = list(range(n_dst))
    src: list[int] = []
    dst: list[int] = []
    for _ in range(draw(ints(0, 5))):
        if not free:
            break
        length = draw(ints(1, 6))
        d0 = draw(st.sampled_from(free))
        s0 = draw(ints(0, n_src - 1))
        step_d = draw(pick(1, 1, -1, 2))
        step_s = draw(pick(1, 1, -1, 0, 3))
        for k in range(length):
            d, s = d0 + k * step_d, s0 + k * step_s
            if d not in free or not 0 <= s < n_src:
                break
            free.remove(d)
            src.append(s)
            dst.append(d)
    if dst and draw(pick(*[False] * 9, True)):
        src.append(draw(ints(0, n_src - 1)))
        dst.append(draw(st.sampled_from(dst)))
    order = draw(pick("as-is", "reversed", "shuffled"))
    idx = np.arange(len(src))
    if order == "reversed":
        idx = idx[::-1]
    elif order == "shuffled":
        idx = np.array(draw(st.permutations(list(range(len(src))))), dtype=np.int64)
    return np.array(src, dtype=np.int64)[idx], np.array(dst, dtype=np.int64)[idx]


@st.composite
def cases(draw) -> tuple[Layout, BlockMapping]:
    """Plain cases: a plain layout and a mapping in one direction."""
    layout, nb_dev, nb_host = draw(layouts())
    direction = draw(pick("h2d", "d2h"))
    n_src, n_dst = (nb_host, nb_dev) if direction == "h2d" else (nb_dev, nb_host)
    s, d = draw(mappings(n_src, n_dst))
    return layout, BlockMapping(direction=direction, src_ids=s, dst_ids=d)


# ---- the whole layout model: groups, chunks, skips, padded rows, fragments, writers ----------------------------
@functools.cache  # one strategy object per argument set
@st.composite
def fragment_table(draw, page: int) -> tuple[tuple[Fragment, ...], int]:
    """No fragments (the whole page); single pieces at distinct slots of a canonical page 1-3x as large (in
    order or shuffled); or one strided run, as a tensor-parallel rank's slice of every token."""
    kind = draw(pick("whole", "whole", "slots", "run"))
    if kind == "whole":
        return (), page
    piece = draw(pick(*[p for p in (1, 2, 4) if page % p == 0]))
    n, scale = page // piece, draw(ints(1, 3))
    if kind == "run":
        off = draw(ints(0, scale - 1)) * piece
        return (Fragment(local_offset=0, local_stride=piece, canonical_offset=off, canonical_stride=scale * piece,
                         fragment_bytes=piece, count=n),), n * scale * piece
    slots = draw(st.permutations(list(range(n * scale))))[:n]
    if draw(st.booleans()):
        slots = sorted(slots)
    local = draw(st.permutations(list(range(n))))
    return tuple(Fragment(local_offset=lo * piece, local_stride=0, canonical_offset=c * piece, canonical_stride=0,
                          fragment_bytes=piece) for lo, c in zip(local, slots)), n * scale * piece


HAS_REGION_WRITERS = "num_writers" in Region.model_fields
HAS_DECLARED_GROUPS = "num_groups" in Layout.model_fields


@st.composite
def general_cases(draw) -> tuple[Layout, BlockMapping, PlanOptions]:
    """Cases over the whole layout model: 1-3 groups of 1-3 regions; k per group and side (device 1-2, host 1-4);
    padded rows; fragments; regions in separate buffers, back to back (so merged ranges cross region
    boundaries), or both sides in one buffer; group starts that skip into a chunk; repeated ids on either
    side; writer rotation (per region too, once regions carry it); options that cap calls, split ranges,
    cut calls per region, or keep every piece."""
    ngroups = draw(ints(1, 3))
    k = {"device": [draw(pick(1, 1, 2)) for _ in range(ngroups)],
         "host": [draw(pick(1, 2, 3, 4)) for _ in range(ngroups)]}
    nchunks = {"device": draw(ints(3, 8)), "host": draw(ints(3, 8))}
    mode = draw(pick("separate", "back-to-back", "back-to-back", "one-buffer"))
    specs = []  # (group, page, fragments, host page, device stride, host stride)
    for g in range(ngroups):
        for _ in range(draw(ints(1, 3))):
            page = draw(pick(4, 8, 12))
            frags, host_page = draw(fragment_table(page))
            pads = {side: draw(pick(0, 0, 0, 4)) for side in ("device", "host")}
            specs.append((g, page, frags, host_page, k["device"][g] * page + pads["device"],
                          k["host"][g] * host_page + pads["host"]))
    places: dict[str, list[Placement]] = {"device": [], "host": []}
    buffers: list[Buffer] = []
    ends = {}
    for side, col in (("device", 4), ("host", 5)):
        off = 0
        for r, spec in enumerate(specs):
            name = {"separate": f"{side[0]}{r}", "back-to-back": side[0], "one-buffer": "m"}[mode]
            if mode == "separate":
                off = 0
            places[side].append(Placement(buffer=name, byte_offset=off, stride_bytes=spec[col],
                                          blocks_per_chunk=k[side][spec[0]]))
            off += nchunks[side] * spec[col] + (draw(pick(0, 0, 0, 3)) if mode == "back-to-back" else 0)
            if mode == "separate":
                buffers.append(Buffer(name=name, nbytes=off, location=Location(side)))
        ends[side] = off
    if mode == "one-buffer":  # the host regions start at, inside or before the end of the device regions
        shift = draw(st.sampled_from([ends["device"], ends["device"], ends["device"] // 2, 0]))
        places["host"] = [p.model_copy(update={"byte_offset": p.byte_offset + shift}) for p in places["host"]]
        buffers.append(Buffer(name="m", nbytes=max(ends["device"], shift + ends["host"])))
    elif mode == "back-to-back":
        buffers += [Buffer(name="d", nbytes=ends["device"]), Buffer(name="h", nbytes=ends["host"], location=Location.HOST)]
    regions = []
    for r, (g, page, frags, host_page, _, _) in enumerate(specs):
        extra = {}
        if HAS_REGION_WRITERS and draw(st.booleans()):
            n = draw(pick(1, 2, 3))
            extra = {"num_writers": n, "writer_index": draw(ints(0, n - 1))}
        regions.append(Region(name=f"g{g}r{r}", page_bytes=page, group=g, fragments=frags,
                              host_page_bytes=host_page if frags else None,
                              device=places["device"][r], host=places["host"][r], **extra))
    direction = draw(pick("h2d", "d2h"))
    sizes, starts, ids = [], [], {"device": [], "host": []}
    wrap = mode == "back-to-back" and draw(st.booleans())  # last chunk then chunk 0: ranges cross regions
    for g in range(ngroups):
        count, start = draw(ints(0, 7)), draw(ints(0, 9))
        sizes.append(count)
        starts.append(start)
        for side in ("device", "host"):
            kk, n = k[side][g], nchunks[side]
            need = -(-(start % kk + count) // kk) if count else 0
            if wrap and 0 < need <= n:
                tail = draw(ints(1, need))
                ids[side] += [(n - tail + i) % n for i in range(need)]
                continue
            unique = need <= n and draw(pick(True, True, True, False))
            ids[side] += draw(st.lists(ints(0, n - 1), min_size=need, max_size=need, unique=unique))
    extra_layout = {}
    if HAS_DECLARED_GROUPS and draw(pick(False, False, True)):  # a group with no regions
        extra_layout = {"num_groups": ngroups + 1}
        ks = {side: {p.blocks_per_chunk for p in places[side]} for side in ("device", "host")}
        count = draw(ints(0, 5)) if all(len(v) == 1 for v in ks.values()) else 0  # else its ids are undefined
        sizes.append(count)
        starts.append(0)
        for side in ("device", "host"):
            need = -(-count // min(ks[side]))
            ids[side] += draw(st.lists(ints(0, nchunks[side] - 1), min_size=need, max_size=need))
    layout = Layout(buffers=buffers, regions=regions, **extra_layout)
    src, dst = (ids["host"], ids["device"]) if direction == "h2d" else (ids["device"], ids["host"])
    mapping = BlockMapping(direction=direction, src_ids=src, dst_ids=dst, group_sizes=sizes, group_starts=starts)
    return layout, mapping, draw(plan_options())


@functools.cache  # one strategy object per argument set
@st.composite
def plan_options(draw, plain: bool = False) -> PlanOptions:
    """Merging on or off, call caps (0 = unlimited), range splitting, per-region calls, writer rotation."""
    writers = 1 if plain else draw(pick(1, 1, 2, 3))
    return PlanOptions(coalesce=draw(pick(True, True, True, False)),
                       max_descriptors=draw(pick(None, None, 0, 1, 2, 5)),
                       max_range_bytes=draw(pick(None, None, None, 3, 8, 13)),
                       regions_per_call=draw(pick(None, None, 1, 2)),
                       num_writers=writers, writer_index=draw(ints(0, writers - 1)))


def check_case(layout: Layout, mapping: BlockMapping, options: PlanOptions = PlanOptions()) -> TransferPlan | None:
    """Plan the case and hold the plan to the oracle; a case whose copies conflict must be refused instead.

    Checks bytes (sentinels included), the copy count, the call cap, range splitting, per-region calls, one
    range per piece without merging and, with merging inside one call group, the fewest possible ranges.
    """
    copies = expected_copies(layout, mapping, options)
    if not independent(copies):
        with pytest.raises(ValueError, match=r"written twice|also writes|overlap source bytes"):
            plan_transfer(layout, mapping, options=options)
        return None
    plan = plan_transfer(layout, mapping, options=options)
    assert_plan_matches(plan, layout, mapping, options, seed=len(copies))
    assert plan.requested_copies == len(copies) and plan.total_bytes == copies.total_bytes
    cap = options.descriptor_cap(plan.target)
    assert int(plan.call_sizes.sum()) == plan.num_ranges and (cap is None or np.all(plan.call_sizes <= cap))
    if options.max_range_bytes:
        assert plan.num_ranges == 0 or int(plan.nbytes.max()) <= options.max_range_bytes
    if options.regions_per_call:
        for sl in plan.calls():
            assert len(set((plan.region[sl] // options.regions_per_call).tolist())) == 1
    if not options.coalesce and not options.max_range_bytes:
        assert plan.num_ranges == len(copies)
    if options.coalesce and not options.max_range_bytes and not options.regions_per_call:
        assert plan.num_ranges == min_ranges(copies)
    return plan


@settings(max_examples=MERGED_EXAMPLES)
@given(st.one_of(cases().map(lambda c: (*c, PlanOptions())), general_cases()))
def test_merged_plan_equals_per_block_copies(case):
    """The headline property: whatever the layout, the merged plan moves exactly the oracle's bytes."""
    check_case(*case)


@given(cases(), plan_options(plain=True))
def test_plan_shape_and_determinism(case, options):
    layout, mapping = case
    plan = check_case(layout, mapping, options)
    if plan is None:
        return
    # order independence: any permutation of the pairs gives the identical plan
    p = np.random.default_rng(len(mapping)).permutation(len(mapping))
    shuffled = BlockMapping(direction=mapping.direction, src_ids=mapping.src_ids[p], dst_ids=mapping.dst_ids[p])
    assert plan_transfer(layout, shuffled, options=options) == plan
    assert TransferPlan.from_json(plan.to_json()) == plan
    assert Layout.model_validate_json(layout.model_dump_json()) == layout


@given(cases())
def test_unmerged_plan_is_one_range_per_copy(case):
    layout, mapping = case
    check_case(layout, mapping, PlanOptions(coalesce=False))


@given(general_cases())
def test_the_whole_layout_model_plans_under_every_option(case):
    """Groups, chunks, fragments and writers under every option, against the oracle (a second budget beside the
    headline one)."""
    check_case(*case)


# ---- examples the properties reach rarely: each pins one refusal ----------------------------------------------
def _chunked(k_host: int = 2) -> Layout:
    return Layout(buffers=[Buffer(name="g", nbytes=512), Buffer(name="h", nbytes=512, location="host")],
                  regions=[Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                  host=Placement(buffer="h", blocks_per_chunk=k_host))])


@pytest.mark.parametrize("dst", [[5, 5], [1, 5, 5]])
def test_a_repeated_destination_chunk_is_refused(dst):
    """k > 1: the same host chunk twice would write the same host bytes twice."""
    n = 2 * len(dst)
    m = BlockMapping(direction="d2h", src_ids=np.arange(n), dst_ids=dst, group_sizes=[n])
    assert not independent(expected_copies(_chunked(), m))
    with pytest.raises(ValueError, match=r"written twice|also writes"):
        plan_transfer(_chunked(), m)


def test_a_repeated_chunk_whose_pages_differ_is_planned():
    """Chunk 5 twice with k = 2 and skip 1 names pages 11 and 10: distinct bytes, a valid transfer."""
    m = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[5, 5], group_sizes=[2], group_starts=[1])
    assert expected_copies(_chunked(), m).dst_offset.tolist() == [11 * 8, 10 * 8]
    check_case(_chunked(), m)


def test_overlapping_regions_in_one_transfer_are_refused():
    """Two regions whose host pages overlap: the same host bytes written by both."""
    regions = [Region(name=f"r{i}", page_bytes=8, device=Placement(buffer="g", byte_offset=256 * i),
                      host=Placement(buffer="h", byte_offset=4 * i, blocks_per_chunk=2)) for i in range(2)]
    layout = Layout(buffers=[Buffer(name="g", nbytes=512), Buffer(name="h", nbytes=512, location="host")], regions=regions)
    m = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[3], group_sizes=[2])
    with pytest.raises(ValueError, match=r"written twice|also writes"):
        plan_transfer(layout, m)


def test_a_transfer_reading_bytes_it_writes_is_refused():
    """Both sides in one buffer: a store whose host pages are the device pages it reads."""
    layout = Layout(buffers=[Buffer(name="m", nbytes=512)],
                    regions=[Region(name="r", page_bytes=8, device=Placement(buffer="m"),
                                    host=Placement(buffer="m", byte_offset=8, blocks_per_chunk=2))])
    m = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0], group_sizes=[2])
    assert not independent(expected_copies(layout, m))
    with pytest.raises(ValueError, match=r"overlap source bytes"):
        plan_transfer(layout, m)


# ---- the plan value: fingerprints and checks ----------------------------------------------------------------
def _rebuild(plan: TransferPlan, **changes) -> TransferPlan:
    cols = {c: getattr(plan, c).copy() for c in COLUMNS}
    cols.update(changes.pop("columns", {}))
    kw = dict(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
              regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
              call_offsets=plan.call_offsets, passes_attrs=plan.passes_attrs, api=plan.api,
              region_page_bytes=plan.region_page_bytes)
    return TransferPlan(**(kw | changes), columns=cols)


def test_fingerprint_changes_with_every_column():
    """Changing one value of any one column (or the call boundaries) changes the fingerprint; the same
    values stored run-length encoded or dense give the same fingerprint."""
    layout = presets.kv_layout(3, 32, 64, shared_device=True)
    plan = plan_transfer(layout, presets.mapping("runs8", 12, 32), options=PlanOptions(max_descriptors=4))
    assert plan.num_ranges >= 4 and len(plan.attrs) >= 1
    same = _rebuild(plan)
    assert same.fingerprint == plan.fingerprint
    seen = {plan.fingerprint}
    for name in COLUMNS:
        for i in (0, plan.num_ranges - 1):
            col = getattr(plan, name).copy()
            col[i] = col[i] + 1 if name not in ("attr",) else (col[i] + 1) % 2
            other = _rebuild(plan, columns={name: col})
            assert other.fingerprint not in seen, f"changing {name}[{i}] kept the fingerprint"
            seen.add(other.fingerprint)
    co = plan.call_offsets.copy()
    co[1] += 1
    assert _rebuild(plan, call_offsets=co).fingerprint not in seen
    assert _rebuild(plan, requested_copies=plan.requested_copies + 1).fingerprint not in seen


def test_check_refuses_a_range_that_wraps_uint64():
    """offset + nbytes past 2**64 wraps to a small end that looks in bounds; check and the executor refuse it."""
    layout = presets.kv_layout(1, 8, 16)
    plan = plan_transfer(layout, presets.mapping("contiguous", 2, 8))
    for side in ("src", "dst"):
        off = getattr(plan, f"{side}_offset").copy()
        off[0] = np.uint64(2**64 - 8)
        bad = _rebuild(plan, columns={f"{side}_offset": off})
        assert int(off[0]) + int(bad.nbytes[0]) > 2**64  # wraps, to an end inside the buffer
        with pytest.raises(PlanError, match=rf"{side}_offset\[0\] = 18446744073709551608: range of \d+ bytes runs past"):
            bad.check()
        bufs = random_buffers(layout)
        before = {k: v.copy() for k, v in bufs.items()}
        with pytest.raises(ValueError, match=rf"{side}_offset"):
            NumpyExecutor().run(bad, bufs)
        for k in bufs:
            np.testing.assert_array_equal(bufs[k], before[k])


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
