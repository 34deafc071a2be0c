"""Every section of benchmarks/gpu_check.py on the CPU, with the CUDA batch executor over the C driver shim and
Triton under its interpreter (TRITON_INTERPRET=1 must be set by the caller). argv: shim library, report path.

Each driver version the check asks for (its newest ABI, the 12.8 ABI, the per-copy path below 12.8) gets its
own copy of the shim library, so each keeps its own version and records. Prints one JSON line: what each
copy saw (batch calls, those with a failIdx argument, descriptors, per-range copies)."""
import json
import shutil
import sys
from pathlib import Path

from build import ShimState  # tests/shims, this script's folder
from runtime import ShimCudaRuntime as CudaStandIn  # the shim as a Runtime for the executor's constructor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check

NEWEST = 13000
made = {}


def stand_in(version):
    """A shim runtime reporting ``version`` (None: the newest), one library copy per version."""
    v = version or NEWEST
    path = Path(sys.argv[1])
    if v != NEWEST:
        path = path.with_name(f"{path.stem}_v{v}{path.suffix}")
        shutil.copy(sys.argv[1], path)
    made[v] = CudaStandIn(path, v)
    return made[v]


gpu_check.run_check("cpu", Path(sys.argv[2]), cuda_stand_in=stand_in)
saw = {}
for v, rt in made.items():
    state = ShimState(rt.lib)
    saw[str(v)] = {"batch_calls": len(state.counts), "fail_idx_calls": sum(state.has_fail_idx),
                   "descriptors": sum(state.counts), "copies": sum(op == "copy" for op, _, _ in state.log)}
print(json.dumps(saw))
