"""explain(), HTML, rich and statistics views of a plan."""
from __future__ import annotations

import json
from html.parser import HTMLParser

import numpy as np
import pytest

from kvxfer.planner import (
    BlockMapping,
    Buffer,
    Layout,
    Placement,
    PlanError,
    PlanOptions,
    Region,
    Target,
    hip_version,
    plan_transfer,
    presets,
)
from kvxfer.planner.render import explain, header_rows, run_length_histogram, stats, stats_frame, to_html, to_rich

from .notebook import cell_html

ROCM716 = Target(platform="rocm", runtime_version=hip_version(7, 16))


@pytest.fixture
def small():
    """2 regions x 16 blocks of 4 KiB; a run of 4 (0..3 -> 4..7) and a single (9 -> 2); calls of 3."""
    layout = presets.kv_layout(2, 16, 4096)
    mapping = BlockMapping(direction="h2d", src_ids=[0, 1, 2, 3, 9], dst_ids=[4, 5, 6, 7, 2])
    return layout, plan_transfer(layout, mapping, ROCM716, PlanOptions(max_descriptors=3))


SMALL_EXPLAIN = """\
TransferPlan(h2d rocm-7.16: 10 -> 4 ranges, 2 calls, 40.0 KiB)
  plan     h2d rocm-7.16 via hipMemcpyBatchAsync
  gates    hip>=7.1 batch: yes | hip>=7.13 attrs: yes | hip>=7.16 prefer-ce: yes
  options  max_descriptors=3 (cap 3)
  attrs    passed (numAttrs per call: 1 x2)
    [0]    any host->dev0 flags 0x100
  buffers  3 (1 host, 2 device; 3 used), 2 regions
  copies   10 requested -> 4 ranges (merge 2.50x)
  bytes    40.0 KiB (40960 B)
  calls    2: 3, 1 ranges
  range    min 4.0 KiB, median 10.0 KiB, max 16.0 KiB
  blocks   of 4.0 KiB: 1 x2, 4 x2

 call  #  source      destination    bytes  blocks  region
    0  0  cpu:36864   gpu.kv0:8192    4096       1  kv0
    0  1  cpu:0       gpu.kv0:16384  16384       4  kv0
    0  2  cpu:102400  gpu.kv1:8192    4096       1  kv1
    1  3  cpu:65536   gpu.kv1:16384  16384       4  kv1
"""


def test_explain_pinned(small):
    _, plan = small
    assert plan.explain() == SMALL_EXPLAIN
    assert explain(plan, ranges=False) == SMALL_EXPLAIN.split("\n\n")[0] + "\n"


def test_explain_is_deterministic_across_equal_plans(small):
    layout, plan = small
    again = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[9, 3, 2, 1, 0], dst_ids=[2, 7, 6, 5, 4]),
                          ROCM716, PlanOptions(max_descriptors=3))
    assert again.explain() == plan.explain()


def test_explain_elides_the_middle_with_a_count():
    plan = plan_transfer(presets.kv_layout(118, 512), presets.mapping("runs8", 256, 512), ROCM716)
    text = plan.explain(max_rows=6)
    table = text.split("\n\n")[1].splitlines()
    assert table[0].split() == ["call", "#", "source", "destination", "bytes", "blocks", "region"]
    assert [int(r.split()[1]) for r in table[1:4] + table[5:]] == [0, 1, 2, 3773, 3774, 3775]
    assert table[4].strip() == f"... {plan.num_ranges - 6} ranges not shown (full=True shows all) ..."
    full = plan.explain(full=True).split("\n\n")[1].splitlines()
    assert len(full) == plan.num_ranges + 1
    end = full[0].index("blocks") + len("blocks")  # fixed width: numeric columns end where their header ends
    assert all(line[end - 1].isdigit() and line[end] == " " for line in full[1:])
    assert repr(plan) == "TransferPlan(h2d rocm-7.16: 30208 -> 3776 ranges, 1 call, 944.0 MiB)"


def test_explain_rejects_bad_max_rows(small):
    with pytest.raises(PlanError, match="max_rows"):
        small[1].explain(max_rows=1)


def test_block_counts_use_each_regions_page_with_a_layout():
    layout = Layout(buffers=(Buffer(name="h", nbytes=1 << 20, location="host"), Buffer(name="d", nbytes=1 << 20)),
                    regions=(Region(name="k", page_bytes=4096, device=Placement(buffer="d"),
                                    host=Placement(buffer="h")),
                             Region(name="v", page_bytes=1024, device=Placement(buffer="d", byte_offset=1 << 19),
                                    host=Placement(buffer="h", byte_offset=1 << 19))))
    plan = plan_transfer(layout, BlockMapping(direction="h2d", src_ids=[0, 1], dst_ids=[0, 1]), ROCM716)
    rows = {r.split()[-1]: r.split() for r in plan.explain(layout=layout).split("\n\n")[1].splitlines()[1:]}
    assert rows["k"][5] == "2" and rows["v"][5] == "2"
    assert "blocks   per region page: 2 x2" in plan.explain(layout=layout)
    # without the layout, the plan's own region_page_bytes give the same exact counts
    assert run_length_histogram(plan) == {2: 2}
    with pytest.raises(PlanError, match="layout.regions"):
        plan.explain(layout=presets.kv_layout(3, 16, 4096))


def test_per_range_api_says_how_many_driver_calls():
    plan = plan_transfer(presets.kv_layout(2, 16, 4096), presets.mapping("fragmented", 4, 16),
                         Target(platform="cuda", runtime_version=12040))
    assert "calls    1: 8 ranges (cuMemcpyAsync per range: 8 driver calls)" in plan.explain()


class _Tables(HTMLParser):
    """Collects the text of every table cell, per table and row; counts tags."""

    def __init__(self):
        super().__init__()
        self.tables, self.tags, self._cell = [], [], None

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell += data


def _parse(html: str) -> _Tables:
    p = _Tables()
    p.feed(html)
    p.close()
    return p


def test_html_has_the_explain_content(small):
    layout, plan = small
    parsed = _parse(cell_html(plan))
    assert "script" not in parsed.tags
    header, ranges = parsed.tables
    assert [tuple(r) for r in header] == [(k.strip(), v) for k, v in header_rows(plan)]
    text_rows = [line.split() for line in SMALL_EXPLAIN.split("\n\n")[1].splitlines()]
    assert [r for r in ranges] == text_rows


def test_html_escapes_names_and_elides():
    layout = Layout(buffers=(Buffer(name="<h&>", nbytes=1 << 16, location="host"), Buffer(name="d", nbytes=1 << 16)),
                    regions=(Region(name="<r>", page_bytes=256, device=Placement(buffer="d"),
                                    host=Placement(buffer="<h&>")),))
    plan = plan_transfer(layout, presets.mapping("fragmented", 20, 64), ROCM716)
    html = to_html(plan, max_rows=4)
    assert "<h&>" not in html and "&lt;h&amp;&gt;" in html
    ranges = _parse(html).tables[1]
    assert len(ranges) == 1 + 4 + 1
    assert ranges[3] == ["... 16 ranges not shown (plan.explain(full=True) shows all) ..."]  # what works in a notebook
    assert ranges[1][2].startswith("<h&>:")  # parsed back to the original name
    assert len(_parse(to_html(plan, full=True)).tables[1]) == 21


def test_rich_rendering_matches_the_header_and_rows(small):
    from rich.console import Console

    _, plan = small
    console = Console(record=True, width=200)
    console.print(plan)  # __rich__
    out = console.export_text()
    for _, value in header_rows(plan):
        assert value in out
    assert "gpu.kv1:16384" in out and "cpu:102400" in out
    console = Console(record=True, width=200)
    console.print(to_rich(plan, max_rows=2))
    assert "2 ranges not shown" in console.export_text()


def test_stats_agree_with_a_loop_over_ranges():
    plan = plan_transfer(presets.kv_layout(3, 64, 4096), presets.mapping("interleaved", 20, 64), ROCM716,
                         PlanOptions(max_descriptors=5))
    s = stats(plan)
    assert json.loads(json.dumps(s)) is not None  # JSON-ready
    per_region: dict[str, list[int]] = {}
    per_call: list[int] = []
    for sl in plan.calls():
        per_call.append(sum(int(x) for x in plan.nbytes[sl]))
    for i in range(plan.num_ranges):
        e = per_region.setdefault(plan.regions[plan.region[i]], [0, 0])
        e[0] += 1
        e[1] += int(plan.nbytes[i])
    assert s["per_region"] == {k: {"ranges": v[0], "bytes": v[1]} for k, v in per_region.items()}
    assert s["bytes_per_call"] == per_call and s["call_sizes"] == [5] * (plan.num_ranges // 5) + (
        [plan.num_ranges % 5] if plan.num_ranges % 5 else [])
    assert s["total_bytes"] == 20 * 3 * 4096 and s["requested_copies"] == 60
    assert s["merge_ratio"] == 60 / plan.num_ranges
    hist = s["run_length_histogram"]
    assert sum(k * v for k, v in hist.items()) == 60 and sum(hist.values()) == plan.num_ranges
    big, little = s["largest_range"], s["smallest_range"]
    assert big["nbytes"] == int(plan.nbytes.max()) and little["nbytes"] == int(plan.nbytes.min())
    assert plan.nbytes[big["index"]] == big["nbytes"] and plan.dst_offset[big["index"]] == big["dst_offset"]
    cpu = s["per_buffer"]["cpu"]
    assert cpu == {"src_ranges": plan.num_ranges, "src_bytes": 60 * 4096, "dst_ranges": 0, "dst_bytes": 0}
    assert plan.stats() == s


def test_stats_of_an_empty_plan():
    plan = plan_transfer(presets.kv_layout(2, 8, 4096), BlockMapping(direction="h2d", src_ids=[], dst_ids=[]))
    s = stats(plan)
    assert s["ranges"] == 0 and s["merge_ratio"] is None and s["largest_range"] is None and s["per_region"] == {}
    assert "calls    none" in plan.explain() and plan.explain().count("\n\n") == 0


def test_stats_frames():
    pd = pytest.importorskip("pandas", reason="pandas is in the dev extra")
    plan = plan_transfer(presets.kv_layout(3, 64, 4096), presets.mapping("runs8", 16, 64), ROCM716)
    regions = stats_frame(plan, "region")
    assert list(regions.index) == ["kv0", "kv1", "kv2"] and regions["bytes"].sum() == plan.total_bytes
    assert stats_frame(plan, "buffer").loc["cpu", "src_ranges"] == plan.num_ranges
    assert stats_frame(plan, "call")["ranges"].tolist() == plan.call_sizes.tolist()
    ranges = stats_frame(plan, "range")
    assert isinstance(ranges, pd.DataFrame) and len(ranges) == plan.num_ranges
    assert np.array_equal(ranges["nbytes"].to_numpy(), plan.nbytes) and set(ranges["blocks"]) == {8.0}
    with pytest.raises(PlanError, match="by"):
        stats_frame(plan, "nope")


def test_views_import_no_heavy_or_device_modules():
    import subprocess
    import sys

    code = ("import sys, kvxfer.planner.render, kvxfer.planner.diff, kvxfer.planner.golden, kvxfer.planner.viz; "
            "print(sorted(m for m in ('pandas', 'matplotlib', 'rich', 'torch', 'pytest', 'cuda') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
