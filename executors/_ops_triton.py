"""Triton executor: one SM kernel copies the plan's ranges from raw source/destination addresses.

Ranges are cut into tiles (a tile table built with numpy), copied with the widest element that every
address and size of a launch allows (one launch per element width present; usually one), full tiles
unmasked and tails masked. Loads (h2d) read pinned host memory through unified addressing; on a GPU, host
buffers that are not pinned are refused. With TRITON_INTERPRET=1 set before triton is imported, the kernel
runs on the CPU on host memory (about 5-8 MB/s: for correctness checks only).

Threads: one executor may be shared by any number of threads. ``run`` waits on the calling thread for the
``after`` transfers it cannot order on the device, then holds the executor's lock while it launches (the copy
stream's order is one chain, and the interpreter is not reentrant). A TritonTransfer's methods may be called
from any thread.
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Location, Platform, Target, TransferPlan, cuda_version, hip_version, import_optional

from ._base import (
    After,
    Bindings,
    Executor,
    ExecutorError,
    Stream,
    TargetMismatchError,
    Transfer,
    completed,
    split_after,
    stream_handle,
    transfers_after,
    wait_on_host,
)
from ._binding import BoundMemory, hold_for_stream
from ._lowering import Lowered
from ._memory import BindingError, Memory, check_location
from ._options import TritonOptions

ELEMENTS = ((8, "int64"), (4, "int32"), (2, "int16"), (1, "uint8"))
TABLE_KEYS = ("src", "dst", "nbytes", "tile_range", "tile_start")


def interpreter_active() -> bool:
    """Whether Triton runs kernels on the CPU (TRITON_INTERPRET=1, read by triton at import)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def launch_tables(src: np.ndarray, dst: np.ndarray, nbytes: np.ndarray, tile_bytes: int) -> list[dict[str, Any]]:
    """Group ranges by the widest element their addresses and sizes allow, and tile each group.

    Returns one dict per launch: ``word`` (bytes per element), ``align16``, ``first`` (the index of the group's
    first range), and int64 arrays ``src``, ``dst``, ``nbytes`` (the group's ranges), ``tile_range`` (index into
    the group) and ``tile_start`` (byte offset).
    """
    g = src | dst | nbytes
    word = np.ones(len(g), dtype=np.int64)
    for w, _ in ELEMENTS[-2::-1]:  # 2, 4, 8: widest that divides wins
        word[g % np.uint64(w) == 0] = w
    align16 = (g % np.uint64(16) == 0) & (word == 8)
    key = word * 2 + align16
    out = []
    for k in np.unique(key).tolist():
        sel = np.flatnonzero(key == k)
        n = nbytes[sel].astype(np.int64)
        tiles = -(-n // tile_bytes)
        tile_range = np.repeat(np.arange(len(sel), dtype=np.int64), tiles)
        first = np.cumsum(tiles) - tiles
        tile_start = (np.arange(len(tile_range), dtype=np.int64) - first[tile_range]) * tile_bytes
        out.append(dict(word=k // 2, align16=bool(k % 2), first=int(sel[0]), src=src[sel].view(np.int64),
                        dst=dst[sel].view(np.int64), nbytes=n, tile_range=tile_range, tile_start=tile_start))
    return out


def _torch_target(torch: Any) -> Target:
    if torch.version.hip:
        major, minor, *rest = (int(p) for p in torch.version.hip.split("-")[0].split(".")[:3])
        return Target(platform=Platform.ROCM, runtime_version=hip_version(major, minor, rest[0] if rest else 0))
    major, minor = (int(p) for p in torch.version.cuda.split(".")[:2])
    return Target(platform=Platform.CUDA, runtime_version=cuda_version(major, minor))


@dataclass(eq=False, kw_only=True)
class TritonTransfer(Transfer):
    """Kernels launched on the executor's stream: torch events ``start``/``end``, ``marks[i]`` done with call i;
    ``keep`` holds the bound memory and the uploaded tile table until the kernels are seen finished (``done`` or
    ``wait``)."""

    start: Any = field(repr=False)
    end: Any = field(repr=False)
    marks: tuple[Any, ...] = field(repr=False)
    keep: tuple[Any, ...] = field(repr=False, default=())
    torch: Any = field(repr=False, default=None)
    device: int = 0

    def done(self) -> bool:
        """Whether the end event has completed; ExecutorError if the GPU reports an error."""
        finished = bool(_guard("event query", lambda: self.end.query()))
        if finished:
            self.keep = ()
        return finished

    def wait(self) -> TritonTransfer:
        """Block until the kernels finish and set ``elapsed_s`` from the start/end events; returns self. Raises
        ExecutorError if the GPU reports an error."""
        _guard("event synchronize", self.end.synchronize)
        self.keep = ()
        self.elapsed_s = self.start.elapsed_time(self.end) / 1e3
        return self

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` has completed (IndexError outside the calls; ExecutorError from the GPU)."""
        mark = self.marks[self._call(call)]
        return bool(_guard("event query (call)", mark.query))

    def wait_call(self, call: int) -> TritonTransfer:
        """Block the host until call ``call`` has completed; returns self. IndexError outside the calls."""
        _guard("event synchronize (call)", self.marks[self._call(call)].synchronize)
        return self

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Make ``stream`` (a torch stream or a raw handle of this GPU platform) wait on the device until call ``call``
        (default: the last) is done."""
        cuda = self.torch.cuda
        mark = self.marks[self._call(call)]
        target: Any = stream if isinstance(stream, cuda.Stream) else cuda.ExternalStream(stream_handle(stream, self.device),
                                                                                         device=self.device)
        target.wait_event(mark)


def _guard(call: str, fn: Any) -> Any:
    """``fn()``, with a GPU error torch raises (an illegal address in the kernel, say) as ExecutorError naming ``call``."""
    try:
        return fn()
    except RuntimeError as e:
        raise ExecutorError(call, 0, None, f"the GPU reported {e}", 0) from e


class TritonExecutor(Executor):
    """Copies with a Triton kernel on ``device`` (or on the CPU under TRITON_INTERPRET=1).

    On a GPU the kernel runs on the executor's own stream, which first waits for the caller's compute stream,
    the previous transfer and every ``after`` transfer (on the device for transfers of the GPU's platform, on
    the host before launching for others). Plans of any platform version run (the kernel uses no copy API),
    but the platform must match the GPU's. Under the interpreter ``run`` copies before it returns
    (``synchronous``). A failed launch raises ExecutorError naming the call and its first descriptor.
    Threads: see the module docstring.
    """

    def __init__(self, *, device: int = 0, tile_bytes: int = 8192, num_programs: int | None = None):
        if tile_bytes < 16 or tile_bytes & (tile_bytes - 1):
            raise ValueError(f"tile_bytes = {tile_bytes}: must be a power of two >= 16")
        torch = import_optional("torch", "the Triton executor")
        tl = import_optional("triton.language", "the Triton executor")
        from ._triton_kernel import copy_ranges

        self._torch: Any = torch  # torch's stream and event classes are untyped
        self._kernel, self.tile_bytes = copy_ranges, tile_bytes
        self._elem = {w: getattr(tl, name) for w, name in ELEMENTS}
        self.interpret = interpreter_active()
        self.domain: str | None = None  # under the interpreter nothing is ordered on a device
        self._last_end: Any = None
        self._lock = threading.Lock()
        if self.interpret:
            self._device, self._target, self.num_programs = torch.device("cpu"), Target(), num_programs or 4
            return
        if not torch.cuda.is_available():
            raise ExecutorError("triton", 0, None, "no GPU visible to torch (set TRITON_INTERPRET=1 before triton is "
                                "imported to run the kernel on the CPU)", 0)
        self._device = torch.device("cuda", device)
        self._stream = self._torch.cuda.Stream(self._device)
        self._target = _torch_target(torch)
        self.domain = self._target.platform.value  # "cuda" or "rocm": the driver torch runs on
        self.num_programs = num_programs or 4 * torch.cuda.get_device_properties(self._device).multi_processor_count

    @classmethod
    def from_options(cls, options: TritonOptions) -> TritonExecutor:
        """An executor built from ``options`` (device, tile_bytes, num_programs)."""
        return cls(device=options.device, tile_bytes=options.tile_bytes, num_programs=options.num_programs)

    @property
    def target(self) -> Target:
        """The GPU's platform and runtime version as torch reports them; the default Target under the interpreter."""
        return self._target

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Refuse (BindingError) memory the kernel cannot reach: anything but host memory under the interpreter; on a GPU a
        location mismatch, or host memory that is pageable or of unknown kind (it must be pinned)."""
        if self.interpret:  # the interpreter runs on host memory: every buffer is host memory there
            if mem.location is not None and mem.location is not Location.HOST:
                raise BindingError(buf.name, f"{mem.location.value} memory", "the Triton interpreter copies host memory")
            return
        check_location(buf, mem)
        if buf.location is not Location.HOST:
            return
        pinned = mem.pinned if mem.pinned is not None else _driver_says_pinned(mem.address)
        if not pinned:
            raise BindingError(buf.name, "pageable host memory" if pinned is False else "host memory of unknown kind",
                               "the Triton kernel reads host memory through unified addressing, which needs pinned "
                               "memory (pin it, or use the cuda-batch executor)")

    @property
    def synchronous(self) -> bool:
        """True under the interpreter (the kernel runs before ``run`` returns), False on a GPU."""
        return self.interpret

    def _attach(self, bound: BoundMemory) -> None:
        if not self.interpret:
            hold_for_stream(bound, int(self._stream.cuda_stream))

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Stream = None, after: After = None) -> Transfer:
        """Launch the copies after ``stream``'s pending work and every ``after`` transfer (see ``Executor.run``);
        complete on return under the interpreter, asynchronous on a GPU. Raises TargetMismatchError (other
        platform), BindingError, PlanError or RunArgumentError before anything runs, ExecutorError naming the
        call when a launch fails."""
        t0 = time.perf_counter()
        if not self.interpret and plan.target.platform is not self._target.platform:
            raise TargetMismatchError(plan.target, self._target, None)
        if self.interpret and stream is not None:
            stream_handle(stream)  # a stream of the wrong kind is refused, as by every executor
        waits = transfers_after(after)
        bound = self.memory_for(plan, memory)
        if bound is not memory and not self.interpret:
            hold_for_stream(bound, int(self._stream.cuda_stream))
        low = bound.descriptors(plan)
        # the plan's calls are kept: launches of call i all precede those of call i+1, so completion can be
        # reported per call (per layer with regions_per_call)
        per_call = [launch_tables(low.src[lo:hi], low.dst[lo:hi], low.nbytes[lo:hi], self.tile_bytes)
                    for lo, hi in low.calls()]
        for (lo, _), groups in zip(low.calls(), per_call):
            for g in groups:
                g["first"] += lo
        on_device, on_host = split_after(waits, self.domain)
        wait_on_host(on_host)
        with self._lock:
            if self.interpret:
                for call, groups in enumerate(per_call):
                    for g in groups:
                        self._launch(call, g, {k: self._torch.from_numpy(g[k]) for k in TABLE_KEYS})
                return completed(plan, t0)
            return self._run_on_gpu(plan, low, per_call, bound, stream, on_device)

    def _launch(self, call: int, g: dict[str, Any], t: dict[str, Any]) -> None:
        """Launch the kernel for one group ``g`` of call ``call`` over tile tables ``t``; ExecutorError naming the call and
        the group's first descriptor if the launch fails (calls before it were launched)."""
        try:
            self.start_kernel(g, t)
        except Exception as e:  # triton and torch raise their own classes for a failed compile or launch
            raise ExecutorError("triton launch", call, g["first"], f"{type(e).__name__}: {e}", call) from e

    def start_kernel(self, g: dict[str, Any], t: dict[str, Any]) -> None:
        """The kernel launch itself for group ``g`` (see ``launch_tables``) over tile tables ``t``; a subclass may
        wrap it (a test double fails it to stand for a launch the driver refuses)."""
        num_tiles = len(g["tile_range"])
        grid = (max(1, min(num_tiles, self.num_programs)),)
        self._kernel[grid](t["src"], t["dst"], t["nbytes"], t["tile_range"], t["tile_start"], num_tiles,
                           ELEM=self._elem[g["word"]], WORD=g["word"], BLOCK=self.tile_bytes // g["word"],
                           ALIGN16=g["align16"])

    def _run_on_gpu(self, plan: TransferPlan, low: Lowered, per_call: list[list[dict[str, Any]]], bound: BoundMemory,
                    stream: Stream, after: list[Transfer]) -> TritonTransfer:
        torch = self._torch
        compute = (torch.cuda.current_stream(self._device) if stream is None else stream
                   if isinstance(stream, torch.cuda.Stream) else
                   torch.cuda.ExternalStream(stream_handle(stream, self._device.index or 0), device=self._device))
        cs = self._stream
        cs.wait_stream(compute)
        if self._last_end is not None:
            cs.wait_event(self._last_end)
        for t in after:  # transfers of this GPU platform: ordered on the device
            t.stream_wait(cs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        marks = [torch.cuda.Event() for _ in range(max(len(per_call) - 1, 0))] + [end]  # marks[i]: call i done
        groups = [g for gs in per_call for g in gs]
        packed = np.concatenate([g[k] for g in groups for k in TABLE_KEYS]) if groups else np.zeros(0, np.int64)
        with torch.cuda.stream(cs):
            # the tile table goes up from pinned memory, asynchronously and before ``start``: it is not copy time
            host = torch.from_numpy(packed).pin_memory()
            table = host.to(self._device, non_blocking=True)
            start.record(cs)
            at = 0
            try:
                for call, gs in enumerate(per_call):
                    for g in gs:
                        views = {}
                        for k in TABLE_KEYS:
                            views[k] = table[at:at + len(g[k])]
                            at += len(g[k])
                        self._launch(call, g, views)
                    if call < len(per_call) - 1:
                        marks[call].record(cs)
            finally:  # successors order after whatever was launched, even on failure
                end.record(cs)
                self._last_end = end
        return TritonTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls, domain=self.domain,
                              start=start, end=end, marks=tuple(marks), keep=(*bound.owners(), host, table), torch=torch,
                              device=self._device.index or 0)


def _driver_says_pinned(address: int) -> bool | None:
    """Ask the CUDA runtime whether ``address`` is page-locked host memory (None if it cannot tell)."""
    try:
        from cuda.bindings import runtime as rt  # type: ignore[import-untyped, import-not-found, unused-ignore]
    except ImportError:
        return None
    err, _flags = rt.cudaHostGetFlags(address)
    return int(err) == 0
