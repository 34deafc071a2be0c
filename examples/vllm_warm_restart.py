"""A prefix that outlives its engine: vLLM's tiering with kvxfer's file tier, on vLLM's CPU build.

Engine 1 serves prompt A (256-token prefix): its KV goes to vLLM's host tier and on to kvxfer's files under
``--root``. Engine 1 exits. Engine 2, new and empty, starts on the same directory and serves A's prefix with
another ending: the prefix is promoted from the files to host memory and loaded, not recomputed. Engine 3 runs
without offloading, and its tokens must be the same.

    .venv-vllm/bin/python examples/vllm_warm_restart.py [--root DIR]   # make venv-vllm builds .venv-vllm
"""
from __future__ import annotations

import argparse
import json
import random
import tempfile
from pathlib import Path
from typing import Any

from vllm_offload import start  # the engine start of the host-tier example (it says why a start is refused)

from kvxfer.testing import write_llama  # a small seeded Llama: no download


def engine(model: Path, tiers: list[dict[str, Any]] | None) -> Any:
    offload = None if tiers is None else {
        "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "KvxferTieringOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm",
                                      "cpu_bytes_to_use": 16 << 20, "secondary_tiers": tiers}}
    return start(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", block_size=32,
               num_gpu_blocks_override=16, max_model_len=480, enable_prefix_caching=True, kv_cache_memory_bytes=512 << 20,
               disable_log_stats=False, kv_transfer_config=offload)


def generate(llm: Any, ids: list[int]) -> list[int]:
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=None, help="the file tier's directory (default: a new one)")
    root = ap.parse_args().root or Path(tempfile.mkdtemp(prefix="kvxfer-tier-"))
    root.mkdir(parents=True, exist_ok=True)
    model = write_llama(Path(tempfile.mkdtemp()) / "llama")
    stats = root / "counters.json"
    files = [{"type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm", "root_dir": str(root),
              "capacity_bytes": 64 << 20, "stats_path": str(stats)}]
    r = random.Random(0)
    a = [r.randrange(3, 512) for _ in range(264)]
    again = a[:256] + [9, 8, 7, 6]

    first = engine(model, files)
    print(f"engine 1, A: {generate(first, a)}")
    first.llm_engine.engine_core.shutdown()  # stores drain before it exits: A's chunks are durable
    print(f"engine 1 stored {json.loads(stats.read_text())['chunks_stored']} chunks under {root}")

    second = engine(model, files)
    restored = generate(second, again)
    second.llm_engine.engine_core.shutdown()
    c = json.loads(stats.read_text())
    print(f"engine 2, A's prefix again: {restored} ({c['found']} chunks found on disk, {c['chunks_loaded']} loaded)")

    plain = engine(model, None)
    recomputed = generate(plain, again)
    plain.llm_engine.engine_core.shutdown()
    print(f"engine 3 (no offloading): {recomputed}; equal: {restored == recomputed}")
    if restored != recomputed:
        raise SystemExit("the restored prefix gave other tokens than a recomputed one")


if __name__ == "__main__":
    main()
