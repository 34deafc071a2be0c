"""Choosing an executor by configuration: ExecutorConfig, the name table, and the ``auto`` choice.

Configuration comes from (later wins): defaults < a TOML/JSON file (``source`` or $KVXFER_EXECUTOR_CONFIG) <
environment variables (ENV_VARS) < explicit overrides (Python keyword arguments, CLI flags).

``auto`` picks per plan: ROCm -> hip-batch; CUDA -> triton only for loads (h2d) from pinned host memory whose
merged ranges are small (at least half of the bytes move in ranges of at most ``triton.small_range_bytes``;
decided on the plan's real range sizes,
not the page size), else cuda-batch; no GPU -> numpy.
"""
from __future__ import annotations

import importlib.util
import json
import os
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import Field

from kvxfer.planner import Buffer, Direction, Layout, Platform, Target, TransferPlan

from ._base import After, Executor, Stream, Transfer, transfers_after
from ._binding import BoundMemory, bind
from ._memory import BindingError, resolve
from ._options import ConfigError, CudaOptions, HipOptions, NixlOptions, NumpyOptions, Options, PosixOptions, TritonOptions
from ._registry import BACKENDS, Backend, ExecutorKind, backend, kind_of

__all__ = ["AutoExecutor", "ConfigError", "ExecutorConfig", "ExecutorKind", "backend_for", "build_executor",
           "choose_executor", "detect_platform", "executor_class", "get_executor"]


class ExecutorConfig(Options):
    """Which executor to build and its options. ``max_descriptors``: per-call cap used when planning and
    enforced by the executor (None = the target's default, 0 = unlimited). ``replan``: re-plan a case for the
    runtime found instead of refusing a target mismatch. One section of typed options per backend."""

    kind: ExecutorKind = ExecutorKind.AUTO
    max_descriptors: int | None = Field(default=None, ge=0, le=2**32 - 1)  # more is a typo, never a limit
    replan: bool = False
    cuda: CudaOptions = CudaOptions()
    hip: HipOptions = HipOptions()
    triton: TritonOptions = TritonOptions()
    nixl: NixlOptions = NixlOptions()
    posix: PosixOptions = PosixOptions()
    numpy: NumpyOptions = NumpyOptions()

    def options_for(self, kind: ExecutorKind | str) -> Options:
        """The options of backend ``kind``, with the top-level ``max_descriptors`` applied where the backend has one."""
        b = backend(kind)
        opts = getattr(self, b.section, None) or b.options()
        if self.max_descriptors is not None and "max_descriptors" in type(opts).model_fields:
            opts = opts.model_copy(update={"max_descriptors": self.max_descriptors})
        return opts

    @classmethod
    def load(cls, source: str | Path | Mapping[str, Any] | None = None, *, env: Mapping[str, str] | None = None,
             **overrides: Any) -> ExecutorConfig:
        """Merge defaults, ``source`` (a dict or a .toml/.json path; default $KVXFER_EXECUTOR_CONFIG), the
        environment (``env``, default os.environ) and ``overrides`` (dotted keys as ``cuda__device``)."""
        env = os.environ if env is None else env
        if source is None:
            source = env.get("KVXFER_EXECUTOR_CONFIG") or None
        data: dict[str, Any] = {} if source is None else (dict(source) if isinstance(source, Mapping) else read_file(source))
        from_env: dict[str, str] = {}  # dotted path -> the variable that set it
        for var, path in ENV_VARS.items():
            if env.get(var) not in (None, ""):
                _set(data, path, _env_value(var, env[var]))
                from_env[path] = var
        for key, value in overrides.items():
            if value is not None:
                _set(data, key.replace("__", "."), value)
                from_env.pop(key.replace("__", "."), None)
        try:
            config: ExecutorConfig = cls.model_validate(data)
            return config
        except ConfigError as e:
            set_by = from_env.get(e.field)
            if set_by is None:
                raise
            raise ConfigError(set_by, e.value, f"{e.reason} (environment variable {set_by} sets {e.field})") from None


ENV_VARS: dict[str, str] = {
    "KVXFER_EXECUTOR": "kind",
    "KVXFER_MAX_DESCRIPTORS": "max_descriptors",
    "KVXFER_REPLAN": "replan",
    "KVXFER_CUDA_DEVICE": "cuda.device",
    "KVXFER_HIP_LIBRARY": "hip.library",
    "KVXFER_TRITON_SMALL_RANGE_BYTES": "triton.small_range_bytes",
    "KVXFER_NUMPY_SMALL_RANGE_BYTES": "numpy.small_range_bytes",
    "KVXFER_NUMPY_BULK_RANGE_BYTES": "numpy.bulk_range_bytes",
    "KVXFER_NUMPY_COPIER": "numpy.copier",
    "KVXFER_NUMPY_COPIER_THREADS": "numpy.copier_threads",
}


def _env_value(var: str, text: str) -> Any:
    if var in ("KVXFER_REPLAN", "KVXFER_NUMPY_COPIER"):
        if text.lower() not in ("0", "1", "true", "false", "yes", "no"):
            raise ConfigError(var, text, "expected 0/1/true/false")
        return text.lower() in ("1", "true", "yes")
    if var == "KVXFER_NUMPY_BULK_RANGE_BYTES" and text.lower() in ("none", "off"):
        return None
    return text  # pydantic validates and converts numbers


def _set(data: dict[str, Any], dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    for p in parents:
        data = data.setdefault(p, {})
    data[leaf] = value


def read_file(path: str | Path) -> dict[str, Any]:
    """A config file: TOML (.toml) or JSON. A TOML file may hold the settings under [executor]."""
    path = Path(path)
    if path.suffix not in (".toml", ".json"):
        raise ConfigError("config", str(path), f"unknown config file type {path.suffix or '(no suffix)'!r}: "
                          "use a .toml or .json file")
    if not path.is_file():
        raise ConfigError("config", str(path), "no such file")
    try:
        if path.suffix == ".toml":
            import tomllib
            data = tomllib.loads(path.read_text())
        else:
            data = json.loads(path.read_text())
    except ValueError as e:  # malformed, or not UTF-8 text
        raise ConfigError("config", str(path), f"cannot parse: {e}") from None
    except RecursionError:
        raise ConfigError("config", str(path), "cannot parse: nested too deeply") from None
    section = data.get("executor", data) if isinstance(data, dict) else data
    if not isinstance(section, dict):
        where = "the [executor] table" if section is not data else "the top level"
        raise ConfigError("config", str(path), f"expected a table of settings at {where}, got {type(section).__name__}")
    return section


# ---- choosing -----------------------------------------------------------------------------------------------
def detect_platform(config: ExecutorConfig | None = None) -> Platform:
    """The platform to run on: a CUDA driver with a device; else a HIP runtime with a device; else the CPU."""
    try:
        from cuda.bindings import driver as cu  # type: ignore[import-untyped, import-not-found, unused-ignore]
        if int(cu.cuInit(0)[0]) == 0:
            err, count = cu.cuDeviceGetCount()
            if int(err) == 0 and count > 0:
                return Platform.CUDA
    except Exception:  # no cuda-bindings, or no libcuda: not a CUDA machine
        pass
    try:
        from hip import hip  # type: ignore[import-untyped, import-not-found, unused-ignore]
        err, count = hip.hipGetDeviceCount()
        if int(err) == 0 and count > 0:
            return Platform.ROCM
    except Exception:  # no hip-python, or no HIP runtime
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
        pinned = resolve(bindings[buf.name], buf.name).pinned
        if pinned is False:
            return False
        known = known and pinned is True
    return True if known else None


def choose_executor(config: ExecutorConfig, plan: TransferPlan | None = None, bindings: Mapping[str, Any] | None = None,
                    platform: Platform | None = None) -> tuple[ExecutorKind, str]:
    """(kind, reason) for running ``plan`` with ``bindings`` under ``config``; pure given ``platform``."""
    if config.kind is not ExecutorKind.AUTO:
        return config.kind, f"configured: kind = {config.kind.value}"
    platform = detect_platform() if platform is None else platform
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


def backend_for(executor: Executor | ExecutorConfig, platform: Platform | None = None) -> Backend | None:
    """The backend table entry that runs ``executor``: the one answer to "which executor is this" (and, through
    ``Backend.gpu``, "is it a GPU executor"). A config names its kind; ``auto`` is the kind this platform runs
    with no plan to inspect (the GPU's DMA executor, NumPy without a GPU; ``platform`` None: detected). An
    executor is its class's entry (an AutoExecutor: its platform's kind). None for an executor of a class the
    table does not list (a wrapper)."""
    if isinstance(executor, ExecutorConfig):
        return BACKENDS[choose_executor(executor, platform=platform)[0]]
    if isinstance(executor, AutoExecutor):
        return BACKENDS[choose_executor(executor.config, platform=executor.platform)[0]]
    kind = kind_of(executor)
    return None if kind is None else BACKENDS[kind]


def executor_class(kind: ExecutorKind | str) -> type[Executor]:
    """Import the class registered for ``kind`` (ConfigError for auto or unknown kinds)."""
    return backend(kind).load()


def build_executor(kind: ExecutorKind | str, config: ExecutorConfig) -> Executor:
    """An executor of ``kind`` made from its typed options in ``config``."""
    return executor_class(kind).from_options(config.options_for(kind))


def get_executor(config: ExecutorConfig | Mapping[str, Any] | str | Path | None = None, **overrides: Any) -> Executor:
    """An executor for ``config``: a model (used as is), or a dict / file path / None, which are read with
    ``ExecutorConfig.load`` (defaults < dict or file < KVXFER_* environment < ``overrides``, dotted keys
    written ``cuda__device``). Overrides cannot be combined with a model."""
    if isinstance(config, ExecutorConfig):
        if overrides:
            raise ConfigError("overrides", sorted(overrides), "an ExecutorConfig model is used as is; pass a dict, "
                              "a file path or None to combine it with keyword overrides")
    else:
        config = ExecutorConfig.load(config, **overrides)
    if config.kind is ExecutorKind.AUTO:
        return AutoExecutor(config)
    return build_executor(config.kind, config)


def _checked_by_the_chosen_executor(buf: Buffer, mem: Any) -> None:
    """Auto resolves memory at bind; each sub-executor checks it when it binds on first use."""


class AutoExecutor(Executor):
    """Chooses per plan (``choose_executor``) and delegates; sub-executors are built on first use, or passed
    in as ``executors`` (kind -> executor, e.g. one made on a particular runtime).

    Transfers of one sub-executor complete in submission order; when consecutive runs switch executor, the
    new run is ordered after the previous transfer as after one of its ``after`` transfers (on the device where
    the two executors share a driver, else on the host), so the order holds across them too. ``stream`` and
    ``after`` go to the chosen executor. ``bind`` keeps the bindings and binds them for each sub-executor the
    first time it is chosen.

    Threads: one AutoExecutor may be shared by any number of threads: runs hold a lock while choosing and
    submitting (waits for ``after`` transfers included, since the order of its runs is one chain), and
    ``close`` takes it too.
    """

    def __init__(self, config: ExecutorConfig, platform: Platform | None = None,
                 executors: Mapping[ExecutorKind, Executor] | None = None):
        self.config = config
        self.platform = detect_platform() if platform is None else platform
        self._executors: dict[ExecutorKind, Executor] = dict(executors or {})
        self._last: tuple[ExecutorKind, Transfer] | None = None
        self._lock = threading.RLock()
        self.last_choice: tuple[ExecutorKind, str] | None = None

    def _get(self, kind: ExecutorKind) -> Executor:
        if kind not in self._executors:
            self._executors[kind] = build_executor(kind, self.config)
        return self._executors[kind]

    @property
    def target(self) -> Target:
        """The target of the platform's DMA executor (CUDA or HIP batch), or the default Target on a host without a GPU."""
        kind = {Platform.CUDA: ExecutorKind.CUDA_BATCH, Platform.ROCM: ExecutorKind.HIP_BATCH}.get(self.platform)
        return self._get(kind).target if kind else Target()

    def explain(self, plan: TransferPlan | None = None, bindings: Mapping[str, Any] | None = None) -> str:
        """One line naming the executor ``choose_executor`` picks for ``plan`` and ``bindings``, and why."""
        kind, reason = choose_executor(self.config, plan, bindings, self.platform)
        line = f"executor: {kind.value} ({reason})"
        how = getattr(self._get(kind), "explain", None) if plan is not None and kind is ExecutorKind.NUMPY else None
        return f"{line}; {how(plan)}" if how is not None else line

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Mapping[str, Any]) -> BoundMemory:
        """Resolve ``bindings`` once and keep them; each sub-executor binds (and checks) them the first time it is chosen."""
        bound = bind(buffers, bindings, check=_checked_by_the_chosen_executor, bound_by=type(self).__name__)
        bound.extra["bindings"] = dict(bindings)
        return bound

    def _sub_memory(self, kind: ExecutorKind, memory: BoundMemory | Mapping[str, Any]) -> Any:
        if not isinstance(memory, BoundMemory):
            return memory
        if memory.bound_by != type(self).__name__:
            raise BindingError(memory.bound_by, repr(memory), "bound by another executor kind; bind with this AutoExecutor")
        if kind not in memory.extra:
            sub = self._get(kind).bind(memory.buffers, memory.extra["bindings"])
            memory.extra[kind] = sub
            memory.on_close(sub.close)
        return memory.extra[kind]

    @property
    def synchronous(self) -> bool:
        """What the backends it may pick report: True only where every one is synchronous (numpy, without a GPU)."""
        if self.config.kind is not ExecutorKind.AUTO:
            return bool(self._get(self.config.kind).synchronous)
        return self.platform is Platform.CPU

    def run(self, plan: TransferPlan, memory: BoundMemory | Mapping[str, Any], stream: Stream = None,
            after: After = None) -> Transfer:
        """Choose an executor for ``plan`` (recorded in ``last_choice``) and run ``plan`` there, after ``stream`` and
        ``after`` (see ``Executor.run``) and, if the previous transfer ran on another executor, after that one too.
        Raises BindingError for memory bound by another executor kind, RunArgumentError for a bad ``after``."""
        waits = transfers_after(after)
        with self._lock:
            raw = memory.extra["bindings"] if isinstance(memory, BoundMemory) else memory
            kind, reason = self.last_choice = choose_executor(self.config, plan, raw, self.platform)
            if self._last is not None and self._last[0] is not kind:
                waits = (*waits, self._last[1])
            transfer = self._get(kind).run(plan, self._sub_memory(kind, memory), stream, waits)
            self._last = (kind, transfer)
            return transfer

    def close(self) -> None:
        """Close every sub-executor built or passed in so far."""
        with self._lock:
            for ex in self._executors.values():
                ex.close()
            self._executors.clear()
