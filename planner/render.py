"""Views of a TransferPlan: ``explain`` (fixed-width text), ``to_html``, ``to_rich``, ``stats``, ``stats_frame``.

Every view is built from the same two pieces, ``header_rows`` and ``range_rows``, so the text that tests pin,
the notebook HTML and the terminal rendering always agree; the table pieces here also serve the diff views
(``planner/diff.py``). Pure: pandas and rich are imported only inside the functions that need them.
``TransferPlan.explain`` and friends import this module lazily: the one documented cycle, plan <-> render.
"""
from __future__ import annotations

import html
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from .credit import Credit, page_bytes, range_blocks, region_credit
from .errors import PlanError
from .layout import Layout
from .optional import import_optional
from .plan import TransferPlan, format_bytes
from .spec import Location
from .target import CopyApi

if TYPE_CHECKING:  # pragma: no cover
    import pandas  # type: ignore[import-untyped]

_HIST_SHOWN = 8


# ---- table pieces (shared with the diff views in diff.py) ------------------------------------------------
DEFAULT_MAX_ROWS = 20
RANGE_COLUMNS = ("call", "#", "source", "destination", "bytes", "blocks", "region")
NUMERIC = {"call", "#", "bytes", "blocks"}


def block_bytes(plan: TransferPlan, layout: Layout | None = None) -> np.ndarray:
    """Bytes of one block for every range (float64): the device page of the range's first region (from
    ``layout`` when given, else from the plan's ``region_page_bytes``; plans saved without it fall back to the
    mean bytes per requested copy, exact whenever all regions share one page size).

    Raises PlanError when ``layout`` does not have the plan's regions and buffers.
    """
    return page_bytes(plan, layout)[plan.region]  # type: ignore[no-any-return]


REGIONS_NAMED = 3  # a range over more regions names the first and counts the rest


def region_labels(plan: TransferPlan, credit: Credit, idx: np.ndarray) -> list[str]:
    """The region column for ranges ``idx``: its region, 'K+V' where a range covers several, and
    'kv0+117 more' past REGIONS_NAMED (numpy over the ranges, no loop per range)."""
    idx = np.asarray(idx, dtype=np.int64)
    lo = np.searchsorted(credit.range, idx, "left")
    many = np.searchsorted(credit.range, idx, "right") - lo
    names = np.array(plan.regions + ("",), dtype=object)
    label = names[credit.region[lo]] if len(idx) else np.zeros(0, dtype=object)
    listed = many <= REGIONS_NAMED
    for j in range(1, REGIONS_NAMED):
        m = listed & (many > j)
        label[m] = label[m] + "+" + names[credit.region[lo[m] + j]]
    m = ~listed
    label[m] = label[m] + "+" + (many[m] - 1).astype(str).astype(object) + " more"
    return label.tolist()


def count(x: float) -> str:
    """``x`` without decimals when it is whole, else with two."""
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def plural(n: int, word: str) -> str:
    """``n`` and ``word``, with an ``s`` unless ``n`` is 1."""
    return f"{n} {word}{'' if n == 1 else 's'}"


def wrap_parts(text: str, width: int, indent: str = "  ", sep: str = ", ") -> list[str]:
    """``text`` (parts joined by ``sep``) as lines of at most ``width`` characters, broken after a ``sep`` and
    continued with ``indent``; a part longer than a line is broken at spaces, never inside a word."""
    import textwrap

    parts = text.split(sep)
    pieces = [p + sep.rstrip() for p in parts[:-1]] + parts[-1:]
    lines: list[str] = []
    line = ""
    for piece in pieces:
        joined = f"{line} {piece}" if line else piece
        if line and len(indent * bool(lines) + joined) > width:
            lines.append(line)
            joined = piece
        line = joined
    lines.append(line)
    out: list[str] = []
    for i, line in enumerate(lines):
        out += textwrap.wrap(line, width, initial_indent=indent if i else "", subsequent_indent=indent,
                             break_long_words=False, break_on_hyphens=False) or [""]
    return out


def _where(plan: TransferPlan, buf: np.ndarray, off: np.ndarray) -> list[str]:
    names = [b.name for b in plan.buffers]
    return [f"{names[b]}:{o}" for b, o in zip(buf.tolist(), off.tolist())]


def shown_indices(n: int, max_rows: int | None) -> tuple[np.ndarray, int]:
    """Indices of the rows to show and where the elision marker goes (-1: none)."""
    if max_rows is None or n <= max_rows:
        return np.arange(n), -1
    head = (max_rows + 1) // 2
    return np.concatenate((np.arange(head), np.arange(n - (max_rows - head), n))), head


def rows_for(plan: TransferPlan, idx: np.ndarray, layout: Layout | None = None, credit: Credit | None = None,
             ) -> list[tuple[str, ...]]:
    """The ranges ``idx`` of ``plan`` as table rows of strings, columns RANGE_COLUMNS. With ``layout``, a range
    over several regions' pages counts each region's blocks and names every region (``credit.region_credit``;
    pass ``credit`` where the caller has it)."""
    idx = np.asarray(idx, dtype=np.int64)
    call = np.searchsorted(plan.call_offsets, idx, side="right") - 1
    credit = region_credit(plan, layout) if credit is None else credit
    blocks = range_blocks(plan, credit, layout)[idx]
    cols = (call.tolist(), idx.tolist(), _where(plan, plan.src_buf[idx], plan.src_offset[idx]),
            _where(plan, plan.dst_buf[idx], plan.dst_offset[idx]), plan.nbytes[idx].tolist(),
            [count(b) for b in blocks.tolist()], region_labels(plan, credit, idx))
    return [tuple(str(v) for v in r) for r in zip(*cols)]


def check_max_rows(max_rows: int | None) -> None:
    """Raise PlanError unless ``max_rows`` is None or at least 2."""
    if max_rows is not None and max_rows < 2:
        raise PlanError("max_rows", max_rows, "must be at least 2, or None for every row")


def range_rows(plan: TransferPlan, layout: Layout | None = None, max_rows: int | None = DEFAULT_MAX_ROWS,
               credit: Credit | None = None) -> tuple[list[tuple[str, ...]], int, int]:
    """The range table as strings (columns RANGE_COLUMNS), the row before which the elision marker goes
    (-1: no elision), and how many ranges were elided. ``max_rows=None`` shows every range."""
    check_max_rows(max_rows)
    idx, cut = shown_indices(plan.num_ranges, max_rows)
    return rows_for(plan, idx, layout, credit), cut, plan.num_ranges - len(idx)


def format_table(columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: set[str], cut: int = -1,
                 marker: str = "", indent: str = " ") -> list[str]:
    """Fixed-width lines: numeric columns right-aligned, others left; ``marker`` is inserted before row ``cut``."""
    widths = [max([len(c)] + [len(r[i]) for r in rows]) for i, c in enumerate(columns)]

    def line(cells: Sequence[str]) -> str:
        out = [c.rjust(w) if name in numeric else c.ljust(w) for c, w, name in zip(cells, widths, columns)]
        return (indent + "  ".join(out)).rstrip()

    lines = [line(columns)]
    for i, r in enumerate(rows):
        if i == cut:
            lines.append(indent + marker)
        lines.append(line(r))
    return lines


# Colours are JupyterLab's theme variables with a fallback for pages without them, so the views stay legible
# on dark themes (tests/test_html_css.py checks every colour is such a variable). Notebook front ends style
# every output table; JupyterLab right-aligns cells with ``:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon
# td`` (specificity 0,2,1) and centres tables. The class is doubled (``.kvxfer.kvxfer``) so each rule here
# outranks those on specificity alone, wherever the stylesheets sit in the document (tests/test_html_css.py
# checks it against JupyterLab's rules).
STYLE = ("<style>"
         ".kvxfer.kvxfer table{margin:0 0 1em 0;border-collapse:collapse;table-layout:auto}"
         ".kvxfer.kvxfer table td,.kvxfer.kvxfer table th{padding:1px 8px;font-family:monospace;text-align:left;"
         "white-space:nowrap;vertical-align:top}"
         ".kvxfer.kvxfer table td.n,.kvxfer.kvxfer table th.n{text-align:right}"
         ".kvxfer.kvxfer .elided{font-style:italic;color:var(--jp-content-font-color2,#888)}</style>")


def html_table(columns: Sequence[str], rows: Sequence[Sequence[str]], numeric: set[str], cut: int = -1,
               marker: str = "", row_class: Sequence[str] | None = None) -> str:
    """A plain <table>: header row, body rows, an elision row before ``cut``; cells escaped."""
    def cls(name: str) -> str:
        return ' class="n"' if name in numeric else ""

    out = ["<table>", "<thead><tr>" + "".join(f"<th{cls(c)}>{html.escape(c)}</th>" for c in columns) + "</tr></thead>",
           "<tbody>"]
    for i, r in enumerate(rows):
        if i == cut:
            out.append(f'<tr class="elided"><td colspan="{len(columns)}">{html.escape(marker)}</td></tr>')
        tr = f'<tr class="{row_class[i]}">' if row_class else "<tr>"
        out.append(tr + "".join(f"<td{cls(c)}>{html.escape(v)}</td>" for c, v in zip(columns, r)) + "</tr>")
    out += ["</tbody>", "</table>"]
    return "\n".join(out)


# ---- shared pieces ----------------------------------------------------------------------------------------
def run_lengths(values: Sequence[int], shown: int = _HIST_SHOWN) -> str:
    """[8192, 8192, 8192, 5632] -> '8192 x3, 5632' (run-length, in order; long lists elided)."""
    if len(values) == 0:
        return "none"
    v = np.asarray(values)
    starts = np.flatnonzero(np.concatenate(([True], v[1:] != v[:-1])))
    lengths = np.diff(np.append(starts, len(v)))
    parts = [f"{v[s]}" + (f" x{k}" if k > 1 else "") for s, k in zip(starts.tolist(), lengths.tolist())]
    if len(parts) > shown:
        parts = parts[:shown] + [f"... ({len(parts) - shown} more)"]
    return ", ".join(parts)


def run_length_histogram(plan: TransferPlan, layout: Layout | None = None, credit: Credit | None = None,
                         ) -> dict[float, int]:
    """{blocks covered by a range: number of ranges}, ascending by blocks (with ``layout``, a range over several
    regions counts the blocks of each). ``credit``: the plan's ``region_credit``, where the caller has it."""
    blocks = range_blocks(plan, region_credit(plan, layout) if credit is None else credit, layout)
    keys, counts = np.unique(blocks, return_counts=True)
    return {(int(k) if float(k).is_integer() else float(k)): int(c) for k, c in zip(keys.tolist(), counts.tolist())}


def _gates(plan: TransferPlan) -> str:
    gates = plan.target.gates()
    return " | ".join(f"{name}: {'yes' if ok else 'no'}" for name, ok in gates) if gates else "none"


def _options(plan: TransferPlan) -> str:
    opts = plan.options.model_dump(mode="json", exclude_defaults=True)  # only what differs from the defaults
    cap = plan.options.descriptor_cap(plan.target)
    parts = [f"{k}={v}" for k, v in opts.items()] or ["defaults"]
    return " ".join(parts) + f" (cap {cap or 'unlimited'})"


def _attrs_line(plan: TransferPlan) -> str:
    if not plan.passes_attrs:
        return "not passed (numAttrs 0)"
    per_call = [len(plan.attr_runs(c)[0]) for c in range(plan.num_calls)]
    return f"passed (numAttrs per call: {run_lengths(per_call)})"


def _buffers_line(plan: TransferPlan) -> str:
    host = sum(1 for b in plan.buffers if b.location is Location.HOST)
    used = len(set(plan.src_buf.tolist()) | set(plan.dst_buf.tolist())) if plan.num_ranges else 0
    return (f"{len(plan.buffers)} ({host} host, {len(plan.buffers) - host} device; {used} used), "
            f"{plural(len(plan.regions), 'region')}")


def _calls_line(plan: TransferPlan) -> str:
    if not plan.num_calls:
        return "none"
    line = f"{plan.num_calls}: {run_lengths(plan.call_sizes.tolist())} ranges"
    if plan.api in (CopyApi.CUDA_PER_RANGE, CopyApi.HIP_PER_RANGE, CopyApi.MEMCPY):
        line += f" ({plan.api.value} per range: {plan.num_ranges} driver calls)"
    return line


def _writers_line(plan: TransferPlan) -> str:
    """Writer rotation per region on a store, regions with equal settings grouped: 'index 0 of 2: a, b | all: c'."""
    groups: dict[tuple[int, int], list[str]] = {}
    for name, setting in zip(plan.regions, plan.region_writers):
        groups.setdefault(setting, []).append(name)
    parts = []
    for (w, i), names in groups.items():
        shown = ", ".join(names[:4]) + (f", ... ({len(names) - 4} more)" if len(names) > 4 else "")
        parts.append(f"{'every rank' if w == 1 else f'index {i} of {w}'}: {shown}")
    return " | ".join(parts)


def header_rows(plan: TransferPlan, layout: Layout | None = None, credit: Credit | None = None,
                ) -> list[tuple[str, str]]:
    """(key, value) lines of the plan's header: target, gates, options, attributes, totals, merge ratio, calls.
    ``credit``: the plan's ``region_credit`` over ``layout``, where the caller has it."""
    n, req = plan.num_ranges, plan.requested_copies
    ratio = f"merge {req / n:.2f}x" if n else "nothing to copy"
    rows = [
        ("plan", f"{plan.direction.value} {plan.target.label} via {plan.api.value}"),
        ("gates", _gates(plan)),
        ("options", _options(plan)),
        ("attrs", _attrs_line(plan)),
    ]
    rows += [(f"  [{i}]", a.short()) for i, a in enumerate(plan.attrs)]
    rows += [
        ("buffers", _buffers_line(plan)),
        ("copies", f"{req} requested -> {plural(n, 'range')} ({ratio})"),
        ("bytes", f"{format_bytes(plan.total_bytes)} ({plan.total_bytes} B)"),
        ("calls", _calls_line(plan)),
    ]
    rows += [("aliases" if i == 0 else "", f"region {a!r} aliases {b!r} (planned once)") for i, (a, b) in enumerate(plan.aliases)]
    if plan.region_writers:
        rows.append(("writers", _writers_line(plan)))
    if layout is not None and layout.num_groups is not None:
        empty = sorted(set(range(layout.num_groups)) - {r.group for r in layout.regions})
        rows.append(("groups", f"{layout.num_groups} declared" + (f", without regions: {empty}" if empty else "")))
    if n:
        nb = plan.nbytes
        credit = region_credit(plan, layout) if credit is None else credit
        unit = np.unique(page_bytes(plan, layout)[np.unique(credit.region)])
        uniform = len(unit) == 1
        hist = run_length_histogram(plan, layout, credit)
        shown = list(hist.items())[:_HIST_SHOWN]
        more = f", ... ({len(hist) - _HIST_SHOWN} more)" if len(hist) > _HIST_SHOWN else ""
        rows += [
            ("range", f"min {format_bytes(int(nb.min()))}, median {format_bytes(int(np.median(nb)))}, "
                      f"max {format_bytes(int(nb.max()))}"),
            ("blocks", ("of " + format_bytes(int(unit[0])) if uniform else "per region page")
             + ": " + ", ".join(f"{count(k)} x{c}" for k, c in shown) + more),
        ]
    return rows


# What shows every range, said where the elision marker appears: each caller (the CLI, the pytest plugin) passes
# its own, so the marker never names an argument that does not exist where it is read.
EXPLAIN_HINT = "full=True shows all"
VIEW_HINT = "plan.explain(full=True) shows all"


def elision(elided: int, hint: str, what: str = "range") -> str:
    """The marker that stands for ``elided`` rows: '... 12 ranges not shown (<hint>) ...'."""
    return f"... {plural(elided, what)} not shown ({hint}) ..."


# ---- text -------------------------------------------------------------------------------------------------
def explain(plan: TransferPlan, *, max_rows: int | None = DEFAULT_MAX_ROWS, full: bool = False,
            ranges: bool = True, layout: Layout | None = None, hint: str = EXPLAIN_HINT) -> str:
    """Deterministic fixed-width text: the header, then the range table.

    ``max_rows`` ranges are shown (head and tail, with a count of the elided middle, followed by ``hint``:
    what shows every range where the text is read); ``full=True`` shows all; ``ranges=False`` prints the
    header only. With ``layout`` (the plan's), block counts use each region's page size. Raises PlanError
    for ``max_rows < 2`` or a layout with other regions.
    """
    credit = region_credit(plan, layout)  # once per view
    head = header_rows(plan, layout, credit)
    width = max(len(k) for k, _ in head)
    lines = [repr(plan)] + [f"  {k.ljust(width)}  {v}" for k, v in head]
    if ranges and plan.num_ranges:
        rows, cut, elided = range_rows(plan, layout, None if full else max_rows, credit)
        lines += [""] + format_table(RANGE_COLUMNS, rows, NUMERIC, cut, elision(elided, hint))
    return "\n".join(lines) + "\n"


# ---- HTML -------------------------------------------------------------------------------------------------
def to_html(plan: TransferPlan, *, max_rows: int | None = DEFAULT_MAX_ROWS, full: bool = False,
            layout: Layout | None = None, hint: str = VIEW_HINT) -> str:
    """The content of ``explain`` as plain HTML (a header table and the range table); no scripts, no subprocess.
    Arguments as for ``explain``."""
    credit = region_credit(plan, layout)  # once per view
    head = "\n".join(f"<tr><th>{html.escape(k.strip())}</th><td>{html.escape(v)}</td></tr>"
                     for k, v in header_rows(plan, layout, credit))
    parts = ['<div class="kvxfer kvxfer-plan">', STYLE, f"<p><b>{html.escape(repr(plan))}</b></p>",
             f'<table class="kvxfer-header">\n{head}\n</table>']
    if plan.num_ranges:
        rows, cut, elided = range_rows(plan, layout, None if full else max_rows, credit)
        parts.append(html_table(RANGE_COLUMNS, rows, NUMERIC, cut, elision(elided, hint)))
    parts.append("</div>")
    return "\n".join(parts)


# ---- terminal ---------------------------------------------------------------------------------------------
def to_rich(plan: TransferPlan, *, max_rows: int | None = DEFAULT_MAX_ROWS, full: bool = False,
            ranges: bool = True, layout: Layout | None = None, hint: str = VIEW_HINT) -> Any:
    """A rich renderable (header grid and range table) with the content of ``explain`` (arguments as there).
    Raises MissingDependencyError (an ImportError) with the install line without ``rich``."""
    import_optional("rich", "terminal rendering")
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text
    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold")
    grid.add_column()
    credit = region_credit(plan, layout)  # once per view
    for k, v in header_rows(plan, layout, credit):
        grid.add_row(k, v)
    parts: list[Any] = [Text(repr(plan), style="bold"), grid]
    if ranges and plan.num_ranges:
        rows, cut, elided = range_rows(plan, layout, None if full else max_rows, credit)
        table = Table(box=None, header_style="bold", pad_edge=False)
        for c in RANGE_COLUMNS:
            table.add_column(c, justify="right" if c in NUMERIC else "left")
        for i, r in enumerate(rows):
            if i == cut:
                table.add_row("", "", Text(elision(elided, hint), style="italic dim"))
            table.add_row(*r)
        parts.append(table)
    return Group(*parts)


# ---- statistics -------------------------------------------------------------------------------------------
def _range_record(plan: TransferPlan, i: int) -> dict[str, Any]:
    names = [b.name for b in plan.buffers]
    return {"index": i, "call": int(np.searchsorted(plan.call_offsets, i, side="right") - 1),
            "src": names[int(plan.src_buf[i])], "src_offset": int(plan.src_offset[i]),
            "dst": names[int(plan.dst_buf[i])], "dst_offset": int(plan.dst_offset[i]),
            "nbytes": int(plan.nbytes[i]), "region": plan.regions[int(plan.region[i])]}


def _totals(keys: np.ndarray, nbytes: np.ndarray, size: int) -> tuple[list[int], list[int]]:
    ranges = np.bincount(keys, minlength=size)
    total = np.bincount(keys, weights=nbytes.astype(np.float64), minlength=size)
    return ranges.tolist(), [int(t) for t in total.tolist()]


def stats(plan: TransferPlan, layout: Layout | None = None) -> dict[str, Any]:
    """Numbers about a plan, as plain Python values (JSON-ready).

    Keys: direction, target, api, requested_copies, ranges, calls, total_bytes, merge_ratio, call_sizes,
    bytes_per_call, range_bytes (min/median/mean/max), largest_range and smallest_range (first such range),
    run_length_histogram ({blocks: ranges}), per_region and per_buffer ({name: {ranges, bytes}}; a buffer
    counts as src_* and dst_*). Regions and buffers that no range touches are left out. With ``layout``, a
    range over several regions' pages counts for each, with its bytes of each (``credit.region_credit``), so
    per_region's bytes add up to total_bytes.
    """
    n = plan.num_ranges
    nb = plan.nbytes
    credit = region_credit(plan, layout)  # once: the histogram and per_region read it
    per_call = np.add.reduceat(nb, plan.call_offsets[:-1]) if n else np.zeros(0, np.uint64)
    out: dict[str, Any] = {
        "direction": plan.direction.value, "target": plan.target.label, "api": plan.api.value,
        "requested_copies": plan.requested_copies, "ranges": n, "calls": plan.num_calls,
        "total_bytes": plan.total_bytes, "merge_ratio": plan.requested_copies / n if n else None,
        "call_sizes": plan.call_sizes.tolist(), "bytes_per_call": [int(x) for x in per_call.tolist()],
        "range_bytes": ({"min": int(nb.min()), "median": float(np.median(nb)), "mean": float(nb.mean()),
                         "max": int(nb.max())} if n else None),
        "largest_range": _range_record(plan, int(np.argmax(nb))) if n else None,
        "smallest_range": _range_record(plan, int(np.argmin(nb))) if n else None,
        "run_length_histogram": run_length_histogram(plan, layout, credit),
    }
    r_ranges, r_bytes = _totals(credit.region, credit.nbytes, len(plan.regions))
    out["per_region"] = {name: {"ranges": c, "bytes": b}
                         for name, c, b in zip(plan.regions, r_ranges, r_bytes) if c}
    nbuf = len(plan.buffers)
    s_ranges, s_bytes = _totals(plan.src_buf, nb, nbuf)
    d_ranges, d_bytes = _totals(plan.dst_buf, nb, nbuf)
    out["per_buffer"] = {
        b.name: {"src_ranges": s_ranges[i], "src_bytes": s_bytes[i], "dst_ranges": d_ranges[i], "dst_bytes": d_bytes[i]}
        for i, b in enumerate(plan.buffers) if s_ranges[i] or d_ranges[i]}
    return out


def stats_frame(plan: TransferPlan, by: str = "region", layout: Layout | None = None) -> pandas.DataFrame:
    """Per-``by`` totals as a pandas DataFrame: by "region", "buffer", "call" or "range" (the range table).

    Raises MissingDependencyError (an ImportError) with the install line without pandas, PlanError for an
    unknown ``by``.
    """
    pd = import_optional("pandas", "stats_frame")
    if by == "range":
        names = np.array([b.name for b in plan.buffers], dtype=object)
        credit = region_credit(plan, layout)
        return pd.DataFrame({
            "call": np.searchsorted(plan.call_offsets, np.arange(plan.num_ranges), side="right") - 1,
            "src": names[plan.src_buf], "src_offset": plan.src_offset, "dst": names[plan.dst_buf],
            "dst_offset": plan.dst_offset, "nbytes": plan.nbytes,
            "blocks": range_blocks(plan, credit, layout),
            "region": region_labels(plan, credit, np.arange(plan.num_ranges)), "attr": plan.attr})
    s = stats(plan, layout)
    if by == "region":
        return pd.DataFrame.from_dict(s["per_region"], orient="index").rename_axis("region")
    if by == "buffer":
        return pd.DataFrame.from_dict(s["per_buffer"], orient="index").rename_axis("buffer")
    if by == "call":
        return pd.DataFrame({"ranges": s["call_sizes"], "bytes": s["bytes_per_call"]}).rename_axis("call")
    raise PlanError("by", by, "expected 'region', 'buffer', 'call' or 'range'")



__all__ = ["DEFAULT_MAX_ROWS", "EXPLAIN_HINT", "VIEW_HINT", "block_bytes", "elision", "explain", "header_rows",
           "region_labels", "run_length_histogram", "run_lengths", "stats", "stats_frame", "to_html", "to_rich", "wrap_parts"]
