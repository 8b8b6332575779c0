"""Iteration time from per-stage times: the one place a schedule's fill, drain and optimizer step are
priced, so a simulator can replace the analytic estimate in one spot."""

from __future__ import annotations

from collections.abc import Sequence

from onnxpipe.plan.result import StagePlan

__all__ = ["optimizer_seconds", "iteration_seconds"]


def optimizer_seconds(param_bytes: float, states: float, memory_bandwidth: float) -> float:
    """An optimizer step streams parameters, gradients and states in and parameters and states out."""
    return (3.0 + 2.0 * states) * param_bytes / memory_bandwidth


def iteration_seconds(stages: Sequence[StagePlan], microbatches: int, schedule: str, optimizer_step: Sequence[float]) -> float:
    """(m + k - 1) bottleneck slots (GPipe and 1F1B have the same fill and drain), then the slowest
    gradient all-reduce and optimizer step."""
    del schedule  # both schedules share the analytic estimate; the simulator tells them apart
    k = len(stages)
    bottleneck = max(s.seconds_per_microbatch(microbatches) for s in stages)
    allreduce = max((s.allreduce_seconds for s in stages), default=0.0)
    return (microbatches + k - 1) * bottleneck + allreduce + max(optimizer_step, default=0.0)
