"""A picture of a plan, the transfer map (needs matplotlib, the ``viz`` extra; imported only when drawing).

Three panels, each legible from 1 region to hundreds:

- **ranges per region** (left): one row per region; its copies (blocks) laid end to end in plan order, each
  range one segment as long as the blocks it covers, neighbouring ranges in alternating shades. A merged run
  is one long segment, a fragmented transfer a row of thin stripes. Colour is the driver call; a black tick
  marks where a call starts inside a row.
- **range sizes** (top right): how many ranges cover how many blocks.
- **one region** (bottom right): source block id against destination block id for the region with the most
  ranges, each range a band along the diagonal, so descending and interleaved runs show their shape (block
  ids need the layout; without it the axes are byte offsets over the page, and say so).

With the layout, a range over several regions' pages (K and V of a block side by side) counts in each of their
rows, by its bytes there (``credit.region_credit``).

``range_strips`` and ``region_segments`` are the numbers the panels draw (pure numpy, no matplotlib).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .credit import Credit, block_position, page_bytes, region_credit
from .layout import Layout
from .optional import import_optional
from .plan import TransferPlan, format_bytes
from .render import plural

STRIP_COLUMNS = 1200  # raster width of the ranges-per-region panel
CALL_COLOURS = 10  # tab10; more calls cycle the colours
LABELLED_RANGES = 48  # up to this many ranges, each segment wide enough says its size in blocks
FEW_REGIONS = 6  # up to this many regions the strips run across the top of the figure
LISTED_SIZES = 12  # distinct range sizes drawn as one bar each; more: a histogram over log-spaced bins


def require_matplotlib() -> Any:
    """The matplotlib module; raises MissingDependencyError (an ImportError) with the install line when the
    ``viz`` extra is missing (callers that write other files first check here, so nothing is written half-way)."""
    return import_optional("matplotlib", "the transfer map")


def range_strips(plan: TransferPlan, layout: Layout | None = None, credit: Credit | None = None,
                 ) -> dict[str, np.ndarray]:
    """The ranges-per-region panel as columns, one entry per (range, region) with bytes, ranges in plan order:
    ``range`` (its range), ``row`` (its region), ``start`` and ``blocks`` (its place and length, in blocks of its
    region, the region's entries laid end to end in plan order), ``call`` (the driver call it is in) and
    ``shade`` (0/1, alternating along a row). Without ``layout`` each range is one entry, in its first region's
    row; with it, a range over several regions' pages (K and V of a block side by side) is one entry in each
    of their rows, sized by its bytes there (``credit.region_credit``; pass ``credit`` where the caller has
    it), and blocks use each region's page."""
    credit = region_credit(plan, layout) if credit is None else credit
    n = len(credit.range)
    blocks = credit.nbytes / page_bytes(plan, layout)[credit.region] if n else np.zeros(0)
    row = credit.region
    order = np.lexsort((np.arange(n), row))  # each region's entries, in plan order
    cum = np.cumsum(blocks[order])
    first = np.concatenate(([True], row[order][1:] != row[order][:-1])) if n else np.zeros(0, bool)
    region_base = np.maximum.accumulate(np.where(first, cum - blocks[order], 0.0)) if n else np.zeros(0)
    start = np.empty(n)
    start[order] = cum - blocks[order] - region_base
    rank = np.empty(n, np.int64)
    starts = np.flatnonzero(first)
    rank[order] = np.arange(n) - np.repeat(starts, np.diff(np.append(starts, n)))
    call = np.searchsorted(plan.call_offsets, credit.range, side="right") - 1
    return {"range": credit.range, "row": row, "start": start, "blocks": blocks, "call": call.astype(np.int64),
            "shade": rank % 2}


def _call_colours(plan: TransferPlan) -> np.ndarray:
    """RGBA per call: tab10, cycled."""
    from matplotlib import colormaps

    cmap = colormaps["tab10"]
    return np.array([cmap(c % CALL_COLOURS) for c in range(max(plan.num_calls, 1))])


def _strip_image(plan: TransferPlan, s: dict[str, np.ndarray], total: float, colours: np.ndarray) -> np.ndarray:
    """RGBA raster (regions x STRIP_COLUMNS): each range painted over its columns in its call's colour, lighter
    on odd shades; empty space transparent. A range narrower than a column still paints one."""
    rows = len(plan.regions)
    img = np.zeros((rows, STRIP_COLUMNS, 4))
    if not len(s["range"]) or total <= 0:
        return img
    scale = STRIP_COLUMNS / total
    c0 = np.minimum((s["start"] * scale).astype(np.int64), STRIP_COLUMNS - 1)
    c1 = np.maximum(np.minimum(np.ceil((s["start"] + s["blocks"]) * scale).astype(np.int64), STRIP_COLUMNS), c0 + 1)
    width = c1 - c0
    which = np.repeat(np.arange(len(s["range"])), width)
    col = np.repeat(c0, width) + (np.arange(int(width.sum())) - np.repeat(np.cumsum(width) - width, width))
    rgba = colours[s["call"]].copy()
    rgba[s["shade"] == 1, :3] = 1 - 0.55 * (1 - rgba[s["shade"] == 1, :3])  # lighter: mixed with white
    img[s["row"][which], col] = rgba[which]
    return img


def _region_ticks(ax: Any, names: tuple[str, ...], height_pt: float) -> None:
    """Region names down the y axis: every one while they fit at 7 pt, else every k-th."""
    n = len(names)
    step = max(1, int(np.ceil(9.0 / max(height_pt / max(n, 1), 1e-9))))
    ticks = list(range(0, n, step))
    ax.set_yticks(ticks, [names[i] for i in ticks], fontsize=7)
    ax.tick_params(axis="y", length=2)


def _draw_strips(ax: Any, plan: TransferPlan, layout: Layout | None, credit: Credit, colours: np.ndarray,
                 height_in: float) -> None:
    s = range_strips(plan, layout, credit)
    rows = len(plan.regions)
    per_row = np.bincount(s["row"], weights=s["blocks"], minlength=rows) if len(s["row"]) else np.zeros(rows)
    total = float(per_row.max()) if rows and plan.num_ranges else 1.0
    ax.imshow(_strip_image(plan, s, total, colours), aspect="auto", interpolation="nearest",
              extent=(0, total, rows - 0.5, -0.5))
    ax.set_xlim(0, total)
    ax.set_ylim(rows - 0.5, -0.5)
    starts = np.flatnonzero(np.isin(s["range"], plan.call_offsets[1:-1]))  # calls 1, 2, ... begin: ticks
    if len(starts):
        x = s["start"][starts]
        ax.vlines(x, s["row"][starts] - 0.5, s["row"][starts] + 0.5, colors="black", linewidth=1.2)
    if len(s["range"]) <= LABELLED_RANGES:
        for i in range(len(s["range"])):
            if s["blocks"][i] >= 0.06 * total:  # wide enough for its label
                ax.text(s["start"][i] + s["blocks"][i] / 2, s["row"][i], f"{s['blocks'][i]:g}", ha="center",
                        va="center", fontsize=7, clip_on=True)
    _region_ticks(ax, plan.regions, height_in * 72 * 0.8)
    ax.set_xlabel("blocks copied, in plan order (one segment per range)", fontsize=8)
    ax.set_ylabel(f"region ({len(plan.regions)})", fontsize=8)
    ax.tick_params(axis="x", labelsize=7)
    ax.set_title("ranges per region", fontsize=9, loc="left")


def _draw_sizes(ax: Any, plan: TransferPlan, layout: Layout | None, credit: Credit) -> None:
    from matplotlib.ticker import MaxNLocator

    from .render import run_length_histogram

    hist = run_length_histogram(plan, layout, credit)
    sizes, counts = list(hist), list(hist.values())
    ax.set_title("range sizes", fontsize=9, loc="left")
    ax.set_ylabel("ranges", fontsize=8)
    ax.tick_params(labelsize=7)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    if not sizes:
        ax.text(0.5, 0.5, "no ranges", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        ax.set_xticks([])
        return
    if len(sizes) <= LISTED_SIZES:
        x = np.arange(len(sizes))
        bars = ax.bar(x, counts, color="0.45", width=0.7)
        ax.bar_label(bars, [str(c) for c in counts], fontsize=7, padding=1)
        ax.set_xticks(x, [f"{v:g}" for v in sizes], fontsize=7, rotation=0 if len(sizes) <= 6 else 45)
        ax.set_xlim(-0.6, len(sizes) - 0.4)
    else:
        lo, hi = min(sizes), max(sizes)
        edges = np.geomspace(lo, hi * 1.0001, 16) if hi > lo else np.array([lo * 0.9, hi * 1.1])
        ax.hist(np.repeat(sizes, counts), bins=edges, color="0.45")
        ax.set_xscale("log")
    ax.set_ylim(0, max(counts) * 1.18)  # headroom for the count labels
    ax.set_xlabel("blocks per range", fontsize=8)


def region_segments(plan: TransferPlan, region: int, layout: Layout | None = None, credit: Credit | None = None,
                    ) -> dict[str, np.ndarray]:
    """The one-region panel's numbers: per (range, region) entry of ``region`` (see ``range_strips``), the
    ``range``, and where its bytes start and end on each side (``x0``, ``x1``: source; ``y0``, ``y1``:
    destination). With ``layout`` these are positions in the region's block ids on that side (id + fraction of
    its page; chunk ids where a side holds chunks), so a shared host buffer shows the mapping's ids; without
    it, byte offsets over the region's page (the axis labels say which)."""
    credit = region_credit(plan, layout) if credit is None else credit
    sel = np.flatnonzero(credit.region == region)
    rng = credit.range[sel]
    regs = credit.region[sel]
    src0, dst0 = plan.src_offset[rng].astype(np.int64), plan.dst_offset[rng].astype(np.int64)
    nb = plan.nbytes[rng].astype(np.int64)
    if layout is None:
        unit = page_bytes(plan)[regs]
        return {"range": rng, "x0": src0 / unit, "x1": (src0 + nb) / unit, "y0": dst0 / unit, "y1": (dst0 + nb) / unit}
    src, dst = layout.info.side[plan.direction.src_side], layout.info.side[plan.direction.dst_side]
    return {"range": rng, "x0": block_position(src, regs, src0), "x1": block_position(src, regs, src0 + nb),
            "y0": block_position(dst, regs, dst0), "y1": block_position(dst, regs, dst0 + nb)}


def _draw_region(ax: Any, plan: TransferPlan, layout: Layout | None, credit: Credit, colours: np.ndarray,
                 region: int | None) -> None:
    from matplotlib.collections import LineCollection
    from matplotlib.ticker import MaxNLocator

    if plan.num_ranges:
        per = np.bincount(credit.region, minlength=len(plan.regions))
        r = int(np.argmax(per)) if region is None else region
    else:
        r = 0 if region is None else region
    seg = region_segments(plan, r, layout, credit) if plan.num_ranges else {"range": np.zeros(0, np.int64)}
    sel = seg["range"]
    name = plan.regions[r] if plan.regions else "-"
    ax.set_title(f"region {name}: {plural(len(sel), 'range')}", fontsize=9, loc="left")
    ax.tick_params(labelsize=7)
    if not len(sel):
        ax.text(0.5, 0.5, "no ranges", ha="center", va="center", transform=ax.transAxes, fontsize=8)
        return
    x0, x1, y0, y1 = seg["x0"], seg["x1"], seg["y0"], seg["y1"]
    segments = np.stack([np.stack([x0, y0], 1), np.stack([x1, y1], 1)], 1)
    calls = np.searchsorted(plan.call_offsets, sel, side="right") - 1
    ax.add_collection(LineCollection(list(segments), colors=colours[calls], linewidths=3, capstyle="butt"))
    for lo, hi, lim in ((x0.min(), x1.max(), ax.set_xlim), (y0.min(), y1.max(), ax.set_ylim)):
        pad = max((hi - lo) * 0.04, 0.5)
        lim(lo - pad, hi + pad)  # the axes fit the region's data
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_locator(MaxNLocator(nbins=5, integer=True))
    src = {plan.buffers[b].name for b in plan.src_buf[sel].tolist()}
    dst = {plan.buffers[b].name for b in plan.dst_buf[sel].tolist()}
    page = format_bytes(int(page_bytes(plan, layout)[r]))
    if layout is not None:
        sides = layout.info.side
        ids = ["chunk id" if sides[s].k[r] > 1 else "block id" for s in (plan.direction.src_side, plan.direction.dst_side)]
        ax.set_xlabel(f"source {ids[0]} ({', '.join(sorted(src))}; pages of {page})", fontsize=8)
        ax.set_ylabel(f"destination {ids[1]} ({', '.join(sorted(dst))})", fontsize=8)
    else:  # without the layout the block ids are unknown: offsets in the buffer, in pages
        ax.set_xlabel(f"source page offset ({', '.join(sorted(src))}; offset / {page})", fontsize=8)
        ax.set_ylabel(f"destination page offset ({', '.join(sorted(dst))})", fontsize=8)


def _legend(fig: Any, plan: TransferPlan, colours: np.ndarray) -> None:
    from matplotlib.patches import Patch

    from .render import run_lengths

    sizes = plan.call_sizes.tolist()
    if plan.num_calls <= CALL_COLOURS:
        handles = [Patch(color=colours[c], label=f"call {c}: {plural(n, 'range')}") for c, n in enumerate(sizes)]
        title = "driver calls"
    else:  # colour c stands for calls c, c + 10, ...
        handles = [Patch(color=colours[c], label=f"calls {c}, {c + CALL_COLOURS}, ...") for c in range(CALL_COLOURS)]
        title = f"{plan.num_calls} driver calls of {run_lengths(sizes, 3)} ranges (colours cycle)"
    fig.legend(handles=handles, loc="outside lower center", ncols=min(len(handles), 5) or 1, fontsize=7,
               title=title, title_fontsize=7, frameon=False)


def transfer_map(plan: TransferPlan, *, layout: Layout | None = None, fig: Any = None, title: str | None = None,
                 region: int | None = None) -> Any:
    """Draw the transfer map of ``plan`` (see the module docstring) into ``fig`` (a matplotlib Figure or
    SubFigure; a new Figure when None, no pyplot state) and return it. ``layout`` (the plan's) gives each
    region's page size; ``region`` picks the region of the bottom-right panel (default: the one with the
    most ranges). Raises ImportError without matplotlib, PlanError for a layout with other regions."""
    require_matplotlib()
    from matplotlib.figure import Figure

    rows = max(len(plan.regions), 1)
    colours = _call_colours(plan)
    if rows <= FEW_REGIONS:  # the strips across the top, the two smaller panels under them
        strip_in = 0.5 + 0.35 * rows
        if fig is None:
            fig = Figure(figsize=(11, strip_in + 4.4), layout="constrained")
        grid = fig.add_gridspec(2, 2, height_ratios=(strip_in, 3.4), width_ratios=(1, 1.4))
        strips, sizes, one = grid[0, :], grid[1, 0], grid[1, 1]
    else:  # the strips down the left, one row per region
        strip_in = min(9.0, 0.9 + 0.05 * rows)
        if fig is None:
            fig = Figure(figsize=(11, max(5.2, strip_in + 1.9)), layout="constrained")
        grid = fig.add_gridspec(2, 2, width_ratios=(2.2, 1), height_ratios=(1, 1.3))
        strips, sizes, one = grid[:, 0], grid[0, 1], grid[1, 1]
    credit = region_credit(plan, layout)  # once per map
    _draw_strips(fig.add_subplot(strips), plan, layout, credit, colours, strip_in)
    _draw_sizes(fig.add_subplot(sizes), plan, layout, credit)
    _draw_region(fig.add_subplot(one), plan, layout, credit, colours, region)
    _legend(fig, plan, colours)
    n, req = plan.num_ranges, plan.requested_copies
    merge = f"merge {req / n:.2f}x" if n else "nothing to copy"
    fig.suptitle(title or f"{plan!r}\n{req} copies -> {plural(n, 'range')} ({merge}), {plural(plan.num_calls, 'call')}",
                 fontsize=9)
    return fig


def save_transfer_map(plan: TransferPlan, path: str | Path, *, dpi: int = 110, **kw: Any) -> Path:
    """Draw the transfer map (see ``transfer_map``; ``kw`` goes there) and save it to ``path`` (PNG, SVG or
    PDF by suffix). Raises ImportError without matplotlib."""
    path = Path(path)
    transfer_map(plan, **kw).savefig(path, dpi=dpi)
    return path


__all__ = ["range_strips", "region_segments", "require_matplotlib", "save_transfer_map", "transfer_map"]
