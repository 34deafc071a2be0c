"""Planner time, old code against new, measured in the same run (no timed asserts anywhere).

    python benchmarks/compare_planner.py OLD_ROOT NEW_ROOT [ROUNDS]

Each root is a checkout of this project (e.g. ``git worktree add /tmp/planner-old <commit>``). Each round runs
the planner cases of ``cli/bench.py`` (``plan_cases`` and ``layout_cases``) once per root, in a fresh
subprocess that imports that root's ``kvxfer``; rounds alternate old and new so load on the machine hits both
alike. Prints per case the median over rounds of each root's best-of-5 time, and the ratio new / old.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys
from kvxfer.cli.bench import best_time, layout_cases, plan_cases
from kvxfer.planner import Target, plan_transfer
target = Target(platform="rocm", runtime_version=71600000)
out = {}
for name, layout, mapping in plan_cases(True):
    _ = layout.info
    out[name] = best_time(lambda: plan_transfer(layout, mapping, target), 5) * 1e3
for name, layout, mapping in layout_cases():
    _ = layout.info
    out["layout " + name] = best_time(lambda: plan_transfer(layout, mapping), 5) * 1e3
print(json.dumps(out))
"""


def package_root(root: Path, into: Path) -> Path:
    """A folder holding ``kvxfer/`` whose subpackages are ``root``'s folders (the package-dir mapping)."""
    pkg = into / "kvxfer"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name in ("planner", "cli", "executors"):
        (pkg / name).symlink_to(root.resolve() / name)
    return into


def main() -> None:
    old, new = Path(sys.argv[1]), Path(sys.argv[2])
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 3
    results: dict[str, list[dict[str, float]]] = {"old": [], "new": []}
    with tempfile.TemporaryDirectory() as tmp:
        paths = {k: package_root(root, Path(tmp) / k) for k, root in (("old", old), ("new", new))}
        for _ in range(rounds):
            for k in ("old", "new"):
                env = os.environ | {"PYTHONPATH": str(paths[k])}
                res = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True,
                                     cwd=tmp)
                results[k].append(json.loads(res.stdout))
    import numpy as np
    print(f"{'case':<40}{'old ms':>10}{'new ms':>10}{'new/old':>9}")
    ratios = []
    for case in results["old"][0]:
        o = float(np.median([r[case] for r in results["old"]]))
        n = float(np.median([r[case] for r in results["new"]]))
        ratios.append(n / o)
        print(f"{case:<40}{o:>10.3f}{n:>10.3f}{n / o:>9.3f}")
    print(f"geometric mean new/old: {float(np.exp(np.mean(np.log(ratios)))):.3f} over {len(ratios)} cases, "
          f"{rounds} alternating rounds")


if __name__ == "__main__":
    main()
