"""The planner's entry points: `plan` (graph, costs, target -> Plan) and `plan_model` (a model path and
a target name -> graph, costs, target, plan), shared by the CLI, split and train."""

from __future__ import annotations

import dataclasses
import functools
import math
import os
from collections.abc import Callable, Mapping

from onnxpipe.cost import Costs, annotate, read_annotated
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.initializers import TieChoice
from onnxpipe.nodes import draws_random
from onnxpipe.plan.baselines import baselines
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.evaluate import fits, within
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.explore import by_stage_count, candidate, explore, microbatch_choices, stage_counts
from onnxpipe.pricing.problem import Problem, build_problem
from onnxpipe.plan.result import Plan
from onnxpipe.plan.solve import latency_message, solve
from onnxpipe.plan.virtual import plan_virtual
from onnxpipe.schedule import SCHEDULES, TABLES, ensure_known, virtual
from onnxpipe.target import Target, load_target
from onnxpipe.units import plural

__all__ = ["plan", "plan_model", "choose_mode", "compare", "faster_stage_count", "TIME_LIMIT"]

#: Seconds a planning command takes in all unless told otherwise.
TIME_LIMIT = 30.0

_RECOMPUTE = ("auto", "always", "never")
#: Shares of the planning budget: exploring configurations or stage counts stops at the first; solving the
#: winner stops at the second, leaving the rest to what follows (several stages per device under auto).
_EXPLORE_SHARE = 0.5
_SOLVE_SHARE = 0.9


def plan(
    graph: Graph,
    costs: Costs,
    target: Target,
    *,
    stages: int | None = None,
    batch: int | None = None,
    microbatches: int | str | None = None,
    schedule: str = "1f1b",
    optimizer: str = "adam",
    recompute: str = "auto",
    replicas: bool = True,
    time_limit: float = TIME_LIMIT,
    progress: Callable[[str], None] | None = None,
    mode: str = "training",
    max_latency: float | None = None,
    deadline: Deadline | None = None,
) -> Plan:
    """Partition and place the graph on the target: the least predicted iteration time among the solver's
    plans (least bottleneck stage time per micro-batch) and every baseline of as many stages.

    Defaults: the stage count (at most one per device) of least predicted iteration time, so no baseline
    beats the plan; 2 x stages micro-batches (2 x devices when the stage count is chosen), a global batch
    of that many copies of the batch the graph was loaded with. `schedule="auto"` / `microbatches="auto"`
    explore (also stage counts when `stages` is None), pricing the DP's plan and every baseline in each
    configuration, and keep the plan of least predicted iteration time: no baseline of any configuration
    explored is predicted faster. `mode="inference"` plans a forward-only pipeline: no gradients, optimizer
    state, stash or recompute; the bottleneck (forward and transfers) is the throughput objective and the
    plan reports its latency; `max_latency` (seconds) takes only plans whose latency is within it, else
    fails naming the least latency found. A schedule that gives each device several stages (interleaved, zb-v) is
    planned by `plan.virtual` (`stages` counts them all, default v per device); auto prices those too, at
    the winner's devices and micro-batches.

    `time_limit` bounds the whole of planning: one `deadline` (default: `time_limit` seconds from now) is
    shared by exploring, pricing the stage counts (`explore.stage_counts`: a ladder above 32 devices), the
    bounds, the DP, CP-SAT and refinement; each stops there with the best plan found so far (exploring
    stops at `_EXPLORE_SHARE` of it, leaving the rest to solve the winner)."""
    devices = len(target.devices)
    _ensure_options(stages, devices, microbatches, schedule, recompute, time_limit)
    if recompute == "always" and mode == "training":
        _ensure_recomputable(graph)
    deadline = deadline or Deadline(time_limit)
    if max_latency is not None and mode != "inference":
        raise OnnxpipeError("--max-latency bounds an inference pipeline's latency; add --mode inference")
    if schedule != "auto" and virtual(schedule) > 1:
        if mode != "training":
            raise OnnxpipeError(f"--schedule {schedule} orders a training step; plan --mode {mode} with the default schedule")
        if microbatches == "auto":
            raise OnnxpipeError(f"--microbatches auto explores the schedules of one stage per device; pass a count with --schedule {schedule}")
        m = microbatches or 2 * ((stages or virtual(schedule) * devices) // virtual(schedule))
        return plan_virtual(graph, costs, target, schedule=schedule, stages=stages, batch=batch or graph.batch * m, microbatches=m,
                            optimizer=optimizer, recompute=recompute, time_limit=time_limit, progress=progress, deadline=deadline)
    exploring = schedule == "auto" or microbatches == "auto"
    k = stages or devices
    m = microbatches if isinstance(microbatches, int) else 2 * k
    batch = batch or graph.batch * m
    base = build_problem(graph, costs, target, batch=batch, microbatches=m if batch % m == 0 else 1, schedule="1f1b" if schedule == "auto" else schedule,
                         optimizer=optimizer, mode=mode, max_latency=math.inf if max_latency is None else max_latency)
    if mode == "inference":
        recompute = "never"  # nothing is stashed for a backward
    if not exploring:
        if batch % m:
            raise OnnxpipeError(f"batch {batch} does not split into {m} micro-batches; pick a divisor of the batch for --microbatches")
        if stages is None:
            return _fastest_stage_count(base, devices, recompute=recompute, replicas=replicas, deadline=deadline, progress=progress)
        # Ranked by iteration time (what the user pays), so no baseline of k stages, priced beside it, is faster.
        return solve(base, k, recompute=recompute, replicas=replicas, deadline=deadline, progress=progress, by_iteration=True)
    candidates, winner, winner_stages, priced = explore(
        base,
        [stages] if stages else list(stage_counts(devices)),
        list(SCHEDULES) if schedule == "auto" else [schedule],
        microbatch_choices(batch) if microbatches == "auto" else [m],
        recompute=recompute,
        replicas=replicas,
        progress=progress,
        deadline=deadline.until(_EXPLORE_SHARE),
    )
    if winner is None or winner_stages is None:
        slow = [c.latency_seconds for c in candidates if c.note.startswith("latency")]
        if slow:
            raise OnnxpipeError(latency_message(base, slow, stages))
        first = candidates[0].note if candidates else "nothing to try"
        raise OnnxpipeError(f"no explored configuration fits ({first}); try --recompute always, a target with more memory, or a larger batch")
    best = solve(winner, winner_stages, recompute=recompute, replicas=replicas, deadline=deadline.until(_SOLVE_SHARE), progress=progress,
                 also=priced, by_iteration=True)
    if schedule == "auto" and mode == "training":
        more = _several_per_device(graph, costs, target, best, recompute=recompute, deadline=deadline, progress=progress)
        fastest = min([best, *(p for p in more if fits(p))], key=lambda p: p.iteration_seconds)
        return dataclasses.replace(fastest, explored=(*candidates, *(candidate(p) for p in more)))
    return dataclasses.replace(best, explored=candidates)


def _ensure_recomputable(graph: Graph) -> None:
    random = draws_random(graph.model.graph)
    if random:
        raise OnnxpipeError(f"--recompute always: the model draws random numbers ({', '.join(random[:3])}: Dropout in training mode or a random op), "
                            "and a recomputed forward would draw other masks than its loss saw; use --recompute auto (stages holding them "
                            "keep their stash) or never")


def _several_per_device(graph: Graph, costs: Costs, target: Target, best: Plan, *, recompute: str, deadline: Deadline,
                        progress: Callable[[str], None] | None) -> list[Plan]:
    """The schedules that give each device several stages (interleaved 1F1B, ZB-V), planned on as many devices as
    `best` uses at its micro-batch count, where they apply (no replicas, micro-batches that fit the table)."""
    k = len(best.stages)
    if any(len(s.devices) > 1 for s in best.stages):
        return []
    found = []
    names = [name for name, (_, v) in TABLES.items() if v > 1 and (name != "interleaved" or best.microbatches % k == 0)]
    for i, name in enumerate(names):
        if deadline.passed():
            break
        v = virtual(name)
        if progress:
            progress(f"exploring {name}, {plural(best.microbatches, 'micro-batch')}, {plural(v * k, 'stage')} on {plural(k, 'device')}")
        share = deadline.share_of_rest(len(names) - i)  # each schedule an equal share of what is left
        try:
            found.append(plan_virtual(graph, costs, target, schedule=name, stages=v * k, batch=best.batch, microbatches=best.microbatches,
                                      optimizer=best.optimizer, recompute=recompute, time_limit=deadline.seconds, progress=progress,
                                      deadline=share))
        except OnnxpipeError:  # no cut into v x k stages fits (or there are fewer nodes): the others stand
            continue
    return found


def plan_model(
    model: str | os.PathLike,
    target: str | Target,
    *,
    dims: Mapping[str, int] | None = None,
    profile: bool | None = None,
    ties: TieChoice | None = None,
    shapes_by_running: bool = False,
    mode: str | None = None,
    adds_loss: bool = False,
    **options: object,
) -> tuple[Graph, Costs, Target, Plan]:
    """Load (untying exporter-merged weights, `ties` overriding), take the model's stored costs (an annotated ONNX) or annotate it, and plan
    in `mode` (`choose_mode`: by default training for a model with a loss output, inference for one without; `adds_loss`: the caller
    appends a loss before training, as `train --loss` does)."""
    graph = load(model, dims, ties, shapes_by_running=shapes_by_running)
    options["mode"] = choose_mode(graph, mode, adds_loss)
    target = load_target(target) if isinstance(target, str) else target
    costs = read_annotated(graph)
    if costs is None:
        first = target.devices[0]  # measured with the execution provider of the first device group's kind
        costs = annotate(graph, profile=target.profile if profile is None else profile, device_kind=first.kind, provider=first.provider)
    return graph, costs, target, plan(graph, costs, target, **options)  # type: ignore[arg-type]


def choose_mode(graph: Graph, mode: str | None, adds_loss: bool = False) -> str:
    """The mode to plan a model in: `mode` when given, else training when the model has a loss output (or gets one:
    `adds_loss`) and inference when it has none (a model without a loss can only be served). Training a model
    without a loss is refused in one line that names both ways out."""
    trainable = graph.loss is not None or adds_loss
    if mode is None:
        return "training" if trainable else "inference"
    if mode == "training" and not trainable:
        first = f" (its first output '{graph.outputs[0]}' is no scalar loss)" if graph.outputs else ""
        raise OnnxpipeError(f"model {graph.source!r} has no loss output{first}, so it cannot be trained as it is; `onnxpipe train` appends "
                            "one with --loss cross_entropy|mse --labels OUTPUT=LABELS, and plan or split serve it forward-only with --mode inference")
    return mode


def compare(graph: Graph, costs: Costs, target: Target, plan: Plan, recompute: str = "auto", replicas: bool = True,
            deadline: Deadline | None = None) -> dict[str, Plan]:
    """The baselines under the plan's batch, micro-batches, schedule and optimizer, by name. Their lower bounds stop at
    `deadline` (the command's): untimed, `plan --stages 4 --compare --time-limit 10` on 1,000 devices took 103 s."""
    problem = _problem_of(graph, costs, target, plan)
    return baselines(problem, len(plan.stages), recompute, replicas, bounds=Bounds(problem, deadline))


def faster_stage_count(graph: Graph, costs: Costs, target: Target, plan: Plan, recompute: str = "auto", replicas: bool = True,
                       max_latency: float = math.inf, deadline: Deadline | None = None) -> Plan | None:
    """The fastest plan at another stage count (the DP's or a baseline's, under the plan's batch,
    micro-batches and schedule, within `max_latency`) when it beats the plan's predicted iteration time; None otherwise.
    Stage counts after `deadline` passes are left out."""
    problem = _problem_of(graph, costs, target, plan, max_latency)
    counts = [k for k in stage_counts(min(len(target.devices), problem.n)) if k != len(plan.stages)]
    found = [p for plans in by_stage_count(problem, counts, recompute, replicas, deadline=deadline).values() for p in plans]
    best = min((p for p in found if within(problem, p)), key=lambda p: p.iteration_seconds, default=None)
    return best if best is not None and best.iteration_seconds < plan.iteration_seconds * (1 - 1e-9) else None


def _problem_of(graph: Graph, costs: Costs, target: Target, plan: Plan, max_latency: float = math.inf) -> Problem:
    return build_problem(graph, costs, target, batch=plan.batch, microbatches=plan.microbatches, schedule=plan.schedule, optimizer=plan.optimizer,
                         mode=plan.mode, max_latency=max_latency)


def _fastest_stage_count(
    problem: Problem, devices: int, *, recompute: str, replicas: bool, deadline: Deadline, progress: Callable[[str], None] | None
) -> Plan:
    """Price the stage counts (`stage_counts`) with the DP and the baselines until `_EXPLORE_SHARE` of the
    deadline, solve the fastest count with CP-SAT and keep the plan of least iteration time at that count:
    no baseline, at any stage count priced, is predicted faster."""
    bounds = Bounds(problem, deadline)
    solve_at = functools.partial(solve, problem, recompute=recompute, replicas=replicas, deadline=deadline,
                                 progress=progress, bounds=bounds)
    fitting = by_stage_count(problem, stage_counts(min(devices, problem.n)), recompute, replicas, bounds, deadline.until(_EXPLORE_SHARE), progress)
    found = {k: [p for p in plans if within(problem, p)] for k, plans in fitting.items()}
    priced = [p for plans in found.values() for p in plans]
    if not priced:
        slow = [p.latency_seconds for plans in fitting.values() for p in plans]
        if slow:
            raise OnnxpipeError(latency_message(problem, slow))
        return solve_at(min(devices, problem.n))  # nothing fits as an interval: CP-SAT may still find a plan, else it names the fix
    k = len(min(priced, key=lambda p: p.iteration_seconds).stages)
    best = solve_at(k, also=found[k], by_iteration=True)
    tried = sorted((candidate(min(plans, key=lambda p: p.iteration_seconds)) for plans in found.values() if plans), key=lambda c: c.iteration_seconds)
    return dataclasses.replace(best, explored=tuple(tried))


def _ensure_options(stages: int | None, devices: int, microbatches: int | str | None, schedule: str, recompute: str, time_limit: float) -> None:
    ensure_known(schedule, ("auto",))
    per_device = 1 if schedule == "auto" else virtual(schedule)
    if stages is not None and stages < 1:
        raise OnnxpipeError(f"--stages {stages}: need at least 1 stage")
    if stages is not None and stages > devices * per_device:
        raise OnnxpipeError(f"--stages {stages} is more than the target's {plural(devices, 'device')}; use at most {devices * per_device} stages or a larger target")
    if isinstance(microbatches, str) and microbatches != "auto":
        raise OnnxpipeError(f"--microbatches {microbatches!r}: expected a positive integer or 'auto'")
    if isinstance(microbatches, int) and microbatches < 1:
        raise OnnxpipeError(f"--microbatches {microbatches}: need at least 1 micro-batch")
    if recompute not in _RECOMPUTE:
        raise OnnxpipeError(f"--recompute {recompute!r}: choose one of {', '.join(_RECOMPUTE)}")
    if time_limit <= 0:
        raise OnnxpipeError(f"--time-limit {time_limit}: must be positive seconds")
