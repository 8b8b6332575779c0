"""Questions asked one pattern of device groups at a time (`plan.patterns`): the patterns are every sequence of groups
within the device counts (none where there is nothing to choose, or too many); below a ceiling, only those whose chain
walk reaches the end within it (`reachable`), never leaving out the pattern of a plan within it (brute force per
pattern); a pattern refuted at a ceiling is not asked again below it, one not reachable there is refuted unasked, a plan
found answers at once, the time left is shared evenly. CP-SAT told the reachable patterns finds the optimum still, and
over none finds nothing. CP-SAT's answers by pattern are checked against brute force with the other questions'
(tests/test_plan_probe.py).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from test_plan import brute_force, chain_model, hand_costs, make_target, slow_link_target

from onnxpipe.graph import load
from onnxpipe.plan import build_problem
from onnxpipe.plan.chainbound import chain_bound
from onnxpipe.plan.coarsen import coarsen
from onnxpipe.plan.cpsat import CpResult, held_ceiling_ns, solve_cpsat
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.layout import Layout
from onnxpipe.plan.patterns import MOST, Patterns, patterns, reachable
from onnxpipe.pricing.problem import Problem

FOUND = Layout(block_stage=np.zeros(1, dtype=np.int64), groups=(0,), replicas=(1,), recompute=(False,))


def _problem(target, n: int = 4, skips: dict[int, int] | None = None) -> Problem:  # type: ignore[no-untyped-def]
    graph = load(chain_model(n, skips or {}))
    costs = hand_costs(graph, list(np.random.default_rng(2).uniform(1e7, 1e9, n)))
    return build_problem(graph, costs, target, batch=graph.batch * 4, microbatches=4)


def test_the_patterns_are_every_sequence_of_groups_within_the_device_counts() -> None:
    problem = _problem(slow_link_target(4e12))  # group 0: two devices, group 1: one
    assert patterns(problem, 3) == [(0, 0, 1), (0, 1, 0), (1, 0, 0)]
    assert patterns(problem, 2) == [(0, 0), (0, 1), (1, 0)]
    # Nothing to choose: one device type, or each stage's group already fixed; too many to ask one at a time.
    assert patterns(_problem(make_target([("a", 4, 1e12, 1e9)])), 3) is None
    assert patterns(dataclasses.replace(problem, stage_groups=(0, 1, 0)), 3) is None
    three = _problem(make_target([("a", 3, 1e12, 1e9), ("b", 3, 2e12, 1e9), ("c", 3, 4e12, 1e9)]))
    assert len(patterns(three, 2) or []) == 9 and 3**3 > MOST and patterns(three, 3) is None
    # Twelve types of one device each: 12! patterns, found too many at once (not after 12**12 sequences); none at 13 stages.
    singles = _problem(make_target([(f"t{i}", 1, 1e12, 1e9) for i in range(12)]))
    assert patterns(singles, 12) is None and patterns(singles, 13) is None and patterns(problem, 4) is None
    # Below a ceiling, at 8 stages over 4 + 4 devices (70 patterns, more than MOST) only those whose walk reaches it: none
    # below the chain bound, one just above it, all far above; over 32 + 32 devices the walks take a step per replica
    # count, too many to follow: None (none left out).
    narrow = _problem(make_target([("a", 4, 1e12, 1e9), ("b", 4, 2e12, 1e9)]), 10)
    bound = chain_bound(narrow, 8)
    assert patterns(narrow, 8) is None and len(reachable(narrow, 8) or []) == 70
    assert reachable(narrow, 8, bound * 0.999) == [] and len(reachable(narrow, 8, bound * 1.001) or []) == 1
    assert patterns(narrow, 8, bound * 1.2) == reachable(narrow, 8, bound * 1.2) and len(reachable(narrow, 8, 2 * bound) or []) == 70
    wide = _problem(make_target([("a", 32, 1e12, 1e9), ("b", 32, 2e12, 1e9)]), 10)
    assert reachable(wide, 8, bound / 10) is None


@settings(max_examples=8, deadline=None)
@given(n=st.integers(4, 5), data=st.data())
def test_no_pattern_with_a_plan_within_a_ceiling_is_left_out(n: int, data: st.DataObject) -> None:
    """Each pattern is reachable at its own least bottleneck (brute force over its plans; within float rounding, 1e-9 of
    it): a pattern left out at a ceiling has no plan within it."""
    skips = {i: data.draw(st.integers(0, i - 2)) for i in range(2, n) if data.draw(st.booleans())}
    graph = load(chain_model(n, skips, width=data.draw(st.sampled_from([16, 65536]))))
    costs = hand_costs(graph, data.draw(st.lists(st.floats(1e6, 1e9), min_size=n, max_size=n)))
    problem = build_problem(graph, costs, slow_link_target(data.draw(st.sampled_from([2.5e11, 4e12]))), batch=graph.batch * 4, microbatches=4)
    every = patterns(problem, 3)
    assert every is not None and len(every) == 3
    least = {p: brute_force(dataclasses.replace(problem, stage_groups=p), 3, "never") for p in every}
    for p, value in least.items():
        assert p in (reachable(problem, 3, value * (1 + 1e-9)) or [])


def test_below_a_ceiling_only_the_patterns_that_reach_it_are_asked_and_cp_sat_keeps_to_them() -> None:
    """On a slow single device of group b, at the optimum only the optimal pattern is reachable (brute force: the others
    take 1.58 and 1.60 times longer); CP-SAT told those patterns finds the optimum; told none, nothing; told the others,
    their own optimum. Three types of three devices, 27 patterns, too many to ask one at a time: below a known plan's
    bottleneck few enough are reachable to ask one at a time (5), the plan's own among them."""
    problem = _problem(slow_link_target(4e12), 5, {3: 1})
    least = {p: brute_force(dataclasses.replace(problem, stage_groups=p), 3, "never") for p in patterns(problem, 3) or []}
    best = min(least, key=least.__getitem__)
    assert best == (0, 0, 1) and min(v for p, v in least.items() if p != best) > 1.5 * least[best]
    nodes = coarsen(problem, problem.n)
    held = held_ceiling_ns(least[best], nodes) / 1e9
    assert reachable(problem, 3, held) == [best]

    def cp(told: list[tuple[int, ...]], ceiling: float = 2 * least[best]) -> CpResult:
        return solve_cpsat(problem, nodes, 3, recompute="never", ceiling_seconds=ceiling, time_limit=20.0, patterns=told)

    found = cp([best])
    assert found.status == "OPTIMAL" and found.layout is not None and found.layout.groups == best
    assert least[best] <= found.objective_seconds <= held
    assert cp([]).status == "INFEASIBLE"
    others = [p for p in least if p != best]
    other = cp(others, 2 * max(least.values()))
    assert other.layout is not None and other.layout.groups in others
    assert min(least[p] for p in others) <= other.objective_seconds <= held_ceiling_ns(min(least[p] for p in others), nodes) / 1e9
    three = _problem(make_target([("a", 3, 1e12, 1e9), ("b", 3, 2e12, 1e9), ("c", 3, 4e12, 1e9)]), 8)
    assert patterns(three, 3) is None  # 27
    nodes = coarsen(three, three.n)
    plan = solve_cpsat(three, nodes, 3, recompute="never", time_limit=20.0)
    assert plan.layout is not None
    few = patterns(three, 3, held_ceiling_ns(plan.objective_seconds, nodes) / 1e9)
    assert few is not None and plan.layout.groups in few and len(few) <= MOST


class Clock:
    """Seconds that pass only as the scripted answers spend them."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Scripted:
    """Per pattern: refutes every ceiling below `hard` at once, finds a plan of bottleneck `optimum` at once at or above
    it, and in between runs out of its time having proven `proven`; records what it is asked."""

    def __init__(self, answers: dict[tuple[int, ...], tuple[float, float, float]]) -> None:
        self.answers = answers
        self.asked: list[tuple[tuple[int, ...], float]] = []
        self.clock = Clock()
        self.ceiling = math.inf

    def __call__(self, problem: Problem, seconds: float) -> CpResult:
        self.asked.append((problem.stage_groups, seconds))
        hard, proven, optimum = self.answers[problem.stage_groups]
        if self.ceiling < hard:
            return CpResult(None, "INFEASIBLE", math.inf, math.inf, 0.0)
        if self.ceiling < optimum:
            self.clock.now += seconds
            return CpResult(None, "UNKNOWN", math.inf, proven, seconds)
        return CpResult(FOUND, "OPTIMAL", optimum, proven, 0.0)  # optimal for its pattern

    def question(self, by_pattern: Patterns, ceiling: float, seconds: float, stopped: bool = False) -> CpResult:
        self.ceiling = ceiling
        self.asked.clear()
        return by_pattern.ask(self, ceiling, Deadline(seconds, self.clock), lambda: stopped)


def test_a_refuted_pattern_is_not_asked_again_below_and_a_plan_found_answers_at_once() -> None:
    problem = _problem(slow_link_target(4e12))
    by_pattern = Patterns(problem, [(0, 0, 1), (0, 1, 0), (1, 0, 0)], preferred=(0, 0, 1))
    one = Scripted({(0, 1, 0): (math.inf, 0.0, math.inf), (1, 0, 0): (7.0, 7.5, 11.0), (0, 0, 1): (8.0, 8.5, 9.0)})
    answer = one.question(by_pattern, 8.8, 4.0)
    # The best plan's pattern last; each an even share of the time left: the first refuted at once leaves its share.
    assert one.asked == [((0, 1, 0), 4.0 / 3), ((1, 0, 0), 2.0), ((0, 0, 1), 2.0)]
    assert answer.status == "UNKNOWN" and answer.layout is None and answer.bound_seconds == 7.5  # the least of the open ones
    assert one.question(by_pattern, 6.0, 2.0).status == "INFEASIBLE"
    assert [p for p, _ in one.asked] == [(1, 0, 0), (0, 0, 1)]  # (0, 1, 0) refuted above 6.0: not asked again
    found = one.question(by_pattern, 9.5, 3.0)
    assert found.layout is FOUND and found.objective_seconds == 9.0
    # Optimal for its pattern alone: the bound is the least any pattern has ((1, 0, 0)'s 7.5, not the plan's pattern's 8.5).
    assert found.status == "FEASIBLE" and found.bound_seconds == 7.5
    assert [p for p, _ in one.asked] == [(0, 1, 0), (1, 0, 0), (0, 0, 1)]  # refuted below 9.5 only: asked again
    # The others refuted within its ceiling, a plan optimal for its pattern is optimal.
    alone = Scripted({(0, 1): (math.inf, 0.0, math.inf), (1, 0): (8.0, 9.0, 9.0)})
    answer = alone.question(Patterns(problem, [(0, 1), (1, 0)]), 9.5, 3.0)
    assert (answer.status, answer.objective_seconds, answer.bound_seconds) == ("OPTIMAL", 9.0, 9.0)
    told = one.question(by_pattern, 9.5, 3.0, stopped=True)
    assert told.status == "UNKNOWN" and told.bound_seconds == 7.5 and not one.asked  # told to stop: none asked
    # Not reachable within the ceiling: refuted there unasked.
    one.ceiling = 9.5
    one.asked.clear()
    answer = by_pattern.ask(one, 9.5, Deadline(3.0, one.clock), lambda: False, reach=[(0, 0, 1)])
    assert [p for p, _ in one.asked] == [(0, 0, 1)] and by_pattern.refuted[(0, 1, 0)] == by_pattern.refuted[(1, 0, 0)] == 9.5
    # The bound is now (0, 0, 1)'s own (8.5), not (1, 0, 0)'s 7.5: the others have no plan within 9.5.
    assert answer.layout is FOUND and answer.objective_seconds == 9.0 and answer.bound_seconds == 8.5
