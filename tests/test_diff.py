"""diff_plans and equivalence: summaries of known pairs, -/+ rows, elision, and the byte-level oracle."""
from __future__ import annotations

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    COLUMNS,
    BlockMapping,
    PlanError,
    PlanOptions,
    Target,
    TransferPlan,
    hip_version,
    plan_transfer,
    presets,
)
from kvxfer.planner.diff import diff_plans, equivalent, normalize
from kvxfer.testing import random_buffers


def rocm(major, minor, patch=0):
    return Target(platform="rocm", runtime_version=hip_version(major, minor, patch))


LAYOUT = presets.kv_layout(4, 64, 4096)
RUNS8 = presets.mapping("runs8", 16, 64)


def test_identical_plans_give_an_empty_diff():
    a, b = plan_transfer(LAYOUT, RUNS8, rocm(7, 16)), plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    d = diff_plans(a, b)
    assert not d and d.identical and d.equivalent
    assert str(d) == "" and d.summary == "" and d.changed_ranges == 0
    assert "identical" in d.to_html()


def table(text: str) -> list[str]:
    """The -/+ table of a diff's text: from its header row on."""
    lines = text.splitlines()
    return lines[next(i for i, line in enumerate(lines) if line.split()[:1] == ["call"]):]


def test_rocm_7_2_vs_7_16_changes_only_the_attributes():
    a, b = plan_transfer(LAYOUT, RUNS8, rocm(7, 2)), plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    d = diff_plans(a, b)
    assert d and d.equivalent and d.changed_ranges == 0
    assert d.summary == ("target rocm-7.2 -> rocm-7.16, ranges 8 -> 8, calls 1 -> 1, bytes equal, "
                         "attrs: flags 0x0 -> 0x100, passed no -> yes, same bytes moved")
    # the text wraps the summary at 80 columns, after a comma
    assert str(d).splitlines() == [f"--- {a!r}", f"+++ {b!r}",
                                   "target rocm-7.2 -> rocm-7.16, ranges 8 -> 8, calls 1 -> 1, bytes equal,",
                                   "  attrs: flags 0x0 -> 0x100, passed no -> yes, same bytes moved"]


def test_merged_vs_unmerged_move_the_same_bytes():
    a = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    b = plan_transfer(LAYOUT, RUNS8, rocm(7, 16), PlanOptions(coalesce=False, max_descriptors=16))
    d = diff_plans(a, b)
    assert d.equivalent and equivalent(a, b) and equivalent(b, a)
    assert d.summary == ("ranges 8 -> 64 (+56), calls 1 -> 4, bytes equal, "
                         "options: coalesce True -> False, max_descriptors None -> 16, same bytes moved")
    # no range of one is a range of the other: 8 merged ranges out, 64 single blocks in
    assert len(d.only_a) == 8 and len(d.only_b) == 64
    rows = table(d.text(max_rows=None))
    assert rows[0].split()[0] == "call" and len(rows) == 1 + 72
    first = rows[1:10]
    assert first[0].startswith("-") and all(r.startswith("+") for r in first[1:])
    assert first[0].split()[5] == str(8 * 4096) and {r.split()[5] for r in first[1:]} == {"4096"}


def test_diff_rows_are_elided_with_a_count():
    a = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    b = plan_transfer(LAYOUT, RUNS8, rocm(7, 16), PlanOptions(coalesce=False))
    lines = table(diff_plans(a, b).text(max_rows=10))
    assert len(lines) == 1 + 10 + 1
    assert lines[1 + 5] == "... 62 changed ranges not shown (text(max_rows=None) shows all) ..."
    where = table(diff_plans(a, b).text(max_rows=10, hint="--full shows all"))[1 + 5]
    assert where == "... 62 changed ranges not shown (--full shows all) ..."  # each caller names what works there
    with pytest.raises(PlanError, match="max_rows"):
        diff_plans(a, b).text(max_rows=0)


def test_different_mappings_move_different_bytes():
    a = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    other = BlockMapping(direction="h2d", src_ids=RUNS8.src_ids, dst_ids=RUNS8.dst_ids[::-1].copy())
    b = plan_transfer(LAYOUT, other, rocm(7, 16))
    d = diff_plans(a, b)
    assert not d.equivalent and d.summary.endswith("bytes equal, different bytes moved")
    assert d.summary.startswith("ranges 8 -> 64 (+56)")


def test_a_load_against_a_store_pairs_rows_region_by_region():
    """Opposite directions share no destination: each changed range of a region sits beside its counterpart
    instead of every '+' row coming before every '-' row."""
    load = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    store = plan_transfer(LAYOUT, BlockMapping(direction="d2h", src_ids=RUNS8.dst_ids, dst_ids=RUNS8.src_ids),
                          rocm(7, 16))
    rows = table(diff_plans(load, store).text(max_rows=None))[1:]
    assert [r[0] for r in rows] == ["-", "+"] * load.num_ranges
    for removed, added in zip(rows[::2], rows[1::2]):
        r, a = removed.split(), added.split()
        assert r[-1] == a[-1] and (r[3], r[4]) == (a[4], a[3])  # one region; a store is the load reversed


def test_diff_html_marks_removed_and_added_rows():
    from html.parser import HTMLParser

    a = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    b = plan_transfer(LAYOUT, RUNS8, rocm(7, 16), PlanOptions(coalesce=False))
    classes: list[str] = []

    class P(HTMLParser):
        def handle_starttag(self, tag, attrs):
            if tag == "tr":
                classes.append(dict(attrs).get("class", ""))
            assert tag != "script"

    P().feed(diff_plans(a, b).to_html(max_rows=None))
    assert classes.count("removed") == 8 and classes.count("added") == 64


def test_summary_names_target_direction_and_totals():
    a = plan_transfer(LAYOUT, presets.mapping("runs8", 16, 64, "d2h"), Target(platform="cuda", runtime_version=13000))
    b = plan_transfer(LAYOUT, presets.mapping("runs8", 8, 64, "h2d"), Target(platform="cuda", runtime_version=12080))
    s = diff_plans(a, b).summary
    assert s.startswith("target cuda-13.0 -> cuda-12.8, direction d2h -> h2d, "
                        "api cuMemcpyBatchAsync_v2 -> cuMemcpyBatchAsync, ranges 8 -> 4 (-4)")
    assert "bytes 262144 -> 131072 (-131072), copies 64 -> 32" in s
    assert "attrs: order stream -> any, src dev0 -> host, dst host -> dev0" in s


def _reordered(plan: TransferPlan, order: np.ndarray, buffers_reversed: bool) -> TransferPlan:
    """The same ranges in another order, one call each 3, optionally with the buffer table reversed."""
    cols = {k: getattr(plan, k)[order] for k in COLUMNS}
    buffers = plan.buffers
    if buffers_reversed:
        n = len(buffers)
        buffers = buffers[::-1]
        cols["src_buf"], cols["dst_buf"] = n - 1 - cols["src_buf"], n - 1 - cols["dst_buf"]
    calls = np.append(np.arange(0, plan.num_ranges, 3), plan.num_ranges)
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=calls, columns=cols)


def test_equivalence_ignores_order_calls_splits_and_buffer_table_order():
    base = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    split = plan_transfer(LAYOUT, RUNS8, rocm(7, 16), PlanOptions(max_range_bytes=12 * 1024))
    shuffled = _reordered(split, np.random.default_rng(1).permutation(split.num_ranges), True)
    assert equivalent(base, split) and equivalent(base, shuffled)
    d = diff_plans(base, shuffled)
    assert d.equivalent and d.summary.endswith("buffers changed, same bytes moved")
    names, norm = normalize(shuffled)
    assert names == tuple(sorted(b.name for b in base.buffers))
    assert len(norm["nbytes"]) == base.num_ranges and int(norm["nbytes"].sum()) == base.total_bytes


def test_one_byte_shift_is_not_equivalent():
    base = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    cols = {k: getattr(base, k) for k in COLUMNS}
    cols["src_offset"] = cols["src_offset"].copy()
    cols["src_offset"][3] += 1
    shifted = TransferPlan(direction=base.direction, target=base.target, options=base.options, buffers=base.buffers,
                           regions=base.regions, attrs=base.attrs, requested_copies=base.requested_copies,
                           call_offsets=base.call_offsets, columns=cols)
    d = diff_plans(base, shifted)
    assert not d.equivalent and len(d.only_a) == 1 and len(d.only_b) == 1 and d.only_a[0] == d.only_b[0] == 3


def test_overlapping_destinations_have_no_normal_form():
    base = plan_transfer(LAYOUT, RUNS8, rocm(7, 16))
    cols = {k: getattr(base, k) for k in COLUMNS}
    cols["dst_offset"] = cols["dst_offset"].copy()
    cols["dst_offset"][1] = cols["dst_offset"][0] + 4096
    cols["dst_buf"] = cols["dst_buf"].copy()
    cols["dst_buf"][1] = cols["dst_buf"][0]
    bad = TransferPlan(direction=base.direction, target=base.target, options=base.options, buffers=base.buffers,
                       regions=base.regions, attrs=base.attrs, requested_copies=base.requested_copies,
                       call_offsets=base.call_offsets, columns=cols)
    with pytest.raises(PlanError, match=r"range 1 writes bytes that range 0 also writes"):
        equivalent(base, bad)


def _run(plan: TransferPlan, seed: int = 7) -> dict[str, np.ndarray]:
    bufs = random_buffers(plan, seed)
    NumpyExecutor().run(plan, bufs)
    return bufs


@pytest.mark.parametrize("pattern", presets.PATTERNS)
def test_equivalence_agrees_with_the_reference_executor(pattern):
    """Equivalent plans leave every byte the same when run; a changed mapping does not."""
    mapping = presets.mapping(pattern, 12, 64, seed=3)
    merged = plan_transfer(LAYOUT, mapping, rocm(7, 16))
    single = plan_transfer(LAYOUT, mapping, rocm(7, 16), PlanOptions(coalesce=False, max_descriptors=5))
    assert equivalent(merged, single)
    x, y = _run(merged), _run(single)
    assert all(np.array_equal(x[k], y[k]) for k in x)
    other = BlockMapping(direction="h2d", src_ids=mapping.src_ids, dst_ids=np.roll(mapping.dst_ids, 1))
    changed = plan_transfer(LAYOUT, other, rocm(7, 16))
    assert not equivalent(merged, changed)
    z = _run(changed)
    assert not all(np.array_equal(x[k], z[k]) for k in x)


def test_large_plans_compare_quickly_enough_to_be_usable():
    """30,208 single-block ranges against 3,776 merged ones: the vectorized path, not a byte loop."""
    layout = presets.kv_layout(118, 512)
    m = presets.mapping("runs8", 256, 512)
    a, b = plan_transfer(layout, m, rocm(7, 16)), plan_transfer(layout, m, rocm(7, 16), PlanOptions(coalesce=False))
    d = diff_plans(a, b)
    assert d.equivalent and len(d.only_a) == 3776 and len(d.only_b) == 30208


def test_diff_rejects_non_plans():
    with pytest.raises(PlanError, match="expected a TransferPlan"):
        diff_plans(plan_transfer(LAYOUT, RUNS8), "plan.json")
