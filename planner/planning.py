"""plan_transfer: layout + block mapping -> TransferPlan, with maximal merging of byte-contiguous copies.

One route: the checking front end (``checks``) turns the mapping, whatever its form, into checked page ids
per group and side, or refuses it; the builder (``build``) turns those pages into ranges and calls, in the
strategy the layout's cache holds for the plan's setting (``layout_cache.Strategy``); the plan value takes the
columns. Aliased regions (the same bytes under two names) are planned once.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .alignment import check_alignment
from .build import build
from .checks import Ids, check, read_settings
from .layout import Layout
from .plan import TransferPlan
from .runs import Column, Runs
from .spec import BlockMapping
from .target import PlanOptions, Target


def plan_transfer(layout: Layout | dict[str, Any] | str | Path, mapping: BlockMapping | dict[str, Any] | str | Path,
                  target: Target | dict[str, Any] | str | Path | None = None,
                  options: PlanOptions | dict[str, Any] | str | Path | None = None) -> TransferPlan:
    """Plan the copies of ``mapping`` over every region of ``layout``.

    Returns a TransferPlan whose ranges cover exactly the requested bytes with the fewest ranges possible
    (or one range per block copy when ``options.coalesce`` is off), split into calls of at most the
    descriptor cap. A layout without regions plans any well-formed mapping to an empty plan. Raises
    LayoutError / MappingError / TargetError (ValueError subclasses) on bad input, one refusal in one wording
    whatever the mapping's form (see ``kvxfer.planner.checks`` for their order).

    ``layout``, ``target`` and ``options`` are models, dicts or JSON paths; ``mapping`` is a BlockMapping, a
    dict of its fields, or a JSON path. A dict whose ids are integer numpy arrays is the per-job hot path: no
    BlockMapping is built and the ids are not copied (the plan keeps none); the same checks apply,
    vectorized. Those arrays must not change until this call returns.
    """
    layout = Layout.coerce(layout, "layout")
    ids = Ids.of(mapping)
    target, options = read_settings(ids, target, options)
    cache = layout.info
    direction = ids.direction
    prepared = cache.prepared(direction, target, options)
    request = check(cache, ids, prepared.strategy, options.coalesce)
    ranges, call_offsets = build(cache, request, prepared.strategy, options, prepared.cap)
    columns = dict(ranges)
    if cache.unique is not cache:  # region indices of the alias-free view -> the layout's own
        columns["region"] = _map(columns["region"], cache.unique.origin)
    reg = columns["region"]
    region_attr = prepared.region_attr
    columns["attr"] = Runs.of(region_attr[reg.values], reg.lengths, len(reg)) if isinstance(reg, Runs) else region_attr[reg]
    plan = TransferPlan.planned(
        direction=direction, target=target, options=options, buffers=layout.buffers, regions=cache.names,
        attrs=prepared.attrs, region_page_bytes=cache.page_bytes, aliases=cache.aliases,
        region_writers=prepared.region_writers, requested_copies=request.requested, call_offsets=call_offsets,
        columns=columns, api=prepared.api, passes_attrs=prepared.passes_attrs)
    return check_alignment(plan, cache.align_bytes) if cache.aligned else plan


def _map(col: Column, table: np.ndarray) -> Column:
    return Runs(table[col.values], col.lengths) if isinstance(col, Runs) else table[col]
