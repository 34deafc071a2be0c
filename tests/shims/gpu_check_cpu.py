"""Every section of benchmarks/gpu_check.py on the CPU, with the CUDA batch executor over the C driver shim and
Triton under its interpreter (TRITON_INTERPRET=1 must be set by the caller). argv: shim library, report path.
Prints one JSON line: what the shim saw."""
import json
import sys
from pathlib import Path

from build import ShimState  # tests/shims, this script's folder
from runtime import ShimCudaRuntime as CudaStandIn  # the shim as a Runtime for the executor's constructor

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import gpu_check

stand_in = CudaStandIn(sys.argv[1], 13000)
gpu_check.run_check("cpu", Path(sys.argv[2]), cuda_stand_in=stand_in)
counts = ShimState(stand_in.lib).counts
print(json.dumps({"batch_calls": len(counts), "descriptors": sum(counts)}))
