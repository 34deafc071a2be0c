"""The one table of backends: kind, module, class and options model. Config, ``auto``, the CLI and the lazy
imports of ``kvxfer.executors`` all read it; a backend module is imported only when its class is asked for.
"""
from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from ._options import ConfigError, CudaOptions, HipOptions, NixlOptions, NumpyOptions, Options, PosixOptions, TritonOptions


class ExecutorKind(StrEnum):
    """The executor backends by config name; ``auto`` chooses one per plan."""

    AUTO = "auto"
    CUDA_BATCH = "cuda-batch"
    HIP_BATCH = "hip-batch"
    TRITON = "triton"
    NUMPY = "numpy"
    NIXL = "nixl"
    POSIX = "posix"


@dataclass(frozen=True)
class Backend:
    """One backend: its kind, ``module:Class``, its options model, the config section that holds them, and
    whether it is a GPU executor (``gpu``: it copies on a GPU, issuing on device streams, so device buffers
    live in GPU memory and host memory is worth pinning; the NumPy and NIXL executors wait on the host)."""

    kind: ExecutorKind
    module: str
    cls: str
    options: type[Options]
    section: str
    gpu: bool

    def load(self) -> type[Any]:
        """Import and return the executor class; ImportError names the backend (with the module's install hint)."""
        try:
            cls: type[Any] = getattr(importlib.import_module(f"kvxfer.executors.{self.module}"), self.cls)
            return cls
        except ImportError as e:
            raise ImportError(f"executor {self.kind.value!r} ({self.module}:{self.cls}) is not available: {e}") from e


BACKENDS: dict[ExecutorKind, Backend] = {b.kind: b for b in (
    Backend(ExecutorKind.CUDA_BATCH, "_ops_cuda", "CudaBatchExecutor", CudaOptions, "cuda", gpu=True),
    Backend(ExecutorKind.HIP_BATCH, "_ops_hip", "HipBatchExecutor", HipOptions, "hip", gpu=True),
    Backend(ExecutorKind.TRITON, "_ops_triton", "TritonExecutor", TritonOptions, "triton", gpu=True),
    Backend(ExecutorKind.NUMPY, "_ops_numpy", "NumpyExecutor", NumpyOptions, "numpy", gpu=False),
    Backend(ExecutorKind.NIXL, "_ops_nixl", "NixlExecutor", NixlOptions, "nixl", gpu=False),
    Backend(ExecutorKind.POSIX, "_ops_posix", "PosixFileExecutor", PosixOptions, "posix", gpu=False),
)}


def backend(kind: ExecutorKind | str) -> Backend:
    """The backend registered for ``kind``; ConfigError for auto or an unknown kind."""
    try:
        return BACKENDS[ExecutorKind(kind)]
    except (ValueError, KeyError):
        raise ConfigError("kind", str(getattr(kind, "value", kind)),
                          f"no executor class (known: {', '.join(k.value for k in BACKENDS)})") from None


def kind_of(executor: object) -> ExecutorKind | None:
    """The kind whose class ``executor`` is an instance of, by class (a subclass counts; a class of another module
    with the same name does not); None for auto and unregistered classes. Only backends whose module is loaded are
    asked: an instance's class is."""
    for b in BACKENDS.values():
        cls = getattr(sys.modules.get(f"{__package__}.{b.module}"), b.cls, None)
        if isinstance(cls, type) and isinstance(executor, cls):
            return b.kind
    return None
