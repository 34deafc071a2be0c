"""Differential property: every plain case gives the identical plan through the fast path and the general path.

``plan_transfer`` sends plain cases (one group, whole pages, k == 1, no writer rotation, no per-layer calls)
down the fast path; ``plan_transfer_general`` forces the general path. Both must produce the same fingerprint
(header, every column, call offsets), or refuse the same input with the same error.
"""
from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from kvxfer.planner import BlockMapping, PlanError, PlanOptions, Target, hip_version, plan_transfer
from kvxfer.planner.planning import plan_transfer_general

from .test_planner_props import cases, layouts

OPTIONS = [PlanOptions(), PlanOptions(coalesce=False), PlanOptions(max_descriptors=3), PlanOptions(max_range_bytes=5),
           PlanOptions(prefer_overlap_with_compute=True), PlanOptions(num_writers=2, writer_index=1)]
TARGETS = [Target(), Target(platform="rocm", runtime_version=hip_version(7, 16)), Target(platform="cuda", runtime_version=13000)]


def _outcome(plan_fn, *args):  # a plan's fingerprint, or the error's type and message
    try:
        return plan_fn(*args).fingerprint
    except PlanError as e:
        return type(e).__name__, str(e)


@given(cases(), st.sampled_from(OPTIONS), st.sampled_from(TARGETS))
def test_fast_and_general_paths_give_identical_plans(case, options, target):
    layout, mapping = case
    if options.num_writers > 1 and mapping.direction.value == "d2h":
        options = PlanOptions()  # writer rotation on stores always takes the general path
    fast = _outcome(plan_transfer, layout, mapping, target, options)
    general = _outcome(plan_transfer_general, layout, mapping, target, options)
    if isinstance(fast, str) and isinstance(general, str):
        assert fast == general
    else:  # both refuse, with the same error class (the general path may word a repeated page differently)
        assert not isinstance(fast, str) and not isinstance(general, str), (fast, general)
        assert fast[0] == general[0]


@given(layouts(), st.data())
def test_paths_agree_on_repeated_and_out_of_range_ids(drawn, data):
    layout, nb_dev, nb_host = drawn
    n = data.draw(st.integers(1, 6))
    src = data.draw(st.lists(st.integers(0, nb_host + 2), min_size=n, max_size=n))
    dst = data.draw(st.lists(st.integers(0, nb_dev + 2), min_size=n, max_size=n))
    mapping = BlockMapping(direction="h2d", src_ids=np.array(src), dst_ids=np.array(dst))
    fast = _outcome(plan_transfer, layout, mapping)
    general = _outcome(plan_transfer_general, layout, mapping)
    assert isinstance(fast, str) == isinstance(general, str), (fast, general)
    if isinstance(fast, str):
        assert fast == general
    elif fast[0] != general[0]:  # an input with several write conflicts: each path may name a different one first
        assert all("written twice" in m or "also writes" in m for _, m in (fast, general)), (fast, general)


def test_the_fast_path_is_taken_for_plain_cases():
    """The differential test compares two different code paths: plain cases really take the fast one."""
    import kvxfer.planner.planning as planning

    calls = []
    original = planning.plan_plain

    def spy(*args):
        calls.append(1)
        return original(*args)

    from kvxfer.planner import presets
    layout = presets.kv_layout(4, 16, 64)
    planning.plan_plain = spy
    try:
        plan_transfer(layout, presets.mapping("runs8", 8, 16))
        plan_transfer_general(layout, presets.mapping("runs8", 8, 16))
    finally:
        planning.plan_plain = original
    assert calls == [1]
