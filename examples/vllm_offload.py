"""kvxfer as vLLM's KV offloading backend, end to end on vLLM's CPU build, checked against a run without offloading.

Writes a small Llama (``kvxfer.testing.write_llama``: seeded random weights, no tokenizer) and runs the same four
prompts on two engines whose KV cache holds 16 blocks of 32 tokens (15 usable: vLLM keeps block 0): one without
offloading, then one with kvxfer's spec behind kvxfer's connector. The prompts are A, two long prompts that evict
A's blocks from the engine's cache, then A's 256-token prefix again with a new ending, whose prefix the second
engine loads back from kvxfer's host tier. The tokens of both engines must be equal.

    make venv-vllm                                   # builds .venv-vllm (vLLM's CPU build and kvxfer)
    .venv-vllm/bin/python examples/vllm_offload.py
"""
from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

from kvxfer.testing import write_llama  # a small seeded Llama: no download

# kv_cache_memory_bytes: the KV cache's size in bytes. Without it vLLM's CPU build takes a share of the first NUMA
# node's memory less what the process uses, which is negative where that node is small (8 GiB of 24 on some
# machines): "Available memory on node 0 ... less than desired CPU memory utilization", then "Engine core
# initialization failed" (docs/reference/troubleshooting.md).
START_HINT = ("the engine did not start. If its log says 'Available memory on node 0 ... less than desired CPU memory "
              "utilization', the first NUMA node is too small for vLLM's CPU build's default sizing: give the KV cache "
              "a size with kv_cache_memory_bytes (docs/reference/troubleshooting.md)")


def start(**kw: Any) -> Any:
    """``vllm.LLM(**kw)``; a refused start ends the script saying what to check first."""
    from vllm import LLM

    try:
        return LLM(**kw)
    except RuntimeError as e:
        raise SystemExit(f"{e}\n{START_HINT}") from e


def generate(model: Path, prompts: dict[str, list[int]], kv_transfer_config: dict[str, Any] | None) -> dict[str, Any]:
    """Run ``prompts`` one after the other on a fresh engine; its tokens per prompt and its offload metrics."""
    from vllm import SamplingParams

    llm = start(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
              num_gpu_blocks_override=16, max_model_len=480, enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20,
              disable_log_stats=False, kv_transfer_config=kv_transfer_config)
    greedy = SamplingParams(temperature=0, max_tokens=8)
    tokens = {name: list(llm.generate([{"prompt_token_ids": ids}], greedy, use_tqdm=False)[0].outputs[0].token_ids)
              for name, ids in prompts.items()}
    metrics = {m.name: m.value for m in llm.get_metrics() if m.name.startswith("vllm:external_prefix_cache_hits")}
    # kvxfer's counters file is replaced after every step that finished jobs, so it is current already; the grace
    # period lets the worker also write its final counters as it shuts down, before vLLM would kill it (5 s default)
    llm.llm_engine.engine_core.shutdown(timeout=60)
    return {"tokens": tokens, "metrics": metrics}


def main() -> None:
    scratch = Path(tempfile.mkdtemp())
    model, stats = write_llama(scratch / "llama"), scratch / "kvxfer-stats.json"
    r = random.Random(0)
    a = [r.randrange(3, 512) for _ in range(264)]
    prompts = {"A": a, "B": [r.randrange(3, 512) for _ in range(440)], "C": [r.randrange(3, 512) for _ in range(440)],
               "A again": a[:256] + [9, 8, 7, 6]}
    plain = generate(model, prompts, None)
    offloaded = generate(model, prompts, {
        "kv_connector": "KvxferOffloadingConnector", "kv_connector_module_path": "kvxfer.offload.vllm",
        "kv_role": "kv_both", "kv_load_failure_policy": "recompute",  # a failed copy is recomputed, not fatal
        "kv_connector_extra_config": {"spec_name": "KvxferOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm",
                                      "cpu_bytes_to_use": 64 << 20, "kvxfer_stats_path": str(stats)}})
    for name, ids in prompts.items():
        print(f"{name:8} {len(ids):4d} prompt tokens -> {offloaded['tokens'][name]}")
    print(f"tokens served from the offload tier: {offloaded['metrics']}")
    same = offloaded["tokens"] == plain["tokens"]
    print(f"tokens equal to the run without offloading: {same}")
    print(f"kvxfer: {json.loads(stats.read_text())}")
    if not same:
        raise SystemExit(f"offloading changed the tokens: {plain['tokens']} without, {offloaded['tokens']} with")


if __name__ == "__main__":
    main()
