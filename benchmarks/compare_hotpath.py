"""Per-job planning, old planner against new, in one process, on the shapes of ``bench_hostpath.py``, through
both input forms a serving loop uses: the dict of the scheduler's numpy id arrays (``bench_hostpath.py``'s hot
path) and a ``BlockMapping`` built per job; contiguous k = 1 shapes also against its run-based coalescing build.

    python benchmarks/compare_hotpath.py OLD_ROOT [ROUNDS] [--stated] [--samples N]

``--stated``: the new planner plans on layouts whose placements state their block counts (as the offload
worker's do), the old one on the same layouts without them (it knows no counts); the plans are the same.
OLD_ROOT is a checkout of the baseline (``/work/mkold.sh planner`` makes one of 7a517d5), imported as
``kvxfer_old.planner`` (see ``compare_planner.py``). Rounds alternate old and new of both forms (and the
run-based build), starting each round one variant later (the code timed just after another pays for the
caches that one left behind); each is timed over at least 50 ms of process CPU time; the minimum over rounds
is reported. ``--samples N``: instead, N rounds of short samples (about 2 ms of calls each, the order turning
as above) and their 10th percentile, which a machine shared with other jobs disturbs less than a minimum of
long loops (a burst of other load spoils few short samples, and no lucky one decides alone). All plans are
checked equal first. Nothing is asserted; figures go to benchmarks/NOTES.md.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_hostpath as bh
from compare_planner import load_old, timed


def worker_layout(mod: Any, tensors: int, gpu_blocks: int, cpu_chunks: int, page: int, k: int,
                  stated: bool = False) -> Any:
    """``bench_hostpath.worker_layout`` built from ``mod``'s values (old or new planner); ``stated``: with the
    block counts the offload worker's layouts state (a planner that knows them)."""
    new = bh.worker_layout(tensors, gpu_blocks, cpu_chunks, page, k, stated)
    return mod.Layout.model_validate(new.model_dump())


def planner(mod: Any, layout: Any, job: Any, form: str) -> Any:
    """``plan()`` planning ``job`` on ``layout`` with ``mod``'s planner, from a dict of the job's numpy arrays
    (``form`` "dict") or from a BlockMapping built per call ("bm")."""
    s, d = (job.cpu_chunks, job.gpu_ids) if job.direction.value == "h2d" else (job.gpu_ids, job.cpu_chunks)
    grouped = job.k > 1 or job.skip
    target, direction = mod.Target(platform="cuda", runtime_version=mod.cuda_version(13, 0)), mod.Direction(job.direction.value)
    groups = {"group_sizes": (job.count,), "group_starts": (job.skip,)} if grouped else {}
    if form == "dict":
        mapping = {"direction": direction, "src_ids": s, "dst_ids": d} | groups
        return lambda: mod.plan_transfer(layout, mapping, target)
    return lambda: mod.plan_transfer(layout, mod.BlockMapping(direction=direction, src_ids=s, dst_ids=d, **groups), target)


def main() -> None:
    import kvxfer.planner as new

    rounds = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 9
    stated = "--stated" in sys.argv[3:]  # the new planner on layouts stating their block counts
    samples = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 0
    shapes = [("contiguous", bh.C32_BLOCKS, 1, "h2d")] + [
        (p, n, k, dr) for p in ("contiguous", "runs8", "fragmented") for n in (256, 2048) for k in (1, 4)
        for dr in ("h2d", "d2h")]
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old(Path(sys.argv[1]), Path(tmp))
        print(f"{'case':<34}{'dict old':>9}{'new':>8}{'new/old':>8}{'bm old':>9}{'new':>8}{'new/old':>8}"
              f"{'runs ms':>9}{'new/runs':>9}")
        for pattern, n, k, dr in shapes:
            job, g, c = bh.make_job(pattern, n, k, dr, seed=32 if n == bh.C32_BLOCKS else 0)
            layouts = {"old": worker_layout(old, bh.NUM_TENSORS, g, c, 256, k),
                       "new": worker_layout(new, bh.NUM_TENSORS, g, c, 256, k, stated)}
            fns = {f"{form} {side}": planner(mod, layouts[side], job, form) for form in ("dict", "bm")
                   for side, mod in (("old", old), ("new", new))}
            prints = {f().fingerprint for f in fns.values()}
            if len(prints) != 1:
                raise SystemExit(f"{pattern} {n} {k} {dr}: the plans differ")
            if k == 1 and pattern == "contiguous":
                _, tensors = bh.memory_for(bh.worker_layout(bh.NUM_TENSORS, g, c, 256, 1))
                fns["runs"] = lambda: bh.run_based_descriptors(tensors, job)
            t = timed(fns, rounds, samples)
            row = f"{f'118x{n} {pattern} k={k} {dr}':<34}"
            for form in ("dict", "bm"):
                row += f"{t[f'{form} old']:9.3f}{t[f'{form} new']:8.3f}{t[f'{form} new'] / t[f'{form} old']:8.2f}"
            if "runs" in t:
                row += f"{t['runs']:9.3f}{t['dict new'] / t['runs']:9.2f}"
            print(row, flush=True)


if __name__ == "__main__":
    main()
