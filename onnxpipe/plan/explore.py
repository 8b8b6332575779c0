"""BaPipe-style exploration: schedules x micro-batch counts x stage counts (replication inside each),
each priced by the DP, every baseline and `evaluate`, and ranked by predicted iteration time for the
global batch, so no baseline in any configuration explored is predicted faster than the winner;
`by_stage_count` does the same for every stage count at one schedule and micro-batch count."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from onnxpipe.plan.baselines import baselines, with_recompute
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.evaluate import evaluate, fits, overflow, within
from onnxpipe.plan.layout import to_assignment
from onnxpipe.pricing.problem import Problem
from onnxpipe.plan.result import Candidate, Plan
from onnxpipe.units import plural

__all__ = ["explore", "microbatch_choices", "by_stage_count", "candidate"]


def microbatch_choices(batch: int, limit: int = 64) -> tuple[int, ...]:
    """Divisors of the batch up to `limit`."""
    return tuple(m for m in range(1, min(batch, limit) + 1) if batch % m == 0)


def explore(
    problem: Problem,
    stage_counts: Sequence[int],
    schedules: Sequence[str],
    microbatches: Sequence[int],
    *,
    recompute: str = "auto",
    replicas: bool = True,
    progress: Callable[[str], None] | None = None,
) -> tuple[tuple[Candidate, ...], Problem | None, int | None, tuple[Plan, ...]]:
    """Every configuration tried (best first), and the winner's problem, stage count and priced plans."""
    report = progress or (lambda _: None)
    tried: list[tuple[Candidate, Problem, int, list[Plan]]] = []
    for m in microbatches:
        for schedule in schedules:
            variant = problem.with_options(microbatches=m, schedule=schedule)
            bounds = Bounds(variant)
            for k in stage_counts:
                report(f"exploring {schedule}, {plural(m, 'micro-batch')}, {plural(k, 'stage')}")
                quick, fitting = _priced(variant, k, recompute, replicas, bounds)
                taken = [p for p in fitting if within(variant, p)]
                if taken:
                    tried.append((candidate(min(taken, key=lambda p: p.iteration_seconds), variant.max_latency), variant, k, taken))
                elif fitting or quick is not None:
                    closest = min(fitting, key=lambda p: p.latency_seconds) if fitting else quick
                    tried.append((candidate(closest, variant.max_latency), variant, k, []))
                else:
                    tried.append((Candidate(schedule, m, k, 1, float("inf"), 0.0, False, "infeasible: too few blocks for the stages"), variant, k, []))
    tried.sort(key=lambda item: (not item[0].feasible, item[0].iteration_seconds))
    if not tried or not tried[0][0].feasible:
        return tuple(c for c, _, _, _ in tried), None, None, ()
    _, variant, k, plans = tried[0]
    return tuple(c for c, _, _, _ in tried), variant, k, tuple(plans)


def by_stage_count(
    problem: Problem, stage_counts: Sequence[int], recompute: str = "auto", replicas: bool = True, bounds: Bounds | None = None
) -> dict[int, list[Plan]]:
    """Plans that fit in memory per stage count: the DP's and every baseline's (data parallelism counts as
    one stage); `within` tells which also keep the latency bound."""
    bounds = bounds or Bounds(problem)
    return {k: _priced(problem, k, recompute, replicas, bounds)[1] for k in stage_counts}


def _priced(problem: Problem, stages: int, recompute: str, replicas: bool, bounds: Bounds) -> tuple[Plan | None, list[Plan]]:
    """The DP's plan (see `_quick_plan`), and the fitting plans of `stages` stages among it and every baseline."""
    quick = _quick_plan(problem, stages, recompute, replicas, bounds)
    others = baselines(problem, stages, recompute, replicas, bounds=bounds)
    return quick, [p for p in ([quick] if quick else []) + list(others.values()) if fits(p) and len(p.stages) == stages]


def candidate(plan: Plan, max_latency: float = math.inf) -> Candidate:
    """How a priced plan shows among the configurations tried (over `max_latency`: not feasible)."""
    slow = plan.latency_seconds > max_latency * (1 + 1e-9)
    note = f"infeasible: {overflow(plan)}" if not fits(plan) else f"latency {plan.latency_seconds * 1e3:.4g} ms > --max-latency" if slow else ""
    return Candidate(
        plan.schedule, plan.microbatches, len(plan.stages), max(len(s.devices) for s in plan.stages), plan.iteration_seconds,
        max(s.memory.total for s in plan.stages), not note, note, plan.latency_seconds,
    )


def _quick_plan(problem: Problem, stages: int, recompute: str, replicas: bool, bounds: Bounds) -> Plan | None:
    """The DP's plan, or when nothing fits, an equal split that shows how far memory is off."""
    blocks = coarsen(problem, min(100, 20 * stages))
    if blocks.count < stages:
        return None
    layout = solve_dp(problem, blocks, stages, recompute, replicas)
    if layout is not None:
        return evaluate(problem, to_assignment(problem, blocks, layout), replicas=replicas, bounds=bounds)
    size = -(-problem.n // stages)
    nodes = tuple(problem.nodes[i : i + size] for i in range(0, problem.n, size))
    if len(nodes) != stages:
        return None
    return with_recompute(problem, nodes, tuple((d.name,) for d in problem.target.devices[:stages]), recompute, "equal", bounds)
