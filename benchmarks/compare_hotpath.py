"""Per-job planning (BlockMapping from numpy ids + plan_transfer), old planner against new, in one process, on
the shapes of ``bench_hostpath.py``; contiguous k = 1 shapes also against its run-based coalescing build.

    python benchmarks/compare_hotpath.py OLD_ROOT [ROUNDS]

OLD_ROOT is a checkout of the baseline (``git worktree add /tmp/planner-old <commit>``), imported as
``kvxfer_old.planner`` (see ``compare_planner.py``). Rounds alternate old, new and run-based; each is timed
over at least 50 ms of process CPU time; the minimum over rounds is reported. Both plans are checked equal
first. Nothing is asserted; figures go to benchmarks/NOTES.md.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hostpath as bh
from compare_planner import load_old, loop_time


def worker_layout(mod: Any, tensors: int, gpu_blocks: int, cpu_chunks: int, page: int, k: int) -> Any:
    """``bench_hostpath.worker_layout`` built from ``mod``'s values (old or new planner)."""
    new = bh.worker_layout(tensors, gpu_blocks, cpu_chunks, page, k)
    return mod.Layout.model_validate(new.model_dump())


def planner(mod: Any, layout: Any, job: Any) -> Any:
    s, d = (job.cpu_chunks, job.gpu_ids) if job.direction.value == "h2d" else (job.gpu_ids, job.cpu_chunks)
    grouped = job.k > 1 or job.skip
    target, direction = mod.Target(platform="cuda", runtime_version=mod.cuda_version(13, 0)), mod.Direction(job.direction.value)

    def plan() -> Any:
        return mod.plan_transfer(layout, mod.BlockMapping(
            direction=direction, src_ids=s, dst_ids=d, group_sizes=(job.count,) if grouped else None,
            group_starts=(job.skip,) if grouped else None), target)
    return plan


def main() -> None:
    import kvxfer.planner as new

    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 9
    shapes = [("contiguous", bh.C32_BLOCKS, 1, "h2d")] + [
        (p, n, k, dr) for p in ("contiguous", "runs8", "fragmented") for n in (256, 2048) for k in (1, 4)
        for dr in ("h2d", "d2h")]
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old(Path(sys.argv[1]), Path(tmp))
        print(f"{'case':<34}{'old ms':>9}{'new ms':>9}{'new/old':>9}{'runs ms':>9}{'old/runs':>9}{'new/runs':>9}")
        for pattern, n, k, dr in shapes:
            job, g, c = bh.make_job(pattern, n, k, dr, seed=32 if n == bh.C32_BLOCKS else 0)
            fo = planner(old, worker_layout(old, bh.NUM_TENSORS, g, c, 256, k), job)
            fn = planner(new, worker_layout(new, bh.NUM_TENSORS, g, c, 256, k), job)
            a, b = fo(), fn()
            if a.fingerprint != b.fingerprint:
                raise SystemExit(f"{pattern} {n} {k} {dr}: the plans differ")
            fns = {"old": fo, "new": fn}
            if k == 1 and pattern == "contiguous":
                _, tensors = bh.memory_for(bh.worker_layout(bh.NUM_TENSORS, g, c, 256, 1))
                fns["runs"] = lambda: bh.run_based_descriptors(tensors, job)
            t: dict[str, float] = {key: np.inf for key in fns}
            for _ in range(rounds):
                for key, f in fns.items():
                    t[key] = min(t[key], loop_time(f) * 1e3)
            row = f"{f'118x{n} {pattern} k={k} {dr}':<34}{t['old']:9.3f}{t['new']:9.3f}{t['new'] / t['old']:9.2f}"
            if "runs" in t:
                row += f"{t['runs']:9.3f}{t['old'] / t['runs']:9.2f}{t['new'] / t['runs']:9.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
