"""kvxfer under vLLM's tiering in a real engine (vLLM's CPU build): host memory and files, restarts, a crash, a
change of tensor-parallel size, another identity, and vLLM's own ``fs`` tier over kvxfer's primary worker.

Fourteen engines run one after the other in one process (``tests/vllm/tier_engine.py``; about 8 minutes on a
2-core machine, one of them at TP=2) over the small Llama of ``test_engine.py``. The host tier holds 16 chunks,
so after A, B and C it no longer holds A's prefix, and A2 (A's prefix with another suffix) finds it on disk
only. Every token is compared with an engine without offloading. Run with ``make test-vllm``.
"""
from __future__ import annotations

import functools
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="the engine tests need vLLM's CPU build: run them with `make test-vllm`")

from tests.vllm.test_engine import MAIN, PREFIX_BLOCKS, _prompts

ROOT = Path(__file__).resolve().parents[2]
ROW = 2 * 2 * 32 * 2 * 32 * 4  # one chunk of one block: 2 layers x 2 KV heads x 32 tokens x (K|V) x 32 x float32
TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
BIND2 = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # one core per rank (vLLM's own binding wants a NUMA node per rank)


def _requests() -> dict[str, list[int]]:
    p = _prompts()
    r = random.Random(5)
    return {**p, "C2": p["C"][:13 * 32] + [r.randrange(3, 512) for _ in range(12)]}


def _cases(tmp: Path) -> list[dict[str, Any]]:
    q = _requests()

    def tier(root: str, name: str, **kw: Any) -> dict[str, Any]:
        return {"type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm", "root_dir": str(tmp / root),
                "capacity_bytes": 64 * ROW, "stats_path": str(tmp / f"{name}.json"), **kw}

    def case(name: str, reqs: str, secondary: dict[str, Any] | None, engine: dict[str, Any] | None = None,
             **kw: Any) -> dict[str, Any]:
        offload = None if secondary is None else {
            "spec_name": "KvxferTieringOffloadingSpec", "cpu_bytes_to_use": 16 * ROW, "secondary_tiers": [secondary],
            **kw.pop("offload", {})}
        return {"name": name, "offload": offload, "model": {"model_dir": str(tmp / "model")}, "max_tokens": 8,
                "engine": {**MAIN["engine"], **(engine or {})}, "requests": [q[k] for k in reqs.split()],
                "tier_stats": str(tmp / f"{name}.json") if secondary and "root_dir" in secondary else None, **kw}

    for root in ("tp", "crash", "fs", "events", "shared"):
        (tmp / root).mkdir(exist_ok=True)
    canonical = {"canonical_layout": True}
    return [
        case("baseline", "A B C A2 C2", None),
        case("tp2-canonical", "A", tier("tp", "tp2-canonical"), TP2, env=BIND2, offload=canonical),
        case("files", "A B C A2", tier("tp", "files")),
        case("tp1-canonical", "A2", tier("tp", "tp1-canonical"), offload=canonical),
        case("warm", "A2 C2", tier("tp", "warm"), corrupt={"stats": str(tmp / "files.json"), "slot": 8 + 13 + 12}),
        case("identity", "A2", tier("tp", "identity"), {"dtype": "bfloat16"}),
        case("crash", "A B C", tier("crash", "crash", type="CrashingFileTier", module_path="tests.vllm.tier_doubles",
                                    crash_at_store=3, crash_marker=str(tmp / "crashed")), crash_marker=str(tmp / "crashed")),
        case("restart", "A2 C2", tier("crash", "restart")),
        case("truncated", "A2 C2", tier("tp", "truncated"), damage={"stats": str(tmp / "warm.json"), "truncate_slots": 20}),
        case("records", "A2 B C A2", tier("tp", "records"), damage={"stats": str(tmp / "truncated.json"), "records": "random"},
             damage_running={"stats": str(tmp / "records.json"), "before": 3, "stored": 8 + 13 + 13, "truncate_slots": 4,
                             "records": "random"}),
        case("fs", "A B C A2", {"type": "fs", "root_dir": str(tmp / "fs")}),
        case("events", "A B", tier("events", "events", type="RecordingFileTier", module_path="tests.vllm.tier_doubles",
                                   enable_kv_events=True, locality="LOCAL", events_path=str(tmp / "events.jsonl")),
             {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}}),
        case("shared-1", "A B C", tier("shared", "shared-1", shared=True)),
        case("shared-2", "A2", tier("shared", "shared-2", shared=True)),
    ]


@functools.cache
def _runs(tmp: Path) -> dict[str, dict[str, Any]]:
    cases = _cases(tmp)
    path = tmp / "tiers.json"
    path.write_text(json.dumps(cases))
    proc = subprocess.run([sys.executable, "-m", "tests.vllm.tier_engine", str(path)], cwd=ROOT, capture_output=True,
                          text=True, timeout=1500,
                          env={**os.environ, "PYTHONPATH": str(ROOT), "VLLM_LOGGING_LEVEL": "WARNING"})
    log = proc.stdout + proc.stderr
    results = [json.loads(ln[len("RESULT "):]) for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert len(results) == len(cases), f"{len(results)} of {len(cases)} results (exit {proc.returncode}):\n{log[-6000:]}"
    return {r["name"]: {**r, "log": log} for r in results}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    return _runs(tmp_path_factory.mktemp("tiers"))


def _ok(r: dict[str, Any]) -> dict[str, Any]:
    assert r["error"] is None, f"{r['name']}: {r['error']}\n{r['log'][-4000:]}"
    return r


def _tokens(runs: dict[str, dict[str, Any]], *which: int) -> list[list[int]]:
    base = _ok(runs["baseline"])["tokens"]
    return [base[i] for i in which]


def test_a_prefix_evicted_from_host_and_engine_is_restored_from_disk_with_the_tokens_of_no_offloading(runs):
    r = _ok(runs["files"])
    assert r["tokens"] == _tokens(runs, 0, 1, 2, 3)
    tier, (worker,) = r["tier"], r["stats"]
    assert worker["host_tier"] == "vllm-tiering" and worker["loads"] == 1 and worker["blocks_loaded"] == PREFIX_BLOCKS
    # every chunk of the prefix came from disk (in one promotion, or two when the host tier had no room yet for
    # all of them while C's chunks were still being written out)
    assert tier["chunks_loaded"] == PREFIX_BLOCKS and tier["hits"] >= PREFIX_BLOCKS and tier["integrity_misses"] == 0
    assert tier["chunks_stored"] == 8 + 13 + 13 and tier["bytes_stored"] == tier["chunks_stored"] * ROW
    assert r["metrics"]["vllm:kv_offload_tiering_chunk_hits"] == PREFIX_BLOCKS
    assert r["metrics"]["vllm:external_prefix_cache_hits"] == PREFIX_BLOCKS * 32


def test_a_new_engine_on_the_same_directory_serves_prefixes_from_disk_and_a_changed_chunk_is_recomputed(runs):
    # the negative control rides on the warm restart: one of C's chunks (the last slot C's store took) had one
    # byte changed on disk; A's prefix comes back whole, C's up to that chunk, the rest is recomputed
    r = _ok(runs["warm"])
    assert r["tokens"] == _tokens(runs, 3, 4)
    tier, (worker,) = r["tier"], r["stats"]
    assert tier["found"] == 8 + 13 + 13 and tier["integrity_misses"] == 1
    assert tier["chunks_loaded"] == PREFIX_BLOCKS + 13 - 1
    hits = r["metrics"]["vllm:external_prefix_cache_hits"]
    assert PREFIX_BLOCKS * 32 <= hits < (PREFIX_BLOCKS + 13) * 32 and hits % 32 == 0
    assert worker["blocks_loaded"] * 32 == hits
    assert r["log"].count("stored chunk(s) refused and dropped") >= 1  # here once; the "truncated" case logs its own


def test_an_engine_killed_while_storing_restarts_with_equal_tokens_and_the_torn_chunks_as_misses(runs, tmp_path_factory):
    crashed, r = runs["crash"], _ok(runs["restart"])
    assert crashed["error"] == "killed" and crashed["tier"]["stores"] == 2  # A and B were durable; C was being stored
    assert r["tokens"] == _tokens(runs, 3, 4)
    tier = r["tier"]
    assert tier["found"] == 8 + 13 and tier["discarded"] == 0
    assert (tier["chunks_loaded"], tier["integrity_misses"]) == (PREFIX_BLOCKS, 0)  # A2 from disk; C2 computed
    data = np.fromfile(Path(tier["folder"]) / "chunks.kvx", np.uint8).reshape(-1, ROW)
    assert data[21:34].any(axis=1).all()  # C's bytes reached the file, yet none of its chunks was served


def test_chunks_stored_at_tp2_in_the_canonical_layout_load_at_tp1_and_the_direct_layout_misses_them(runs):
    tp2, tp1, direct = _ok(runs["tp2-canonical"]), _ok(runs["tp1-canonical"]), _ok(runs["files"])
    assert tp2["tokens"] == _tokens(runs, 0) and len(tp2["stats"]) == 2
    assert tp1["tokens"] == _tokens(runs, 3)
    assert tp1["tier"]["folder"] == tp2["tier"]["folder"] and tp1["tier"]["found"] == PREFIX_BLOCKS
    assert (tp1["tier"]["hits"], tp1["tier"]["chunks_loaded"]) == (PREFIX_BLOCKS, PREFIX_BLOCKS)
    assert direct["tier"]["folder"] != tp2["tier"]["folder"] and direct["tier"]["found"] == 0


def test_a_directory_written_for_another_dtype_gives_misses(runs):
    r = _ok(runs["identity"])
    assert r["tier"]["found"] == 0 and r["tier"]["hits"] == 0 and r["tier"]["lookups"] > 0
    assert r["tier"]["folder"] != runs["files"]["tier"]["folder"]


def test_vllms_fs_tier_runs_over_kvxfers_primary_worker_on_the_cpu_build(runs):
    r = _ok(runs["fs"])
    assert r["tokens"] == _tokens(runs, 0, 1, 2, 3)
    assert r["stats"][0]["host_tier"] == "vllm-tiering" and r["stats"][0]["blocks_loaded"] == PREFIX_BLOCKS
    assert r["metrics"]["vllm:kv_offload_tiering_chunk_hits"] == PREFIX_BLOCKS


def test_a_two_request_run_reports_its_stored_chunks_as_events_and_its_counters_as_engine_metrics(runs):
    r = _ok(runs["events"])
    assert r["tokens"] == _tokens(runs, 0, 1)
    tier = r["tier"]
    events = [json.loads(ln) for ln in (Path(tier["folder"]).parents[1] / "events.jsonl").read_text().splitlines()]
    assert events and all(e["medium"] == "STORAGE" and e["ownership"] == "RecordingFileTier" and e["locality"] == "LOCAL"
                          for e in events)
    stored = [k for e in events if not e["removed"] for k in e["keys"]]
    assert len(stored) == len(set(stored)) == tier["chunks_stored"] == PREFIX_BLOCKS + 13
    assert not any(e["removed"] for e in events)
    m = r["metrics"]
    assert m["vllm:kvxfer_tier_bytes"] == tier["bytes_stored"] == (PREFIX_BLOCKS + 13) * ROW
    assert m["vllm:kvxfer_tier_chunks"] == PREFIX_BLOCKS + 13 and m["vllm:kvxfer_tier_lookups"] == tier["lookups"]
    assert m["vllm:kvxfer_tier_io_ms"] > 0 and m["vllm:kvxfer_tier_job_ms"] > 0  # milliseconds: never rounded to 0
    assert m["vllm:kvxfer_tier_capacity_chunks"] == 64


def test_a_truncated_data_file_before_a_restart_costs_only_the_chunks_past_its_end(runs):
    r = _ok(runs["truncated"])
    assert r["tokens"] == _tokens(runs, 3, 4)  # every request finishes with the tokens of no offloading
    tier = r["tier"]
    assert tier["chunks_loaded"] >= PREFIX_BLOCKS and tier["integrity_misses"] >= 1 and tier["failed_jobs"] <= 2
    assert r["log"].count("stored chunk(s) refused and dropped") >= 2  # the "warm" case's line and this one's


def test_random_bytes_in_the_records_before_a_restart_start_the_store_over_and_say_so(runs):
    r = _ok(runs["records"])
    assert r["tokens"][0] == _tokens(runs, 3)[0]
    assert r["tier"]["found"] == 0
    assert r["log"].count("set aside as") == 1 and "not kvxfer integrity records" in r["log"]


def test_a_store_damaged_while_the_engine_runs_costs_the_chunks_and_the_engine_serves_on(runs):
    # the same engine, on: A2, B and C stored to disk, then (the engine running) the data file cut to 4 slots and
    # random bytes written over the records; A2 again finds its prefix on disk only, and every chunk of it is refused
    r = _ok(runs["records"])
    assert r["tokens"] == _tokens(runs, 3, 1, 2, 3)  # every request finishes with the tokens of no offloading
    tier = r["tier"]
    assert tier["chunks_stored"] >= 8 + 13 + 13 and tier["chunks_loaded"] == 0
    assert tier["integrity_misses"] == PREFIX_BLOCKS and tier["failed_jobs"] >= 1
    assert r["log"].count(f"{PREFIX_BLOCKS} stored chunk(s) refused and dropped") == 1  # named once


def test_a_second_engine_on_a_shared_root_serves_the_prefix_the_first_stored(runs):
    one, two = _ok(runs["shared-1"]), _ok(runs["shared-2"])
    assert one["tokens"] == _tokens(runs, 0, 1, 2) and two["tokens"] == _tokens(runs, 3)
    assert one["tier"]["writer"] != two["tier"]["writer"] and one["tier"]["folder"] == two["tier"]["folder"]
    # A's and B's chunks, and C's, which the first engine drains from its host tier as it stops: all found by the second
    assert one["tier"]["chunks_stored"] >= 8 + 13 and two["tier"]["found"] == one["tier"]["chunks_stored"]
    assert (two["tier"]["chunks_loaded"], two["tier"]["integrity_misses"]) == (PREFIX_BLOCKS, 0)
    assert two["metrics"]["vllm:external_prefix_cache_hits"] == PREFIX_BLOCKS * 32
