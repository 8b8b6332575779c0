"""Questions below the best plan (`plan.probe`): the bound they prove is never above the optimum, rises to the
hardest question answered, stops once close enough or at the deadline, and a plan found below the ceiling is kept;
the searches are ended from another thread when told (`Stop`) or once they find no better plan for a while (`Stall`).

The bisection itself is checked against scripted answers on a clock that advances per reading (work done, never
wall-clock time); CP-SAT's answers are checked against the optimum of a chain (the DP's, exact there) and brute force.
"""

from __future__ import annotations

import math
import threading
import time

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
from onnxpipe.plan.cpsat import CpResult, Stall, Stop, solve_cpsat
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.layout import Layout, to_assignment
from onnxpipe.plan.patterns import Patterns, patterns
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
    assert len(ask.asked) == 1  # the first question is asked just within CLOSE below the best plan: no question more


def test_the_first_question_aims_just_below_the_best_plan_then_bisects_below_it_with_the_time_left() -> None:
    ask = Scripted(optimum=10.0, hard=9.0)  # refuted below 9, out of time from 9 up to the optimum
    probed = probe(ask, 5.0, 10.0, Deadline(1000.0, clock=Ticks()))
    (low, aimed, seconds), *bisected = ask.asked
    assert low == 5.0 and 10.0 * (1 - CLOSE) <= aimed < 10.0 and 400.0 < seconds <= 500.0  # half the time left
    assert bisected and all(ceiling < aimed for _, ceiling, _ in bisected)  # given up there: bisection below it
    assert 9.0 - STEP * 10.0 <= probed.bound_seconds < 9.0 and not probed.found


def test_without_aim_every_question_bisects() -> None:
    ask = Scripted(optimum=10.0, hard=9.0)
    probe(ask, 5.0, 10.0, Deadline(1000.0, clock=Ticks()), aim=False)
    assert ask.asked[0][1] == 7.5 and 400.0 < ask.asked[0][2] <= 500.0  # the middle, with half the time left


def test_a_plan_found_beside_the_questions_lowers_them() -> None:
    ask = Scripted(optimum=12.0, hard=8.0)  # the questions find no plan: refuted below 8, out of time above
    found_beside = iter([12.0, 8.0])  # the search beside finds a plan of 8 while the first question is asked
    probed = probe(ask, 5.0, 12.0, Deadline(1000.0, clock=Ticks()), known=lambda: next(found_beside, 8.0))
    assert len(ask.asked) == 2 and ask.asked[1][1] < 8.0  # asked again below that plan, not below the first
    assert 8.0 * (1 - CLOSE) <= probed.bound_seconds < 8.0 and not probed.found


def test_questions_stop_at_the_deadline_each_with_at_most_half_the_time_left() -> None:
    ticks = Ticks()
    ask = Scripted(optimum=2.0, hard=0.0)  # every question runs out of time
    probed = probe(ask, 1.0, 2.0, Deadline(8.0, clock=ticks))
    assert probed.bound_seconds == 1.0 and not probed.found
    assert 0 < len(ask.asked) < 8 and all(seconds <= 4.0 for _, _, seconds in ask.asked)


def test_questions_stop_when_told() -> None:
    ask = Scripted(optimum=2.0, hard=0.0)  # every question runs out of time
    probed = probe(ask, 1.0, 2.0, Deadline(1000.0, clock=Ticks()), stopped=lambda: len(ask.asked) >= 2)
    assert len(ask.asked) == 2 and probed.bound_seconds == 1.0  # the search beside has ended: no third question
    assert not probe(ask, 1.0, 2.0, Deadline(1000.0, clock=Ticks()), stopped=lambda: True).found and len(ask.asked) == 2


def _chain_problem(n: int, devices: int = 3):  # type: ignore[no-untyped-def]
    graph = load(chain_model(n, {}))
    costs = hand_costs(graph, list(np.random.default_rng(1).uniform(1e7, 1e9, n)))
    return build_problem(graph, costs, make_target([("a", devices, 1e12, 1e9)]), batch=graph.batch * 4, microbatches=4)


def _asking(problem, nodes, recompute: str = "auto"):  # type: ignore[no-untyped-def]
    """CP-SAT's answers over single nodes, each with as long as it asks for, as `solve._prove` asks them."""
    return lambda low, ceiling, seconds: solve_cpsat(problem, nodes, 3, recompute=recompute, floor_seconds=low, ceiling_seconds=ceiling,
                                                     time_limit=seconds, refute=True)


def _rounding(nodes) -> float:  # type: ignore[no-untyped-def]
    """CP-SAT prices each term in whole nanoseconds, rounded up (as `solve` allows for)."""
    return 1e-9 * (nodes.count + len(nodes.nbytes) + 4)


def test_cp_sat_questions_on_a_chain_prove_the_optimum_within_close_and_find_it() -> None:
    problem = _chain_problem(60)
    nodes = coarsen(problem, problem.n)
    optimum = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3))).bottleneck_seconds  # exact on a chain
    worse = baselines(problem, 3)["uniform-nodes"]
    floor = lower_bound(problem, 3).work_seconds  # the fractional one: the chain bound is the optimum itself on a chain
    assert worse.bottleneck_seconds > optimum * (1 + CLOSE) and floor < optimum * (1 - CLOSE)  # both ends have room to move
    probed = probe(_asking(problem, nodes), floor, worse.bottleneck_seconds, Deadline(60.0))
    assert probed.found
    found = evaluate(problem, to_assignment(problem, nodes, probed.found[-1].layout)).bottleneck_seconds
    assert optimum * (1 - 1e-9) <= found < worse.bottleneck_seconds
    assert floor <= probed.bound_seconds <= optimum + _rounding(nodes)  # holds for every plan ...
    assert found - probed.bound_seconds <= CLOSE * found + _rounding(nodes)  # ... and closes on the plan found


@pytest.mark.parametrize("by_pattern", [False, True])
@settings(max_examples=5, deadline=None)
@given(n=st.integers(4, 5), data=st.data())
def test_cp_sat_questions_never_claim_more_than_brute_force_across_device_groups(by_pattern: bool, n: int, data: st.DataObject) -> None:
    """Asked over every device group at once, or one pattern of groups at a time (`plan.patterns`, as `solve._prove` asks
    where they are few): then no pattern is refuted where brute force finds one of its plans either."""
    skips = {i: data.draw(st.integers(0, i - 2)) for i in range(2, n) if data.draw(st.booleans())}
    graph = load(chain_model(n, skips, width=data.draw(st.sampled_from([16, 65536]))))
    costs = hand_costs(graph, data.draw(st.lists(st.floats(1e6, 1e9), min_size=n, max_size=n)))
    problem = build_problem(graph, costs, slow_link_target(4e12), batch=graph.batch * 4, microbatches=4)
    expected = brute_force(problem, 3, "never")
    nodes = coarsen(problem, problem.n)
    start = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3, "never", True))).bottleneck_seconds
    floor = lower_bound(problem, 3).seconds
    one = _asking(problem, nodes, "never")
    found = patterns(problem, 3)
    assert found is not None
    each = Patterns(problem, found)

    def ask(low: float, ceiling: float, seconds: float) -> CpResult:
        return each.ask(lambda q, limit: _asking(q, nodes, "never")(low, ceiling, limit), ceiling, Deadline(seconds), lambda: False)

    probed = probe(ask if by_pattern else one, floor, start, Deadline(60.0))
    best = min([start, *(evaluate(problem, to_assignment(problem, nodes, r.layout)).bottleneck_seconds for r in probed.found)])
    assert expected * (1 - 1e-9) <= best <= start
    assert floor <= probed.bound_seconds <= expected + _rounding(nodes)
    assert best - probed.bound_seconds <= CLOSE * best + _rounding(nodes)
    for p, ceiling in each.refuted.items():  # no plan of the pattern within the ceiling it was refuted at
        assert ceiling <= brute_force(each.problems[p], 3, "never") + _rounding(nodes)


def _prove_on_a_chain(monkeypatch, stall: bool):  # type: ignore[no-untyped-def]
    """`_prove` from a uniform split of a 60-node chain, its search down from that plan stalled (no plan, its bound on the
    floor, as on an encoder-decoder) or not; with the chain's optimum and the floor."""
    problem = _chain_problem(60)
    nodes = coarsen(problem, problem.n)
    optimum = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3))).bottleneck_seconds
    worse = baselines(problem, 3)["uniform-nodes"]
    floor = lower_bound(problem, 3).work_seconds
    real_search, real_probe = solve_module.solve_cpsat, solve_module.probe
    searches_down, asked, questions_began = [], threading.Event(), []

    def solve_cpsat_spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs["ceiling_seconds"] == worse.bottleneck_seconds:  # the search down from the plan given
            searches_down.append(kwargs)
            if stall:  # searches, and finds nothing while the questions run (at most its time)
                kwargs["searching"].set()
                asked.wait(kwargs["time_limit"])
                return CpResult(None, "UNKNOWN", math.inf, kwargs["floor_seconds"], 0.0)
        else:  # a question: built only once the search down searches (both build in Python, under one lock)
            questions_began.append(searches_down[0]["searching"].is_set() if searches_down else False)
        return real_search(*args, **kwargs)

    def probe_spy(*args, **kwargs):  # type: ignore[no-untyped-def]
        try:
            return real_probe(*args, **kwargs)
        finally:
            asked.set()

    monkeypatch.setattr(solve_module, "solve_cpsat", solve_cpsat_spy)
    monkeypatch.setattr(solve_module, "probe", probe_spy)
    hint = solve_module._layout_of(problem, worse, nodes, True)
    result = solve_module._prove(problem, nodes, hint, worse, 3, "auto", True, floor, Deadline(60.0), lambda _: None, hold=6.0)
    assert len(searches_down) == 1 and searches_down[0]["hint"] is hint
    assert all(questions_began)
    return problem, nodes, result, optimum, floor


def test_prove_proves_the_optimum_by_its_search_down(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    problem, nodes, result, optimum, _ = _prove_on_a_chain(monkeypatch, stall=False)
    assert result.status == "OPTIMAL" and result.layout is not None
    assert evaluate(problem, to_assignment(problem, nodes, result.layout)).bottleneck_seconds == pytest.approx(optimum, rel=1e-9)
    assert optimum - _rounding(nodes) <= result.bound_seconds <= optimum + _rounding(nodes)


def test_prove_takes_the_bound_and_plan_of_the_questions_where_the_search_down_stalls(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    problem, nodes, result, optimum, floor = _prove_on_a_chain(monkeypatch, stall=True)
    assert result.layout is not None and result.status in ("OPTIMAL", "FEASIBLE")
    found = evaluate(problem, to_assignment(problem, nodes, result.layout)).bottleneck_seconds
    assert optimum * (1 - 1e-9) <= found <= optimum * (1 + CLOSE)
    assert floor < optimum * (1 - CLOSE) <= result.bound_seconds <= optimum + _rounding(nodes)


class _Solver:
    """Stands in for a running CP-SAT solver: remembers being told to stop."""

    def __init__(self) -> None:
        self.told = 0

    def stop_search(self) -> None:
        self.told += 1


def test_prove_ends_the_search_down_once_the_questions_have_proven_its_plan_close_enough(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    problem = _chain_problem(60)
    nodes = coarsen(problem, problem.n)
    least = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3)))  # the optimum: exact on a chain
    optimum, floor = least.bottleneck_seconds, lower_bound(problem, 3).work_seconds
    hint = solve_module._layout_of(problem, least, nodes, True)
    real_search, running = solve_module.solve_cpsat, _Solver()

    def search_down_that_never_ends(*args, **kwargs):  # type: ignore[no-untyped-def]
        if kwargs.get("refute"):
            return real_search(*args, **kwargs)
        kwargs["progress"](optimum, floor)  # it finds the optimal plan at once, then searches on without proving it
        assert kwargs["stop"].enter(running)
        kwargs["searching"].set()
        while not running.told and time.monotonic() < give_up:  # a real search would run to its time limit
            time.sleep(0.01)
        kwargs["stop"].leave(running)
        return CpResult(hint, "FEASIBLE", optimum, floor, 0.0)

    monkeypatch.setattr(solve_module, "solve_cpsat", search_down_that_never_ends)
    give_up = time.monotonic() + 60.0
    result = solve_module._prove(problem, nodes, hint, least, 3, "auto", True, floor, Deadline(20.0), lambda _: None, hold=2.0)
    assert running.told  # told to stop by the questions, not left to run out its time
    assert result.layout is not None and optimum * (1 - CLOSE) <= result.bound_seconds <= optimum + _rounding(nodes)


def test_prove_asks_no_question_with_less_time_than_a_question_took_to_build(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Near the end of the time a question whose share is shorter than building a question's model took could not search:
    it is not asked (each such model once took 0.1-0.3 s past the limit). Each question here takes 0.2 s to build and
    finds nothing; the search down finds nothing either, to the end of its time."""
    problem = _chain_problem(60)
    nodes = coarsen(problem, problem.n)
    least = baselines(problem, 3)["uniform-nodes"]
    hint = solve_module._layout_of(problem, least, nodes, True)
    asked: list[tuple[float, float]] = []  # each question's time limit, and how long it took

    def solve_cpsat_fake(*args, **kwargs):  # type: ignore[no-untyped-def]
        if not kwargs.get("refute"):  # the search down: runs out its time
            kwargs["searching"].set()
            time.sleep(kwargs["time_limit"])
            return CpResult(None, "UNKNOWN", math.inf, kwargs["floor_seconds"], 0.0)
        begun = time.perf_counter()
        time.sleep(0.2)  # building its model
        asked.append((kwargs["time_limit"], time.perf_counter() - begun))
        return CpResult(None, "UNKNOWN", math.inf, kwargs["floor_seconds"], 0.0)

    monkeypatch.setattr(solve_module, "solve_cpsat", solve_cpsat_fake)
    floor = least.bottleneck_seconds / 2  # far below: the bisection alone would go on for several questions
    solve_module._prove(problem, nodes, hint, least, 3, "auto", True, floor, Deadline(1.0), lambda _: None, hold=0.1)
    assert len(asked) >= 2
    took = [t for _, t in asked]
    assert all(limit >= max(took[:i]) for i, (limit, _) in enumerate(asked) if i)


def test_interrupt_ends_the_searches_running_only() -> None:
    stop, running = Stop(), _Solver()
    assert stop.enter(running)
    stop.interrupt()
    later = _Solver()
    assert running.told == 1 and stop.enter(later) and later.told == 0


def test_stop_ends_the_searches_running_and_keeps_later_ones_from_starting() -> None:
    stop, running, done = Stop(), _Solver(), _Solver()
    assert stop.enter(running) and stop.enter(done)
    stop.leave(done)
    stop.stop()
    assert (running.told, done.told) == (1, 0)
    assert not stop.enter(_Solver())


def test_a_moot_search_does_not_start_and_starts_again_once_it_is_not() -> None:
    answered = [True]
    stop = Stop(moot=lambda: answered[0])
    assert not stop.enter(_Solver())
    answered[0] = False
    running = _Solver()
    assert stop.enter(running) and not stop.stopped
    stop.interrupt()
    assert running.told == 1


def test_a_cp_sat_question_ends_at_the_first_plan_within_its_ceiling() -> None:
    """`refute`: any plan within the ceiling answers the question (no search on for better ones): the first plan found
    is the answer, where minimising from it finds the optimum."""
    graph = load(chain_model(12, {3: 1, 7: 5}))
    problem = build_problem(graph, hand_costs(graph, [float(f) for f in range(1, 13)]), make_target([("a", 4, 1e12, 1e9)]),
                            batch=graph.batch * 4, microbatches=4)
    nodes = coarsen(problem, problem.n)
    optimum = solve_cpsat(problem, nodes, 4, recompute="never", time_limit=20)
    assert optimum.status == "OPTIMAL"
    # Every plan's bottleneck is within a ceiling this high: the first one found answers, far above the optimum.
    answer = solve_cpsat(problem, nodes, 4, recompute="never", ceiling_seconds=1e3, time_limit=20, workers=1, refute=True)
    assert answer.status == "FEASIBLE" and answer.layout is not None and answer.objective_seconds > optimum.objective_seconds


def test_stall_ends_a_search_once_it_finds_no_better_plan() -> None:
    stall, running = Stall(0.05), _Solver()
    assert stall.stop.enter(running)
    stall.found(2.0, 1.0)
    stall.found(1.5, 1.0)  # a better plan: the wait starts again
    give_up = time.monotonic() + 60.0
    while not running.told and time.monotonic() < give_up:
        time.sleep(0.01)
    assert running.told == 1 and stall.stop.stopped


def test_stall_never_ends_a_search_before_its_first_plan_nor_once_closed() -> None:
    waiting, running = Stall(0.05), _Solver()
    closed, done = Stall(1.0), _Solver()
    assert waiting.stop.enter(running) and closed.stop.enter(done)
    closed.found(2.0, 1.0)
    closed.close()  # the search ended: its wait is called off
    time.sleep(1.5)
    assert (running.told, done.told) == (0, 0) and not waiting.stop.stopped and not closed.stop.stopped


def test_a_cp_sat_search_whose_time_went_on_building_its_model_does_not_start() -> None:
    """The time limit covers building the model: with none left, no search (which once ran 0.05 s more, past the limit)."""
    graph = load(chain_model(12, {}))
    problem = build_problem(graph, hand_costs(graph, [float(f) for f in range(1, 13)]), make_target([("a", 4, 1e12, 1e9)]),
                            batch=graph.batch * 4, microbatches=4)
    nodes = coarsen(problem, problem.n)
    assert solve_cpsat(problem, nodes, 4, recompute="never", time_limit=20).status == "OPTIMAL"
    out_of_time = solve_cpsat(problem, nodes, 4, recompute="never", floor_seconds=1.0, time_limit=0.0)
    assert (out_of_time.status, out_of_time.layout, out_of_time.bound_seconds) == ("UNKNOWN", None, 1.0)
