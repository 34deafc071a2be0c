"""Choosing an executor by configuration: ExecutorConfig, the name table, and the ``auto`` choice.

Configuration comes from (later wins): defaults < a TOML/JSON file (``source`` or $KVXFER_EXECUTOR_CONFIG) <
environment variables (ENV_VARS) < explicit overrides (Python keyword arguments, CLI flags).

``auto`` picks per plan: ROCm -> hip-batch; CUDA -> triton only for loads (h2d) from pinned host memory whose
merged ranges are small (at least half of the bytes move in ranges of at most ``triton.small_range_bytes``;
decided on the plan's real range sizes,
not the page size), else cuda-batch; no GPU -> numpy.
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import os
from collections.abc import Mapping
from enum import StrEnum
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
from pydantic import Field, field_validator

from kvxfer.planner import Direction, PlanError, Platform, Target, TransferPlan
from kvxfer.planner._model import Spec

from .base import Executor, Transfer, resolve_memory


class ConfigError(PlanError):
    """Bad executor configuration; names the field and value (a PlanError so validation reports it as is)."""


class ExecutorKind(StrEnum):
    AUTO = "auto"
    CUDA_BATCH = "cuda-batch"
    HIP_BATCH = "hip-batch"
    TRITON = "triton"
    NUMPY = "numpy"
    NIXL = "nixl"


EXECUTORS: dict[ExecutorKind, str] = {  # resolved on use, so unused backends are never imported
    ExecutorKind.CUDA_BATCH: "kvxfer.executors.ops_cuda:CudaBatchExecutor",
    ExecutorKind.HIP_BATCH: "kvxfer.executors.ops_hip:HipBatchExecutor",
    ExecutorKind.TRITON: "kvxfer.executors.ops_triton:TritonExecutor",
    ExecutorKind.NUMPY: "kvxfer.executors.ops_numpy:NumpyExecutor",
    ExecutorKind.NIXL: "kvxfer.executors.ops_nixl:NixlExecutor",
}


class _Options(Spec):
    _error: ClassVar = ConfigError


class CudaOptions(_Options):
    """cuda-batch: device ordinal; ``driver_lib`` loads a host-memory driver stand-in (tests/shims/fake_cuda.c)
    instead of the real driver, reporting ``driver_version`` when given."""

    device: int = Field(default=0, ge=0)
    driver_lib: str | None = None
    driver_version: int | None = Field(default=None, ge=0)


class HipOptions(_Options):
    """hip-batch: device ordinal; ``library`` overrides the libamdhip64 search; ``host_as_device`` allows host
    memory for device buffers (only for host-memory stand-ins such as tests/shims/fake_hip.c)."""

    device: int = Field(default=0, ge=0)
    library: str | None = None
    host_as_device: bool = False


class TritonOptions(_Options):
    """triton: ``small_range_bytes`` is auto's threshold (a load goes to the kernel when at least half of its
    bytes move in ranges no larger); ``tile_bytes`` is the bytes one program copies per
    step (power of two); ``num_programs`` caps the grid (None = 4 per SM, or the tile count if smaller)."""

    device: int = Field(default=0, ge=0)
    small_range_bytes: int = Field(default=28 * 1024, ge=0)
    tile_bytes: int = Field(default=8192, ge=16, le=1 << 16)
    num_programs: int | None = Field(default=None, gt=0)

    @field_validator("tile_bytes")
    @classmethod
    def _power_of_two(cls, v: int) -> int:
        if v & (v - 1):
            raise ConfigError("", v, "must be a power of two")  # the field path is added by validation
        return v


class ExecutorConfig(_Options):
    """Which executor to build and its options. ``max_descriptors``: per-call cap used when planning and
    enforced by the executor (None = the target's default, 0 = unlimited). ``replan``: re-plan a case for the
    runtime found instead of refusing a target mismatch. ``nixl``: free-form options for the NIXL executor."""

    kind: ExecutorKind = ExecutorKind.AUTO
    max_descriptors: int | None = Field(default=None, ge=0)
    replan: bool = False
    cuda: CudaOptions = CudaOptions()
    hip: HipOptions = HipOptions()
    triton: TritonOptions = TritonOptions()
    nixl: dict[str, Any] = Field(default_factory=dict)

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
             **overrides: Any) -> ExecutorConfig:
        """Merge defaults, ``source`` (a dict or a .toml/.json path; default $KVXFER_EXECUTOR_CONFIG), the
        environment (``env``, default os.environ) and ``overrides`` (dotted keys as ``cuda__device``)."""
        env = os.environ if env is None else env
        if source is None:
            source = env.get("KVXFER_EXECUTOR_CONFIG") or None
        data: dict[str, Any] = {} if source is None else (dict(source) if isinstance(source, Mapping) else read_file(source))
        for var, path in ENV_VARS.items():
            if env.get(var) not in (None, ""):
                _set(data, path, _env_value(var, env[var]))
        for key, value in overrides.items():
            if value is not None:
                _set(data, key.replace("__", "."), value)
        return cls.model_validate(data)


ENV_VARS: dict[str, str] = {
    "KVXFER_EXECUTOR": "kind",
    "KVXFER_MAX_DESCRIPTORS": "max_descriptors",
    "KVXFER_REPLAN": "replan",
    "KVXFER_CUDA_DEVICE": "cuda.device",
    "KVXFER_CUDA_DRIVER_LIB": "cuda.driver_lib",
    "KVXFER_HIP_LIBRARY": "hip.library",
    "KVXFER_TRITON_SMALL_RANGE_BYTES": "triton.small_range_bytes",
}


def _env_value(var: str, text: str) -> Any:
    if var == "KVXFER_REPLAN":
        if text.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(var, text, "expected 0/1/true/false")
        return text.lower() in ("1", "true", "yes")
    return text  # pydantic validates and converts numbers


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[leaf] = value


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file: TOML (.toml) or JSON. A TOML file may hold the settings under [executor]."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("config", str(path), "no such file")
    try:
        if path.suffix == ".toml":
            try:
                import tomllib
            except ImportError:  # Python 3.10
                import tomli as tomllib
            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except ValueError as e:
        raise ConfigError("config", str(path), f"cannot parse: {e}") from None
    return data.get("executor", data)


# ---- choosing -----------------------------------------------------------------------------------------------
def detect_platform(config: ExecutorConfig) -> Platform:
    """The platform to run on: a configured shim decides; else a CUDA driver with a device; else a HIP
    runtime with a device; else the CPU."""
    if config.cuda.driver_lib:
        return Platform.CUDA
    if config.hip.library:
        return Platform.ROCM
    try:
        from cuda.bindings import driver as cu
        if int(cu.cuInit(0)[0]) == 0:
            err, count = cu.cuDeviceGetCount()
            if int(err) == 0 and count > 0:
                return Platform.CUDA
    except Exception:  # no cuda-bindings, or no libcuda: not a CUDA machine
        pass
    try:
        import ctypes

        from .ops_hip import load_hip
        n = ctypes.c_int(0)
        if load_hip().hipGetDeviceCount(ctypes.byref(n)) == 0 and n.value > 0:
            return Platform.ROCM
    except Exception:
        pass
    return Platform.CPU


def _host_sources_pinned(plan: TransferPlan, bindings: Mapping[str, Any] | None) -> bool | None:
    """True when every host buffer the plan reads is known pinned, False if one is known pageable, else None."""
    if bindings is None:
        return None
    known = True
    for i in plan.buffers_used("src").tolist():
        buf = plan.buffers[i]
        if buf.location.value != "host" or buf.name not in bindings:
            continue
        pinned = resolve_memory(bindings[buf.name], buf.name).pinned
        if pinned is False:
            return False
        known = known and pinned is True
    return True if known else None


def choose_executor(config: ExecutorConfig, plan: TransferPlan | None = None, bindings: Mapping[str, Any] | None = None,
                    platform: Platform | None = None) -> tuple[ExecutorKind, str]:
    """(kind, reason) for running ``plan`` with ``bindings`` under ``config``; pure given ``platform``."""
    if config.kind is not ExecutorKind.AUTO:
        return config.kind, f"configured: kind = {config.kind.value}"
    platform = detect_platform(config) if platform is None else platform
    if platform is Platform.ROCM:
        return ExecutorKind.HIP_BATCH, "ROCm: DMA batch copies (the SM-kernel path is only chosen on CUDA)"
    if platform is Platform.CPU:
        return ExecutorKind.NUMPY, "no GPU runtime found: host memory, reference executor"
    if plan is None:
        return ExecutorKind.CUDA_BATCH, "CUDA: no plan to inspect, DMA batch copies"
    if plan.direction is not Direction.H2D:
        return ExecutorKind.CUDA_BATCH, "CUDA store (d2h): always DMA, the copy engines leave compute alone"
    if plan.num_ranges == 0:
        return ExecutorKind.CUDA_BATCH, "CUDA load with no ranges"
    limit = config.triton.small_range_bytes
    nb = plan.nbytes
    share = float(nb[nb <= limit].sum(dtype=np.uint64)) / plan.total_bytes  # by bytes: a few huge ranges count
    if share < 0.5:
        return ExecutorKind.CUDA_BATCH, (f"CUDA load: {share:.0%} of the bytes move in merged ranges <= {limit:,} B, "
                                         "so most descriptors are large enough for full DMA bandwidth")
    pinned = _host_sources_pinned(plan, bindings)
    if pinned is not True:
        why = "pageable" if pinned is False else "not known to be pinned"
        return ExecutorKind.CUDA_BATCH, f"CUDA load with small ranges, but host memory is {why}: DMA batch copies"
    if importlib.util.find_spec("triton") is None:
        return ExecutorKind.CUDA_BATCH, "CUDA load with small ranges, but triton is not installed: DMA batch copies"
    return ExecutorKind.TRITON, (f"CUDA load from pinned host memory: {share:.0%} of the bytes move in merged ranges "
                                 f"<= {limit:,} B, where an SM kernel avoids the per-descriptor DMA cost")


def executor_class(kind: ExecutorKind | str) -> type[Executor]:
    """Import the class registered for ``kind`` (raises ConfigError for auto or unknown kinds)."""
    try:
        kind = ExecutorKind(kind)
        module, _, name = EXECUTORS[kind].partition(":")
    except (ValueError, KeyError):
        raise ConfigError("kind", str(kind), f"no executor class (known: {', '.join(k.value for k in EXECUTORS)})") from None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError as e:
        raise ImportError(f"executor {kind.value!r} ({EXECUTORS[kind]}) is not available: {e}") from e


def build_executor(kind: ExecutorKind | str, config: ExecutorConfig) -> Executor:
    cls = executor_class(kind)
    from_config = getattr(cls, "from_config", None)
    return from_config(config) if from_config is not None else cls()


def get_executor(config: ExecutorConfig | Mapping[str, Any] | str | Path | None = None) -> Executor:
    """An executor for ``config``: a model (used as is), or a dict / file path / None, which are read with
    ``ExecutorConfig.load`` (defaults < dict or file < KVXFER_* environment)."""
    if not isinstance(config, ExecutorConfig):
        config = ExecutorConfig.load(config)
    if config.kind is ExecutorKind.AUTO:
        return AutoExecutor(config)
    return build_executor(config.kind, config)


class AutoExecutor(Executor):
    """Chooses per plan (``choose_executor``) and delegates; sub-executors are built on first use.

    Transfers of one sub-executor complete in submission order; when consecutive runs switch executor, the
    previous transfer is waited for on the host first, so the order holds across them too.
    """

    name = "auto"

    def __init__(self, config: ExecutorConfig, platform: Platform | None = None):
        self.config = config
        self.platform = detect_platform(config) if platform is None else platform
        self._executors: dict[ExecutorKind, Executor] = {}
        self._last: tuple[ExecutorKind, Transfer] | None = None
        self.last_choice: tuple[ExecutorKind, str] | None = None

    def _get(self, kind: ExecutorKind) -> Executor:
        if kind not in self._executors:
            self._executors[kind] = build_executor(kind, self.config)
        return self._executors[kind]

    @property
    def target(self) -> Target:
        kind = {Platform.CUDA: ExecutorKind.CUDA_BATCH, Platform.ROCM: ExecutorKind.HIP_BATCH}.get(self.platform)
        return self._get(kind).target if kind else Target()

    def explain(self, plan: TransferPlan | None = None, bindings: Mapping[str, Any] | None = None) -> str:
        kind, reason = choose_executor(self.config, plan, bindings, self.platform)
        return f"executor: {kind.value} ({reason})"

    def run(self, plan: TransferPlan, bindings: Mapping[str, Any], stream: Any = None) -> Transfer:
        kind, reason = self.last_choice = choose_executor(self.config, plan, bindings, self.platform)
        if self._last is not None and self._last[0] is not kind:
            self._last[1].wait()
        transfer = self._get(kind).run(plan, bindings, stream)
        self._last = (kind, transfer)
        return transfer

    def close(self) -> None:
        for ex in self._executors.values():
            ex.close()
        self._executors.clear()

