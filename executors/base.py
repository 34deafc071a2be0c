"""What every executor shares: binding buffer names to memory, the Transfer handle, the Executor interface."""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Case, Location, Target, TransferPlan


class TargetMismatchError(ValueError):
    """The plan was made for a different platform or runtime version than the one found."""

    def __init__(self, plan_target: Target, runtime_target: Target, gate: str | None):
        self.plan_target, self.runtime_target, self.gate = plan_target, runtime_target, gate
        why = f"they differ on gate {gate!r}" if gate else "the platforms differ"
        super().__init__(f"plan target {plan_target.label} does not fit the runtime found, {runtime_target.label}: "
                         f"{why}; re-plan for {runtime_target.label} (kvxfer run --replan, or Executor.run_case(case, ..., "
                         f"replan=True))")


def check_plan_target(plan: TransferPlan, runtime: Target) -> None:
    """Raise TargetMismatchError unless ``runtime`` has the plan's platform and sits on the same side of
    every version gate the plan's target used."""
    if plan.target.platform is not runtime.platform:
        raise TargetMismatchError(plan.target, runtime, None)
    for (name, want), (_, have) in zip(plan.target.gates(), runtime.gates()):
        if want != have:
            raise TargetMismatchError(plan.target, runtime, name)


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
    """Byte views for every buffer the plan touches, checked before anything is copied (the plan's ranges
    too: a hand-made or edited plan must not copy half and then fail)."""
    plan.check()
    used_src = set(plan.buffers_used("src").tolist())
    used_dst = set(plan.buffers_used("dst").tolist())
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
    _keep: Any = field(default=None, repr=False)  # bound memory and events, alive until the copies finish
    _call_poll: Callable[[int], bool] | None = field(default=None, repr=False)
    _call_wait: Callable[[int], None] | None = field(default=None, repr=False)
    _stream_wait: Callable[[Any, int], None] | None = field(default=None, repr=False)

    def done(self) -> bool:
        return self._poll()

    def _call(self, call: int) -> int:
        if not -self.calls <= call < self.calls:
            raise IndexError(f"call = {call}: the transfer has {self.calls} calls")
        return call % self.calls

    def _hook(self, hook: Callable[..., Any] | None, what: str) -> Callable[..., Any]:
        if hook is None:
            raise NotImplementedError(f"this transfer ({type(self).__name__}) does not report {what}")
        return hook

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` has finished. With ``PlanOptions(regions_per_call=...)`` a call is a layer (or
        N layers): per-layer completion. DMA and Triton executors finish calls in order."""
        return self._hook(self._call_poll, "per-call completion")(self._call(call))

    def wait_call(self, call: int) -> Transfer:
        """Block the host until call ``call`` has finished."""
        self._hook(self._call_wait, "per-call completion")(self._call(call))
        return self

    def stream_wait(self, stream: Any, call: int = -1) -> None:
        """Make ``stream`` (a compute stream) wait on the device, without a host sync, until call ``call``
        (default: the last) has finished."""
        self._hook(self._stream_wait, "stream ordering")(stream, self._call(call))

    def wait(self) -> Transfer:
        t = self._wait()
        if t is not None:
            self.elapsed_s = t
        return self


class Executor:
    """Runs a TransferPlan exactly as planned. Subclasses lower ranges and calls one to one.

    ``run`` returns a Transfer: asynchronous on GPUs (poll ``done()``, block with ``wait()``), complete on
    return on the CPU. ``target`` is the platform and runtime version found, for planning.
    """

    name = "base"

    @property
    def target(self) -> Target:
        return Target()

    def run(self, plan: TransferPlan, bindings: Mapping[str, Any], stream: Any = None) -> Transfer:
        raise NotImplementedError

    def run_case(self, case: Case | dict | str, bindings: Mapping[str, Any], stream: Any = None, *,
                 replan: bool = True) -> Transfer:
        """Plan ``case`` and run it. With ``replan`` the case's target is replaced by the runtime found
        (``self.target``), so a case written for another version still runs; without it a mismatch raises."""
        case = Case.coerce(case, "case")
        if replan:
            case = Case(layout=case.layout, mapping=case.mapping, target=self.target, options=case.options)
        return self.run(case.plan(), bindings, stream)

    def close(self) -> None:
        """Release driver resources (streams); the executor is unusable afterwards."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def completed(plan: TransferPlan, t0: float) -> Transfer:
    """A Transfer for synchronous executors: finished on return."""
    return Transfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls,
                    elapsed_s=time.perf_counter() - t0, _call_poll=lambda i: True, _call_wait=lambda i: None,
                    _stream_wait=lambda stream, i: None)  # finished on return: nothing left to wait for


# ---- address binding (executors that hand raw addresses to a driver) -------------------------------------
U64 = 1 << 64


@dataclass(frozen=True)
class RawMemory:
    """Memory given by address: ``nbytes`` bytes at ``address``. ``location`` None means unknown (not checked)."""

    address: int
    nbytes: int
    location: Location | None = None
    device: int | None = None
    pinned: bool | None = None
    readonly: bool = False


@dataclass(frozen=True)
class Bound:
    """One buffer bound to memory: absolute address, size, where it lives (None = unknown), and its owner."""

    address: int
    nbytes: int
    location: Location | None
    device: int | None
    pinned: bool | None
    writable: bool
    owner: Any = field(repr=False, default=None)


def resolve_memory(obj: Any, name: str) -> Bound:
    """Address and size of a torch tensor, numpy array, ``__cuda_array_interface__`` object, RawMemory or
    ``(address, nbytes)`` pair. Raises BindingError for non-contiguous, null or unsupported memory."""
    if isinstance(obj, RawMemory):
        b = Bound(int(obj.address), int(obj.nbytes), obj.location, obj.device, obj.pinned, not obj.readonly, obj)
    elif isinstance(obj, tuple) and len(obj) == 2 and all(isinstance(v, (int, np.integer)) for v in obj):
        b = Bound(int(obj[0]), int(obj[1]), None, None, None, True, obj)
    elif type(obj).__module__.startswith("torch"):
        if not obj.is_contiguous():
            raise BindingError(name, _describe(obj), "tensor is not contiguous")
        dev = obj.device
        if dev.type == "cpu":
            loc, ordinal, pinned = Location.HOST, None, bool(obj.is_pinned()) if obj.numel() else False
        elif dev.type == "cuda":
            loc, ordinal, pinned = Location.DEVICE, dev.index if dev.index is not None else 0, None
        else:
            raise BindingError(name, _describe(obj), f"tensor on {dev.type}: expected cpu or cuda")
        b = Bound(int(obj.data_ptr()), obj.numel() * obj.element_size(), loc, ordinal, pinned, True, obj)
    elif isinstance(obj, np.ndarray):
        if not obj.flags.c_contiguous:
            raise BindingError(name, _describe(obj), "array is not C-contiguous")
        b = Bound(int(obj.__array_interface__["data"][0]), int(obj.nbytes), Location.HOST, None, None,
                  bool(obj.flags.writeable), obj)
    elif hasattr(obj, "__cuda_array_interface__"):
        cai = obj.__cuda_array_interface__
        if cai.get("strides") is not None:
            raise BindingError(name, _describe(obj), "__cuda_array_interface__ with strides: pass contiguous memory")
        nbytes = int(np.prod(cai["shape"], dtype=np.int64)) * np.dtype(cai["typestr"]).itemsize
        b = Bound(int(cai["data"][0]), nbytes, Location.DEVICE, None, None, not cai["data"][1], obj)
    else:
        raise BindingError(name, type(obj).__name__, "expected a torch tensor, numpy array, RawMemory or "
                           "(address, nbytes) pair")
    if b.nbytes > 0 and b.address == 0:
        raise BindingError(name, "address 0", "null address")
    if b.address < 0 or b.nbytes < 0 or b.address + b.nbytes > U64:
        raise BindingError(name, f"[{b.address:#x}, +{b.nbytes})", "does not fit the 64-bit address space")
    return b


def check_location(buf: Buffer, bound: Bound, *, host_as_device: bool = False) -> None:
    """Raise BindingError when memory sits where the plan's buffer does not (unknown locations pass).

    ``host_as_device`` lets device buffers be host memory: for host-memory stand-ins of a GPU runtime (shims).
    """
    if bound.location is None or (host_as_device and buf.location is Location.DEVICE):
        return
    if bound.location is not buf.location:
        raise BindingError(buf.name, f"{bound.location.value} memory",
                           f"the plan places this buffer in {buf.location.value} memory")
    if buf.location is Location.DEVICE and bound.device is not None and bound.device != buf.device:
        raise BindingError(buf.name, f"device {bound.device}", f"the plan places this buffer on device {buf.device}")


@dataclass
class Addresses:
    """Absolute source and destination addresses of every range (uint64), and the buffers they came from."""

    src: np.ndarray
    dst: np.ndarray
    bound: list[Bound | None]


def bind_addresses(plan: TransferPlan, bindings: Mapping[str, Any],
                   check: Callable[[Buffer, Bound], None] = check_location,
                   out: tuple[np.ndarray, np.ndarray] | None = None) -> Addresses:
    """Turn the plan's (buffer, offset) pairs into absolute uint64 addresses, vectorized.

    Every buffer the plan touches must be bound, at least as large as the plan's buffer, writable where
    written, and accepted by ``check``. Every range must lie inside its buffer (a malformed plan is refused,
    naming the range). Addresses are written into ``out`` (two uint64 arrays of at least num_ranges) when
    given. Raises BindingError; nothing is copied by this function.
    """
    n = plan.num_ranges
    used_src = plan.buffers_used("src")
    used_dst = plan.buffers_used("dst")
    bound: list[Bound | None] = [None] * len(plan.buffers)
    base = np.zeros(len(plan.buffers), dtype=np.uint64)
    size = np.zeros(len(plan.buffers), dtype=np.uint64)
    for i in np.union1d(used_src, used_dst).tolist():
        if not 0 <= i < len(plan.buffers):
            raise BindingError(f"#{i}", "buffer index", f"the plan has {len(plan.buffers)} buffers")
        buf = plan.buffers[i]
        if buf.name not in bindings:
            raise BindingError(buf.name, "missing", f"the plan reads or writes this buffer (known: {sorted(bindings)})")
        b = resolve_memory(bindings[buf.name], buf.name)
        if b.nbytes < buf.nbytes:
            raise BindingError(buf.name, f"{b.nbytes} bytes", f"smaller than the plan's buffer of {buf.nbytes} bytes")
        if not b.writable and i in used_dst:
            raise BindingError(buf.name, _describe(b.owner), "read-only, but the plan writes to it")
        check(buf, b)
        bound[i], base[i], size[i] = b, b.address, buf.nbytes
    src = out[0][:n] if out is not None else np.empty(n, dtype=np.uint64)
    dst = out[1][:n] if out is not None else np.empty(n, dtype=np.uint64)
    for side, bufs, offs, addr in (("src", plan.src_buf, plan.src_offset, src), ("dst", plan.dst_buf, plan.dst_offset, dst)):
        end = offs + plan.nbytes  # uint64: wraps on malformed input, caught by end < offs
        bad = (end < offs) | (end > size[bufs])
        if bad.any():
            j = int(np.argmax(bad))
            raise BindingError(plan.buffers[int(bufs[j])].name, f"range {j} [{int(offs[j])}, +{int(plan.nbytes[j])})",
                               f"{side} range runs past the buffer's {int(size[bufs[j]])} bytes (malformed plan)")
        np.add(base[bufs], offs, out=addr)  # cannot wrap: base + size <= 2^64 was checked per buffer
    return Addresses(src, dst, bound)
