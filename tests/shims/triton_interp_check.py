"""Run in a subprocess with TRITON_INTERPRET=1: the Triton executor against the NumPy executor on random
small plans, each ordered after a transfer of another kind. Prints one JSON line: {"plans": n, "ranges": r,
"bytes": b, "widths": [...], "mismatches": [...], "synchronous": bool, "after": [...], "bad stream": str}."""
import json
import sys

import numpy as np
from shims.cases import expected, host_buffers

from kvxfer.executors import ExecutorError, RunArgumentError, Transfer
from kvxfer.executors._ops_triton import TritonExecutor, launch_tables
from kvxfer.planner import PlanOptions, Target, plan_transfer, presets


class Pending(Transfer):
    """Another executor's transfer: records, when waited for, whether the plan's bytes had moved yet."""

    def __init__(self, bufs, want, fails):
        super().__init__(nbytes=0, ranges=0, calls=1)
        self.bufs, self.want, self.fails, self.moved = bufs, want, fails, None

    def wait(self):
        self.moved = all(np.array_equal(self.bufs[k], self.want[k]) for k in self.want)
        if self.fails:
            raise ExecutorError("copy", 0, None, "failed elsewhere", 0)
        return self


rng = np.random.default_rng(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
ex = TritonExecutor(tile_bytes=64, num_programs=3)  # small tiles: ranges span several tiles and tails
report = {"plans": 0, "ranges": 0, "bytes": 0, "widths": set(), "mismatches": [], "synchronous": ex.synchronous,
          "after": []}
PAGES = (1, 3, 6, 100, 40, 48, 256, 1000)  # widths 1, 1, 2, 4, 8, 8+align16, ...
for trial in range(16):
    blocks = int(rng.integers(6, 24))
    page = PAGES[trial % len(PAGES)]
    layout = presets.kv_layout(int(rng.integers(1, 4)), blocks, page, shared_device=bool(trial % 2))
    n = int(rng.integers(1, blocks // 2 + 1))
    mapping = dict(direction=["h2d", "d2h"][trial % 2], src_ids=rng.permutation(blocks)[:n],
                   dst_ids=rng.permutation(blocks)[:n])
    plan = plan_transfer(layout, mapping, Target(platform="cuda", runtime_version=13000),
                         PlanOptions(coalesce=bool(trial % 3), regions_per_call=1 if trial % 4 == 3 else None,
                                     max_descriptors=int(rng.integers(0, 5))))
    bufs = host_buffers(layout, seed=trial)
    want = expected(plan, bufs)
    base = np.array([bufs[b.name].ctypes.data for b in plan.buffers], dtype=np.uint64)
    src, dst = base[plan.src_buf] + plan.src_offset, base[plan.dst_buf] + plan.dst_offset
    report["widths"] |= {f'{g["word"]}{"a16" if g["align16"] else ""}' for g in launch_tables(src, dst, plan.nbytes, 64)}
    pending = Pending(bufs, want, fails=bool(trial % 2))
    t = ex.run(plan, bufs, stream=trial, after=[pending])  # a stream is accepted: nothing to order on the CPU
    assert t.done()
    report["after"].append(pending.moved)  # False: the copies waited for the transfer (failed or not)
    for k in want:
        if not np.array_equal(bufs[k], want[k]):
            report["mismatches"].append({"trial": trial, "buffer": k, "bytes": int((bufs[k] != want[k]).sum())})
    report["plans"] += 1
    report["ranges"] += plan.num_ranges
    report["bytes"] += plan.total_bytes
report["widths"] = sorted(report["widths"])
try:
    ex.run(plan, bufs, stream=object())
    report["bad stream"] = "accepted"
except RunArgumentError as e:
    report["bad stream"] = str(e)
print(json.dumps(report))
