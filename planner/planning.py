"""plan_transfer: layout + block mapping -> TransferPlan, with maximal merging of byte-contiguous copies.

One route: the checking front end (``checks``) turns the mapping, whatever its form, into checked page ids
per group and side, or refuses it; the builder (``build``) turns those pages into ranges and calls, in the
strategy the layout's cache holds for the plan's setting (``layout_cache.Strategy``); the plan value takes the
columns. Aliased regions (the same bytes under two names) are planned once.
"""
from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from .alignment import check_alignment
from .build import build
from .checks import Ids, check, read_settings, refuse_overlaps
from .frozen import freeze
from .layout import Layout
from .layout_cache import Prepared
from .plan import COLUMNS, TransferPlan
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
    layout = layout if type(layout) is Layout else Layout.coerce(layout, "layout")
    ids = Ids.of(mapping)
    target, options = read_settings(ids, target, options)
    cache = layout.info
    direction = ids.direction
    prepared = cache.prepared(direction, target, options)
    request = check(cache, ids, prepared.strategy, options.coalesce)
    ranges, call_offsets = build(cache, request, prepared.strategy, options, prepared.cap)
    if request.touch:
        refuse_overlaps(cache, request, ranges, prepared.strategy.call_group)
    columns = _columns(ranges, cache.unique.origin if cache.unique is not cache else None, prepared)
    plan = TransferPlan.planned(
        direction=direction, target=target, options=options, buffers=layout.buffers, regions=cache.names,
        attrs=prepared.attrs, region_page_bytes=cache.page_bytes, aliases=cache.aliases,
        region_writers=prepared.region_writers, requested_copies=request.requested, call_offsets=call_offsets,
        columns=columns, api=prepared.api, passes_attrs=prepared.passes_attrs)
    return check_alignment(plan, cache.align_bytes) if cache.aligned else plan


def _columns(ranges: Mapping[str, Column], origin: np.ndarray | None, prepared: Prepared) -> dict[str, Column]:
    """The plan's columns from the builder's ranges: region indices of the alias-free view mapped to the
    layout's own (``origin``; None: no aliases) and the attribute column added, run-length columns frozen in the
    plan's dtype as the builder's are (the plan freezes its dense ones)."""
    columns = dict(ranges) if not isinstance(ranges, dict) else ranges  # the builder's own dict, made for this plan
    if origin is not None:
        columns["region"] = _map(columns["region"], origin)
    reg = columns["region"]
    if not isinstance(reg, Runs):
        columns["attr"] = prepared.region_attr[reg]
        return columns
    rows = prepared.strategy.rows
    attr = prepared.rows_attr if rows is not None and reg.values is rows.regs else freeze(prepared.region_attr[reg.values])
    columns["attr"] = Runs.of(attr, reg.lengths, len(reg))  # type: ignore[arg-type]  # rows_attr is set with rows
    nb = columns["nbytes"]
    if isinstance(nb, Runs):  # the builder's int64 sizes, as the plan's uint64: a view of frozen memory is frozen
        columns["nbytes"] = Runs.of(nb.values.view(COLUMNS["nbytes"]), nb.lengths, len(nb))
    return columns


def _map(col: Column, table: np.ndarray) -> Column:
    return Runs.of(freeze(table[col.values].astype(np.int32)), col.lengths, len(col)) if isinstance(col, Runs) else table[col]
