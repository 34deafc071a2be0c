"""The layout model, complete: writer rotation per region, aliased regions, declared (possibly empty) groups."""
from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Case,
    Layout,
    LayoutError,
    Location,
    MappingError,
    Placement,
    PlanOptions,
    Region,
    plan_transfer,
    presets,
)
from kvxfer.testing import apply_copies, expected_copies, min_ranges, random_buffers

from .test_layouts import fragment_tables, group_mappings


def run_against_oracle(layout: Layout, mapping: BlockMapping, options: PlanOptions = PlanOptions()):
    plan = plan_transfer(layout, mapping, options=options)
    copies = expected_copies(layout, mapping, options)
    bufs = random_buffers(layout, seed=len(copies))
    want = {k: v.copy() for k, v in bufs.items()}
    apply_copies(copies, want)
    NumpyExecutor().run(plan, bufs)
    for k in bufs:  # requested bytes copied; every other byte untouched
        np.testing.assert_array_equal(bufs[k], want[k], err_msg=k)
    return plan, copies


# ---- the repro: which rank writes which page ----------------------------------------------------
def mixed_layout(writer_index: int) -> Layout:
    buffers = (Buffer(name="dev.repl", nbytes=32 * 8), Buffer(name="dev.priv", nbytes=32 * 8),
               Buffer(name="host", nbytes=64 * 8, location=Location.HOST))
    return Layout(buffers=buffers, regions=(
        Region(name="repl", page_bytes=32, device=Placement(buffer="dev.repl"),
               host=Placement(buffer="host", stride_bytes=64), num_writers=2, writer_index=writer_index),
        Region(name="priv", page_bytes=32, device=Placement(buffer="dev.priv"),
               host=Placement(buffer="host", byte_offset=32, stride_bytes=64), num_writers=1)))


STORE_0_3 = BlockMapping(direction="d2h", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3])


@pytest.mark.parametrize("plan_writers", [PlanOptions(), PlanOptions(num_writers=2, writer_index=0),
                                          PlanOptions(num_writers=4, writer_index=3)])
def test_each_region_rotates_its_own_writers(plan_writers):
    """Replicated pages 0 and 2 plus private pages 0-3, whatever the plan-level options say (6 pages)."""
    plan = plan_transfer(mixed_layout(0), STORE_0_3, options=plan_writers)
    written = sorted((plan.regions[r], int(o)) for r, o in zip(plan.region, plan.dst_offset))
    assert written == [("priv", 32), ("priv", 96), ("priv", 160), ("priv", 224), ("repl", 0), ("repl", 128)]
    assert plan.requested_copies == 6 and plan.region_writers == ((2, 0), (1, 0))
    assert "writers  index 0 of 2: repl | every rank: priv" in plan.explain()


def test_rank_1_writes_the_other_replicated_pages_and_loads_read_everything():
    plan = plan_transfer(mixed_layout(1), STORE_0_3)
    assert sorted(int(o) for r, o in zip(plan.region, plan.dst_offset) if r == 0) == [64, 192]  # pages 1 and 3
    load = plan_transfer(mixed_layout(1), BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3]))
    assert load.total_bytes == 8 * 32 and not load.region_writers


def test_two_ranks_write_every_canonical_byte_exactly_once():
    host = np.zeros(64 * 8, np.uint8)
    seen = np.zeros(64 * 8, np.int64)
    for rank in (0, 1):
        layout = mixed_layout(rank)
        plan = plan_transfer(layout, STORE_0_3)
        for o, n in zip(plan.dst_offset.tolist(), plan.nbytes.tolist()):
            seen[o:o + n] += 1
        bufs = {"dev.repl": np.full(256, 10 + rank, np.uint8), "dev.priv": np.full(256, 20 + rank, np.uint8), "host": host}
        NumpyExecutor().run(plan, bufs)
    repl = np.concatenate([np.arange(p * 64, p * 64 + 32) for p in range(4)])
    assert np.all(seen[repl] == 1)  # the replicated layer: once overall
    assert np.all(seen[repl + 32] == 2)  # the private layer: once per rank (each rank owns its own host row)
    assert host[repl].tolist() == [10] * 32 + [11] * 32 + [10] * 32 + [11] * 32


def test_region_writer_settings_are_checked():
    with pytest.raises(LayoutError, match=r"writer_index = 2: must be below num_writers 2"):
        Region(name="r", page_bytes=8, device=Placement(buffer="g"), host=Placement(buffer="h"), num_writers=2, writer_index=2)
    layout = mixed_layout(0).model_copy(update={"regions": (mixed_layout(0).regions[0].model_copy(
        update={"writer_index": None}), mixed_layout(0).regions[1])})
    with pytest.raises(LayoutError, match=r"regions\[0\].writer_index = 3: must be below num_writers 2"):
        plan_transfer(layout, STORE_0_3, options=PlanOptions(num_writers=4, writer_index=3))


# ---- aliased regions --------------------------------------------------------------------------------------
def alias_layout(**alias_changes) -> Layout:
    g, h = Buffer(name="g", nbytes=64 * 16), Buffer(name="h", nbytes=64 * 16, location=Location.HOST)
    layer = Region(name="layer", page_bytes=64, device=Placement(buffer="g"), host=Placement(buffer="h"))
    alias = layer.model_copy(update={"name": "alias"})
    if alias_changes:
        alias = Region.model_validate(alias.model_dump() | alias_changes)
    return Layout(buffers=(g, h), regions=(layer, alias))


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_aliased_regions_are_planned_once_and_said_once(direction):
    m = BlockMapping(direction=direction, src_ids=[0, 1, 2, 9], dst_ids=[4, 5, 6, 3])
    plan, copies = run_against_oracle(alias_layout(), m)
    assert plan.num_ranges == min_ranges(copies) == 2 and plan.total_bytes == 4 * 64
    assert plan.aliases == (("alias", "layer"),) and set(plan.region.tolist()) == {0}
    text = plan.explain()
    assert text.count("region 'alias' aliases 'layer'") == 1
    same = Layout(buffers=alias_layout().buffers, regions=alias_layout().regions[:1])
    from kvxfer.planner.diff import diff_plans
    assert "aliases 0 -> 1" in diff_plans(plan_transfer(same, m), plan).summary


def test_an_alias_keeps_its_own_call_group():
    layout = alias_layout()
    plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[2, 3]),
                         options=PlanOptions(regions_per_call=1))
    assert plan.num_calls == 1 and plan.region.tolist() == [0]


def test_device_only_sharing_is_fine_on_stores_and_refused_on_loads():
    layout = alias_layout(host={"buffer": "h", "byte_offset": 64 * 8})
    store = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0, 1])
    plan, copies = run_against_oracle(layout, store)  # two reads of the same device bytes into two destinations
    assert plan.num_ranges == 2 and not plan.aliases
    with pytest.raises(LayoutError, match=r"regions\[1\] = 'alias': writes bytes at offset 0 of buffer 'g' that "
                                          r"region 'layer' also writes"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[0, 1]))


def test_partially_overlapping_regions_stay_errors():
    layout = alias_layout(device={"buffer": "g", "byte_offset": 32}, host={"buffer": "h", "byte_offset": 32})
    for direction in ("h2d", "d2h"):
        with pytest.raises(LayoutError, match=r"regions\[1\] = 'alias': writes bytes at offset 32 .* that region "
                                              r"'layer' also writes"):
            plan_transfer(layout, BlockMapping(direction=direction, src_ids=[0], dst_ids=[0]))


def test_regions_differing_only_in_writers_are_not_aliases():
    layout = alias_layout(num_writers=2, writer_index=1)
    assert plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[], dst_ids=[])).aliases == ()
    with pytest.raises(LayoutError, match=r"also writes"):
        plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[0, 1]))


def test_layout_from_tensors_layers_sharing_one_tensor_become_aliases():
    torch = pytest.importorskip("torch")
    from kvxfer.executors.torch_layout import layout_from_tensors

    dev, host = torch.arange(8 * 16, dtype=torch.uint8).reshape(8, 16), torch.zeros(8, 16, dtype=torch.uint8)
    other_dev, other_host = torch.ones(8, 16, dtype=torch.uint8), torch.zeros(8, 16, dtype=torch.uint8)
    layout, bindings = layout_from_tensors({"a": dev, "b": dev, "c": other_dev}, {"a": host, "b": host, "c": other_host})
    plan = plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[1, 2], dst_ids=[5, 6]))
    NumpyExecutor().run(plan, bindings)
    assert torch.equal(host[5:7], dev[1:3]) and plan.aliases == (("b", "a"),)


# ---- declared groups --------------------------------------------------------------------------------------
def groups_layout(num_groups: int | None) -> Layout:
    g, h = Buffer(name="g", nbytes=16 * 32), Buffer(name="h", nbytes=16 * 32, location=Location.HOST)
    regs = (Region(name="full", page_bytes=16, device=Placement(buffer="g"), host=Placement(buffer="h")),
            Region(name="swa", page_bytes=16, group=2, device=Placement(buffer="g", byte_offset=16 * 16),
                   host=Placement(buffer="h", byte_offset=16 * 16)))
    return Layout(buffers=(g, h), regions=regs, num_groups=num_groups)


def test_an_empty_group_consumes_its_ids_and_copies_nothing():
    m = BlockMapping(direction="h2d", src_ids=[0, 1, 7, 7, 2], dst_ids=[3, 4, 9, 9, 5], group_sizes=[2, 2, 1])
    plan, copies = run_against_oracle(groups_layout(3), m)  # group 1 names ids 7 twice: nothing is copied for it
    assert plan.num_ranges == min_ranges(copies) == 2 and plan.requested_copies == 3
    assert "groups   3 declared, without regions: [1]" in plan.explain(layout=groups_layout(3))
    plan, _ = run_against_oracle(groups_layout(None), m)  # undeclared: groups up to the largest region.group
    assert plan.total_bytes == 3 * 16


def test_declared_groups_catch_a_wrong_group_sizes_length():
    with pytest.raises(MappingError, match=r"group_sizes = \[2, 1, 1\]: the layout has 4 KV-cache groups"):
        plan_transfer(groups_layout(4), BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3], dst_ids=[0, 1, 2, 3],
                                                     group_sizes=[2, 1, 1]))
    with pytest.raises(LayoutError, match=r"regions\[1\].group = 2: the layout declares 2 KV-cache groups"):
        groups_layout(2)


EMPTY_MAPPINGS = {
    "no groups": dict(src_ids=[0, 1, 2], dst_ids=[3, 4, 5]),
    "host chunks of k = 4": dict(src_ids=[0, 1], dst_ids=list(range(8)), group_sizes=[8]),
    "a group starting inside a chunk": dict(src_ids=[2, 3, 9], dst_ids=list(range(9)), group_sizes=[9], group_starts=[3]),
    "two groups": dict(src_ids=[5], dst_ids=[0, 1, 2, 3, 4], group_sizes=[4, 1], group_starts=[0, 2]),
    "nothing": dict(src_ids=[], dst_ids=[]),
}


@pytest.mark.parametrize("form", ["BlockMapping", "dict"])
@pytest.mark.parametrize("name", sorted(EMPTY_MAPPINGS))
def test_a_layout_without_regions_plans_any_well_formed_mapping_to_an_empty_plan(name, form):
    """A tensor-parallel rank whose KV tensors all map nothing has a layout without regions: whatever its chunk
    size on the host (k > 1 here), a job plans to no ranges and moves no byte."""
    fields = EMPTY_MAPPINGS[name]
    groups = len(fields.get("group_sizes", [1]))
    layout = Layout(buffers=(Buffer(name="host", nbytes=4096, location=Location.HOST),), regions=(),
                    num_groups=groups if groups > 1 else None)
    for direction in ("h2d", "d2h"):
        mapping = (BlockMapping(direction=direction, **fields) if form == "BlockMapping" else
                   {"direction": direction, **{k: np.array(v, np.int64) if k.endswith("_ids") else v
                                               for k, v in fields.items()}})
        plan = plan_transfer(layout, mapping)
        assert (plan.num_ranges, plan.num_calls, plan.requested_copies, plan.total_bytes) == (0, 0, 0, 0)
        assert plan.regions == () and plan.call_offsets.tolist() == [0]
        memory = {"host": np.arange(4096, dtype=np.int64).astype(np.uint8)}
        before = memory["host"].copy()
        NumpyExecutor().run(plan, memory)
        assert np.array_equal(memory["host"], before)


def test_a_layout_says_its_group_count_and_whether_it_is_chunked():
    host = Buffer(name="h", nbytes=4096, location=Location.HOST)
    assert (Layout(buffers=(host,), regions=()).group_count, Layout(buffers=(host,), regions=()).chunked) == (1, False)
    assert Layout(buffers=(host,), regions=(), num_groups=3).group_count == 3
    assert (groups_layout(None).group_count, groups_layout(4).group_count) == (3, 4)
    chunked = presets.chunked_layout(2, 16, 64, blocks_per_chunk=4)
    assert chunked.chunked and not presets.kv_layout(2, 16, 64).chunked
    assert chunked.prepare() is chunked
    plan = plan_transfer(chunked, BlockMapping(direction="h2d", src_ids=[1], dst_ids=[0, 1, 2, 3], group_sizes=[4]))
    assert plan.num_ranges == 2  # one per region: the prepared layout plans as before


def test_a_layout_without_regions_still_refuses_a_malformed_mapping():
    layout = Layout(buffers=(Buffer(name="host", nbytes=64, location=Location.HOST),), regions=(), num_groups=2)
    with pytest.raises(MappingError, match=r"src_ids\[1\] = -1: block ids must be non-negative"):
        plan_transfer(layout, {"direction": "h2d", "src_ids": np.array([0, -1]), "dst_ids": np.array([0, 1]),
                               "group_sizes": [1, 1]})
    with pytest.raises(MappingError, match=r"group_sizes = \[2\]: the layout has 2 KV-cache groups"):
        plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0], dst_ids=[0, 1], group_sizes=[2]))
    with pytest.raises(MappingError, match=r"dst_ids = 'length 1': src_ids has 2 ids"):
        plan_transfer(layout.model_copy(update={"num_groups": None}), {"direction": "h2d", "src_ids": np.array([0, 1]),
                                                                       "dst_ids": np.array([0])})


def test_new_fields_are_in_the_schema_and_round_trip_through_case_files(tmp_path):
    jsonschema = pytest.importorskip("jsonschema")
    schema = Case.json_schema()
    defs = schema["$defs"]
    assert "num_groups" in defs["Layout"]["properties"]
    assert {"num_writers", "writer_index"} <= set(defs["Region"]["properties"])
    case = Case(layout=mixed_layout(1).model_copy(update={"num_groups": 1}), mapping=STORE_0_3)
    path = case.save(tmp_path / "c.json")
    jsonschema.validate(json.loads(path.read_text()), schema)
    loaded = Case.load(path)
    assert loaded.layout == case.layout and loaded.plan() == case.plan()


# ---- property test against the oracle ---------------------------------------------------------------------
@st.composite
def model_cases(draw):
    """Replicated and private regions over 1-3 groups (some empty), k per side, skips, fragments, aliased pairs."""
    ngroups = draw(st.integers(1, 3))
    empty = {g for g in range(1, ngroups) if draw(st.integers(0, 3)) == 0}  # group 0 always has regions
    same_k = bool(empty)  # an empty group counts its ids with the chunk size all regions share
    kd, kh = draw(st.sampled_from([1, 1, 2])), draw(st.sampled_from([1, 2, 3]))
    k_dev = [kd if same_k else draw(st.sampled_from([1, 1, 2])) for _ in range(ngroups)]
    k_host = [kh if same_k else draw(st.sampled_from([1, 2, 3, 4])) for _ in range(ngroups)]
    regions, buffers = [], [Buffer(name="g", nbytes=1 << 14), Buffer(name="h", nbytes=1 << 14, location="host")]
    off_d = off_h = 0
    for g in range(ngroups):
        for j in range(0 if g in empty else draw(st.integers(1, 3))):
            page = draw(st.sampled_from([4, 8, 12]))
            frags, host_page = draw(fragment_tables(page))
            stride_h = k_host[g] * host_page + draw(st.sampled_from([0, 0, 4]))
            writers = draw(st.sampled_from([None, None, 1, 2, 3]))
            index = draw(st.one_of(st.none(), st.integers(0, writers - 1))) if writers else None
            reg = Region(name=f"g{g}r{j}", page_bytes=page, group=g, fragments=frags, host_page_bytes=host_page if frags else None,
                         device=Placement(buffer="g", byte_offset=off_d, blocks_per_chunk=k_dev[g]),
                         host=Placement(buffer="h", byte_offset=off_h, blocks_per_chunk=k_host[g], stride_bytes=stride_h),
                         num_writers=writers, writer_index=index)
            regions.append(reg)
            if draw(st.integers(0, 3)) == 0:
                regions.append(reg.model_copy(update={"name": f"g{g}r{j}.alias"}))
            off_d += 16 * 4 * page
            off_h += 16 * stride_h
    regions = draw(st.permutations(regions))
    layout = Layout(buffers=buffers, regions=regions, num_groups=ngroups)
    m = draw(group_mappings(k_dev, k_host))
    writers = draw(st.sampled_from([1, 1, 2, 3]))
    options = PlanOptions(num_writers=writers, writer_index=draw(st.integers(0, writers - 1)),
                          coalesce=draw(st.sampled_from([True, True, False])),
                          regions_per_call=draw(st.sampled_from([None, None, 1, 2])),
                          max_descriptors=draw(st.sampled_from([None, 3])))
    return layout, m, options


@given(model_cases())
def test_layout_model_equals_per_piece_copies_with_fewest_ranges(case):
    layout, mapping, options = case
    for r in layout.regions:  # a region's own index must fit its own or the plan's writer count
        nw = r.num_writers or options.num_writers
        wi = 0 if nw == 1 else options.writer_index if r.writer_index is None else r.writer_index
        if mapping.direction.value == "d2h" and wi >= nw:
            with pytest.raises(LayoutError, match=r"writer_index"):
                plan_transfer(layout, mapping, options=options)
            return
    plan, copies = run_against_oracle(layout, mapping, options)
    if options.coalesce and options.regions_per_call is None:
        assert plan.num_ranges == min_ranges(copies)
    aliases = {a for a, _ in plan.aliases}
    once = layout.model_copy(update={"regions": tuple(r for r in layout.regions if r.name not in aliases)})
    assert plan.requested_copies == len(expected_copies(once, mapping, options))  # aliases' copies are made once


# ---- refusals of chunked layouts ---------------------------------------------------------------------------
def chunk_layout(k: int = 2) -> Layout:
    return Layout(buffers=(Buffer(name="g", nbytes=8 * 64), Buffer(name="h", nbytes=8 * 64, location=Location.HOST)),
                  regions=(Region(name="r", page_bytes=8, device=Placement(buffer="g"),
                                  host=Placement(buffer="h", blocks_per_chunk=k)),))


def test_a_repeated_destination_chunk_of_a_chunked_layout_is_refused():
    m = BlockMapping(direction="d2h", src_ids=[0, 1, 2, 3], dst_ids=[5, 5], group_sizes=[4])
    with pytest.raises(MappingError, match=r"dst_ids\[1\] = 5: destination block is written twice \(also dst_ids\[0\]\)"):
        plan_transfer(chunk_layout(), m)
    with pytest.raises(MappingError, match=r"written twice"):
        plan_transfer(chunk_layout(), m, options=PlanOptions(regions_per_call=1, coalesce=False))


def test_destinations_over_their_own_sources_are_refused():
    layout = Layout(buffers=(Buffer(name="m", nbytes=8 * 64, location=Location.HOST),),
                    regions=(Region(name="r", page_bytes=8, device=Placement(buffer="m"),
                                    host=Placement(buffer="m", byte_offset=8 * 32, blocks_per_chunk=2)),))
    ok = BlockMapping(direction="d2h", src_ids=[0, 1], dst_ids=[1], group_sizes=[2])
    plan, _ = run_against_oracle(layout, ok)  # one buffer, disjoint halves: fine
    assert plan.num_ranges == 1
    bad = BlockMapping(direction="h2d", src_ids=[0], dst_ids=[32, 33], group_sizes=[2])  # device pages 32-33 = host chunk 0
    with pytest.raises(LayoutError, match=r"overlap source bytes of the same transfer"):
        plan_transfer(layout, bad)
