"""The vLLM releases this wing was written against, and vLLM imported after checking that its version is one of them.

No vLLM import at module level: ``import_vllm`` imports it when called (by ``api``, before any of vLLM's names).
"""
from __future__ import annotations

from typing import Any

from kvxfer.planner import DEPENDENCIES, import_optional

__all__ = ["INSTALL_HINT", "SUPPORTED_VLLM", "import_vllm"]

SUPPORTED_VLLM = ("0.32",)  # major.minor releases whose offloading interface this wing was written against
INSTALL_HINT = DEPENDENCIES["vllm"].install_line  # worded once, in kvxfer.planner.optional


def import_vllm() -> Any:
    """vLLM, imported, after checking its version is one this module supports (``MissingDependencyError``, an
    ImportError, naming the install line when vLLM is missing; ImportError naming the version found otherwise)."""
    vllm = import_optional("vllm", f"kvxfer.offload.vllm (for vLLM {', '.join(SUPPORTED_VLLM)})")
    version = str(getattr(vllm, "__version__", "unknown"))
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise ImportError(f"kvxfer.offload.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: "
                          + INSTALL_HINT)
    return vllm
