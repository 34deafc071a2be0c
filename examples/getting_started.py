"""docs/getting-started.md as one script: its Python blocks, in order (written by examples/sync_notebook.py).

    make venv-vllm                                     # builds .venv-vllm (vLLM's CPU build and kvxfer)
    .venv-vllm/bin/python examples/getting_started.py  # a few minutes: two engines start
"""
import json
import random
import tempfile
from pathlib import Path

from kvxfer.testing import write_llama

work = Path(tempfile.mkdtemp(prefix="kvxfer-start-"))
model = write_llama(work / "llama")
store = work / "kv"  # the storage tier's directory: it must exist
store.mkdir()


def engine():
    from vllm import LLM

    return LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, dtype="float32",
               block_size=32, num_gpu_blocks_override=16, max_model_len=480, enable_prefix_caching=True,
               kv_cache_memory_bytes=512 << 20,  # see "Memory at engine start" below
               kv_transfer_config={
                   "kv_connector": "KvxferOffloadingConnector",
                   "kv_connector_module_path": "kvxfer.offload.vllm",
                   "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                   "kv_connector_extra_config": {
                       "spec_name": "KvxferTieringOffloadingSpec", "spec_module_path": "kvxfer.offload.vllm",
                       "cpu_bytes_to_use": 16 << 20,
                       "secondary_tiers": [{
                           "type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm",
                           "root_dir": str(store), "capacity_bytes": 64 << 20,
                           "stats_path": str(store / "counters.json")}]}})


def generate(llm, prompt):
    from vllm import SamplingParams

    out = llm.generate([{"prompt_token_ids": prompt}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def main():
    r = random.Random(0)
    prompt = [r.randrange(3, 512) for _ in range(264)]

    first = engine()
    print("engine 1:", generate(first, prompt))
    # stores drain before the engine process exits (give it time: see "Shutting down" below)
    first.llm_engine.engine_core.shutdown(timeout=60)
    print("chunks stored:", json.loads((store / "counters.json").read_text())["chunks_stored"])

    second = engine()  # a new engine on the same directory: it finds the chunks of the first
    again = generate(second, prompt[:256] + [9, 8, 7, 6])
    second.llm_engine.engine_core.shutdown(timeout=60)
    counters = json.loads((store / "counters.json").read_text())
    print("engine 2:", again, "found on disk:", counters["found"], "loaded:", counters["chunks_loaded"])


if __name__ == "__main__":
    main()
