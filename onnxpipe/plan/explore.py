"""BaPipe-style exploration: schedules x micro-batch counts x stage counts (replication inside each),
each priced by the DP + `evaluate` and ranked by predicted iteration time for the global batch;
`by_stage_count` prices every stage count at one schedule and micro-batch count, baselines included,
so the planner can pick the stage count no baseline beats."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from onnxpipe.plan.baselines import baselines, with_recompute
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.evaluate import evaluate, fits, overflow
from onnxpipe.plan.layout import to_assignment
from onnxpipe.plan.problem import Problem
from onnxpipe.plan.result import Candidate, Plan

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
) -> tuple[tuple[Candidate, ...], Problem | None, int | None]:
    """Every configuration tried (best first) and the winner's problem and stage count."""
    report = progress or (lambda _: None)
    tried: list[tuple[Candidate, Problem, int]] = []
    for m in microbatches:
        for schedule in schedules:
            variant = problem.with_options(microbatches=m, schedule=schedule)
            for k in stage_counts:
                report(f"exploring {schedule}, {m} micro-batches, {k} stages")
                plan = _quick_plan(variant, k, recompute, replicas)
                if plan is None:
                    tried.append((Candidate(schedule, m, k, 1, float("inf"), 0.0, False, "infeasible: too few blocks for the stages"), variant, k))
                    continue
                tried.append((candidate(plan), variant, k))
    tried.sort(key=lambda item: (not item[0].feasible, item[0].iteration_seconds))
    winner = tried[0] if tried and tried[0][0].feasible else None
    return tuple(c for c, _, _ in tried), (winner[1] if winner else None), (winner[2] if winner else None)


def by_stage_count(problem: Problem, stage_counts: Sequence[int], recompute: str = "auto", replicas: bool = True) -> dict[int, list[Plan]]:
    """Fitting plans per stage count: the DP's and every baseline's (data parallelism counts as one stage)."""
    found: dict[int, list[Plan]] = {}
    for k in stage_counts:
        quick = _quick_plan(problem, k, recompute, replicas)
        others = baselines(problem, k, recompute, replicas)
        found[k] = [p for p in ([quick] if quick else []) + list(others.values()) if fits(p) and len(p.stages) == k]
    return found


def candidate(plan: Plan) -> Candidate:
    """How a priced plan shows among the configurations tried."""
    ok = fits(plan)
    return Candidate(
        plan.schedule, plan.microbatches, len(plan.stages), max(len(s.devices) for s in plan.stages), plan.iteration_seconds,
        max(s.memory.total for s in plan.stages), ok, "" if ok else f"infeasible: {overflow(plan)}",
    )


def _quick_plan(problem: Problem, stages: int, recompute: str, replicas: bool) -> Plan | None:
    """The DP's plan, or when nothing fits, an equal split that shows how far memory is off."""
    blocks = coarsen(problem, min(100, 20 * stages))
    if blocks.count < stages:
        return None
    layout = solve_dp(problem, blocks, stages, recompute, replicas)
    if layout is not None:
        return evaluate(problem, to_assignment(problem, blocks, layout), replicas=replicas)
    size = -(-problem.n // stages)
    nodes = tuple(problem.nodes[i : i + size] for i in range(0, problem.n, size))
    if len(nodes) != stages:
        return None
    return with_recompute(problem, nodes, tuple((d.name,) for d in problem.target.devices[:stages]), recompute, "equal")
