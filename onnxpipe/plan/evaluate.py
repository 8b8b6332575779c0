"""The one evaluation function: an assignment (nodes, devices and recompute per stage) is priced
(`onnxpipe.pricing.stage.price`), then its schedule simulated on those prices, and becomes a full `Plan`
with per-stage times, communication, memory and the iteration time. The planner, every baseline and
hand-given cuts go through it, so their numbers compare like for like.

Reading order: `evaluate` -> `_ensure_assignment` -> `_stage_plan`.
"""

from __future__ import annotations

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.result import Plan, SolveInfo, StagePlan
from onnxpipe.pricing.notes import pricing_notes
from onnxpipe.pricing.problem import Problem, schedule_table
from onnxpipe.pricing.stage import Assignment, StageCost, price
from onnxpipe.schedule import stage_rows
from onnxpipe.simulate import simulate
from onnxpipe.units import format_bytes, plural

__all__ = ["Assignment", "evaluate", "fits", "within", "placed", "overflow"]


def evaluate(problem: Problem, assignment: Assignment, solver: SolveInfo | None = None, replicas: bool = True, bounds: Bounds | None = None) -> Plan:
    """Price an assignment under the problem's batch, micro-batches, schedule and optimizer, and simulate its
    iteration. `bounds`: the problem's lower bounds, when the caller prices several plans of it."""
    stage_of = _ensure_assignment(problem, assignment)
    k = len(assignment.stages)
    costs = price(problem, assignment, stage_of)
    bottleneck = max(c.seconds_per_microbatch(problem.microbatches) for c in costs)
    bound = (bounds or Bounds(problem))(k, replicas).seconds
    info = solver or SolveInfo(status="given", bound_seconds=bound, gap=_gap(bottleneck, bound), solve_seconds=0.0, coarsening_loss=0.0, blocks=problem.n)
    table = schedule_table(problem.mode, problem.schedule, k, problem.microbatches)
    sim = simulate(table, costs, problem.target, schedule=problem.schedule, batch=problem.batch)
    graph = problem.graph
    return Plan(
        model=graph.source,
        fingerprint=graph.fingerprint,
        target=problem.target.name,
        dims=dict(graph.dims),
        batch=problem.batch,
        microbatches=problem.microbatches,
        schedule=problem.schedule,
        optimizer=problem.optimizer,
        stages=tuple(_stage_plan(c, tuple(problem.nodes[i] for i in np.flatnonzero(stage_of == c.index))) for c in costs),
        bottleneck_seconds=bottleneck,
        lower_bound_seconds=bound,
        iteration_seconds=sim.iteration_seconds,
        solver=info,
        mode=problem.mode,
        latency_seconds=0.0 if problem.training else sim.latency_seconds,
        notes=pricing_notes(problem, stage_of, assignment.devices),
    )


def fits(plan: Plan) -> bool:
    """Every device holds what its stages need."""
    return not overflow(plan)


def within(problem: Problem, plan: Plan) -> bool:
    """The plan fits, its stages run where the problem places them (`placed`) and its latency is within the problem's
    bound (`Problem.max_latency`)."""
    return placed(problem, plan) and fits(plan) and plan.latency_seconds <= problem.max_latency * (1 + 1e-9)


def placed(problem: Problem, plan: Plan) -> bool:
    """Every stage runs on the device group the problem fixes for it (`Problem.stage_groups`; none fixed: any)."""
    return not problem.stage_groups or (len(plan.stages) == len(problem.stage_groups) and all(
        problem.group_of(d) == g for s, g in zip(plan.stages, problem.stage_groups) for d in s.devices))


def overflow(plan: Plan) -> str:
    """Why a plan does not fit, e.g. 'stage 0 needs 9.1 GiB > 8 GiB'; empty when it fits. A device holding
    several stages needs their peaks together."""
    need: dict[tuple[str, ...], float] = {}
    for s in plan.stages:
        need[s.devices] = need.get(s.devices, 0.0) + s.memory.total
    over = [s for s in plan.stages if need[s.devices] > s.memory.capacity]
    if not over:
        return ""
    s = max(over, key=lambda s: need[s.devices] / s.memory.capacity)
    shared = [t.index for t in plan.stages if t.devices == s.devices]
    who = f"stage {s.index}" if len(shared) == 1 else f"stages {', '.join(map(str, shared))} on one device"
    return f"{who} needs {format_bytes(need[s.devices])} > {format_bytes(s.memory.capacity)}"


def _gap(objective: float, bound: float) -> float:
    return max(0.0, (objective - bound) / objective) if objective > 0 else 0.0


def _ensure_assignment(problem: Problem, assignment: Assignment) -> np.ndarray:
    k = len(assignment.stages)
    if not (k == len(assignment.devices) == len(assignment.recompute)) or k == 0:
        raise OnnxpipeError(f"an assignment needs nodes, devices and a recompute flag for each of its {plural(k, 'stage')}")
    position = {n: i for i, n in enumerate(problem.nodes)}
    stage_of = np.full(problem.n, -1, dtype=np.int64)
    for s, names in enumerate(assignment.stages):
        if not names:
            raise OnnxpipeError(f"stage {s} has no nodes; use fewer stages")
        for name in names:
            if name not in position:
                raise OnnxpipeError(f"node '{name}' of stage {s} is not a compute node of the model; take node names from the model")
            if stage_of[position[name]] >= 0:
                raise OnnxpipeError(f"node '{name}' is in stage {stage_of[position[name]]} and stage {s}; each node belongs to one stage")
            stage_of[position[name]] = s
    if (stage_of < 0).any():
        raise OnnxpipeError(f"node '{problem.nodes[int(np.argmin(stage_of))]}' is in no stage; every compute node needs one")
    # A schedule may give a device several stages (`schedule.stage_rows`): those stages share its devices.
    rows = stage_rows(schedule_table(problem.mode, problem.schedule, k, problem.microbatches))
    used: dict[str, int] = {}
    for s, devs in enumerate(assignment.devices):
        if not devs:
            raise OnnxpipeError(f"stage {s} has no device")
        for d in devs:
            problem.group_of(d)
            if used.setdefault(d, rows[s]) != rows[s]:
                raise OnnxpipeError(f"device '{d}' runs two stages; give each stage its own devices")
        first = rows.index(rows[s])
        if assignment.devices[first] != devs:
            raise OnnxpipeError(f"stages {first} and {s} share a device under {problem.schedule}; give them the same devices")
    for t, p in enumerate(problem.tensor_producer):
        if p >= 0 and (stage_of[problem.tensor_consumers[t]] < stage_of[p]).any():
            raise OnnxpipeError(
                f"tensor '{problem.tensor_names[t]}' would flow backward from stage {stage_of[p]} to stage "
                f"{int(stage_of[problem.tensor_consumers[t]].min())}; data must flow to the same or a later stage"
            )
    return stage_of


def _stage_plan(cost: StageCost, nodes: tuple[str, ...]) -> StagePlan:
    """How a priced stage shows in the plan."""
    return StagePlan(
        index=cost.index,
        devices=cost.devices,
        nodes=nodes,
        forward_seconds=cost.forward,
        backward_seconds=cost.backward,
        weight_seconds=cost.weight,
        comm_in_seconds=cost.in_seconds,
        comm_out_seconds=cost.out_seconds,
        comm_in_bytes=cost.in_bytes,
        comm_out_bytes=cost.out_bytes,
        allreduce_seconds=cost.allreduce,
        recompute=cost.recompute,
        memory=cost.memory,
        stash_bytes=cost.stash,
        tied=cost.tied,
        tied_bytes=cost.tied_bytes,
        corun_slowdown=cost.corun_slowdown,
    )
