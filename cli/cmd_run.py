"""kvxfer run CASE: plan a case file, run it on an executor, optionally verify every byte.

Memory: GPU executors get torch tensors (device buffers on the GPU, host buffers pinned); the numpy
executor (and auto on a machine without a GPU runtime) runs on host memory mapped lazily, so only the pages
the plan touches take memory (``run_memory``). ``run_case`` is the command without its flags: tests call it
with an executor built on a host-memory runtime.
"""
from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import typer

PROGRESS_BYTES = 256 << 20  # runs that touch this much say what they are doing at each stage (on stderr)
MAX_SEED = 2**64 - 1  # the seed is one word of the random generator's key


def _print(message: str, err: bool = False) -> None:
    print(message, file=sys.stderr if err else sys.stdout)


def _seed(value: int) -> int:
    """``--seed``: one word of the random generator's key."""
    if not 0 <= value <= MAX_SEED:
        raise typer.BadParameter(f"{value} is not in 0 .. 2**64-1 (the seed is one 64-bit word)")
    return value


def register(app: typer.Typer) -> None:
    """Add the ``run`` command to ``app``."""

    @app.command("run")
    def _cmd(case_path: Path = typer.Argument(..., metavar="FILE", help="case file, plan file (.json/.npz) or golden file"),
             executor: str | None = typer.Option(
                 None, "--executor", "-e", metavar="NAME", help="auto, cuda-batch, hip-batch, triton, numpy, nixl, posix"),
             config: Path | None = typer.Option(None, "--config", metavar="FILE",
                                                help="executor config file (TOML or JSON)"),
             verify: bool = typer.Option(False, "--verify", help="compare every byte with the test oracle"),
             explain_executor: bool = typer.Option(False, "--explain-executor", help="print the executor chosen and why"),
             replan: bool | None = typer.Option(
                 None, "--replan/--no-replan", help="plan for the runtime found instead of the case's target"),
             max_descriptors: int | None = typer.Option(None, "--max-descriptors", metavar="N",
                                                        help="per-call cap (0 = unlimited)"),
             seed: int = typer.Option(0, "--seed", metavar="N", callback=_seed,
                                      help="seed of the buffers' random contents (0 .. 2**64-1)")) -> None:
        """Plan FILE, run it, report bytes, calls and time; with --verify exit 1 on any differing byte."""
        from kvxfer.executors import ExecutorConfig, ExecutorKind, get_executor

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
    the kind), run it on fresh memory (seeded random bytes in every page the plan touches) and report; with
    ``verify``, compare every byte of every buffer with the test oracle (``kvxfer.testing.expected_copies``;
    a plan file, which holds no mapping, against its own ranges). ``on_gpu``: allocate device buffers on the
    GPU (default: when ``ex`` is a GPU executor, ``Backend.gpu``). Returns False when bytes differ. Raises
    ValueError for a seed outside 0 .. 2**64-1, MemoryError naming the buffer and its size when memory cannot
    be had."""
    from kvxfer.executors import AutoExecutor, backend_for

    from . import run_memory as rm

    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ValueError(f"seed = {seed!r}: must be an integer in 0 .. 2**64-1")
    say = echo or _print
    plan, oracle, against = _plan_and_oracle(case_path, ex, cfg)
    if on_gpu is None:
        runs = backend_for(ex)
        on_gpu = runs is not None and runs.gpu
    names = [b.name for b in plan.buffers]
    ranges = _pieces(rm, plan, names)
    oracle = ranges if oracle is None else oracle
    touched = rm.touched_pages([b.nbytes for b in plan.buffers], ranges, oracle)
    touched_bytes = sum(int((t[:, 1] - t[:, 0]).sum()) for t in touched)
    stage = _stages(say, touched_bytes >= PROGRESS_BYTES)
    stage(f"memory: {len(names)} buffers, {rm.size_text(sum(b.nbytes for b in plan.buffers))} mapped, "
          f"{rm.size_text(touched_bytes)} touched")
    mem = rm.allocate(list(plan.buffers), on_gpu)
    rm.fill(mem, touched, seed, say)
    if explain_executor:
        say(ex.explain(plan, mem.arrays) if isinstance(ex, AutoExecutor) else f"executor: {cfg.kind.value} (configured)")
    say(repr(plan))
    stage(f"running {plan.num_ranges} ranges ({rm.size_text(plan.total_bytes)}) ...")
    _report(say, ex.run(plan, mem.arrays).wait())
    if not verify:
        return True
    if not rm.independent(oracle, names):
        raise ValueError(f"--verify: {against} write a byte twice or read a byte they write, so their order "
                         "matters and the check cannot tell the result; run without --verify")
    stage(f"verifying every byte against {against} ...")
    return _verified(say, rm.check(mem, oracle, touched, seed, say), sum(b.nbytes for b in plan.buffers), against)


def _plan_and_oracle(case_path: Path, ex: Any, cfg: Any) -> tuple[Any, Any, str]:
    """(the plan to run, the per-copy oracle's pieces or None for the plan's own ranges, what they are) of the file
    at ``case_path``: a case is planned for ``ex`` (its target when ``cfg.replan``, the descriptor cap of
    ``cfg``) and checked against the test oracle; a plan file runs as stored, against its own ranges."""
    from kvxfer.planner import Case, PlanOptions
    from kvxfer.testing import expected_copies

    from . import run_memory as rm
    from ._inputs import read_input

    case, stored = read_input(case_path)
    if case is None:
        if stored is None:  # read_input gives a case, a plan or both, or raises
            raise ValueError(f"{case_path}: holds neither a case nor a plan")
        return stored, None, "the plan's own ranges (a plan file holds no mapping)"
    target = ex.target if cfg.replan else case.target
    options = case.options if cfg.max_descriptors is None else PlanOptions.model_validate(
        case.options.model_dump() | {"max_descriptors": cfg.max_descriptors})
    plan = Case(layout=case.layout, mapping=case.mapping, target=target, options=options).plan()
    c = expected_copies(case.layout, case.mapping, plan.options)
    names = [b.name for b in plan.buffers]
    return plan, rm.Pieces.of(c.buffers, names, c.src_buf, c.src_offset, c.dst_buf, c.dst_offset, c.nbytes), \
        "the test oracle"


def _pieces(rm: Any, plan: Any, names: list[str]) -> Any:
    """The plan's own ranges as run_memory pieces."""
    return rm.Pieces.of(tuple(names), names, plan.src_buf, plan.src_offset, plan.dst_buf, plan.dst_offset, plan.nbytes)


def _stages(say: Callable[..., None], loud: bool) -> Callable[[str], None]:
    """What reports a stage of a long run on stderr (``loud``), and says nothing for a short one."""
    def stage(message: str) -> None:
        if loud:
            say(message, err=True)
    return stage


def _report(say: Callable[..., None], t: Any) -> None:
    """The line saying what a finished transfer moved, in how many ranges and calls, and how fast."""
    secs = t.elapsed_s or 0.0
    rate = f", {t.nbytes / secs / 1e9:.2f} GB/s" if secs > 0 else ""
    say(f"ran {t.nbytes} bytes in {t.ranges} range{'s' * (t.ranges != 1)}, {t.calls} call{'s' * (t.calls != 1)}: "
        f"{secs * 1e3:.3f} ms{rate}")


def _verified(say: Callable[..., None], bad: list[Any], total: int, against: str) -> bool:
    """Report the verification (the buffers that differ, at most ten, on stderr); True when none does."""
    if not bad:
        say(f"verify: OK, all {total} bytes match {against}")
        return True
    say(f"verify: FAILED against {against}: bytes differ in {len(bad)} buffer(s)", err=True)
    for m in bad[:10]:
        say(m.line(), err=True)
    if len(bad) > 10:
        say(f"  ... and {len(bad) - 10} more buffers", err=True)
    return False
