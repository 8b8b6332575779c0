"""Iteration time of a plan: the one place a schedule's fill, drain, transfers, all-reduce and optimizer
step are priced. The event simulator does it, so the planner ranks candidates as `onnxpipe simulate` would."""

from __future__ import annotations

from onnxpipe.plan.result import Plan
from onnxpipe.target import Target

__all__ = ["iteration_seconds"]


def iteration_seconds(plan: Plan, target: Target) -> float:
    """Seconds of one iteration of the plan's schedule on the target, as simulated."""
    from onnxpipe.simulate import simulate  # simulate reads plan.result: importing it while plan loads would be circular

    return simulate(plan, target).iteration_seconds
