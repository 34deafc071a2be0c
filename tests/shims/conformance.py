"""The executor conformance checks, written once and run against every executor that runs here.

Each adapter builds one executor kind over one small layout and exposes the memory a plan touches (local
arrays, and for NIXL the remote side's arrays too) so a check can see every byte. Checks:
- ``malformed``: hand-built plans that are malformed or leave the bound memory are refused before any byte
  moves (every byte of every buffer unchanged);
- ``threads``: 8 threads share one executor, each running its own plan (disjoint destinations, ranges of
  different sizes) several times; the result equals the reference, or the executor refuses;
- ``fault``: a fault injected at the first descriptor of call k is reported as call k, with k calls issued and
  exactly those calls' bytes copied. Faults come in through what each executor is built from: the C shims
  (DMA), a NIXL agent that refuses a post (NIXL), and subclasses whose copy or launch step fails (NumPy,
  Triton), all defined here, in the tests.

``python tests/shims/conformance.py triton`` (with TRITON_INTERPRET=1) runs the checks for the Triton
interpreter in a fresh process and prints one JSON line: {check: "pass" | "skip: ..." | "fail: ..."}.
"""
from __future__ import annotations

import ctypes
import json
import sys
import threading
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from kvxfer.executors import ExecutorError, NumpyExecutor
from kvxfer.planner import COLUMNS, PlanOptions, Target, TransferPlan, hip_version, plan_transfer, presets

REGIONS, BLOCKS, PAGE = 2, 64, 64
LAYOUT = presets.kv_layout(REGIONS, BLOCKS, PAGE)  # "cpu" (host, both regions), "gpu.kv0", "gpu.kv1"
THREADS, REPS = 8, 4


class Skip(Exception):
    """This check does not apply to this executor (the reason says why)."""


class Adapter:
    """One executor kind over LAYOUT. ``arrays`` holds every byte the plans can touch, by buffer name."""

    name = "base"
    target = Target()
    faults = False

    def __init__(self) -> None:
        self.arrays = {b.name: np.zeros(b.nbytes, np.uint8) for b in LAYOUT.buffers}
        self.executor: Any = None

    def bindings(self) -> dict[str, Any]:
        return dict(self.arrays)

    def fill(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        for a in self.arrays.values():
            a[:] = rng.integers(0, 256, a.nbytes, dtype=np.uint8)
        return {k: v.copy() for k, v in self.arrays.items()}

    def inject_fault(self, descriptor: int) -> None:
        raise Skip("no fault injection for this executor")

    def clear_fault(self) -> None:
        pass

    def close(self) -> None:
        if self.executor is not None:
            self.executor.close()


class FaultyNumpyExecutor(NumpyExecutor):
    """Test double: moving any range at or past descriptor ``fault`` fails, as numpy running out of memory for a
    group's temporary would."""

    fault = -1

    def move(self, path: Any, sides: Any, src: int, dst: int, low: Any, index: np.ndarray) -> None:
        if 0 <= self.fault <= int(index.max()):
            raise MemoryError(f"injected at descriptor {self.fault}")
        super().move(path, sides, src, dst, low, index)


class NumpyAdapter(Adapter):
    name = "numpy"
    faults = True

    def __init__(self) -> None:
        super().__init__()
        self.executor = FaultyNumpyExecutor(copier=False)  # call by call: faults land in ``move`` (the copier: test_host_copy)

    def inject_fault(self, descriptor: int) -> None:
        self.executor.fault = descriptor

    def clear_fault(self) -> None:
        self.executor.fault = -1


class ShimAdapter(Adapter):
    """A DMA executor over a C shim; ``state`` is the shim's ShimState."""

    faults = True

    def __init__(self, executor: Any, state: Any, target: Target):
        super().__init__()
        self.executor, self.state, self.target = executor, state, target

    def inject_fault(self, descriptor: int) -> None:
        self.state.reset()
        self.state.set(fail_at=descriptor, fail_code=700 if self.target.platform.value == "cuda" else 1)

    def clear_fault(self) -> None:
        self.state.set(fail_at=-1)


class TritonAdapter(Adapter):
    name = "triton-interpreter"
    faults = True

    def __init__(self) -> None:
        super().__init__()
        from kvxfer.executors import TritonExecutor

        class FaultyTritonExecutor(TritonExecutor):
            """Test double: launching a group whose first range is at or past descriptor ``fault`` fails, as a
            launch the driver refuses would."""

            fault = -1

            def start_kernel(self, g: dict[str, Any], t: dict[str, Any]) -> None:
                if 0 <= self.fault <= g["first"]:
                    raise RuntimeError(f"injected launch failure at descriptor {self.fault}")
                super().start_kernel(g, t)

        self.executor = FaultyTritonExecutor(tile_bytes=64, num_programs=2)

    def inject_fault(self, descriptor: int) -> None:
        self.executor.fault = descriptor

    def clear_fault(self) -> None:
        self.executor.fault = -1


class FaultyAgent:
    """Test double around a real nixl_agent: posting the call whose descriptors include ``fault`` (counted from
    ``arm``) is refused, as NIXL refuses a transfer; everything else goes to the real agent."""

    def __init__(self, agent: Any):
        self._agent, self.fault, self.posted = agent, -1, 0
        self._sizes: dict[int, int] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def arm(self, descriptor: int) -> None:
        self.fault, self.posted = descriptor, 0

    def get_xfer_descs(self, rows: Any, mem: str) -> Any:
        descs = self._agent.get_xfer_descs(rows, mem)
        self._sizes[id(descs)] = len(rows)
        return descs

    def initialize_xfer(self, op: str, local: Any, remote: Any, peer: str, notif: bytes) -> Any:
        n = self._sizes.pop(id(local), 0)
        self._sizes.pop(id(remote), None)
        first, self.posted = self.posted, self.posted + n
        if first <= self.fault < first + n:
            raise RuntimeError(f"NIXL_ERR_BACKEND (injected at descriptor {self.fault})")
        return self._agent.initialize_xfer(op, local, remote, peer, notif)


class NixlAdapter(Adapter):
    """Two agents in this process over UCX loopback: ``engine`` runs the plans with the device buffers local,
    ``tier`` holds the host buffer, which the engine reaches as a RemoteBuffer."""

    name = "nixl-loopback"
    faults = True

    def __init__(self) -> None:
        super().__init__()
        from nixl_cu13._api import nixl_agent, nixl_agent_config

        from kvxfer.executors import NixlExecutor
        opts = {"poll_timeout_s": 20.0, "drain_timeout_s": 1.0}
        self.agent = FaultyAgent(nixl_agent("conf-engine", nixl_agent_config(backends=["UCX"])))
        self.executor, self.tier = NixlExecutor(agent=self.agent, **opts), NixlExecutor(name="conf-tier", **opts)
        device = {k: v for k, v in self.arrays.items() if k != "cpu"}
        reg = self.executor.register(device)
        self.remote = self.executor.add_peer(self.tier.describe(self.tier.register({"cpu": self.arrays["cpu"]})))
        self.tier.add_peer(self.executor.describe(reg))

    def bindings(self) -> dict[str, Any]:
        return {**{k: v for k, v in self.arrays.items() if k != "cpu"}, **self.remote}

    def inject_fault(self, descriptor: int) -> None:
        self.agent.arm(descriptor)

    def clear_fault(self) -> None:
        self.agent.arm(-1)

    def close(self) -> None:
        self.executor.close()
        self.tier.close()


def _plan(adapter: Adapter, pattern: str = "runs8", n: int = 16, direction: str = "h2d", seed: int = 0,
          max_descriptors: int | None = 3, dst_ids: np.ndarray | None = None) -> TransferPlan:
    src, dst = presets.block_pattern(pattern, n, BLOCKS, seed)
    if dst_ids is not None:
        dst = dst_ids
    return plan_transfer(LAYOUT, {"direction": direction, "src_ids": src, "dst_ids": dst}, adapter.target,
                         PlanOptions(max_descriptors=max_descriptors))


def hand_made(plan: TransferPlan, **edits: Callable[[np.ndarray], None]) -> TransferPlan:
    """``plan`` with columns edited in place by ``edits[column](array)``, built without any check."""
    cols = {c: np.array(getattr(plan, c)) for c in COLUMNS}
    for c, edit in edits.items():
        edit(cols[c])
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=plan.call_offsets, columns=cols)


def _set_last(value: int) -> Callable[[np.ndarray], None]:
    def edit(a: np.ndarray) -> None:
        a[-1] = value
    return edit


def malformed_plans(adapter: Adapter) -> dict[str, TransferPlan]:
    plan = _plan(adapter)
    dst_size = LAYOUT.buffers[int(plan.dst_buf[-1])].nbytes
    return {
        "range past its buffer": hand_made(plan, dst_offset=_set_last(dst_size - 8)),
        "uint64 wrap": hand_made(plan, src_offset=_set_last(2**64 - 32)),
        "zero-byte range": hand_made(plan, nbytes=_set_last(0)),
        "attr index out of range in the last call": hand_made(plan, attr=_set_last(99)),
        "buffer index out of the table": hand_made(plan, dst_buf=_set_last(len(LAYOUT.buffers))),
    }


def check_malformed(adapter: Adapter) -> None:
    for what, bad in malformed_plans(adapter).items():
        before = adapter.fill(seed=len(what))
        try:
            adapter.executor.run(bad, adapter.bindings()).wait()
        except ValueError:
            pass
        else:
            raise AssertionError(f"{adapter.name}: a plan with a {what} ran")
        changed = [k for k in before if not np.array_equal(adapter.arrays[k], before[k])]
        if changed:
            raise AssertionError(f"{adapter.name}: refusing a plan with a {what} left bytes changed in {changed}")


def check_threads(adapter: Adapter) -> None:
    """8 threads, one executor, REPS runs each; thread i writes destination blocks [8i, 8i+8)."""
    plans = []
    for i in range(THREADS):
        pattern = ("fragmented", "contiguous", "runs8", "descending")[i % 4]
        src, _ = presets.block_pattern(pattern, 8, BLOCKS, seed=i)
        dst = np.arange(8 * i, 8 * i + 8)[:len(src)]
        plans.append(plan_transfer(LAYOUT, {"direction": "h2d", "src_ids": src, "dst_ids": dst}, adapter.target,
                                   PlanOptions(max_descriptors=2 + i % 3)))
    before = adapter.fill(seed=99)
    want = {k: v.copy() for k, v in before.items()}
    for p in plans:
        NumpyExecutor().run(p, want)
    errors: list[BaseException] = []
    refused: list[BaseException] = []
    barrier = threading.Barrier(THREADS)
    bindings = adapter.bindings()

    def work(i: int) -> None:
        try:
            barrier.wait()
            for _ in range(REPS):
                adapter.executor.run(plans[i], bindings).wait()
        except RuntimeError as e:  # a clear refusal of concurrent use is conforming
            refused.append(e)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    if errors:
        raise AssertionError(f"{adapter.name}: {len(errors)} threads failed: {errors[0]!r}")
    if refused:
        if not all("concurrent" in str(e) for e in refused):
            raise AssertionError(f"{adapter.name}: refusal does not say why: {refused[0]}")
        return
    bad = {k: int((adapter.arrays[k] != want[k]).sum()) for k in want if not np.array_equal(adapter.arrays[k], want[k])}
    if bad:
        raise AssertionError(f"{adapter.name}: wrong bytes after concurrent runs: {bad}")


def truncated(plan: TransferPlan, calls: int) -> TransferPlan:
    """The first ``calls`` calls of ``plan`` (what must have landed when call ``calls`` fails at its start)."""
    end = int(plan.call_offsets[calls])
    cols = {c: np.array(getattr(plan, c))[:end] for c in COLUMNS}
    return TransferPlan(direction=plan.direction, target=plan.target, options=plan.options, buffers=plan.buffers,
                        regions=plan.regions, attrs=plan.attrs, requested_copies=plan.requested_copies,
                        call_offsets=plan.call_offsets[:calls + 1], columns=cols)


def check_fault(adapter: Adapter) -> None:
    plan = _plan(adapter, pattern="fragmented", n=16, max_descriptors=3)
    k = 2
    if plan.num_calls <= k:
        raise AssertionError(f"the fault plan has {plan.num_calls} calls; it needs more than {k}")
    before = adapter.fill(seed=7)
    want = {k_: v.copy() for k_, v in before.items()}
    NumpyExecutor().run(truncated(plan, k), want)
    adapter.inject_fault(int(plan.call_offsets[k]))
    try:
        adapter.executor.run(plan, adapter.bindings()).wait()
    except ExecutorError as e:
        if (e.chunk, e.issued_chunks) != (k, k) or f"chunk {k}" not in str(e):
            raise AssertionError(f"{adapter.name}: fault in call {k} reported as {e!r}") from None
    else:
        raise AssertionError(f"{adapter.name}: a fault injected in call {k} was not reported")
    finally:
        adapter.clear_fault()
    bad = {n: int((adapter.arrays[n] != want[n]).sum()) for n in want if not np.array_equal(adapter.arrays[n], want[n])}
    if bad:
        raise AssertionError(f"{adapter.name}: after a fault in call {k}, bytes differ from calls 0..{k - 1}: {bad}")


CHECKS = {"malformed": check_malformed, "threads": check_threads, "fault": check_fault}


def shim_adapters(cuda_lib: str, hip_lib: str) -> dict[str, Callable[[], Adapter]]:
    """Factories for the DMA executors on the C shims (CUDA 13.0 and 12.8 ABIs, per-range 12.4, HIP 7.16)."""
    from kvxfer.executors import CudaBatchExecutor, HipBatchExecutor

    from .build import ShimState
    from .runtime import ShimCudaRuntime, ShimHipRuntime

    def cuda(version: int, name: str) -> Callable[[], Adapter]:
        def make() -> Adapter:
            state = ShimState(ctypes.CDLL(cuda_lib))
            state.reset()
            state.set(null_batch=0)
            a = ShimAdapter(CudaBatchExecutor(ShimCudaRuntime(cuda_lib, version)), state,
                            Target(platform="cuda", runtime_version=version))
            a.name = name
            return a
        return make

    def hip() -> Adapter:
        state = ShimState(ctypes.CDLL(hip_lib))
        state.reset()
        state.set(version=hip_version(7, 16))
        a = ShimAdapter(HipBatchExecutor(ShimHipRuntime(hip_lib)), state, Target(platform="rocm",
                                                                                runtime_version=hip_version(7, 16)))
        a.name = "hip-7.16-shim"
        return a

    return {"cuda-13.0-shim": cuda(13000, "cuda-13.0-shim"), "cuda-12.8-shim": cuda(12080, "cuda-12.8-shim"),
            "cuda-per-range-shim": cuda(12040, "cuda-per-range-shim"), "hip-7.16-shim": hip}


def run_all(adapter: Adapter) -> dict[str, str]:
    out = {}
    for name, check in CHECKS.items():
        try:
            check(adapter)
            out[name] = "pass"
        except Skip as e:
            out[name] = f"skip: {e}"
        except BaseException as e:
            out[name] = f"fail: {e!r} {traceback.format_exc()[-1500:]}"
    return out


if __name__ == "__main__":
    if sys.argv[1:] != ["triton"]:
        raise SystemExit("usage: conformance.py triton   (with TRITON_INTERPRET=1)")
    a = TritonAdapter()
    print(json.dumps(run_all(a)))
