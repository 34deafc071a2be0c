"""The offload worker across TP ranks in separate processes, sharing one host region in /dev/shm.

Two ranks store (a replicated layer with rotating writers, a head-sharded layer as canonical fragments, a
rank-private layer); then four ranks, and one, load the TP-independent layers, and two ranks load
everything. Every byte is checked against the oracle, and bytes nobody wrote stay as they were."""
from __future__ import annotations

import multiprocessing as mp
import os
import time
import uuid
from pathlib import Path

import numpy as np
import pytest

from kvxfer.offload import SharedRegion, SharedRegionError, TPRank, build_layout, find_stale, make_geometry, remove_stale

from . import offload_cases as oc
from .shims.build import build, compiler

SHM = "/dev/shm" if os.path.isdir("/dev/shm") else None
pytestmark = pytest.mark.skipif(SHM is None, reason="no /dev/shm")


@pytest.fixture(scope="module")
def ctx():
    c = mp.get_context("forkserver")
    c.set_forkserver_preload(["numpy", "kvxfer.offload", "tests.offload_cases"])
    return c


@pytest.fixture(scope="module", params=["numpy", "cuda-shim"])
def shim_path(request, tmp_path_factory):
    """None: the NumPy executor on a background thread; else the CUDA batch executor on the C driver shim."""
    if request.param == "numpy":
        return None
    if compiler() is None:
        pytest.skip("no C compiler (cc) to build the driver shim")
    return str(build("fake_cuda", tmp_path_factory.mktemp("offload_shim")))


@pytest.fixture
def region_name():
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    for p in Path(SHM).glob(f"*{name}*"):
        p.unlink()


def _run(ctx, jobs, out, timeout=120):
    procs = [ctx.Process(target=oc.run_rank, args=(*j, out)) for j in jobs]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"


def _layout(names, tp, rank, geometry):
    dev = oc.rank_device(names, tp, rank, "sentinel")
    return build_layout(dev.buffers, dev.tensors, geometry, TPRank(size=tp, rank=rank)), dev


def test_tp_round_trip_across_processes(ctx, shim_path, region_name, tmp_path):
    all3, indep = ["rep", "shard", "priv"], ["rep", "shard"]
    creator = oc.rank_device(all3, 2, 0, "data")
    t = oc.tier(region_name, SHM)
    geometry = make_geometry(creator.tensors, t, TPRank(size=2))
    region = SharedRegion.create(region_name, geometry, attachers=2 + 4 + 1 + 2, directory=SHM)
    try:
        region.data[:] = np.random.default_rng(5).integers(0, 256, region.data.size, dtype=np.uint8)  # sentinels
        want_host = {"host": region.data.copy()}
        out = str(tmp_path)

        # two ranks store
        _run(ctx, [("store", all3, 2, r, region_name, SHM, shim_path) for r in range(2)], out)
        for r in range(2):
            res = np.load(tmp_path / f"store-2-{r}.npz")
            assert bool(res["success"]), str(res["error"])
            layout, _ = _layout(all3, 2, r, geometry)
            dev = oc.rank_device(all3, 2, r, "data")
            arrays = {**{k: np.asarray(v) for k, v in dev.bindings.items()}, **want_host}
            copies = oc.oracle(layout, oc.store_mapping())  # the layout's replicated region rotates writers
            assert int(res["nbytes"]) == copies.total_bytes < oc.oracle(oc.everyone_writes(layout), oc.store_mapping()).total_bytes  # each rank writes only its share of the replicas
            oc.apply(copies, arrays)
        np.testing.assert_array_equal(region.data, want_host["host"])
        host_after_store = region.data.copy()

        # four ranks and one rank load the TP-independent layers; two ranks load everything
        loads = [(4, r, indep) for r in range(4)] + [(1, 0, indep)] + [(2, r, all3) for r in range(2)]
        _run(ctx, [("load", names, tp, r, region_name, SHM, shim_path) for tp, r, names in loads], out)
        for tp, r, names in loads:
            res = np.load(tmp_path / f"load-{tp}-{r}.npz")
            assert bool(res["success"]), str(res["error"])
            layout, dev = _layout(names, tp, r, geometry)
            arrays = {**{k: np.asarray(v).copy() for k, v in dev.bindings.items()}, "host": host_after_store.copy()}
            copies = oc.oracle(layout, oc.load_mapping())
            assert int(res["nbytes"]) == copies.total_bytes
            oc.apply(copies, arrays)
            for name in names:
                np.testing.assert_array_equal(res[f"dev.{name}"], arrays[f"dev.{name}"], err_msg=f"tp {tp} rank {r} {name}")
            # and the meaning: logical blocks 1..8 stored from device blocks 0..7 arrive at device blocks 10..17
            for name in names:
                page = oc.PAGE[name] // tp if name == "shard" else oc.PAGE[name]
                got = res[f"dev.{name}"].reshape(-1, page)
                for i in range(8):
                    np.testing.assert_array_equal(got[10 + i], oc.device_pages(name, tp, r, i) if name != "priv"
                                                  else oc.device_pages(name, 2, r, i))
        assert not (Path(SHM) / f"kvxfer-{region_name}").exists()  # every rank attached: the name is gone
        np.testing.assert_array_equal(region.data, host_after_store)  # loads never write the host
    finally:
        region.close()


def test_rank_killed_mid_job_leaves_region_usable_and_removable(ctx, region_name, tmp_path):
    names = ["rep", "shard", "priv"]
    out = str(tmp_path)
    geometry = make_geometry(oc.rank_device(names, 2, 0, "data").tensors, oc.tier(region_name, SHM), TPRank(size=2))
    # the creator is a process of its own that dies too, so the region ends up with no live owner
    creator = ctx.Process(target=_create_and_wait, args=(region_name, geometry.model_dump_json(), 3))
    creator.start()
    path = Path(SHM) / f"kvxfer-{region_name}"
    _wait_for(lambda: path.exists())
    victim = ctx.Process(target=oc.run_rank, args=("store", names, 2, 1, region_name, SHM, None, out, True))
    victim.start()
    _wait_for(lambda: (tmp_path / "ready-1").exists())  # half of its store's copies are done; it blocks there
    oc.kill(victim.pid)  # mid-job, for certain
    victim.join()
    assert victim.exitcode == -9
    # usable: another rank 1 attaches, stores, and a rank 0 loader reads back what rank 1 stored
    _run(ctx, [("store", names, 2, 1, region_name, SHM, None)], out)
    assert bool(np.load(tmp_path / "store-2-1.npz")["success"])
    assert path.exists() and path not in find_stale(SHM)  # the creator still lives
    oc.kill(creator.pid)
    creator.join()
    assert path in find_stale(SHM)
    assert path in remove_stale(SHM)
    assert not path.exists()
    with pytest.raises(SharedRegionError, match="no such region"):
        SharedRegion.attach(region_name, SHM)


def _create_and_wait(name: str, geometry_json: str, attachers: int) -> None:
    from kvxfer.offload import Geometry
    SharedRegion.create(name, Geometry.model_validate_json(geometry_json), attachers=attachers, directory=SHM)
    time.sleep(600)


def _wait_for(cond, timeout=60.0):
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)
