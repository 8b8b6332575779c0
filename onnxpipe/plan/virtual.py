"""Plans with several stages per device (interleaved 1F1B, ZB-V): the model cut into k x v stages by the
planner on a target whose every device counts v times (one virtual device per stage it will hold, with
1/v of its memory: its stages share it), then each stage put on the device the schedule's table places it
on (`schedule.placement`), and the assignment priced and simulated on the real target under that table.

Stages of one device type only: which stage lands on which device is the schedule's, not the solver's,
so on a target of several device types the solver's choice of types would not survive the placement.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from onnxpipe import schedule as sched
from onnxpipe.cost import Costs
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.evaluate import evaluate
from onnxpipe.plan.result import Plan
from onnxpipe.plan.solve import solve
from onnxpipe.pricing.problem import build_problem
from onnxpipe.pricing.stage import Assignment
from onnxpipe.target import Target

__all__ = ["plan_virtual"]


def plan_virtual(
    graph: Graph,
    costs: Costs,
    target: Target,
    *,
    schedule: str,
    stages: int | None,
    batch: int,
    microbatches: int,
    optimizer: str,
    recompute: str,
    time_limit: float,
    progress: Callable[[str], None] | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """The plan of `stages` stages (default: v per device) under a schedule that gives each device v of them."""
    v = sched.virtual(schedule)
    groups = target.groups()
    if len(groups) > 1:
        raise OnnxpipeError(
            f"schedule {schedule} puts {v} stages on each device, which the planner does on targets of one device type; "
            f"{target.name} has {len(groups)} ({', '.join(groups)}): plan it with {', '.join(sched.SCHEDULES)}"
        )
    count = stages or v * len(target.devices)
    if count % v or not v <= count <= v * len(target.devices):
        raise OnnxpipeError(
            f"schedule {schedule} needs {v} stages per device: pass --stages a multiple of {v} up to {v * len(target.devices)} (got {count})"
        )
    virtual = build_problem(graph, costs, _split_devices(target, v), batch=batch, microbatches=microbatches, schedule="1f1b", optimizer=optimizer)
    deadline = deadline or Deadline(time_limit)
    bounds = Bounds(virtual, deadline)
    cut = solve(virtual, count, recompute=recompute, replicas=False, deadline=deadline, progress=progress, bounds=bounds)
    names = [d.name for d in target.devices]
    place = sched.placement(schedule, count)
    assignment = Assignment(
        stages=tuple(s.nodes for s in cut.stages),
        devices=tuple((names[place[s]],) for s in range(count)),
        recompute=tuple(s.recompute for s in cut.stages),
    )
    problem = build_problem(graph, costs, target, batch=batch, microbatches=microbatches, schedule=schedule, optimizer=optimizer)
    # The bound of the cut: k x v stages each on its own device of the same speed, the family the placement belongs to.
    return evaluate(problem, assignment, cut.solver, replicas=False, bounds=bounds)


def _split_devices(target: Target, v: int) -> Target:
    """The target with each device as v devices of its type, each with 1/v of its memory."""
    devices = tuple(
        dataclasses.replace(d, name=f"{d.name}/{i}", memory_bytes=d.memory_bytes / v) for d in target.devices for i in range(v)
    )
    return dataclasses.replace(target, devices=devices)
