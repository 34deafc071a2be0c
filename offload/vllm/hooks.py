"""What vLLM 0.34's connector hooks ask of kvxfer's backend, as plain answers the test suite checks without vLLM.

``kv_cache_access``: how kvxfer's workers reach the device KV cache, by ``kvxfer_executor``'s kind: a NIXL executor
registers the cache with UCX (vLLM's ``REGISTERS``: each segment one physical allocation); every other kind copies
in process (``IN_PROCESS``, vLLM's default: any allocation). ``may_load_async``: kvxfer's loads run on the worker's
lanes while the engine steps, so a request whose blocks the offloading tier may hold can start loading while the
running batch is full (0.34's ``--max-num-inflight-kv-loads``); a request that skips reading external KV cannot,
and vLLM's own answer (a P/D remote prefill) stands. ``supports_sleep_mode`` (0.33 on): kvxfer binds the device
caches by address once; vLLM's sleep mode keeps their virtual addresses and drains transfers first, so an
in-process executor follows it, while a NIXL executor's registrations would be stale: refused there. All are
cheap: vLLM asks each time a request waits.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["kv_cache_access", "may_load_async", "supports_sleep_mode"]


def kv_cache_access(extra_config: Mapping[str, Any] | None) -> frozenset[str]:
    """The names of vLLM's ``KVCacheAccess`` flags kvxfer's workers need under ``extra_config`` (the connector's
    ``kv_connector_extra_config``): {"REGISTERS"} for a NIXL executor, none (IN_PROCESS) otherwise."""
    from kvxfer.executors import ExecutorConfig

    value = (extra_config or {}).get("kvxfer_executor")
    if value is None:
        return frozenset()
    raw = ExecutorConfig.load(value).kind
    kind = str(getattr(raw, "value", raw))
    return frozenset({"REGISTERS"}) if kind == "nixl" else frozenset()


def supports_sleep_mode(extra_config: Mapping[str, Any] | None) -> bool:
    """Whether kvxfer's workers follow vLLM's sleep mode under ``extra_config``: not with a NIXL executor (its
    registrations of the device cache are not redone after wake-up)."""
    return not kv_cache_access(extra_config)


def may_load_async(request: Any, vllm_answer: bool) -> bool:
    """Whether kvxfer may load ``request``'s KV while the batch is full: vLLM's answer, or any request that has
    block hashes to look up and does not skip reading external KV (kvxfer's loads never block a step)."""
    if vllm_answer:
        return True
    if getattr(request, "skip_reading_external_kv", False):
        return False
    return bool(getattr(request, "block_hashes", None))
