"""A plan's predicted iteration: its stages priced again from the plan alone (a plan JSON carries no graph),
then simulated. What `onnxpipe simulate`, the report and the training report run on a plan.

Reading order: `simulate_plan` -> `stage_costs` -> `_stash` -> `_rescaled`; `read_plan`, `plan_target`.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.result import Plan, StagePlan
from onnxpipe.pricing.problem import flights, schedule_table
from onnxpipe.pricing.stage import StageCost, held, stage_cost
from onnxpipe.simulate import Simulation, simulate
from onnxpipe.target import Target, load_target

__all__ = ["simulate_plan", "stage_costs", "read_plan", "plan_target"]


def simulate_plan(plan: Plan, target: Target, *, schedule: str | None = None, microbatches: int | None = None, batch: int | None = None,
                  background: float = 0.0) -> Simulation:
    """Simulate one training iteration of `plan` on `target`.

    `schedule`, `microbatches` and `batch` (the global batch) override the plan's; per-micro-batch
    times, transfers and stashes scale linearly with the micro-batch size (batch / micro-batches), and
    the number of micro-batches in flight is re-derived from the new table. `background`: runnable
    processes of other work competing for a target's shared `cores` (a measured run queue), 0 on a
    quiet machine.
    """
    name = schedule or plan.schedule
    m = microbatches or plan.microbatches
    total = batch or plan.batch
    if m > total:
        raise OnnxpipeError(f"{m} micro-batches exceed the batch of {total}; pass --microbatches at most {total}")
    _ensure_devices(plan, target)
    costs = stage_costs(plan, target)
    scale = (total * plan.microbatches) / (m * plan.batch)  # exact integers, one rounding: the plan's own batch gives M0 / m exactly
    if scale != 1.0:
        costs = tuple(_rescaled(c, scale) for c in costs)
    return simulate(schedule_table(plan.mode, name, len(plan.stages), m), costs, target, schedule=name, batch=total, background=background)


def stage_costs(plan: Plan, target: Target) -> tuple[StageCost, ...]:
    """Each stage's cost at the plan's micro-batch size, from the figures the plan records."""
    held_flights = flights(plan.mode, plan.schedule, len(plan.stages), plan.microbatches)
    out = []
    for stage in plan.stages:
        stash, during = _stash(stage, held(max(held_flights[stage.index], 1), len(stage.devices)))
        out.append(stage_cost(
            target,
            index=stage.index,
            devices=stage.devices,
            recompute=stage.recompute,
            forward=stage.forward_seconds,
            backward=stage.backward_seconds,
            weight=stage.weight_seconds,
            in_bytes=stage.comm_in_bytes,
            out_bytes=stage.comm_out_bytes,
            in_seconds=stage.comm_in_seconds,
            out_seconds=stage.comm_out_seconds,
            memory=stage.memory,
            stash=stash,
            during_backward=during,
            tied=stage.tied,
            tied_bytes=stage.tied_bytes,
            tied_devices=tuple(d for s in sorted({stage.index, *stage.tied}) for d in plan.stages[s].devices),
            corun_slowdown=stage.corun_slowdown,
        ))
    return tuple(out)


def _stash(stage: StagePlan, live: int) -> tuple[float, float]:
    """(bytes stashed per micro-batch, extra bytes held during a backward) on the replica that runs it, where
    one replica holds `live` micro-batches. The plan's `stash_bytes` when given; a plan written without it
    gives its peak activations only: held x stash without recompute, held x inputs + one micro-batch's
    activations with recompute (inputs = the bytes it receives)."""
    if not stage.recompute:
        return stage.stash_bytes or stage.memory.activations / live, 0.0
    inputs = min(stage.stash_bytes or stage.comm_in_bytes, stage.memory.activations / live)
    return inputs, stage.memory.activations - live * inputs


def _rescaled(cost: StageCost, scale: float) -> StageCost:
    """The same stage at `scale` times the micro-batch size: work, messages and stashes grow linearly."""
    return dataclasses.replace(
        cost, forward=cost.forward * scale, backward=cost.backward * scale, weight=cost.weight * scale, out_bytes=cost.out_bytes * scale,
        stash=cost.stash * scale, during_backward=cost.during_backward * scale,
    )


def _ensure_devices(plan: Plan, target: Target) -> None:
    names = {d.name for d in target.devices}
    for stage in plan.stages:
        if not stage.devices:
            raise OnnxpipeError(f"plan stage {stage.index} has no device; regenerate the plan with `onnxpipe plan`")
        for d in stage.devices:
            if d not in names:
                raise OnnxpipeError(
                    f"plan stage {stage.index} runs on {d!r}, which target {target.name!r} does not have; pass the plan's own target with --target"
                )


def read_plan(path: str | os.PathLike) -> Plan:
    """A plan from its JSON file or from a stage directory (which holds plan.json)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "plan.json").is_file():
            raise OnnxpipeError(f"{path}: no plan.json in this directory; pass a plan JSON or a directory written by `onnxpipe split`")
        path = path / "plan.json"
    return Plan.read(path)


def plan_target(plan: Plan, target: str | None = None) -> Target:
    """The target named by `target`, else the one the plan was made for."""
    return load_target(target or plan.target)
