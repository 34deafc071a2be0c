"""A case: everything needed to build one plan (layout, mapping, target, options), as one JSON file."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from ._model import Spec
from .errors import PlanError
from .files import PlanFileError, read_json
from .layout import Layout
from .plan import TransferPlan
from .planning import plan_transfer
from .spec import BlockMapping
from .target import PlanOptions, Target


class Case(Spec):
    """Inputs of one plan. ``Case.load(path)`` reads JSON; ``case.plan()`` plans it."""

    layout: Layout
    mapping: BlockMapping
    target: Target = Target()
    options: PlanOptions = PlanOptions()

    def plan(self) -> TransferPlan:
        """The plan for this case: ``plan_transfer(layout, mapping, target, options)``. Raises what it raises (PlanError
        subclasses)."""
        return plan_transfer(self.layout, self.mapping, self.target, self.options)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict; layout and options fields at their defaults are left out so files stay stable as fields are
        added (the mapping and the target are written in full)."""
        return {"layout": self.layout.model_dump(mode="json", exclude_defaults=True), "mapping": self.mapping.model_dump(),
                "target": self.target.model_dump(mode="json"),
                "options": self.options.model_dump(mode="json", exclude_defaults=True)}

    def to_json(self, indent: int | None = 1) -> str:
        """``to_dict()`` as JSON text (``indent`` None: one line)."""
        return json.dumps(self.to_dict(), indent=indent)

    def save(self, path: str | Path) -> Path:
        """Write ``to_json()`` to ``path`` (replacing it) and return the path."""
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> Case:
        """Read a case file (JSON). Raises PlanFileError naming the file and every problem found."""
        d = read_json(path, "case file")
        if "kvxfer_golden" in d:
            raise PlanFileError("kvxfer_golden", d["kvxfer_golden"], "this is a golden file, not a case file; "
                                      "read its case with kvxfer.planner.golden.load_case", source=str(path))
        try:
            return cls.model_validate(d)
        except PlanError as e:
            raise PlanFileError.wrap(e, str(path)) from None

    @classmethod
    def json_schema(cls) -> dict[str, Any]:
        """JSON Schema (draft 2020-12) of the case file, generated from the models so new fields appear by
        themselves. Block ids are arrays of non-negative integers; ``runtime_version`` is the encoded integer
        or a ``"major.minor"`` string."""
        schema = {"$schema": "https://json-schema.org/draft/2020-12/schema", **cls.model_json_schema()}
        schema["title"] = "kvxfer case"
        defs = schema["$defs"]
        ids = {"type": "array", "items": {"type": "integer", "minimum": 0}}
        for name in ("src_ids", "dst_ids"):
            defs["BlockMapping"]["properties"][name] = {**ids, "title": name}
        version = defs["Target"]["properties"]["runtime_version"]
        defs["Target"]["properties"]["runtime_version"] = {
            "anyOf": [{k: v for k, v in version.items() if k not in ("default", "title")},
                      {"type": "string", "pattern": r"^[0-9]+\.[0-9]+$"}],
            "default": version.get("default", 0), "title": version.get("title", "Runtime Version")}
        return schema
