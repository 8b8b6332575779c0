"""One configuration (stages, micro-batches, schedule fixed): coarsen, solve the interval DP, hand its
answer to CP-SAT as a hint, keep the best plan under `evaluate`, never worse than a baseline.

Reading order: `solve` -> `_choose` -> `_ensure_some_fit`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.baselines import baselines
from onnxpipe.plan.bounds import LowerBound, lower_bound
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.cpsat import solve_cpsat
from onnxpipe.plan.dp import intervals, solve_dp
from onnxpipe.plan.evaluate import evaluate, fits
from onnxpipe.plan.layout import to_assignment
from onnxpipe.plan.problem import Problem
from onnxpipe.plan.result import Plan, SolveInfo

__all__ = ["solve", "default_blocks", "infeasible_message"]

#: Relative difference under which the solver's model and `evaluate` are taken to agree.
_AGREE = 1e-4


def default_blocks(stages: int) -> int:
    """Enough blocks for balanced stages, few enough for CP-SAT to prove optimality quickly."""
    return min(400, 40 * stages)


def solve(
    problem: Problem,
    stages: int,
    *,
    recompute: str = "auto",
    replicas: bool = True,
    time_limit: float = 30.0,
    max_blocks: int | None = None,
    progress: Callable[[str], None] | None = None,
) -> Plan:
    """The best plan found for this configuration, with its proven bound and gap."""
    report = progress or (lambda _: None)
    started = time.perf_counter()
    bound = lower_bound(problem, stages, replicas)
    _ensure_some_fit(problem, bound, stages)
    blocks = coarsen(problem, max_blocks or default_blocks(stages))
    report(f"dynamic program over {blocks.count} blocks")
    hint = solve_dp(problem, blocks, stages, recompute, replicas, table=intervals(blocks))
    found: list[tuple[Plan, float | None]] = []
    if hint is not None:
        found.append((evaluate(problem, to_assignment(problem, blocks, hint), replicas=replicas), None))
    remaining = time_limit - (time.perf_counter() - started)
    report(f"CP-SAT over {blocks.count} blocks, up to {remaining:.0f} s")
    result = solve_cpsat(
        problem,
        blocks,
        stages,
        recompute=recompute,
        replicas=replicas,
        hint=hint,
        floor_seconds=bound.seconds,
        time_limit=remaining,
        progress=lambda value, best: report(f"CP-SAT: bottleneck {value * 1e3:.3f} ms, bound {best * 1e3:.3f} ms"),
    )
    if result.layout is not None:
        found.append((evaluate(problem, to_assignment(problem, blocks, result.layout), replicas=replicas), result.objective_seconds))
    report("comparing against baselines")
    others = [p for name, p in baselines(problem, stages, recompute, replicas, blocks).items() if name != "data-parallel"]
    found.extend((p, None) for p in others)
    best, modelled = _choose(found)
    if best is None:
        raise OnnxpipeError(infeasible_message(problem, bound, stages))
    objective = best.bottleneck_seconds
    solver_bound = result.bound_seconds if result.layout is not None or result.status == "UNKNOWN" else bound.seconds
    agrees = modelled is not None and abs(modelled - objective) <= _AGREE * objective
    # CP-SAT's bound holds for `evaluate` only where its model priced the plan as evaluate does.
    proven = max(min(solver_bound, objective), bound.seconds) if agrees else bound.seconds
    status = "OPTIMAL" if result.status == "OPTIMAL" and agrees else "FEASIBLE"
    info = SolveInfo(
        status=status,
        bound_seconds=proven,
        gap=max(0.0, (objective - proven) / objective) if objective > 0 else 0.0,
        solve_seconds=time.perf_counter() - started,
        coarsening_loss=blocks.rounding_seconds / objective if objective > 0 else 0.0,
        blocks=blocks.count,
    )
    return dataclasses.replace(best, solver=info)


def _choose(found: list[tuple[Plan, float | None]]) -> tuple[Plan | None, float | None]:
    """The fitting plan with the least bottleneck, then the least communication."""
    fitting = [(p, m) for p, m in found if fits(p)]
    if not fitting:
        return None, None

    def key(item: tuple[Plan, float | None]) -> tuple[float, float, int]:
        plan, modelled = item
        comm = sum(s.comm_in_seconds + s.comm_out_seconds for s in plan.stages)
        return (round(plan.bottleneck_seconds, 12), comm, 0 if modelled is not None else 1)

    return min(fitting, key=key)


def infeasible_message(problem: Problem, bound: LowerBound, stages: int) -> str:
    gib = 2**30
    need = bound.memory_bytes
    cap = bound.capacity_bytes
    fixes = "try --recompute always, more stages, a smaller micro-batch (--microbatches), or a target with more memory"
    if need > cap:
        return f"no plan fits: the smallest stage needs {need / gib:.1f} GiB of memory but the largest device holds {cap / gib:.1f} GiB; {fixes}"
    return (
        f"no plan with {stages} stages fits in memory (largest device {cap / gib:.1f} GiB; every plan needs at least "
        f"{need / gib:.1f} GiB on some device, more once activations are stashed); {fixes}"
    )


def _ensure_some_fit(problem: Problem, bound: LowerBound, stages: int) -> None:
    if not bound.fits:
        raise OnnxpipeError(infeasible_message(problem, bound, stages))
