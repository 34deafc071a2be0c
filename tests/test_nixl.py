"""The NIXL executor on real NIXL over UCX loopback: two agents in one process and in two processes.

Every transfer is compared byte for byte (sentinels included) with per-block copies by the NumPy executor.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvxfer.executors import BindingError, ExecutorError, NixlExecutor
from kvxfer.executors.nixl_memory import RemoteBuffer
from kvxfer.executors.nixl_peer import LOOPBACK_ENV, PeerProcess
from kvxfer.planner import PlanOptions, plan_transfer, presets
from kvxfer.testing import random_buffers, run_reference

for _k, _v in LOOPBACK_ENV.items():  # loopback only; set before nixl loads UCX (kvxfer imports it lazily)
    os.environ.setdefault(_k, _v)
pytest.importorskip("nixl_cu13._api", reason="nixl-cu13 is not installed (pip install 'kvxfer[nixl]')")

REGIONS, BLOCKS, PAGE = 6, 64, 1024
LAYOUT = presets.kv_layout(REGIONS, BLOCKS, PAGE)  # "cpu" holds every region; "gpu.kv<r>" one each
HOST = ("cpu",)
DEVICE = tuple(b.name for b in LAYOUT.buffers if b.name not in HOST)
TIMEOUT = {"poll_timeout_s": 20.0}


def _fill(arrays: dict[str, np.ndarray], seed: int) -> None:
    fresh = random_buffers(LAYOUT, seed)
    for name, a in arrays.items():
        a[:] = fresh[name]


def _expected(plan_args: tuple, before: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Per-piece copies by the test oracle (kvxfer.testing), on copies of the memory before the transfer."""
    layout, mapping = plan_args
    return run_reference(layout, mapping, before)


def _assert_same(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> None:
    for name in want:
        bad = np.flatnonzero(got[name] != want[name])
        assert bad.size == 0, f"{name}: {bad.size} bytes differ, first at {bad[0] if bad.size else None}"


@pytest.fixture(scope="module")
def pair():
    """Two agents in this process: 'engine' holds the device-side buffers (DRAM here), 'tier' the host side."""
    engine, tier = NixlExecutor(name="engine", **TIMEOUT), NixlExecutor(name="tier", **TIMEOUT)
    mem = {b.name: np.zeros(b.nbytes, dtype=np.uint8) for b in LAYOUT.buffers}
    dev = {n: mem[n] for n in DEVICE}
    host = {n: mem[n] for n in HOST}
    reg_engine = engine.register(dev, [b for b in LAYOUT.buffers if b.name in DEVICE])
    reg_tier = tier.register(host)
    remote_host = engine.add_peer(tier.describe(reg_tier))
    remote_dev = tier.add_peer(engine.describe(reg_engine))
    yield {"engine": (engine, dev, remote_dev), "tier": (tier, host, remote_host), "mem": mem}
    engine.close()
    tier.close()


CASES = [(p, c) for p in presets.PATTERNS for c in (True, False)]


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("initiator", ["engine", "tier"])
@pytest.mark.parametrize("pattern,coalesce", CASES)
def test_one_process_matches_per_block_copies(pair, direction, initiator, pattern, coalesce):
    mapping = presets.mapping(pattern, 24, BLOCKS, direction, seed=3)
    plan = plan_transfer(LAYOUT, mapping, options=PlanOptions(coalesce=coalesce, max_descriptors=40))
    _fill(pair["mem"], seed=len(pattern) + coalesce)
    want = _expected((LAYOUT, mapping), pair["mem"])
    ex, local, _ = pair[initiator]
    other, _, remote = pair["tier" if initiator == "engine" else "engine"]
    t = ex.run(plan, {**local, **remote})
    assert t.wait() is t and t.done()
    # the initiator's remote side is the plan's source for a READ, its destination for a WRITE
    remote_is_src = (direction == "h2d") == (initiator == "engine")
    assert t.op == ("READ" if remote_is_src else "WRITE")
    assert (t.calls, t.ranges, t.nbytes) == (plan.num_calls, plan.num_ranges, plan.total_bytes)
    other.wait_notifs(ex.agent_name, t.notifs, timeout_s=10)
    _assert_same(pair["mem"], want)


def test_notifications_name_plan_and_call(pair):
    mapping = presets.mapping("fragmented", 16, BLOCKS, "d2h", seed=1)
    plan = plan_transfer(LAYOUT, mapping, options=PlanOptions(max_descriptors=32))
    engine, dev, _ = pair["engine"]
    tier, _, remote_host = pair["tier"]
    t1, t2 = engine.run(plan, {**dev, **remote_host}).wait(), engine.run(plan, {**dev, **remote_host}).wait()
    assert len(t1.notifs) == plan.num_calls == 3
    assert all(n.startswith(f"kvxfer:{plan.fingerprint[:12]}:".encode()) for n in t1.notifs + t2.notifs)
    assert len(set(t1.notifs + t2.notifs)) == 6  # runs of the same plan are told apart
    tier.wait_notifs("engine", t1.notifs + t2.notifs, timeout_s=10)


def test_unknown_agent_is_a_binding_error(pair):
    engine, dev, _ = pair["engine"]
    _, host, _ = pair["tier"]
    plan = plan_transfer(LAYOUT, presets.mapping("runs8", 8, BLOCKS, "h2d"))
    ghost = RemoteBuffer("nobody", host["cpu"].ctypes.data, host["cpu"].nbytes)
    with pytest.raises(BindingError, match=r"'nobody' is unknown to 'engine'"):
        engine.run(plan, {**dev, "cpu": ghost})


def test_removed_peer_is_unknown():
    a, b = NixlExecutor(name="a-rm", **TIMEOUT), NixlExecutor(name="b-rm", **TIMEOUT)
    host = {"cpu": np.zeros(LAYOUT.buffers[0].nbytes, np.uint8)}
    dev = {n: np.zeros(b_.nbytes, np.uint8) for b_ in LAYOUT.buffers for n in [b_.name] if n in DEVICE}
    remote = a.add_peer(b.describe(b.register(host)))
    a.register(dev)
    plan = plan_transfer(LAYOUT, presets.mapping("contiguous", 8, BLOCKS, "h2d"))
    a.run(plan, {**dev, **remote}).wait()
    a.remove_peer("b-rm")
    with pytest.raises(BindingError, match="unknown"):
        a.run(plan, {**dev, **remote})
    a.close()
    b.close()


def test_a_live_peers_description_replayed_under_another_name_is_refused_and_the_peer_still_works():
    import json

    from kvxfer.executors import PeerInfoError

    a, b = NixlExecutor(name="a-replay", **TIMEOUT), NixlExecutor(name="b-replay", **TIMEOUT)
    host = {"cpu": np.zeros(LAYOUT.buffers[0].nbytes, np.uint8)}
    dev = {n: np.zeros(b_.nbytes, np.uint8) for b_ in LAYOUT.buffers for n in [b_.name] if n in DEVICE}
    blob = b.describe(b.register(host))
    remote = a.add_peer(blob)
    a.register(dev)
    replayed = json.dumps({**json.loads(blob), "agent": "mallory"}).encode()  # b's metadata, another name
    with pytest.raises(PeerInfoError, match="the NIXL metadata is agent 'b-replay''s"):
        a.add_peer(replayed)
    host["cpu"][:] = 7
    plan = plan_transfer(LAYOUT, presets.mapping("contiguous", 8, BLOCKS, "h2d"))
    a.run(plan, {**dev, **remote}).wait()  # b is still loaded: the refusal unloaded nothing
    assert all((dev[n] != 0).any() for n in DEVICE)
    a.close()
    b.close()


def test_unregistered_local_buffer(pair):
    engine, dev, _ = pair["engine"]
    _, _, remote_host = pair["tier"]
    plan = plan_transfer(LAYOUT, presets.mapping("runs8", 8, BLOCKS, "h2d"))
    stray = np.zeros_like(dev["gpu.kv2"])
    with pytest.raises(BindingError, match=r"gpu\.kv2.*not registered with agent 'engine'"):
        engine.run(plan, {**dev, "gpu.kv2": stray, **remote_host})


def test_unregistered_remote_memory_raises_on_post(pair):
    engine, dev, _ = pair["engine"]
    tier = pair["tier"][0]
    plan = plan_transfer(LAYOUT, presets.mapping("runs8", 8, BLOCKS, "h2d"), options=PlanOptions(max_descriptors=2))
    stray = np.zeros(LAYOUT.buffers[0].nbytes, np.uint8)  # never registered by 'tier'
    with pytest.raises(ExecutorError, match=r"initialize_xfer failed at chunk 0.*NotFound"):
        engine.run(plan, {**dev, "cpu": RemoteBuffer(tier.agent_name, stray.ctypes.data, stray.nbytes)})


@pytest.mark.parametrize("side", ["local", "remote"])
def test_binding_smaller_than_plan(pair, side):
    engine, dev, _ = pair["engine"]
    _, _, remote_host = pair["tier"]
    plan = plan_transfer(LAYOUT, presets.mapping("runs8", 8, BLOCKS, "h2d"))
    if side == "local":
        bindings = {**dev, "gpu.kv0": dev["gpu.kv0"][:-1], **remote_host}
        name = "gpu.kv0"
    else:
        r = remote_host["cpu"]
        bindings = {**dev, "cpu": RemoteBuffer(r.agent, r.addr, r.nbytes - PAGE)}
        name = "cpu"
    with pytest.raises(BindingError, match=rf"{name}.*smaller than the plan's buffer"):
        engine.run(plan, bindings)


def test_both_sides_local_or_remote(pair):
    engine, dev, remote_dev = pair["engine"]
    _, host, remote_host = pair["tier"]
    plan = plan_transfer(LAYOUT, presets.mapping("runs8", 8, BLOCKS, "h2d"))
    with pytest.raises(BindingError, match="both sides of the plan are local"):
        engine.run(plan, {**dev, **host})
    with pytest.raises(BindingError, match="must be local memory"):
        engine.run(plan, {**remote_dev, **remote_host})


def test_mixed_remote_sources_rejected():
    layout = presets.kv_layout(3, 16, 256, shared_host=False)
    ex = NixlExecutor(name="mixed", **TIMEOUT)
    mem = {b.name: np.zeros(b.nbytes, np.uint8) for b in layout.buffers}
    ex.register(mem)
    plan = plan_transfer(layout, presets.mapping("runs8", 4, 16, "h2d"))
    fake = RemoteBuffer("elsewhere", 4096, 1 << 20)
    with pytest.raises(BindingError, match=r"'cpu.kv1'\] = local memory: other source buffers are remote"):
        ex.run(plan, {**mem, "cpu.kv0": fake, "cpu.kv2": fake})
    ex.close()


@pytest.fixture(scope="module")
def peer():
    """A second process holding the host-side buffer; this process holds the device side."""
    engine = NixlExecutor(name="engine-x", **TIMEOUT)
    dev = {n: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers for n in [b.name] if n in DEVICE}
    reg = engine.register(dev)
    with PeerProcess(engine, {"cpu": LAYOUT.buffers[0].nbytes}, reg, options=TIMEOUT, timeout_s=30) as p:
        yield engine, dev, p
    engine.close()


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("pattern,coalesce", [("runs8", True), ("runs8", False), ("descending", True),
                                              ("interleaved", False), ("fragmented", True)])
def test_two_processes_match_per_block_copies(peer, direction, pattern, coalesce):
    engine, dev, p = peer
    rng = np.random.default_rng(len(pattern))
    p.write("cpu", rng.integers(0, 256, LAYOUT.buffers[0].nbytes, dtype=np.uint8))
    _fill(dev, seed=7 + coalesce)
    mapping = presets.mapping(pattern, 24, BLOCKS, direction, seed=5)
    plan = plan_transfer(LAYOUT, mapping, options=PlanOptions(coalesce=coalesce, max_descriptors=64))
    before = {**dev, "cpu": p.read("cpu")}
    want = _expected((LAYOUT, mapping), before)
    t = engine.run(plan, {**dev, **p.remote}).wait()
    assert t.op == ("READ" if direction == "h2d" else "WRITE") and t.peer == p.agent_name
    p.wait_notifs(t.notifs, timeout_s=10)  # the target learns the data landed from the notifications
    _assert_same({**dev, "cpu": p.read("cpu")}, want)


def test_peer_demo_runs(capsys):
    from kvxfer.executors.nixl_peer import demo

    demo(regions=2, blocks=32, page_bytes=512)
    out = capsys.readouterr().out
    assert out.count("bytes match") == 2 and "READ" in out and "WRITE" in out


@pytest.mark.gpu
def test_vram_bindings_load_from_dram_peer(peer):
    """Same code path with the device side in GPU memory: local VRAM descriptors, remote DRAM."""
    import torch

    engine, _, p = peer
    vram = {n: torch.zeros(b.nbytes, dtype=torch.uint8, device="cuda") for b in LAYOUT.buffers
            for n in [b.name] if n in DEVICE}
    reg = engine.register(vram)
    try:
        assert {s.mem for s in reg.segments.values()} == {"VRAM"}
        mapping = presets.mapping("runs8", 24, BLOCKS, "h2d", seed=2)
        plan = plan_transfer(LAYOUT, mapping)
        before = {**{n: v.cpu().numpy() for n, v in vram.items()}, "cpu": p.read("cpu")}
        want = _expected((LAYOUT, mapping), before)
        t = engine.run(plan, {**vram, **p.remote}).wait()
        assert t.op == "READ"
        _assert_same({**{n: v.cpu().numpy() for n, v in vram.items()}, "cpu": p.read("cpu")}, want)
    finally:
        reg.deregister()


def test_a_stopped_or_closed_peer_says_so():
    import signal
    ex = NixlExecutor(name="asker", progress_thread=False, **TIMEOUT)
    peer = PeerProcess(ex, {"cpu": 64}, timeout_s=20.0)
    peer.timeout_s = 1.0
    os.kill(peer.proc.pid, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match=r"is stopped \(process \d+, state T"):
            peer.read("cpu")
    finally:
        os.kill(peer.proc.pid, signal.SIGCONT)
    peer.timeout_s = 20.0
    peer.proc.kill()
    peer.proc.wait()
    peer.close()
    with pytest.raises(RuntimeError, match="was closed"):
        peer.read("cpu")
    ex.close()
