"""kvxfer's connector without an engine (vLLM's classes, so ``make test-vllm`` only): the scheduler-side manager
that takes failed jobs out of the index, and the worker metadata that carries them over the ranks. The engine
runs are in tests/vllm/test_engine.py."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip("vllm", reason="the connector subclasses vLLM's: run with `make test-vllm`")

from vllm.v1.kv_offload.base import LookupResult, ReqContext, make_offload_key
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

from kvxfer.offload.vllm import FailedTransfers, KvxferWorkerMetadata

CTX = ReqContext(req_id="r")
KEYS = [make_offload_key(bytes([i]) * 16, 0) for i in range(3)]


def _stored(manager: Any, job_id: int, keys: list[Any]) -> Any:
    """Prepare a store of ``keys`` as vLLM's scheduler does, and name its job."""
    out = manager.prepare_store(keys, CTX)
    manager.name_jobs(SimpleNamespace(store_jobs={job_id: SimpleNamespace(dst_spec=out.store_spec)}, load_jobs={}))
    return out


@pytest.mark.parametrize("fails", [False, True])
def test_a_store_that_failed_on_a_rank_leaves_the_index_and_one_that_did_not_becomes_a_hit(fails: bool) -> None:
    inner = CPUOffloadingManager(num_chunks=4)
    m = FailedTransfers(inner)
    m.on_new_request(CTX)
    _stored(m, 7, KEYS[:2])
    if fails:
        m.fail({7})
    m.complete_store(set(KEYS[:2]), CTX)  # vLLM completes it once every rank reported
    want = LookupResult.MISS if fails else LookupResult.HIT
    assert [inner.lookup(k, CTX) for k in KEYS[:2]] == [want, want]
    _stored(m, 8, KEYS[:2])  # the chunks were freed: the keys can be stored again
    m.complete_store(set(KEYS[:2]), CTX)
    assert m.lookup(KEYS[0], CTX) is LookupResult.HIT


def test_the_keys_of_a_failed_load_miss_until_they_are_stored_anew() -> None:
    inner = CPUOffloadingManager(num_chunks=4)
    m = FailedTransfers(inner)
    m.on_new_request(CTX)
    _stored(m, 1, KEYS)
    m.complete_store(set(KEYS), CTX)
    spec = m.prepare_load(KEYS[:2], CTX)
    m.name_jobs(SimpleNamespace(store_jobs={}, load_jobs={2: SimpleNamespace(src_spec=spec)}))
    m.fail({2})
    m.complete_load(KEYS[:2], CTX)
    assert [m.lookup(k, CTX) for k in KEYS] == [LookupResult.MISS, LookupResult.MISS, LookupResult.HIT]
    assert inner.lookup(KEYS[0], CTX) is LookupResult.HIT  # still held by vLLM's manager, no longer offered
    m.reset_cache()
    _stored(m, 3, KEYS[:1])
    m.complete_store(set(KEYS[:1]), CTX)
    assert m.lookup(KEYS[0], CTX) is LookupResult.HIT


def test_failed_jobs_of_any_rank_survive_the_merge_of_the_ranks_metadata() -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.common import OffloadingWorkerMetadata

    rank0 = KvxferWorkerMetadata(completed_jobs={1: 1, 2: 1})
    rank1 = KvxferWorkerMetadata(completed_jobs={1: 1, 2: 1}, failed_jobs={2})
    merged = rank0.aggregate(rank1).aggregate(OffloadingWorkerMetadata(completed_jobs={3: 1}))
    assert isinstance(merged, KvxferWorkerMetadata)
    assert merged.completed_jobs == {1: 2, 2: 2, 3: 1} and merged.failed_jobs == {2}


def test_the_worker_metadata_pickles_as_an_ordinary_class_of_its_module() -> None:
    """What crosses vLLM's processes pickles by reference to the class's own module, which a process that unpickles
    it imports like any other (no attribute set on a face, no renamed class)."""
    import pickle

    import kvxfer.offload.vllm.connector as connector

    meta = KvxferWorkerMetadata(completed_jobs={1: 1}, failed_jobs={1})
    assert (type(meta).__module__, type(meta).__qualname__) == ("kvxfer.offload.vllm.connector", "KvxferWorkerMetadata")
    assert KvxferWorkerMetadata is connector.KvxferWorkerMetadata
    back = pickle.loads(pickle.dumps(meta))
    assert type(back) is KvxferWorkerMetadata and back.failed_jobs == {1} and back.completed_jobs == {1: 1}
    assert b"kvxfer.offload.vllm.connector" in pickle.dumps(meta)


@pytest.mark.parametrize("name", ["KvxferOffloadingSpec", "KvxferOffloadingWorker", "KvxferOffloadingConnector",
                                  "KvxferWorkerMetadata", "FailedTransfers", "KvxferTieringOffloadingSpec",
                                  "KvxferFileTier"])
def test_every_class_vllm_loads_by_name_is_a_top_level_class_of_its_module(name: str) -> None:
    import importlib

    import kvxfer.offload.vllm as face

    cls = getattr(face, name)
    module = importlib.import_module(f"kvxfer.offload.vllm.{face.CLASSES[name]}")
    assert cls.__module__ == module.__name__ and cls.__qualname__ == name and getattr(module, name) is cls
