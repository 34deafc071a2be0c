"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily.

Bind once, run many: ``bound = executor.bind(layout, {name: memory})`` then ``executor.run(plan, bound,
stream=None, after=None)``. Backends are listed once, in ``registry.BACKENDS``; their classes import on first use.

Public submodules (``from kvxfer.executors import torch_layout``): ``memory`` (resolving a binding),
``binding`` (memory bound once), ``lowering`` (a plan's ranges read once, bounded and lowered onto bound
memory), ``config`` (choosing an executor), ``dma`` (the ``Runtime`` protocol a DMA driver implements),
``file_trust`` (opening files without trusting what is planted: links, foreign files, bounded locks),
``nixl_memory`` (memory, registrations and files as NIXL sees them), ``nixl_peer`` (a NIXL peer process and
metadata exchange), ``options``, ``pinning``, ``torch_layout`` (layouts from tensors), and one module per
backend (``ops_cuda``, ``ops_hip``, ``ops_nixl``, ``ops_numpy``, ``ops_posix``: files with pread/pwrite,
``ops_triton``).
"""
from __future__ import annotations

import importlib
from typing import Any

from .base import (
    After,
    CompletedTransfer,
    Executor,
    ExecutorError,
    RunArgumentError,
    Stream,
    TargetMismatchError,
    Transfer,
    check_plan_target,
    stream_handle,
    wait_on_host,
)
from .binding import BoundMemory, bind
from .lowering import Lowered
from .memory import BindingError, Memory, RawMemory, resolve
from .ops_numpy import NumpyExecutor
from .options import ConfigError, CudaOptions, HipOptions, NixlOptions, NumpyOptions, PosixOptions, TritonOptions
from .registry import BACKENDS, ExecutorKind

_HELPERS = {  # not backends: configuration, pinning and NIXL memory, imported on first use
    "ExecutorConfig": "config", "get_executor": "config", "choose_executor": "config", "AutoExecutor": "config",
    "backend_for": "config",
    "coerce_executor": "_coerce", "ExecutorSource": "_coerce", "ExecutorSpec": "_coerce", "PlanRunner": "_coerce",
    "pin_host_memory": "pinning", "PinnedRegion": "pinning", "RemoteBuffer": "nixl_memory", "PeerInfo": "nixl_memory",
    "PeerInfoError": "nixl_memory", "FileBinding": "nixl_memory",
}
_SUBMODULES = ("binding", "config", "dma", "file_trust", "lowering", "memory", "nixl_memory", "nixl_peer", "ops_cuda",
               "ops_hip", "ops_nixl", "ops_numpy", "ops_posix", "ops_triton", "options", "pinning", "torch_layout")

__all__ = ["BACKENDS", "After", "BindingError", "BoundMemory", "CompletedTransfer", "ConfigError", "CudaOptions",
           "Executor", "ExecutorError", "ExecutorKind", "HipOptions", "Lowered", "Memory", "NixlOptions", "NumpyExecutor",
           "NumpyOptions", "PosixOptions", "RawMemory", "RunArgumentError", "Stream", "TargetMismatchError", "Transfer",
           "TritonOptions", "bind", "check_plan_target", "resolve", "stream_handle", "wait_on_host",
           *(b.cls for b in BACKENDS.values() if b.cls != "NumpyExecutor"), *_HELPERS, *_SUBMODULES]


def __getattr__(name: str) -> Any:
    for b in BACKENDS.values():
        if b.cls == name:
            return b.load()
    if name in _HELPERS:
        return getattr(importlib.import_module(f".{_HELPERS[name]}", __name__), name)
    if name in _SUBMODULES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
