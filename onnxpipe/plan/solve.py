"""One configuration (stages, micro-batches, schedule fixed): coarsen, solve the interval DP, hand its
answer to CP-SAT as a hint, keep the best plan under `evaluate` (least bottleneck, or least iteration
time when the caller ranks by it), never worse than a baseline.

Reading order: `solve` -> `_choose` -> `_ensure_some_fit`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence

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
from onnxpipe.units import format_bytes

__all__ = ["solve", "default_blocks", "infeasible_message"]

#: Relative difference under which the solver's model and `evaluate` are taken to agree.
_AGREE = 1e-4


def default_blocks(stages: int) -> int:
    """Enough blocks for balanced stages, few enough for CP-SAT to prove optimality quickly."""
    return min(400, max(120, 40 * stages))


def solve(
    problem: Problem,
    stages: int,
    *,
    recompute: str = "auto",
    replicas: bool = True,
    time_limit: float = 30.0,
    max_blocks: int | None = None,
    progress: Callable[[str], None] | None = None,
    also: Sequence[Plan] = (),
    by_iteration: bool = False,
) -> Plan:
    """The best plan found for this configuration, with its proven bound and gap on the bottleneck.

    `also`: more plans of `stages` stages to choose from; `by_iteration` ranks by predicted iteration
    time first (the plan may then have more than the least bottleneck, and says so in its gap)."""
    report = progress or (lambda _: None)
    started = time.perf_counter()
    bound = lower_bound(problem, stages, replicas)
    _ensure_some_fit(problem, bound, stages)
    blocks = coarsen(problem, max_blocks or default_blocks(stages))
    report(f"dynamic program over {blocks.count} blocks")
    hint = solve_dp(problem, blocks, stages, recompute, replicas, table=intervals(blocks))
    found: list[Plan] = []
    if hint is not None:
        found.append(evaluate(problem, to_assignment(problem, blocks, hint), replicas=replicas))
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
        ceiling_seconds=found[0].bottleneck_seconds if found else math.inf,
        time_limit=remaining,
        progress=lambda value, best: report(f"CP-SAT: bottleneck {value * 1e3:.3f} ms, bound {best * 1e3:.3f} ms"),
    )
    # CP-SAT's bound holds for `evaluate` only where its model priced its plan as evaluate does.
    agrees = False
    tolerance = 1e-9 * (blocks.count + len(blocks.nbytes) + 4)  # CP-SAT rounds each term up to whole nanoseconds
    if result.layout is not None:
        mine = evaluate(problem, to_assignment(problem, blocks, result.layout), replicas=replicas)
        found.append(mine)
        agrees = abs(result.objective_seconds - mine.bottleneck_seconds) <= tolerance + _AGREE * mine.bottleneck_seconds
    report("comparing against baselines")
    # The baselines exactly as `compare` reports them, so the plan is never worse than any of them.
    found.extend(p for name, p in baselines(problem, stages, recompute, replicas).items() if name != "data-parallel")
    found.extend(also)
    best = _choose(found, by_iteration)
    if best is None:
        raise OnnxpipeError(infeasible_message(problem, bound, stages))
    objective = best.bottleneck_seconds
    proven = max(min(result.bound_seconds, objective), bound.seconds) if agrees else bound.seconds
    status = "OPTIMAL" if result.status == "OPTIMAL" and agrees and objective <= proven * (1 + _AGREE) + tolerance else "FEASIBLE"
    info = SolveInfo(
        status=status,
        bound_seconds=proven,
        gap=max(0.0, (objective - proven) / objective) if objective > 0 else 0.0,
        solve_seconds=time.perf_counter() - started,
        coarsening_loss=blocks.rounding_seconds / objective if objective > 0 else 0.0,
        blocks=blocks.count,
    )
    return dataclasses.replace(best, solver=info)


def _choose(found: list[Plan], by_iteration: bool = False) -> Plan | None:
    """The fitting plan with the least bottleneck (or iteration time, then bottleneck), then the least communication."""
    fitting = [p for p in found if fits(p)]
    if not fitting:
        return None

    def key(p: Plan) -> tuple[float, ...]:
        rest = (round(p.bottleneck_seconds, 12), sum(s.comm_in_seconds + s.comm_out_seconds for s in p.stages))
        return (round(p.iteration_seconds, 12), *rest) if by_iteration else rest

    return min(fitting, key=key)


def infeasible_message(problem: Problem, bound: LowerBound, stages: int) -> str:
    need = bound.memory_bytes
    cap = bound.capacity_bytes
    fixes = "try --recompute always, more stages, a smaller micro-batch (--microbatches), or a target with more memory"
    if need > cap:
        return f"no plan fits: the smallest stage needs {format_bytes(need)} of memory but the largest device holds {format_bytes(cap)}; {fixes}"
    return (
        f"no plan with {stages} stages fits in memory (largest device {format_bytes(cap)}; every plan needs at least "
        f"{format_bytes(need)} on some device, more once activations are stashed); {fixes}"
    )


def _ensure_some_fit(problem: Problem, bound: LowerBound, stages: int) -> None:
    if problem.n < stages:
        raise OnnxpipeError(f"the model has {problem.n} compute nodes, fewer than {stages} stages; use at most {problem.n} stages")
    if not bound.fits:
        raise OnnxpipeError(infeasible_message(problem, bound, stages))
