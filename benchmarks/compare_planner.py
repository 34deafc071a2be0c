"""Planner time, old code against new, measured in the same run and the same process (no timed asserts).

    python benchmarks/compare_planner.py OLD_ROOT [ROUNDS]

OLD_ROOT is a checkout of the baseline (e.g. ``git worktree add /tmp/planner-old <commit>``); the new code is
this checkout. The baseline planner is imported under another package name (``kvxfer_old.planner``: the planner
imports itself only relatively), so both run in one process on the same inputs. For each case of
``cli/bench.py`` (``plan_cases`` and ``layout_cases``) the rounds alternate old and new, each timed over a loop
of at least 50 ms of this process's CPU time (``time.process_time``: waiting for a core on a shared machine is
not counted); the reported time is the minimum over rounds, the figure least disturbed by other load.
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


def main() -> None:
    import kvxfer.planner as new

    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 7
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
            times: dict[str, list[float]] = {"old": [], "new": []}
            for _ in range(rounds):
                for k in ("old", "new"):
                    times[k].append(loop_time(plans[k]))
            o, n = min(times["old"]) * 1e3, min(times["new"]) * 1e3
            ratios.append(n / o)
            print(f"{name:<40}{o:>10.3f}{n:>10.3f}{n / o:>9.3f}", flush=True)
        print(f"geometric mean new/old: {float(np.exp(np.mean(np.log(ratios)))):.3f} over {len(ratios)} cases, "
              f"{rounds} alternating rounds, minimum per case")


if __name__ == "__main__":
    main()
