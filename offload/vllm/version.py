"""The vLLM releases this wing supports, and every difference between them in one place.

``SUPPORTED_VLLM`` names the major.minor releases; ``traits(version)`` says what a release's offloading interface
has (``VllmTraits``); ``import_vllm`` imports vLLM after refusing, in one line naming the version found and the
range, any release outside it. No vLLM import at module level: ``import_vllm`` imports it when called (by ``api``,
before any of vLLM's names), so the rest of this module is plain Python the test suite checks without vLLM.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvxfer.planner import DEPENDENCIES, import_optional

__all__ = ["INSTALL_HINT", "SUPPORTED_VLLM", "UnsupportedVllmError", "VllmTraits", "import_vllm", "release", "traits"]

INSTALL_HINT = DEPENDENCIES["vllm"].install_line  # worded once, in kvxfer.planner.optional


@dataclass(frozen=True)
class VllmTraits:
    """What one vLLM release's offloading interface has, as this wing uses it.

    ``device_pointers``: ``OffloadingWorker.submit_store(job_id, device_ptrs, dst_spec)`` and ``submit_load(job_id,
    src_spec, device_ptrs, expedited)`` take ``DevicePointers`` (flat pointer and size arrays per group) instead of
    a ``GPULoadStoreSpec`` (0.34). ``expedited``: loads carry the flag (0.33 on). ``kv_cache_access``,
    ``may_load_async``: the connector's class hooks exist (0.34). ``sleep_mode``: the connector's sleep hooks
    (0.33 on). ``fs_worker``: ``vllm.v1.kv_offload.fs.worker`` (0.34). ``key_family``: what an offload key and
    a block hash mean (vLLM's ``hash_block_tokens`` and ``make_offload_key``); a store written under one family is
    read under every release of the same family and is a clean miss under another."""

    release: str
    device_pointers: bool = False
    expedited: bool = False
    kv_cache_access: bool = False
    may_load_async: bool = False
    sleep_mode: bool = False
    fs_worker: bool = False
    key_family: str = "blockhash-1"


_TRAITS = {
    "0.32": VllmTraits("0.32"),
    "0.33": VllmTraits("0.33", expedited=True, sleep_mode=True),
    "0.34": VllmTraits("0.34", device_pointers=True, expedited=True, kv_cache_access=True, may_load_async=True,
                       sleep_mode=True, fs_worker=True),
}
SUPPORTED_VLLM = tuple(_TRAITS)  # major.minor releases whose offloading interface this wing was written against


class UnsupportedVllmError(ImportError):
    """vLLM's installed release is outside the range this wing supports (one line naming both)."""


def release(version: str) -> str:
    """``version``'s major.minor ("0.34.0rc1" -> "0.34")."""
    return ".".join(str(version).split(".")[:2])


def traits(version: str) -> VllmTraits:
    """The traits of ``version`` (any spelling with the major.minor first); UnsupportedVllmError outside the range."""
    found = _TRAITS.get(release(version))
    if found is None:
        raise UnsupportedVllmError(f"kvxfer.offload.vllm supports vLLM {SUPPORTED_VLLM[0]} to {SUPPORTED_VLLM[-1]} "
                                   f"({', '.join(SUPPORTED_VLLM)}), found {version}: " + INSTALL_HINT)
    return found


def import_vllm() -> Any:
    """vLLM, imported, after checking its version is one this module supports (``MissingDependencyError``, an
    ImportError, naming the install line when vLLM is missing; UnsupportedVllmError naming the version found and
    the range otherwise)."""
    vllm = import_optional("vllm", f"kvxfer.offload.vllm (for vLLM {', '.join(SUPPORTED_VLLM)})")
    traits(str(getattr(vllm, "__version__", "unknown")))
    return vllm
