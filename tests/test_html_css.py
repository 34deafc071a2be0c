"""The HTML views keep their alignment inside JupyterLab: kvxfer's table rules outrank JupyterLab's on specificity.

JupyterLab's table rules are written out below as facts (from @jupyterlab/rendermime, style/base.css); where
nbconvert's lab template is installed, JupyterLab's whole stylesheet as it ships there is checked too. A small
cascade resolves, per element of kvxfer's markup, the value each property gets, with kvxfer's stylesheet placed
both before and after JupyterLab's, so only specificity can make kvxfer's rules win.
"""
from __future__ import annotations

import re
from html.parser import HTMLParser
from pathlib import Path

import pytest

from kvxfer.planner import Target, hip_version, plan_transfer, presets
from kvxfer.planner.diff import diff_plans

from .notebook import cell_html

# (selector, declarations) of JupyterLab's rendered-HTML table rules that touch what kvxfer styles.
JUPYTERLAB_RULES = [
    (".jp-RenderedHTMLCommon table", {"border-collapse": "collapse", "table-layout": "fixed",
                                      "margin-left": "auto", "margin-right": "auto", "margin-bottom": "1em"}),
    (".jp-RenderedHTMLCommon td", {"vertical-align": "middle", "padding": "0.5em", "white-space": "normal"}),
    (".jp-RenderedHTMLCommon th", {"vertical-align": "middle", "padding": "0.5em", "white-space": "normal"}),
    (".jp-RenderedHTMLCommon tr", {"vertical-align": "middle", "padding": "0.5em", "white-space": "normal"}),
    (":not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td", {"text-align": "right"}),
    (":not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon th", {"text-align": "right"}),
    (":not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon tr", {"text-align": "right"}),
    (".jp-RenderedHTMLCommon th", {"font-weight": "bold"}),
    (".jp-RenderedHTMLCommon tbody tr:nth-child(odd)", {"background": "var(--jp-layout-color0)"}),
    (".jp-RenderedHTMLCommon tbody tr:nth-child(even)", {"background": "var(--jp-rendermime-table-row-background)"}),
    (".jp-RenderedHTMLCommon tbody tr:hover", {"background": "var(--jp-rendermime-table-row-hover-background)"}),
]
# The output area kvxfer's HTML is placed in (a code cell's output, not Markdown).
OUTPUT_AREA = ("div", frozenset({"jp-RenderedHTMLCommon", "jp-RenderedHTML", "jp-OutputArea-output"}))
SIDES = ("top", "right", "bottom", "left")

_COMPOUND = re.compile(r"(?P<tag>[a-zA-Z][\w-]*|\*)?(?P<rest>(?:[.#][\w-]+|\[[^\]]*\]|::?[\w-]+(?:\([^)]*\))?)*)")
_PART = re.compile(r"[.#][\w-]+|\[[^\]]*\]|::?[\w-]+(?:\([^)]*\))?")


def _sides(value: str) -> tuple[str, str, str, str]:
    """A 1-4 value box shorthand as (top, right, bottom, left)."""
    v = value.split()
    top = v[0]
    right = v[1] if len(v) > 1 else top
    bottom = v[2] if len(v) > 2 else top
    return top, right, bottom, v[3] if len(v) > 3 else right


def specificity(selector: str) -> tuple[int, int, int]:
    """(ids, classes + attributes + pseudo-classes, types + pseudo-elements) of a selector; ``:not(x)`` counts
    as ``x`` (Selectors Level 4)."""
    ids = classes = types = 0
    for compound in selector.split():
        m = _COMPOUND.fullmatch(compound)
        assert m, f"selector part not understood by this test: {compound!r}"
        types += bool(m["tag"]) and m["tag"] != "*"
        for part in _PART.findall(m["rest"]):
            if part.startswith(":not("):
                i, c, t = specificity(part[5:-1])
                ids, classes, types = ids + i, classes + c, types + t
            elif part.startswith("#"):
                ids += 1
            elif part.startswith("::"):
                types += 1
            else:
                classes += 1
    return ids, classes, types


def _matches_compound(compound: str, tag: str, classes: frozenset[str]) -> bool:
    m = _COMPOUND.fullmatch(compound)
    if m["tag"] and m["tag"] not in ("*", tag):
        return False
    for part in _PART.findall(m["rest"]):
        if part.startswith(":not("):
            if _matches_compound(part[5:-1], tag, classes):
                return False
        elif part.startswith(".") and part[1:] not in classes:
            return False
        # other pseudo-classes (:nth-child, :hover) may hold: assume they do (the strictest case for kvxfer)
    return True


def matches(selector: str, path: list[tuple[str, frozenset[str]]]) -> bool:
    """Whether ``selector`` (compounds joined by descendant combinators) matches the last element of ``path``."""
    *ancestors, last = selector.split()
    if not _matches_compound(last, *path[-1]):
        return False
    i = len(path) - 2
    for compound in reversed(ancestors):
        while i >= 0 and not _matches_compound(compound, *path[i]):
            i -= 1
        if i < 0:
            return False
        i -= 1
    return True


def parse_css(css: str) -> tuple[list[tuple[str, dict[str, str]]], list[str]]:
    """Top-level rules of a stylesheet as (selector, declarations), one entry per selector of a selector list,
    and the selectors this test cannot read (combinators other than descendant, odd syntax). @-rules
    (media queries, keyframes, font faces) are skipped."""
    css = re.sub(r"/\*.*?\*/", "", re.sub(r"^\s*<style>|</style>\s*$", "", css), flags=re.S)
    rules, unread, pos = [], [], 0
    while (brace := css.find("{", pos)) >= 0:
        depth, end = 1, brace + 1
        while depth:
            depth += {"{": 1, "}": -1}.get(css[end], 0)
            end += 1
        head, body, pos = css[pos:brace].strip(), css[brace + 1:end - 1], end
        if head.startswith("@"):
            continue
        decls = {}
        body = re.sub(r"[^;{}]*\{[^{}]*\}", "", body)  # nested rules (CSS nesting): not read
        for decl in (x.strip() for x in body.split(";")):
            if ":" not in decl:
                continue
            prop, value = (x.strip() for x in decl.split(":", 1))
            if prop == "margin":  # the one per-side shorthand that matters here
                decls |= {f"margin-{side}": x for side, x in zip(SIDES, _sides(value))}
            else:
                decls[prop] = value
        for sel in (x.strip() for x in head.split(",")):
            readable = all(_COMPOUND.fullmatch(c) for c in sel.split())
            (rules.append((sel, decls)) if readable else unread.append(sel))
    return rules, unread


def parse_style(css: str) -> list[tuple[str, dict[str, str]]]:
    rules, unread = parse_css(css)
    assert not unread, f"selectors this test cannot read: {unread}"
    return rules


def resolve(path, sheets) -> dict[str, str]:
    """The cascade for one element: per property, the declaration of highest specificity, later sheets and
    rules winning ties. ``sheets`` are in document order."""
    best: dict[str, tuple[tuple, int, str]] = {}
    order = 0
    for rules in sheets:
        for selector, decls in rules:
            order += 1
            if not matches(selector, path):
                continue
            for prop, value in decls.items():
                key = (specificity(selector), order)
                if prop not in best or key > best[prop][:2]:
                    best[prop] = (*key, value)
    return {p: v for p, (_, _, v) in best.items()}


class _Elements(HTMLParser):
    """Every element of an HTML fragment as its path of (tag, classes), with tbody inserted as browsers do."""

    def __init__(self):
        super().__init__()
        self.stack: list[tuple[str, frozenset[str]]] = [("html", frozenset()), ("body", frozenset()), OUTPUT_AREA]
        self.paths: list[list[tuple[str, frozenset[str]]]] = []

    def handle_starttag(self, tag, attrs):
        if tag == "tr" and self.stack[-1][0] == "table":
            self._push("tbody", frozenset())
        self._push(tag, frozenset((dict(attrs).get("class") or "").split()))

    def _push(self, tag, classes):
        self.stack.append((tag, classes))
        self.paths.append(list(self.stack))

    def handle_endtag(self, tag):
        while self.stack and self.stack[-1][0] != tag:
            self.stack.pop()  # implied ends (the tbody inserted above)
        if self.stack:
            self.stack.pop()
        if tag == "table" and self.stack[-1][0] == "tbody":
            self.stack.pop()


def elements(html: str) -> list[list[tuple[str, frozenset[str]]]]:
    p = _Elements()
    p.feed(html)
    return p.paths


def test_specificity_counts_like_the_selectors_spec():
    assert specificity(".jp-RenderedHTMLCommon td") == (0, 1, 1)
    assert specificity(":not(.jp-RenderedMarkdown).jp-RenderedHTMLCommon td") == (0, 2, 1)
    assert specificity(".jp-RenderedHTMLCommon tbody tr:nth-child(odd)") == (0, 2, 2)
    assert specificity("#a .b::before") == (1, 1, 1)


def test_the_old_rules_lose_to_jupyterlab():
    """The regression: ``.kvxfer td{text-align:left}`` is outranked, and cells come out right-aligned."""
    old = parse_style("<style>.kvxfer td,.kvxfer th{text-align:left}</style>")
    td = [p for p in elements('<div class="kvxfer"><table><tr><td>x</td></tr></table></div>') if p[-1][0] == "td"][0]
    assert resolve(td, [old, JUPYTERLAB_RULES])["text-align"] == "right"


def _views():
    target = Target(platform="rocm", runtime_version=hip_version(7, 16))
    layout = presets.kv_layout(2, 64, 4096)
    a = plan_transfer(layout, presets.mapping("runs8", 24, 64), target)
    b = plan_transfer(layout, presets.mapping("fragmented", 24, 64), target)
    return {"plan": cell_html(a), "diff": diff_plans(a, b).to_html()}


def check_views_win(html: str, jupyterlab: list[tuple[str, dict[str, str]]]) -> None:
    ours = parse_style(re.search(r"<style>.*?</style>", html, re.S)[0])
    cells = [p for p in elements(html) if p[-1][0] in ("td", "th")]
    tables = [p for p in elements(html) if p[-1][0] == "table"]
    assert cells and tables
    for sheets in ([ours, jupyterlab], [jupyterlab, ours]):  # either order: specificity decides
        for path in cells:
            got = resolve(path, sheets)
            numeric = "n" in path[-1][1]
            assert got["text-align"] == ("right" if numeric else "left"), (path[-1], got)
            assert got["padding"] == "1px 8px" and got["white-space"] == "nowrap"
        for path in tables:
            got = resolve(path, sheets)
            assert (got["margin-left"], got["margin-right"], got["table-layout"]) == ("0", "0", "auto")


@pytest.mark.parametrize("view", ["plan", "diff"])
def test_kvxfer_rules_win_over_jupyterlabs_table_rules_on_specificity(view):
    check_views_win(_views()[view], JUPYTERLAB_RULES)


def _lab_stylesheet() -> Path | None:
    """JupyterLab's stylesheet as nbconvert's lab template ships it (nbconvert is in the dev extra)."""
    try:
        import nbconvert
        from jupyter_core.paths import jupyter_path
    except ImportError:
        return None
    # jupyter's search path, and the data folder of the environment nbconvert is installed in (a venv layered
    # over another one finds its templates there)
    beside = Path(nbconvert.__file__).parents[4] / "share" / "jupyter" / "nbconvert" / "templates"
    for root in [*jupyter_path("nbconvert", "templates"), str(beside)]:
        css = Path(root) / "lab" / "static" / "index.css"
        if css.is_file():
            return css
    return None


@pytest.mark.parametrize("view", ["plan", "diff"])
def test_kvxfer_rules_win_over_the_whole_jupyterlab_stylesheet(view):
    css = _lab_stylesheet()
    if css is None:
        pytest.skip("nbconvert's lab template (JupyterLab's stylesheet) is not installed: pip install 'kvxfer[dev]'")
    rules, unread = parse_css(css.read_text())
    table_rules = [sel for sel, _ in rules if re.search(r"\b(table|td|th|tr)\b", sel.split()[-1])]
    assert len(table_rules) >= 10, "JupyterLab's table rules were not found in the stylesheet"
    # a table rule this test cannot read would escape the check: there must be none
    assert not [sel for sel in unread if re.search(r"\b(table|td|th|tr)\b", re.split(r"[\s>+~]+", sel)[-1])]
    check_views_win(_views()[view], rules)


# ---- colours: JupyterLab's theme variables, so the views stay legible on dark themes ----------------------
COLOUR_PROPS = ("color", "background", "background-color", "border-color")
VAR_WITH_FALLBACK = re.compile(r"var\((--jp-[\w-]+),\s*(#[0-9a-fA-F]{3,8}|[a-z]+)\)")


def _colours(html: str) -> list[tuple[str, str, str]]:
    """(selector, property, value) of every colour the view's stylesheet sets."""
    rules = parse_style(re.search(r"<style>.*?</style>", html, re.S)[0])
    return [(sel, prop, value) for sel, decls in rules for prop, value in decls.items() if prop in COLOUR_PROPS]


@pytest.mark.parametrize("view", ["plan", "diff"])
def test_every_colour_is_a_jupyterlab_theme_variable_with_a_fallback(view):
    colours = _colours(_views()[view])
    assert colours, "the view sets no colour (this test would check nothing)"
    for sel, prop, value in colours:
        assert VAR_WITH_FALLBACK.fullmatch(value), f"{sel} {{{prop}: {value}}} is not var(--jp-..., fallback)"


def test_the_diff_colours_are_the_themes_error_and_success_colours():
    found = {sel.split()[-1]: VAR_WITH_FALLBACK.fullmatch(v)[1] for sel, _, v in _colours(_views()["diff"])}
    assert found["tr.removed"] == "--jp-error-color1" and found["tr.added"] == "--jp-success-color1"


def test_the_variables_are_defined_by_jupyterlabs_light_and_dark_themes():
    css = _lab_stylesheet()
    if css is None:
        pytest.skip("nbconvert's lab template (JupyterLab's themes) is not installed: pip install 'kvxfer[dev]'")
    used = {VAR_WITH_FALLBACK.fullmatch(v)[1] for view in _views().values() for _, _, v in _colours(view)}
    for theme in ("theme-light.css", "theme-dark.css"):
        text = (css.parent / theme).read_text()
        assert not [v for v in used if f"{v}:" not in text], f"{theme} lacks a variable kvxfer uses"
