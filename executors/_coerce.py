"""One coercion of everything that names an executor: an instance, a zero-argument factory, a config (an
``ExecutorConfig``, a dict, a .toml/.json path) or None (the default config) -> an ``ExecutorSource``, which makes the
executor and says whether the caller owns it (``make``), and which backend runs it when that is known without
making one (``backend``). cuda.core's options coercion is the model: every caller takes the same forms, checked
in one place, and an ``ExecutorSource`` passes through unchanged.

Forms are told apart by class, in this order: None; an ``ExecutorSource``; a class (a factory: calling it makes an
executor); an ``Executor``, or an object of another class with the interface ``PlanRunner`` declares (a wrapper);
an ``ExecutorConfig``; a mapping; a str or path; any other callable (a factory). Anything else is refused with a
ConfigError naming the value.
"""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeAlias, runtime_checkable

from kvxfer.planner import Buffer, Layout, Target, TransferPlan

from ._base import After, Executor, Stream, Transfer
from ._binding import BoundMemory
from ._options import ConfigError
from ._registry import Backend
from .config import ExecutorConfig, backend_for, get_executor

__all__ = ["ExecutorSource", "ExecutorSpec", "PlanRunner", "coerce_executor"]


@runtime_checkable
class PlanRunner(Protocol):
    """What an object of a class outside ``Executor`` needs to be used as an executor (a wrapper in front of one):
    the members the offload worker and the simple path call."""

    @property
    def target(self) -> Target:
        """The target plans for it are made for."""

    @property
    def synchronous(self) -> bool:
        """Whether ``run`` returns with every copy done."""

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Mapping[str, Any]) -> BoundMemory:
        """Resolve and check every buffer's memory once."""

    def run(self, plan: TransferPlan, memory: Any, stream: Stream = None, after: After = None) -> Transfer:
        """Run ``plan`` on ``memory``."""

    def close(self) -> None:
        """Release what it holds."""


@dataclass(frozen=True)
class ExecutorSource:
    """An executor argument, coerced: exactly one of ``given`` (an executor to use, the caller's), ``factory``
    (called for each executor made) and ``config`` (read once: defaults < file or dict < ``KVXFER_*`` environment)."""

    given: PlanRunner | None = None
    factory: Callable[[], PlanRunner] | None = None
    config: ExecutorConfig | None = None

    @property
    def backend(self) -> Backend | None:
        """The backend table entry that runs it, when known without making one: a given executor's class (None for
        a class the table does not list, a wrapper), a config's kind (``auto``: the kind this platform runs).
        None for a factory (unknown until called)."""
        if self.given is not None:
            return backend_for(self.given) if isinstance(self.given, Executor) else None
        if self.config is not None:
            return backend_for(self.config)
        return None

    def make(self, *, one_kind: bool = False) -> tuple[PlanRunner, bool]:
        """(an executor, whether the caller owns it and closes it): the given one (not owned; the same object on
        every call), or a new one from the factory or config (owned). ``one_kind``: a config of kind ``auto`` makes
        the executor of the kind this platform runs (one executor for every plan, as a worker's lanes need) instead
        of an AutoExecutor choosing per plan."""
        if self.given is not None:
            return self.given, False
        if self.factory is not None:
            return self.factory(), True
        config = self.config if self.config is not None else ExecutorConfig.load(None)
        if one_kind:
            runs = backend_for(config)
            if runs is not None and runs.kind is not config.kind:
                config = config.model_copy(update={"kind": runs.kind})
        return get_executor(config), True


# every form an executor argument takes (an Executor is a PlanRunner)
ExecutorSpec: TypeAlias = (ExecutorSource | PlanRunner | Callable[[], PlanRunner] | ExecutorConfig | Mapping[str, Any] | str
                           | os.PathLike[str] | None)


def coerce_executor(executor: ExecutorSpec) -> ExecutorSource:
    """``executor`` in any form an executor argument takes (see the module), as an ExecutorSource; a dict or path is
    read here (ConfigError naming the bad setting). Raises ConfigError naming the value for any other form."""
    if executor is None:
        return ExecutorSource(config=ExecutorConfig.load(None))
    if isinstance(executor, ExecutorSource):
        return executor
    if isinstance(executor, type):
        return ExecutorSource(factory=executor)
    if isinstance(executor, (Executor, PlanRunner)):
        return ExecutorSource(given=executor)
    if isinstance(executor, ExecutorConfig):
        return ExecutorSource(config=executor)
    if isinstance(executor, Mapping):
        return ExecutorSource(config=ExecutorConfig.load(executor))
    if isinstance(executor, (str, os.PathLike)):
        return ExecutorSource(config=ExecutorConfig.load(os.fspath(executor)))
    if callable(executor):
        return ExecutorSource(factory=executor)
    raise ConfigError("executor", executor, f"a {type(executor).__name__} is none of the forms an executor argument "
                      "takes: an executor, a zero-argument factory, an ExecutorConfig, a dict, a .toml/.json path or None")
