"""First-principles lower bounds: no plan on this target can beat them, whatever the partition.

The work LP and the largest node ignore that a stage is contiguous and runs on one device group; the
chain bound (`onnxpipe.plan.chainbound`) adds both, with the all-reduce of replicated stages. The message bound counts
the latencies that stages sharing a connected part of the graph pay, which the chain bound's walk may skip by leaving
stages empty."""

from __future__ import annotations

import itertools
import weakref
from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from onnxpipe.plan.chainbound import chain_bound, fits_in_memory
from onnxpipe.plan.deadline import Deadline
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.stage import state_bytes

__all__ = ["LowerBound", "lower_bound", "Bounds", "message_bound"]

#: Share of the planning budget one stage count's chain bound may bisect for (it stops there with a weaker, still valid
#: bound; building the chain, once per problem, comes before): exploring prices up to a few dozen stage counts.
_CHAIN_SHARE = 0.03


@dataclass(frozen=True)
class LowerBound:
    """Bounds on the bottleneck seconds per micro-batch, and on memory."""

    #: All forward + backward work spread perfectly over the devices a plan can use (fractional LP).
    work_seconds: float
    #: The heaviest node on its fastest device, split over as many replicas as a stage can get.
    node_seconds: float
    #: Contiguous stages on one device group each, over the chain of clean gaps (`chain_bound`).
    chain_seconds: float
    #: Least bytes some device must hold in any plan: the largest node's parameters, gradients,
    #: optimizer state and one micro-batch of its activations, or all parameter state spread evenly.
    memory_bytes: float
    #: The largest device memory of the target.
    capacity_bytes: float
    #: Some walk over the chain of clean gaps holds each stage's parameter state and one micro-batch of its activations
    #: in its device's memory (`chainbound.fits_in_memory`); when none does, no plan fits.
    chain_fits: bool = True
    #: The latencies some stage pays (`message_bound`): where every device holds a sliver of the work, they are the bottleneck.
    message_seconds: float = 0.0

    @property
    def seconds(self) -> float:
        return max(self.work_seconds, self.node_seconds, self.chain_seconds, self.message_seconds)

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes and self.chain_fits


#: Per problem, the bounds found without a deadline (`Bounds`): plain numbers, so an entry never keeps its problem alive.
_UNTIMED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class Bounds:
    """The lower bounds of one problem by stage count, each found once: solving and exploring price many
    plans of one problem, every priced plan carries its bound, and the chain bound's DP is the costly part.
    Under a `deadline`, each stage count's chain bound bisects for at most `_CHAIN_SHARE` of the budget. Without one,
    each bound is the full bisection, whoever asks: every `Bounds` of a problem without a deadline shares them (kept per
    problem, as its chain is), since `evaluate` given none, the baselines and `compare` each made their own, and a brute
    force over 40 small graphs' every assignment spent 85 of its 91 s bisecting the same bounds again."""

    def __init__(self, problem: Problem, deadline: Deadline | None = None) -> None:
        self.problem = problem
        self.deadline = deadline
        self._found: dict[tuple[int, bool], LowerBound] = _UNTIMED.setdefault(problem, {}) if deadline is None else {}

    def __call__(self, stages: int, replicas: bool = True) -> LowerBound:
        if (stages, replicas) not in self._found:
            self._found[stages, replicas] = lower_bound(self.problem, stages, replicas, self.deadline, _CHAIN_SHARE)
        return self._found[stages, replicas]


def lower_bound(problem: Problem, stages: int, replicas: bool = True, deadline: Deadline | None = None, share: float = 1.0) -> LowerBound:
    """Bounds for plans of `stages` stages (replicated stages may use every device when `replicas`); the chain
    bound stops at `deadline`, or once it has bisected for `share` of its budget, with the best bound it has proven."""
    work = problem.forward + problem.backward
    counts = np.array([len(d) for d in problem.group_devices])
    usable = problem.device_count if replicas else stages
    most_replicas = np.minimum(counts, max(1, problem.device_count - stages + 1)) if replicas else np.ones_like(counts)
    node = float(np.max(np.min(work / most_replicas[:, None], axis=0)))
    state = state_bytes(problem.params, problem.trained, problem.optimizer_states, problem.training)
    spread = float(state.sum()) / usable
    per_node = float(np.max(state + problem.activations / np.max(most_replicas)))
    chain = chain_bound(problem, stages, replicas, deadline, share)
    return LowerBound(
        work_seconds=_work_bound(work, counts, usable),
        node_seconds=node,
        chain_seconds=chain,
        memory_bytes=max(per_node, spread),
        capacity_bytes=float(np.max(problem.capacity)),
        chain_fits=chain > 0 or fits_in_memory(problem, stages, replicas),  # 0: no walk fits, or its deadline passed first
        message_seconds=message_bound(problem, stages),
    )


def message_bound(problem: Problem, stages: int) -> float:
    """Latencies some stage of every plan pays. A plan's stages each hold a node, so with more stages than the compute
    nodes have connected parts (`Problem.parts`), two stages hold nodes of one part and some tensor crosses between
    them; with more than twice as many, some part's nodes lie in three stages or more, and among stages joined by
    crossing tensors one is then joined to two others. Each crossing tensor costs both its ends a message, and each
    message at least `Problem.least_latency` (`pricing.stage`). The chain bound misses it where its walk leaves stages
    empty: transformer-tiny served at 4 stages on 1,000 devices, whose chain bound is the work over 997 of them."""
    parts = problem.parts
    return problem.least_latency * (2 if stages > 2 * parts else 1 if stages > parts else 0)


def _work_bound(work: np.ndarray, counts: np.ndarray, usable: int) -> float:
    """min T such that the work, split fractionally over groups, fits `count_g * T` on each group,
    over every way of picking `usable` devices."""
    if len(counts) == 1:
        return float(work.sum()) / min(usable, int(counts[0]))
    columns, weight = np.unique(np.round(work, 15), axis=1, return_counts=True)
    if usable >= int(counts.sum()):  # every device is used: one pick (not a walk over every count of every group)
        return _fractional_makespan(columns, weight, counts)
    best = np.inf
    for picked in itertools.product(*(range(int(c) + 1) for c in counts)):
        if sum(picked) != min(usable, int(counts.sum())):
            continue
        best = min(best, _fractional_makespan(columns, weight, np.array(picked)))
    return float(best)


def _fractional_makespan(columns: np.ndarray, weight: np.ndarray, devices: np.ndarray) -> float:
    solver = pywraplp.Solver.CreateSolver("GLOP")
    groups, kinds = columns.shape
    t = solver.NumVar(0, solver.infinity(), "T")
    share = [[solver.NumVar(0, 1, "") if devices[g] else None for g in range(groups)] for _ in range(kinds)]
    for j in range(kinds):
        solver.Add(sum(v for v in share[j] if v is not None) == 1)
    for g in range(groups):
        if devices[g]:
            solver.Add(sum(share[j][g] * float(columns[g, j] * weight[j]) for j in range(kinds)) <= t * float(devices[g]))
    solver.Minimize(t)
    solver.Solve()
    # Round down slightly: the LP's float tolerance must never lift the bound above a true optimum.
    return max(0.0, t.solution_value() * (1 - 1e-7))
