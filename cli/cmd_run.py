"""kvxfer run CASE: plan a case file, run it on an executor, optionally verify every byte.

Memory: GPU executors get torch tensors (device buffers on the GPU, host buffers pinned); the numpy
executor (and auto on a machine without a GPU runtime) runs on host memory. ``run_case`` is the command
without its flags: tests call it with an executor built on a host-memory runtime.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


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


def _print(message: str, err: bool = False) -> None:
    print(message, file=sys.stderr if err else sys.stdout)


def register(app) -> None:
    """Add the ``run`` command to ``app``."""
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
             seed: int = typer.Option(0, "--seed", help="seed of the random buffer contents")) -> None:
        """Plan CASE, run it, report bytes, calls and time; with --verify exit 1 on any differing byte."""
        from kvxfer.executors.config import ExecutorConfig, ExecutorKind, get_executor

        from ._inputs import read_input

        overrides: dict[str, Any] = dict(kind=executor, max_descriptors=max_descriptors, replan=replan)
        cfg = ExecutorConfig.load(config, **overrides)
        if cfg.kind is ExecutorKind.NIXL:
            raise typer.BadParameter("a NIXL plan needs a remote peer; run it from Python (NixlExecutor with "
                                     "kvxfer.executors.nixl_peer), or try python -m kvxfer.executors.nixl_peer",
                                     param_hint="--executor")
        case, _ = read_input(case_path)
        if case is None and (replan or max_descriptors is not None):
            raise typer.BadParameter(f"{case_path} is a plan file, which runs as stored; pass its case or golden "
                                     "file to plan again", param_hint="--replan/--max-descriptors")
        ex = get_executor(cfg)
        try:
            ok = run_case(case_path, ex, cfg, verify=verify, explain_executor=explain_executor, seed=seed, echo=typer.echo)
        finally:
            ex.close()
        if not ok:
            raise typer.Exit(1)


def run_case(case_path: Path, ex: Any, cfg: Any, *, verify: bool = False, explain_executor: bool = False, seed: int = 0,
             echo: Callable[..., None] | None = None, on_gpu: bool | None = None) -> bool:
    """Plan the case at ``case_path`` for ``ex`` (``cfg``: its ExecutorConfig, for replan, the descriptor cap and
    the kind), run it on fresh random memory and report; with ``verify``, compare every byte with the NumPy
    reference. ``on_gpu``: allocate device buffers on the GPU (default: unless the executor is numpy or auto
    without a GPU runtime). Returns False when bytes differ."""
    from kvxfer.executors import NumpyExecutor
    from kvxfer.executors.config import AutoExecutor, ExecutorKind
    from kvxfer.planner import Case, PlanOptions, Platform

    echo = echo or _print

    from ._inputs import read_input

    case, stored = read_input(case_path)
    if case is None:  # a plan file runs as stored
        plan = stored
    else:
        target = ex.target if cfg.replan else case.target
        options = case.options if cfg.max_descriptors is None else PlanOptions.model_validate(
            case.options.model_dump() | {"max_descriptors": cfg.max_descriptors})
        plan = Case(layout=case.layout, mapping=case.mapping, target=target, options=options).plan()
    if on_gpu is None:  # host memory for numpy, and for auto on a machine without a GPU runtime
        on_gpu = not (cfg.kind is ExecutorKind.NUMPY or (isinstance(ex, AutoExecutor) and ex.platform is Platform.CPU))
    mem = _allocate(plan, on_gpu, seed)
    if explain_executor:
        echo(ex.explain(plan, mem) if isinstance(ex, AutoExecutor) else f"executor: {cfg.kind.value} (configured)")
    want = None
    if verify:
        want = {k: v.copy() for k, v in _to_host(mem).items()}
        NumpyExecutor().run(plan, want)
    echo(repr(plan))
    t = ex.run(plan, mem).wait()
    secs = t.elapsed_s or 0.0
    rate = f", {t.nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else ""
    echo(f"ran {t.nbytes} bytes in {t.ranges} range{'s' * (t.ranges != 1)}, {t.calls} call{'s' * (t.calls != 1)}: "
         f"{secs * 1e3:.3f} ms{rate}")
    if want is not None:
        got = _to_host(mem)
        bad = {k: int((got[k] != want[k]).sum()) for k in want if not np.array_equal(got[k], want[k])}
        if bad:
            echo(f"verify: FAILED, differing bytes per buffer: {bad}", err=True)
            return False
        echo(f"verify: OK, all {sum(v.nbytes for v in want.values())} bytes match the reference")
    return True
