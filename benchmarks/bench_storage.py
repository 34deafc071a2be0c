"""Spill and restore to a file on a real disk through NIXL's POSIX backend: per-block plan, merged plan, and one
large pwrite/pread of the same bytes, buffered and O_DIRECT.

Shapes: a tier layout of R regions x B blocks x page bytes in host memory, spilled to slots of one file; the
file keeps one spare slot per region, so region ranges cannot merge into each other (one I/O request per
region, as with real host chunk ids). A spill (WRITE) moves every block; a restore (READ) reads them back.
Every write is timed until durable: run() to completion plus fdatasync (the large pwrite too). Before every
read, the file's pages are dropped from the page cache (fdatasync + POSIX_FADV_DONTNEED), so buffered reads
come from the disk. Ratios are against the one large I/O measured in the same run; the restore is checked
byte for byte once per shape. "merged, pread" issues the merged plan's requests as plain pwrite/pread
calls (the access pattern without NIXL). "tier" runs the merged plan through FileTier (CRC-32 per chunk, records,
fdatasync) to show what integrity costs on top.

    python benchmarks/bench_storage.py [--dir /var/tmp] [--reps 3] [--regions 118] [--out out/bench_storage.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from kvxfer.executors.nixl_memory import FileBinding
from kvxfer.executors.nixl_peer import LOOPBACK_ENV
from kvxfer.offload.files.file_tier import FileTier, aligned_empty, tier_layout
from kvxfer.planner import BlockMapping, PlanOptions, plan_transfer

KIB = 1024


def _drop_cache(fd: int) -> None:
    os.fdatasync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _nixl(ex, plan, bindings, fd: int, write: bool) -> float:
    if not write:
        _drop_cache(fd)
    t0 = time.perf_counter()
    ex.run(plan, bindings).wait()
    if write:
        os.fdatasync(fd)
    return time.perf_counter() - t0


def _large(mem: np.ndarray, fd: int, write: bool) -> float:
    if not write:
        _drop_cache(fd)
    t0 = time.perf_counter()
    n = os.pwritev(fd, [mem], 0) if write else os.preadv(fd, [mem], 0)
    if write:
        os.fdatasync(fd)
    if n != mem.nbytes:
        raise OSError(f"short {'write' if write else 'read'}: {n} of {mem.nbytes} bytes")
    return time.perf_counter() - t0


def _ranges(mem: np.ndarray, plan, fd: int, write: bool) -> float:
    """The merged plan's requests as plain pwrite/pread calls: separates NIXL's cost from the access pattern's."""
    if not write:
        _drop_cache(fd)
    mem_off, file_off = (plan.src_offset, plan.dst_offset) if write else (plan.dst_offset, plan.src_offset)
    t0 = time.perf_counter()
    for m, f, n in zip(mem_off.tolist(), file_off.tolist(), plan.nbytes.tolist()):
        view = mem[m:m + n]
        got = os.pwritev(fd, [view], f) if write else os.preadv(fd, [view], f)
        if got != n:
            raise OSError(f"short {'write' if write else 'read'} at file offset {f}: {got} of {n} bytes")
    if write:
        os.fdatasync(fd)
    return time.perf_counter() - t0


def run_shape(ex, directory: Path, regions: int, blocks: int, page: int, o_direct: bool, reps: int) -> list[dict]:
    layout = tier_layout(regions, blocks, page, file_blocks=blocks + 1, align_bytes=4096)
    mem = aligned_empty(layout.buffers[0].nbytes)
    mem[:] = np.random.default_rng(0).integers(0, 256, mem.nbytes, dtype=np.uint8)
    back = aligned_empty(mem.nbytes)
    ids = np.arange(blocks)
    store, load = BlockMapping(direction="d2h", src_ids=ids, dst_ids=ids), BlockMapping(direction="h2d", src_ids=ids, dst_ids=ids)
    plans = {"per-block": {True: plan_transfer(layout, store, options=PlanOptions(coalesce=False)),
                           False: plan_transfer(layout, load, options=PlanOptions(coalesce=False))},
             "merged": {True: plan_transfer(layout, store), False: plan_transfer(layout, load)}}
    path = directory / f"bench-{regions}x{blocks}x{page}-{'direct' if o_direct else 'buffered'}.kv"
    fb = FileBinding(path, create=True, o_direct=o_direct)
    reg_f = ex.register({"file0": fb}, layout)
    reg_m = ex.register({"mem": mem}, layout.buffers[:1])
    reg_b = ex.register({"mem": back}, layout.buffers[:1])
    times: dict[tuple[str, bool], list[float]] = {}
    try:
        for _ in range(reps):
            for write in (True, False):
                for label, p in plans.items():
                    times.setdefault((label, write), []).append(
                        _nixl(ex, p[write], {"mem": mem if write else back, "file0": fb}, fb.fd, write))
                times.setdefault(("one large I/O", write), []).append(_large(mem if write else back, fb.fd, write))
                times.setdefault(("merged, pread", write), []).append(
                    _ranges(mem if write else back, plans["merged"][write], fb.fd, write))
        back[:] = 0
        ex.run(plans["merged"][True], {"mem": mem, "file0": fb}).wait()
        ex.run(plans["merged"][False], {"mem": back, "file0": fb}).wait()
        for r in range(regions):  # the restore lands every block where it came from
            a = r * blocks * page
            if not np.array_equal(back[a:a + blocks * page], mem[a:a + blocks * page]):
                raise SystemExit(f"restore differs in region {r}")
    finally:
        reg_b.deregister()
        reg_m.deregister()
        reg_f.deregister()
        fb.close()
        path.unlink(missing_ok=True)
    # the same merged spill and restore through the tier: checksums, records, fdatasync per job
    tier_dir = Path(tempfile.mkdtemp(dir=directory))
    tier = FileTier(ex, layout, {"file0": FileBinding(tier_dir / "tier.kv", create=True, o_direct=o_direct)},
                    {"mem": mem}, chunk_bytes=page)
    try:
        for _ in range(reps):
            times.setdefault(("tier (merged)", True), []).append(tier.spill(plans["merged"][True]).raise_for_error().seconds)
            _drop_cache(tier.files["file0"].fd)
            times.setdefault(("tier (merged)", False), []).append(tier.restore(plans["merged"][False]).raise_for_error().seconds)
    finally:
        tier.close()
        shutil.rmtree(tier_dir, ignore_errors=True)
    rows = []
    requests = {"per-block": plans["per-block"][True].num_ranges, "merged": plans["merged"][True].num_ranges,
                "one large I/O": 1, "tier (merged)": plans["merged"][True].num_ranges,
                "merged, pread": plans["merged"][True].num_ranges}
    for write in (True, False):
        base = statistics.median(times[("one large I/O", write)])
        for label in ("per-block", "merged", "merged, pread", "one large I/O", "tier (merged)"):
            med = statistics.median(times[(label, write)])
            rows.append({"shape": f"{regions}x{blocks}x{page // KIB}KiB", "io": "O_DIRECT" if o_direct else "buffered",
                         "op": "spill (write+fdatasync)" if write else "restore (read)", "plan": label,
                         "requests": requests[label], "bytes": int(mem.nbytes), "median_s": med,
                         "min_s": min(times[(label, write)]), "gb_s": mem.nbytes / med / 1e9,
                         "vs_large": base / med})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", default="/var/tmp", help="a directory on a real disk (not tmpfs)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--regions", type=int, default=118)
    ap.add_argument("--small-reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    for k, v in LOOPBACK_ENV.items():
        os.environ.setdefault(k, v)
    from kvxfer.executors import NixlExecutor

    ex = NixlExecutor(backends=["POSIX"], poll_timeout_s=600)
    directory = Path(tempfile.mkdtemp(prefix="kvxfer-bench-storage-", dir=args.dir))
    rows = []
    try:
        for o_direct in (False, True):
            rows += run_shape(ex, directory, args.regions, 256, 32 * KIB, o_direct, args.reps)
            rows += run_shape(ex, directory, 1, 2048, 4 * KIB, o_direct, args.small_reps)
    finally:
        ex.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(f"# {platform.node()} {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())} load {os.getloadavg()[0]:.1f}, "
          f"dir {args.dir}, backend POSIX (nixl-cu13), reps {args.reps}/{args.small_reps}")
    print(f"{'shape':<16}{'io':<10}{'op':<25}{'plan':<15}{'requests':>9}{'median ms':>11}{'GB/s':>7}{'x large':>9}")
    for r in rows:
        print(f"{r['shape']:<16}{r['io']:<10}{r['op']:<25}{r['plan']:<15}{r['requests']:>9}{r['median_s'] * 1e3:>11.1f}"
              f"{r['gb_s']:>7.2f}{r['vs_large']:>9.2f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
