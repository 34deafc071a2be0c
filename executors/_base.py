"""What every executor shares: errors, the Transfer handle, the Executor interface (bind once, run), and the
two orderings every ``run`` takes: after the caller's compute ``stream``, and ``after`` other transfers.

Binding itself (resolving memory, checking it, lowering ranges to addresses) lives in ``_binding``.
"""
from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, SupportsInt, TypeAlias

from kvxfer.planner import Buffer, Case, Layout, Target, TransferPlan

from ._binding import BoundMemory, bind, plan_buffers
from ._memory import BindingError, Memory, check_location


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


class HasCudaStream(Protocol):
    """A stream object that carries its raw handle (a torch stream: ``cuda_stream``)."""

    @property
    def cuda_stream(self) -> int:
        """The raw stream handle (CUstream / hipStream_t) as an int."""
        ...


Stream: TypeAlias = SupportsInt | HasCudaStream | None  # an int handle, a CUstream, a torch stream, or None


class RunArgumentError(ValueError):
    """A bad argument to ``run`` or a Transfer method (``stream``, ``after``): names the argument, index and value."""

    def __init__(self, field: str, value: Any, reason: str, index: int | None = None):
        self.field, self.index, self.value, self.reason = field, index, value, reason
        where = field if index is None else f"{field}[{index}]"
        text = repr(value)
        super().__init__(f"{where} = {text if len(text) <= 80 else type(value).__name__ + ' object'}: {reason}")


class ExecutorError(RuntimeError):
    """A driver call failed. Names the call, the chunk, the failing descriptor and what was already issued."""

    def __init__(self, call: str, chunk: int, descriptor: int | None, reason: str, issued_chunks: int):
        self.call, self.chunk, self.descriptor, self.reason, self.issued_chunks = call, chunk, descriptor, reason, issued_chunks
        where = f"chunk {chunk}" + (f", descriptor {descriptor}" if descriptor is not None else "")
        super().__init__(f"{call} failed at {where}: {reason}; chunks 0..{chunk - 1} were issued before it"
                         if chunk else f"{call} failed at {where}: {reason}; nothing was issued before it")


@dataclass(eq=False, kw_only=True)
class Transfer:
    """A submitted plan: ``nbytes``, ``ranges`` and ``calls`` it moves, ``elapsed_s`` once known.

    ``done()`` polls, ``wait()`` blocks and returns self (raising the transfer's ExecutorError if it failed). Per
    call (a layer, with ``PlanOptions(regions_per_call=...)``): ``call_done(i)``, ``wait_call(i)``, and
    ``stream_wait(stream, i)``, which makes a compute stream wait on the device where the backend has device
    events, else waits on the host. ``domain`` names the driver whose streams ``stream_wait`` can order on the
    device ("cuda", "rocm", a test shim's own), None for none. Each backend has its own subclass; its methods
    may be called from any thread.
    """

    nbytes: int
    ranges: int
    calls: int
    elapsed_s: float | None = None
    domain: str | None = field(default=None, repr=False)

    def _call(self, call: int) -> int:
        if not -self.calls <= call < self.calls:
            raise IndexError(f"call = {call}: the transfer has {self.calls} calls")
        return call % self.calls

    def done(self) -> bool:
        """Whether every call has finished (polls; never blocks)."""
        raise NotImplementedError

    def wait(self) -> Transfer:
        """Block until every call has finished, set ``elapsed_s`` where the backend measures it, and return self."""
        raise NotImplementedError

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` has finished (DMA and Triton executors finish calls in order)."""
        raise NotImplementedError

    def wait_call(self, call: int) -> Transfer:
        """Block the host until call ``call`` has finished."""
        raise NotImplementedError

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Order ``stream`` after call ``call`` (default: the last): on the device, without a host sync, where the
        backend has device events; else by waiting on the host until the call has finished."""
        raise NotImplementedError


@dataclass(eq=False, kw_only=True)
class CompletedTransfer(Transfer):
    """A transfer that finished before ``run`` returned (synchronous executors)."""

    def done(self) -> bool:
        """Always True."""
        return True

    def wait(self) -> CompletedTransfer:
        """Return self: nothing left to wait for."""
        return self

    def call_done(self, call: int) -> bool:
        """True for any valid call index; IndexError outside ``-calls..calls-1``."""
        self._call(call)
        return True

    def wait_call(self, call: int) -> CompletedTransfer:
        """Return self for any valid call index; IndexError outside ``-calls..calls-1``."""
        self._call(call)
        return self

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Nothing to wait for (the copies finished on return); IndexError for an invalid call index."""
        self._call(call)  # finished on return: nothing left to wait for


def stream_handle(stream: Stream, device: int = 0) -> int:
    """A raw stream handle from None (torch's current stream on ``device``, on the calling thread, when torch has
    initialized a GPU; else the legacy default stream 0), an int, a torch stream (``cuda_stream``) or a
    cuda-bindings CUstream. RunArgumentError for anything else."""
    if stream is None:
        torch: Any = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
            return int(torch.cuda.current_stream(device).cuda_stream)
        return 0
    handle: Any = getattr(stream, "cuda_stream", stream)
    if isinstance(handle, (bool, str, bytes, float)):
        raise RunArgumentError("stream", stream, "expected None, an int handle, a torch stream or a CUstream")
    try:
        value = int(handle)
    except (TypeError, ValueError):
        raise RunArgumentError("stream", stream, "expected None, an int handle, a torch stream or a CUstream") from None
    if value < 0 or value >= 1 << 64:
        raise RunArgumentError("stream", stream, "a stream handle is an unsigned 64-bit value")
    return value


def synchronize_stream(stream: Stream, device: int = 0) -> None:
    """Block the host until the work queued on ``stream`` so far is done (for executors that post from the host).

    None means the current stream on ``device`` when torch has initialized a GPU (else no GPU work can be
    queued: nothing to wait for). RunArgumentError for a stream that cannot be waited for here."""
    torch: Any = sys.modules.get("torch")
    gpu = torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized()
    if stream is None:
        if gpu:
            torch.cuda.current_stream(device).synchronize()
        return
    if hasattr(stream, "synchronize") and hasattr(stream, "cuda_stream"):
        stream.synchronize()
        return
    handle = stream_handle(stream, device)
    if not gpu:
        raise RunArgumentError("stream", stream, "a raw stream handle can only be waited for with torch on a GPU")
    torch.cuda.ExternalStream(handle, device=device).synchronize()


After: TypeAlias = Transfer | Iterable[Transfer] | None


def transfers_after(after: After) -> tuple[Transfer, ...]:
    """``after`` (None, a Transfer, or an iterable of Transfers) as a tuple; RunArgumentError naming the index of
    anything else."""
    if after is None:
        return ()
    if isinstance(after, Transfer):
        return (after,)
    if isinstance(after, (str, bytes, Mapping)) or not isinstance(after, Iterable):
        raise RunArgumentError("after", after, "expected None, a Transfer or a sequence of Transfers")
    items = tuple(after)
    for i, t in enumerate(items):
        if not isinstance(t, Transfer):
            raise RunArgumentError("after", t, "expected a Transfer", i)
    return items


def split_after(after: tuple[Transfer, ...], domain: str | None) -> tuple[list[Transfer], list[Transfer]]:
    """(those ``stream_wait`` can order on a stream of driver ``domain`` on the device, the others)."""
    device = [t for t in after if domain is not None and t.domain == domain]
    return device, [t for t in after if domain is None or t.domain != domain]


def wait_on_host(transfers: Iterable[Transfer]) -> None:
    """Block until every transfer has finished, successfully or not: a failed transfer's error belongs to its
    owner (its own ``wait``), not to the run that waits for it. One blocking ``wait`` per transfer, in order (never a
    poll of ``done``): the waiting thread holds no GIL and wakes when the last one finishes."""
    for t in transfers:
        try:
            t.wait()
        except Exception:  # reported by that transfer's owner
            pass


def completed(plan: TransferPlan, t0: float) -> CompletedTransfer:
    """A CompletedTransfer for ``plan`` whose ``elapsed_s`` is the time since ``t0`` (a ``time.perf_counter()`` value)."""
    return CompletedTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls,
                             elapsed_s=time.perf_counter() - t0)


Bindings = Mapping[str, Any]


class Executor:
    """Runs a TransferPlan exactly as planned. Subclasses lower ranges and calls one to one.

    ``bind(buffers, bindings)`` resolves and checks memory once (and pins or registers it where the backend
    needs that); ``run(plan, bound)`` then only checks the plan's ranges against the bound sizes and adds
    bases to offsets. ``run(plan, {name: memory})`` binds for one run. ``run`` returns a Transfer, complete on
    return where ``synchronous`` is True. Every run is ordered after the work queued on the caller's
    ``stream`` at the call and after every transfer in ``after``. ``target`` is the platform and runtime found.
    """

    @classmethod
    def from_options(cls, options: Any) -> Executor:
        """An executor from its backend's typed options (``kvxfer.executors``' ``*Options``: each backend takes its own
        model, so the base class cannot name one)."""
        return cls()

    @property
    def target(self) -> Target:
        """The platform and runtime version this executor runs on (base: the default Target)."""
        return Target()

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse memory this backend cannot address for ``buf`` (BindingError). Default: location only."""
        check_location(buf, mem)

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Bindings) -> BoundMemory:
        """Resolve, check (and pin or register, where the backend needs it) each buffer's memory, once.
        Raises BindingError naming the buffer. Release with ``bound.close()`` or ``unbind(bound)``."""
        bound = bind(buffers, bindings, check=self.check_memory, bound_by=type(self).__name__)
        self._attach(bound)
        return bound

    def unbind(self, bound: BoundMemory) -> None:
        """Release ``bound`` (same as ``bound.close()``)."""
        bound.close()

    def _attach(self, bound: BoundMemory) -> None:
        """Backend hook run once per ``bind``: registration and the like."""

    def memory_for(self, plan: TransferPlan, memory: BoundMemory | Bindings) -> BoundMemory:
        """``memory`` if it is a BoundMemory made by this kind of executor, else the plan's buffers bound for one run.
        Raises BindingError for a BoundMemory made by another executor kind, or memory that does not fit."""
        if isinstance(memory, BoundMemory):
            if memory.bound_by != type(self).__name__:
                raise BindingError(memory.bound_by, repr(memory), f"bound by another executor kind; bind with this "
                                   f"{type(self).__name__}")
            return memory
        return bind(plan.buffers, memory, check=self.check_memory, required=plan_buffers(plan),
                    bound_by=type(self).__name__)

    @property
    def synchronous(self) -> bool:
        """True when ``run`` has finished every copy by the time it returns; False when it only issues them."""
        return False

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Stream = None, after: After = None) -> Transfer:
        """Run ``plan`` on ``memory`` (a BoundMemory from ``bind``, or ``{name: memory}`` for one run) and return its
        Transfer.

        ``stream``: the caller's compute stream (None: the current stream of the executor's device, resolved on
        the calling thread; an int handle; a torch stream); GPU executors order the copies after the work queued
        on it at the call, host executors have nothing to order. ``after``: None, a Transfer or a sequence of
        Transfers (of any executor): the copies start only once every one of them has finished, successfully or
        not (their errors are their owners'). Each backend implements it."""
        raise NotImplementedError

    def run_case(self, case: Case | dict[str, Any] | str, bindings: BoundMemory | Bindings, stream: Stream = None, *,
                 replan: bool = True, after: After = None) -> Transfer:
        """Plan ``case`` and run it. With ``replan`` the case's target is replaced by the runtime found
        (``self.target``), so a case written for another version still runs; without it a mismatch raises."""
        case = Case.coerce(case, "case")
        if replan:
            case = Case(layout=case.layout, mapping=case.mapping, target=self.target, options=case.options)
        return self.run(case.plan(), bindings, stream, after)

    def close(self) -> None:
        """Release driver resources (streams); the executor is unusable afterwards."""

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
