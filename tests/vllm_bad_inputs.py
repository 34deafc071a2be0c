"""Bad inputs of kvxfer's vLLM backend for the catalogue in test_bad_inputs.py: the start-up checks of
``kv_connector_extra_config`` (kvxfer.offload.vllm.checks, which need no vLLM; a shared region's name taken by
another file is offload_bad_inputs.py's). Each row is ``(name, act, error, fragment)`` as in offload_bad_inputs.py."""
from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvxfer.offload.vllm.checks import (
    ExtraConfigError,
    check_blocks_per_chunk,
    check_executor_device,
    check_extra,
    check_host_memory,
)

Act = Callable[[Any], Any]


def extra(**keys: Any) -> Act:
    """Check a kv_connector_extra_config holding ``keys`` (values may be callables of the row's folder)."""
    def act(env: Any) -> Any:
        return check_extra({k: v(Path(env.folder)) if callable(v) else v for k, v in keys.items()})
    return act


ROWS: list[tuple[str, Act, type[BaseException], str]] = [
    ("vllm: kvxfer_executor given as 42", extra(kvxfer_executor=42), ExtraConfigError,
     "['kvxfer_executor'] = 42: must be an executor config"),
    ("vllm: kvxfer_stats_path naming a directory", extra(kvxfer_stats_path=str), ExtraConfigError, "is a directory"),
    ("vllm: kvxfer_stats_path in a missing folder", extra(kvxfer_stats_path=lambda d: str(d / "no" / "s.json")),
     ExtraConfigError, "does not exist"),
    ("vllm: kvxfer_stats_path under /proc", extra(kvxfer_stats_path="/proc/self/kvxfer.json"), ExtraConfigError,
     "which holds no regular files"),
    ("vllm: kvxfer_stats_path given as a number", extra(kvxfer_stats_path=7), ExtraConfigError, "must be a file path"),
    ("vllm: kvxfer_verify given as a word", extra(kvxfer_verify="yes"), ExtraConfigError,
     "['kvxfer_verify'] = 'yes': must be true or false"),
    ("vllm: misspelt kvxfer key", extra(kvxfer_exector={"kind": "numpy"}), ExtraConfigError, "unknown kvxfer key"),
    ("vllm: blocks_per_chunk given as a float", extra(blocks_per_chunk=2.5), ExtraConfigError,
     "['blocks_per_chunk'] = 2.5: must be a positive integer"),
    ("vllm: cpu_bytes_to_use given as a word", extra(cpu_bytes_to_use="8GiB"), ExtraConfigError,
     "must be a positive number of bytes"),
    ("vllm: blocks_per_chunk past the model's length", lambda env: check_blocks_per_chunk({"blocks_per_chunk": 64}, 64,
                                                                                           32, 480),
     ExtraConfigError, "holds 2048 tokens, more than the model's max_model_len 480"),
    ("vllm: cpu_bytes_to_use beyond the memory available", lambda env: check_host_memory(1 << 60, 1 << 60),
     ExtraConfigError, "GiB is available ("),
    ("vllm: a CUDA executor on a CPU engine", lambda env: check_executor_device({"kind": "cuda-batch"}, "cpu"),
     ExtraConfigError, "this engine's KV caches are on cpu"),
]
