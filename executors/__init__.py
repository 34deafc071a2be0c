"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily.

Bind once, run many: ``bound = executor.bind(layout, {name: memory})`` then ``executor.run(plan, bound,
stream=None, after=None)``. Backends are listed once, in the registry (``BACKENDS``); their classes import on
first use.

The public API is ``__all__``, flat: the executors (``NumpyExecutor``, ``CudaBatchExecutor``, ...), their
options, binding (``bind``, ``BoundMemory``, ``resolve``, ``Memory``, ``RawMemory``), lowering (``Lowered``),
transfers and errors, configuration (``get_executor``, ``ExecutorConfig``, ...), pinning, the DMA driver
protocol (``Runtime``), NIXL's remote buffers and peer descriptions, and ``FileBinding``. Public submodules:
``config`` (choosing an executor), ``file_trust`` (files: ``FileBinding`` and opening files without trusting
what is planted: links, foreign files, bounded locks), ``nixl_memory`` (memory, registrations and files as NIXL
sees them), ``nixl_peer`` (a NIXL peer process and metadata exchange: ``python -m kvxfer.executors.nixl_peer``)
and ``torch_layout`` (layouts from tensors). Every other module is private (``_binding``, ``_lowering``,
``_ops_numpy``, ...); the old public paths of those (``kvxfer.executors.binding`` ...) still import, with a
DeprecationWarning naming ``kvxfer.executors`` (``_moved``).
"""
from __future__ import annotations

import importlib
from typing import Any

from . import _moved
from ._base import (
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
from ._binding import BoundMemory, bind
from ._lowering import Lowered
from ._memory import BindingError, Memory, RawMemory, resolve
from ._ops_numpy import NumpyExecutor
from ._options import ConfigError, CudaOptions, HipOptions, NixlOptions, NumpyOptions, PosixOptions, TritonOptions
from ._registry import BACKENDS, ExecutorKind

_moved.install()

_HELPERS = {  # not backends: configuration, pinning, the DMA protocol, NIXL memory and files, imported on first use
    "ExecutorConfig": "config", "get_executor": "config", "choose_executor": "config", "AutoExecutor": "config",
    "backend_for": "config",
    "coerce_executor": "_coerce", "ExecutorSource": "_coerce", "ExecutorSpec": "_coerce", "PlanRunner": "_coerce",
    "pin_host_memory": "_pinning", "PinnedRegion": "_pinning", "Runtime": "_dma", "RemoteBuffer": "nixl_memory",
    "PeerInfo": "nixl_memory", "PeerInfoError": "nixl_memory", "FileBinding": "file_trust",
    "CudaRuntime": "_ops_cuda", "HipRuntime": "_ops_hip",  # a backend's driver, to drive it as another version
}
_SUBMODULES = ("config", "file_trust", "nixl_memory", "nixl_peer", "torch_layout")

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
    if name in _SUBMODULES or name in _moved.MOVED:  # an old path warns (``_moved``)
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
