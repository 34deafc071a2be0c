"""plan_transfer: layout + block mapping -> TransferPlan, with maximal merging of byte-contiguous copies.

Plain transfers (one group, whole pages, k == 1, no writer rotation, no per-layer calls) take the fast path
(``plain_path``). So do paged ones (the same with chunks of k pages laid out without padding), once each
side's chunk ids are expanded to page ids; everything else, and every refusal, goes through the general path
(``general_path``). Both build on the column operations
in ``columns``, and give identical plans wherever both apply (a differential test checks it through
``plan_transfer_general``). Aliased regions (the same bytes under two names) are planned once.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from .alignment import check_alignment
from .columns import attributes
from .errors import LayoutError, MappingError
from .general_path import group_pages, plan_general
from .layout import Layout
from .layout_info import LayoutInfo
from .plain_path import plan_plain
from .plan import TransferPlan
from .runs import Column, Ranges, Runs
from .spec import BlockMapping, BorrowedMapping, Direction
from .target import PlanOptions, Target


def plan_transfer(layout: Layout | dict[str, Any] | Any, mapping: BlockMapping | dict[str, Any] | Any,
                  target: Target | dict[str, Any] | None = None,
                  options: PlanOptions | dict[str, Any] | None = None) -> TransferPlan:
    """Plan the copies of ``mapping`` over every region of ``layout``.

    Returns a TransferPlan whose ranges cover exactly the requested bytes with the fewest ranges possible
    (or one range per block copy when ``options.coalesce`` is off), split into calls of at most the
    descriptor cap. Raises LayoutError / MappingError / TargetError (ValueError subclasses) on bad input.

    ``mapping`` is a BlockMapping, a dict of its fields, or a JSON path. A dict whose ids are integer numpy
    arrays is the per-job hot path: no BlockMapping is built and the ids are not copied (the plan keeps
    none); the same checks apply, vectorized. Those arrays must not change until this call returns.
    """
    return _plan(layout, mapping, target, options, general=False)


def plan_transfer_general(layout: Layout | dict[str, Any] | Any, mapping: BlockMapping | dict[str, Any] | Any,
                          target: Target | dict[str, Any] | None = None,
                          options: PlanOptions | dict[str, Any] | None = None) -> TransferPlan:
    """``plan_transfer`` forced through the general path, even where the fast path applies. For differential
    tests and diagnosis: its plans must equal ``plan_transfer``'s."""
    return _plan(layout, mapping, target, options, general=True)


_DEFAULT_TARGET, _DEFAULT_OPTIONS = Target(), PlanOptions()  # frozen values: built once, not per plan


def _plan(layout_in: Any, mapping_in: Any, target_in: Any, options_in: Any, general: bool) -> TransferPlan:
    layout = Layout.coerce(layout_in, "layout")
    mapping: BlockMapping | BorrowedMapping | None = BorrowedMapping.of(mapping_in)  # numpy ids: not copied
    if mapping is None:
        mapping = BlockMapping.coerce(mapping_in, "mapping")
    try:
        target = _DEFAULT_TARGET if target_in is None else Target.coerce(target_in, "target")
        options = _DEFAULT_OPTIONS if options_in is None else PlanOptions.coerce(options_in, "options")
    except ValueError:
        if isinstance(mapping, BorrowedMapping):  # name a bad id first, as a BlockMapping would (rare path)
            mapping.check_values()
        raise
    full = layout.info
    info = full.without_aliases() if full.aliases else full
    direction = mapping.direction
    cap = options.descriptor_cap(target)
    made: tuple[Ranges, int, np.ndarray] | None = None
    if not general and _plain(info, mapping, options):
        made = plan_plain(info, mapping, options, cap)
    else:
        if isinstance(mapping, BorrowedMapping):
            mapping.check_values()
        if not general and _paged(info, mapping, options):
            try:
                made = _plan_pages(info, mapping, options, cap)
            except (MappingError, LayoutError):  # refusals are named by the general path, as always
                made = None
        if made is None:
            made = plan_general(info, mapping, options, cap)
    ranges, requested, call_offsets = made
    ranges = dict(ranges)
    if info is not full:  # region indices of the alias-free view -> the layout's own
        ranges["region"] = _map(ranges["region"], info.origin)
    attrs, region_attr = attributes(full, direction, target, options)
    api, passes = full.cached(("api", target.platform, target.runtime_version),
                              lambda: (target.copy_api, target.passes_attrs))
    reg = ranges["region"]
    ranges["attr"] = Runs.of(region_attr[reg.values], reg.lengths, len(reg)) if isinstance(reg, Runs) else region_attr[reg]
    plan = TransferPlan.planned(
        direction=direction, target=target, options=options, buffers=layout.buffers, regions=full.names, attrs=attrs,
        region_page_bytes=full.page_bytes, aliases=full.aliases, region_writers=_region_writers(full, direction, options),
        requested_copies=requested, call_offsets=call_offsets, columns=ranges, api=api, passes_attrs=passes)
    return check_alignment(plan, full.align_bytes) if full.aligned else plan


def _plain(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, options: PlanOptions) -> bool:
    """Whether the fast path applies: plain layout and mapping, no per-layer calls, no writer rotation."""
    if not (info.plain and mapping.plain and options.regions_per_call is None):
        return False
    return mapping.direction is Direction.H2D or _one_writer(info, options)


def _one_writer(info: LayoutInfo, options: PlanOptions) -> bool:
    """Whether every region has one writer (no rotation) under ``options``; made once per layout and setting."""
    key = ("one_writer", options.num_writers, options.writer_index)
    return info.cached(key, lambda: not bool(np.any(info.writers(options.num_writers, options.writer_index)[0] > 1)))


def _paged(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, options: PlanOptions) -> bool:
    """Whether chunk ids can become page ids for the fast path: a paged layout (whole pages, offsets linear in
    the page id on both sides), one group, no per-layer calls, no writer rotation."""
    if not (info.paged and options.regions_per_call is None and len(mapping.group_sizes or (0,)) == 1):
        return False
    return mapping.direction is Direction.H2D or _one_writer(info, options)


def _plan_pages(info: LayoutInfo, mapping: BlockMapping | BorrowedMapping, options: PlanOptions,
                cap: int | None) -> tuple[Ranges, int, np.ndarray]:
    """The fast path over page ids: each side's chunk ids expanded to the group's page ids (checked to fit, as
    the general path checks them), then planned as a plain transfer of pages. Raises MappingError or
    LayoutError on anything wrong; the caller then lets the general path name it."""
    direction = mapping.direction
    s_ids, d_ids = mapping.src_ids, mapping.dst_ids
    count = mapping.group_sizes[0] if mapping.group_sizes else len(s_ids)
    start = mapping.group_starts[0] if mapping.group_starts else 0
    regs = info.group_regions(0)
    sp, _, used_s = group_pages(info, regs, s_ids, 0, count, start, direction.src_side, "src_ids", 0, False)
    dp, _, used_d = group_pages(info, regs, d_ids, 0, count, start, direction.dst_side, "dst_ids", 0, False)
    if used_s != len(s_ids) or used_d != len(d_ids):
        raise MappingError("group_sizes", count, "the group does not consume the id lists exactly")
    return plan_plain(info, BorrowedMapping(direction, sp, dp, None, None), options, cap)


def _region_writers(info: LayoutInfo, direction: Direction, options: PlanOptions) -> tuple[tuple[int, int], ...]:
    """Each region's (writers, index) on a store where some region sets its own; () when the options say it all."""
    if direction is Direction.H2D or not info.sets_writers:
        return ()
    nw, wi = info.writers(options.num_writers, options.writer_index)
    return tuple(zip(nw.tolist(), wi.tolist()))


def _map(col: Column, table: np.ndarray) -> Column:
    return Runs(table[col.values], col.lengths) if isinstance(col, Runs) else table[col]
