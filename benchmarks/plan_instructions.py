"""Instructions per plan, old planner against new, on the shapes of ``bench_hostpath.py`` (dict hot path).

    python benchmarks/plan_instructions.py OLD_ROOT [REPS [PATTERN:N:K:DIRECTION ...]]

Each count runs a child process under valgrind's callgrind: the child builds the layout, plans a few times,
then has callgrind zero its counters (``callgrind_control -z``), plans REPS times (default 100) with the
garbage collector off, and has callgrind dump (``-d``); the dump is the loop alone. Unlike times on a shared
machine, the counts repeat run to run (``PYTHONHASHSEED=0``). Needs valgrind; takes about 25 minutes for the
24 shapes. Nothing is asserted; figures go to benchmarks/NOTES.md.
"""
from __future__ import annotations

import gc
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SHAPES = [(p, n, k, dr) for p in ("contiguous", "runs8", "fragmented") for n in (256, 2048) for k in (1, 4)
          for dr in ("h2d", "d2h")]


def child(side: str, old_root: str, pattern: str, n: int, k: int, direction: str, reps: int) -> None:
    sys.path.insert(0, str(HERE))
    import bench_hostpath as bh
    from compare_hotpath import planner, worker_layout
    from compare_planner import load_old

    with tempfile.TemporaryDirectory() as tmp:
        mod: Any = load_old(Path(old_root), Path(tmp)) if side == "old" else __import__("kvxfer.planner").planner
        job, g, c = bh.make_job(pattern, n, k, direction, seed=0)
        plan = planner(mod, worker_layout(mod, bh.NUM_TENSORS, g, c, 256, k), job, "dict")
        for _ in range(5):
            plan()
        gc.collect()
        gc.disable()
        subprocess.run(["callgrind_control", "-z", str(os.getpid())], capture_output=True, check=False)
        for _ in range(reps):
            plan()
        subprocess.run(["callgrind_control", "-d", str(os.getpid())], capture_output=True, check=False)


def count(side: str, old_root: str, shape: tuple[str, int, int, str], reps: int) -> int:
    with tempfile.TemporaryDirectory() as out:
        subprocess.run(["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}/cg.%p", sys.executable, __file__,
                        "--child", side, old_root, *map(str, shape), str(reps)],
                       capture_output=True, check=True, env=os.environ | {"PYTHONHASHSEED": "0"})
        dump = next(Path(out).glob("cg.*.1")).read_text()
        total = next(int(line.split()[1]) for line in dump.splitlines() if line.startswith(("summary:", "totals:")))
        return total // reps


def main() -> None:
    if sys.argv[1] == "--child":
        side, old_root, pattern, n, k, direction, reps = sys.argv[2:9]
        child(side, old_root, pattern, int(n), int(k), direction, int(reps))
        return
    old_root, reps = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 100
    print(f"{'case':<34}{'old':>10}{'new':>10}{'new/old':>9}   (instructions per plan, dict form)")
    shapes = [tuple(int(x) if x.isdigit() else x for x in s.split(":")) for s in sys.argv[3:]] or SHAPES
    for shape in shapes:
        old, new = count("old", old_root, shape, reps), count("new", old_root, shape, reps)
        pattern, n, k, direction = shape
        print(f"{f'118x{n} {pattern} k={k} {direction}':<34}{old:>10}{new:>10}{new / old:>9.3f}", flush=True)


if __name__ == "__main__":
    main()
