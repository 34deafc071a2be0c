"""Run a TransferPlan through NIXL: one side of the plan is local registered memory, the other a remote agent's.

How bindings split a plan: each buffer name maps to local memory (numpy array, CPU or CUDA tensor, registered
with ``register``) or to a ``RemoteBuffer`` (another agent's registered segment, from ``add_peer``). Every
range must go between a local and a remote buffer, and the plan as a whole must have one remote side:
- the plan's sources are remote (a load from a remote cache tier, the decode side pulling a prefill's
  blocks): each call is one NIXL READ into local memory;
- the plan's destinations are remote (a store to a remote tier, prefill pushing to decode): one WRITE.
A buffer bound to a ``FileBinding`` (file_trust) is a file: this agent reads and writes it itself through a
storage backend (``backends=["POSIX"]``, or GDS/GDS_MT on GPU machines), with no notification.
Otherwise each call's transfer carries the notification ``kvxfer:<plan fingerprint[:12]>:<run>:<call>;`` so the
other side can tell which plan and call have landed (``wait_notifs``).

NIXL posts from the host and has no device events: ``run`` waits on the host for its ``after`` transfers and,
when the plan's local memory is on a GPU, for the work queued on the caller's ``stream``; a NixlTransfer's
``stream_wait`` waits on the host. A NixlTransfer holds its calls' handles in an ``Inflight``, which polls them
with a deadline, drains the others when one fails, and never releases memory a call may still touch.

The memory side (segments, remote buffers, peer descriptions, registrations, files) is ``nixl_memory``; the
bootstrap of a second agent (metadata exchange, a peer process) is ``nixl_peer``.
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, Layout, TransferPlan, import_optional

from ._base import (
    After,
    Bindings,
    Executor,
    ExecutorError,
    Stream,
    Transfer,
    stream_handle,
    synchronize_stream,
    transfers_after,
    wait_on_host,
)
from ._binding import BoundMemory
from ._lowering import Lowered
from ._memory import BindingError, Memory
from ._options import NixlOptions
from .file_trust import FileBinding
from .nixl_memory import (
    PeerInfo,
    PeerInfoError,
    Registration,
    RemoteBuffer,
    Segment,
    file_remote,
    register,
    register_files,
    segment_of,
)

__all__ = ["NixlExecutor", "NixlOptions", "NixlTransfer", "PeerInfo", "PeerInfoError", "RemoteBuffer"]

# ---- one plan in flight: posting, polling with a deadline, release, precise failure ----------------------------
SPIN_S = 2e-3  # busy-poll this long before sleeping: small transfers finish within it
SLEEP_S = 2e-4


def poll_until(ready: Callable[[], bool], timeout_s: float) -> bool:
    """Call ``ready`` until it returns True (-> True) or ``timeout_s`` passes (-> False)."""
    start = time.perf_counter()
    while not ready():
        waited = time.perf_counter() - start
        if waited > timeout_s:
            return False
        if waited > SPIN_S:
            time.sleep(SLEEP_S)
    return True


def reason(e: BaseException) -> str:
    """A NIXL exception as text; the binding's exception class names the status (nixlNotFoundError, ...)."""
    return f"{type(e).__name__}: {e}"


class Inflight:
    """The transfer handles of one run, by call index. Memory in ``keep`` stays referenced until they finish.

    Any failure (rejected post, a transfer in ERR, a deadline passed) first gives the other calls at most
    ``drain_s`` to stop touching memory, releases the handles that stopped, then raises ExecutorError; the
    same error is raised again by every later ``poll``/``wait``, so a failed plan never reads as done. So
    ``wait()`` returns or raises within ``timeout_s + drain_s``. Calls still in flight when the drain gives up
    are never released: their memory stays referenced here and ``registrations`` are marked unusable.
    """

    def __init__(self, agent: Any, t0: float, timeout_s: float, keep: list[Any], notifs: tuple[bytes, ...], *,
                 drain_s: float = 1.0, registrations: list[Any] | None = None, notify: bool = True):
        self.agent, self.t0, self.timeout_s, self.keep, self.notifs = agent, t0, timeout_s, keep, notifs
        self.drain_s, self.registrations = drain_s, list(registrations or [])
        self.notify = notify  # False: the tags only name the calls (storage backends take no notifications)
        self.stuck: dict[int, Any] = {}  # calls that outlived the drain: handles kept, memory kept
        self.pending: dict[int, Any] = {}
        self.posted = 0
        self.error: ExecutorError | None = None
        self.elapsed: float | None = None

    def post(self, call: int, make: Callable[[], Any], what: str) -> None:
        """Create the transfer with ``make()`` and post it; raises ExecutorError if NIXL rejects either step."""
        try:
            handle = make()
        except Exception as e:  # the binding raises one class per nixl status
            self._fail("initialize_xfer", call, f"{what}: {reason(e)}")
        self.pending[call] = handle
        self.posted += 1
        try:
            state = self.agent.transfer(handle, self.notifs[call] if self.notify else b"")
        except Exception as e:
            state = reason(e)
        if state == "DONE":
            self._release(call)
        elif state != "PROC":
            self._fail("transfer", call, f"{what}: posting returned {state}")

    def _state(self, call: int) -> str:
        try:
            return str(self.agent.check_xfer_state(self.pending[call]))
        except Exception as e:
            return reason(e)

    def _release(self, call: int) -> None:
        self.pending.pop(call).release()

    def poll(self) -> bool:
        """True once every call is DONE; raises ExecutorError for a call in ERR (or any earlier failure)."""
        if self.error is not None:
            raise self.error
        for call in sorted(self.pending):
            state = self._state(call)
            if state == "DONE":
                self._release(call)
            elif state != "PROC":
                self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} ended in {state}")
        if not self.pending and self.elapsed is None:
            self.elapsed = time.perf_counter() - self.t0
            self.keep = []
        return not self.pending

    def call_done(self, call: int) -> bool:
        """True once call ``call`` is DONE (NIXL calls finish independently); raises like ``poll``."""
        self.poll()
        return call not in self.pending

    def wait_call(self, call: int) -> None:
        """Poll until call ``call`` is DONE; ExecutorError when ``timeout_s`` passes first."""
        if not poll_until(lambda: self.call_done(call), self.timeout_s):
            self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} still in progress after "
                       f"{self.timeout_s}s")

    def wait(self) -> float | None:
        """Poll until done; ExecutorError when ``timeout_s`` passes first. Returns seconds since run()."""
        if not poll_until(self.poll, self.timeout_s):
            call = min(self.pending)
            self._fail("check_xfer_state", call, f"transfer {self.notifs[call].decode()} still in progress after "
                       f"{self.timeout_s}s ({len(self.pending)} calls unfinished)")
        return self.elapsed

    def _fail(self, what: str, call: int, why: str) -> None:
        """Drain the other calls (at most ``drain_s``), release what stopped, record and raise the error."""
        timed_out = "still in progress" in why  # that call may itself still be moving bytes: drain it too
        failed = None if timed_out else self.pending.pop(call, None)
        others = dict(self.pending)
        drained = poll_until(lambda: all(self._state(c) != "PROC" for c in others), self.drain_s)
        stopped = {c: h for c, h in others.items() if drained or self._state(c) != "PROC"}
        self.stuck = {c: h for c, h in others.items() if c not in stopped}
        leftover = []
        for h in ([failed] if failed is not None else []) + list(stopped.values()):
            try:
                h.release()
            except Exception as e:
                leftover.append(reason(e))
        self.pending = {}
        note = f"; {len(others)} other calls " + ("drained" if not self.stuck else
                                                  f"given {self.drain_s}s to drain, {len(self.stuck)} still running")
        if leftover:
            note += f"; release failed: {leftover[0]}"
        if self.stuck:  # bytes may still move: keep the memory referenced, never reuse or deregister it
            for reg in self.registrations:
                reg.mark_unusable()
            note += "; their memory stays referenced and its registration is marked unusable"
        elif not leftover:
            self.keep = []  # nothing in flight references the memory any more
        self.error = ExecutorError(what, call, None, f"{why} ({self.posted} of {len(self.notifs)} calls posted"
                                   f"{note if others or self.stuck else ''}); destination bytes may be partly written",
                                   issued_chunks=self.posted)
        raise self.error


@dataclass(eq=False, kw_only=True)
class NixlTransfer(Transfer):
    """A plan in flight through NIXL: ``op`` READ or WRITE, the remote ``peer``, one notification per call.
    NIXL calls finish independently; NIXL has no device events, so ``stream_wait`` waits on the host."""

    flight: Inflight | None = field(repr=False, default=None)
    op: str = ""
    peer: str = ""
    notifs: tuple[bytes, ...] = ()

    def done(self) -> bool:
        """Whether every call is done; raises ExecutorError for a call that failed."""
        return self.flight is None or self.flight.poll()

    def wait(self) -> NixlTransfer:
        """Poll until every call is done and set ``elapsed_s``; returns self. ExecutorError on failure or after the poll
        timeout."""
        if self.flight is not None:
            t = self.flight.wait()
            if t is not None:
                self.elapsed_s = t
        return self

    def call_done(self, call: int) -> bool:
        """Whether call ``call`` is done (calls finish independently). IndexError or ExecutorError."""
        call = self._call(call)
        return self.flight is None or self.flight.call_done(call)

    def wait_call(self, call: int) -> NixlTransfer:
        """Poll until call ``call`` is done; returns self. IndexError, or ExecutorError on failure or timeout."""
        call = self._call(call)
        if self.flight is not None:
            self.flight.wait_call(call)
        return self

    def stream_wait(self, stream: Stream, call: int = -1) -> None:
        """Wait on the host until call ``call`` (default: the last) is done, so whatever is queued on ``stream`` later
        runs after it (NIXL has no device events). IndexError, RunArgumentError, or ExecutorError on failure."""
        if stream is not None:
            stream_handle(stream)  # a stream of the wrong kind is refused, as by every transfer
        self.wait_call(call)


@dataclass(frozen=True)
class _Sides:
    op: str
    peer: str
    local_mem: str
    remote_mem: str
    dev: np.ndarray  # per plan buffer: device id (0 where unused)



def _reading(buffers: Sequence[Buffer], src: set[int], dst: set[int], remote: Mapping[int, RemoteBuffer]) -> bool:
    """Whether the plan reads from the remote side (its sources are remote) rather than writing to it: one side
    all remote, the other all local. BindingError names the first buffer on the wrong side."""
    if not remote:
        raise BindingError(buffers[min(src)].name, "local memory", "both sides of the plan are local; bind the source "
                           "or the destination buffers to RemoteBuffers (NumpyExecutor copies locally)")
    reading = bool(src & remote.keys())
    (remote_side, rs), (local_side, ls) = ((src, "source"), (dst, "destination")) if reading else \
        ((dst, "destination"), (src, "source"))
    not_remote = sorted(remote_side - remote.keys())
    if not_remote:
        raise BindingError(buffers[not_remote[0]].name, "local memory", f"other {rs} buffers are remote; every {rs} "
                           "buffer must be a RemoteBuffer (one side of a NIXL transfer is remote)")
    not_local = sorted(local_side & remote.keys())
    if not_local:
        raise BindingError(buffers[not_local[0]].name, remote[not_local[0]], f"the {rs} side is remote, so every {ls} "
                           "buffer must be local memory")
    return reading


def _one_mem(what: str, side: Mapping[int, Segment] | Mapping[int, RemoteBuffer]) -> str:
    """The one NIXL memory type of one side's descriptors (BindingError when the side mixes types)."""
    mems = sorted({s.mem for s in side.values()})
    if len(mems) > 1:
        raise BindingError(what, mems, "one side of a NIXL descriptor list has one memory type")
    return mems[0]

class NixlExecutor(Executor):
    """Runs each call of a plan as one NIXL transfer between this agent and one remote agent.

    Construct with options (NixlOptions fields) or ``from_options``; pass ``agent`` to share an existing
    nixl_agent. Raises MissingDependencyError (an ImportError) with the install line when nixl-cu13 is missing.

    ``bind(layout, bindings)`` registers the local memory with the agent once (the registration is released
    by ``bound.close()``); a one-off ``run(plan, bindings)`` needs local memory registered with ``register``.

    Threads: one executor may be shared by any number of threads. ``run`` waits on the calling thread for its
    ``after`` transfers and its stream, then holds the executor's lock while it checks and posts a plan;
    ``register``, ``describe``, ``add_peer``, ``remove_peer`` and ``close`` take the same lock. A NixlTransfer's
    methods may be called from any thread.
    """

    def __init__(self, options: NixlOptions | Mapping[str, Any] | None = None, *, agent: Any = None, **kw: Any):
        opts = NixlOptions.model_validate({**dict(options or {}), **kw}) if not isinstance(options, NixlOptions) \
            else options.model_copy(update=kw)
        self.options = opts
        if agent is None:
            api = import_optional("nixl_cu13._api", "the NIXL executor")
            nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config
            conf = nixl_agent_config(enable_prog_thread=opts.progress_thread, backends=list(opts.backends),
                                     num_threads=opts.num_threads, capture_telemetry=opts.telemetry)
            try:  # a plugin that cannot start (GDS without cuFile) is skipped or refused by nixl: say which
                agent = nixl_agent(opts.name or f"kvxfer-{uuid.uuid4().hex[:12]}", conf)
                missing = [f"{b!r} (no such plugin)" for b in opts.backends if b not in agent.backends]
            except Exception as e:
                agent, missing = None, [reason(e)]
            if missing:
                raise ValueError(f"nixl.backends = {list(opts.backends)}: could not start {missing[0]}; GDS and GDS_MT "
                                 "need cuFile and a GPU, POSIX and UCX run anywhere")
        self.agent = agent
        self._registrations: list[Registration] = []
        self._flights: list[Inflight] = []  # transfers that may still touch registered memory
        self._runs = itertools.count()
        self._lock = threading.Lock()

    @classmethod
    def from_options(cls, options: NixlOptions) -> NixlExecutor:
        """An executor with a new agent made from ``options``."""
        return cls(options)

    @property
    def agent_name(self) -> str:
        """The name of this executor's NIXL agent."""
        return str(self.agent.name)

    # ---- memory and peers --------------------------------------------------------------------------------
    @property
    def synchronous(self) -> bool:
        """False: ``run`` posts the transfers and returns."""
        return False

    def register(self, bindings: Mapping[str, Any],
                 buffers: Layout | TransferPlan | Iterable[Buffer] | None = None) -> Registration:
        """Register local memory under buffer names; ``buffers`` (a Layout, plan or Buffer list) restricts and
        size-checks the names. See nixl_memory.register."""
        bufs = buffers.buffers if isinstance(buffers, (Layout, TransferPlan)) else buffers
        files = {n: b for n, b in bindings.items() if isinstance(b, FileBinding)}  # storage: FILE memory
        if files and len(files) < len(bindings):
            raise BindingError(sorted(set(bindings) - set(files))[0], "memory", "register files and memory separately")
        with self._lock:
            reg = register_files(self.agent, files, bufs) if files else register(self.agent, bindings, bufs)
            self._registrations.append(reg)
        return reg

    def describe(self, registration: Registration) -> bytes:
        """What a peer needs to address ``registration``: this agent's name, its NIXL metadata and each registered
        buffer's segment, as ``PeerInfo`` JSON bytes for the peer's ``add_peer``."""
        with self._lock:
            metadata = bytes(self.agent.get_agent_metadata())
            buffers = tuple((n, s) for n, s in registration.segments.items() if s.mem != "FILE")
        return PeerInfo(self.agent_name, metadata, buffers).encode()

    def add_peer(self, info: bytes | PeerInfo) -> dict[str, RemoteBuffer]:
        """Load a peer's ``describe()`` output (the JSON bytes, or a decoded PeerInfo); returns its buffers as
        RemoteBuffer bindings by name.

        Raises PeerInfoError naming the field for a malformed description (nothing is loaded), or when NIXL
        refuses the metadata or it names another agent than the description does. A refusal never unloads an
        agent: the agent the metadata names may be a live peer (a replayed description under another name), so
        whatever NIXL holds is left as it is and nothing of the description is returned (``remove_peer`` forgets
        an agent). The description is data: nothing in it is executed; buffers it names that the peer did not
        register are refused by NIXL when a transfer is posted."""
        peer_info = info if isinstance(info, PeerInfo) else PeerInfo.decode(info)
        with self._lock:
            try:
                loaded = self.agent.add_remote_agent(peer_info.metadata)
            except Exception as e:  # the binding raises one class per nixl status
                raise PeerInfoError("metadata", f"{len(peer_info.metadata)} bytes", f"refused by NIXL: {reason(e)}") from None
        peer = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if peer != peer_info.agent:
            raise PeerInfoError("agent", peer_info.agent, f"the NIXL metadata is agent {peer!r}'s; agents already "
                                "loaded are left as they are")
        return {n: RemoteBuffer(peer, seg.addr, seg.nbytes, seg.dev, seg.mem) for n, seg in peer_info.buffers}

    def remove_peer(self, peer: str) -> None:
        """Forget the remote agent ``peer`` (its metadata loaded by ``add_peer``)."""
        with self._lock:
            self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        """Wait for transfers still in flight, then deregister everything registered through this executor."""
        with self._lock:
            flights, self._flights = self._flights, []
            for flight in flights:  # memory must not be deregistered under a transfer in flight
                try:
                    flight.wait()
                except ExecutorError:
                    pass  # a failed transfer has already stopped touching memory (its owner sees the error)
            while self._registrations:
                self._registrations.pop().deregister()

    def wait_notifs(self, peer: str, notifs: Iterable[bytes], timeout_s: float | None = None) -> None:
        """Block until every notification in ``notifs`` arrived from ``peer``; TimeoutError names the missing."""
        missing = [bytes(n) for n in notifs]

        def arrived() -> bool:
            missing[:] = [n for n in missing if not self.agent.check_remote_xfer_done(peer, n, tag_is_prefix=False)]
            return not missing

        if not poll_until(arrived, timeout_s or self.options.poll_timeout_s):
            raise TimeoutError(f"notifications from {peer!r} still missing after "
                               f"{timeout_s or self.options.poll_timeout_s}s: {missing[:4]}")

    # ---- running -----------------------------------------------------------------------------------------
    def _registered(self, seg: Segment) -> bool:
        return any(r.covers(seg) for reg in self._registrations if reg.usable for r in reg.segments.values())

    def check_memory(self, buf: Buffer, mem: Memory) -> None:
        """Accept remote buffers; refuse (BindingError) local memory NIXL cannot describe as DRAM or VRAM."""
        if not isinstance(mem.owner, RemoteBuffer):
            segment_of(mem, buf.name)  # local memory NIXL can describe: host (DRAM) or a CUDA tensor (VRAM)

    def _attach(self, bound: BoundMemory) -> None:
        local = {b.name: m.owner for b, m in zip(bound.buffers, bound.memory)
                 if m is not None and not isinstance(m.owner, RemoteBuffer)}
        if local:
            reg = self.register(local, [b for b in bound.buffers if b.name in local])
            bound.extra["registration"] = reg
            bound.on_close(reg.deregister)

    def _files_as_segments(self, buffers: Any, bindings: Bindings) -> Bindings:
        """File bindings opened for their buffers and described as this agent's own FILE segments (file offset,
        length, fd), so the one binding path checks every range against the file buffer like any memory."""
        if not any(isinstance(b, FileBinding) for b in bindings.values()):
            return bindings
        table = {b.name: b for b in getattr(buffers, "buffers", buffers)}
        return {n: (file_remote(b.open(table[n]), self.agent_name) if isinstance(b, FileBinding) and n in table else b)
                for n, b in bindings.items()}

    def bind(self, buffers: Layout | Sequence[Buffer], bindings: Bindings) -> BoundMemory:
        """As Executor.bind; FileBinding values are opened and bound as FILE segments (register them first)."""
        return super().bind(buffers, self._files_as_segments(buffers, bindings))

    def memory_for(self, plan: TransferPlan, memory: BoundMemory | Bindings) -> BoundMemory:
        """As Executor.memory_for; FileBinding values of a one-off run are opened and bound as FILE segments."""
        if not isinstance(memory, BoundMemory):
            memory = self._files_as_segments(plan.buffers, memory)
        return super().memory_for(plan, memory)

    def _sides(self, plan: TransferPlan, bound: BoundMemory, low: Lowered) -> _Sides:
        """Check which side is remote and decide READ or WRITE, from the buffers ``low`` was checked with. Raises
        BindingError: both sides local, a side mixing local and remote buffers, local memory not registered with
        this agent, remote buffers of several agents or of one unknown here, or one side mixing memory types."""
        src = set(low.src_runs[0].tolist())
        dst = set(low.dst_runs[0].tolist())
        dev = np.zeros(len(plan.buffers), dtype=np.uint64)
        remote: dict[int, RemoteBuffer] = {}
        local: dict[int, Segment] = {}
        for i in sorted(src | dst):
            mem = bound.memory[i]
            if isinstance(mem.owner, RemoteBuffer):
                remote[i] = mem.owner
                dev[i] = mem.owner.dev
            else:
                local[i] = seg = segment_of(mem, plan.buffers[i].name)
                dev[i] = seg.dev
        reading = _reading(plan.buffers, src, dst, remote)
        self._check_registered(plan.buffers, local)
        peer = self._peer(plan.buffers, remote)
        local_mem, remote_mem = (_one_mem(what, d) for what, d in (("local", local), ("remote", remote)))
        return _Sides("READ" if reading else "WRITE", peer, local_mem, remote_mem, dev)

    def _check_registered(self, buffers: Sequence[Buffer], local: Mapping[int, Segment]) -> None:
        """Every local buffer's bytes lie in one usable registration of this executor (BindingError)."""
        for i, seg in local.items():
            if not self._registered(Segment(seg.addr, buffers[i].nbytes, seg.dev, seg.mem)):
                raise BindingError(buffers[i].name, f"{seg.mem} at {seg.addr:#x}, {buffers[i].nbytes} bytes",
                                   f"not registered with agent {self.agent_name!r} (use register() or bind()), or "
                                   "its registration is unusable (a transfer over it never finished)")

    def _peer(self, buffers: Sequence[Buffer], remote: Mapping[int, RemoteBuffer]) -> str:
        """The one agent every remote buffer belongs to, known to this agent (BindingError otherwise)."""
        peers = sorted({r.agent for r in remote.values()})
        first = buffers[min(remote)].name
        if len(peers) > 1:
            raise BindingError(first, f"agents {peers}", "one NIXL transfer targets one agent; plan each peer's buffers "
                               "separately")
        if peers[0] != self.agent_name and not self.agent.check_remote_metadata(peers[0]):
            raise BindingError(first, f"RemoteBuffer(agent={peers[0]!r})",
                               f"agent {peers[0]!r} is unknown to {self.agent_name!r} (add_peer its metadata first)")
        return peers[0]

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Stream = None,
            after: After = None) -> NixlTransfer:
        """Post every call of ``plan`` as one NIXL transfer; returns at once with a NixlTransfer.

        First waits on the host for every ``after`` transfer and, when the local memory is on a GPU, for the work
        queued on ``stream`` (None: the current stream of that GPU). Raises BindingError, PlanError or
        RunArgumentError (before anything is posted) for a malformed plan, a range outside its bound buffer, a
        missing, undersized, unregistered or wrongly-sided binding or an unknown agent, and ExecutorError naming
        the call when NIXL rejects a transfer (calls posted before it are drained first). ``done()``/``wait()``
        raise ExecutorError when a transfer ends in ERR or outlives ``poll_timeout_s``; a failed transfer is never
        reported done.
        """
        t0 = time.perf_counter()
        if stream is not None:
            stream_handle(stream)  # a stream of the wrong kind is refused before anything else
        waits = transfers_after(after)
        bound = self.memory_for(plan, memory)
        low = bound.descriptors(plan)  # every range inside its bound buffer, local and remote
        if plan.num_ranges == 0:
            wait_on_host(waits)
            return NixlTransfer(nbytes=0, ranges=0, calls=0, elapsed_s=time.perf_counter() - t0)
        with self._lock:
            s = self._sides(plan, bound, low)
        wait_on_host(waits)
        if s.local_mem == "VRAM":  # the device memory NIXL reads or writes must be done being computed on
            synchronize_stream(stream, int(s.dev[int(low.dst_runs[0][0] if s.op == "READ" else low.src_runs[0][0])]))
        with self._lock:
            return self._post(plan, bound, low, s, t0)

    def _post(self, plan: TransferPlan, bound: BoundMemory, low: Lowered, s: _Sides, t0: float) -> NixlTransfer:
        reading = s.op == "READ"
        loc_side, rem_side = ("dst", "src") if reading else ("src", "dst")
        loc_addr, rem_addr = (low.dst, low.src) if reading else (low.src, low.dst)
        local = np.stack([loc_addr, low.nbytes, s.dev[low.buffer_column(loc_side)]], axis=1)
        remote = np.stack([rem_addr, low.nbytes, s.dev[low.buffer_column(rem_side)]], axis=1)
        tag = f"kvxfer:{plan.fingerprint[:12]}:{next(self._runs)}"
        notifs = tuple(f"{tag}:{c};".encode() for c in range(low.num_calls))  # ';' ends the tag: 1 never matches 10
        used = np.unique((low.dst_runs if reading else low.src_runs)[0]).tolist()
        registrations = [r for r in self._registrations
                         if any(r.covers(segment_of(bound.memory[i], plan.buffers[i].name)) for i in used)]
        notify = s.peer != self.agent_name  # storage backends (FILE) take no notifications
        flight = Inflight(self.agent, t0, self.options.poll_timeout_s, bound.owners(), notifs,
                          drain_s=self.options.drain_timeout_s, registrations=registrations, notify=notify)
        self._flights = [f for f in self._flights if f.pending and f.error is None] + [flight]
        agent = self.agent

        def make(lo: int, hi: int, notif: bytes) -> Callable[[], Any]:
            return lambda: agent.initialize_xfer(s.op, agent.get_xfer_descs(local[lo:hi], s.local_mem),
                                                 agent.get_xfer_descs(remote[lo:hi], s.remote_mem), s.peer, notif)
        for c, (lo, hi) in enumerate(low.calls()):
            flight.post(c, make(lo, hi, notifs[c] if notify else b""), f"{s.op} to {s.peer!r}")
        return NixlTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls, flight=flight,
                            op=s.op, peer=s.peer, notifs=notifs if notify else ())
