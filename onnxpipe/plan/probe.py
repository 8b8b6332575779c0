"""Raising the proven bound where CP-SAT's search down from the best plan leaves it on the floor: ask, for a
bottleneck T below the best plan's, whether any plan has one of at most T (CP-SAT with T as its ceiling).

Why: CP-SAT refutes such a question far sooner than it closes the search from above, since the lower ceiling
narrows every block's stage window (`cpsat._windows`) and caps every time variable before it branches, and on one
device type its LP adds up the stage times (`cpsat.solve_cpsat`, `refute`). Measured node by node on BART-base's and
T5-small's exports (616 and 683 nodes, 2 and 4 stages on gpu4 and fpga4): the search from the best plan ends 9 s later
with its bound still the first-principles one, while "no plan within 0.995 of the best" is shown in 0.2-2.5 s.
An INFEASIBLE answer at T is a bound that holds for every plan; a plan found at or below T is a better plan.

The first question for each best plan asks just within `CLOSE` below it: refuted, the bound is close enough in one
question. Otherwise bisection between the bound and the best plan. Each question may take half the time left, so one
that runs out leaves time to ask a lower one. (With a quarter for the aimed one, on a 2-core machine half the speed of
the one that share was measured on, BART-base's export at 4 stages on gpu4 and T5-small's on fpga4 ran out of it and
ended 0.60% and 0.58% above their bounds in 10.5 s; with half, 0.47% in 8.1 s and 0.23% in 6.0 s; eleven other rows of
one device type the same.) It stops once the bound is within `CLOSE` of the best plan, when the questions left could
raise it by less than `STEP` of it, or when told to
(`plan.solve._prove` asks beside a search down from the best plan, on a core of its own, hands on the plans that
search finds, and stops the questions once it ends).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from onnxpipe.plan.cpsat import CpResult
from onnxpipe.plan.deadline import Deadline

__all__ = ["Probed", "probe", "close", "CLOSE"]

#: Close enough: the bound within this share of the best plan's bottleneck (the goal the planner is held to;
#: the cost model's own error is several times larger).
CLOSE = 0.005
#: The first question of each best plan asks within this share of CLOSE below it (a margin under CLOSE itself).
_AIM = 0.95
#: The least rise, as a share of the best plan's bottleneck, worth another question.
STEP = 0.001


@dataclass(frozen=True)
class Probed:
    #: No plan has a bottleneck below this (seconds per micro-batch).
    bound_seconds: float
    #: The answers that found a plan at or below their ceiling, each better than the one before.
    found: tuple[CpResult, ...]


def close(best: float, bound: float) -> bool:
    """The bound is within `CLOSE` of the best plan's bottleneck."""
    return best - bound <= CLOSE * best


def probe(ask: Callable[[float, float, float], CpResult], bound: float, best: float, deadline: Deadline,
          report: Callable[[str], None] = lambda _: None, stopped: Callable[[], bool] = lambda: False,
          known: Callable[[], float] = lambda: math.inf, aim: bool = True) -> Probed:
    """`ask(floor, ceiling, seconds)`: CP-SAT over single nodes with those floor, ceiling and time limit.
    `bound`: a bound valid for every plan; `best`: the best plan's bottleneck; `stopped`: True once the questions
    are no longer wanted (the search beside them has ended); `known`: the least bottleneck found elsewhere so far (that
    search's plans), read before each question; `aim`: the first question for each best plan asks just within CLOSE
    below it (else each bisects). A bound read off an answer that found a plan is
    CP-SAT's, in its whole nanoseconds (each term rounded up), as `solve` reads it."""
    found: list[CpResult] = []
    top = best  # the least ceiling not yet refuted nor given up on
    while True:
        best = min(best, known())
        top = min(top, best)
        if deadline.passed() or stopped() or close(best, bound) or top - bound <= STEP * best:
            break
        target = best * (1 - _AIM * CLOSE)  # refuted there, the bound is close enough: one question
        aimed = aim and top > target > bound
        ceiling = target if aimed else (bound + top) / 2
        answer = ask(bound, ceiling, deadline.remaining() / 2)
        if answer.status == "INFEASIBLE":
            bound = ceiling
            report(f"CP-SAT node by node: no plan has a bottleneck of {ceiling * 1e3:.3f} ms or less")
            continue
        if answer.bound_seconds <= ceiling:  # CP-SAT's own bound under this ceiling: no plan below it but above the ceiling
            bound = max(bound, answer.bound_seconds)
        if answer.layout is None:
            top = ceiling
            continue
        found.append(answer)
        best = top = answer.objective_seconds
        report(f"CP-SAT node by node: a plan with a bottleneck of {best * 1e3:.3f} ms")
    return Probed(bound, tuple(found))
