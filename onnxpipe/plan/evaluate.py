"""The one evaluation function: an assignment (nodes, devices and recompute per stage) becomes a full
`Plan` with per-stage times, communication, memory and the iteration time. The planner, every
baseline and hand-given cuts go through it, so their numbers compare like for like.

Reading order: `Assignment` -> `evaluate` -> `_ensure_assignment` -> `_tied` -> `_communication` -> `_stage`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.bounds import lower_bound
from onnxpipe.pricing.timemodel import allreduce_seconds
from onnxpipe.plan.problem import Problem, held, in_flight
from onnxpipe.plan.result import Memory, Plan, SolveInfo, StagePlan
from onnxpipe.plan.timing import iteration_seconds
from onnxpipe.units import format_bytes

__all__ = ["Assignment", "evaluate", "fits", "overflow"]


@dataclass(frozen=True)
class Assignment:
    """Where everything goes, before any number is attached."""

    #: Node names of each stage.
    stages: tuple[tuple[str, ...], ...]
    #: Device instance names of each stage (several: the stage is replicated).
    devices: tuple[tuple[str, ...], ...]
    #: Per stage: True recomputes activations in backward instead of stashing them.
    recompute: tuple[bool, ...]


def evaluate(problem: Problem, assignment: Assignment, solver: SolveInfo | None = None, replicas: bool = True) -> Plan:
    """Price an assignment under the problem's batch, micro-batches, schedule and optimizer."""
    stage_of = _ensure_assignment(problem, assignment)
    k = len(assignment.stages)
    groups = [np.array([problem.group_of(d) for d in devs]) for devs in assignment.devices]
    comm = _communication(problem, stage_of, groups, k)
    flights = in_flight(problem.schedule, k, problem.microbatches)
    tied = _tied(problem, stage_of, k)
    stage_plans = [replace(_stage(problem, s, stage_of == s, assignment, groups[s], comm, flights[s]), tied=tied[s][0], tied_bytes=tied[s][1])
                   for s in range(k)]
    bottleneck = max(p.seconds_per_microbatch(problem.microbatches) for p in stage_plans)
    bound = lower_bound(problem, k, replicas).seconds
    info = solver or SolveInfo(status="given", bound_seconds=bound, gap=_gap(bottleneck, bound), solve_seconds=0.0, coarsening_loss=0.0, blocks=problem.n)
    graph = problem.graph
    plan = Plan(
        model=graph.source,
        fingerprint=graph.fingerprint,
        target=problem.target.name,
        dims=dict(graph.dims),
        batch=problem.batch,
        microbatches=problem.microbatches,
        schedule=problem.schedule,
        optimizer=problem.optimizer,
        stages=tuple(stage_plans),
        bottleneck_seconds=bottleneck,
        lower_bound_seconds=bound,
        iteration_seconds=0.0,
        solver=info,
    )
    return replace(plan, iteration_seconds=iteration_seconds(plan, problem.target))


def fits(plan: Plan) -> bool:
    """Every device holds what its stage needs."""
    return all(s.memory.total <= s.memory.capacity for s in plan.stages)


def overflow(plan: Plan) -> str:
    """Why a plan does not fit, e.g. 'stage 0 needs 9.1 GiB > 8 GiB'; empty when it fits."""
    over = [s for s in plan.stages if s.memory.total > s.memory.capacity]
    if not over:
        return ""
    s = max(over, key=lambda s: s.memory.total / s.memory.capacity)
    return f"stage {s.index} needs {format_bytes(s.memory.total)} > {format_bytes(s.memory.capacity)}"


def _gap(objective: float, bound: float) -> float:
    return max(0.0, (objective - bound) / objective) if objective > 0 else 0.0


def _ensure_assignment(problem: Problem, assignment: Assignment) -> np.ndarray:
    k = len(assignment.stages)
    if not (k == len(assignment.devices) == len(assignment.recompute)) or k == 0:
        raise OnnxpipeError(f"an assignment needs nodes, devices and a recompute flag for each of its {k} stages")
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
    used: set[str] = set()
    for s, devs in enumerate(assignment.devices):
        if not devs:
            raise OnnxpipeError(f"stage {s} has no device")
        for d in devs:
            problem.group_of(d)
            if d in used:
                raise OnnxpipeError(f"device '{d}' runs two stages; give each stage its own devices")
            used.add(d)
    for t, p in enumerate(problem.tensor_producer):
        if p >= 0 and (stage_of[problem.tensor_consumers[t]] < stage_of[p]).any():
            raise OnnxpipeError(
                f"tensor '{problem.tensor_names[t]}' would flow backward from stage {stage_of[p]} to stage "
                f"{int(stage_of[problem.tensor_consumers[t]].min())}; data must flow to the same or a later stage"
            )
    return stage_of


def _tied(problem: Problem, stage_of: np.ndarray, k: int) -> list[tuple[tuple[int, ...], float]]:
    """Per stage: the other stages reading one of its trained weights (each holds a copy; through
    constant chains too, e.g. the transpose of a tied embedding), and the bytes of those weights."""
    graph = problem.graph
    position = {n: i for i, n in enumerate(problem.nodes)}
    others: list[set[int]] = [set() for _ in range(k)]
    nbytes = [0.0] * k
    for weight in graph.parameters:
        stages: set[int] = set()
        frontier, seen = [weight], set()
        while frontier:
            for node in graph.consumers(frontier.pop()):
                if node in position:
                    stages.add(int(stage_of[position[node]]))
                elif node not in seen:
                    seen.add(node)
                    frontier.extend(o for o in graph.node(node).output if o)
        if len(stages) > 1:
            for s in stages:
                others[s] |= stages - {s}
                nbytes[s] += graph.tensors[weight].nbytes
    return [(tuple(sorted(o)), b) for o, b in zip(others, nbytes)]


@dataclass(frozen=True)
class _Comm:
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    in_seconds: np.ndarray
    out_seconds: np.ndarray
    #: Bytes a recomputing stage stashes per micro-batch: everything it receives, model inputs included.
    stash_bytes: np.ndarray


def _communication(problem: Problem, stage_of: np.ndarray, groups: list[np.ndarray], k: int) -> _Comm:
    """One message per tensor per consumer stage, from the producer's stage; a replicated stage sends
    and receives its share of the micro-batch on each replica."""
    in_b, out_b, in_s, out_s, stash = (np.zeros(k) for _ in range(5))
    replicas = [len(g) for g in groups]
    for t, p in enumerate(problem.tensor_producer):
        nbytes = problem.tensor_bytes[t]
        targets = np.unique(stage_of[problem.tensor_consumers[t]])
        if p < 0:
            stash[targets] += nbytes
            continue
        src = stage_of[p]
        for dst in targets[targets != src]:
            ga, gb = groups[src][0], groups[dst][0]
            latency, bandwidth = problem.latency[ga, gb], problem.bandwidth[ga, gb]
            in_b[dst] += nbytes
            out_b[src] += nbytes
            stash[dst] += nbytes
            in_s[dst] += latency + nbytes / replicas[dst] / bandwidth
            out_s[src] += latency + nbytes / replicas[src] / bandwidth
    return _Comm(in_b, out_b, in_s, out_s, stash)


def _stage(problem: Problem, s: int, mask: np.ndarray, assignment: Assignment, groups: np.ndarray, comm: _Comm, flight: int) -> StagePlan:
    """A stage's plan. Replicas take whole micro-batches round-robin, so per micro-batch a stage of r
    replicas delivers r times its slowest replica's rate (times are those shares), and a replica holds
    the activations of whole micro-batches (`held`)."""
    r = len(groups)
    forward = float(max(problem.forward[g, mask].sum() for g in groups)) / r
    backward = float(max(problem.backward[g, mask].sum() for g in groups)) / r
    recompute = assignment.recompute[s]
    extra = float(max(problem.corun_forward[g, mask].sum() * (2 if recompute else 1) + problem.corun_backward[g, mask].sum() for g in groups)) / r
    params = float(problem.params[mask].sum())
    activations = float(problem.activations[mask].sum())
    mine = held(flight, r)
    if recompute:
        backward += forward
        stashed = mine * comm.stash_bytes[s] + activations
    else:
        stashed = mine * activations
    devices = assignment.devices[s]
    memory = Memory(
        parameters=params,
        gradients=params,
        optimizer=params * problem.optimizer_states,
        activations=stashed,
        capacity=float(min(problem.capacity[g] for g in groups)),
    )
    return StagePlan(
        index=s,
        devices=tuple(devices),
        nodes=tuple(problem.nodes[i] for i in np.flatnonzero(mask)),
        forward_seconds=forward,
        backward_seconds=backward,
        comm_in_seconds=float(comm.in_seconds[s]),
        comm_out_seconds=float(comm.out_seconds[s]),
        comm_in_bytes=float(comm.in_bytes[s]),
        comm_out_bytes=float(comm.out_bytes[s]),
        allreduce_seconds=allreduce_seconds(problem.target, tuple(devices), params),
        recompute=recompute,
        memory=memory,
        stash_bytes=float(comm.stash_bytes[s]) if recompute else activations,
        corun_slowdown=extra / (forward + backward) if forward + backward > 0 else 0.0,
    )
