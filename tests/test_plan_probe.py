"""Questions below the best plan (`plan.probe`): the bound they prove is never above the optimum, rises to the
hardest question answered, stops once close enough or at the deadline, and a plan found below the ceiling is kept.

The bisection itself is checked against scripted answers on a clock that advances per reading (work done, never
wall-clock time); CP-SAT's answers are checked against the optimum of a chain (the DP's, exact there) and brute force.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import brute_force, chain_model, hand_costs, make_target, slow_link_target
from test_plan_deadline import Ticks

from onnxpipe.graph import load
from onnxpipe.plan import baselines, build_problem, evaluate, lower_bound
from onnxpipe.plan import solve as solve_module
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.cpsat import CpResult
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.layout import Layout, to_assignment
from onnxpipe.plan.probe import CLOSE, STEP, probe

#: A stand-in for a plan found by a question (the bisection never looks inside it).
FOUND = Layout(block_stage=np.zeros(1, dtype=np.int64), groups=(0,), replicas=(1,), recompute=(False,))


class Scripted:
    """Answers as CP-SAT would for a problem whose optimum is `optimum`: refutes every ceiling below `hard`, runs
    out of time between `hard` and the optimum, finds the optimal plan at or above it; records each question."""

    def __init__(self, optimum: float, hard: float) -> None:
        self.optimum, self.hard = optimum, hard
        self.asked: list[tuple[float, float, float]] = []

    def __call__(self, low: float, ceiling: float, seconds: float) -> CpResult:
        self.asked.append((low, ceiling, seconds))
        if ceiling < self.hard:
            return CpResult(None, "INFEASIBLE", math.inf, math.inf, 0.0)
        if ceiling < self.optimum:
            return CpResult(None, "UNKNOWN", math.inf, low, seconds)
        return CpResult(FOUND, "FEASIBLE", self.optimum, low, 0.0)


def test_the_bound_rises_to_the_hardest_question_answered_and_a_better_plan_is_kept() -> None:
    ask = Scripted(optimum=10.0, hard=9.95)
    probed = probe(ask, 5.0, 12.0, Deadline(1000.0, clock=Ticks()))
    assert [r.objective_seconds for r in probed.found] == [10.0]  # the plan below the best one given
    assert 9.95 - STEP * 10.0 <= probed.bound_seconds < 9.95  # never more than a refuted ceiling, close to the hardest
    assert all(5.0 <= low < ceiling < 12.0 for low, ceiling, _ in ask.asked)
    assert all(low == max([5.0, *(c for _, c, _ in ask.asked[:i] if c < 9.95)]) for i, (low, _, _) in enumerate(ask.asked))


def test_questions_stop_once_the_bound_is_close_enough() -> None:
    ask = Scripted(optimum=1.0, hard=1.0)  # every ceiling below the best plan is refuted at once
    probed = probe(ask, 0.0, 1.0, Deadline(1000.0, clock=Ticks()))
    assert 1.0 - CLOSE <= probed.bound_seconds < 1.0 and not probed.found
    assert len(ask.asked) == math.ceil(math.log2(1 / CLOSE))  # each answer halves the gap: no question more


def test_questions_stop_at_the_deadline_each_with_at_most_half_the_time_left() -> None:
    ticks = Ticks()
    ask = Scripted(optimum=2.0, hard=0.0)  # every question runs out of time
    probed = probe(ask, 1.0, 2.0, Deadline(8.0, clock=ticks))
    assert probed.bound_seconds == 1.0 and not probed.found
    assert 0 < len(ask.asked) < 8 and all(seconds <= 4.0 for _, _, seconds in ask.asked)


def _chain_problem(n: int, devices: int = 3):  # type: ignore[no-untyped-def]
    graph = load(chain_model(n, {}))
    costs = hand_costs(graph, list(np.random.default_rng(1).uniform(1e7, 1e9, n)))
    return build_problem(graph, costs, make_target([("a", devices, 1e12, 1e9)]), batch=graph.batch * 4, microbatches=4)


def _unproven(floor: float) -> CpResult:
    """A search node by node that ended with no plan and its bound on the floor."""
    return CpResult(None, "UNKNOWN", math.inf, floor, 0.0)


def test_cp_sat_questions_on_a_chain_prove_the_optimum_within_close_and_find_it() -> None:
    problem = _chain_problem(60)
    nodes = coarsen(problem, problem.n)
    optimum = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3))).bottleneck_seconds  # exact on a chain
    worse = baselines(problem, 3)["uniform-nodes"]
    floor = lower_bound(problem, 3).work_seconds  # the fractional one: the chain bound is the optimum itself on a chain
    assert worse.bottleneck_seconds > optimum * (1 + CLOSE) and floor < optimum * (1 - CLOSE)  # both ends have room to move
    result = solve_module._probe_below(problem, nodes, worse, 3, "auto", True, _unproven(floor), floor, Deadline(60.0), lambda _: None)
    assert result.layout is not None
    found = evaluate(problem, to_assignment(problem, nodes, result.layout)).bottleneck_seconds
    assert optimum * (1 - 1e-9) <= found < worse.bottleneck_seconds
    rounding = 1e-9 * (nodes.count + len(nodes.nbytes) + 4)  # CP-SAT prices each term in whole nanoseconds, rounded up
    assert floor <= result.bound_seconds <= optimum + rounding  # holds for every plan ...
    assert found - result.bound_seconds <= CLOSE * found + 1e-9  # ... and closes on the plan found


@settings(max_examples=5, deadline=None)
@given(n=st.integers(4, 5), data=st.data())
def test_cp_sat_questions_never_claim_more_than_brute_force_across_device_groups(n: int, data: st.DataObject) -> None:
    skips = {i: data.draw(st.integers(0, i - 2)) for i in range(2, n) if data.draw(st.booleans())}
    graph = load(chain_model(n, skips, width=data.draw(st.sampled_from([16, 65536]))))
    costs = hand_costs(graph, data.draw(st.lists(st.floats(1e6, 1e9), min_size=n, max_size=n)))
    problem = build_problem(graph, costs, slow_link_target(4e12), batch=graph.batch * 4, microbatches=4)
    expected = brute_force(problem, 3, "never")
    nodes = coarsen(problem, problem.n)
    start = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3, "never", True)))
    floor = lower_bound(problem, 3).seconds
    result = solve_module._probe_below(problem, nodes, start, 3, "never", True, _unproven(floor), floor, Deadline(60.0), lambda _: None)
    best = start.bottleneck_seconds if result.layout is None else evaluate(problem, to_assignment(problem, nodes, result.layout)).bottleneck_seconds
    assert expected * (1 - 1e-9) <= best <= start.bottleneck_seconds * (1 + 1e-9)
    assert floor <= result.bound_seconds <= expected + 1e-9 * (nodes.count + len(nodes.nbytes) + 4)  # whole nanoseconds, rounded up
    assert best - result.bound_seconds <= CLOSE * best + 1e-9
