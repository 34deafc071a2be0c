"""The bad-input catalogue: every row is an input that must be refused with the library's own error type and
a message naming the mistake, before any destination byte changes.

Each row's ``act(env)`` goes as far as a user would: build the values (or load the file), plan, and run the
plan with the NumPy executor into sentinel buffers. The row passes when ``act`` raises ``error`` with
``fragment`` in its message and every sentinel byte is unchanged. CLI rows run the real entry point
(``kvxfer.cli.main.main``): exit 2, one line of stderr (or one line per problem), no traceback, and no file
in the folder rewritten.
"""
from __future__ import annotations

import copy
import io
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvxfer.executors import NumpyExecutor
from kvxfer.planner import (
    COLUMNS,
    BlockMapping,
    Buffer,
    Case,
    Layout,
    LayoutError,
    Location,
    MappingError,
    Placement,
    PlanError,
    PlanFileError,
    PlanOptions,
    Region,
    Target,
    TargetError,
    TransferPlan,
    golden,
    plan_transfer,
    presets,
)

from .offload_bad_inputs import ROWS as OFFLOAD_ROWS
from .vllm_bad_inputs import ROWS as VLLM_ROWS

LAYOUT = presets.kv_layout(2, 16, 64)
MAPPING = presets.mapping("runs8", 8, 16)
CASE = Case(layout=LAYOUT, mapping=MAPPING, target=Target(platform="cuda", runtime_version="13.0"))
PLAN = CASE.plan()


@dataclass
class Env:
    """What a row acts on: sentinel buffers for LAYOUT and a folder of files."""

    bufs: dict[str, np.ndarray]
    folder: Path

    def run(self, plan: TransferPlan) -> None:
        NumpyExecutor().run(plan, self.bufs)

    def write(self, name: str, content: Any) -> Path:
        path = self.folder / name
        if isinstance(content, bytes):
            path.write_bytes(content)
        else:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        return path


@dataclass(frozen=True)
class Bad:
    name: str
    act: Callable[[Env], Any]
    error: type[BaseException]
    fragment: str


CLI_EXIT = SystemExit  # CLI rows: exit status 2, checked with stderr below


# ---- building blocks ---------------------------------------------------------------------------------------
def _torch_over_bytes(n: int) -> Any:
    """A CPU tensor whose storage is an immutable ``bytes`` object (torch warns that it is not writable)."""
    import warnings

    torch = pytest.importorskip("torch")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.frombuffer(bytes(n), dtype=torch.uint8)


def layout_with(path: str, value: Any) -> Callable[[Env], Any]:
    """Replace one field of LAYOUT's JSON form (``regions.0.page_bytes``), plan and run."""
    def act(env: Env) -> None:
        d = LAYOUT.model_dump(mode="json")
        *parents, last = path.split(".")
        node = d
        for p in parents:
            node = node[int(p)] if p.isdigit() else node[p]
        node[int(last) if last.isdigit() else last] = value
        env.run(plan_transfer(Layout.model_validate(d), MAPPING))
    return act


def mapping(**kw: Any) -> Callable[[Env], Any]:
    def act(env: Env) -> None:
        fields = {"direction": "h2d", "src_ids": MAPPING.src_ids, "dst_ids": MAPPING.dst_ids} | kw
        env.run(plan_transfer(LAYOUT, BlockMapping(**fields)))
    return act


def target(**kw: Any) -> Callable[[Env], Any]:
    return lambda env: env.run(plan_transfer(LAYOUT, MAPPING, Target(**kw)))


def options(**kw: Any) -> Callable[[Env], Any]:
    return lambda env: env.run(plan_transfer(LAYOUT, MAPPING, options=PlanOptions(**kw)))


def plan_dict(change: Callable[[dict[str, Any]], Any]) -> dict[str, Any]:
    d = copy.deepcopy(PLAN.to_dict())
    d.pop("fingerprint")
    change(d)
    return d


def plan_file(change: Callable[[dict[str, Any]], Any]) -> Callable[[Env], Any]:
    return lambda env: env.run(TransferPlan.load(env.write("plan.json", plan_dict(change))))


def col(name: str, i: int, value: Any) -> Callable[[dict[str, Any]], Any]:
    return lambda d: d["columns"][name].__setitem__(i, value)


def npz(change: Callable[[dict[str, np.ndarray]], Any] | None = None, data: bytes | None = None) -> Callable[[Env], Any]:
    def act(env: Env) -> None:
        raw = PLAN.to_npz_bytes() if data is None else data
        if change is not None:
            with np.load(io.BytesIO(raw)) as z:
                members = {k: z[k] for k in z.files}
            change(members)
            out = io.BytesIO()
            np.savez(out, **members)
            raw = out.getvalue()
        env.run(TransferPlan.load(env.write("plan.npz", raw)))
    return act


def case_file(content: Any) -> Callable[[Env], Any]:
    return lambda env: env.run(Case.load(env.write("case.json", content)).plan())


def case_with(section: str, **kw: Any) -> dict[str, Any]:
    d = CASE.to_dict()
    d[section] = {**d[section], **kw}
    return d


def golden_file(change: Callable[[dict[str, Any]], Any]) -> Callable[[Env], Any]:
    def act(env: Env) -> None:
        d = json.loads(golden.dumps(CASE))
        change(d)
        env.run(golden.load(env.write("g.json", d)).plan)
    return act


def cli(*args: str, files: dict[str, Any] | None = None) -> Callable[[Env], Any]:
    """Run ``kvxfer ARGS`` in-process; names in ARGS that are keys of ``files`` become written files."""
    def act(env: Env) -> None:
        from kvxfer.cli.main import main

        paths = {name: str(env.write(name, content)) for name, content in (files or {}).items()}
        main([paths.get(a, a) for a in args])
    return act


def broken_golden(d: dict[str, Any]) -> None:
    d["plan"]["ranges"][0][1] = 1.5


def built_plan(column: str, value: Any, index: int = 1) -> Callable[[Env], Any]:
    """Build PLAN again by hand with one value of ``column`` (or ``call_offsets``) changed, and run it."""
    def act(env: Env) -> None:
        cols = {c: PLAN.column(c).tolist() for c in COLUMNS}
        offsets = PLAN.call_offsets.tolist()
        (offsets if column == "call_offsets" else cols[column])[index] = value
        env.run(TransferPlan(direction=PLAN.direction, target=PLAN.target, options=PLAN.options, buffers=PLAN.buffers,
                             regions=PLAN.regions, attrs=PLAN.attrs, requested_copies=PLAN.requested_copies,
                             call_offsets=offsets, columns=cols))
    return act


def plan_with(**fields: Any) -> Callable[[Env], Any]:
    """Build PLAN again by hand with ``fields`` of the constructor replaced (``columns`` merged), and run it."""
    def act(env: Env) -> None:
        kw: dict[str, Any] = dict(direction=PLAN.direction, target=PLAN.target, options=PLAN.options,
                                  buffers=PLAN.buffers, regions=PLAN.regions, attrs=PLAN.attrs,
                                  requested_copies=PLAN.requested_copies, call_offsets=PLAN.call_offsets.tolist())
        cols = {c: PLAN.column(c).tolist() for c in COLUMNS} | fields.pop("columns", {})
        env.run(TransferPlan(**kw, columns=cols, **fields))
    return act


def chunked_mapping(s: list[int], d: list[int]) -> Callable[[Env], Any]:
    """A dict of numpy ids (the hot path) on a layout whose host side holds chunks of 2 blocks, planned and run
    on sentinel buffers of its own."""
    def act(env: Env) -> None:
        layout = presets.chunked_layout(2, 8, 64, blocks_per_chunk=2)
        bufs = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
        mapping = {"direction": "h2d", "src_ids": np.array(s), "dst_ids": np.array(d), "group_sizes": [len(d)]}
        NumpyExecutor().run(plan_transfer(layout, mapping), bufs)
    return act


def one_buffer_store() -> Callable[[Env], Any]:
    """A store writing X[48, 144) while one copy reads X[0, 96) and a later-starting one X[10, 20)."""
    def act(env: Env) -> None:
        layout = Layout(buffers=[Buffer(name="X", nbytes=500, location=Location.HOST)], regions=[
            Region(name=f"r{r}", page_bytes=p, device=Placement(buffer="X", byte_offset=a),
                   host=Placement(buffer="X", byte_offset=b))
            for r, (p, a, b) in enumerate(((96, 0, 300), (96, 200, 48), (10, 10, 400)))])
        plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0]))
    return act


def writes_across_buffers() -> Callable[[Env], Any]:
    """a writes X[0, 100) and b X[50, 150), with c's write to Y[20, 30) between their offsets."""
    def act(env: Env) -> None:
        layout = Layout(buffers=[Buffer(name="X", nbytes=200, location=Location.HOST),
                                 Buffer(name="Y", nbytes=200, location=Location.HOST),
                                 *(Buffer(name=f"g{r}", nbytes=1000) for r in range(3))],
                        regions=[Region(name=name, page_bytes=page, device=Placement(buffer=f"g{r}"),
                                        host=Placement(buffer=buf, byte_offset=off))
                                 for r, (name, page, buf, off) in enumerate((("a", 100, "X", 0), ("b", 100, "X", 50),
                                                                             ("c", 10, "Y", 20)))])
        plan_transfer(layout, BlockMapping(direction="d2h", src_ids=[0], dst_ids=[0]))
    return act


def golden_folder_with(record: bytes, *args: str) -> Callable[[Env], Any]:
    """``kvxfer golden check`` (and ``args``) on a folder holding one golden file and the used-files record."""
    def act(env: Env) -> None:
        from kvxfer.cli.main import main

        env.write("g.json", golden.dumps(CASE))
        env.write(golden.USED_RECORD, record)
        main(["golden", "check", str(env.folder), *args])
    return act


def bench_out(where: str) -> Callable[[Env], Any]:
    """``kvxfer bench --quick --out`` a path under the folder (``where``: relative to it)."""
    def act(env: Env) -> None:
        from kvxfer.cli.main import main

        main(["bench", "--quick", "--out", str(env.folder / where)])
    return act


CASE_JSON = CASE.to_dict()
NPZ = PLAN.to_npz_bytes()
DEEP_JSON = '{"kind": ' + "[" * 100_000 + "]" * 100_000 + "}"

CATALOGUE: list[Bad] = [
    # ---- layouts ------------------------------------------------------------------------------------------
    Bad("buffer of zero bytes", layout_with("buffers.0.nbytes", 0), LayoutError, "greater than 0"),
    Bad("buffer of negative bytes", layout_with("buffers.0.nbytes", -64), LayoutError, "buffers[0].nbytes"),
    Bad("buffer size given as a bool", layout_with("buffers.0.nbytes", True), LayoutError, "got bool"),
    Bad("buffer size given as a float", layout_with("buffers.0.nbytes", 2048.0), LayoutError, "got float"),
    Bad("buffer size given as a word", layout_with("buffers.0.nbytes", "2 KiB"), LayoutError, "buffers[0].nbytes"),
    Bad("buffer size past int64", layout_with("buffers.0.nbytes", 2**63), LayoutError, "buffers[0].nbytes"),
    Bad("buffer without a name", layout_with("buffers.0.name", ""), LayoutError, "buffers[0].name"),
    Bad("page size given as a bool", layout_with("regions.0.page_bytes", True), LayoutError, "got bool"),
    Bad("page of zero bytes", layout_with("regions.0.page_bytes", 0), LayoutError, "page_bytes"),
    Bad("placement in an unknown buffer", layout_with("regions.0.device.buffer", "gpu.nope"), LayoutError, "gpu.nope"),
    Bad("negative byte offset", layout_with("regions.0.host.byte_offset", -1), LayoutError, "byte_offset"),
    Bad("unknown layout key", layout_with("buffer", []), LayoutError, "unknown key 'buffer' (did you mean 'buffers'?)"),
    Bad("device ordinal negative", layout_with("buffers.1.device", -1), LayoutError, "buffers[1].device"),
    # ---- mappings -----------------------------------------------------------------------------------------
    Bad("block id 2**70", mapping(src_ids=[2**70] * 8), MappingError, "does not fit int64"),
    Bad("block id None", mapping(src_ids=[None] * 8), MappingError, "block ids must be integers"),
    Bad("block ids as a dict", mapping(src_ids={"a": 1}), MappingError, "expected a list or array"),
    Bad("block ids as a generator", mapping(src_ids=(i for i in range(8))), MappingError, "expected a list or array"),
    Bad("block ids None", mapping(dst_ids=None), MappingError, "dst_ids"),
    Bad("fractional block id", mapping(src_ids=[1.5] * 8), MappingError, "src_ids[0] = 1.5"),
    Bad("bool block ids", mapping(src_ids=[True] * 8), MappingError, "must be integers"),
    Bad("negative block id", mapping(src_ids=[-1] + [1] * 7), MappingError, "non-negative"),
    Bad("string block ids", mapping(src_ids=["1"] * 8), MappingError, "must be integers"),
    Bad("two-dimensional ids", mapping(src_ids=[[1]] * 8), MappingError, "one-dimensional"),
    Bad("id lists of unequal length", mapping(dst_ids=[0, 1]), MappingError, "equal length"),
    Bad("unknown direction", mapping(direction="sideways"), MappingError, "direction"),
    Bad("block id past the pool", mapping(src_ids=[99] * 8), PlanError, "99"),
    Bad("destination block repeated", mapping(dst_ids=[5] * 8), PlanError, "dst"),
    Bad("typo'd mapping key", mapping(src_id=[1]), MappingError, "unknown key 'src_id' (did you mean 'src_ids'?)"),
    Bad("whole-number float block ids", mapping(src_ids=[float(i) for i in MAPPING.src_ids]), MappingError,
        "src_ids[0] = 0.0: block ids must be integers"),
    Bad("negative zero as a block id", mapping(dst_ids=[0, 1, 2, -0.0, 4, 5, 6, 7]), MappingError,
        "dst_ids[3] = -0.0: block ids must be integers"),
    Bad("float numpy block ids in a dict", lambda env: env.run(plan_transfer(LAYOUT, {
        "direction": "h2d", "src_ids": MAPPING.src_ids.astype(float), "dst_ids": MAPPING.dst_ids})), MappingError,
        "src_ids[0] = 0.0: block ids must be integers"),
    Bad("whole-number float group size", mapping(group_sizes=[8.0]), MappingError, "group_sizes[0] = 8.0: must be an integer"),
    Bad("block id past its placement's block count", layout_with("regions.0.host.num_blocks", 4), MappingError,
        "src_ids[4] = 4: past the 4 blocks of region 'kv0' (host side, buffer 'cpu')"),
    Bad("placement claiming more blocks than its buffer", layout_with("regions.1.device.num_blocks", 17), LayoutError,
        "regions[1].device.num_blocks = 17: block 16 ends at byte 1088, past buffer 'gpu.kv1' of 1024 bytes"),
    # ---- targets ------------------------------------------------------------------------------------------
    Bad("CUDA major as the version", target(platform="cuda", runtime_version=13), TargetError, "1000*major"),
    Bad("HIP 7.2 as 72", target(platform="rocm", runtime_version=72), TargetError, "major*10,000,000"),
    Bad("HIP three-part string", target(platform="rocm", runtime_version="7.2.2"), TargetError, "build number"),
    Bad("version as a float", target(platform="cuda", runtime_version=12.8), TargetError, "floats are ambiguous"),
    Bad("version as a word", target(platform="cuda", runtime_version="latest"), TargetError, "major.minor"),
    Bad("version as a bool", target(platform="cuda", runtime_version=True), TargetError, "got bool"),
    Bad("negative version", target(platform="cuda", runtime_version=-1), TargetError, "runtime_version"),
    Bad("unknown platform", target(platform="tpu"), TargetError, "platform"),
    # ---- options ------------------------------------------------------------------------------------------
    Bad("negative descriptor cap", options(max_descriptors=-1), TargetError, "max_descriptors"),
    Bad("zero-byte range limit", options(max_range_bytes=0), TargetError, "max_range_bytes"),
    Bad("no writers", options(num_writers=0), TargetError, "num_writers"),
    Bad("writer index past the writers", options(num_writers=2, writer_index=2), TargetError, "writer_index"),
    Bad("zero regions per call", options(regions_per_call=0), TargetError, "regions_per_call"),
    Bad("coalesce given as a word", options(coalesce="yes"), TargetError, "expected true or false"),
    Bad("descriptor cap given as a bool", options(max_descriptors=True), TargetError, "got bool"),
    Bad("typo'd option", options(colesce=False), TargetError, "did you mean 'coalesce'"),
    # ---- plan files (JSON) --------------------------------------------------------------------------------
    Bad("float offset", plan_file(col("dst_offset", 0, 1.5)), PlanFileError, "dst_offset[0] = 1.5"),
    Bad("string call offsets", plan_file(lambda d: d.update(call_offsets=[str(x) for x in d["call_offsets"]])),
        PlanFileError, "call_offsets[0]"),
    Bad("float call offsets", plan_file(lambda d: d.update(call_offsets=[float(x) for x in d["call_offsets"]])),
        PlanFileError, "got float"),
    Bad("(n, 1) column", plan_file(lambda d: d["columns"].update(nbytes=[[x] for x in d["columns"]["nbytes"]])),
        PlanFileError, "got list"),
    Bad("region name not a string", plan_file(lambda d: d["regions"].__setitem__(0, 7)), PlanFileError, "strings"),
    Bad("flags past 32 bits", plan_file(lambda d: d["attrs"][0].update(flags=2**40)), PlanFileError, "attrs[0].flags"),
    Bad("negative range size", plan_file(col("nbytes", 0, -64)), PlanFileError, "nbytes[0] = -64"),
    Bad("attribute index past uint16", plan_file(col("attr", 0, 70000)), PlanFileError, "uint16"),
    Bad("buffer index past int32", plan_file(col("dst_buf", 0, 2**31)), PlanFileError, "int32"),
    Bad("range size 2**64", plan_file(col("nbytes", 0, 2**64)), PlanFileError, "uint64"),
    Bad("offsets negative and past int64", plan_file(lambda d: d["columns"].update(src_offset=[-1, 2**63])),
        PlanFileError, "src_offset[0] = -1"),
    Bad("null offset", plan_file(col("src_offset", 0, None)), PlanFileError, "got null"),
    Bad("offset past its buffer", plan_file(col("dst_offset", 0, 10**6)), PlanFileError, "runs past buffer"),
    Bad("attribute index past the table", plan_file(col("attr", 0, 5)), PlanFileError, "attr[0] = 5"),
    Bad("zero-byte range", plan_file(col("nbytes", 0, 0)), PlanFileError, "empty range"),
    Bad("call offsets that fall", plan_file(lambda d: d.update(call_offsets=[0, 5, 3, len(d["columns"]["nbytes"])])),
        PlanFileError, "rise strictly"),
    Bad("passes_attrs as a number", plan_file(lambda d: d.update(passes_attrs=1)), PlanFileError, "expected bool"),
    Bad("buffer size as a bool", plan_file(lambda d: d["buffers"][0].update(nbytes=True)), PlanFileError,
        "buffers[0].nbytes"),
    Bad("unknown copy api", plan_file(lambda d: d.update(api="cudaMemcpy")), PlanFileError, "expected one of"),
    Bad("unknown direction in a plan", plan_file(lambda d: d.update(direction="up")), PlanFileError, "direction"),
    Bad("newer plan schema", plan_file(lambda d: d.update(schema_version=2)), PlanFileError, "plan schema 1"),
    Bad("fingerprint of other content", plan_file(lambda d: d.update(fingerprint="0" * 64)), PlanFileError,
        "does not match"),
    Bad("column missing", plan_file(lambda d: d["columns"].pop("attr")), PlanFileError, "columns.attr"),
    Bad("typo'd plan key", plan_file(lambda d: d.update(region=d.pop("regions"))), PlanFileError,
        "did you mean 'regions'"),
    Bad("top-level JSON list", lambda env: TransferPlan.load(env.write("plan.json", "[1, 2]")), PlanFileError,
        "JSON object"),
    Bad("plan file that is not JSON", lambda env: TransferPlan.load(env.write("plan.json", "{nope")), PlanFileError,
        "not valid JSON"),
    Bad("plan file missing", lambda env: TransferPlan.load(env.folder / "absent.json"), PlanFileError, "no such"),
    # ---- plan files (npz) ---------------------------------------------------------------------------------
    Bad("empty npz", npz(data=b""), PlanFileError, "empty file"),
    Bad("truncated npz", npz(data=NPZ[: len(NPZ) // 2]), PlanFileError, "not a readable .npz"),
    Bad("npz member missing", npz(lambda m: m.pop("attr")), PlanFileError, "member missing"),
    Bad("2-D npz column", npz(lambda m: m.update(nbytes=m["nbytes"].reshape(-1, 1))), PlanFileError, "shape"),
    Bad("float npz column", npz(lambda m: m.update(dst_offset=m["dst_offset"].astype(float))), PlanFileError,
        "float64"),
    Bad("npz header not JSON", npz(lambda m: m.update(header=np.frombuffer(b"{x", np.uint8))), PlanFileError,
        "not valid JSON"),
    # ---- case files ---------------------------------------------------------------------------------------
    Bad("case not JSON", case_file("{"), PlanFileError, "not valid JSON"),
    Bad("case as a list", case_file([CASE_JSON]), PlanFileError, "JSON object"),
    Bad("empty case file", case_file(""), PlanFileError, "not valid JSON"),
    Bad("case with a typo'd key", case_file(case_with("mapping", src_id=[1])), PlanFileError,
        "unknown key 'src_id' (did you mean 'src_ids'?)"),
    Bad("case with three mistakes", case_file({**case_with("options", colesce=1), "layout": {
        **CASE_JSON["layout"], "colour": 1}, "target": {"platform": "cuda", "runtime_version": 13}}), PlanFileError,
        "(and 2 more"),
    Bad("case with a bool page size", case_file({**CASE_JSON, "layout": json.loads(
        json.dumps(CASE_JSON["layout"]).replace('"page_bytes": 64', '"page_bytes": true', 1))}), PlanFileError,
        "got bool"),
    Bad("case with CUDA 13 as 13", case_file(case_with("target", runtime_version=13)), PlanFileError, "13000"),
    Bad("golden file read as a case", lambda env: Case.load(env.write("g.json", golden.dumps(CASE))), PlanFileError,
        "golden file, not a case file"),
    Bad("case not UTF-8", case_file(b"\xff\xfe{}"), PlanFileError, "UTF-8"),
    Bad("case with whole-number float ids", case_file(case_with("mapping", dst_ids=[float(i) for i in MAPPING.dst_ids])),
        PlanFileError, "mapping.dst_ids[0] = 0.0: block ids must be integers"),
    # ---- golden files -------------------------------------------------------------------------------------
    Bad("golden range with a float", golden_file(broken_golden), golden.GoldenError, "got float"),
    Bad("golden columns renamed", golden_file(lambda d: d["plan"].update(range_columns=["a"])), golden.GoldenError,
        "range_columns"),
    Bad("golden file without its version", golden_file(lambda d: d.pop("kvxfer_golden")), golden.GoldenError,
        "not a kvxfer golden file"),
    Bad("golden file from a newer kvxfer", golden_file(lambda d: d.update(kvxfer_golden=99)), golden.GoldenError,
        "newer kvxfer"),
    Bad("golden row too short", golden_file(lambda d: d["plan"]["ranges"].__setitem__(0, [1, 2])),
        golden.GoldenError, "row of 7"),
    # ---- bindings -----------------------------------------------------------------------------------------
    Bad("binding missing", lambda env: NumpyExecutor().run(PLAN, {"cpu": env.bufs["cpu"]}), ValueError, "missing"),
    Bad("binding too small", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": np.zeros(10, np.uint8)}),
        ValueError, "smaller than"),
    Bad("binding read-only", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": np.frombuffer(
        bytes(1024), np.uint8)}), ValueError, "read-only"),
    Bad("binding a string", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": "x" * 1024}), ValueError,
        "bindings['gpu.kv0'] = str: expected a torch tensor, numpy array"),
    Bad("binding immutable bytes", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv1": bytes(1024)}),
        ValueError, "bindings['gpu.kv1'] = bytes: expected a torch tensor, numpy array"),
    Bad("binding a list", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": [0] * 1024}), ValueError,
        "bindings['gpu.kv0'] = list: expected"),
    Bad("binding an object array", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": np.zeros(1024, object)}),
        ValueError, "of dtype object: an array of Python objects holds pointers"),
    Bad("binding a torch tensor over bytes", lambda env: NumpyExecutor().run(PLAN, {**env.bufs, "gpu.kv0": _torch_over_bytes(
        1024)}), ValueError, "read-only"),
    Bad("bindings as a list", lambda env: NumpyExecutor().run(PLAN, list(env.bufs.values())), ValueError, "bindings"),
    # ---- CLI ----------------------------------------------------------------------------------------------
    Bad("kvxfer plan on a list", cli("plan", "l.json", files={"l.json": "[]"}), CLI_EXIT, "JSON object"),
    Bad("kvxfer plan on a missing file", cli("plan", "absent.json"), CLI_EXIT, "no such file"),
    Bad("kvxfer diff on an empty npz", cli("diff", "a.npz", "a.npz", files={"a.npz": b""}), CLI_EXIT, "empty file"),
    Bad("kvxfer diff on a truncated npz", cli("diff", "t.npz", "t.npz", files={"t.npz": NPZ[:200]}), CLI_EXIT,
        "not a readable .npz"),
    Bad("kvxfer run on a float-offset plan", cli("run", "p.json", "-e", "numpy", files={"p.json": plan_dict(
        col("dst_offset", 0, 1.5))}), CLI_EXIT, "dst_offset[0] = 1.5"),
    Bad("kvxfer plan on a typo'd case", cli("plan", "c.json", files={"c.json": case_with("mapping", src_id=[1])}),
        CLI_EXIT, "did you mean 'src_ids'"),
    Bad("kvxfer plan --max-rows lots", cli("plan", "c.json", "--max-rows", "lots", files={"c.json": CASE_JSON}),
        CLI_EXIT, "'all'"),
    Bad("kvxfer plan --json --explain", cli("plan", "c.json", "--json", "--explain", files={"c.json": CASE_JSON}),
        CLI_EXIT, "choose one"),
    Bad("kvxfer diff on a broken golden", cli("diff", "g.json", "c.json", files={
        "g.json": golden.dumps(CASE).replace('"nbytes": 1024', '"nbytes": -5', 1), "c.json": CASE_JSON}),
        CLI_EXIT, "g.json"),
    Bad("kvxfer run on a case of CUDA 13", cli("run", "c.json", "-e", "numpy", files={
        "c.json": case_with("target", runtime_version=13)}), CLI_EXIT, "1000*major"),
    Bad("kvxfer run --seed -1", cli("run", "c.json", "-e", "numpy", "--seed", "-1", files={"c.json": CASE_JSON}),
        CLI_EXIT, "'--seed': -1 is not in 0 .. 2**64-1"),
    Bad("kvxfer run --seed 2**64", cli("run", "c.json", "-e", "numpy", "--seed", str(2**64), files={"c.json": CASE_JSON}),
        CLI_EXIT, f"'--seed': {2**64} is not in 0 .. 2**64-1"),
    Bad("kvxfer run with a deeply nested --config", cli("run", "c.json", "--config", "deep.json", files={
        "c.json": CASE_JSON, "deep.json": DEEP_JSON}), CLI_EXIT, "deep.json': cannot parse: nested too deeply"),
    Bad("kvxfer golden check with a used-files record not UTF-8", golden_folder_with(b"g.json\n\xff\xfe"), CLI_EXIT,
        ".kvxfer-golden-used: record = 'byte 7': not UTF-8 text"),
    Bad("kvxfer bench --out into a missing folder", bench_out("missing/results.json"), CLI_EXIT,
        "results.json: the folder "),
    Bad("kvxfer bench --out a folder", bench_out("."), CLI_EXIT, "is a folder; name the file to write"),
    # ---- offload: the worker, shared regions, files (rows built in tests/offload_bad_inputs.py) ------------------
    *(Bad(*row) for row in OFFLOAD_ROWS),
    # ---- kvxfer's vLLM backend: start-up checks (rows built in tests/vllm_bad_inputs.py) ----------------------
    *(Bad(*row) for row in VLLM_ROWS),
    # ---- the planner's front end and the plan constructor (restructured planner; issue 22, items 6, 7) --------
    Bad("plan built with a buffer index past int32", built_plan("src_buf", 2**32), PlanError, "src_buf[1] = 4294967296"),
    Bad("plan built with an attribute index past uint16", built_plan("attr", 65536), PlanError, "attr[1] = 65536"),
    Bad("plan built with a fractional size", built_plan("nbytes", 1.5), PlanError, "nbytes[1] = 1.5"),
    Bad("plan built with a negative offset", built_plan("dst_offset", -64), PlanError, "dst_offset[1] = -64"),
    Bad("plan built with a NaN offset", built_plan("src_offset", float("nan")), PlanError, "src_offset[1] = nan"),
    Bad("plan built with a bool size", built_plan("nbytes", True), PlanError, "nbytes[1] = True"),
    Bad("plan built with float call offsets", built_plan("call_offsets", 0.5, index=0), PlanError, "call_offsets[0] = 0.5"),
    Bad("dict ids: a chunk past its buffer", chunked_mapping([0, 4], [0, 1, 2, 3]), MappingError,
        "src_ids[1] = 4: block of region 'kv1' (host side) ends at byte 1088, past buffer 'cpu'"),
    Bad("dict ids: negative id named before the short list", chunked_mapping([0, -1], [0, 1]), MappingError,
        "src_ids[1] = -1: block ids must be non-negative"),
    Bad("store over bytes a long earlier read covers", one_buffer_store(), LayoutError, "overlap source bytes"),
    Bad("writes overlapping across another buffer's range", writes_across_buffers(), LayoutError,
        "that region 'a' also writes"),
    # ---- the plan constructor's other fields (issue 28, item 13) ---------------------------------------------------
    Bad("plan built with a writer count past int64", plan_with(region_writers=[(2**64, 0)] * len(PLAN.regions)),
        PlanError, "region_writers[0] = (18446744073709551616, 0)"),
    Bad("plan built with a word as a writer count", plan_with(region_writers=[("a", 0)] * len(PLAN.regions)),
        PlanError, "region_writers[0] = ('a', 0): expected a pair of integers"),
    Bad("plan built with a writer index equal to its writers", plan_with(region_writers=[(2, 2)] * len(PLAN.regions)),
        PlanError, "region_writers[0] = (2, 2)"),
    Bad("plan built with a writer entry that is not a pair", plan_with(region_writers=[7] * len(PLAN.regions)),
        PlanError, "region_writers[0] = 7: expected a (num_writers, writer_index) pair"),
    Bad("plan built with a size column one short", plan_with(columns={"nbytes": PLAN.nbytes.tolist()[:-1]}),
        PlanError, f"nbytes = {PLAN.num_ranges - 1}: column length differs from the other columns' ({PLAN.num_ranges})"),
    Bad("region writer index equal to its writers", lambda env: Region(
        name="r", page_bytes=8, device={"buffer": "g"}, host={"buffer": "h"}, num_writers=2, writer_index=2),
        LayoutError, "writer_index = 2: must be below num_writers 2"),
]


def test_the_catalogue_is_large_and_distinct():
    assert len(CATALOGUE) >= 60
    assert len({b.name for b in CATALOGUE}) == len(CATALOGUE)


@pytest.mark.parametrize("bad", CATALOGUE, ids=lambda b: b.name)
def test_bad_input_is_refused_before_any_byte_moves(bad: Bad, tmp_path, capsys):
    rng = np.random.default_rng(len(bad.name))
    env = Env({b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}, tmp_path)
    before = {k: v.copy() for k, v in env.bufs.items()}
    with pytest.raises(bad.error) as info:
        bad.act(env)
    files_after_error = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    if bad.error is CLI_EXIT:
        err = capsys.readouterr().err
        assert info.value.code == 2, err
        assert bad.fragment in err, err
        assert "Traceback" not in err and "Aborted" not in err
        lines = err.strip().splitlines()
        assert len(lines) == 1 or (lines[0].endswith("problems") and len(lines) <= 12) or "Usage" in err, err
        assert max(map(len, lines)) <= 300
    else:
        assert isinstance(info.value, ValueError), "the library's errors are ValueErrors"
        assert bad.fragment in str(info.value), str(info.value)
        assert "\n" not in str(info.value) and len(str(info.value)) < 400
    for name, want in before.items():
        assert np.array_equal(env.bufs[name], want), f"{name} changed"
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == files_after_error


def test_good_inputs_pass_the_same_harness(tmp_path):
    """The rows fail because of their one change: the unchanged inputs plan and run."""
    rng = np.random.default_rng(0)
    env = Env({b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}, tmp_path)
    before = env.bufs["gpu.kv0"].copy()
    plan_file(lambda d: None)(env)
    npz()(env)
    case_file(CASE_JSON)(env)
    golden_file(lambda d: None)(env)
    mapping()(env)
    target(platform="rocm", runtime_version="7.2")(env)
    assert not np.array_equal(env.bufs["gpu.kv0"], before)
