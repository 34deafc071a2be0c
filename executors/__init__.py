"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily."""
from __future__ import annotations

import importlib
from typing import Any

from .base import (
    BindingError,
    Bound,
    Executor,
    ExecutorError,
    RawMemory,
    TargetMismatchError,
    Transfer,
    bind_addresses,
    check_plan_target,
)
from .ops_numpy import NumpyExecutor

_LAZY = {  # backend classes import on first use, so importing kvxfer.executors stays light
    "CudaBatchExecutor": "ops_cuda", "HipBatchExecutor": "ops_hip", "TritonExecutor": "ops_triton",
    "ExecutorConfig": "config", "get_executor": "config", "choose_executor": "config",
    "pin_host_memory": "pinning", "PinnedRegion": "pinning",
    "NixlExecutor": "ops_nixl", "RemoteBuffer": "nixl_memory",
}

__all__ = ["BindingError", "Bound", "Executor", "ExecutorError", "NumpyExecutor", "RawMemory", "TargetMismatchError",
           "Transfer", "bind_addresses", "check_plan_target", *list(_LAZY)]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
