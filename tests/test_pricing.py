"""The pricing layer: one rule for a stage's time and memory, which the DP, CP-SAT, `evaluate` and the
simulator all read. Properties on random DAGs (tests/test_properties.py's models) and random targets:
the DP's and CP-SAT's stage times and memory equal `price`'s; a plan's stages priced again from its JSON
give the same simulated iteration as `evaluate`."""

from __future__ import annotations

import dataclasses
import math
from types import MappingProxyType

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from onnxpipe.cost import annotate
from onnxpipe.graph import load
from onnxpipe.models import build
from onnxpipe.plan import evaluate, simulate_plan
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.cpsat import _NS, _Model
from onnxpipe.plan.dp import _prefix, _stage_times, intervals
from onnxpipe.pricing.problem import Problem, build_problem
from onnxpipe.pricing.stage import Assignment, StageCost, activation_bytes, held, price, state_bytes
from onnxpipe.pricing.timemodel import node_seconds
from onnxpipe.target import Device, Link, Target, load_target
from test_properties import RandomModel, random_models


def test_the_rule_in_numbers() -> None:
    # 3 micro-batches in flight over 2 replicas: one replica owns 2 of any 3 consecutive ones.
    assert (held(3, 2), held(4, 2), held(1, 3)) == (2, 2, 1)
    assert state_bytes(100.0, 100.0, 2.0) == 400.0  # Adam: parameters, gradients and two moments
    assert state_bytes(100.0, 40.0, 2.0) == 220.0  # 60 bytes frozen (int8 weights): held, no gradient, no moments
    assert state_bytes(100.0, 40.0, 2.0, training=False) == 100.0
    assert activation_bytes(2, 50.0, 10.0, False) == 100.0
    assert activation_bytes(2, 50.0, 10.0, True) == 70.0  # two stashes and one micro-batch rebuilt


def test_a_derived_tensor_costs_each_stage_reading_it_the_nodes_that_make_it() -> None:
    """The padding mask (`Graph.derived_nodes`) is read as a model input is, and each stage reading it pays its makers'
    forward, at that stage's device: the first stage alone when the mask's readers sit there, both otherwise."""
    graph = load(build("bert-tiny", padding_mask=True))
    problem = build_problem(graph, annotate(graph), load_target("hetero"), batch=graph.batch * 2, microbatches=2)
    mask = next(t for t, name in enumerate(problem.tensor_names) if name in graph.derived and len(problem.tensor_consumers[t]) > 1)
    assert problem.tensor_producer[mask] == -1 and len(problem.tensor_consumers[mask]) == 2  # one Add per layer
    assert problem.tensor_bytes[mask] == graph.tensors["attention_mask"].nbytes  # what a recomputing stage stashes for it
    makers = [n for n in graph.order if n in graph.derived_nodes]
    for g in range(len(problem.groups)):
        device = problem.target.device(problem.group_devices[g][0])
        want = sum(node_seconds(device, problem.costs.nodes[n], problem.dtype) for n in makers)  # one micro-batch: the batch annotated
        assert problem.crossing_received[g, mask] == pytest.approx(want, rel=1e-12) and want > 0
    c1, c2 = problem.tensor_consumers[mask]
    devices = tuple((d.name,) for d in problem.target.devices[:2])
    for last, paying in ((c2, (True, False)), (c1, (True, True))):
        assignment = Assignment((problem.nodes[: last + 1], problem.nodes[last + 1:]), devices, (False, False))
        stage_of = np.repeat([0, 1], [last + 1, problem.n - last - 1])
        plain = price(dataclasses.replace(problem, crossing_received=problem.crossing_received * 0), assignment, stage_of)
        costs = price(problem, assignment, stage_of)
        for s, (device,) in enumerate(devices):
            want = problem.crossing_received[problem.group_of(device), mask] if paying[s] else 0.0
            assert costs[s].forward - plain[s].forward == pytest.approx(want, rel=1e-9, abs=1e-15)


@st.composite
def targets(draw: st.DrawFn, groups: int) -> Target:
    """A random cluster: `groups` device groups of 1-3 devices each, links of random bandwidth and latency."""
    devices: list[Device] = []
    for g in range(groups):
        rate = draw(st.floats(1e10, 1e13))
        fields = dict(
            group=f"d{g}", kind=draw(st.sampled_from(("gpu", "fpga"))), peak_flops=MappingProxyType({"float32": rate}),
            memory_bytes=1e12, memory_bandwidth=draw(st.floats(1e10, 1e12)),
            efficiency=MappingProxyType({"default": draw(st.floats(0.2, 1.0))}), op_overhead=draw(st.floats(0.0, 1e-5)),
            action_overhead=draw(st.floats(0.0, 1e-5)), step_overhead=draw(st.floats(0.0, 1e-4)),
        )
        devices += [Device(name=f"d{g}_{i}", **fields) for i in range(draw(st.integers(1, 3)))]  # type: ignore[arg-type]
    links = tuple(
        Link((f"d{a}", f"d{b}"), draw(st.floats(1e8, 1e11)), draw(st.floats(0.0, 1e-4)), "switch") for a in range(groups) for b in range(a, groups)
    )
    return Target("random", "random cluster", tuple(devices), links, False, "<test>")


@st.composite
def layouts(draw: st.DrawFn, problem: Problem, stages: int) -> tuple[list[int], list[int], list[int], list[bool]]:
    """Cuts of the topological order into `stages` runs, and per stage a device group, a replica count
    (within the group's devices) and a recompute flag."""
    cuts = sorted(draw(st.lists(st.integers(1, problem.n - 1), min_size=stages - 1, max_size=stages - 1, unique=True)))
    left = [len(d) for d in problem.group_devices]
    groups, replicas = [], []
    for s in range(stages):
        after = stages - s - 1  # stages still to place, one device each at least
        g = draw(st.sampled_from([g for g, n in enumerate(left) if n >= 1 and sum(left) - 1 >= after]))
        r = draw(st.integers(1, min(left[g], sum(left) - after)))
        left[g] -= r
        groups.append(g)
        replicas.append(r)
    return [0, *cuts, problem.n], groups, replicas, draw(st.lists(st.booleans(), min_size=stages, max_size=stages))


def setup(case: RandomModel, target: Target, data: st.DataObject) -> tuple[Problem, int]:
    graph = load(case.model)
    m = data.draw(st.sampled_from((1, 2, 4)))
    problem = build_problem(graph, annotate(graph), target, batch=graph.batch * m, microbatches=m,
                            schedule=data.draw(st.sampled_from(("gpipe", "1f1b"))), optimizer=data.draw(st.sampled_from(("sgd", "adam"))),
                            mode=data.draw(st.sampled_from(("training", "training", "inference"))))
    # some weights frozen (int8 behind a DequantizeLinear, a constant fill): held, without gradients, optimizer state or all-reduce
    kept = np.array(data.draw(st.lists(st.sampled_from((0.0, 0.5, 1.0)), min_size=problem.n, max_size=problem.n)))
    problem = dataclasses.replace(problem, trained=problem.trained * kept)
    if data.draw(st.booleans()):  # cut tensors costing their stages forward seconds (layout reorders, float readers of a dequantized tensor)
        shape = problem.crossing_sent.shape
        sent, received = (np.array(data.draw(st.lists(st.sampled_from((0.0, 0.0, 2e-6, 3e-4)), min_size=math.prod(shape), max_size=math.prod(shape))))
                          .reshape(shape) for _ in range(2))
        # a model input's: a derived tensor (`Graph.derived_nodes`) that each stage reading it makes
        problem = dataclasses.replace(problem, crossing_sent=sent * (problem.tensor_producer >= 0), crossing_received=received)
    return problem, min(case.stages, len(target.devices))


def priced(problem: Problem, bounds: list[int], groups: list[int], replicas: list[int], recompute: list[bool]) -> tuple[StageCost, ...]:
    used = [0] * len(problem.groups)
    devices = []
    for g, r in zip(groups, replicas):
        devices.append(problem.group_devices[g][used[g] : used[g] + r])
        used[g] += r
    stage_of = np.repeat(np.arange(len(groups)), np.diff(bounds))
    nodes = tuple(problem.nodes[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    return price(problem, Assignment(nodes, tuple(devices), tuple(recompute)), stage_of)


@given(random_models(), targets(groups=1), st.data())
def test_the_dp_prices_a_stage_as_the_rule(case: RandomModel, target: Target, data: st.DataObject) -> None:
    """On one device group the DP's stage time is `price`'s, except that it prices each tensor sent once
    (it cannot know how many later stages read it): equal where each goes to one stage, else less.
    Its memory is `price`'s: the stage fits a capacity just above it and not one just below."""
    problem, k = setup(case, target, data)
    bounds, groups, replicas, recompute = data.draw(layouts(problem, k))
    costs = priced(problem, bounds, groups, replicas, recompute)
    blocks = coarsen(problem, problem.n)
    assert blocks.count == problem.n
    table = intervals(blocks)
    flights = problem.flights(k)
    for s, cost in enumerate(costs):
        i, j = bounds[s], bounds[s + 1]
        choice = "always" if cost.recompute else "never"

        def dp(capacity: float) -> float:
            shrunk = dataclasses.replace(problem, capacity=np.array([capacity]))
            return float(_stage_times(shrunk, blocks, table, _prefix(blocks), {}, 0, replicas[s], 0 if s else -1, 0, flights[s], choice)[i, j])

        sent = table.out_count[i, j] * problem.latency[0, 0] + table.out_bytes[i, j] / (replicas[s] * problem.bandwidth[0, 0])
        fanout = any(len(set(np.searchsorted(bounds, c, side="right") - 1) - {s}) > 1
                     for p, c in zip(problem.tensor_producer, problem.tensor_consumers) if i <= p < j)
        assert sent == pytest.approx(cost.out_seconds, rel=1e-9, abs=1e-18) if not fanout else sent <= cost.out_seconds * (1 + 1e-9)
        want = cost.seconds_per_microbatch(problem.microbatches) - cost.out_seconds + sent
        total = cost.memory.total
        assert dp(total * (1 + 1e-9)) == pytest.approx(want, rel=1e-9, abs=1e-18)
        if total > 0:
            assert math.isinf(dp(total * (1 - 1e-9)))


def assert_cpsat_prices_as_the_rule(problem: Problem, bounds: list[int], groups: list[int], replicas: list[int], recompute: list[bool]) -> None:
    """CP-SAT held to one layout: each stage's time (the sum of the stage times minimised) and its objective
    (the bottleneck) are `price`'s, each term rounded up to whole nanoseconds; it finds the layout feasible
    under a capacity of `price`'s fullest stage plus its KiB rounding, and infeasible just below that stage's memory."""
    from ortools.sat.python import cp_model

    k = len(groups)
    costs = priced(problem, bounds, groups, replicas, recompute)
    blocks = coarsen(problem, problem.n)
    fullest = max(c.memory.total for c in costs)
    terms = problem.n + len(blocks.nbytes) * (k + 4) + 4

    def solve(capacity: float, each: bool = False) -> tuple[str, list[float]]:
        model = _Model(dataclasses.replace(problem, capacity=np.full(len(problem.groups), capacity)), blocks, k, "auto", True, 0.0, math.inf)
        stage_of = np.repeat(np.arange(k), np.diff(bounds))
        for b in range(blocks.count):
            for s in range(k):
                model.cp.add(model.x[b][s] == int(stage_of[b] == s))
        for s in range(k):
            model.cp.add(model.y[s][model.options.index((groups[s], replicas[s]))] == 1)
            model.cp.add(model.rc[s] == int(costs[s].recompute))
        if each:
            model.cp.minimize(sum(model.stage_ns))
        solver = cp_model.CpSolver()
        solver.parameters.num_workers = 1
        solver.parameters.max_time_in_seconds = 30
        status = solver.solve(model.cp)
        if status != cp_model.OPTIMAL:
            return solver.status_name(status), []
        return "OPTIMAL", [solver.value(t) / _NS for t in model.stage_ns] if each else [solver.objective_value / _NS]

    def near(got: float, want: float) -> bool:
        return want * (1 - 1e-9) <= got <= want * (1 + 1e-9) + terms * 1e-9

    capacity = fullest + 1024.0 * (terms + 1)
    status, (objective,) = solve(capacity)
    assert status == "OPTIMAL" and near(objective, max(c.seconds_per_microbatch(problem.microbatches) for c in costs))
    status, stages = solve(capacity, each=True)
    assert status == "OPTIMAL" and all(near(got, c.seconds_per_microbatch(problem.microbatches)) for got, c in zip(stages, costs)), (stages, costs)
    if fullest > 2048:
        assert solve(fullest * (1 - 1e-6) - 1024.0)[0] == "INFEASIBLE"


@given(random_models(), targets(groups=2), st.data())
def test_cpsat_prices_a_layout_as_the_rule(case: RandomModel, target: Target, data: st.DataObject) -> None:
    problem, k = setup(case, target, data)
    assert_cpsat_prices_as_the_rule(problem, *data.draw(layouts(problem, k)))


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_cpsat_prices_replicated_stages_across_groups_as_the_rule(mode: str) -> None:
    """The zoo's perceptron on two groups of two devices, both stages replicated, messages across the groups."""
    graph = load(build("mlp"))
    target = Target("two", "two groups of two", tuple(
        Device(name=f"d{g}_{i}", group=f"d{g}", kind="gpu", peak_flops=MappingProxyType({"float32": 1e12 * (g + 1)}), memory_bytes=1e12,
               memory_bandwidth=1e11, efficiency=MappingProxyType({"default": 0.5}), op_overhead=1e-6) for g in range(2) for i in range(2)),
        (Link(("d0", "d0"), 5e10, 2e-6, "switch"), Link(("d0", "d1"), 1e9, 1e-5, "switch"), Link(("d1", "d1"), 5e10, 2e-6, "switch")), False, "<test>")
    problem = build_problem(graph, annotate(graph), target, batch=graph.batch * 4, microbatches=4, mode=mode)
    half = problem.n // 2
    for recompute in ([False, False], [True, False]):
        assert_cpsat_prices_as_the_rule(problem, [0, half, problem.n], [0, 1], [2, 2], recompute)


@given(random_models(), targets(groups=2), st.data())
def test_a_plan_priced_again_from_its_record_simulates_as_evaluate(case: RandomModel, target: Target, data: st.DataObject) -> None:
    """`evaluate` simulates the stage costs it priced; the plan JSON's figures, priced again, give the same iteration."""
    problem, k = setup(case, target, data)
    bounds, groups, replicas, recompute = data.draw(layouts(problem, k))
    costs = priced(problem, bounds, groups, replicas, recompute)
    nodes = tuple(problem.nodes[a:b] for a, b in zip(bounds[:-1], bounds[1:]))
    plan = evaluate(problem, Assignment(nodes, tuple(c.devices for c in costs), tuple(recompute)))
    assert plan.bottleneck_seconds == max(c.seconds_per_microbatch(problem.microbatches) for c in costs)
    assert simulate_plan(plan, target).iteration_seconds == pytest.approx(plan.iteration_seconds, rel=1e-9)
