"""kvxfer.executors: run a TransferPlan on a backend. Heavy backends import their drivers lazily."""
from .base import BindingError, Executor, ExecutorError, Transfer
from .ops_numpy import NumpyExecutor

__all__ = ["BindingError", "Executor", "ExecutorError", "NumpyExecutor", "Transfer"]
