"""Plans with several stages per device (interleaved 1F1B, ZB-V): the model cut into k x v stages by the
planner on a target whose every device counts v times (one virtual device per stage it will hold, with
1/v of its memory: its stages share it), then each stage put on the device the schedule's table places it
on (`schedule.placement`), and the assignment priced and simulated on the real target under that table.

On a target of several device types, the stages a device holds run on its type: which device index holds which
type (a pattern) fixes each stage's type (`Problem.stage_groups`), and each pattern is cut in turn, a share of the
time each, the plan of least predicted iteration kept. Every pattern where there are at most `_MOST_PATTERNS`;
beyond, those that keep each type's devices side by side, in every order of the types (the bound then is the
first-principles one, as the other patterns were not searched).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable

from onnxpipe import schedule as sched
from onnxpipe.cost import Costs
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.evaluate import evaluate, fits
from onnxpipe.plan.patterns import sequences
from onnxpipe.plan.result import Plan, SolveInfo
from onnxpipe.plan.solve import solve
from onnxpipe.pricing.problem import Problem, build_problem
from onnxpipe.pricing.stage import Assignment
from onnxpipe.target import Target

__all__ = ["plan_virtual"]

#: Device-type patterns searched one by one up to this many (2 + 2 devices of two types: 6; 4 + 4: 70).
_MOST_PATTERNS = 24


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
    count = stages or v * len(target.devices)
    if count % v or not v <= count <= v * len(target.devices):
        raise OnnxpipeError(
            f"schedule {schedule} needs {v} stages per device: pass --stages a multiple of {v} up to {v * len(target.devices)} (got {count})"
        )
    virtual = build_problem(graph, costs, _split_devices(target, v), batch=batch, microbatches=microbatches, schedule="1f1b", optimizer=optimizer)
    problem = build_problem(graph, costs, target, batch=batch, microbatches=microbatches, schedule=schedule, optimizer=optimizer)
    deadline = deadline or Deadline(time_limit)
    bounds = Bounds(virtual, deadline)
    place = sched.placement(schedule, count)
    patterns, every = _patterns(tuple(len(d) for d in problem.group_devices), count // v)
    several = len(problem.group_devices) > 1
    found: list[tuple[Plan, Plan]] = []  # (the cut on the virtual target, it placed on the real one)
    failure: OnnxpipeError | None = None
    for i, pattern in enumerate(patterns):
        if deadline.passed() and found:
            every = False
            break
        fixed = dataclasses.replace(virtual, stage_groups=tuple(pattern[place[s]] for s in range(count))) if several else virtual
        if several and progress:
            progress(f"{schedule}: devices of types {', '.join(virtual.groups[g] for g in pattern)} (pattern {i + 1} of {len(patterns)})")
        share = deadline.share_of_rest(len(patterns) - i) if several else deadline
        try:
            cut = solve(fixed, count, recompute=recompute, replicas=False, deadline=share, progress=progress, bounds=bounds)
        except OnnxpipeError as exc:  # no cut of this pattern fits: the others stand
            failure = exc
            continue
        devices = _devices(problem, pattern)
        assignment = Assignment(
            stages=tuple(s.nodes for s in cut.stages),
            devices=tuple((devices[place[s]],) for s in range(count)),
            recompute=tuple(s.recompute for s in cut.stages),
        )
        # The bound of the cut: k x v stages each on its own device of the same speed, the family the placement belongs to.
        found.append((cut, evaluate(problem, assignment, cut.solver, replicas=False, bounds=bounds)))
    if not found:
        assert failure is not None
        raise failure
    cut, plan = min(found, key=lambda f: (not fits(f[1]), f[1].iteration_seconds))
    if not several:
        return plan
    return dataclasses.replace(plan, solver=_over_patterns(cut, [c for c, _ in found], every and len(found) == len(patterns), bounds(count, False).seconds))


def _patterns(counts: tuple[int, ...], used: int) -> tuple[list[tuple[int, ...]], bool]:
    """The device type (group) of each of `used` device indices, at most counts[g] of group g; and whether these are all
    of them (else: each group's devices side by side, in up to `_MOST_PATTERNS` orders of the groups, the first `used`
    of each order)."""
    every = list(itertools.islice(sequences(counts, used), _MOST_PATTERNS + 1))
    if len(every) <= _MOST_PATTERNS:
        return every, True
    orders = itertools.islice(itertools.permutations(range(len(counts))), _MOST_PATTERNS)
    return sorted({tuple(g for g in order for _ in range(counts[g]))[:used] for order in orders}), False


def _devices(problem: Problem, pattern: tuple[int, ...]) -> list[str]:
    """The real device at each index of a pattern: the next unused one of its group, in file order."""
    left = [list(names) for names in problem.group_devices]
    return [left[g].pop(0) for g in pattern]


def _over_patterns(chosen: Plan, cuts: list[Plan], every: bool, floor: float) -> SolveInfo:
    """The chosen cut's solver figures over every pattern searched: a bound holds for every plan only as the least of the
    patterns' bounds when every pattern was searched (each holds for its own pattern), else it is the first-principles one."""
    info = chosen.solver
    assert info is not None
    bound = min(c.solver.bound_seconds for c in cuts if c.solver) if every else floor
    objective = chosen.bottleneck_seconds
    least = min(c.solver.least_bottleneck_seconds or c.bottleneck_seconds for c in cuts if c.solver)
    status = "OPTIMAL" if every and all(c.solver and c.solver.status == "OPTIMAL" for c in cuts) and objective <= bound * (1 + 1e-9) else "FEASIBLE"
    return dataclasses.replace(info, status=status, bound_seconds=bound, gap=max(0.0, (objective - bound) / objective) if objective > 0 else 0.0,
                               solve_seconds=sum(c.solver.solve_seconds for c in cuts if c.solver), least_bottleneck_seconds=least)


def _split_devices(target: Target, v: int) -> Target:
    """The target with each device as v devices of its type, each with 1/v of its memory."""
    devices = tuple(
        dataclasses.replace(d, name=f"{d.name}/{i}", memory_bytes=d.memory_bytes / v) for d in target.devices for i in range(v)
    )
    return dataclasses.replace(target, devices=devices)
