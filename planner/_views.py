"""Table pieces shared by the plan views (planner/inspect.py) and the diff views (planner/diff.py)."""
from __future__ import annotations

import html
from collections.abc import Sequence

import numpy as np

from .errors import PlanError
from .plan import TransferPlan
from .spec import Layout

DEFAULT_MAX_ROWS = 20
RANGE_COLUMNS = ("call", "#", "source", "destination", "bytes", "blocks", "region")
NUMERIC = {"call", "#", "bytes", "blocks"}


def block_bytes(plan: TransferPlan, layout: Layout | None = None) -> np.ndarray:
    """Bytes of one block for every range (float64): the device page of the range's region (from ``layout``
    when given, else from the plan's ``region_page_bytes``; plans saved without it fall back to the mean
    bytes per requested copy, exact whenever all regions share one page size).

    Raises PlanError when ``layout`` does not have the plan's regions.
    """
    if layout is not None:
        names = tuple(r.name for r in layout.regions)
        if names != plan.regions:
            raise PlanError("layout.regions", f"{len(names)} regions",
                            f"do not match the plan's {len(plan.regions)} regions")
        return layout.info.page.astype(np.float64)[plan.region]
    if plan.region_page_bytes:
        return np.asarray(plan.region_page_bytes, dtype=np.float64)[plan.region]
    unit = plan.total_bytes / plan.requested_copies if plan.requested_copies else 1.0
    return np.full(plan.num_ranges, unit or 1.0)


def count(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:.2f}"


def plural(n: int, word: str) -> str:
    return f"{n} {word}{'' if n == 1 else 's'}"


def _where(plan: TransferPlan, buf: np.ndarray, off: np.ndarray) -> list[str]:
    names = [b.name for b in plan.buffers]
    return [f"{names[b]}:{o}" for b, o in zip(buf.tolist(), off.tolist())]


def shown_indices(n: int, max_rows: int | None) -> tuple[np.ndarray, int]:
    """Indices of the rows to show and where the elision marker goes (-1: none)."""
    if max_rows is None or n <= max_rows:
        return np.arange(n), -1
    head = (max_rows + 1) // 2
    return np.concatenate((np.arange(head), np.arange(n - (max_rows - head), n))), head


def rows_for(plan: TransferPlan, idx: np.ndarray, layout: Layout | None = None) -> list[tuple[str, ...]]:
    """The ranges ``idx`` of ``plan`` as table rows of strings, columns RANGE_COLUMNS."""
    idx = np.asarray(idx, dtype=np.int64)
    call = np.searchsorted(plan.call_offsets, idx, side="right") - 1
    blocks = plan.nbytes[idx].astype(np.float64) / block_bytes(plan, layout)[idx]
    cols = (call.tolist(), idx.tolist(), _where(plan, plan.src_buf[idx], plan.src_offset[idx]),
            _where(plan, plan.dst_buf[idx], plan.dst_offset[idx]), plan.nbytes[idx].tolist(),
            [count(b) for b in blocks.tolist()], [plan.regions[r] for r in plan.region[idx].tolist()])
    return [tuple(str(v) for v in r) for r in zip(*cols)]


def check_max_rows(max_rows: int | None) -> None:
    if max_rows is not None and max_rows < 2:
        raise PlanError("max_rows", max_rows, "must be at least 2, or None for every row")


def range_rows(plan: TransferPlan, layout: Layout | None = None, max_rows: int | None = DEFAULT_MAX_ROWS,
               ) -> tuple[list[tuple[str, ...]], int, int]:
    """The range table as strings (columns RANGE_COLUMNS), the row before which the elision marker goes
    (-1: no elision), and how many ranges were elided. ``max_rows=None`` shows every range."""
    check_max_rows(max_rows)
    idx, cut = shown_indices(plan.num_ranges, max_rows)
    return rows_for(plan, idx, layout), cut, plan.num_ranges - len(idx)


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


# Notebook front ends style every output table; JupyterLab right-aligns cells with
# ``:not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td`` (specificity 0,2,1) and centres tables. The class is
# doubled (``.kvxfer.kvxfer``) so each rule here outranks those on specificity alone, wherever the stylesheets
# sit in the document (tests/test_html_css.py checks it against JupyterLab's rules).
STYLE = ("<style>"
         ".kvxfer.kvxfer table{margin:0 0 1em 0;border-collapse:collapse;table-layout:auto}"
         ".kvxfer.kvxfer table td,.kvxfer.kvxfer table th{padding:1px 8px;font-family:monospace;text-align:left;"
         "white-space:nowrap;vertical-align:top}"
         ".kvxfer.kvxfer table td.n,.kvxfer.kvxfer table th.n{text-align:right}"
         ".kvxfer.kvxfer .elided{font-style:italic;color:#888}</style>")


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
