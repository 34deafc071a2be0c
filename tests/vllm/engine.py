"""Runs vLLM engines (CPU build) over sequences of requests and prints what happened, one JSON line per engine.

``python -m tests.vllm.engine CASES.json`` (from the repository root): CASES is a list of cases, run one after
the other in this process (each engine is started, used and shut down before the next; the engine tests run a
few per process to pay vLLM's import once). A case holds:

- ``model``: keyword arguments of ``tests.vllm.llama.write_llama`` and ``model_dir``, where it is written;
- ``engine``: extra keyword arguments of ``vllm.LLM`` (``num_gpu_blocks_override``, ``tensor_parallel_size``...);
- ``offload``: None (no offloading), or kvxfer's ``kv_connector_extra_config`` (``spec_name`` and
  ``spec_module_path`` default to kvxfer's spec);
- ``transfer``: more keys of vLLM's ``kv_transfer_config`` (``KVXFER_CONNECTOR``: kvxfer's connector);
- ``requests``: prompt token id lists, generated one after the other (greedy, ``max_tokens`` each), or all in
  one ``generate`` call with ``batch`` true (vLLM schedules them together as its cache allows);
- ``name``: echoed in the result.

The output, per case: ``tokens`` (generated ids per request), ``metrics`` (vLLM's counters and histogram sums by name),
``stats`` (kvxfer's counters, one dict per rank, written by each worker at shutdown), ``error`` (the engine's
failure, if it failed to start or run), and timings (``start_s``; ``request_s`` for all requests and
``request_times_s`` per request, wall time of each generate call).
"""
from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.vllm.llama import write_llama  # noqa: E402

# The KV cache's size is given (kv_cache_memory_bytes), not a share of memory: vLLM's CPU build takes a share of the
# first NUMA node's memory less the process's own, which is negative where that node is small (8 GiB of 24 on
# some machines); each case sets its block count (num_gpu_blocks_override) within it
BASE = dict(skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32, enable_prefix_caching=True,
            kv_cache_memory_bytes=512 << 20, max_num_seqs=4, seed=0, disable_log_stats=False)


# kvxfer's connector, which takes failed copies (recomputed), with vLLM's recompute policy
KVXFER_CONNECTOR = {"kv_connector": "KvxferOffloadingConnector", "kv_connector_module_path": "kvxfer.offload.vllm",
                    "kv_load_failure_policy": "recompute"}


def kv_transfer_config(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's kv_transfer_config for kvxfer's spec with ``extra`` as the connector's extra config."""
    extra = {"spec_name": "KvxferOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm", **extra}
    return {"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "kv_connector_extra_config": extra}


def _metrics(llm: Any) -> dict[str, float]:
    out: dict[str, float] = {}
    for m in llm.get_metrics():
        value = getattr(m, "value", None)
        if value is None:
            value = getattr(m, "sum", None)
        if isinstance(value, (int, float)):
            out[m.name] = out.get(m.name, 0.0) + float(value)
    return out


def run(case: dict[str, Any], before: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Run ``case`` (see the module docstring) and return the result dict; ``before(i)`` is called before the i-th
    ``generate`` call (what a test does to a running engine's surroundings)."""
    from vllm import LLM, SamplingParams

    model = dict(case.get("model", {}))
    folder = write_llama(model.pop("model_dir"), **model)
    stats_dir = Path(tempfile.mkdtemp(prefix="kvxfer-vllm-stats-"))
    kw = {**BASE, **case.get("engine", {})}
    if case.get("offload") is not None:
        kw["kv_transfer_config"] = {**kv_transfer_config({"kvxfer_stats_path": str(stats_dir / "stats.json"),
                                                          **case["offload"]}), **case.get("transfer", {})}
    out: dict[str, Any] = {"name": case.get("name"), "tokens": [], "metrics": {}, "stats": [], "error": None,
                           "request_times_s": []}
    t0 = time.perf_counter()
    try:
        llm = LLM(model=str(folder), **kw)
    except Exception as e:  # a refused start-up is a result, not a crash of this script
        out["error"] = f"{type(e).__name__}: {e}"
        return out
    out["start_s"] = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=int(case.get("max_tokens", 8)))
    t1 = time.perf_counter()
    batches = [case["requests"]] if case.get("batch") else [[p] for p in case["requests"]]
    try:
        for i, batch in enumerate(batches):
            if before is not None:
                before(i)
            t2 = time.perf_counter()
            res = llm.generate([{"prompt_token_ids": list(p)} for p in batch], params, use_tqdm=False)
            out["request_times_s"].append(time.perf_counter() - t2)
            out["tokens"].extend(list(r.outputs[0].token_ids) for r in res)
    except Exception as e:
        out["error"] = f"{type(e).__name__}: {e}"
    out["request_s"] = time.perf_counter() - t1
    try:
        out["metrics"] = _metrics(llm)
    except Exception as e:
        out["metrics_error"] = repr(e)
    # workers shut their connectors down, which writes kvxfer's stats; a grace period longer than vLLM's 5 s
    # default, after which it kills the engine process (a loaded 2-core machine can take longer to tear down)
    llm.llm_engine.engine_core.shutdown(timeout=60)
    ranks = int(kw.get("tensor_parallel_size", 1))
    deadline = time.monotonic() + 30
    while case.get("offload") is not None and len(list(stats_dir.glob("*.json"))) < ranks and time.monotonic() < deadline:
        time.sleep(0.1)
    out["stats"] = [json.loads(p.read_text()) for p in sorted(stats_dir.glob("*.json"))]
    return out


if __name__ == "__main__":
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    for case in json.loads(Path(sys.argv[1]).read_text()):
        try:
            result = run(case)
        except Exception:
            result = {"name": case.get("name"), "error": traceback.format_exc()}
        print("RESULT " + json.dumps(result), flush=True)
