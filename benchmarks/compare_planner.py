"""Planner time, old code against new, measured in the same run and the same process (no timed asserts).

    python benchmarks/compare_planner.py OLD_ROOT [ROUNDS] [--samples N]

OLD_ROOT is a checkout of the baseline (e.g. ``git worktree add /tmp/planner-old <commit>``); the new code is
this checkout. The baseline planner is imported under another package name (``kvxfer_old.planner``: the planner
imports itself only relatively), so both run in one process on the same inputs. For each case of
``cli/bench.py`` (``plan_cases`` and ``layout_cases``) the rounds alternate old and new, each timed over a loop
of at least 50 ms of this process's CPU time (``time.process_time``: waiting for a core on a shared machine is
not counted); the reported time is the minimum over rounds, the figure least disturbed by other load.
``--samples N``: N rounds of short samples instead, reporting their 10th percentile (see ``timed``).
Prints each case's times and the ratio new / old.
"""
from __future__ import annotations

import importlib
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from kvxfer.cli.bench import layout_cases, plan_cases
from kvxfer.planner import BlockMapping, Target


def load_old(root: Path, into: Path) -> Any:
    pkg = into / "kvxfer_old"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "planner").symlink_to(root.resolve() / "planner")
    sys.path.insert(0, str(into))
    return importlib.import_module("kvxfer_old.planner")


def loop_time(fn: Callable[[], Any], min_s: float = 0.05) -> float:
    """CPU seconds per call (process time: time spent waiting for a core on a shared machine is left out)."""
    loops, t0 = 0, time.process_time()
    while True:
        fn()
        loops += 1
        t = time.process_time() - t0
        if t >= min_s:
            return t / loops


def timed(fns: dict[str, Any], rounds: int, samples: int) -> dict[str, float]:
    """Milliseconds per call of each function: the minimum over ``rounds`` loops of at least 50 ms, or with
    ``samples`` the 10th percentile of that many short samples; the order turns every round, so no variant
    always runs right after another."""
    keys = list(fns)
    if not samples:
        t = {key: np.inf for key in fns}
        for r in range(rounds):
            for key in keys[r % len(keys):] + keys[:r % len(keys)]:
                t[key] = min(t[key], loop_time(fns[key]) * 1e3)
        return t
    reps = {key: max(3, int(0.002 / max(loop_time(f, 0.01), 1e-7))) for key, f in fns.items()}
    got: dict[str, list[float]] = {key: [] for key in fns}
    for r in range(samples):
        for key in keys[r % len(keys):] + keys[:r % len(keys)]:
            f, n = fns[key], reps[key]
            t0 = time.perf_counter()
            for _ in range(n):
                f()
            got[key].append((time.perf_counter() - t0) / n * 1e3)
    return {key: float(np.percentile(v, 10)) for key, v in got.items()}


def main() -> None:
    import kvxfer.planner as new

    rounds = int(sys.argv[2]) if len(sys.argv) > 2 and sys.argv[2].isdigit() else 7
    samples = int(sys.argv[sys.argv.index("--samples") + 1]) if "--samples" in sys.argv else 0
    with tempfile.TemporaryDirectory() as tmp:
        old = load_old(Path(sys.argv[1]), Path(tmp))
        target = Target(platform="rocm", runtime_version=71600000)
        cases = [(n, lay, m, target) for n, lay, m in plan_cases(True)] + [(f"layout {n}", lay, m, None)
                                                                           for n, lay, m in layout_cases()]
        print(f"{'case':<40}{'old ms':>10}{'new ms':>10}{'new/old':>9}")
        ratios = []
        for name, layout, mapping, tgt in cases:
            # each side gets its own values, validated by its own code (the layout-derived arrays built once)
            lay_old = old.Layout.model_validate(layout.model_dump(exclude_defaults=True))
            lay_new = new.Layout.model_validate(layout.model_dump())
            map_old = old.BlockMapping.model_validate(mapping.model_dump())
            map_new = BlockMapping.model_validate(mapping.model_dump())
            t_old = None if tgt is None else old.Target.model_validate(tgt.model_dump())
            plans = {"old": lambda: old.plan_transfer(lay_old, map_old, t_old),
                     "new": lambda: new.plan_transfer(lay_new, map_new, tgt)}
            assert plans["old"]().fingerprint == plans["new"]().fingerprint, name  # same plans, else no comparison
            t = timed(plans, rounds, samples)
            o, n = t["old"], t["new"]
            ratios.append(n / o)
            print(f"{name:<40}{o:>10.3f}{n:>10.3f}{n / o:>9.3f}", flush=True)
        how = f"{samples} samples, 10th percentile" if samples else f"{rounds} alternating rounds, minimum"
        print(f"geometric mean new/old: {float(np.exp(np.mean(np.log(ratios)))):.3f} over {len(ratios)} cases, "
              f"{how} per case")


if __name__ == "__main__":
    main()
