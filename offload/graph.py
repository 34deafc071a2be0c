"""The offload worker's job graph as a pure value: events in, decisions out. No lock, thread, executor or transfer
lives here (h11 keeps HTTP's state machine apart from its sockets the same way); ``OffloadWorker`` feeds it what
happened, under its own lock, and does what it answers.

Jobs run in lanes, one per kind of job. A lane is *pipelined* when its executor completes runs in the order they
were issued (an issue lane: the next job may start as soon as this one has started), else *serial* (a thread lane:
one job at a time, the next starts once this one has ended).

A job's life: accepted -> started -> ended (its own work is over, with or without an error) -> final (it has ended
and so has, finally, every job it reads from) -> retired (reported, each lane in acceptance order).

- Ordering. A job is ordered after, per other lane, the newest pending job it conflicts with (one writes an id the
  other reads or writes: ``conflict``) that is not *done* (done: it has ended, and so has every older job of its
  lane), which starts after the older ones of its lane (after an expedited one, the next such job too); its own
  lane's order covers that lane. Such a dependency is met once it is done, or once it has started on a pipelined
  lane (the worker hands its transfer to the executor as ``after``, which orders the two: a job there completes
  after the older ones of its lane, so ordering on it covers them, even when it ended at once, copying nothing).
- Failures. A job reads from the last pending writer of each id it reads (skipping one known to have succeeded).
  When one of those failed, the job fails too, with a DependencyError naming it: it is failed before it starts
  when that is known then (``failure``), else once it is final. A job that only overwrites what a failed job
  touched is ordered after it, not failed.
- Expedited jobs (vLLM 0.34 marks some loads so). An expedited job may start before earlier jobs of its own lane
  that have not started and that it does not conflict with; every other rule holds for it. Results still retire
  in lane order.

Events: ``accept`` a job (-> the jobs that start now), ``fail`` a started job whose error is known before its work
ended (an issue that raised while copies it made still run), ``settle`` a job whose work ended (-> the jobs that
start now), ``retire`` (-> the final jobs, with their errors). A job handed back by ``accept`` or ``settle`` counts
as started: the caller starts the jobs in the order given (a job may depend on one before it in the list).
Queries: ``after`` (the dependencies to order on), ``failure`` (an inherited failure known now), ``unsettled``
(the jobs whose end would tell more: for the caller to poll).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Hashable, Mapping
from dataclasses import dataclass, field
from typing import Protocol, TypeAlias

import numpy as np

__all__ = ["DependencyError", "GraphError", "Ids", "JobGraph", "Node", "conflict", "overlap"]

Ids: TypeAlias = tuple[tuple[str, np.ndarray], ...]  # what a job reads or writes: (id space, sorted unique ids) pairs


class DependencyError(RuntimeError):
    """The job read bytes that a failed job was to write, so its own bytes are not the ones asked for.

    ``job_id``/``op``: the failed job it read from; ``cause``: that job's error. ``root_id``/``root_op``/``root``:
    the first failure of the chain (the same job when it failed on its own)."""

    def __init__(self, job_id: int, op: str, cause: BaseException):
        self.job_id, self.op, self.cause = job_id, op, cause
        self.root_id: int
        self.root_op: str
        self.root: BaseException
        if isinstance(cause, DependencyError):
            self.root_id, self.root_op, self.root = cause.root_id, cause.root_op, cause.root
        else:
            self.root_id, self.root_op, self.root = job_id, op, cause
        text = str(self.root)
        text = text if len(text) <= 160 else text[:157] + "..."
        chain = "" if self.root_id == job_id else f", which read from failed job {self.root_id} ({self.root_op})"
        super().__init__(f"reads what job {job_id} ({op}) was to write, and that job failed{chain}: "
                         f"{type(self.root).__name__}: {text}")


def overlap(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether two sorted unique id arrays share an id."""
    if not len(a) or not len(b) or a[-1] < b[0] or b[-1] < a[0]:
        return False
    i = np.searchsorted(b, a)
    i[i == len(b)] = len(b) - 1
    return bool(np.any(b[i] == a))


def _any_overlap(xs: Ids, ys: Ids) -> bool:
    return any(sx == sy and overlap(a, b) for sx, a in xs for sy, b in ys)


class Touching(Protocol):
    """What a job reads and writes (a graph node)."""

    reads: Ids
    writes: Ids


def conflict(a: Touching, b: Touching) -> bool:
    """Whether ``a`` and ``b`` must not run at the same time: one writes an id the other reads or writes
    (read-after-write, write-after-read, write-after-write)."""
    return _any_overlap(a.reads, b.writes) or _any_overlap(a.writes, b.reads) or _any_overlap(a.writes, b.writes)


class GraphError(ValueError):
    """An event the graph cannot take (an unknown or repeated job id, a job settled before it started, an unknown
    lane); names the event, the job and why."""

    def __init__(self, event: str, job_id: int, reason: str):
        self.event, self.job_id, self.reason = event, job_id, reason
        super().__init__(f"{event}({job_id!r}): {reason}")


@dataclass(eq=False, slots=True)
class Node:
    """One accepted job as the graph sees it: its lane, operation, the ids it reads and writes, and its state."""

    job_id: int
    seq: int  # acceptance order
    lane: Hashable
    op: str
    reads: Ids
    writes: Ids
    expedited: bool = False
    after: list[Node] = field(default_factory=list)  # per other lane, the newest conflicting job (not done)
    reads_from: list[Node] = field(default_factory=list)  # the last pending writers of the ids it reads
    readers: list[Node] = field(default_factory=list)  # the jobs that read from this one
    started: bool = False
    ended: bool = False
    final: bool = False
    retired: bool = False
    error: BaseException | None = None  # its own (``fail``, ``settle``), then the inherited one once final


@dataclass
class _Lane:
    pipelined: bool
    jobs: deque[Node] = field(default_factory=deque)  # accepted, not retired, in order
    waiting: list[Node] = field(default_factory=list)  # accepted, not started, in order
    running: int = 0  # started and not ended
    expedited: int = 0  # waiting expedited jobs


class JobGraph:
    """The job graph of one worker (see the module). ``lanes``: lane -> whether it is pipelined. Not thread-safe:
    its owner serializes the calls (the worker holds its lock)."""

    def __init__(self, lanes: Mapping[Hashable, bool] | None = None):
        self._lanes: dict[Hashable, _Lane] = {}
        self._nodes: dict[int, Node] = {}  # accepted and not retired
        self._seq = 0
        self._waiting = 0  # accepted jobs not started, over every lane
        for lane, pipelined in (lanes or {}).items():
            self.add_lane(lane, pipelined)

    def add_lane(self, lane: Hashable, pipelined: bool) -> None:
        """Add a lane (a lower tier attached later); GraphError if it exists."""
        if lane in self._lanes:
            raise GraphError("add_lane", -1, f"lane {lane!r} exists")
        self._lanes[lane] = _Lane(pipelined)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def node(self, job_id: int) -> Node:
        """The pending job ``job_id`` (GraphError when it is not pending)."""
        try:
            return self._nodes[job_id]
        except KeyError:
            raise GraphError("node", job_id, "not pending (never accepted, or retired)") from None

    # ---- events ---------------------------------------------------------------------------------------------
    def accept(self, job_id: int, lane: Hashable, op: str, reads: Ids, writes: Ids, *,
               expedited: bool = False) -> list[int]:
        """Accept a job of ``lane`` reading and writing these ids; the jobs that start now (it, possibly)."""
        if job_id in self._nodes:
            raise GraphError("accept", job_id, "a job with this id is pending")
        if lane not in self._lanes:
            raise GraphError("accept", job_id, f"unknown lane {lane!r} (lanes: {list(self._lanes)})")
        node = Node(job_id, self._seq, lane, op, reads, writes, expedited)
        self._seq += 1
        if self._nodes:
            self._dependencies(node)
        self._nodes[job_id] = node
        state = self._lanes[lane]
        state.jobs.append(node)
        # accepting a job changes no other job's chances: it alone may start now
        if self._may_start(node, state, state.waiting, self._done() if node.after else set()):
            node.started = True
            state.running += 1
            return [job_id]
        state.waiting.append(node)
        state.expedited += expedited
        self._waiting += 1
        return []

    def fail(self, job_id: int, error: BaseException) -> None:
        """Record the own error of started job ``job_id`` before its work has ended (it stays ordered until then)."""
        node = self.node(job_id)
        if not node.started or node.ended:
            raise GraphError("fail", job_id, "only a started job that has not ended can fail early")
        node.error = node.error or error

    def settle(self, job_id: int, error: BaseException | None = None) -> list[int]:
        """Job ``job_id``'s work has ended (``error``: its own failure; an earlier ``fail`` stands); the jobs that
        start now."""
        node = self.node(job_id)
        if not node.started:
            raise GraphError("settle", job_id, "the job has not started")
        if node.ended:
            raise GraphError("settle", job_id, "the job has ended already")
        node.ended, node.error = True, node.error or error
        self._lanes[node.lane].running -= 1
        self._finalize(node)
        return self._start()

    def retire(self) -> list[tuple[int, BaseException | None]]:
        """The final jobs, each lane from its oldest pending job up to its first job not final, in acceptance
        order, each with its error (None: success); they leave the graph."""
        out: list[Node] = []
        for state in self._lanes.values():
            while state.jobs and state.jobs[0].final:
                out.append(state.jobs.popleft())
        out.sort(key=lambda n: n.seq)
        for n in out:
            n.retired = True  # done for good: jobs waiting on it may still name it
            del self._nodes[n.job_id]
        return [(n.job_id, n.error) for n in out]

    # ---- queries --------------------------------------------------------------------------------------------
    def after(self, job_id: int) -> list[int]:
        """The jobs ``job_id`` is ordered after that are not done (the worker orders on their transfers)."""
        after = self.node(job_id).after
        done = self._done() if after else set()
        return [d.job_id for d in after if not (d.retired or id(d) in done)]

    def failure(self, job_id: int) -> DependencyError | None:
        """The failure ``job_id`` inherits, as known now: a job it reads from failed (on its own, or inherited)."""
        failed = next((d for d in self.node(job_id).reads_from if d.error is not None), None)
        return None if failed is None else _inherited(failed)

    def unsettled(self, job_id: int) -> list[int]:
        """The started jobs whose end would tell now whether ``job_id`` inherits a failure: those it reads from that
        have not ended, and, past one that has ended but is not final, those that one reads from (for the caller
        to poll, settling the ones done, then to ask again)."""
        out, seen, stack = [], set(), list(self.node(job_id).reads_from)
        while stack:
            d = stack.pop()
            if id(d) in seen or d.final:
                continue
            seen.add(id(d))
            if not d.ended:
                if d.started:
                    out.append(d.job_id)
                continue  # nothing past it tells more until it has ended
            stack.extend(d.reads_from)
        return out

    def started(self, lane: Hashable) -> list[int]:
        """The jobs of ``lane`` that started and have not ended, oldest first."""
        return [n.job_id for n in self._lanes[lane].jobs if n.started and not n.ended]

    # ---- the rules ------------------------------------------------------------------------------------------
    def _done(self) -> set[int]:
        """The pending jobs (``id``) that are done: each lane's oldest jobs up to the first that has not ended (a
        retired job is done too)."""
        out = set()
        for state in self._lanes.values():
            for n in state.jobs:
                if not n.ended:
                    break
                out.add(id(n))
        return out

    def _dependencies(self, node: Node) -> None:
        unexplained = dict(node.reads)  # id space -> ids it reads whose last writer is not found yet
        ordered = {node.lane}  # lanes whose order already covers the rest
        done: set[int] | None = None  # found when first needed (most jobs conflict with none)
        for prev in reversed(self._nodes.values()):
            if prev.lane not in ordered and conflict(node, prev) \
                    and id(prev) not in (done := self._done() if done is None else done):
                node.after.append(prev)
                if not prev.expedited:  # it starts after every older job of its lane; an expedited one may not
                    ordered.add(prev.lane)
            for space, ids in prev.writes:
                left = unexplained.get(space)
                if left is not None and len(left) and overlap(left, ids):
                    if not (prev.final and prev.error is None):
                        node.reads_from.append(prev)
                        prev.readers.append(node)
                    unexplained[space] = np.setdiff1d(left, ids, assume_unique=True)

    def _met(self, dep: Node, done: set[int]) -> bool:
        return dep.retired or (dep.started and self._lanes[dep.lane].pipelined) or id(dep) in done

    def _may_start(self, node: Node, state: _Lane, earlier: list[Node], done: set[int]) -> bool:
        """Whether waiting ``node`` may start: ``earlier`` (its lane's jobs before it that have not started) is
        empty, or it is expedited and conflicts with none of them; its lane is pipelined or runs nothing; every
        job it is ordered after is met."""
        if earlier and not (node.expedited and not any(conflict(node, e) for e in earlier)):
            return False
        if not state.pipelined and state.running:
            return False
        return all(self._met(d, done) for d in node.after)

    def _start(self) -> list[int]:
        started: list[int] = []
        if not self._waiting:
            return started
        lanes = [state for state in self._lanes.values() if state.waiting]
        done = self._done() if any(n.after for state in lanes for n in state.waiting) else set()  # a start ends none
        progress = bool(lanes)
        while progress:
            progress = False
            for state in lanes:
                i = 0
                while i < len(state.waiting):
                    node = state.waiting[i]
                    if not self._may_start(node, state, state.waiting[:i] if i else [], done):
                        if not state.expedited:
                            break  # only the oldest job of a lane without expedited jobs may start
                        i += 1
                        continue
                    del state.waiting[i]
                    node.started = True
                    state.running += 1
                    state.expedited -= node.expedited
                    self._waiting -= 1
                    started.append(node.job_id)
                    progress = True
        return started

    def _finalize(self, node: Node) -> None:
        """Make ``node`` final if it ended and every job it reads from is final, then its readers in turn."""
        stack = [node]
        while stack:
            n = stack.pop()
            if n.final or not n.ended or not all(d.final for d in n.reads_from):
                continue
            if n.error is None:
                failed = next((d for d in n.reads_from if d.error is not None), None)
                if failed is not None:
                    n.error = _inherited(failed)
            n.final, n.after, n.reads_from = True, [], []
            stack.extend(n.readers)
            n.readers = []


def _inherited(source: Node) -> DependencyError:
    """The failure of a job that read what ``source`` (a failed job) was to write."""
    return DependencyError(source.job_id, source.op, source.error or RuntimeError("failed"))
