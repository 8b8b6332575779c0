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
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.layout import EXACT_REPLICAS, to_assignment
from onnxpipe.pricing.problem import Problem
from onnxpipe.plan.result import Candidate, Plan
from onnxpipe.units import plural

__all__ = ["explore", "microbatch_choices", "by_stage_count", "candidate", "stage_counts"]


def microbatch_choices(batch: int, limit: int = 64) -> tuple[int, ...]:
    """Divisors of the batch up to `limit`."""
    return tuple(m for m in range(1, min(batch, limit) + 1) if batch % m == 0)


def stage_counts(most: int) -> tuple[int, ...]:
    """The stage counts worth pricing from 1 to `most`: every one up to EXACT_REPLICAS, then about 1.5x apart
    and `most` itself (on 1,000 devices 41 counts, not 1,000; neighbours differ by a few percent of a stage)."""
    counts = set(range(1, min(most, EXACT_REPLICAS) + 1))
    c = EXACT_REPLICAS
    while c < most:
        c = min(most, c * 3 // 2)
        counts.add(c)
    return tuple(sorted(counts))


def _stop(deadline: Deadline | None, found: bool) -> bool:
    """Past the deadline with something found: the rest is left untried."""
    return found and deadline is not None and deadline.passed()


def explore(
    problem: Problem,
    stage_counts: Sequence[int],
    schedules: Sequence[str],
    microbatches: Sequence[int],
    *,
    recompute: str = "auto",
    replicas: bool = True,
    progress: Callable[[str], None] | None = None,
    deadline: Deadline | None = None,
) -> tuple[tuple[Candidate, ...], Problem | None, int | None, tuple[Plan, ...]]:
    """Every configuration tried (best first), and the winner's problem, stage count and priced plans.
    Once `deadline` passes with a configuration that fits, the rest are left untried."""
    report = progress or (lambda _: None)
    tried: list[tuple[Candidate, Problem, int, list[Plan]]] = []
    for m in microbatches:
        for schedule in schedules:
            if _stop(deadline, any(c.feasible for c, _, _, _ in tried)):
                break
            variant = problem.with_options(microbatches=m, schedule=schedule)
            bounds = Bounds(variant, deadline)
            for k in stage_counts:
                best = min((c.iteration_seconds for c, _, _, _ in tried if c.feasible), default=None)
                if _stop(deadline, best is not None):
                    break
                report(f"exploring {schedule}, {plural(m, 'micro-batch')}, {plural(k, 'stage')}"
                       + (f" (best so far: iteration {best * 1e3:.2f} ms)" if best is not None else ""))
                quick, fitting = _priced(variant, k, recompute, replicas, bounds, deadline)
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
    problem: Problem, stage_counts: Sequence[int], recompute: str = "auto", replicas: bool = True, bounds: Bounds | None = None,
    deadline: Deadline | None = None, progress: Callable[[str], None] | None = None,
) -> dict[int, list[Plan]]:
    """Plans that fit in memory per stage count: the DP's and every baseline's (data parallelism counts as
    one stage); `within` tells which also keep the latency bound. Once `deadline` passes with a plan that
    fits, the remaining counts are left out."""
    bounds = bounds or Bounds(problem, deadline)
    found: dict[int, list[Plan]] = {}
    for k in stage_counts:
        priced = [p for plans in found.values() for p in plans]
        if _stop(deadline, bool(priced)):
            break
        if progress:
            best = min(priced, key=lambda p: p.iteration_seconds, default=None)
            progress(f"pricing {plural(k, 'stage')}" + (f" (best so far: {plural(len(best.stages), 'stage')}, iteration "
                                                         f"{best.iteration_seconds * 1e3:.2f} ms)" if best else ""))
        found[k] = _priced(problem, k, recompute, replicas, bounds, deadline)[1]
    return found


def _priced(problem: Problem, stages: int, recompute: str, replicas: bool, bounds: Bounds,
            deadline: Deadline | None = None) -> tuple[Plan | None, list[Plan]]:
    """The DP's plan (see `_quick_plan`), and the fitting plans of `stages` stages among it and every baseline."""
    quick = _quick_plan(problem, stages, recompute, replicas, bounds, deadline)
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


def _quick_plan(problem: Problem, stages: int, recompute: str, replicas: bool, bounds: Bounds, deadline: Deadline | None = None) -> Plan | None:
    """The DP's plan, or when nothing fits, an equal split that shows how far memory is off."""
    blocks = coarsen(problem, min(100, 20 * stages))
    if blocks.count < stages:
        return None
    layout = solve_dp(problem, blocks, stages, recompute, replicas, deadline=deadline)
    if layout is not None:
        return evaluate(problem, to_assignment(problem, blocks, layout), replicas=replicas, bounds=bounds)
    size = -(-problem.n // stages)
    nodes = tuple(problem.nodes[i : i + size] for i in range(0, problem.n, size))
    if len(nodes) != stages:
        return None
    return with_recompute(problem, nodes, tuple((d.name,) for d in problem.target.devices[:stages]), recompute, "equal", bounds)
