"""CP-SAT over blocks: any assignment where data flows forward (not only intervals of one order),
with device group, replica count and recompute chosen per stage, warm-started from the DP and
stopped at a time limit with its proven bound.

The stage-time model is the pricing rule (`onnxpipe.pricing.stage`, as `evaluate` prices a plan) in integer
nanoseconds, applied term by term: a tensor is counted once per stage that receives it, and each message is
priced on the link between the producer's and the receiver's device groups on both ends (a skip over a stage
of another group included). Every term is rounded up, memory in KiB, so the model never prices a plan below
`evaluate`. A known plan's bottleneck (the DP's hint) caps every time variable and, through `_windows`,
rules out stages a block cannot take in any better plan; the first-principles bound is the objective's floor.

Reading order: `CpResult` -> `solve_cpsat` -> `_Model` (variables, then constraints) -> `hint` -> `_windows`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from onnxpipe.plan.coarsen import Blocks
from onnxpipe.plan.layout import Layout, replica_choices
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.stage import activation_bytes, held, message_seconds, recomputed_backward, state_bytes

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["CpResult", "solve_cpsat"]

_NS = 1e9
_KIB = 1024.0


@dataclass(frozen=True)
class CpResult:
    #: None when CP-SAT found nothing (the hint, if any, was infeasible or time ran out).
    layout: Layout | None
    #: "OPTIMAL", "FEASIBLE", "INFEASIBLE" or "UNKNOWN".
    status: str
    #: The model's objective and proven bound, in seconds per micro-batch.
    objective_seconds: float
    bound_seconds: float
    wall_seconds: float


def solve_cpsat(
    problem: Problem,
    blocks: Blocks,
    stages: int,
    *,
    recompute: str = "auto",
    replicas: bool = True,
    hint: Layout | None = None,
    floor_seconds: float = 0.0,
    ceiling_seconds: float = math.inf,
    time_limit: float = 30.0,
    workers: int | None = None,
    progress: Callable[[float, float], None] | None = None,
) -> CpResult:
    """Minimise the bottleneck seconds per micro-batch. `floor_seconds` is a known valid lower bound;
    `ceiling_seconds` the bottleneck of a plan on these blocks (the hint's), which bounds the search."""
    from ortools.sat.python import cp_model  # here, not at import: it loads pandas (~0.5 s) that split, simulate and train never need

    model = _Model(problem, blocks, stages, recompute, replicas, floor_seconds, ceiling_seconds)
    if hint is not None:
        model.hint(hint)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = max(0.05, time_limit)
    solver.parameters.num_workers = workers or _default_workers()
    if solver.parameters.num_workers == 1:
        # Measured: the LP relaxation of this model is weak (stage times are max-of-sums over Booleans) and
        # only slows the search; without it the zoo's 8-stage heterogeneous plans are proven 1.3-3x sooner.
        # (With more workers the default portfolio runs a no-LP worker of its own.)
        solver.parameters.linearization_level = 0
        # Measured likewise: presolve spends longer than it saves on these models (gpt2 node by node,
        # heterogeneous 8 stages: 3.1 s -> 1.5 s; the 10,000-node graph's 296 blocks: 1.9 s -> 1.0 s).
        solver.parameters.cp_model_presolve = False
    # Left on, OR-Tools takes over SIGINT while solving and leaves it at the default action afterwards, so a
    # later Ctrl-C (during training, say) would kill the process without cleanup.
    solver.parameters.catch_sigint_signal = False
    callback = _progress(cp_model, progress) if progress else None
    status = solver.Solve(model.cp, callback) if callback else solver.Solve(model.cp)
    name = solver.StatusName(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpResult(None, name, math.inf, solver.BestObjectiveBound() / _NS if status == cp_model.UNKNOWN else math.inf, solver.WallTime())
    return CpResult(model.layout(solver), name, solver.ObjectiveValue() / _NS, solver.BestObjectiveBound() / _NS, solver.WallTime())


def _default_workers() -> int:
    """All cores; on two or fewer, one: a single search worker proves optimality sooner than a two-worker
    portfolio sharing the cores (measured on the zoo's 8-stage plans, 2 to 5x sooner)."""
    cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores


def _progress(cp_model, report: Callable[[float, float], None]):  # type: ignore[no-untyped-def]
    """A solution callback reporting (objective, bound) seconds."""

    class Progress(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            report(self.ObjectiveValue() / _NS, self.BestObjectiveBound() / _NS)

    return Progress()


class _Model:
    def __init__(self, problem: Problem, blocks: Blocks, stages: int, recompute: str, replicas: bool, floor: float, ceiling: float) -> None:
        from ortools.sat.python import cp_model

        self.problem, self.blocks, self.k = problem, blocks, stages
        cp = self.cp = cp_model.CpModel()
        nb, k = blocks.count, stages
        counts = [len(d) for d in problem.group_devices]
        most = max(1, sum(counts) - k + 1) if replicas else 1
        # Every term is rounded up to whole nanoseconds, so a plan priced at `ceiling` may sit that many above it.
        self.most_ns = int(math.ceil(ceiling * _NS * (1 + 1e-6))) + nb + 3 * len(blocks.nbytes) + 16 if math.isfinite(ceiling) else 2**50
        self.x = [[cp.NewBoolVar("") for _ in range(k)] for _ in range(nb)]
        for b in range(nb):
            cp.AddExactlyOne(self.x[b])
        if math.isfinite(ceiling):
            first, last = _windows(problem, blocks, k, replicas, self.most_ns / _NS)
            for b in range(nb):
                for s in (*range(0, first[b]), *range(last[b] + 1, k)):
                    cp.Add(self.x[b][s] == 0)
        for s in range(k):
            cp.AddBoolOr([self.x[b][s] for b in range(nb)])
        stage = [sum(s * self.x[b][s] for s in range(1, k)) for b in range(nb)]
        edges = {(int(p), int(c)) for p, cs in zip(blocks.producer, blocks.consumers) if p >= 0 for c in cs}
        for p, c in sorted(edges):
            cp.Add(stage[p] <= stage[c])
        # Per stage: one (group, replicas) choice and a recompute flag.
        self.options = [(g, r) for g in range(len(counts)) for r in replica_choices(counts[g], most)]
        self.y = [[cp.NewBoolVar("") for _ in self.options] for _ in range(k)]
        for s in range(k):
            cp.AddExactlyOne(self.y[s])
        for g, c in enumerate(counts):
            cp.Add(sum(r * self.y[s][o] for s in range(k) for o, (h, r) in enumerate(self.options) if h == g) <= c)
        self.in_group = [[cp.NewBoolVar("") for _ in counts] for _ in range(k)]
        for s in range(k):
            for g in range(len(counts)):
                cp.Add(self.in_group[s][g] == sum(self.y[s][o] for o, (h, _) in enumerate(self.options) if h == g))
        self.rc = [cp.NewBoolVar("") for _ in range(k)]
        for v in self.rc:
            if recompute != "auto":
                cp.Add(v == (recompute == "always"))
        # Crossing tensors: received[t][s] (per stage that reads it from elsewhere); by group of the other
        # end (see `_by_group`): came_from[t][s][g] (received from a producer in group g), went_to[t][s][g]
        # (received by stage s of group g), sent_to[t][s][g] (messages the producer's stage s sends to group g).
        self.received, self.inputs, self.came_from, self.went_to, self.sent_to = [], [], [], [], []
        self.block_group = {}
        for p, cs in zip(blocks.producer, blocks.consumers):
            recv = [cp.NewBoolVar("") for _ in range(k)]
            for s in range(k):
                for c in cs:
                    cp.Add(recv[s] >= self.x[c][s] - (self.x[p][s] if p >= 0 else 0))
            self.inputs.append(recv if p < 0 else None)
            self.received.append(None if p < 0 else recv)
            came, went, sent = self._by_group(int(p), recv) if p >= 0 else (None, None, None)
            self.came_from.append(came)
            self.went_to.append(went)
            self.sent_to.append(sent)
        # leaves[t][s]: crossing tensor t, which costs its stage forward seconds when sent (`Blocks.crossing_sent`), leaves stage s.
        self.leaves: list[list | None] = [None] * len(blocks.nbytes)
        for t, (p, recv) in enumerate(zip(blocks.producer, self.received)):
            if recv is not None and blocks.crossing_sent[:, t].any():
                self.leaves[t] = [cp.NewBoolVar("") for _ in range(k)]
                for s in range(k):
                    for d in range(k):
                        if d != s:
                            cp.Add(self.leaves[t][s] >= self.x[p][s] + recv[d] - 1)
        self.bottleneck = cp.NewIntVar(min(int(math.floor(floor * _NS)), self.most_ns), self.most_ns, "T")
        #: Per stage: its time in nanoseconds (at least: the model only bounds them by the bottleneck).
        self.stage_ns: list[cp_model.LinearExpr] = []
        self._stage_constraints(recompute)
        cp.Minimize(self.bottleneck)

    def _by_group(self, p: int, recv: list[cp_model.IntVar]) -> tuple[list[list], list[list] | None, list[list]]:
        """came_from, went_to (received by a stage of group g) and sent_to of one crossing tensor produced
        in block p; with one group, came_from is recv itself and went_to is not needed."""
        cp, k, groups = self.cp, self.k, len(self.in_group[0])
        if groups == 1:
            sent = [cp.NewIntVar(0, k - 1, "") for _ in range(k)]
            for s in range(k):
                cp.Add(sent[s] >= sum(recv) - (k - 1) * (1 - self.x[p][s]))
            return [[r] for r in recv], None, [[v] for v in sent]
        if p not in self.block_group:
            self.block_group[p] = [cp.NewBoolVar("") for _ in range(groups)]
            cp.AddExactlyOne(self.block_group[p])
            for s in range(k):
                for g in range(groups):
                    cp.AddBoolOr([self.x[p][s].Not(), self.in_group[s][g].Not(), self.block_group[p][g]])
        came, into = ([[cp.NewBoolVar("") for _ in range(groups)] for _ in range(k)] for _ in range(2))
        for s in range(k):
            cp.Add(sum(came[s]) == recv[s])
            cp.Add(sum(into[s]) == recv[s])
            for g in range(groups):
                cp.AddBoolOr([recv[s].Not(), self.block_group[p][g].Not(), came[s][g]])
                cp.AddBoolOr([recv[s].Not(), self.in_group[s][g].Not(), into[s][g]])
        sent = [[cp.NewIntVar(0, k - 1, "") for _ in range(groups)] for _ in range(k)]
        for s in range(k):
            for g in range(groups):
                cp.Add(sent[s][g] >= sum(into[d][g] for d in range(k)) - (k - 1) * (1 - self.x[p][s]))
        return came, into, sent

    def _stage_constraints(self, recompute: str) -> None:
        problem, blocks, cp, k = self.problem, self.blocks, self.cp, self.k
        flights = problem.flights(k)
        crossing = [t for t, r in enumerate(self.received) if r is not None]
        reads = [t for t, r in enumerate(self.inputs) if r is not None]
        state = state_bytes(blocks.params, blocks.trained, problem.optimizer_states, problem.training)
        m = problem.microbatches
        # holds[s]: the stage has trained parameters, so a replicated stage all-reduces gradients.
        holds = [cp.NewBoolVar("") for _ in range(k)]
        for s in range(k):
            for b in np.flatnonzero(blocks.trained > 0):
                cp.AddImplication(self.x[b][s], holds[s])
        for s in range(k):
            comp, comm_in, comm_out, ar = (cp.NewIntVar(0, self.most_ns, "") for _ in range(4))
            self.stage_ns.append(comp + comm_in + comm_out + ar)
            cp.Add(self.bottleneck >= self.stage_ns[-1])
            for o, (g, r) in enumerate(self.options):
                y = self.y[s][o]
                cut = self._crossing(s, g, r, crossing)
                for rc in (False, True):
                    if (recompute == "always" and not rc) or (recompute == "never" and rc):
                        continue
                    flag = self.rc[s] if rc else self.rc[s].Not()
                    seconds = (blocks.forward[g] + recomputed_backward(blocks.forward[g], blocks.backward[g], rc)) / r
                    # a recomputing stage runs its forward again, the crossings' part with it (`recomputed_backward`)
                    cp.Add(comp >= _dot(self.x, s, seconds * _NS, math.ceil) + cut * (2 if rc else 1)).OnlyEnforceIf([y, flag])
                    cap = int(problem.capacity[g] // _KIB)
                    mine = held(flights[s], r)  # whole micro-batches on one replica
                    # Activations per block, and with recompute each tensor it receives (its stash) per micro-batch held.
                    need = _dot(self.x, s, (state + activation_bytes(mine, blocks.activations, 0.0, rc)) / _KIB, math.ceil)
                    if rc:
                        stash = [_ceil(activation_bytes(mine, 0.0, blocks.nbytes[t], True) / _KIB) for t in range(len(blocks.nbytes))]
                        need += sum(self.received[t][s] * stash[t] for t in crossing) + sum(self.inputs[t][s] * stash[t] for t in reads)
                    cp.Add(need <= cap).OnlyEnforceIf([y, flag])
                groups = range(len(problem.groups))
                if s < k - 1:
                    out = sum(self.sent_to[t][s][gd] * self._message(t, g, gd, r) for t in crossing for gd in groups)
                    cp.Add(comm_out >= out).OnlyEnforceIf(y)
                if s > 0:
                    inside = sum(self.came_from[t][s][gp] * self._message(t, gp, g, r) for t in crossing for gp in groups)
                    cp.Add(comm_in >= inside).OnlyEnforceIf(y)
                if r > 1:
                    a0, a1 = problem.allreduce_affine(g, r)
                    cp.Add(ar >= _ceil(a0 / m * _NS) * holds[s] + _dot(self.x, s, blocks.trained * a1 / m * _NS, math.ceil)).OnlyEnforceIf(y)

    def _crossing(self, s: int, g: int, r: int, crossing: list[int]) -> cp_model.LinearExpr:
        """Forward nanoseconds the tensors stage s receives and sends cost it on group g with r replicas (its share)."""
        from ortools.sat.python import cp_model

        received, sent = self.blocks.crossing_received[g], self.blocks.crossing_sent[g]
        terms = [(self.received[t][s], _ceil(received[t] / r * _NS)) for t in crossing if received[t] > 0]
        terms += [(self.leaves[t][s], _ceil(sent[t] / r * _NS)) for t in crossing if self.leaves[t] is not None and sent[t] > 0]
        return cp_model.LinearExpr.WeightedSum([v for v, _ in terms], [c for _, c in terms])

    def _message(self, t: int, source: int, dest: int, replicas: int) -> int:
        """Nanoseconds one end spends on tensor t between groups source and dest, its share over `replicas`."""
        problem = self.problem
        return _ceil(message_seconds(problem.latency[source, dest], self.blocks.nbytes[t], replicas, problem.bandwidth[source, dest]) * _NS)

    def hint(self, layout: Layout) -> None:
        """Warm-start from `layout`; none when its replica counts are not among the model's (`replica_choices`)."""
        cp, k = self.cp, self.k
        if any((g, r) not in self.options for g, r in zip(layout.groups, layout.replicas)):
            return
        for b, s0 in enumerate(layout.block_stage):
            for s in range(k):
                cp.AddHint(self.x[b][s], int(s == s0))
        for s in range(k):
            chosen = self.options.index((layout.groups[s], layout.replicas[s]))
            for o in range(len(self.options)):
                cp.AddHint(self.y[s][o], int(o == chosen))
            cp.AddHint(self.rc[s], int(layout.recompute[s]))
        groups = layout.groups
        for p, g in self.block_group.items():
            for h, v in enumerate(g):
                cp.AddHint(v, int(groups[layout.block_stage[p]] == h))
        tensors = zip(self.blocks.producer, self.blocks.consumers, self.received, self.came_from, self.went_to, self.sent_to, self.inputs, self.leaves)
        for p, cs, recv, came, went, sent, reads, leaves in tensors:
            readers = set(int(layout.block_stage[c]) for c in cs)
            if recv is None:
                for s in range(k):
                    cp.AddHint(reads[s], int(s in readers))
                continue
            src = int(layout.block_stage[p])
            readers.discard(src)
            for s in range(k):
                cp.AddHint(recv[s], int(s in readers))
                if leaves is not None:
                    cp.AddHint(leaves[s], int(s == src and bool(readers)))
                for h in range(len(sent[s])):
                    if went is not None:
                        cp.AddHint(came[s][h], int(s in readers and groups[src] == h))
                        cp.AddHint(went[s][h], int(s in readers and groups[s] == h))
                    cp.AddHint(sent[s][h], sum(groups[d] == h for d in readers) if s == src else 0)

    def layout(self, solver: cp_model.CpSolver) -> Layout:
        k = self.k
        block_stage = np.array([next(s for s in range(k) if solver.BooleanValue(self.x[b][s])) for b in range(self.blocks.count)])
        chosen = [self.options[next(o for o in range(len(self.options)) if solver.BooleanValue(self.y[s][o]))] for s in range(k)]
        return Layout(
            block_stage=block_stage,
            groups=tuple(g for g, _ in chosen),
            replicas=tuple(r for _, r in chosen),
            recompute=tuple(bool(solver.BooleanValue(v)) for v in self.rc),
        )


def _windows(problem: Problem, blocks: Blocks, k: int, replicas: bool, ceiling: float) -> tuple[np.ndarray, np.ndarray]:
    """First and last stage each block can take in a plan of bottleneck <= ceiling: the stages up to a
    block's must do the work of its ancestors (the ones from it on, of its descendants), and a stage's
    devices each do at most `ceiling` seconds of it (on their fastest group)."""
    nb, devices = blocks.count, problem.device_count
    work = (blocks.forward + blocks.backward).min(axis=0)
    before = np.eye(nb, dtype=bool)
    for p, cs in zip(blocks.producer, blocks.consumers):
        if p >= 0:
            before[cs] |= before[p]
    for c in range(nb):  # producers precede consumers in block order: one pass closes the relation
        before[c] |= before[before[c]].any(axis=0)
    ancestors, descendants = before @ work, before.T @ work
    stages = np.arange(k)
    up_to = devices - (k - 1 - stages) if replicas else stages + 1  # devices stages 0..s may hold
    from_on = devices - stages if replicas else k - stages  # devices stages s..k-1 may hold
    slack = 1 + 1e-9
    first = np.array([int(np.argmax(ceiling * up_to * slack >= a)) if (ceiling * up_to * slack >= a).any() else k for a in ancestors])
    last = np.array([int(np.flatnonzero(ceiling * from_on * slack >= d)[-1]) if (ceiling * from_on * slack >= d).any() else -1 for d in descendants])
    return first, last


def _ceil(value: float) -> int:
    return int(math.ceil(value - 1e-9))


def _dot(x: list[list[cp_model.IntVar]], s: int, weights: np.ndarray, rounding: Callable[[float], int]) -> cp_model.LinearExpr:
    from ortools.sat.python import cp_model

    coefficients = [rounding(w - 1e-9) for w in weights]
    return cp_model.LinearExpr.WeightedSum([x[b][s] for b in range(len(x)) if coefficients[b]], [c for c in coefficients if c])
