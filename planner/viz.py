"""A picture of a plan: the transfer map (needs matplotlib, the ``viz`` extra; imported only when drawing).

Source blocks run along x, destination blocks along y; every buffer used on a side gets its own stretch of
the axis, in buffer order. A range is a band from (source, destination) along the diagonal, as long as the
blocks it covers, coloured by region. The first range of each driver call is marked and numbered.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .layout import Layout
from .plan import TransferPlan, format_bytes
from .render import block_bytes

_LEGEND_REGIONS = 12
_LABELLED_CALLS = 32
_LABELLED_BUFFERS = 16


def require_matplotlib() -> Any:
    """The matplotlib module; raises ImportError with the install hint when the ``viz`` extra is missing
    (callers that write other files first check here, so nothing is written half-way)."""
    try:
        import matplotlib
    except ImportError as e:
        raise ImportError(f"the transfer map needs matplotlib: pip install 'kvxfer[viz]' ({e})") from None
    return matplotlib


def _axis(plan: TransferPlan, bufs: np.ndarray, unit: float) -> tuple[np.ndarray, list[tuple[float, float, str]]]:
    """Start (in blocks) of every buffer on one side's axis, and (start, end, name) of the used ones."""
    used = np.unique(bufs)
    start = np.zeros(len(plan.buffers))
    spans, pos = [], 0.0
    for b in used.tolist():
        start[b] = pos
        size = plan.buffers[b].nbytes / unit
        spans.append((pos, pos + size, plan.buffers[b].name))
        pos += size
    return start, spans


def _buffer_ticks(ax: Any, spans: list[tuple[float, float, str]], axis: str) -> None:
    """Block numbers along one axis. One buffer: the plain numeric ticks are its block numbers. A few buffers:
    block numbers counted within each buffer, and the buffer names under them. Many: positions only (the
    axis label says the buffers are laid back to back)."""
    from matplotlib.ticker import MaxNLocator

    line = ax.axvline if axis == "x" else ax.axhline
    for s, _, _ in spans[1:]:
        line(s, color="0.85", linewidth=0.6, zorder=0)
    if not 1 < len(spans) <= _LABELLED_BUFFERS:
        return
    longest = max(e - s for s, e, _ in spans)
    steps = MaxNLocator(nbins=max(2, 12 // len(spans)), integer=True, min_n_ticks=1).tick_values(0, longest)
    step = max(float(steps[1] - steps[0]) if len(steps) > 1 else longest, 1.0)
    ticks = [(s + b, f"{b:g}") for s, e, _ in spans for b in np.arange(0, e - s, step).tolist()]
    set_ticks = ax.set_xticks if axis == "x" else ax.set_yticks
    set_ticks([t for t, _ in ticks], [lab for _, lab in ticks], fontsize=7)
    set_ticks([(s + e) / 2 for s, e, _ in spans], [n for _, _, n in spans], minor=True, fontsize=7)
    widest = max(len(lab) for _, lab in ticks)  # names sit beyond the numbers: pad by the numbers' extent
    ax.tick_params(axis=axis, which="minor", length=0, pad=14 if axis == "x" else 6 + 4.5 * widest)


def transfer_map(plan: TransferPlan, *, layout: Layout | None = None, ax: Any = None,
                 title: str | None = None, linewidth: float = 3.0) -> Any:
    """Draw the transfer map of ``plan`` on ``ax`` (a new Figure when None, no pyplot state) and return the
    Figure. With ``layout``, block lengths use each region's page size. Raises ImportError without matplotlib."""
    require_matplotlib()
    from matplotlib import colormaps
    from matplotlib.collections import LineCollection
    from matplotlib.figure import Figure

    if ax is None:
        fig = Figure(figsize=(8, 7), layout="constrained")
        ax = fig.add_subplot()
    fig = ax.figure
    unit = float(np.median(block_bytes(plan, layout))) if plan.num_ranges else 1.0
    xs, xspans = _axis(plan, plan.src_buf, unit)
    ys, yspans = _axis(plan, plan.dst_buf, unit)
    x0 = xs[plan.src_buf] + plan.src_offset / unit
    y0 = ys[plan.dst_buf] + plan.dst_offset / unit
    length = plan.nbytes / unit
    segments = np.stack([np.stack([x0, y0], 1), np.stack([x0 + length, y0 + length], 1)], 1)
    cmap = colormaps["tab20"]
    colours = cmap((plan.region % 20) / 19.0)
    ax.add_collection(LineCollection(list(segments), colors=colours, linewidths=linewidth, capstyle="butt"))
    starts = plan.call_offsets[:-1]
    if plan.num_ranges:
        ax.scatter(x0[starts], y0[starts], marker="o", s=28, facecolors="none", edgecolors="black",
                   zorder=3, label="start of a call\n(its first range)")
        for c, i in enumerate(starts.tolist()[:_LABELLED_CALLS]):
            ax.annotate(f"call {c}", (x0[i], y0[i]), textcoords="offset points", xytext=(4, 4), fontsize=7)
    _buffer_ticks(ax, xspans, "x")
    _buffer_ticks(ax, yspans, "y")
    for set_lim, spans in ((ax.set_xlim, xspans), (ax.set_ylim, yspans)):
        top = max(spans[-1][1], 1) if spans else 1
        set_lim(-0.02 * top, 1.02 * top)  # a margin: bands and markers at block 0 stay off the axis lines

    def label(side: str, spans: list[tuple[float, float, str]]) -> str:
        if len(spans) == 1:
            return f"{side} block of {spans[0][2]}"
        if len(spans) > _LABELLED_BUFFERS:
            return f"{side} block, {len(spans)} buffers back to back"
        return f"{side} block"

    ax.set_xlabel(label(f"source ({plan.direction.src_side})", xspans) + f", {format_bytes(int(unit))} each")
    ax.set_ylabel(label(f"destination ({plan.direction.dst_side})", yspans))
    ax.set_title(title or repr(plan), fontsize=9)
    from matplotlib.lines import Line2D

    regions = np.unique(plan.region).tolist()
    shown = regions if len(regions) <= _LEGEND_REGIONS else []
    handles = [Line2D([], [], color=cmap((r % 20) / 19.0), linewidth=linewidth, label=plan.regions[r]) for r in shown]
    note = None if shown or not regions else f"colour: region\n({len(regions)} regions,\ntab20 cycled)"
    # outside the axes, so it never covers a band
    ax.legend(handles=handles + ax.get_legend_handles_labels()[0], title=note, title_fontsize=7, fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)
    return fig


def save_transfer_map(plan: TransferPlan, path: str | Path, *, dpi: int = 120, **kw: Any) -> Path:
    """Draw the transfer map (see ``transfer_map``) and save it to ``path`` (PNG, SVG or PDF by suffix)."""
    path = Path(path)
    transfer_map(plan, **kw).savefig(path, dpi=dpi)
    return path
