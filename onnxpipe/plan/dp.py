"""Dynamic program over contiguous runs of blocks (PipeDream-style, extended with device groups,
replication and recompute): the exact minimum bottleneck among partitions that cut the topological
order into intervals, under the planner's stage-time model. Fast; its answer warm-starts CP-SAT.

Stage-time model: the pricing rule (`onnxpipe.pricing.stage`) over prefix sums of the blocks, with one
difference: each stage's group and the next one's are chosen together, and what a stage sends is priced on the
link to the next stage's group, what it receives on the link from the one before, as if every message went to the
next stage (exact on a chain; a tensor skipping stages is priced on those links instead of its own). Priced on the
slowest link leaving its group instead, as before, every stage but the last paid the slow link between device
types: node by node over GPT-2's export at 8 heterogeneous stages the DP's plan was 36.06 ms instead of 35.48 (the
optimum, four U280 stages then four V100 ones, is 35.34), over LLaMA's 33.34 instead of the optimal 30.76.

Reading order: `Intervals` / `intervals` -> `solve_dp` -> `_stage_times` -> `_backtrack`.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import numpy as np

from onnxpipe.plan.coarsen import Blocks
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.layout import Layout, replica_choices
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.stage import activation_bytes, held, message_seconds, seconds_per_microbatch, state_bytes

__all__ = ["Intervals", "intervals", "solve_dp"]


@dataclass(frozen=True, eq=False)
class Intervals:
    """Matrices indexed [i, j] for the stage made of blocks i..j-1."""

    in_bytes: np.ndarray
    in_count: np.ndarray
    #: Received bytes plus model inputs read: what a recomputing stage stashes.
    stash_bytes: np.ndarray
    out_bytes: np.ndarray
    out_count: np.ndarray
    #: (groups, i, j) forward seconds what the stage sends and receives costs it (`Blocks.crossing_sent`,
    #: `crossing_received`); (groups, 1, 1) zeros when nothing crossing costs any.
    crossing: np.ndarray


def intervals(blocks: Blocks) -> Intervals:
    nb = blocks.count
    shape = (nb + 2, nb + 2)
    groups = len(blocks.crossing_sent)
    costly = bool(blocks.crossing_sent.any() or blocks.crossing_received.any())
    in_b, in_c, stash, out_b, out_c = (np.zeros(shape) for _ in range(5))
    crossing = np.zeros((groups, *shape)) if costly else np.zeros((groups, 1, 1))
    for t, (pb, nbytes, cbs) in enumerate(zip(blocks.producer, blocks.nbytes, blocks.consumers)):
        lows = np.concatenate([[pb], cbs[:-1]]) + 1
        cols = cbs + 1
        # received, or read as a model input (a derived tensor the stage makes): `Blocks.crossing_received` either way
        received = tuple((crossing[g], blocks.crossing_received[g, t]) for g in range(groups)) if costly else ()
        for m, w in ((stash, nbytes), *received) + (((in_b, nbytes), (in_c, 1.0)) if pb >= 0 else ()):
            np.add.at(m, (lows, cols), w)
            np.add.at(m, (cols, cols), -w)
        if pb >= 0:
            last = cbs[-1]
            sent = [(crossing[g], blocks.crossing_sent[g, t]) for g in range(groups)] if costly else []
            for m, w in ((out_b, nbytes), (out_c, 1.0), *sent):
                m[0, pb + 1] += w
                m[0, last + 1] -= w
                m[pb + 1, pb + 1] -= w
                m[pb + 1, last + 1] += w

    def done(m: np.ndarray) -> np.ndarray:
        return np.cumsum(np.cumsum(m, axis=-2), axis=-1)[..., : nb + 1, : nb + 1]

    return Intervals(done(in_b), done(in_c), done(stash), done(out_b), done(out_c), done(crossing) if costly else crossing)


def solve_dp(
    problem: Problem,
    blocks: Blocks,
    stages: int,
    recompute: str = "auto",
    replicas: bool = True,
    in_order: bool = False,
    table: Intervals | None = None,
    deadline: Deadline | None = None,
) -> Layout | None:
    """The best interval partition into `stages` stages, or None when none fits in memory (or the deadline
    passes first: it is read once per stage).

    `in_order` places stages on devices in target order (a planner blind to heterogeneity)."""
    table = table or intervals(blocks)
    nb = blocks.count
    counts = tuple(len(d) for d in problem.group_devices)
    total = sum(counts)
    flights = problem.flights(stages)
    prefix = _prefix(blocks)
    groups = len(counts)
    # A state: (devices used per group, the last stage's group, the next stage's group, on whose link the last stage's
    # messages out were priced).
    layers: list[dict[tuple[tuple[int, ...], int, int], tuple[np.ndarray, np.ndarray, list]]] = []
    start = np.full(nb + 1, np.inf)
    start[0] = 0.0
    current = {((0,) * groups, -1, g): (start, np.zeros(nb + 1, dtype=np.int64)) for g in range(groups)}
    cache: dict = {}
    grid = [_grid(c) for c in counts]
    for s in range(stages):
        if deadline is not None and deadline.passed():
            return None
        last = s == stages - 1
        nxt: dict[tuple[tuple[int, ...], int, int], tuple[np.ndarray, np.ndarray, list]] = {}
        for (used, gp, g), (best, _) in current.items():
            if not np.isfinite(best).any() or (problem.stage_groups and g != problem.stage_groups[s]):
                continue
            spare = total - sum(used) - (stages - s - 1)
            after = [g] if last else [problem.stage_groups[s + 1]] if problem.stage_groups else range(groups)
            for r in _replica_counts(counts, used, g, spare, replicas, in_order):
                for gn in after:
                    times = _stage_times(problem, blocks, table, prefix, cache, g, r, gp, gn, flights[s], recompute)
                    cand = np.maximum(best[:, None], times)
                    if last:
                        cand[:, :nb] = np.inf
                    arg = np.argmin(cand, axis=0)
                    value = cand[arg, np.arange(nb + 1)]
                    key = (_using(used, g, r, grid[g], total - (stages - s - 1)), g, gn)
                    entry = nxt.get(key)
                    if entry is None:
                        nxt[key] = (value, arg, [(used, gp, r)] * (nb + 1))
                        continue
                    better = np.flatnonzero(value < entry[0])
                    entry[0][better] = value[better]
                    entry[1][better] = arg[better]
                    for j in better:
                        entry[2][j] = (used, gp, r)
        layers.append(nxt)
        current = {key: (v[0], v[1]) for key, v in nxt.items()}
    finals = [(v[0][nb], key) for key, v in layers[-1].items() if np.isfinite(v[0][nb])]
    if not finals:
        return None
    return _backtrack(problem, blocks, table, prefix, cache, layers, min(finals)[1], flights, recompute)


def _grid(count: int) -> list[int]:
    """Per device count u of a group: the least replica choice at or above it (u itself up to `EXACT_REPLICAS` devices)."""
    choices = replica_choices(count, count)
    return [choices[bisect.bisect_left(choices, u)] if u else 0 for u in range(count + 1)]


def _using(used: tuple[int, ...], g: int, r: int, grid: list[int], most: int) -> tuple[int, ...]:
    """Devices used per group once a stage takes r of group g: on a group of over `EXACT_REPLICAS` devices, rounded up to a
    replica choice (`_grid`) while that leaves each later stage a device (`most` in all). Sums of its choices (8 + 7,
    8 + 7 + 8, ...) gave the DP a state per device count: transformer-tiny at 4 stages on 1,000 devices took 75,000 stage
    choices, 2.2 s. A plan so found uses fewer devices than its state counts, so it holds."""
    exact = used[g] + r
    rounded = grid[exact]
    taken = rounded if sum(used) + r - exact + rounded <= most else exact
    return used[:g] + (taken,) + used[g + 1:]


def _replica_counts(counts: tuple[int, ...], used: tuple[int, ...], g: int, spare: int, replicas: bool, in_order: bool) -> tuple[int, ...]:
    """The replica counts a stage on group g may take (none in target order while an earlier group has devices left)."""
    if in_order and any(u < c for u, c in zip(used[:g], counts[:g])):
        return ()
    return replica_choices(counts[g], min(counts[g] - used[g], spare) if replicas else min(1, counts[g] - used[g]))


@dataclass(frozen=True)
class _Prefix:
    forward: np.ndarray
    backward: np.ndarray
    params: np.ndarray
    activations: np.ndarray
    trained: np.ndarray
    random: np.ndarray


def _prefix(blocks: Blocks) -> _Prefix:
    def cum(a: np.ndarray) -> np.ndarray:
        return np.concatenate([np.zeros(a.shape[:-1] + (1,)), np.cumsum(a, axis=-1)], axis=-1)

    return _Prefix(cum(blocks.forward), cum(blocks.backward), cum(blocks.params), cum(blocks.activations), cum(blocks.trained),
                   cum(blocks.random.astype(float)))


def _span(prefix: np.ndarray) -> np.ndarray:
    return prefix[None, :] - prefix[:, None]


def _stage_times(problem, blocks, table, prefix, cache, g, r, gp, gn, flight, recompute, with_choice=False):  # type: ignore[no-untyped-def]
    """(blocks+1, blocks+1) seconds per micro-batch of a stage i..j-1 on group g after one on gp, before one on gn (inf
    where invalid or too big). What the choices share is built once (`cache`): the spans per group, the times kept per
    (group, replicas, neighbours), the memory masks per (group, micro-batches held), so each choice costs two
    whole-matrix steps (the DP over BERT-base's export node by node at 8 heterogeneous stages: 132 of them). Where every
    stage keeps its activations within memory (`_Fits.binding` False) a choice's times are those kept times themselves,
    not a copy, and recomputing times are made only where some stage needs them: node by node at 8 heterogeneous stages
    the DP took 52 MiB over BERT-base's export (439 nodes) instead of 83, 64 over ViT-B/16's (500) instead of 104."""
    key = (g, r, gp, gn, flight, recompute, with_choice)
    if key in cache:
        return cache[key]

    def once(name, make):  # type: ignore[no-untyped-def]
        if name not in cache:
            cache[name] = make()
        return cache[name]

    trained = once("trained", lambda: _span(prefix.trained))
    spans = once("spans", lambda: _Spans.of(problem, prefix, trained))

    def forward() -> np.ndarray:
        return once(("forward", g), lambda: _span(prefix.forward[g]) + table.crossing[g]) / r

    def kept() -> np.ndarray:
        backward = once(("backward", g), lambda: _span(prefix.backward[g])) / r
        comm = message_seconds(table.in_count * problem.latency[gp, g], table.in_bytes, r, problem.bandwidth[gp, g]) if gp >= 0 else 0.0
        comm = comm + message_seconds(table.out_count * problem.latency[g, gn], table.out_bytes, r, problem.bandwidth[g, gn])
        a0, a1 = problem.allreduce_affine(g, r)
        allreduce = np.where(trained > 0, a0 + a1 * trained, 0.0) if r > 1 else 0.0
        return np.where(spans.valid, seconds_per_microbatch(forward(), backward, comm, allreduce, problem.microbatches), np.inf)

    keep = once(("keep", g, r, gp, gn), kept)  # inf where no stage
    fits = once(("fits", g, held(flight, r), recompute), lambda: spans.fitting(problem.capacity[g], held(flight, r), table.stash_bytes, recompute))
    if not fits.binding:
        times = keep
    else:
        # Recomputing runs the forward again in backward (`recomputed_backward`): one more forward. It never costs less
        # than keeping, so a stage recomputes only where keeping does not fit.
        again = np.where(fits.recompute, keep + forward(), np.inf) if fits.recompute.any() else np.inf
        times = np.where(fits.keep, keep, again)
    cache[key] = (times, fits.recompute & ~fits.keep) if with_choice else times
    return cache[key]


@dataclass(frozen=True)
class _Fits:
    """Where a stage fits in memory keeping its activations, and where recomputing (each within the stages that may be)."""

    keep: np.ndarray
    recompute: np.ndarray
    #: Some stage that may be does not fit keeping its activations.
    binding: bool


@dataclass(frozen=True)
class _Spans:
    """Per stage i..j-1 (matrices as `Intervals`): the bytes held whatever the policy, and where a stage may be."""

    state: np.ndarray
    activations: np.ndarray
    valid: np.ndarray  # j > i
    may_recompute: np.ndarray  # valid, and no node draws random numbers (`Problem.random`)

    @staticmethod
    def of(problem: Problem, prefix: _Prefix, trained: np.ndarray) -> _Spans:
        valid = ~np.tril(np.ones_like(trained, dtype=bool))
        return _Spans(state_bytes(_span(prefix.params), trained, problem.optimizer_states, problem.training),
                      _span(prefix.activations), valid, valid & ~(_span(prefix.random) > 0))

    def fitting(self, capacity: float, mine: int, stash: np.ndarray, recompute: str) -> _Fits:
        """Where a stage holding `mine` micro-batches per replica fits in `capacity` keeping its activations, and where
        recomputing."""
        never = np.zeros_like(self.valid)
        keep = self.valid & (self.state + activation_bytes(mine, self.activations, stash, False) <= capacity) if recompute != "always" else never
        again = self.may_recompute & (self.state + activation_bytes(mine, self.activations, stash, True) <= capacity) if recompute != "never" else never
        return _Fits(keep, again, bool((self.valid & ~keep).any()))


def _backtrack(problem, blocks, table, prefix, cache, layers, key, flights, recompute) -> Layout:  # type: ignore[no-untyped-def]
    nb = blocks.count
    k = len(layers)
    block_stage = np.zeros(nb, dtype=np.int64)
    groups, reps, rcs = [0] * k, [0] * k, [False] * k
    j = nb
    for s in range(k - 1, -1, -1):
        value, arg, source = layers[s][key]
        i = int(arg[j])
        used, gp, r = source[j]
        g, gn = key[1], key[2]
        _, choose_rc = _stage_times(problem, blocks, table, prefix, cache, g, r, gp, gn, flights[s], recompute, with_choice=True)
        block_stage[i:j] = s
        groups[s], reps[s], rcs[s] = g, r, bool(choose_rc[i, j])
        key, j = (used, gp, g), i
    return Layout(block_stage=block_stage, groups=tuple(groups), replicas=tuple(reps), recompute=tuple(rcs))
