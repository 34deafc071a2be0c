"""The engine tests' small Llama: ``kvxfer.testing.write_llama`` (public, documented in the getting-started guide)."""
from __future__ import annotations

from kvxfer.testing import write_llama

__all__ = ["write_llama"]
