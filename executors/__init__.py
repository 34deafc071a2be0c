"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily."""
from .base import BindingError, Executor, ExecutorError, Transfer
from .ops_numpy import NumpyExecutor

__all__ = ["BindingError", "Executor", "ExecutorError", "NumpyExecutor", "Transfer"]


def __getattr__(name: str):
    # NixlExecutor lives in ops_nixl, which imports nixl only when an agent is created
    if name == "NixlExecutor":
        from .ops_nixl import NixlExecutor
        return NixlExecutor
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
