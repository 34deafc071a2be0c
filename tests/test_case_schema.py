"""The case file's JSON Schema (kvxfer schema) resolves and accepts every shipped case and golden case."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvxfer.planner import Case, golden

jsonschema = pytest.importorskip("jsonschema")
ROOT = Path(__file__).resolve().parent.parent
GOLDEN = sorted((ROOT / "tests" / "golden").glob("*.json"))
SHIPPED_CASES = sorted(p for p in (ROOT / "examples").rglob("*.json")
                       if "layout" in json.loads(p.read_text()))


def _validator() -> jsonschema.protocols.Validator:
    schema = Case.json_schema()
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def test_schema_refs_resolve_from_the_root():
    schema = Case.json_schema()
    refs = {m for m in json.dumps(schema).split('"$ref": ')[1:]}
    assert refs, "the schema should reference its $defs"
    for ref in refs:
        name = json.loads(ref.split(",")[0].split("}")[0]).rsplit("/", 1)[-1]
        assert name in schema["$defs"], ref


@pytest.mark.parametrize("path", GOLDEN + SHIPPED_CASES, ids=lambda p: p.name)
def test_every_shipped_case_validates(path):
    d = json.loads(path.read_text())
    case = d["case"] if "kvxfer_golden" in d else d
    errors = sorted(_validator().iter_errors(case), key=str)
    assert not errors, f"{path.name}: {errors[0].message} at {list(errors[0].absolute_path)}"


def test_schema_has_every_model_field():
    from kvxfer.planner import BlockMapping, Buffer, Fragment, Layout, Placement, PlanOptions, Region, Target

    defs = Case.json_schema()["$defs"]
    for model in (BlockMapping, Buffer, Fragment, Layout, Placement, PlanOptions, Region, Target):
        assert set(defs[model.__name__]["properties"]) == set(model.model_fields), model.__name__
    assert {"group_sizes", "group_starts"} <= set(defs["BlockMapping"]["properties"])


@pytest.mark.parametrize("bad,where", [
    ({"mapping": {"direction": "h2d", "src_ids": [1.5], "dst_ids": [0]}}, "src_ids"),
    ({"mapping": {"direction": "h2d", "src_id": [1], "dst_ids": [0]}}, "src_id"),
    ({"target": {"platform": "cuda", "runtime_version": "13"}}, "runtime_version"),
    ({"layout": {"buffers": [], "regions": [], "colour": 1}}, "colour"),
])
def test_schema_refuses_what_the_loader_refuses(bad, where):
    d = json.loads(GOLDEN[0].read_text())["case"]
    for key, value in bad.items():
        d[key] = {**d[key], **value} if key != "mapping" else value
    assert list(_validator().iter_errors(d)), where
    with pytest.raises(ValueError):
        Case.model_validate(d)


def test_schema_command_prints_the_same_schema(tmp_path):
    out = subprocess.run([sys.executable, "-m", "kvxfer.cli", "schema", "--json"], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == Case.json_schema()


def test_string_versions_validate_and_plan():
    d = golden.load(GOLDEN[0]).case.to_dict()
    d["target"] = {"platform": "cuda", "runtime_version": "12.8"}
    assert not list(_validator().iter_errors(d))
    assert Case.model_validate(d).target.runtime_version == 12080


def test_a_case_dumps_to_json_through_pydantic_and_reads_back():
    from kvxfer.planner import Case, presets
    case = Case(layout=presets.kv_layout(2, 32, 64), mapping=presets.mapping("fragmented", 6, 32, "d2h", seed=4))
    text = case.model_dump_json()  # pydantic's own serializer, nested mapping included (it raised on numpy ids)
    back = Case.model_validate_json(text)
    assert back == case and back.plan().num_ranges == case.plan().num_ranges
    assert case.model_dump()["mapping"]["src_ids"] == case.mapping.src_ids.tolist()
