"""Writes docs/reference/configuration.md from the code, so the configuration reference cannot drift: every key
of the executor config (``ExecutorConfig`` and its per-backend options, with the environment variable that sets
it), of the file tier (``StoreConfig``, a ``secondary_tiers`` entry of type ``KvxferFileTier``) and of vLLM's
``kv_connector_extra_config`` that kvxfer reads (``KVXFER_KEYS``), with its type, default, unit and constraints,
and the error a bad value gets, produced by handing the model (or the start-up check) that bad value.

    python tests/reference/configuration.py            # rewrite the page
    python tests/reference/configuration.py --check    # exit 1 if the page is not current (tests/test_docs_config.py)
"""
from __future__ import annotations

import enum
import sys
import types
import typing
from pathlib import Path
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "reference" / "configuration.md"

HEAD = """# Configuration

Every configuration key kvxfer reads, with its type, default, unit and the error a bad value gets. This page is
generated from the code (`python tests/reference/configuration.py`; `tests/test_docs_config.py` fails when it is
not current): the types, defaults and limits are the pydantic models' own, and each error is what the model, or
the start-up check, says when handed the bad value shown.
"""


def _type(annotation: Any) -> str:
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return " \\| ".join(f'"{m.value}"' for m in annotation)
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return " \\| ".join(_type(a) for a in typing.get_args(annotation))
    if origin is tuple:
        return f"list of {_type(typing.get_args(annotation)[0])}"
    return "null" if annotation is type(None) else getattr(annotation, "__name__", str(annotation))


def _limits(info: FieldInfo) -> str:
    out = []
    for m in info.metadata:
        for attr, sign in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<"), ("min_length", "length ≥")):
            if getattr(m, attr, None) is not None:
                out.append(f"{sign} {getattr(m, attr)}")
    return ", ".join(out)


def _unit(name: str) -> str:
    if name.endswith("_bytes"):
        return "bytes"
    if name.endswith("_s"):
        return "seconds"
    return ""


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        return "(table)"
    return f"`{value!r}`".replace("|", "\\|")


def _bad(annotation: Any, info: FieldInfo) -> Any:
    """A value the field refuses: below its lower limit, else of the wrong kind."""
    for m in info.metadata:
        for attr in ("ge", "gt"):
            if getattr(m, attr, None) is not None:
                return getattr(m, attr) - 1 if attr == "ge" else getattr(m, attr)
    args = typing.get_args(annotation) or (annotation,)
    if typing.get_origin(annotation) is tuple:
        return 5
    if any(a is str for a in args) and not any(isinstance(a, type) and issubclass(a, enum.Enum) for a in args):
        return 5 if all(a in (str, type(None)) for a in args) else ["x"]
    if float in args:
        return float("inf")
    if bool in args:
        return "maybe"
    return "nonsense"


def _error(validate: Any, data: dict[str, Any]) -> str:
    try:
        validate(data)
    except ValueError as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0]}".replace("|", "\\|")
    return "(accepted)"


def _rows(model: type[BaseModel], prefix: str, validate: Any, wrap: Any, env: dict[str, str]) -> list[str]:
    rows = []
    for name, info in model.model_fields.items():
        key = f"{prefix}{name}"
        sub = info.annotation
        if isinstance(sub, type) and issubclass(sub, BaseModel):
            rows += _rows(sub, f"{key}.", validate, lambda d, k=name, w=wrap: w({k: d}), env)
            continue
        bad = _bad(sub, info)
        err = _error(validate, wrap({name: bad}))
        var = env.get(key, "")
        rows.append(f"| `{key}` | {_type(sub)} | {_default(info)} | {_unit(name)} | {_limits(info)} | "
                    f"{'`' + var + '`' if var else ''} | `{bad!r}` → {err} |")
    return rows


HEADER = ("| key | type | default | unit | limits | environment | a bad value and its error |\n"
          "|---|---|---|---|---|---|---|")


def executor_section() -> str:
    from kvxfer.executors.config import ENV_VARS, ExecutorConfig

    env = {path: var for var, path in ENV_VARS.items()}
    rows = _rows(ExecutorConfig, "", ExecutorConfig.model_validate, lambda d: d, env)
    return ("## The executor config\n\n`get_executor(config)`, the offload worker's executor argument, vLLM's "
            "`kvxfer_executor` key and `kvxfer run --executor` read it: a dict, a TOML or JSON file, "
            "`$KVXFER_EXECUTOR_CONFIG`, then the environment variables below, then keyword overrides, in that "
            "order. Per-backend options sit in their table (`posix.threads` is `{\"posix\": {\"threads\": 8}}`).\n\n"
            + HEADER + "\n" + "\n".join(rows) + "\n")


def store_section() -> str:
    from kvxfer.offload.files.chunk_store import StoreConfig

    base = {"root_dir": str(ROOT), "capacity_bytes": 1 << 20}
    rows = _rows(StoreConfig, "", lambda d: StoreConfig.model_validate({**base, **d}), lambda d: d, {})
    return ("## The file tier (`KvxferFileTier`)\n\nThe keys of a `secondary_tiers` entry of type `KvxferFileTier` "
            "(and of `ChunkStore`'s `StoreConfig`); vLLM's `locality` is accepted too. At engine start a bad key "
            "stops the engine with one line naming it as `secondary_tiers[KvxferFileTier].<key>`; `root_dir` must "
            "exist and be writable.\n\n" + HEADER.replace(" environment |", "").replace("|---|---|---|---|---|---|---|",
                                                                                        "|---|---|---|---|---|---|")
            + "\n" + "\n".join(r.replace(" |  | `", " | `", 1) for r in rows) + "\n")


def vllm_section() -> str:
    from kvxfer.offload.vllm.checks import KVXFER_KEYS, VLLM_KEYS, check_executor_device, check_stats_path

    checks = {"kvxfer_executor": (lambda v: check_executor_device(v, "cpu"), {"kind": "cuda-batch"}),
              "kvxfer_stats_path": (check_stats_path, "/proc/kvxfer.json")}
    rows = []
    for key in KVXFER_KEYS:
        check, bad = checks.get(key, (None, None))
        err = _error(check, bad) if check else "read as a boolean"
        rows.append(f"| `{key}` | " + (f"`{bad!r}` → {err}" if check else err) + " |")
    return ("## vLLM's `kv_connector_extra_config`\n\nkvxfer reads these keys beside vLLM's own "
            f"({', '.join(f'`{k}`' for k in VLLM_KEYS)}); any other `kvxfer_*` key stops the engine at start-up "
            "(`ExtraConfigError` naming it), and a key neither reads is logged as a warning naming the closest "
            "known one. What each key does: [kvxfer in vLLM](../vllm/index.md).\n\n"
            "| key | a bad value and its error |\n|---|---|\n" + "\n".join(rows) + "\n")


def render() -> str:
    return "\n".join([HEAD, executor_section(), store_section(), vllm_section()])


if __name__ == "__main__":
    text = render()
    if "--check" in sys.argv:
        sys.exit(0 if PAGE.read_text() == text else 1)
    PAGE.write_text(text)
    print(f"wrote {PAGE}")
