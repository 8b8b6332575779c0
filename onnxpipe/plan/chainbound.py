"""A lower bound on the bottleneck from the graph's chain of clean gaps: it knows that a stage is
contiguous and runs on one device group, which the fractional work bound does not.

Reading order: `Segments` / `segments` (graph only, cached) -> `chain_bound` -> `_Chain` (per problem)
-> `_feasible` (the DP for one T) -> `_Chain.reach`.

Why it is valid:

1. Every stage of a plan is a difference of nested downsets of the compute-node DAG (data flows to the
   same or a later stage). A gap p of the topological order is CLEAN when every node after p has every
   node before p as an ancestor: then every downset lies inside the prefix or contains all of it, so
   clean gaps are the same in any topological order, and they cut the nodes into SEGMENTS whose stage
   ranges never overlap except at one shared stage per gap.
2. Dropping nodes only lowers stage times, so the bound may ignore some: nodes no path reaches from the
   first compute node (e.g. label preprocessing that depends on model inputs alone) are dropped when
   that leaves more segments. Ancestry stays the full graph's.
3. Map a plan to a walk over positions x = i + f (segments 0..i-1 done, fraction f of segment i done,
   measured in the work of one group g: the nodes of segment i taken so far, whichever stages took
   them, have at most f times the segment's work on g): a stage on g starting at x charges exactly its own
   work on g (any split of a segment between stages has the same total work on g). A position in g's work
   becomes one in h's (`_Chain.switch`) as the most h-work nodes of at most that g-work can have: a
   fractional knapsack over the segment's nodes, most work on h per work on g first (the nodes taking no
   time on g come first, so a stage ending at a segment's start that took none of it hands on the segment
   whole where each of its nodes takes time on g). The walk keeps a position in every group's work: after a
   stage on g, h's is the least of g's converted and, inside one segment, h's before plus the most h-work of
   nodes of at most the stage's own g-work (r * t), so a change of device type and back does not forget
   what the first stage took (`_Chain.after`). A later start never costs more, so the walk starting at
   the most the real plan can have reached stays feasible wherever the plan is. A segment of one node
   is never split, so a stage's reach is rounded down to the start of a one-node segment it would end
   inside (that node goes whole to a later stage). A stage then pays its charged work / r, the
   all-reduce of the parameters of the whole segments it covers (as `timemodel.allreduce_seconds`, over
   the micro-batches), the least latency of a message into its group when it starts after position 0
   and ends past max(start, 1) (some earlier node is then an ancestor of one of its nodes), and the
   least latency out of its group when it starts before the last segment and ends past its start but
   before the end (one of its nodes is then an ancestor of a later stage's). Every term is at most what
   `evaluate` charges, and none grows when the start moves later. A stage replicated over devices of
   several groups (data parallelism over the whole target, a baseline's replicas across a group
   boundary) costs `evaluate` its largest per-group work / r plus messages priced on its first
   device's links: it is bounded by every one of its groups' work / r with the least latency of any
   link and no all-reduce: its walk reaches, in each of its groups' work, at most what that group alone
   reaches, and the next stage starts at the least of those reaches converted to its own group.
4. For a given T the DP keeps, per (stages used, devices used per group, group of the last stage), the
   farthest position in each group's work (merging walks, the most of each: still at least where each of their
   plans is): a farther start never costs more, so farther dominates. T is feasible iff some
   walk of exactly `stages` stages (empty ones allowed) within the device counts reaches the end; the
   bound is the largest infeasible T found by bisection. Memory and recompute only add, so are ignored.
"""

from __future__ import annotations

import bisect
import itertools
import math
from dataclasses import dataclass

import numpy as np

from onnxpipe.plan.deadline import Deadline
from onnxpipe.pricing.problem import Problem

__all__ = ["Segments", "segments", "chain_bound"]

#: Bisection stops when the interval is this fraction of the starting upper bound.
_PRECISION = 1e-6


@dataclass(frozen=True, eq=False)
class Segments:
    """The compute nodes cut at clean gaps."""

    #: (nodes,) segment index of each node in topological order; -1 for a node the bound drops.
    of: np.ndarray
    #: Number of segments.
    count: int


#: Segments by graph fingerprint (the compute nodes and their edges); a handful of graphs at most.
_CACHE: dict[str, Segments] = {}
_CACHED_GRAPHS = 16


def segments(problem: Problem) -> Segments:
    """The problem's segments; they depend on the graph alone, so are computed once per graph."""
    key = problem.graph.fingerprint
    if key not in _CACHE:
        preds: list[list[int]] = [[] for _ in range(problem.n)]
        for p, consumers in zip(problem.tensor_producer, problem.tensor_consumers):
            if p >= 0:
                for c in consumers:
                    preds[int(c)].append(int(p))
        ancestors = _ancestors(preds)
        unreached = sum(1 << v for v in range(1, problem.n) if not ancestors[v] & 1)
        if len(_CACHE) >= _CACHED_GRAPHS:
            _CACHE.pop(next(iter(_CACHE)))
        _CACHE[key] = max((_cut(ancestors, dropped) for dropped in (0, unreached)), key=lambda s: s.count)
    return _CACHE[key]


def _ancestors(preds: list[list[int]]) -> list[int]:
    """Per node, its ancestors as a bitset (bit u set: node u is an ancestor)."""
    out: list[int] = []
    for v, ps in enumerate(preds):
        a = 0
        for u in ps:
            a |= out[u] | (1 << u)
        out.append(a)
    return out


def _cut(ancestors: list[int], dropped: int) -> Segments:
    """Segments of the kept nodes: gap p is clean iff every kept node v >= p has all kept nodes before
    p as ancestors, i.e. iff p <= e(v), e(v) the first position that is neither ancestor nor dropped."""
    n = len(ancestors)
    clean = np.zeros(n + 1, dtype=bool)
    reach = n
    for v in range(n - 1, -1, -1):
        if not dropped >> v & 1:
            a = ancestors[v] | dropped
            reach = min(reach, min(v, ((~a) & (a + 1)).bit_length() - 1))
        clean[v] = reach >= v
    kept = np.array([not dropped >> v & 1 for v in range(n)])
    index = np.cumsum(clean[:n] & kept) - 1
    return Segments(of=np.where(kept, index, -1), count=int(index[kept].max()) + 1)


def chain_bound(problem: Problem, stages: int, replicas: bool = True, deadline: Deadline | None = None) -> float:
    """Least bottleneck (seconds per micro-batch) of the chain relaxation; 0 when no walk fits. When `deadline`
    passes, the bisection's lower end so far: every bottleneck below it was proven infeasible, so it is a bound."""
    chain = _Chain(problem, segments(problem), replicas)
    high = min(chain.total(g) for g in range(len(chain.counts)))
    low = 0.0
    try:
        if not _feasible(chain, stages, high, deadline):
            return 0.0
        precision = _PRECISION * high  # of the starting upper bound: a bound near 0 ends too (no float underflow loop)
        while high - low > precision:
            mid = (low + high) / 2
            if _feasible(chain, stages, mid, deadline):
                high = mid
            else:
                low = mid
    except _OutOfTime:
        pass
    return low


class _OutOfTime(Exception):
    """The deadline passed inside a feasibility check (its answer unknown)."""


class _Chain:
    """Prefix sums per group (work) and per group and replica count (work / r + all-reduce slope)."""

    def __init__(self, problem: Problem, segs: Segments, replicas: bool) -> None:
        kept = segs.of >= 0
        of = segs.of[kept]
        work = (problem.forward + problem.backward)[:, kept]
        self.m = segs.count
        self.counts = [len(d) for d in problem.group_devices]
        self.most = [c if replicas else 1 for c in self.counts]
        groups = range(len(self.counts))
        self.seg_work = [np.bincount(of, weights=work[g], minlength=self.m) for g in groups]
        # A segment's trained parameters are surely all-reduced only where each of its nodes takes time on g:
        # then a stage covering it whole (in positions) holds every one of its nodes.
        timed = [np.bincount(of, weights=(work[g] <= 0).astype(float), minlength=self.m) == 0 for g in groups]
        params = np.bincount(of, weights=problem.trained[kept], minlength=self.m)
        self.prefix = [[0.0, *np.cumsum(w).tolist()] for w in self.seg_work]
        self.params = [[0.0, *np.cumsum(params * t).tolist()] for t in timed]
        self.seg = [w.tolist() for w in self.seg_work]
        #: Segments of one node: a stage holds all of it or none (its positions stay whole).
        self.atomic = (np.bincount(of, minlength=self.m) == 1).tolist()
        #: Per ordered pair of groups (g, h) and segment: the knapsack of `switch`, cumulative work on g and on h of
        #: the segment's nodes, most work on h per work on g first.
        self.knapsack = {(g, h): _knapsacks(of, work[g], work[h], self.m) for g in groups for h in groups if g != h}
        latency = problem.latency
        ok = [[self.counts[h] >= (2 if h == g else 1) for h in groups] for g in groups]
        self.lat_in = [min((float(latency[h, g]) for h in groups if ok[g][h]), default=0.0) for g in groups]
        self.lat_out = [min((float(latency[g, h]) for h in groups if ok[g][h]), default=0.0) for g in groups]
        links = [float(latency[g, h]) for g in groups for h in groups if ok[g][h]]
        #: Least latency of any message, for stages replicated over several groups.
        self.lat_any = min(links, default=0.0)
        self.allreduce: dict[tuple[int, int, bool], tuple[float, float, list[float]]] = {}
        for g in groups:
            for r in range(1, self.most[g] + 1):
                fixed, slope = problem.allreduce_affine(g, r) if r > 1 else (0.0, 0.0)
                fixed, slope = fixed / problem.microbatches, slope / problem.microbatches
                self.allreduce[g, r, True] = (fixed, slope, [w / r + slope * p for w, p in zip(self.prefix[g], self.params[g])])
            for r in range(2, sum(self.counts) + 1):
                self.allreduce[g, r, False] = (0.0, 0.0, [w / r for w in self.prefix[g]])

    def total(self, g: int) -> float:
        return self.prefix[g][-1]

    def covered(self, g: int, x: float) -> float:
        i = min(int(x), self.m - 1)
        return self.prefix[g][i] + (x - i) * self.seg[g][i]

    def reach(self, g: int, r: int, a: float, t: float, ring: bool = True) -> float:
        """Farthest position (a supremum) a stage on r replicas of g starting at a can cover within t;
        `ring` False: the stage's replicas span several groups (no all-reduce, any link's latency)."""
        m = self.m
        lat_in = (self.lat_in[g] if ring else self.lat_any) if a > 0 else 0.0
        lat_out = (self.lat_out[g] if ring else self.lat_any) if a < m - 1 else 0.0
        if self._cost(g, r, a, m, ring) + (lat_in if m > max(a, 1.0) else 0.0) <= t:
            return float(m)
        early = min(max(a, 1.0), self._solve(g, r, a, t - lat_out, ring))
        return self._whole(a, min(float(m), max(a, early, self._solve(g, r, a, t - lat_in - lat_out, ring))))

    def _whole(self, a: float, y: float) -> float:
        """`y` rounded down to the start of a one-node segment it ends inside (never below `a`)."""
        i = int(y)
        return max(a, float(i)) if i < self.m and y > i and self.atomic[i] else y

    def switch(self, g: int, h: int, x: float) -> float:
        """A position in g's work as one in h's: the most h-work that nodes of at most that g-work in its segment can
        have (module docstring, 3)."""
        i = int(x)
        if i >= self.m:
            return x
        return self._in(h, i, self._most(g, h, i, (x - i) * self.seg[g][i]))

    def after(self, g: int, h: int, y: float, x: float, work: float) -> float:
        """Where a stage on g that reached `y` (in g's work) with at most `work` on g leaves a position that was `x` in
        h's work: the least of `switch` at y and, when y is inside a segment, the most h-work that segment's nodes taken
        before (x, or none) and by the stage (a knapsack of `work`) can have."""
        best = self.switch(g, h, y)
        i = int(y)
        if i < self.m:
            best = min(best, self._in(h, i, max(x - i, 0.0) * self.seg[h][i] + self._most(g, h, i, work)))
        return best

    def _most(self, g: int, h: int, i: int, budget: float) -> float:
        """Most work on h of nodes of segment i with at most `budget` work on g, fractionally."""
        on_g, on_h = self.knapsack[g, h][i]
        j = bisect.bisect_right(on_g, budget) - 1  # whole items that fit; on_g[0] == 0.0
        taken = on_h[j]
        if j + 1 < len(on_g):
            taken += (on_h[j + 1] - on_h[j]) * (budget - on_g[j]) / (on_g[j + 1] - on_g[j])
        return taken

    def _in(self, h: int, i: int, work: float) -> float:
        """The position `work` of h's work into segment i."""
        return i + min(1.0, work / self.seg[h][i]) if self.seg[h][i] > 0 else i + 1.0

    def _cost(self, g: int, r: int, a: float, y: float, ring: bool) -> float:
        fixed, slope, _ = self.allreduce[g, r, ring]
        first, last = math.ceil(a), math.floor(y)
        params = self.params[g][last] - self.params[g][first] if last > first else 0.0
        return (self.covered(g, y) - self.covered(g, a)) / r + (fixed + slope * params if params > 0 else 0.0)

    def _solve(self, g: int, r: int, a: float, budget: float, ring: bool) -> float:
        """Farthest y >= a with work / r + all-reduce <= budget (a when budget < 0)."""
        if budget < 0:
            return a
        prefix, seg, params = self.prefix[g], self.seg[g], self.params[g]
        first = math.ceil(a)
        start = self.covered(g, a)
        # No whole segment with parameters: up to the first such segment's end, work alone.
        free = bisect.bisect_right(params, params[min(first, self.m)]) - 1
        y = self._inverse(prefix, seg, start + budget * r)
        best = min(y, float(free + 1)) if free < self.m else y
        fixed, slope, q = self.allreduce[g, r, ring]
        rest = budget - fixed + start / r + slope * params[min(first, self.m)]
        j = bisect.bisect_right(q, rest) - 1
        if j >= first and j >= 0:
            if j >= self.m:
                return float(self.m)
            step = seg[j] / r
            best = max(best, j + (min(1.0, (rest - q[j]) / step) if step > 0 else 1.0))
        return max(a, best)

    def _inverse(self, prefix: list[float], seg: list[float], c: float) -> float:
        j = bisect.bisect_right(prefix, c) - 1
        if j >= self.m:
            return float(self.m)
        return j + (min(1.0, (c - prefix[j]) / seg[j]) if seg[j] > 0 else 1.0)


#: The last group of a stage replicated over several groups.
_MIXED = -2


def _feasible(chain: _Chain, stages: int, t: float, deadline: Deadline | None = None) -> bool:
    """Some walk of exactly `stages` stages within the device counts covers every segment in time t
    (`_OutOfTime` when `deadline` passes first: it is read once per state of the walk)."""
    devices = sum(chain.counts)
    groups = range(len(chain.counts))
    mixes = _mixes(chain) if len(chain.counts) > 1 and max(chain.most) > 1 else ()
    #: (devices used per group, group of the last stage) -> the position in each group's work (module docstring, 3-4).
    level: dict[tuple[tuple[int, ...], int], tuple[float, ...]] = {((0,) * len(chain.counts), -1): (0.0,) * len(chain.counts)}
    for j in range(stages):
        nxt: dict[tuple[tuple[int, ...], int], tuple[float, ...]] = {}
        spare = devices - (stages - j - 1)

        def keep(used: tuple[int, ...], last: int, x: tuple[float, ...], ends: dict[int, float], r: int) -> None:
            # Each group's position: the least that any of the stage's groups' reaches implies (the stage does at most
            # r * t of work on each); a merged state the most of each.
            y = tuple(min(e if g == h else chain.after(g, h, e, x[h], r * t) for g, e in ends.items()) for h in groups)
            kept = nxt.get((used, last))
            nxt[used, last] = y if kept is None else tuple(map(max, kept, y))

        for (used, _), x in level.items():
            if deadline is not None and deadline.passed():
                raise _OutOfTime
            for g in groups:
                for r in range(1, min(chain.most[g], chain.counts[g] - used[g]) + 1):
                    if sum(used) + r > spare:
                        break
                    y = chain.reach(g, r, x[g], t)
                    if y >= chain.m:
                        return True
                    keep(used[:g] + (used[g] + r,) + used[g + 1:], g, x, {g: y}, r)
            for mix in mixes:
                if sum(used) + sum(mix) > spare or any(u + c > n for u, c, n in zip(used, mix, chain.counts)):
                    continue
                ends = {g: chain.reach(g, sum(mix), x[g], t, ring=False) for g in groups if mix[g]}
                if min(ends.values()) >= chain.m:
                    return True
                keep(tuple(u + c for u, c in zip(used, mix)), _MIXED, x, ends, sum(mix))
        level = nxt
    return False


def _knapsacks(of: np.ndarray, on_g: np.ndarray, on_h: np.ndarray, segments: int) -> list[tuple[list[float], list[float]]]:
    """Per segment: cumulative work on g and on h of its nodes (from 0.0), in order of most work on h per work on g
    (nodes with none on g first)."""
    out = []
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(segments + 1))
    for i in range(segments):
        nodes = order[bounds[i]:bounds[i + 1]]
        a, b = on_g[nodes], on_h[nodes]
        ratio = np.divide(b, a, out=np.full(len(a), np.inf), where=a > 0)
        rank = np.argsort(-ratio, kind="stable")
        out.append(([0.0, *np.cumsum(a[rank]).tolist()], [0.0, *np.cumsum(b[rank]).tolist()]))
    return out


def _mixes(chain: _Chain) -> list[tuple[int, ...]]:
    """Device counts per group of a stage replicated over two or more groups."""
    return [mix for mix in itertools.product(*(range(c + 1) for c in chain.counts)) if sum(1 for c in mix if c) >= 2]
