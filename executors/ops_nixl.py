"""Run a TransferPlan through NIXL: one side of the plan is local registered memory, the other a remote agent's.

How bindings split a plan: each buffer name maps to local memory (numpy array, CPU or CUDA tensor, registered
with ``register``) or to a ``RemoteBuffer`` (another agent's registered segment, from ``add_peer``). Every
range must go between a local and a remote buffer, and the plan as a whole must have one remote side:
- the plan's sources are remote (a load from a remote cache tier, the decode side pulling a prefill's
  blocks): each call is one NIXL READ into local memory;
- the plan's destinations are remote (a store to a remote tier, prefill pushing to decode): one WRITE.
A buffer bound to a ``FileBinding`` (nixl_files) is a file: this agent reads and writes it itself through a
storage backend (``backends=["POSIX"]``, or GDS/GDS_MT on GPU machines), with no notification.
Otherwise each call's transfer carries the notification ``kvxfer:<plan fingerprint[:12]>:<run>:<call>;`` so the
other side can tell which plan and call have landed (``wait_notifs``).
"""
from __future__ import annotations

import itertools
import threading
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvxfer.planner import Buffer, TransferPlan

from .base import Bindings, Executor, ExecutorError, Transfer
from .binding import BindingError, BoundMemory, Memory
from .nixl_files import FileBinding, register_files
from .nixl_memory import MEM_TYPES, Registration, RemoteBuffer, Segment, descriptor_rows, register, segment_of
from .nixl_transfer import Inflight, poll_until, reason
from .options import NixlOptions

__all__ = ["NixlExecutor", "NixlOptions", "NixlTransfer", "RemoteBuffer"]

INSTALL_HINT = "the NIXL executor needs nixl-cu13: pip install 'kvxfer[nixl]' (not the 'nixl' meta package)"


@dataclass(eq=False, kw_only=True)
class NixlTransfer(Transfer):
    """A plan in flight through NIXL: ``op`` READ or WRITE, the remote ``peer``, one notification per call.
    NIXL calls finish independently; ``stream_wait`` is refused (NIXL transfers are not stream-ordered)."""

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

    def stream_wait(self, stream: Any, call: int = -1) -> None:
        """Always raises ValueError: NIXL transfers are not stream-ordered; wait on the host instead."""
        raise ValueError(f"stream = {stream!r}: NIXL transfers are not stream-ordered; wait_call({call}) on the host")


@dataclass(frozen=True)
class _Sides:
    op: str
    peer: str
    local_mem: str
    remote_mem: str
    dev: np.ndarray  # per plan buffer: device id (0 where unused)


class NixlExecutor(Executor):
    """Runs each call of a plan as one NIXL transfer between this agent and one remote agent.

    Construct with options (NixlOptions fields) or ``from_options``; pass ``agent`` to share an existing
    nixl_agent. Raises ImportError with an install hint when nixl-cu13 is missing.

    ``bind(layout, bindings)`` registers the local memory with the agent once (the registration is released
    by ``bound.close()``); a one-off ``run(plan, bindings)`` needs local memory registered with ``register``.
    Threads: one executor may be shared; ``run`` holds a lock while it checks and posts a plan.
    """

    def __init__(self, options: NixlOptions | Mapping[str, Any] | None = None, *, agent: Any = None, **kw: Any):
        opts = NixlOptions.model_validate({**dict(options or {}), **kw}) if not isinstance(options, NixlOptions) \
            else options.model_copy(update=kw)
        self.options = opts
        if agent is None:
            try:
                from nixl_cu13._api import nixl_agent, nixl_agent_config
            except ImportError as e:
                raise ImportError(f"{INSTALL_HINT} ({e})") from e
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
        return self.agent.name

    # ---- memory and peers --------------------------------------------------------------------------------
    def register(self, bindings: Mapping[str, Any], buffers: Any = None) -> Registration:
        """Register local memory under buffer names; ``buffers`` (a Layout, plan or Buffer list) restricts and
        size-checks the names. See nixl_memory.register."""
        bufs = getattr(buffers, "buffers", buffers)
        files = {n: b for n, b in bindings.items() if isinstance(b, FileBinding)}  # storage: FILE memory
        if files and len(files) < len(bindings):
            raise BindingError(sorted(set(bindings) - set(files))[0], "memory", "register files and memory separately")
        reg = register_files(self.agent, files, bufs) if files else register(self.agent, bindings, bufs)
        self._registrations.append(reg)
        return reg

    def describe(self, registration: Registration) -> dict[str, Any]:
        """What a peer needs to address ``registration``: agent name, metadata, serialized descriptor lists."""
        lists = {}
        for mem in MEM_TYPES:
            names = [n for n, s in registration.segments.items() if s.mem == mem]
            if names:
                dlist = self.agent.get_xfer_descs(descriptor_rows(registration.segments[n] for n in names), mem)
                lists[mem] = (names, self.agent.get_serialized_descs(dlist))
        return {"agent": self.agent_name, "metadata": self.agent.get_agent_metadata(), "buffers": lists}

    def add_peer(self, info: Mapping[str, Any]) -> dict[str, RemoteBuffer]:
        """Load a peer's ``describe()`` output; returns its buffers as RemoteBuffer bindings by name.

        The serialized lists are unpickled (NIXL's own format), so take ``info`` only from a trusted peer.
        """
        peer = self.agent.add_remote_agent(info["metadata"])
        peer = peer.decode() if isinstance(peer, bytes) else peer
        if peer != info["agent"]:
            raise BindingError(info["agent"], f"metadata of {peer!r}", "the metadata names a different agent")
        remote = {}
        for mem, (names, blob) in info["buffers"].items():
            dlist = self.agent.deserialize_descs(blob)
            for i, n in enumerate(names):
                addr, nbytes, dev = dlist[i]
                remote[n] = RemoteBuffer(peer, int(addr), int(nbytes), int(dev), mem)
        return remote

    def remove_peer(self, peer: str) -> None:
        """Forget the remote agent ``peer`` (its metadata loaded by ``add_peer``)."""
        self.agent.remove_remote_agent(peer)

    def close(self) -> None:
        """Wait for transfers still in flight, then deregister everything registered through this executor."""
        for flight in self._flights:  # memory must not be deregistered under a transfer in flight
            try:
                flight.wait()
            except ExecutorError:
                pass  # a failed transfer has already stopped touching memory (its owner sees the error)
        self._flights = []
        while self._registrations:
            self._registrations.pop().deregister()

    def wait_notifs(self, peer: str, notifs: Any, timeout_s: float | None = None) -> None:
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
        return {n: (b.open(table[n]).remote(self.agent_name) if isinstance(b, FileBinding) and n in table else b)
                for n, b in bindings.items()}

    def bind(self, buffers: Any, bindings: Bindings) -> BoundMemory:
        """As Executor.bind; FileBinding values are opened and bound as FILE segments (register them first)."""
        return super().bind(buffers, self._files_as_segments(buffers, bindings))

    def memory_for(self, plan: TransferPlan, memory: BoundMemory | Bindings) -> BoundMemory:
        """As Executor.memory_for; FileBinding values of a one-off run are opened and bound as FILE segments."""
        if not isinstance(memory, BoundMemory):
            memory = self._files_as_segments(plan.buffers, memory)
        return super().memory_for(plan, memory)

    def _sides(self, plan: TransferPlan, bound: BoundMemory) -> _Sides:
        """Check which side is remote and decide READ or WRITE. Raises BindingError."""
        src = set(plan.buffers_used("src").tolist())
        dst = set(plan.buffers_used("dst").tolist())
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

        def name(i: int) -> str:
            return plan.buffers[i].name
        if not remote:
            raise BindingError(name(min(src)), "local memory", "both sides of the plan are local; bind the source or "
                               "the destination buffers to RemoteBuffers (NumpyExecutor copies locally)")
        reading = bool(src & remote.keys())
        (remote_side, rs), (local_side, ls) = ((src, "source"), (dst, "destination")) if reading else \
            ((dst, "destination"), (src, "source"))
        not_remote = sorted(remote_side - remote.keys())
        if not_remote:
            raise BindingError(name(not_remote[0]), "local memory", f"other {rs} buffers are remote; every {rs} "
                               "buffer must be a RemoteBuffer (one side of a NIXL transfer is remote)")
        not_local = sorted(local_side & remote.keys())
        if not_local:
            raise BindingError(name(not_local[0]), remote[not_local[0]], f"the {rs} side is remote, so every {ls} "
                               "buffer must be local memory")
        op = "READ" if reading else "WRITE"
        for i, seg in local.items():
            if not self._registered(Segment(seg.addr, plan.buffers[i].nbytes, seg.dev, seg.mem)):
                raise BindingError(name(i), f"{seg.mem} at {seg.addr:#x}, {plan.buffers[i].nbytes} bytes",
                                   f"not registered with agent {self.agent_name!r} (use register() or bind()), or "
                                   "its registration is unusable (a transfer over it never finished)")
        peers = sorted({r.agent for r in remote.values()})
        if len(peers) > 1:
            raise BindingError(plan.buffers[min(remote)].name, f"agents {peers}",
                               "one NIXL transfer targets one agent; plan each peer's buffers separately")
        if peers[0] != self.agent_name and not self.agent.check_remote_metadata(peers[0]):
            raise BindingError(plan.buffers[min(remote)].name, f"RemoteBuffer(agent={peers[0]!r})",
                               f"agent {peers[0]!r} is unknown to {self.agent_name!r} (add_peer its metadata first)")
        mems = [{s.mem for s in d.values()} for d in (local, remote)]
        for what, m in zip(("local", "remote"), mems):
            if len(m) > 1:
                raise BindingError(what, sorted(m), "one side of a NIXL descriptor list has one memory type")
        return _Sides(op, peers[0], mems[0].pop(), mems[1].pop(), dev)

    def run(self, plan: TransferPlan, memory: BoundMemory | Bindings, stream: Any = None) -> NixlTransfer:
        """Post every call of ``plan`` as one NIXL transfer; returns at once with a NixlTransfer.

        Raises BindingError or PlanError (before anything is posted) for a malformed plan, a range outside
        its bound buffer, a missing, undersized, unregistered or wrongly-sided binding or an unknown agent,
        and ExecutorError naming the call when NIXL rejects a transfer (calls posted before it are drained
        first). ``done()``/``wait()`` raise ExecutorError when a transfer ends in ERR or outlives
        ``poll_timeout_s``; a failed transfer is never reported done.
        """
        if stream is not None:
            raise ValueError(f"stream = {stream!r}: NIXL transfers are not stream-ordered; synchronize before run()")
        t0 = time.perf_counter()
        bound = self.memory_for(plan, memory)
        src_addr, dst_addr = bound.lower(plan)  # every range inside its bound buffer, local and remote
        if plan.num_ranges == 0:
            return NixlTransfer(nbytes=0, ranges=0, calls=0, elapsed_s=time.perf_counter() - t0)
        with self._lock:
            s = self._sides(plan, bound)
            reading = s.op == "READ"
            loc_buf, loc_addr, rem_buf, rem_addr = ((plan.dst_buf, dst_addr, plan.src_buf, src_addr) if reading else
                                                    (plan.src_buf, src_addr, plan.dst_buf, dst_addr))
            local = np.stack([loc_addr, plan.nbytes, s.dev[loc_buf]], axis=1)
            remote = np.stack([rem_addr, plan.nbytes, s.dev[rem_buf]], axis=1)
            tag = f"kvxfer:{plan.fingerprint[:12]}:{next(self._runs)}"
            notifs = tuple(f"{tag}:{c};".encode() for c in range(plan.num_calls))  # ';' ends the tag: 1 never matches 10
            used = plan.buffers_used("dst" if reading else "src").tolist()
            registrations = [r for r in self._registrations
                             if any(r.covers(segment_of(bound.memory[i], plan.buffers[i].name)) for i in used)]
            notify = s.peer != self.agent_name  # storage backends (FILE) take no notifications
            flight = Inflight(self.agent, t0, self.options.poll_timeout_s, bound.owners(), notifs,
                              drain_s=self.options.drain_timeout_s, registrations=registrations, notify=notify)
            self._flights = [f for f in self._flights if f.pending and f.error is None] + [flight]
            for c, sl in enumerate(plan.calls()):
                flight.post(c, lambda sl=sl, c=c: self.agent.initialize_xfer(
                    s.op, self.agent.get_xfer_descs(local[sl], s.local_mem),
                    self.agent.get_xfer_descs(remote[sl], s.remote_mem), s.peer, notifs[c] if notify else b""),
                    f"{s.op} to {s.peer!r}")
        return NixlTransfer(nbytes=plan.total_bytes, ranges=plan.num_ranges, calls=plan.num_calls, flight=flight,
                            op=s.op, peer=s.peer, notifs=notifs if notify else ())
