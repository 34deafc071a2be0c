"""What every executor shares: binding buffer names to memory, the Transfer handle, the Executor interface."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from kvxfer.planner import TransferPlan


class BindingError(ValueError):
    """A binding does not fit the plan: missing, too small, not contiguous, or read-only where written."""

    def __init__(self, buffer: str, value: Any, reason: str):
        self.buffer, self.value, self.reason = buffer, value, reason
        super().__init__(f"bindings[{buffer!r}] = {value}: {reason}")


class ExecutorError(RuntimeError):
    """A driver call failed. Names the call, the chunk, the failing descriptor and what was already issued."""

    def __init__(self, call: str, chunk: int, descriptor: int | None, reason: str, issued_chunks: int):
        self.call, self.chunk, self.descriptor, self.reason, self.issued_chunks = call, chunk, descriptor, reason, issued_chunks
        where = f"chunk {chunk}" + (f", descriptor {descriptor}" if descriptor is not None else "")
        super().__init__(f"{call} failed at {where}: {reason}; chunks 0..{chunk - 1} were issued before it"
                         if chunk else f"{call} failed at {where}: {reason}; nothing was issued before it")


def _describe(obj: Any) -> str:
    shape = getattr(obj, "shape", None)
    return f"{type(obj).__name__}{tuple(shape) if shape is not None else ''}"


def as_byte_view(obj: Any, name: str) -> np.ndarray:
    """A flat uint8 view (no copy) of a contiguous numpy array or CPU torch tensor."""
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise BindingError(name, _describe(obj), f"tensor is on {obj.device}; this executor needs host memory")
        if not obj.is_contiguous():
            raise BindingError(name, _describe(obj), "tensor is not contiguous")
        obj = obj.detach().reshape(-1).view(__import__("torch").uint8).numpy()
    if not isinstance(obj, np.ndarray):
        raise BindingError(name, type(obj).__name__, "expected a numpy array or CPU torch tensor")
    if not obj.flags.c_contiguous:
        raise BindingError(name, _describe(obj), "array is not C-contiguous")
    return obj.reshape(-1).view(np.uint8)


def bind_views(plan: TransferPlan, bindings: Mapping[str, Any]) -> list[np.ndarray | None]:
    """Byte views for every buffer the plan touches, checked before anything is copied."""
    used_src = set(np.unique(plan.src_buf).tolist())
    used_dst = set(np.unique(plan.dst_buf).tolist())
    views: list[np.ndarray | None] = []
    for i, buf in enumerate(plan.buffers):
        if i not in used_src and i not in used_dst:
            views.append(None)
            continue
        if buf.name not in bindings:
            raise BindingError(buf.name, "missing", f"the plan reads or writes this buffer (known: {sorted(bindings)})")
        v = as_byte_view(bindings[buf.name], buf.name)
        if v.nbytes < buf.nbytes:
            raise BindingError(buf.name, f"{v.nbytes} bytes", f"smaller than the plan's buffer of {buf.nbytes} bytes")
        if i in used_dst and not v.flags.writeable:
            raise BindingError(buf.name, _describe(bindings[buf.name]), "read-only, but the plan writes to it")
        views.append(v)
    return views


@dataclass
class Transfer:
    """A submitted plan. ``done()`` polls, ``wait()`` blocks and returns self; ``elapsed_s`` once known."""

    nbytes: int
    ranges: int
    calls: int
    _poll: Callable[[], bool] = field(default=lambda: True, repr=False)
    _wait: Callable[[], float | None] = field(default=lambda: None, repr=False)
    elapsed_s: float | None = None

    def done(self) -> bool:
        return self._poll()

    def wait(self) -> Transfer:
        t = self._wait()
        if t is not None:
            self.elapsed_s = t
        return self


class Executor:
    """Runs a TransferPlan exactly as planned. Subclasses lower ranges and calls one to one."""

    name = "base"

    def run(self, plan: TransferPlan, bindings: Mapping[str, Any], stream: Any = None) -> Transfer:
        raise NotImplementedError


def completed(plan: TransferPlan, t0: float) -> Transfer:
    """A Transfer for synchronous executors: finished on return."""
    return Transfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls,
                    elapsed_s=time.perf_counter() - t0)
