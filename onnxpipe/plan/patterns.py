"""Questions below the best plan on several device types, asked one pattern at a time: a pattern fixes each stage's
device group (`Problem.stage_groups`), and no plan is within a ceiling once no pattern's is.

Why: with every stage's group fixed, each stage's time is one linear constraint, no longer one per choice of type,
each enforced by its own literal; CP-SAT's LP then adds them up as on one device type (`cpsat.solve_cpsat`, `refute`)
and refutes what a question over every type leaves open. Measured node by node on BART-base's export training at 4
heterogeneous stages (6 patterns): "no plan within 0.475% of the best" for each pattern in 0.7-3 s, 13.6 s in all,
where bisecting over every type in 30 s left a 5.6% gap; without the LP four of the six ran out of 5 s each. A
pattern refuted at a ceiling stays refuted below it: later, lower questions skip it. Worth it only where the patterns
are few: at 8 stages over 4 + 4 devices (70 patterns) 3 of the first 38 of BART-base's were refuted within 10 s each,
and the search down proves the other exports there in seconds.

Below a ceiling only the patterns whose chain walk reaches the end within it count (`reachable`,
`chainbound.ending_prefixes`): the chain bound holds for each pattern's plans apart, and most patterns' are far above
the best one's. So the questions and the search down are told those (CP-SAT's `patterns`: its stages' groups follow
one of them, and each block's stages are narrowed to what they leave, `cpsat._windows`), a pattern that does not reach
a question's ceiling is refuted without a search, and a question is asked pattern by pattern where those are few.
ViT-B/16's export at 8 heterogeneous stages: 15 of the 70 reach its best plan's bottleneck, 5 a question 1.3% below.
Measured side by side (one planning process at a time, after and before in turn, the same plans and verdicts): ViT-B/16
2.2-2.3 s of solving instead of 3.4-3.7, Swin-T 3.0-3.1 instead of 5.0-6.4, BERT-base 5.3 instead of 5.8-6.9 at 8
heterogeneous stages; GPT-2's and LLaMA's (28 and 63 patterns reach theirs) within the runs' spread (4.0-4.9 s against
3.8-4.7, 6.6-8.7 against 7.1-7.9); T5-small's at 4 heterogeneous stages 13.4-14.4 s instead of 19.6-19.7, BART-base's
within the spread.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Collection, Iterator

from onnxpipe.plan.chainbound import ending_prefixes
from onnxpipe.plan.cpsat import CpResult
from onnxpipe.plan.deadline import Deadline
from onnxpipe.pricing.problem import Problem

__all__ = ["Patterns", "patterns", "reachable", "sequences", "MOST"]

#: The most patterns asked one at a time; more, and each question is asked over every type at once.
MOST = 20
#: The most patterns `reachable` lists; more, and CP-SAT is told none (its table of patterns would outgrow its use).
MANY = 4096


def patterns(problem: Problem, stages: int, ceiling: float = math.inf, replicas: bool = True) -> list[tuple[int, ...]] | None:
    """Every pattern of `stages` stages within the device counts that a plan of bottleneck within `ceiling` may have
    (`reachable`), where several device types leave each stage's group open and they are at most `MOST`; else None."""
    return reachable(problem, stages, ceiling, replicas, MOST)


def reachable(problem: Problem, stages: int, ceiling: float = math.inf, replicas: bool = True, most: int = MANY) -> list[tuple[int, ...]] | None:
    """The patterns of `stages` stages within the device counts whose chain walk reaches the end within `ceiling`
    (`chainbound.ending_prefixes`; every pattern where it is infinite): no plan of another pattern has a bottleneck within
    it. None where one device type or fixed groups leave no pattern to choose, the walks are too many to follow, or the
    patterns are more than `most`."""
    counts = tuple(len(d) for d in problem.group_devices)
    if len(counts) == 1 or problem.stage_groups or sum(counts) < stages:
        return None
    if not math.isfinite(ceiling):
        found = list(itertools.islice(sequences(counts, stages), most + 1))  # no further than one too many
        return found if len(found) <= most else None
    ends = ending_prefixes(problem, stages, ceiling, replicas)
    if ends is None:
        return None
    reached: set[tuple[int, ...]] = set()
    for prefix in ends:
        left = tuple(c - prefix.count(g) for g, c in enumerate(counts))
        reached.update(prefix + rest for rest in itertools.islice(sequences(left, stages - len(prefix)), most + 1))
        if len(reached) > most:
            return None
    return sorted(reached)


def sequences(counts: tuple[int, ...], used: int) -> Iterator[tuple[int, ...]]:
    """Every sequence of `used` groups with at most counts[g] of group g (sum(counts) >= used), in lexicographic order,
    lazily: there can be very many, and a target thousands of devices long (so a loop, not recursion). Every prefix
    completes, as the groups' devices left always cover the indices left."""
    left, sequence, start = list(counts), [], 0
    while True:
        if len(sequence) == used:
            yield tuple(sequence)
            start = len(counts)  # nothing more at this length: back up
        g = next((h for h in range(start, len(counts)) if left[h]), None) if len(sequence) < used else None
        if g is not None:
            sequence.append(g)
            left[g] -= 1
            start = 0
            continue
        if not sequence:
            return
        last = sequence.pop()
        left[last] += 1
        start = last + 1


class Patterns:
    """The patterns of one configuration, each with the highest ceiling it has been refuted at (no plan of it is within
    that) and the bound CP-SAT proved for it under a ceiling it did not settle."""

    def __init__(self, problem: Problem, found: list[tuple[int, ...]], preferred: tuple[int, ...] = ()) -> None:
        # The best plan's own pattern last: a plan near the ceiling likely has it, so it is the slowest to refute.
        ordered = sorted(found, key=lambda p: p == preferred)
        self.problems = {p: dataclasses.replace(problem, stage_groups=p) for p in ordered}
        self.refuted = {p: 0.0 for p in ordered}
        self.proven = {p: 0.0 for p in ordered}

    def ask(self, one: Callable[[Problem, float], CpResult], ceiling: float, until: Deadline, stopped: Callable[[], bool],
            reach: Collection[tuple[int, ...]] | None = None) -> CpResult:
        """Whether any plan is within `ceiling`: `one(problem, seconds)` asks it of one pattern's problem. Each pattern not
        yet refuted there gets an even share of the time left (`until`); the first plan found answers, OPTIMAL only where
        no pattern's bound is below it (CP-SAT's verdict and bound for one pattern hold for that pattern's plans alone).
        INFEASIBLE once every pattern is refuted; else UNKNOWN with the least bound any pattern has. `reach`: the patterns
        whose chain walk reaches the ceiling (`reachable`); the others are refuted there unasked."""
        started = until.clock()
        for p in self.refuted if reach is not None else ():
            if p not in reach:  # its walk does not fit within the ceiling (`reachable`): refuted without a search
                self.refuted[p] = max(self.refuted[p], ceiling)
        open_ = [p for p, at in self.refuted.items() if at < ceiling]
        for i, p in enumerate(open_):
            if stopped():
                break
            answer = one(self.problems[p], until.share_of_rest(len(open_) - i).remaining())
            if answer.status == "INFEASIBLE":
                self.refuted[p] = ceiling
            elif answer.bound_seconds <= ceiling:  # CP-SAT's bound under the ceiling: none of this pattern below it
                self.proven[p] = max(self.proven[p], answer.bound_seconds)
            if answer.layout is not None:
                bound = self._bound(ceiling)
                status = "OPTIMAL" if bound >= answer.objective_seconds else "FEASIBLE"
                return CpResult(answer.layout, status, answer.objective_seconds, bound, until.clock() - started)
        if all(at >= ceiling for at in self.refuted.values()):
            return CpResult(None, "INFEASIBLE", math.inf, math.inf, until.clock() - started)
        return CpResult(None, "UNKNOWN", math.inf, self._bound(ceiling), until.clock() - started)

    def _bound(self, ceiling: float) -> float:
        """No plan is below it, nor within `ceiling` where every pattern is refuted there."""
        return min(ceiling if at >= ceiling else max(at, self.proven[p]) for p, at in self.refuted.items())
