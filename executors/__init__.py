"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily.

Bind once, run many: ``bound = executor.bind(layout, {name: memory})`` then ``executor.run(plan, bound)``.
Backends are listed once, in ``registry.BACKENDS``; their classes import on first use.
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import CompletedTransfer, Executor, ExecutorError, TargetMismatchError, Transfer, check_plan_target
from .binding import BindingError, BoundMemory, Memory, RawMemory, bind, resolve
from .ops_numpy import NumpyExecutor
from .options import ConfigError, CudaOptions, HipOptions, NixlOptions, NumpyOptions, TritonOptions
from .registry import BACKENDS, ExecutorKind

_HELPERS = {  # not backends: configuration, pinning and NIXL memory, imported on first use
    "ExecutorConfig": "config", "get_executor": "config", "choose_executor": "config", "AutoExecutor": "config",
    "pin_host_memory": "pinning", "PinnedRegion": "pinning", "RemoteBuffer": "nixl_memory",
}

__all__ = ["BACKENDS", "BindingError", "BoundMemory", "CompletedTransfer", "ConfigError", "CudaOptions", "Executor",
           "ExecutorError", "ExecutorKind", "HipOptions", "Memory", "NixlOptions", "NumpyExecutor", "NumpyOptions",
           "RawMemory", "TargetMismatchError", "Transfer", "TritonOptions", "bind", "check_plan_target", "resolve",
           *(b.cls for b in BACKENDS.values() if b.cls != "NumpyExecutor"), *_HELPERS]


def __getattr__(name: str) -> Any:
    for b in BACKENDS.values():
        if b.cls == name:
            return b.load()
    if name in _HELPERS:
        return getattr(importlib.import_module(f".{_HELPERS[name]}", __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
