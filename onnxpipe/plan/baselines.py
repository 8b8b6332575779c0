"""What others would plan, priced by the same `evaluate`: GPipe / DeepSpeed `uniform` (equal node or
layer counts), DeepSpeed `parameters` (equal parameter bytes), PipeDream's dynamic program (devices in
target order, replication allowed) and pure data parallelism."""

from __future__ import annotations

import dataclasses

import numpy as np

from onnxpipe.plan.coarsen import Blocks, coarsen
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.evaluate import evaluate
from onnxpipe.plan.layout import to_assignment
from onnxpipe.pricing.problem import Problem
from onnxpipe.plan.result import Plan
from onnxpipe.pricing.stage import Assignment

__all__ = ["baselines", "with_recompute", "balanced_cuts"]


def baselines(
    problem: Problem, stages: int, recompute: str = "auto", replicas: bool = True, blocks: Blocks | None = None, bounds: Bounds | None = None
) -> dict[str, Plan]:
    """Each baseline's plan by name; a baseline that cannot form `stages` stages is left out."""
    bounds = bounds or Bounds(problem)
    devices = tuple((d.name,) for d in problem.target.devices[:stages])
    found: dict[str, Plan] = {}
    layers = (problem.params > 0).astype(float)
    for name, weights in (
        ("uniform-nodes", np.ones(problem.n)),
        ("uniform-layers", layers if layers.sum() >= stages else np.ones(problem.n)),
        ("parameters", problem.params if (problem.params > 0).sum() >= stages else np.ones(problem.n)),
    ):
        cuts = balanced_cuts(weights, stages, problem.sealed)
        if cuts is not None:
            nodes = tuple(problem.nodes[a:b] for a, b in zip(cuts[:-1], cuts[1:]))
            found[name] = with_recompute(problem, nodes, devices, recompute, name, bounds)
    blocks = blocks or coarsen(problem, 100)
    if blocks.count >= stages:
        layout = solve_dp(problem, blocks, stages, recompute, replicas, in_order=True)
        if layout is not None:
            plan = evaluate(problem, to_assignment(problem, blocks, layout), replicas=replicas, bounds=bounds)
            found["pipedream"] = _named(plan, "pipedream")
    everything = (tuple(d.name for d in problem.target.devices),)
    found["data-parallel"] = with_recompute(problem, (problem.nodes,), everything, recompute, "data-parallel", bounds)
    return found


def balanced_cuts(weights: np.ndarray, stages: int, sealed: np.ndarray) -> list[int] | None:
    """Cut positions giving each of `stages` runs about equal weight, every run non-empty; a cut that would take a
    sealed gap (`Problem.sealed`) moves to the next open one."""
    n = len(weights)
    gaps = np.flatnonzero(~sealed)
    if len(gaps) <= stages:
        return None
    cumulative = np.cumsum(weights)
    total = cumulative[-1]
    cuts = [0]
    for s in range(1, stages):
        at = max(int(np.searchsorted(cumulative, total * s / stages, side="left")) + 1, cuts[-1] + 1)
        cuts.append(int(gaps[min(int(np.searchsorted(gaps, at)), len(gaps) - 1 - (stages - s))]))
    cuts.append(n)
    return cuts


def with_recompute(
    problem: Problem, nodes: tuple[tuple[str, ...], ...], devices: tuple[tuple[str, ...], ...], recompute: str, name: str, bounds: Bounds | None = None
) -> Plan:
    """Evaluate an assignment, recomputing (under "auto") exactly the stages that overflow memory."""
    flags = tuple(recompute == "always" for _ in nodes)
    plan = evaluate(problem, Assignment(nodes, devices, flags), bounds=bounds)
    if recompute == "auto":
        over = tuple(s.memory.total > s.memory.capacity for s in plan.stages)
        if any(over):
            plan = evaluate(problem, Assignment(nodes, devices, over), bounds=bounds)
    return _named(plan, name)


def _named(plan: Plan, name: str) -> Plan:
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, status=name))
