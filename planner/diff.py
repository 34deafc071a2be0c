"""Comparing plans: ``diff_plans`` (what changed, as a PlanDiff) and ``equivalent`` (do they move the same bytes).

"Identical" means equal fingerprints: same header, same ranges in the same order and calls. "Equivalent" means
the same byte-level (source byte, destination byte) pairs, whatever the merging, order or call split; it is
decided on the maximal merged form (``normalize``), which is canonical because destinations never overlap.
Ranges are matched by buffer *name*, so plans whose buffer tables list the buffers in another order compare.
"""
from __future__ import annotations

import html
from dataclasses import dataclass, field

import numpy as np

from .errors import PlanError
from .plan import CopyAttributes, LocationHint, TransferPlan
from .render import (
    NUMERIC,
    RANGE_COLUMNS,
    STYLE,
    check_max_rows,
    elision,
    format_table,
    html_table,
    rows_for,
    shown_indices,
    wrap_parts,
)
from .spec import Location

DEFAULT_DIFF_ROWS = 40
TEXT_HINT = "text(max_rows=None) shows all"
VIEW_HINT = "print(diff.text(max_rows=None)) shows all"
TEXT_WIDTH = 80  # the summary line is wrapped to this width in text(); ``summary`` itself stays one line
# removed/added rows in JupyterLab's theme colours (legible on light and dark themes), with fallbacks
DIFF_STYLE = STYLE.replace("</style>", ".kvxfer tr.removed{color:var(--jp-error-color1,#b00)}"
                                       ".kvxfer tr.added{color:var(--jp-success-color1,#070)}</style>")
_KEY = ("dst_buf", "dst_offset", "src_buf", "src_offset", "nbytes")  # sort priority: destination first


def _named(plan: TransferPlan, ids: dict[str, int]) -> dict[str, np.ndarray]:
    """The plan's range geometry with buffer indices replaced by ``ids[buffer name]`` (shared between plans)."""
    remap = np.array([ids.get(b.name, -1) for b in plan.buffers], dtype=np.int64)
    return {"src_buf": remap[plan.src_buf].astype(np.int64), "src_offset": plan.src_offset,
            "dst_buf": remap[plan.dst_buf].astype(np.int64), "dst_offset": plan.dst_offset, "nbytes": plan.nbytes}


def normalize(plan: TransferPlan) -> tuple[tuple[str, ...], dict[str, np.ndarray]]:
    """The plan's byte coverage in maximal merged form: (sorted names of the buffers used, columns src_buf,
    src_offset, dst_buf, dst_offset, nbytes with buffer indices into those names), sorted by destination.

    Two plans move the same (source byte, destination byte) pairs exactly when their normal forms are equal.
    Raises PlanError naming the range when two ranges write the same destination byte (no canonical form).
    """
    used = np.union1d(plan.src_buf, plan.dst_buf) if plan.num_ranges else np.zeros(0, np.int32)
    names = sorted({plan.buffers[i].name for i in used.tolist()})
    r = _named(plan, {n: i for i, n in enumerate(names)})
    keep = r["nbytes"] > 0
    r = {k: v[keep] for k, v in r.items()}
    idx = np.flatnonzero(keep)
    o = np.lexsort((r["dst_offset"], r["dst_buf"]))
    db, do, nb = r["dst_buf"][o], r["dst_offset"][o], r["nbytes"][o]
    bad = np.flatnonzero((db[1:] == db[:-1]) & (do[:-1] + nb[:-1] > do[1:]))
    if bad.size:
        i, j = int(idx[o[bad[0]]]), int(idx[o[bad[0] + 1]])
        raise PlanError("dst_offset", int(plan.dst_offset[j]), f"range {j} writes bytes that range {i} also writes "
                        f"(buffer {names[int(db[bad[0] + 1])]!r}); a plan must write each destination byte once", j)
    diag = r["dst_offset"] - r["src_offset"]  # wraps modulo 2^64, which keeps equality exact
    o = np.lexsort((r["dst_offset"], diag, r["dst_buf"], r["src_buf"]))
    r, diag = {k: v[o] for k, v in r.items()}, diag[o]
    link = ((r["src_buf"][1:] == r["src_buf"][:-1]) & (r["dst_buf"][1:] == r["dst_buf"][:-1])
            & (diag[1:] == diag[:-1]) & (r["dst_offset"][:-1] + r["nbytes"][:-1] == r["dst_offset"][1:]))
    starts = np.flatnonzero(np.concatenate(([True], ~link))) if len(diag) else np.zeros(0, np.int64)
    out = {k: v[starts] for k, v in r.items()}
    out["nbytes"] = np.add.reduceat(r["nbytes"], starts) if len(starts) else r["nbytes"]
    o = np.lexsort((out["dst_offset"], out["dst_buf"]))
    return tuple(names), {k: v[o] for k, v in out.items()}


def equivalent(a: TransferPlan, b: TransferPlan) -> bool:
    """True when ``a`` and ``b`` copy the same source bytes to the same destination bytes (buffers by name),
    however they are merged, ordered, split or chunked. Direction, target and attributes are not compared."""
    na, ra = normalize(a)
    nb, rb = normalize(b)
    return na == nb and all(np.array_equal(ra[k], rb[k]) for k in _KEY)


# ---- the summary line -------------------------------------------------------------------------------------
def _change(label: str, x: object, y: object) -> str | None:
    return None if x == y else f"{label} {x} -> {y}"


def _loc(h: LocationHint) -> str:
    return f"dev{h.id}" if h.location is Location.DEVICE else "host"


def _attr_changes(a: tuple[CopyAttributes, ...], b: tuple[CopyAttributes, ...]) -> list[str]:
    if len(a) != len(b):
        return [f"{len(a)} -> {len(b)} entries"]
    seen: list[str] = []
    for x, y in zip(a, b):
        for part in (_change("order", x.src_access_order.value, y.src_access_order.value),
                     _change("src", _loc(x.src_location), _loc(y.src_location)),
                     _change("dst", _loc(x.dst_location), _loc(y.dst_location)),
                     _change("flags", f"{x.flags:#x}", f"{y.flags:#x}")):
            if part and part not in seen:
                seen.append(part)
    return seen


def _signed(d: int) -> str:
    return f" ({d:+d})" if d else ""


def summary_line(a: TransferPlan, b: TransferPlan, same_bytes: bool | None) -> str:
    """One line saying what differs between the headers and totals of ``a`` and ``b``."""
    parts = [_change("target", a.target.label, b.target.label),
             _change("direction", a.direction.value, b.direction.value),
             _change("api", a.api.value, b.api.value),
             f"ranges {a.num_ranges} -> {b.num_ranges}{_signed(b.num_ranges - a.num_ranges)}",
             f"calls {a.num_calls} -> {b.num_calls}",
             "bytes equal" if a.total_bytes == b.total_bytes else
             f"bytes {a.total_bytes} -> {b.total_bytes}{_signed(b.total_bytes - a.total_bytes)}",
             _change("copies", a.requested_copies, b.requested_copies)]
    attrs = _attr_changes(a.attrs, b.attrs)
    passed = _change("passed", "yes" if a.passes_attrs else "no", "yes" if b.passes_attrs else "no")
    attrs += [passed] if passed else []
    parts.append("attrs: " + ", ".join(attrs) if attrs else None)
    oa, ob = a.options.model_dump(mode="json"), b.options.model_dump(mode="json")
    opts = [f"{k} {oa.get(k)} -> {ob.get(k)}" for k in sorted(set(oa) | set(ob)) if oa.get(k) != ob.get(k)]
    parts.append("options: " + ", ".join(opts) if opts else None)
    if a.buffers != b.buffers:
        parts.append(f"buffers {len(a.buffers)} -> {len(b.buffers)}" if len(a.buffers) != len(b.buffers)
                     else "buffers changed")
    if a.regions != b.regions:
        parts.append(f"regions {len(a.regions)} -> {len(b.regions)}" if len(a.regions) != len(b.regions)
                     else "regions renamed")
    if a.aliases != b.aliases:
        parts.append(f"aliases {len(a.aliases)} -> {len(b.aliases)}" if len(a.aliases) != len(b.aliases)
                     else "aliases changed")
    if a.region_writers != b.region_writers:
        parts.append("region writers changed")
    if same_bytes is not None:
        parts.append("same bytes moved" if same_bytes else "different bytes moved")
    return ", ".join(p for p in parts if p)


# ---- the diff ---------------------------------------------------------------------------------------------
def _differing(a: TransferPlan, b: TransferPlan) -> tuple[np.ndarray, np.ndarray]:
    """Ranges present in only one plan (matched on buffer names, offsets and size): (side 0 = only in a / 1 =
    only in b, index into that plan). Ordered by destination, removed before added at the same place. Plans
    that move in opposite directions share no destinations: their rows are paired instead, region by region
    (regions matched by name), the k-th changed range of a region in ``a`` beside the k-th in ``b``."""
    ids: dict[str, int] = {}
    for buf in a.buffers + b.buffers:  # a's buffer order, then b's new buffers: rows follow the plans' order
        ids.setdefault(buf.name, len(ids))
    ka, kb = _named(a, ids), _named(b, ids)
    cols: dict[str, np.ndarray] = {k: np.concatenate((ka[k].astype(np.uint64), kb[k].astype(np.uint64))) for k in _KEY}
    side = np.concatenate((np.zeros(a.num_ranges, np.int8), np.ones(b.num_ranges, np.int8)))
    index = np.concatenate((np.arange(a.num_ranges), np.arange(b.num_ranges)))
    o = np.lexsort([side, *(cols[k] for k in reversed(_KEY))])
    same_next = np.ones(len(o) - 1 if len(o) else 0, dtype=bool)
    for k in _KEY:
        c = cols[k][o]
        same_next &= c[1:] == c[:-1]
    same_next &= side[o][1:] != side[o][:-1]
    matched = np.zeros(len(o), dtype=bool)
    matched[:-1] |= same_next
    matched[1:] |= same_next
    keep = o[~matched]
    keep = keep[np.lexsort((side[keep], cols["dst_offset"][keep], cols["dst_buf"][keep]))]  # '-' before '+'
    if a.direction != b.direction:
        keep = keep[_paired(a, b, side[keep], index[keep])]
    return side[keep], index[keep]


def _paired(a: TransferPlan, b: TransferPlan, side: np.ndarray, index: np.ndarray) -> np.ndarray:
    """The order that puts the k-th changed range of each region in ``a`` (side 0) before the k-th in ``b``
    (side 1), counting each side's ranges by their device-side place (a load's destination, a store's source,
    buffers by name), regions in ``a``'s order then ``b``'s new ones."""
    names: dict[str, int] = {}
    for name in a.regions + b.regions:
        names.setdefault(name, len(names))
    buffers: dict[str, int] = {}
    for buf in a.buffers + b.buffers:
        buffers.setdefault(buf.name, len(buffers))
    region, dev_buf, dev_off = (np.zeros(len(side), np.int64) for _ in range(3))
    for s, plan in enumerate((a, b)):
        rows = index[side == s]
        ids = np.array([names[r] for r in plan.regions] or [0], np.int64)
        region[side == s] = ids[plan.region[rows]]
        dev = "dst" if plan.direction.dst_side is Location.DEVICE else "src"
        remap = np.array([buffers[buf.name] for buf in plan.buffers] or [0], np.int64)
        dev_buf[side == s] = remap[getattr(plan, f"{dev}_buf")[rows]]
        dev_off[side == s] = getattr(plan, f"{dev}_offset")[rows]
    group = region * 2 + side
    o = np.lexsort((dev_off, dev_buf, group))  # each region's rows of one side, by device-side place
    starts = np.flatnonzero(np.concatenate(([True], group[o][1:] != group[o][:-1]))) if len(o) else o
    ordinal = np.empty(len(side), np.int64)
    ordinal[o] = np.arange(len(o)) - np.repeat(starts, np.diff(np.append(starts, len(o))))
    return np.lexsort((side, ordinal, region))


@dataclass(frozen=True)
class PlanDiff:
    """What differs between plans ``a`` and ``b``. Falsy (and ``str`` empty) when they are identical.

    ``summary`` is one line; ``only_a`` / ``only_b`` index the ranges present in one plan only (matched on
    buffer names, offsets and size), in destination order. ``text()`` and ``to_html()`` render the summary and
    the -/+ rows, eliding the middle beyond ``max_rows``.
    """

    a: TransferPlan = field(repr=False)
    b: TransferPlan = field(repr=False)
    identical: bool
    equivalent: bool
    summary: str
    only_a: np.ndarray = field(repr=False)
    only_b: np.ndarray = field(repr=False)
    _side: np.ndarray = field(repr=False)
    _index: np.ndarray = field(repr=False)

    def __bool__(self) -> bool:
        return not self.identical

    @property
    def changed_ranges(self) -> int:
        """Number of ranges in only one of the two plans."""
        return len(self._side)

    def _rows(self, max_rows: int | None) -> tuple[list[tuple[str, ...]], list[str], int, int]:
        check_max_rows(max_rows)
        shown, cut = shown_indices(len(self._side), max_rows)
        side, index = self._side[shown], self._index[shown]
        rows_a = iter(rows_for(self.a, index[side == 0]))
        rows_b = iter(rows_for(self.b, index[side == 1]))
        rows = [("-",) + next(rows_a) if s == 0 else ("+",) + next(rows_b) for s in side.tolist()]
        kinds = ["removed" if s == 0 else "added" for s in side.tolist()]
        return rows, kinds, cut, len(self._side) - len(shown)

    def text(self, max_rows: int | None = DEFAULT_DIFF_ROWS, *, hint: str = TEXT_HINT, width: int = TEXT_WIDTH) -> str:
        """'' when identical; else '--- a', '+++ b', the summary (wrapped to ``width`` columns, continued with
        two spaces) and the -/+ rows (fixed width), the middle elided beyond ``max_rows`` with a count and
        ``hint`` (what shows every row where the text is read). Raises PlanError for ``max_rows < 2``."""
        if self.identical:
            return ""
        lines = [f"--- {self.a!r}", f"+++ {self.b!r}", *wrap_parts(self.summary, width)]
        if len(self._side):
            rows, _, cut, elided = self._rows(max_rows)
            marker = elision(elided, hint, "changed range")
            lines += format_table(("",) + RANGE_COLUMNS, rows, NUMERIC, cut, marker, indent="")
        return "\n".join(lines) + "\n"

    def __str__(self) -> str:
        return self.text()

    def to_html(self, max_rows: int | None = DEFAULT_DIFF_ROWS, *, hint: str = VIEW_HINT) -> str:
        """The content of ``text()`` as plain HTML; removed rows have class "removed", added rows "added", in
        JupyterLab's error and success colours."""
        if self.identical:
            return '<div class="kvxfer kvxfer-diff"><p>identical plans</p></div>'
        parts = ['<div class="kvxfer kvxfer-diff">', DIFF_STYLE,
                 f"<p>--- {html.escape(repr(self.a))}<br>+++ {html.escape(repr(self.b))}</p>",
                 f'<p class="summary">{html.escape(self.summary)}</p>']
        if len(self._side):
            rows, kinds, cut, elided = self._rows(max_rows)
            parts.append(html_table(("",) + RANGE_COLUMNS, rows, NUMERIC, cut, elision(elided, hint, "changed range"),
                                    kinds))
        parts.append("</div>")
        return "\n".join(parts)

    def _repr_html_(self) -> str:
        return self.to_html()


def diff_plans(a: TransferPlan, b: TransferPlan) -> PlanDiff:
    """Compare two plans: identical (same fingerprint), equivalent (same bytes moved), a summary line, and the
    ranges found in only one of them. Raises PlanError when a plan writes a destination byte twice."""
    if not isinstance(a, TransferPlan) or not isinstance(b, TransferPlan):
        bad, name = (a, "a") if not isinstance(a, TransferPlan) else (b, "b")
        raise PlanError(name, type(bad).__name__, "expected a TransferPlan")
    empty = np.zeros(0, np.int64)
    if a == b:
        return PlanDiff(a, b, True, True, "", empty, empty, empty.astype(np.int8), empty)
    same = equivalent(a, b)
    side, index = _differing(a, b)
    return PlanDiff(a, b, False, same, summary_line(a, b, same), index[side == 0], index[side == 1], side, index)


__all__ = ["DEFAULT_DIFF_ROWS", "DIFF_STYLE", "TEXT_HINT", "TEXT_WIDTH", "VIEW_HINT", "PlanDiff", "diff_plans", "equivalent",
           "normalize", "summary_line"]
