"""The NIXL executor's logic without NIXL: a scripted agent drives ERR states, rejected posts and deadlines.

These run everywhere; test_nixl.py covers real NIXL.
"""
from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from kvxfer.executors import BindingError, ExecutorError, NixlExecutor, NixlOptions, RunArgumentError, Transfer
from kvxfer.executors.nixl_memory import RemoteBuffer
from kvxfer.planner import PlanOptions, plan_transfer, presets

LAYOUT = presets.kv_layout(2, 16, 256)


class Handle:
    def __init__(self, log: list, call: int):
        self.log, self.call, self.released = log, call, False

    def release(self) -> None:
        self.released = True
        self.log.append(("release", self.call))


class ScriptedAgent:
    """Answers like nixl_agent; ``states[call]`` is the sequence check_xfer_state returns for that call."""

    name = "scripted"

    def __init__(self, states=None, fail_init_at=None, post_state="PROC"):
        self.states, self.fail_init_at, self.post_state = states or {}, fail_init_at, post_state
        self.log: list = []
        self.handles: list[Handle] = []

    def register_memory(self, rows, mem):
        return (tuple(rows), mem)

    def deregister_memory(self, handle):
        self.log.append(("deregister", handle[1]))

    def check_remote_metadata(self, agent):
        return agent == "peer"

    def get_xfer_descs(self, rows, mem):
        return (np.array(rows), mem)

    def initialize_xfer(self, op, local, remote, peer, notif):
        call = len(self.handles)
        if call == self.fail_init_at:
            raise KeyError("NIXL_ERR_NOT_FOUND")
        self.log.append((op, peer, notif, len(local[0])))
        h = Handle(self.log, call)
        self.handles.append(h)
        return h

    def transfer(self, handle, notif):
        return self.post_state

    def check_xfer_state(self, handle):
        seq = self.states.get(handle.call, ["DONE"])
        return seq.pop(0) if len(seq) > 1 else seq[0]


def _setup(agent, **opts):
    ex, bindings, plan, _ = _setup_registered(agent, **opts)
    return ex, bindings, plan


def _setup_registered(agent, **opts):
    """(executor, bindings, plan, the registration of the local memory)."""
    ex = NixlExecutor(agent=agent, **opts)
    dev = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers if b.name != "cpu"}
    reg = ex.register(dev)
    bindings = {**dev, "cpu": RemoteBuffer("peer", 1 << 20, LAYOUT.buffers[0].nbytes)}
    plan = plan_transfer(LAYOUT, presets.mapping("fragmented", 6, 16, "h2d"), options=PlanOptions(max_descriptors=4))
    return ex, bindings, plan, reg


def test_lowering_one_read_per_call_with_notifications():
    agent = ScriptedAgent(states={0: ["PROC", "DONE"]})
    ex, bindings, plan = _setup(agent)
    t = ex.run(plan, bindings)
    assert not t.done() and t.done()  # call 0 was in progress once
    posts = [e for e in agent.log if e[0] == "READ"]
    assert [p[3] for p in posts] == plan.call_sizes.tolist()
    assert [p[2] for p in posts] == list(t.notifs) and all(p[1] == "peer" for p in posts)
    assert all(h.released for h in agent.handles)


def test_err_state_raises_and_never_reads_done():
    agent = ScriptedAgent(states={1: ["ERR"]})
    ex, bindings, plan = _setup(agent)
    t = ex.run(plan, bindings)
    with pytest.raises(ExecutorError, match=r"check_xfer_state failed at chunk 1.*ended in ERR"):
        t.wait()
    with pytest.raises(ExecutorError, match=r"check_xfer_state failed at chunk 1.*ended in ERR"):
        t.done()  # the failure sticks
    assert t.elapsed_s is None and all(h.released for h in agent.handles)


def test_rejected_post_drains_earlier_calls():
    agent = ScriptedAgent(fail_init_at=2)
    ex, bindings, plan = _setup(agent)
    with pytest.raises(ExecutorError, match=r"initialize_xfer failed at chunk 2.*NIXL_ERR_NOT_FOUND.*2 of 3 calls posted"):
        ex.run(plan, bindings)
    assert len(agent.handles) == 2 and all(h.released for h in agent.handles)


def test_err_on_post_raises():
    agent = ScriptedAgent(post_state="ERR")
    ex, bindings, plan = _setup(agent)
    with pytest.raises(ExecutorError, match=r"transfer failed at chunk 0: READ to 'peer': posting returned ERR"):
        ex.run(plan, bindings)


def test_deadline_fails_instead_of_hanging():
    agent = ScriptedAgent(states={0: ["PROC"]})
    ex, bindings, plan = _setup(agent, poll_timeout_s=0.05)
    t = ex.run(plan, bindings)
    with pytest.raises(ExecutorError, match="still in progress after 0.05s"):
        t.wait()


def test_wait_notifs_deadline():
    agent = ScriptedAgent()
    agent.check_remote_xfer_done = lambda peer, tag, tag_is_prefix: False
    ex = NixlExecutor(agent=agent, poll_timeout_s=0.05)
    with pytest.raises(TimeoutError, match="still missing"):
        ex.wait_notifs("peer", [b"x"])


def test_a_stream_is_accepted_and_one_of_the_wrong_kind_refused_before_posting():
    agent = ScriptedAgent()
    ex, bindings, plan = _setup(agent)
    ex.run(plan, bindings, stream=77).wait()  # host memory: nothing queued on a stream to order after
    assert len(agent.handles) == plan.num_calls
    with pytest.raises(RunArgumentError, match=r"^stream = <object object at .*>: expected None, an int handle"):
        ex.run(plan, bindings, stream=object())
    assert len(agent.handles) == plan.num_calls


class SlowTransfer(Transfer):
    """A transfer of another executor that finishes when ``wait`` is called (and records that it was)."""

    def __init__(self, log: list, fails: bool = False):
        super().__init__(nbytes=0, ranges=0, calls=1)
        self.log, self.fails = log, fails

    def wait(self):
        self.log.append("after waited")
        if self.fails:
            raise ExecutorError("copy", 0, None, "failed elsewhere", 0)
        return self


def test_run_posts_only_after_every_after_transfer_finished_even_a_failed_one():
    agent = ScriptedAgent()
    ex, bindings, plan = _setup(agent)
    log = agent.log
    ex.run(plan, bindings, after=[SlowTransfer(log), SlowTransfer(log, fails=True)]).wait()
    kinds = [e if isinstance(e, str) else e[0] for e in log]
    assert kinds[:2] == ["after waited", "after waited"] and kinds.count("READ") == plan.num_calls
    with pytest.raises(RunArgumentError, match=r"^after\[1\] = 'x': expected a Transfer"):
        ex.run(plan, bindings, after=[SlowTransfer(log), "x"])


def test_empty_plan_is_done_at_once():
    ex, bindings, _ = _setup(ScriptedAgent())
    plan = plan_transfer(LAYOUT, {"direction": "h2d", "src_ids": [], "dst_ids": []})
    t = ex.run(plan, bindings)
    assert t.done() and t.calls == 0


def test_built_from_typed_options(monkeypatch):
    from kvxfer.executors.config import ExecutorConfig, build_executor
    seen = []
    monkeypatch.setattr(NixlExecutor, "__init__", lambda self, options=None, **kw: seen.append(options))
    build_executor("nixl", ExecutorConfig(kind="nixl", nixl={"name": "x", "backends": ["UCX"]}))
    NixlExecutor.from_options(NixlOptions(poll_timeout_s=3))
    assert seen == [NixlOptions(name="x"), NixlOptions(poll_timeout_s=3)]
    with pytest.raises(ValueError, match="nixl.bogus = 1: unknown key 'bogus'"):
        ExecutorConfig(nixl={"bogus": 1})


def test_missing_nixl_gives_install_hint(monkeypatch):
    monkeypatch.setitem(sys.modules, "nixl_cu13._api", None)
    with pytest.raises(ImportError, match=r"kvxfer\[nixl\]"):
        NixlExecutor()


def test_importing_executors_does_not_import_nixl():
    code = ("import sys, kvxfer.executors as e, kvxfer.executors._ops_nixl, kvxfer.executors.nixl_peer; "
            "assert e.NixlExecutor; assert not [m for m in sys.modules if m.startswith('nixl')], sys.modules")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_per_call_completion_and_tags():
    agent = ScriptedAgent(states={0: ["PROC", "PROC", "DONE"], 1: ["DONE"]})
    ex, bindings, plan = _setup(agent)
    assert plan.num_calls == 3
    t = ex.run(plan, bindings)
    assert not t.call_done(0) and t.call_done(1) and t.call_done(2)  # NIXL calls finish independently
    t.wait_call(0)
    assert t.call_done(0) and t.done()
    t.stream_wait(None, 0)  # no device events: waits on the host, here for a call already done
    assert all(n.endswith(b";") for n in t.notifs)  # self-delimiting: call 1's tag is no part of call 10's
    assert not any(a != b and a in b for a in t.notifs for b in t.notifs)


def test_wait_call_deadline():
    agent = ScriptedAgent(states={0: ["PROC"]})
    ex, bindings, plan = _setup(agent, poll_timeout_s=0.05)
    t = ex.run(plan, bindings)
    with pytest.raises(ExecutorError, match=r"still in progress after 0.05s"):
        t.wait_call(0)


def test_close_waits_for_transfers_before_deregistering():
    agent = ScriptedAgent(states={0: ["PROC", "PROC", "DONE"]})
    ex, bindings, plan = _setup(agent)
    ex.run(plan, bindings)  # the caller drops the transfer
    ex.close()
    kinds = [e[0] for e in agent.log]
    assert kinds.index("deregister") > max(i for i, k in enumerate(kinds) if k == "release")
    assert all(h.released for h in agent.handles)


class VirtualClock:
    """Stands in for the ``time`` module of ops_nixl: time passes only as the code under test reads the clock
    (one step per read) or sleeps, so how long a wait lasts is counted exactly, whatever the machine's load."""

    STEP = 1e-5

    def __init__(self):
        self.now = 0.0

    def perf_counter(self) -> float:
        self.now += self.STEP
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


def test_wait_is_bounded_by_timeout_plus_one_drain_and_stuck_memory_stays_registered(monkeypatch):
    from kvxfer.executors import _ops_nixl as ops_nixl
    clock = VirtualClock()
    monkeypatch.setattr(ops_nixl, "time", clock)
    agent = ScriptedAgent(states={0: ["PROC"], 1: ["PROC"], 2: ["PROC"]})  # never finishes (a stopped peer)
    ex, bindings, plan, reg = _setup_registered(agent, poll_timeout_s=0.2, drain_timeout_s=0.1)
    t = ex.run(plan, bindings)
    start = clock.now
    with pytest.raises(ExecutorError, match=r"still in progress after 0.2s.*given 0.1s to drain, 3 still running.*"
                                            r"memory stays referenced and its registration is marked unusable"):
        t.wait()
    waited = clock.now - start
    assert 0.2 + 0.1 <= waited <= 0.2 + 0.1 + 2 * ops_nixl.SLEEP_S  # the timeout, then one bounded drain
    assert not any(h.released for h in agent.handles)  # never released under a transfer in flight
    assert t.flight.keep and not reg.usable
    with pytest.raises(BindingError, match="registration is unusable"):
        ex.run(plan, bindings)  # the memory is not reused
    ex.close()
    assert not [e for e in agent.log if e[0] == "deregister"]  # nor deregistered under it


def test_remote_range_past_its_buffer_is_refused_before_posting():
    from kvxfer.planner import PlanError

    from .shims.conformance import hand_made
    agent = ScriptedAgent()
    ex, bindings, plan = _setup(agent)
    small = dict(bindings, cpu=RemoteBuffer("peer", 1 << 20, LAYOUT.buffers[0].nbytes))
    bad = hand_made(plan, src_offset=lambda a: a.__setitem__(-1, LAYOUT.buffers[0].nbytes - 8))
    with pytest.raises(PlanError, match=r"src_offset\[\d+\] = \d+: range of 256 bytes runs past buffer 'cpu'"):
        ex.run(bad, small)
    assert agent.handles == []


def test_bind_registers_once_and_close_deregisters():
    agent = ScriptedAgent()
    ex = NixlExecutor(agent=agent)
    dev = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers if b.name != "cpu"}
    bound = ex.bind(LAYOUT, {**dev, "cpu": RemoteBuffer("peer", 1 << 20, LAYOUT.buffers[0].nbytes)})
    assert [e[0] for e in agent.log] == []  # register_memory is not logged; nothing deregistered yet
    plan = plan_transfer(LAYOUT, presets.mapping("fragmented", 6, 16, "h2d"), options=PlanOptions(max_descriptors=4))
    for _ in range(3):
        ex.run(plan, bound).wait()
    assert len([e for e in agent.log if e[0] == "READ"]) == 3 * plan.num_calls
    bound.close()
    assert [e for e in agent.log if e[0] == "deregister"] == [("deregister", "DRAM")]
    with pytest.raises(BindingError, match="was closed"):
        ex.run(plan, bound)


@pytest.mark.parametrize("where", ["inside", "starts inside, ends past", "starts before, ends inside"])
def test_memory_only_partly_inside_a_registration_is_refused_as_not_registered(where):
    agent = ScriptedAgent()
    ex = NixlExecutor(agent=agent)
    sizes = {b.name: b.nbytes for b in LAYOUT.buffers if b.name != "cpu"}
    arena = np.zeros(4 * sum(sizes.values()), np.uint8)
    half = LAYOUT.buffers[1].nbytes // 2
    name = LAYOUT.buffers[1].name
    regions = {n: arena[i * 2 * s + s:(i * 2 + 1) * s + s] for i, (n, s) in enumerate(sizes.items())}  # a gap before each
    ex.register(regions)
    lo = regions[name].ctypes.data - arena.ctypes.data
    shift = {"inside": 0, "starts inside, ends past": half, "starts before, ends inside": -half}[where]
    local = dict(regions, **{name: arena[lo + shift:lo + shift + sizes[name]]})
    bindings = {**local, "cpu": RemoteBuffer("peer", 1 << 20, LAYOUT.buffers[0].nbytes)}
    plan = plan_transfer(LAYOUT, presets.mapping("fragmented", 6, 16, "h2d"))
    if where == "inside":
        ex.run(plan, bindings).wait()
        return
    with pytest.raises(BindingError, match=rf"^bindings\['{name}'\] = DRAM at 0x[0-9a-f]+, {sizes[name]} bytes: not registered"):
        ex.run(plan, bindings)
    assert agent.handles == []
