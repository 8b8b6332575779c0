"""CP-SAT over blocks: any assignment where data flows forward (not only intervals of one order),
with device group, replica count and recompute chosen per stage, warm-started from the DP and
stopped at a time limit with its proven bound.

The stage-time model is the pricing rule (`onnxpipe.pricing.stage`, as `evaluate` prices a plan) in integer
nanoseconds, applied term by term: a tensor is counted once per stage that receives it, and each message is
priced on the link between the producer's and the receiver's device groups on both ends (a skip over a stage
of another group included). Every term is rounded up, memory in KiB, so the model never prices a plan below
`evaluate`. A known plan's bottleneck (the DP's hint) caps every time variable and, through `_windows`,
rules out stages a block cannot take in any better plan: the model has variables only for the stages a block,
and the tensors it sends or receives, can take (half of them or fewer at 8 stages; CP-SAT's time grows with
the crossing variables it propagates). The first-principles bound is the objective's floor.

Reading order: `CpResult` -> `solve_cpsat` -> `_Model` (variables, then constraints) -> `hint` -> `_windows` (`_devices`, `_holds`, `_held`).
"""

from __future__ import annotations

import math
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from onnxpipe.plan.coarsen import Blocks
from onnxpipe.plan.layout import Layout, replica_choices
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.stage import activation_bytes, held, message_seconds, recomputed_backward, state_bytes

if TYPE_CHECKING:
    from ortools.sat.python import cp_model

__all__ = ["CpResult", "Stop", "Stall", "solve_cpsat", "half_the_cores", "held_ceiling_ns"]

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


class Stop:
    """Ends, from another thread, the searches started under it (and any started later): the search down from the
    best plan ends the questions asked beside it once it is done (`plan.solve._prove`). `moot`: a search about to start
    does not while it holds (a question the search down answered while its model was being built: `interrupt` ends only
    the searches already running, so whoever makes it hold then interrupts)."""

    def __init__(self, moot: Callable[[], bool] = lambda: False) -> None:
        self._lock = threading.Lock()
        self._running: set = set()
        self._moot = moot
        self.stopped = False

    def stop(self) -> None:
        with self._lock:
            self.stopped = True
        self.interrupt()

    def interrupt(self) -> None:
        """Ends the searches running now only; later ones still start."""
        with self._lock:
            for solver in self._running:
                solver.stop_search()

    def enter(self, solver) -> bool:  # type: ignore[no-untyped-def]
        """Registers a solver about to search; False once stopped or moot (it should not start)."""
        with self._lock:
            starts = not self.stopped and not self._moot()
            if starts:
                self._running.add(solver)
            return starts

    def leave(self, solver) -> None:  # type: ignore[no-untyped-def]
        with self._lock:
            self._running.discard(solver)


class Stall:
    """Ends a search that has found no better plan for `seconds` since its last (`found`, its progress callback); one that
    finds none runs to its time limit."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.stop = Stop()
        self._lock = threading.Lock()
        self._timer: threading.Timer | None = None

    def found(self, value: float, bound: float) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()
            self._timer = threading.Timer(self.seconds, self.stop.stop)
            self._timer.daemon = True
            self._timer.start()

    def close(self) -> None:
        with self._lock:
            if self._timer is not None:
                self._timer.cancel()


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
    stop: Stop | None = None,
    searching: threading.Event | None = None,
    refute: bool = False,
    patterns: Sequence[tuple[int, ...]] | None = None,
) -> CpResult:
    """Minimise the bottleneck seconds per micro-batch. `floor_seconds` is a known valid lower bound;
    `ceiling_seconds` the bottleneck of a plan on these blocks (the hint's), which bounds the search. `stop`: ends
    the search from another thread (UNKNOWN, or FEASIBLE with the best plan found so far). `searching`: set once the
    model is built and CP-SAT is about to search (it then leaves the interpreter lock to other threads). `refute`: the
    question is whether any plan is within the ceiling (`probe`), not the least bottleneck: the first plan found answers it
    (and the next question asks below it; going on to the time limit instead, BART-base's export on gpu4 at 4 stages spent 3.2 s
    bettering a plan the question had found by 0.01%). `time_limit` covers building the model too (0.1-0.4 s node by node on
    the exports): none left for the search, it does not start (UNKNOWN). `patterns`: on several device groups, the stages'
    groups follow one of these (the patterns a plan within the ceiling may have, `plan.patterns.reachable`; none: no plan)."""
    from ortools.sat.python import cp_model  # here, not at import: it loads pandas (~0.5 s) that split, simulate and train never need

    started = time.perf_counter()
    model = _Model(problem, blocks, stages, recompute, replicas, floor_seconds, ceiling_seconds, patterns)
    if hint is not None:
        model.hint(hint)
    left = time_limit - (time.perf_counter() - started)
    if left <= 0:
        return CpResult(None, "UNKNOWN", math.inf, floor_seconds, 0.0)
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = left
    solver.parameters.num_workers = workers or _default_workers()
    solver.parameters.stop_after_first_solution = refute
    if solver.parameters.num_workers == 1 and refute and (len(problem.group_devices) == 1 or problem.stage_groups):
        # A question below the best plan (`probe`) on one device type, or each stage's fixed (`plan.patterns`): CP-SAT's full
        # linearization (every enforced linear
        # constraint in its LP) refutes it where the search alone stalls, as the LP adds up what no stage constraint
        # does: the work is fixed, so a bottleneck near its even share leaves room for few messages. Measured node by
        # node on BART-base's export training on gpu4 at 4 stages: "no plan within 46.114 ms" (best plan 46.46 ms, work
        # bound 45.60) in 0.1 s, none in 15 s without. On several device types each stage's choice of type enforces
        # its own constraints and the LP is weak: the same questions on hetero took 2-4x longer with it (not so once a
        # pattern fixes each stage's type).
        solver.parameters.linearization_level = 2
    elif solver.parameters.num_workers == 1:
        # Measured: the LP relaxation of this model is weak (stage times are max-of-sums over Booleans) and
        # only slows the search; without it the zoo's 8-stage heterogeneous plans are proven 1.3-3x sooner.
        # (With more workers the default portfolio runs a no-LP worker of its own.)
        solver.parameters.linearization_level = 0
        # Measured likewise: presolve spends longer than it saves on these models (gpt2 node by node,
        # heterogeneous 8 stages: 3.1 s -> 1.5 s; the 10,000-node graph's 296 blocks: 1.9 s -> 1.0 s).
        solver.parameters.cp_model_presolve = False
        # Measured in CP-SAT's deterministic time (the machine's speed aside), same plans and verdicts: without the SAT
        # inprocessing passes (clause vivification and probing between restarts) the zoo's 36 plans of 4 and 8 stages on
        # the three targets take 3.1 instead of 8.3 in all, BERT-base's export at 8 heterogeneous stages 2.4 instead of
        # 3.1, ViT-B/16's there 0.75 instead of 1.7; branching towards the best plan found saves another 0.4 on BERT-base
        # (0.1 over the zoo; the zoo's gpt2 and ResNet-50's export at 8 heterogeneous stages 0.1 and 0.2 slower).
        solver.parameters.use_sat_inprocessing = False
        solver.parameters.exploit_best_solution = True
    # Left on, OR-Tools takes over SIGINT while solving and leaves it at the default action afterwards, so a
    # later Ctrl-C (during training, say) would kill the process without cleanup.
    solver.parameters.catch_sigint_signal = False
    callback = _progress(cp_model, progress) if progress else None
    if stop is not None and not stop.enter(solver):
        return CpResult(None, "UNKNOWN", math.inf, floor_seconds, 0.0)
    if searching is not None:
        searching.set()
    try:
        status = solver.solve(model.cp, callback) if callback else solver.solve(model.cp)
    finally:
        if stop is not None:
            stop.leave(solver)
    name = solver.status_name(status)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return CpResult(None, name, math.inf, solver.best_objective_bound / _NS if status == cp_model.UNKNOWN else math.inf, solver.wall_time)
    return CpResult(model.layout(solver), name, solver.objective_value / _NS, solver.best_objective_bound / _NS, solver.wall_time)


def held_ceiling_ns(ceiling: float, blocks: Blocks) -> int:
    """A ceiling (seconds) as the model over `blocks` holds it, in nanoseconds: every term is rounded up to whole
    nanoseconds, so a plan priced at `ceiling` may sit that many above it. A plan the model holds within it is priced
    within it by `evaluate` too (each of the model's terms is at least `evaluate`'s)."""
    return int(math.ceil(ceiling * _NS * (1 + 1e-6))) + blocks.count + 3 * len(blocks.nbytes) + 16


def _default_workers() -> int:
    """All cores; on two or fewer, one: a single search worker proves optimality sooner than a two-worker
    portfolio sharing the cores (measured on the zoo's 8-stage plans, 2 to 5x sooner)."""
    cores = os.cpu_count() or 1
    return 1 if cores <= 2 else cores


def half_the_cores() -> int:
    """Workers for each of two searches run side by side: half the cores, at least one."""
    return max(1, (os.cpu_count() or 1) // 2)


def _progress(cp_model, report: Callable[[float, float], None]):  # type: ignore[no-untyped-def]
    """A solution callback reporting (objective, bound) seconds."""

    class Progress(cp_model.CpSolverSolutionCallback):
        def on_solution_callback(self) -> None:
            report(self.objective_value / _NS, self.best_objective_bound / _NS)

    return Progress()


class _Model:
    def __init__(self, problem: Problem, blocks: Blocks, stages: int, recompute: str, replicas: bool, floor: float, ceiling: float,
                 patterns: Sequence[tuple[int, ...]] | None = None) -> None:
        from ortools.sat.python import cp_model

        self.problem, self.blocks, self.k = problem, blocks, stages
        cp = self.cp = cp_model.CpModel()
        nb, k = blocks.count, stages
        counts = [len(d) for d in problem.group_devices]
        most = max(1, sum(counts) - k + 1) if replicas else 1
        self.most_ns = held_ceiling_ns(ceiling, blocks) if math.isfinite(ceiling) else 2**50
        first, last = _windows(problem, blocks, k, replicas, self.most_ns / _NS, patterns) if math.isfinite(ceiling) else (np.zeros(nb, int), np.full(nb, k - 1))
        #: x[b][s]: block b is in stage s, over the stages it can take (`_windows`); no variable where it cannot.
        self.x = [{s: cp.new_bool_var("") for s in range(int(first[b]), int(last[b]) + 1)} for b in range(nb)]
        for b in range(nb):
            cp.add_exactly_one(self.x[b].values())
        for s in range(k):
            cp.add_bool_or([x[s] for x in self.x if s in x])
        stage = [sum(s * v for s, v in x.items() if s) for x in self.x]
        edges = {(int(p), int(c)) for p, cs in zip(blocks.producer, blocks.consumers) if p >= 0 for c in cs}
        for p, c in sorted(edges):
            cp.add(stage[p] <= stage[c])
        # Per stage: one (group, replicas) choice and a recompute flag.
        self.options = [(g, r) for g in range(len(counts)) for r in replica_choices(counts[g], most)]
        self.y = [[cp.new_bool_var("") for _ in self.options] for _ in range(k)]
        for s in range(k):
            cp.add_exactly_one(self.y[s])
        for g, c in enumerate(counts):
            cp.add(sum(r * self.y[s][o] for s in range(k) for o, (h, r) in enumerate(self.options) if h == g) <= c)
        self.in_group = [[cp.new_bool_var("") for _ in counts] for _ in range(k)]
        for s in range(k):
            for g in range(len(counts)):
                cp.add(self.in_group[s][g] == sum(self.y[s][o] for o, (h, _) in enumerate(self.options) if h == g))
            if problem.stage_groups:
                cp.add(self.in_group[s][problem.stage_groups[s]] == 1)
        if patterns is not None:  # the stages' groups follow one of these patterns (`plan.patterns.reachable`)
            cp.add_allowed_assignments([v for row in self.in_group for v in row], [[int(p[s] == g) for s in range(k) for g in range(len(counts))] for p in patterns])
        self.rc = [cp.new_bool_var("") for _ in range(k)]
        for v in self.rc:
            if recompute != "auto":
                cp.add(v == (recompute == "always"))
        for b in np.flatnonzero(blocks.random):  # a stage drawing random numbers keeps its stash (`Problem.random`)
            for s, v in self.x[b].items():
                cp.add_implication(v, self.rc[s].negated())
        self.block_group: dict[int, list] = {}
        # Crossing tensors, each over the stages where it can arise (no variable elsewhere): received[t][s] (stage s reads
        # it from an earlier stage; inputs[t][s] for a model input); by group of the other end (`_by_group`): came_from[t][s][g]
        # (received from a producer in group g), sent_to[t][s][g] (messages the producer's stage s sends to group g);
        # leaves[t][s] where it costs its stage forward seconds when sent (`Blocks.crossing_sent`): it leaves stage s.
        self.received: list[dict | None] = []
        self.inputs: list[dict | None] = []
        self.came_from: list[dict | None] = []
        self.went_to: list[dict | None] = []
        self.sent_to: list[dict | None] = []
        self.leaves: list[dict | None] = []
        for t, (p, cs) in enumerate(zip(blocks.producer, blocks.consumers)):
            p, cs = int(p), sorted({int(c) for c in cs})
            after = min(self.x[p], default=k) if p >= 0 else -1  # a reader sits in a later stage than the producer
            recv = {s: cp.new_bool_var("") for s in sorted({s for c in cs for s in self.x[c] if s > after})}
            for s, v in recv.items():
                for c in cs:
                    if s in self.x[c]:
                        cp.add_bool_or([self.x[c][s].negated(), v, *([self.x[p][s]] if p >= 0 and s in self.x[p] else [])])
            self.inputs.append(recv if p < 0 else None)
            self.received.append(None if p < 0 else recv)
            came, went, sent = self._by_group(p, cs, recv) if p >= 0 else (None, None, None)
            self.came_from.append(came)
            self.went_to.append(went)
            self.sent_to.append(sent)
            self.leaves.append(self._leaving(p, cs, recv) if p >= 0 and blocks.crossing_sent[:, t].any() else None)
        self.bottleneck = cp.new_int_var(min(int(math.floor(floor * _NS)), self.most_ns), self.most_ns, "T")
        #: Per stage: its time in nanoseconds (at least: the model only bounds them by the bottleneck).
        self.stage_ns: list[cp_model.LinearExpr] = []
        self._stage_constraints(recompute)
        cp.minimize(self.bottleneck)

    def _group_of(self, b: int) -> list:
        """block_group[b][g]: block b sits in a stage of group g."""
        if b not in self.block_group:
            cp, groups = self.cp, len(self.in_group[0])
            self.block_group[b] = [cp.new_bool_var("") for _ in range(groups)]
            cp.add_exactly_one(self.block_group[b])
            for s, v in self.x[b].items():
                for g in range(groups):
                    cp.add_bool_or([v.negated(), self.in_group[s][g].negated(), self.block_group[b][g]])
        return self.block_group[b]

    def _senders(self, p: int, recv: dict) -> dict[int, list[int]]:
        """Per stage s the producer block p can take: the later stages that may receive from it (none: no variable)."""
        return {s: later for s in self.x[p] if (later := [d for d in recv if d > s])}

    def _by_group(self, p: int, cs: list[int], recv: dict) -> tuple[dict, dict | None, dict]:
        """came_from, went_to (received by a stage of group g; only with several groups and consumers) and sent_to of one
        crossing tensor produced in block p and read by blocks cs. With one consumer a message leaves stage s exactly
        when p is in s and the consumer is not (it is then later), to the consumer's group: no count over the later
        stages; with several, sent_to counts the later stages of each group that receive it."""
        cp, groups = self.cp, len(self.in_group[0])
        senders = self._senders(p, recv)
        into: dict | None = None
        if groups == 1:
            came = {s: [v] for s, v in recv.items()}
        else:
            source = self._group_of(p)
            came = {s: [cp.new_bool_var("") for _ in range(groups)] for s in recv}
            for s, v in recv.items():
                cp.add(sum(came[s]) == v)
                for g in range(groups):
                    cp.add_bool_or([v.negated(), source[g].negated(), came[s][g]])
        sent: dict[int, list] = {}
        if len(cs) == 1:
            c = cs[0]
            dest = [None] if groups == 1 else self._group_of(c)
            for s in senders:
                sent[s] = [cp.new_bool_var("") for _ in range(groups)]
                for g, v in enumerate(sent[s]):
                    cp.add_bool_or([self.x[p][s].negated(), v, *([self.x[c][s]] if s in self.x[c] else []), *([dest[g].negated()] if groups > 1 else [])])
            return came, None, sent
        if groups > 1:
            into = {s: [cp.new_bool_var("") for _ in range(groups)] for s in recv}
            for s, v in recv.items():
                cp.add(sum(into[s]) == v)
                for g in range(groups):
                    cp.add_bool_or([v.negated(), self.in_group[s][g].negated(), into[s][g]])
        by_group = into or {s: [v] for s, v in recv.items()}
        for s, later in senders.items():
            most = min(len(cs), len(later))
            sent[s] = [cp.new_int_var(0, most, "") for _ in range(groups)]
            for g, v in enumerate(sent[s]):
                cp.add(v >= sum(by_group[d][g] for d in later) - most * (1 - self.x[p][s]))
        return came, into, sent

    def _leaving(self, p: int, cs: list[int], recv: dict) -> dict:
        """leaves[s]: the tensor leaves stage s: p is in s and some consumer is not (it is then in a later stage)."""
        cp = self.cp
        leaves = {s: cp.new_bool_var("") for s in self._senders(p, recv)}
        for s, v in leaves.items():
            for c in cs:
                cp.add_bool_or([self.x[p][s].negated(), v, *([self.x[c][s]] if s in self.x[c] else [])])
        return leaves

    def _stage_constraints(self, recompute: str) -> None:
        problem, blocks, cp, k = self.problem, self.blocks, self.cp, self.k
        flights = problem.flights(k)
        state = state_bytes(blocks.params, blocks.trained, problem.optimizer_states, problem.training)
        m = problem.microbatches
        # holds[s]: the stage has trained parameters, so a replicated stage all-reduces gradients.
        holds = [cp.new_bool_var("") for _ in range(k)]
        for b in np.flatnonzero(blocks.trained > 0):
            for s, v in self.x[b].items():
                cp.add_implication(v, holds[s])
        for s in range(k):
            comp, comm_in, comm_out, ar = (cp.new_int_var(0, self.most_ns, "") for _ in range(4))
            self.stage_ns.append(comp + comm_in + comm_out + ar)
            cp.add(self.bottleneck >= self.stage_ns[-1])
            # (tensor, variable) of what stage s may receive from another stage, or read as a model input
            received = [(t, r[s]) for t, r in enumerate(self.received) if r is not None and s in r]
            read = [(t, r[s]) for t, r in enumerate(self.inputs) if r is not None and s in r]
            for o, (g, r) in enumerate(self.options):
                y = self.y[s][o]
                cut = self._crossing(s, g, r, received + read)
                for rc in (False, True):
                    if (recompute == "always" and not rc) or (recompute == "never" and rc):
                        continue
                    flag = self.rc[s] if rc else self.rc[s].negated()
                    seconds = (blocks.forward[g] + recomputed_backward(blocks.forward[g], blocks.backward[g], rc)) / r
                    # a recomputing stage runs its forward again, the crossings' part with it (`recomputed_backward`)
                    cp.add(comp >= _dot(self.x, s, seconds * _NS, math.ceil) + cut * (2 if rc else 1)).only_enforce_if([y, flag])
                    cap = int(problem.capacity[g] // _KIB)
                    mine = held(flights[s], r)  # whole micro-batches on one replica
                    # Activations per block, and with recompute each tensor it receives (its stash) per micro-batch held.
                    need = _dot(self.x, s, (state + activation_bytes(mine, blocks.activations, 0.0, rc)) / _KIB, math.ceil)
                    if rc:
                        need += sum(v * _ceil(activation_bytes(mine, 0.0, blocks.nbytes[t], True) / _KIB) for t, v in (*received, *read))
                    cp.add(need <= cap).only_enforce_if([y, flag])
                out = [(v, self._message(t, g, gd, r)) for t, sent in enumerate(self.sent_to) if sent is not None and s in sent
                       for gd, v in enumerate(sent[s])]
                if out:
                    cp.add(comm_out >= _weighted(out)).only_enforce_if(y)
                inside = [(v, self._message(t, gp, g, r)) for t, came in enumerate(self.came_from) if came is not None and s in came
                          for gp, v in enumerate(came[s])]
                if inside:
                    cp.add(comm_in >= _weighted(inside)).only_enforce_if(y)
                if r > 1:
                    a0, a1 = problem.allreduce_affine(g, r)
                    cp.add(ar >= _ceil(a0 / m * _NS) * holds[s] + _dot(self.x, s, blocks.trained * a1 / m * _NS, math.ceil)).only_enforce_if(y)

    def _crossing(self, s: int, g: int, r: int, received: list[tuple[int, cp_model.IntVar]]) -> cp_model.LinearExpr:
        """Forward nanoseconds the tensors stage s receives (or reads as model inputs: derived tensors it makes) and sends
        cost it on group g with r replicas (its share)."""
        into, sent = self.blocks.crossing_received[g], self.blocks.crossing_sent[g]
        terms = [(v, _ceil(into[t] / r * _NS)) for t, v in received if into[t] > 0]
        terms += [(leaves[s], _ceil(sent[t] / r * _NS)) for t, leaves in enumerate(self.leaves) if leaves is not None and s in leaves and sent[t] > 0]
        return _weighted(terms)

    def _message(self, t: int, source: int, dest: int, replicas: int) -> int:
        """Nanoseconds one end spends on tensor t between groups source and dest, its share over `replicas`."""
        problem = self.problem
        return _ceil(message_seconds(problem.latency[source, dest], self.blocks.nbytes[t], replicas, problem.bandwidth[source, dest]) * _NS)

    def hint(self, layout: Layout) -> None:
        """Warm-start from `layout`; none when its replica counts are not among the model's (`replica_choices`) or it puts
        a block in a stage the model rules out (`_windows`)."""
        k = self.k
        if any((g, r) not in self.options for g, r in zip(layout.groups, layout.replicas)):
            return
        stage_of = [int(s) for s in layout.block_stage]
        if any(s not in x for s, x in zip(stage_of, self.x)):
            return
        hinted: list[int] = []
        values: list[int] = []

        def hint(var, value: int) -> None:  # type: ignore[no-untyped-def]
            hinted.append(var.index)
            values.append(int(value))

        for x, s0 in zip(self.x, stage_of):
            for s, v in x.items():
                hint(v, int(s == s0))
        for s in range(k):
            chosen = self.options.index((layout.groups[s], layout.replicas[s]))
            for o in range(len(self.options)):
                hint(self.y[s][o], int(o == chosen))
            for g, v in enumerate(self.in_group[s]):
                hint(v, int(layout.groups[s] == g))
            hint(self.rc[s], int(layout.recompute[s]))
        groups = layout.groups
        for b, g in self.block_group.items():
            for h, v in enumerate(g):
                hint(v, int(groups[stage_of[b]] == h))
        tensors = zip(self.blocks.producer, self.blocks.consumers, self.received, self.came_from, self.went_to, self.sent_to, self.inputs, self.leaves)
        for p, cs, recv, came, went, sent, reads, leaves in tensors:
            readers = {stage_of[c] for c in cs}
            if recv is None:
                for s, v in reads.items():
                    hint(v, int(s in readers))
                continue
            src = stage_of[p]
            readers.discard(src)
            for s, v in recv.items():
                hint(v, int(s in readers))
                for h, w in enumerate(came[s] if len(came[s]) > 1 else ()):
                    hint(w, int(s in readers and groups[src] == h))
            for s, w in (went or {}).items():
                for h, v in enumerate(w):
                    hint(v, int(s in readers and groups[s] == h))
            for s, counts in sent.items():
                for h, w in enumerate(counts):
                    hint(w, sum(groups[d] == h for d in readers) if s == src else 0)
            for s, v in (leaves or {}).items():
                hint(v, int(s == src and bool(readers)))
        # The hints in two bulk extends: CpModel.add_hint appends to the proto twice per call, with checks (28,837 hints
        # on a 789-node graph).
        self.cp.proto.solution_hint.vars.extend(hinted)
        self.cp.proto.solution_hint.values.extend(values)

    def layout(self, solver: cp_model.CpSolver) -> Layout:
        k = self.k
        block_stage = np.array([next(s for s, v in x.items() if solver.boolean_value(v)) for x in self.x])
        chosen = [self.options[next(o for o in range(len(self.options)) if solver.boolean_value(self.y[s][o]))] for s in range(k)]
        return Layout(
            block_stage=block_stage,
            groups=tuple(g for g, _ in chosen),
            replicas=tuple(r for _, r in chosen),
            recompute=tuple(bool(solver.boolean_value(v)) for v in self.rc),
        )


def _windows(problem: Problem, blocks: Blocks, k: int, replicas: bool, ceiling: float, patterns: Sequence[tuple[int, ...]] | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
    """First and last stage each block can take in a plan of bottleneck <= ceiling: the stages up to a
    block's must do the work of its ancestors (the ones from it on, of its descendants), and a stage's
    devices each do at most `ceiling` seconds of it (`_holds`)."""
    nb = blocks.count
    times = blocks.forward + blocks.backward
    preds: list[set[int]] = [set() for _ in range(nb)]
    for p, cs in zip(blocks.producer, blocks.consumers):
        if p >= 0:
            for c in cs:
                preds[int(c)].add(int(p))
    before = np.eye(nb, dtype=bool)
    for c in range(nb):  # producers precede consumers in block order: each row is final before a consumer reads it
        if preds[c]:
            before[c] |= before[list(preds[c])].any(axis=0)
    (up_to, first_most), (from_on, last_most) = _devices(problem, k, replicas, patterns)
    reach = _holds(before, times, up_to, first_most, ceiling)  # stages 0..s can hold the block's ancestors
    first = np.where(reach.any(axis=1), reach.argmax(axis=1), k)
    hold = _holds(before.T, times, from_on, last_most, ceiling)  # stages s..k-1 can hold its descendants
    last = np.where(hold.any(axis=1), k - 1 - hold[:, ::-1].argmax(axis=1), -1)
    return first, last


def _devices(problem: Problem, k: int, replicas: bool, patterns: Sequence[tuple[int, ...]] | None = None
             ) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """The most devices stages 0..s may hold, in all (k,) and of each group (k, groups); the same for stages s..k-1. Each
    stage holds one device at least (exactly one without replicas), and with each stage's group fixed
    (`Problem.stage_groups`) only devices of those stages' groups, as many as the other stages of the group leave; with
    the stages' groups following one of `patterns`, the most any of them leaves. Measured
    on the questions asked by pattern (`plan.patterns`) at 4 heterogeneous stages, "no plan within 0.475% of the best" for
    each of the 6 patterns: BART-base's export in 3.1 s instead of 7.3 (CP-SAT's deterministic time 0.87 instead of 1.42),
    T5-small's in 6.7 s instead of 7.8 (1.69 instead of 2.74), where every device counted at the fastest group's speed."""
    counts = np.array([len(d) for d in problem.group_devices])
    stages = np.arange(k)
    up_to = counts.sum() - (k - 1 - stages) if replicas else stages + 1
    from_on = counts.sum() - stages if replicas else k - stages
    fixed = [problem.stage_groups] if problem.stage_groups else patterns
    if not fixed:
        return (up_to, np.tile(counts, (k, 1))), (from_on, np.tile(counts, (k, 1)))
    member = np.array(fixed)[:, :, None] == np.arange(len(counts))  # (patterns, k, groups): stage s is of group g
    upto, fromon = np.cumsum(member, axis=1), np.cumsum(member[:, ::-1], axis=1)[:, ::-1]  # stages of each group in 0..s, in s..k-1
    prefix = (counts - (fromon - member) if replicas else upto) * (upto > 0)
    suffix = (counts - (upto - member) if replicas else fromon) * (fromon > 0)
    return (up_to, prefix.max(axis=0)), (from_on, suffix.max(axis=0))


def _holds(sets: np.ndarray, times: np.ndarray, total: np.ndarray, most: np.ndarray, ceiling: float) -> np.ndarray:
    """(sets, stages): whether `total[s]` devices, at most `most[s, g]` of group g, can each run at most `ceiling` seconds of the
    work of the blocks in a set (its row of `sets`), a relaxation (messages left out, a block's work split at will).
    Counted in the fastest group's seconds: on one group n devices hold n ceilings; on several, group g's devices hold most
    of it with the blocks it runs fastest relative to the fastest group first (a fractional knapsack, `_held`), and the
    devices are taken by what each adds, which only decreases."""
    fast = times.min(axis=0)
    need = sets @ fast
    gains = [_held(sets, fast, times[g], int(most[:, g].max()), ceiling) for g in range(len(times))]
    holds = np.zeros((len(sets), len(total)), dtype=bool)
    for s, n in enumerate(total):
        pool = np.concatenate([gain[:, : most[s, g]] for g, gain in enumerate(gains)], axis=1)
        held = -np.sort(-pool, axis=1)[:, : int(n)].sum(axis=1)
        holds[:, s] = held >= need * (1 - 1e-9)
    return holds


def _held(sets: np.ndarray, fast: np.ndarray, time: np.ndarray, devices: int, ceiling: float) -> np.ndarray:
    """(sets, devices): the fastest group's seconds of each set's work that the n-th device of a group with these `time`s
    adds, at most `ceiling` of its own seconds each (greedy by fast / time is optimal for the fractional knapsack)."""
    budgets = np.arange(devices + 1) * ceiling * (1 + 1e-9)
    if np.array_equal(time, fast):  # the fastest group on every block (one group's): each device holds a whole ceiling
        return np.diff(np.minimum(budgets[None, :], (sets @ fast)[:, None]), axis=1)
    rate = np.divide(fast, time, out=np.ones_like(fast), where=time > 0)
    order = np.argsort(-rate, kind="stable")
    rate, members = rate[order], sets[:, order]
    spent = np.cumsum(np.where(members, time[order], 0.0), axis=1)
    done = np.cumsum(np.where(members, fast[order], 0.0), axis=1)
    rows, last = np.arange(len(sets)), len(order) - 1
    held = np.zeros((len(sets), devices + 1))
    for n in range(1, devices + 1):
        if budgets[n - 1] >= spent[:, -1].max():  # every set already held whole: the devices left add nothing
            held[:, n:] = done[:, -1:]
            break
        whole = (spent <= budgets[n]).sum(axis=1)  # the blocks wholly held; the next one in part
        before = np.maximum(whole - 1, 0)
        spent_before = np.where(whole > 0, spent[rows, before], 0.0)
        done_before = np.where(whole > 0, done[rows, before], 0.0)
        part = (budgets[n] - spent_before) * rate[np.minimum(whole, last)]
        held[:, n] = np.where(whole > last, done[:, -1], done_before + part)
    return np.diff(held, axis=1)


def _ceil(value: float) -> int:
    return int(math.ceil(value - 1e-9))


def _dot(x: list[dict[int, cp_model.IntVar]], s: int, weights: np.ndarray, rounding: Callable[[float], int]) -> cp_model.LinearExpr:
    """Sum over the blocks that can take stage s of x[b][s] * weights[b], each weight rounded."""
    return _weighted([(v[s], rounding(w - 1e-9)) for v, w in zip(x, weights) if s in v])


def _weighted(terms: list[tuple[cp_model.IntVar, int]]) -> cp_model.LinearExpr:
    """A linear expression of (variable, integer coefficient) terms, zero coefficients left out."""
    from ortools.sat.python import cp_model

    kept = [(v, c) for v, c in terms if c]
    return cp_model.LinearExpr.weighted_sum([v for v, _ in kept], [c for _, c in kept])
