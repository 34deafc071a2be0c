"""kvxfer's file tier beside vLLM's own ``fs`` tier, both under ``KvxferTieringOffloadingSpec``'s primary worker on
vLLM's CPU build.

1. Files (no engine; each tier driven as vLLM's tiering manager drives it, same primary rows, same chunks): GB/s
   of a store of ``--chunks`` chunks of ``--chunk-mib`` MiB from host rows into the tier and of their load back,
   from submission until the result is polled, against one sequential write (read) of the same bytes; kvxfer with
   and without the page cache (O_DIRECT; its reads and writes on 4 threads, and on 1) and with durability
   ``none`` and ``fdatasync``. vLLM's ``fs`` tier uses
   O_DIRECT where a probe says it works, and never syncs. Files and folders after the store, and file and
   descriptor syscalls per GiB stored and loaded back (``strace -f -c -e trace=%file,%desc`` of a process that
   stores and loads ``--chunks`` chunks, less one that moves one).
2. Engines (the model of ``bench_vllm.py``: 8 layers, hidden 512, 8 KV heads of 64, float32; a 2,048-token prefix
   is 64 MiB of KV). Recomputed: one engine without offloading serves P, two long prompts that evict P from its
   cache, then P' (P's prefix again). Per tier: an engine serves P and the two long prompts and exits (its stores
   drain); a new engine on the same directory serves P', every chunk of the prefix from disk. Time to first token
   of P'; scheduler-process CPU time per engine step over both engines (``tier_timing``: the tier's calls on the
   scheduler thread, and the whole process's CPU, I/O threads included); the restore timeline (queued, read,
   reported, device load submitted).
3. Crashes (the small Llama of the engine tests): an engine serving six prompts is SIGKILLed at a random moment
   once the tier has begun storing; a new engine on the same directory serves each prompt's prefix with a new
   suffix; wrong tokens are counted against an engine without offloading, with the hits from disk. Then one byte
   of a stored chunk is changed on disk and the prefixes are served again.

    .venv-vllm/bin/python benchmarks/bench_vllm_tiers.py [--root /var/tmp] [--chunks 128] [--chunk-mib 1]
        [--kills 2] [--skip-files] [--skip-engines] [--skip-crash] [--quick] [--json OUT]
        [--rounds 1] [--engine-tiers page,odirect,fs]

Run it under ``flock /tmp/kvxfer-engine.lock``. ``--quick``: small sizes (a smoke run; its figures are not for
notes). Needs .venv-vllm (``make venv-vllm``) and, for syscalls, ``strace``.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # the engine runner and the model writer live with the engine tests
    sys.path.insert(0, str(ROOT))


# ---- 1. files ------------------------------------------------------------------------------------------------
def _spec(chunk_bytes: int) -> Any:
    """The fields of vLLM's offloading spec that both tiers read (kvxfer's identity, vLLM's FileMapper)."""
    parallel = SimpleNamespace(tp_size=1, pp_size=1, pcp_size=1, dcp_size=1, world_size=1, rank=0,
                               is_parallelism_agnostic=False)
    config = SimpleNamespace(model=SimpleNamespace(name="bench/llama", dtype="float32"), parallel=parallel,
                             cache=SimpleNamespace(tokens_per_hash=32), canonical_layout=False, replicated_layout=False,
                             kv_cache_layout="LBNHC", groups=(SimpleNamespace(tokens_per_block=32, layer_names=("l0",)),))
    return SimpleNamespace(config=config, blocks_per_chunk=1, replicated_layout=False,
                           kv_events_config=SimpleNamespace(enable_kv_cache_events=False))


def _rows(chunks: int, chunk_bytes: int) -> tuple[mmap.mmap, np.ndarray]:
    """2 x ``chunks`` host rows, page-aligned (O_DIRECT) and committed (as vLLM's primary tier is), the first half
    random."""
    buf = mmap.mmap(-1, 2 * chunks * chunk_bytes)
    rows = np.frombuffer(buf, np.int8).reshape(2 * chunks, chunk_bytes)
    rows[:chunks] = np.random.default_rng(0).integers(-128, 127, (chunks, chunk_bytes), dtype=np.int8)
    rows[chunks:] = 0
    return buf, rows


def _make_tier(kind: str, root: Path, rows: np.ndarray, **kw: Any) -> Any:
    if kind == "fs":
        from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager

        return FileSystemTierManager(_spec(rows.shape[1]), memoryview(rows), "fs", root_dir=str(root))
    from kvxfer.offload.vllm import KvxferFileTier

    return KvxferFileTier(_spec(rows.shape[1]), memoryview(rows), "KvxferFileTier", None, root_dir=str(root),
                          capacity_bytes=rows.nbytes, **kw)


def _job(tier: Any, job: Any) -> float:
    """Seconds from submission until the tier reports ``job`` (polled as often as the scheduler could)."""
    t0 = time.perf_counter()
    (tier.submit_load if job.is_promotion else tier.submit_store)(job)
    while True:
        done = list(tier.get_finished_jobs())
        if done:
            assert len(done) == 1 and done[0].success, done
            return time.perf_counter() - t0
        time.sleep(0.0002)


def tier_round_trip(kind: str, root: Path, chunks: int, chunk_bytes: int, **kw: Any) -> tuple[float, float, int]:
    """(store s, load s, files after the store) of one fresh tier: rows [0, chunks) stored, loaded into the rest."""
    from vllm.v1.kv_offload.base import ReqContext
    from vllm.v1.kv_offload.tiering.base import TransferJob

    _, rows = _rows(chunks, chunk_bytes)
    root.mkdir(parents=True)
    tier = _make_tier(kind, root, rows, **kw)
    ctx = ReqContext(req_id="bench")
    keys = [os.urandom(32) + bytes(4) for _ in range(chunks)]
    store = _job(tier, TransferJob(1, keys, np.arange(chunks), False, ctx))
    files = sum(len(f) + len(d) for _, d, f in os.walk(root))  # files and folders
    load = _job(tier, TransferJob(2, keys, np.arange(chunks, 2 * chunks), True, ctx))
    assert np.array_equal(rows[chunks:], rows[:chunks]), "a load did not give back the bytes stored"
    tier.shutdown()
    del tier, rows  # the anonymous mapping goes with the last view of it
    return store, load, files


def sequential(path: Path, data: np.ndarray, o_direct: bool, sync: bool) -> tuple[float, float]:
    """(write s, read s) of ``data`` as one write and one read of one file."""
    flags = os.O_DIRECT if o_direct else 0
    fd = os.open(path, os.O_CREAT | os.O_TRUNC | os.O_WRONLY | flags, 0o600)
    t0 = time.perf_counter()
    done, view = 0, memoryview(data).cast("B")
    while done < len(view):
        done += os.write(fd, view[done:])
    if sync:
        os.fdatasync(fd)
    write = time.perf_counter() - t0
    os.close(fd)
    out = mmap.mmap(-1, data.nbytes)
    np.frombuffer(out, np.uint8)[:] = 0  # committed, as the rows a tier loads into
    fd = os.open(path, os.O_RDONLY | flags)
    t0 = time.perf_counter()
    got = 0
    while got < data.nbytes:
        got += os.preadv(fd, [memoryview(out)[got:]], got)
    read = time.perf_counter() - t0
    os.close(fd)
    out.close()
    path.unlink()
    return write, read


def files_bench(root: Path, chunks: int, chunk_bytes: int, reps: int = 3) -> dict[str, Any]:
    buf, rows = _rows(chunks, chunk_bytes)
    data = rows[:chunks]
    gib = data.nbytes / 2**30
    out: dict[str, Any] = {"bytes": data.nbytes}
    for name, o_direct, sync in (("sequential, page cache", False, False), ("sequential, page cache + fdatasync", False, True),
                                 ("sequential, O_DIRECT", True, False), ("sequential, O_DIRECT + fdatasync", True, True)):
        best = [min(x) for x in zip(*(sequential(root / "seq.bin", data, o_direct, sync) for _ in range(reps)))]
        out[name] = {"store_gbs": data.nbytes / best[0] / 1e9, "load_gbs": data.nbytes / best[1] / 1e9}
    del rows, data
    buf.close()
    variants = [("kvxfer, page cache, durability none", "kvxfer", {"durability": "none"}),
                ("kvxfer, page cache, fdatasync", "kvxfer", {}),
                ("kvxfer, page cache, none, no CRC", "kvxfer", {"durability": "none", "verify": False}),
                ("kvxfer, O_DIRECT, durability none", "kvxfer", {"durability": "none", "o_direct": True}),
                ("kvxfer, O_DIRECT, none, 1 I/O thread", "kvxfer", {"durability": "none", "o_direct": True,
                                                                    "io_threads": 1}),
                ("kvxfer, O_DIRECT, fdatasync", "kvxfer", {"o_direct": True}),
                ("vLLM fs (O_DIRECT, no sync)", "fs", {})]
    for name, kind, kw in variants:
        runs = []
        for rep in range(reps):
            where = root / f"{kind}-{len(out)}-{rep}"
            runs.append(tier_round_trip(kind, where, chunks, chunk_bytes, **kw))
            shutil.rmtree(where)
        store, load = min(r[0] for r in runs), min(r[1] for r in runs)
        out[name] = {"store_gbs": chunks * chunk_bytes / store / 1e9, "load_gbs": chunks * chunk_bytes / load / 1e9,
                     "files": runs[0][2], "files_per_gib": runs[0][2] / gib}
    return out


def syscalls_per_gib(root: Path, chunks: int, chunk_bytes: int) -> dict[str, float]:
    """File and descriptor syscalls (strace's %file and %desc classes: opens, reads, writes, syncs, renames, stats,
    closes; not futexes, sleeps or mappings) per stored GiB for each tier: ``strace -f -c`` of a child that stores
    and loads ``chunks`` chunks, less one that moves one chunk (imports and set-up)."""
    if shutil.which("strace") is None:
        return {}
    out = {}
    for kind, kw in (("kvxfer", '{"durability": "fdatasync"}'), ("fs", "{}")):
        calls = []
        for n in (chunks, 1):
            summary = root / f"strace-{kind}-{n}.txt"
            where = root / f"strace-{kind}-{n}"
            child = [sys.executable, __file__, "--child", kind, "--child-kw", kw, "--chunks", str(n), "--chunk-bytes",
                     str(chunk_bytes), "--root", str(where)]
            subprocess.run(["strace", "-f", "-c", "-e", "trace=%file,%desc", "-o", str(summary), *child], check=True,
                           capture_output=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
            total = [ln.split() for ln in summary.read_text().splitlines() if ln.strip().endswith("total")][-1]
            calls.append(int(total[3]))  # % time, seconds, usecs/call, calls[, errors], "total"
            shutil.rmtree(where, ignore_errors=True)
        out[kind] = (calls[0] - calls[1]) / ((chunks - 1) * chunk_bytes / 2**30)
    return out


# ---- 2. engines ----------------------------------------------------------------------------------------------
def _tier_entry(kind: str, root: Path, timing: Path, **kw: Any) -> dict[str, Any]:
    if kind == "fs":
        return {"type": "TimedFileSystemTierManager", "module_path": "benchmarks.tier_timing", "root_dir": str(root),
                "timing_path": str(timing)}
    return {"type": "TimedKvxferFileTier", "module_path": "benchmarks.tier_timing", "root_dir": str(root),
            "capacity_bytes": 8 << 30, "timing_path": str(timing), "stats_path": f"{timing}.tier", **kw}


ENGINE_TIERS = {"page": ("kvxfer, page cache", "kvxfer", {}), "odirect": ("kvxfer, O_DIRECT", "kvxfer", {"o_direct": True}),
                "fs": ("vLLM fs", "fs", {})}


def engine_bench(tmp: Path, layers: int, hidden: int, prefix_blocks: int, tiers: tuple[str, ...] = ("page", "odirect", "fs"),
                 rounds: int = 1) -> dict[str, Any]:
    """Part 2. With ``rounds`` above 1 the tiers run again in turn, the order reversed every other round (each
    round's figures under ``out["rounds"]``; the first round's also under the tier's name)."""
    from tests.vllm.engine import run

    r = random.Random(0)
    prefix_tokens = prefix_blocks * 32
    prefix = [r.randrange(3, 4000) for _ in range(prefix_tokens)]
    requests = [prefix + [r.randrange(3, 4000) for _ in range(16)],
                [r.randrange(3, 4000) for _ in range(prefix_tokens + 40)],
                [r.randrange(3, 4000) for _ in range(prefix_tokens + 40)],
                prefix + [r.randrange(3, 4000) for _ in range(16)]]
    heads = hidden // 64
    model = {"model_dir": str(tmp / "model"), "layers": layers, "hidden": hidden, "heads": heads, "kv_heads": heads,
             "intermediate": hidden * 11 // 4, "vocab": 4096}
    chunk = layers * heads * 32 * 2 * 64 * 4
    engine = {"num_gpu_blocks_override": prefix_blocks + 16, "max_model_len": (prefix_blocks + 2) * 32,
              "max_num_batched_tokens": 8192}
    base = {"model": model, "engine": engine, "requests": requests, "max_tokens": 1}
    out: dict[str, Any] = {"chunk_bytes": chunk}
    rec = run({**base, "name": "recomputed", "offload": None})
    if rec["error"]:
        raise SystemExit(f"recomputed: {rec['error']}")
    out["recomputed"] = {**rec, "ttft_s": rec["request_times_s"][3], "timing": None, "tier": None}
    out["rounds"] = []
    for rnd in range(rounds):
        out["rounds"].append({})
        for name, kind, kw in (ENGINE_TIERS[t] for t in (tiers if rnd % 2 == 0 else tiers[::-1])):
            _one_tier(tmp, out, rec, base, requests, prefix_blocks, chunk, rnd, name, kind, kw)
    return out


def _one_tier(tmp: Path, out: dict[str, Any], rec: dict[str, Any], base: dict[str, Any], requests: list[list[int]],
              prefix_blocks: int, chunk: int, rnd: int, name: str, kind: str, kw: dict[str, Any]) -> None:
    """One tier's two engines (stores, then P' from disk on a new engine), into ``out``."""
    from tests.vllm.engine import run

    tag = f"{rnd}-{kind}-{len(kw)}"
    root = tmp / f"root-{tag}"
    root.mkdir()
    runs = []
    # the first engine stores P and the prompts that evict it, and exits (its stores drain); the second, on
    # the same directory, serves P' with an empty host tier: every chunk of the prefix comes from disk
    for i, reqs in enumerate((requests[:3], requests[3:])):
        timing = tmp / f"timing-{tag}-{i}.json"
        offload = {"spec_name": "KvxferTieringOffloadingSpec", "cpu_bytes_to_use": 2 * prefix_blocks * chunk,
                   "secondary_tiers": [_tier_entry(kind, root, timing, **kw)]}
        res = run({**base, "name": name, "offload": offload, "requests": reqs})
        if res["error"]:
            raise SystemExit(f"{name}: {res['error']}")
        tier = Path(f"{timing}.tier")
        runs.append({**res, "timing": json.loads(timing.read_text()) if timing.exists() else None,
                     "tier": json.loads(tier.read_text()) if tier.exists() else None})
    if runs[1]["tokens"] != rec["tokens"][3:]:
        raise SystemExit(f"{name}: tokens of P' differ from the recomputed engine's")
    t0, t1 = runs[0]["timing"] or {}, runs[1]["timing"] or {}
    timing_sum = {k: t0.get(k, 0) + t1.get(k, 0) for k in ("calls", "scheduler_s", "steps", "process_cpu_s")}
    loads = [j for j in t1.get("loads", []) if j["ok"]]  # the new engine's first load: the prefix from disk
    out["rounds"][rnd][name] = {"ttft_s": runs[1]["request_times_s"][0], "load_s": loads[0]["s"] if loads else None,
                                "load_chunks": loads[0]["chunks"] if loads else 0}
    if rnd == 0:
        out[name] = {**runs[1], "ttft_s": runs[1]["request_times_s"][0], "timing": timing_sum, "store_run": runs[0]}


# ---- 3. crashes --------------------------------------------------------------------------------------------------
def _engine_core(pid: int) -> int | None:
    import psutil

    for p in psutil.Process(pid).children(recursive=True):
        try:
            if "EngineCore" in " ".join(p.cmdline()) or "EngineCore" in p.name():
                return int(p.pid)
        except psutil.Error:
            continue
    return None


def _stores_begun(kind: str, root: Path, stats: Path) -> bool:
    if kind == "fs":
        return any(f.endswith(".bin") for _, _, fs in os.walk(root) for f in fs)
    return stats.exists() and json.loads(stats.read_text() or "{}").get("stores", 0) >= 1


def crash_once(kind: str, tmp: Path, case: dict[str, Any], seed: int) -> None:
    """Run ``case`` in a process of its own and SIGKILL its engine a random 0-40 ms after the tier's first store."""
    path = tmp / f"crash-{seed}.json"
    path.write_text(json.dumps([case]))
    proc = subprocess.Popen([sys.executable, "-m", "tests.vllm.engine", str(path)], cwd=ROOT, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    stats, root = Path(case["offload"]["secondary_tiers"][0].get("stats_path", "/nonexistent")), Path(
        case["offload"]["secondary_tiers"][0]["root_dir"])
    deadline = time.monotonic() + 600
    while proc.poll() is None and not _stores_begun(kind, root, stats) and time.monotonic() < deadline:
        time.sleep(0.002)
    time.sleep(random.Random(seed).uniform(0, 0.04))
    core = _engine_core(proc.pid)
    if core is not None:
        os.kill(core, signal.SIGKILL)
    time.sleep(1.0)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for leftover in Path("/dev/shm").glob("vllm_offload_*.mmap"):
        try:
            if time.time() - leftover.stat().st_mtime < 900:  # this run's (the engine lock keeps others out)
                leftover.unlink()
        except OSError:
            pass


def crash_bench(tmp: Path, kills: int) -> dict[str, Any]:
    from tests.vllm.engine import run

    r = random.Random(7)

    def ids(n: int) -> list[int]:
        return [r.randrange(3, 512) for _ in range(n)]

    prompts = [ids(320 + 32 * (i % 3)) for i in range(6)]
    again = [p[:256] + ids(12) for p in prompts]
    model = {"model_dir": str(tmp / "small-model")}
    engine = {"num_gpu_blocks_override": 16, "max_model_len": 480}
    base = run({"name": "baseline", "offload": None, "model": model, "engine": engine, "requests": again, "max_tokens": 8})
    row = 2 * 2 * 32 * 2 * 32 * 4
    out: dict[str, Any] = {}
    for kind in ("kvxfer", "fs"):
        wrong = hits = 0
        for k in range(kills):
            root = tmp / f"crash-{kind}-{k}"
            root.mkdir()
            entry = ({"type": "fs", "root_dir": str(root)} if kind == "fs" else
                     {"type": "KvxferFileTier", "module_path": "kvxfer.offload.vllm", "root_dir": str(root),
                      "capacity_bytes": 1 << 30, "stats_path": str(tmp / f"crash-{kind}-{k}.json")})
            offload = {"spec_name": "KvxferTieringOffloadingSpec", "cpu_bytes_to_use": 16 * row, "secondary_tiers": [entry]}
            case = {"name": "crash", "offload": offload, "model": model, "engine": engine, "requests": prompts,
                    "max_tokens": 8}
            crash_once(kind, tmp, case, seed=k)
            entry = {k2: v for k2, v in entry.items() if k2 != "stats_path"}
            res = run({**case, "name": "restart", "offload": {**offload, "secondary_tiers": [entry]}, "requests": again})
            if res["error"]:
                raise SystemExit(f"{kind} restart: {res['error']}")
            wrong += sum(a != b for got, want in zip(res["tokens"], base["tokens"]) for a, b in zip(got, want))
            hits += int(res["metrics"].get("vllm:kv_offload_tiering_chunk_hits", 0))
            if k == kills - 1:  # then the first 8 KiB of every stored chunk overwritten on disk
                _corrupt_chunks(root, row)
                res = run({**case, "name": "corrupted", "offload": {**offload, "secondary_tiers": [entry]},
                           "requests": again})
                out[f"{kind} corrupted"] = {"wrong_tokens": sum(a != b for got, want in zip(res["tokens"], base["tokens"])
                                                                for a, b in zip(got, want)),
                                            "hits": int(res["metrics"].get("vllm:kv_offload_tiering_chunk_hits", 0))}
        out[kind] = {"kills": kills, "wrong_tokens": wrong, "tokens": kills * sum(len(t) for t in base["tokens"]),
                     "hits": hits}
    return out


def _corrupt_chunks(root: Path, row: int) -> None:
    """Overwrite the first 8 KiB of every chunk a tier stored under ``root`` with random bytes (vLLM's fs: every
    ``.bin`` file; kvxfer: the slots of its data file that hold data)."""
    noise = np.random.default_rng(3).integers(0, 256, 8192, dtype=np.uint8).tobytes()
    for path in root.rglob("*"):
        if not path.is_file() or path.suffix not in (".bin", ".kvx"):
            continue
        with open(path, "r+b") as f:
            for at in range(0, path.stat().st_size, row if path.suffix == ".kvx" else path.stat().st_size):
                try:
                    if os.lseek(f.fileno(), at, os.SEEK_DATA) != at:
                        continue  # a hole: a slot never written
                except OSError:
                    break
                f.seek(at)
                f.write(noise)


# ---- report ------------------------------------------------------------------------------------------------------
def _child(a: argparse.Namespace) -> None:
    tier_round_trip(a.child, a.root, a.chunks, a.chunk_bytes, **json.loads(a.child_kw))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--root", type=Path, default=Path("/var/tmp"))
    ap.add_argument("--chunks", type=int, default=128)
    ap.add_argument("--chunk-mib", type=int, default=1)
    ap.add_argument("--chunk-bytes", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--prefix-blocks", type=int, default=64)
    ap.add_argument("--kills", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=1, help="part 2: run the tiers this many times, in turn")
    ap.add_argument("--engine-tiers", default="page,odirect,fs", help="part 2: which of page, odirect, fs")
    ap.add_argument("--skip-files", action="store_true")
    ap.add_argument("--skip-engines", action="store_true")
    ap.add_argument("--skip-crash", action="store_true")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--child-kw", default="{}", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        return _child(a)
    if a.quick:
        a.chunks, a.layers, a.hidden, a.prefix_blocks, a.kills = 16, 2, 128, 8, 1
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    chunk_bytes = a.chunk_bytes or a.chunk_mib << 20
    tmp = Path(tempfile.mkdtemp(prefix="kvxfer-bench-tiers-", dir=a.root))
    figures: dict[str, Any] = {"load_average_start": os.getloadavg()}
    try:
        if not a.skip_files:
            figures["files"] = f = files_bench(tmp, a.chunks, chunk_bytes)
            figures["syscalls_per_gib"] = sc = syscalls_per_gib(tmp, a.chunks, chunk_bytes)
            print(f"\n1. {a.chunks} chunks of {chunk_bytes >> 20} MiB ({f['bytes'] / 2**20:.0f} MiB) from host rows to "
                  f"files under {a.root} and back, best of 3 (GB/s)")
            print(f"{'':40} {'store':>7} {'load':>7} {'files+dirs':>10}")
            for name, v in f.items():
                if isinstance(v, dict):
                    print(f"{name:40} {v['store_gbs']:7.2f} {v['load_gbs']:7.2f} {v.get('files', 1):10d}")
            print("file and descriptor syscalls per GiB stored and loaded back: "
                  + ", ".join(f"{k} {v:,.0f}" for k, v in sc.items()))
        if not a.skip_engines:
            tiers = tuple(t.strip() for t in a.engine_tiers.split(","))
            unknown = [t for t in tiers if t not in ENGINE_TIERS]
            if unknown:
                raise SystemExit(f"--engine-tiers: {unknown} (choose from {', '.join(ENGINE_TIERS)})")
            e = engine_bench(tmp, a.layers, a.hidden, a.prefix_blocks, tiers, a.rounds)
            figures["engines"] = {k: ({kk: v[kk] for kk in ("ttft_s", "request_times_s", "timing", "tier", "stats",
                                                            "metrics")} if isinstance(v, dict) else v)
                                  for k, v in e.items()}
            rec = e["recomputed"]["ttft_s"]
            print(f"\n2. P' ({a.prefix_blocks * 32}-token prefix, {a.prefix_blocks * e['chunk_bytes'] / 2**20:.1f} MiB of "
                  f"KV): time to first token, recomputed after eviction, or restored from disk by a new engine")
            print(f"{'':22} {'TTFT s':>7} {'x recompute':>11} {'disk hits':>9} {'sched us/step':>13} {'proc CPU ms/step':>16}")
            for name in ("recomputed", *(ENGINE_TIERS[t][0] for t in tiers)):
                v = e[name]
                t, m = v["timing"], v["metrics"]
                steps = max((t or {}).get("steps", 0), 1)
                sched = f"{t['scheduler_s'] / steps * 1e6:13.0f}" if t else f"{'-':>13}"
                cpu = f"{t['process_cpu_s'] / steps * 1e3:16.2f}" if t else f"{'-':>16}"
                print(f"{name:22} {v['ttft_s']:7.3f} {v['ttft_s'] / rec:11.2f} "
                      f"{m.get('vllm:kv_offload_tiering_chunk_hits', 0):9.0f} {sched} {cpu}")
            for name in (ENGINE_TIERS[t][0] for t in tiers if t != "fs"):
                t, worker = e[name]["tier"], e[name]["stats"][0]
                if t and t["load_timeline"] and worker.get("load_submitted"):
                    j = t["load_timeline"][-1]
                    dev = worker["load_submitted"][-1]
                    print(f"{name}: promotion of {j['chunks']} chunks: queued {1e3 * (j['started'] - j['submitted']):.1f} ms, "
                          f"read {1e3 * (j['done'] - j['started']):.1f} ms, reported {1e3 * (j['polled'] - j['done']):.1f} ms "
                          f"later, device load submitted {1e3 * (dev - j['polled']):.1f} ms after that")
            names = [ENGINE_TIERS[t][0] for t in tiers]
            print("\nper round (the order reversed every other round): P' TTFT s, and its load from disk as the scheduler"
                  " saw it (submit_load until get_finished_jobs reports it), ms")
            print(f"{'round':>5} " + " ".join(f"{n + ' TTFT':>24} {'load ms':>8}" for n in names))
            for i, row in enumerate(e["rounds"]):
                print(f"{i + 1:5d} " + " ".join(f"{row[n]['ttft_s']:24.3f} " + (f"{1e3 * row[n]['load_s']:8.1f}"
                                                                              if row[n]["load_s"] is not None else f"{'-':>8}")
                                                for n in names))
            if "vLLM fs" in names:
                for n in (n for n in names if n != "vLLM fs"):
                    tt = [row[n]["ttft_s"] / row["vLLM fs"]["ttft_s"] for row in e["rounds"]]
                    ld = [row[n]["load_s"] / row["vLLM fs"]["load_s"] for row in e["rounds"]
                          if row[n]["load_s"] and row["vLLM fs"]["load_s"]]
                    print(f"{n} / vLLM fs, per round: TTFT " + ", ".join(f"{x:.2f}" for x in tt)
                          + "; load " + ", ".join(f"{x:.2f}" for x in ld))
        if not a.skip_crash:
            figures["crash"] = c = crash_bench(tmp, a.kills)
            print("\n3. SIGKILL while storing, restart on the same directory, the six prefixes again")
            for name, v in c.items():
                print(f"{name:22} wrong tokens {v['wrong_tokens']:4d}  hits from disk {v['hits']:4d}"
                      + (f"  (of {v['tokens']} tokens, {v['kills']} kills)" if "kills" in v else ""))
    finally:
        figures["load_average_end"] = os.getloadavg()
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"\nload average {figures['load_average_start']} -> {figures['load_average_end']}")
    if a.json:
        a.json.write_text(json.dumps(figures, indent=1, default=str))


if __name__ == "__main__":
    main()
