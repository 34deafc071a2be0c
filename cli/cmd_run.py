"""kvxfer run CASE: plan a case file, run it on an executor, optionally verify every byte.

Memory: GPU executors get torch tensors (device buffers on the GPU, host buffers pinned). The numpy
executor, and the batch executors loaded with ``--shim`` (a host-memory driver stand-in built from
tests/shims/fake_cuda.c or fake_hip.c), run on host memory, so a CPU-only machine can run every path.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

HELP_SHIM = ("host-memory driver stand-in for cuda-batch / hip-batch: a shared library compiled from "
             "tests/shims/fake_cuda.c or fake_hip.c (cc -shared -fPIC -Itests/shims FILE -o LIB)")


def _allocate(plan: Any, on_gpu: bool, seed: int) -> dict[str, Any]:
    """Random bytes in every buffer of the plan (host numpy arrays, or torch tensors when ``on_gpu``)."""
    rng = np.random.default_rng(seed)
    host = {b.name: rng.integers(0, 256, b.nbytes, dtype=np.uint8) for b in plan.buffers}
    if not on_gpu:
        return host
    import torch
    return {b.name: (torch.from_numpy(host[b.name]).to(f"cuda:{b.device}") if b.location.value == "device"
                     else torch.from_numpy(host[b.name]).pin_memory()) for b in plan.buffers}


def _to_host(mem: dict[str, Any]) -> dict[str, np.ndarray]:
    return {k: (v if isinstance(v, np.ndarray) else v.cpu().numpy()) for k, v in mem.items()}


def register(app) -> None:
    import typer

    @app.command("run")
    def _cmd(case_path: Path = typer.Argument(..., help="case file, plan file (.json/.npz) or golden file"),
             executor: str | None = typer.Option(
                 None, "--executor", "-e", help="auto, cuda-batch, hip-batch, triton, numpy, nixl"),
             config: Path | None = typer.Option(None, "--config", help="executor config file (TOML or JSON)"),
             verify: bool = typer.Option(False, "--verify", help="compare every byte with the NumPy reference"),
             explain_executor: bool = typer.Option(False, "--explain-executor", help="print the executor chosen and why"),
             replan: bool | None = typer.Option(
                 None, "--replan/--no-replan", help="plan for the runtime found instead of the case's target"),
             max_descriptors: int | None = typer.Option(None, "--max-descriptors", help="per-call cap (0 = unlimited)"),
             shim: Path | None = typer.Option(None, "--shim", help=HELP_SHIM),
             shim_version: int | None = typer.Option(
                 None, "--shim-version", help="runtime version the shim reports (12080, 71600000, ...)"),
             seed: int = typer.Option(0, "--seed", help="seed of the random buffer contents")) -> None:
        """Plan CASE, run it, report bytes, calls and time; with --verify exit 1 on any differing byte."""
        from kvxfer.executors import NumpyExecutor
        from kvxfer.executors.config import AutoExecutor, ExecutorConfig, ExecutorKind, get_executor
        from kvxfer.planner import Case, PlanOptions, Platform

        from ._inputs import read_input

        overrides: dict[str, Any] = dict(kind=executor, max_descriptors=max_descriptors, replan=replan)
        if shim is not None:
            if shim_version is not None:
                os.environ["KVXFER_SHIM_VERSION"] = str(shim_version)  # read by the shim's version query
            kind = ExecutorKind(executor or "auto")
            if kind is ExecutorKind.HIP_BATCH:
                overrides.update(hip__library=str(shim), hip__host_as_device=True)
            elif kind is ExecutorKind.CUDA_BATCH:
                overrides.update(cuda__driver_lib=str(shim))
            else:
                raise typer.BadParameter("--shim needs --executor cuda-batch or hip-batch", param_hint="--shim")
        cfg = ExecutorConfig.load(config, **overrides)
        if cfg.kind is ExecutorKind.NIXL:
            raise typer.BadParameter("a NIXL plan needs a remote peer; run it from Python (NixlExecutor with "
                                     "kvxfer.executors.nixl_peer), or try python -m kvxfer.executors.nixl_peer",
                                     param_hint="--executor")
        case, stored = read_input(case_path)
        if case is None and (replan or max_descriptors is not None):
            raise typer.BadParameter(f"{case_path} is a plan file, which runs as stored; pass its case or golden "
                                     "file to plan again", param_hint="--replan/--max-descriptors")
        ex = get_executor(cfg)
        if case is None:
            plan = stored
        else:
            target = ex.target if cfg.replan else case.target
            options = case.options if cfg.max_descriptors is None else PlanOptions.model_validate(
                case.options.model_dump() | {"max_descriptors": cfg.max_descriptors})
            plan = Case(layout=case.layout, mapping=case.mapping, target=target, options=options).plan()
        # host memory for numpy, for shims, and for auto on a machine without a GPU runtime
        cpu_only = isinstance(ex, AutoExecutor) and ex.platform is Platform.CPU
        mem = _allocate(plan, not (cfg.kind is ExecutorKind.NUMPY or shim is not None or cpu_only), seed)
        if explain_executor:
            typer.echo(ex.explain(plan, mem) if isinstance(ex, AutoExecutor) else f"executor: {cfg.kind.value} (configured)")
        want = None
        if verify:
            want = {k: v.copy() for k, v in _to_host(mem).items()}
            NumpyExecutor().run(plan, want)
        typer.echo(repr(plan))
        t = ex.run(plan, mem).wait()
        secs = t.elapsed_s or 0.0
        rate = f", {t.nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else ""
        typer.echo(f"ran {t.nbytes} bytes in {t.ranges} range{'s' * (t.ranges != 1)}, {t.calls} call{'s' * (t.calls != 1)}: "
                   f"{secs * 1e3:.3f} ms{rate}")
        ex.close()
        if want is not None:
            got = _to_host(mem)
            bad = {k: int((got[k] != want[k]).sum()) for k in want if not np.array_equal(got[k], want[k])}
            if bad:
                typer.echo(f"verify: FAILED, differing bytes per buffer: {bad}", err=True)
                raise typer.Exit(1)
            typer.echo(f"verify: OK, all {sum(v.nbytes for v in want.values())} bytes match the reference")
