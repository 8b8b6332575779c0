"""A lower bound on the bottleneck from the graph's chain of clean gaps: it knows that a stage is
contiguous and runs on one device group, which the fractional work bound does not.

Reading order: `Segments` / `segments` (graph only, cached) -> `chain_bound` -> `_Chain` (per problem, cached: `_chain_of`)
-> `_feasible` (the DP for one T) -> `_Chain.reach` -> `_Chain._reach_paying` -> `_Chain._stop`; `_Cuts` / `_cuts` (per
problem, cached) -> `_least_cut` -> `_ends` -> `_Messages` -> `_Messages.stops` -> `_Priced`.

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
   the most the real plan can have reached stays feasible wherever the plan is. What the stages up to one
   ending inside segment i hold of it is a downset of the segment, so that stage's reach is rounded down to
   the most work on its group that a downset has within it (`Segments.downsets`, `_Chain._attained`; a
   one-node segment goes whole to a later stage; LLaMA's gate and up projections, each half of its
   feed-forward segment's work on a U280, are taken one by one: its bound at 8 heterogeneous stages rose
   1.4%). A stage then pays its charged work / r, the
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
   bound is the largest infeasible T found by bisection. Recompute only adds, so is ignored; memory: 6.
5. A stage on one group also pays for the messages it must receive and send (`_Chain._reach_paying`), each tensor on the
   cheapest link from a group some earlier stage runs on (to one a later stage may run on: the DP's state holds the
   devices used), at those links' least latency and most bandwidth. Say the stage starts in segment i and ends in
   segment j (their nodes not all done when it starts, ends). If i < j, it holds the rest of segment i after a part D done
   before (a downset of the segment, maybe empty), so it receives at least what that rest reads from before the segment
   or from D (`_Cuts.into`: a minimum cut over D, and no less than what its first node reads); and it holds a last node
   of segment j - 1 and a part E of segment j (a downset, maybe empty, never all of it), so it sends at least what those
   write that is read outside E (`_Cuts.out`: a minimum cut over E, and no less than what its last node writes); where
   the walk's start is at or before segment j - 1's, the plan's stage holds all of it, and what every node of it writes
   that segment j or a later one reads counts (`_Cuts.whole`); and it holds the segments between i and j whole, so it also
   receives every tensor written before segment i that one of them reads (and segment i does not), and sends every tensor
   written in one of them but the last that a segment after j reads (`_Skips`: the residual stream around a
   normalisation, an attention mask). Where segment j's downsets are listed, each E is charged its own sends
   (`_Cuts.ends`): the stage ends at the farthest E whose work and sends fit (`_Messages.stops`; an E both nearer and
   dearer than another never does), where the least over E charged every end alike (a stage of BERT-base's export ending
   after a layer's query and key projections sends both and the layer norm's output that the value projection reads, not
   one tensor; one holding the whole segment before the attention node sends the values and the attention probabilities,
   not the smaller alone). If i = j, it receives what its first node reads and sends what its last node writes
   (`_Cuts.first`, `last`), and ends before the segment's end (one holding it whole ends in a later segment, charged
   there); starting at the segment's start, the plan's stage starts there too (it receives what its first node reads and
   sends what E writes that is read outside E) or in an earlier segment (it holds a last node of segment j - 1 and E).
   Only what kept nodes write counts (a dropped node may sit in any stage; what a kept node writes only kept nodes read).
   The walk's start is at or past the plan's (3), whose stage may start in an earlier segment i'; it then also does the
   work from the end of i' to the walk's start, and that of a last node of i', which the charge takes off
   (`_Priced.skipped`; the tensors skipping segment i' are not counted then). Only where every node takes time on the
   group do positions tell which segments are done: elsewhere its stages pay latencies alone. The charge changes with
   the end's segment, so the farthest end is found segment by segment down from (3)'s reach, which it never exceeds. A
   stage ending in a one-node segment holds none of it (E is empty), so it ends at that segment's start: one holding the
   node whole ends in a later segment and pays that one's charge, what the node sends included (charged as ending inside
   the segment, a stage of GPT-2's export ending after a layer norm was charged for the norm's input alone, not for both
   tensors it must send: the bound at 8 heterogeneous stages rose 0.33%, to 34.60 ms of the optimal 35.34). With each end
   charged its own sends, GPT-2's bound there is 34.90 ms, LLaMA's 29.49 (29.01 before; optimal 30.76), BERT-base's
   22.92 (22.57; optimal 24.41), and fewer patterns of device types reach the optimal plans (LLaMA 47 of 70 instead of
   61, BERT-base 31 instead of 35).
6. The bound holds for the plans that fit in memory. Each device of a stage holds every node of the segments the stage
   covers whole: their parameter state and at least one micro-batch of their activations (every replica holds the
   state, and a recomputing stage still holds one micro-batch's activations: `pricing.stage`), within its group's
   memory (`_Chain._fitting`; a stage replicated over several groups is not held to it). The walk's start is at or
   past the plan's, so the plan's stage holds whole the segments from the walk's start to its own end, where every
   node takes time on the group (as for the all-reduce, 3): they fit, and the walk's stage may reach as far. Where
   memory keeps the fastest group from taking everything, the bisection starts from a time some walk fits in (none: 0).
7. A group of more than `EXACT_REPLICAS` devices (1,000 accelerators) would give the DP a state per device count and a
   step per replica count. There a stage's replica count r is known only within a
   RUNG [lo, hi] (every count up to `EXACT_REPLICAS` its own; beyond, hi / lo at most 1 + 1 / `_RUNG`): the stage
   uses lo devices, divides its work and messages by hi and pays the least all-reduce of any count in the rung, and
   the devices used are rounded down to a rung's lo. Each step only lowers what a real r charges or uses, so the walk
   of every plan stays feasible; with no group that large, every rung is one count and nothing changes. On one group
   the DP also drops each state that a state using fewer devices reaches past (`_undominated`: it can do all the
   other can). The 4-stage bound of transformer-tiny on 1,000 accelerators: 0.0606 ms in 1.1 s instead of 19 s with
   every count; with neither, 57 s already at 300 devices.
"""

from __future__ import annotations

import bisect
import itertools
import math
import weakref
from dataclasses import dataclass

import networkx as nx
import numpy as np

from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.layout import EXACT_REPLICAS
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.stage import message_seconds, state_bytes

__all__ = ["Segments", "segments", "chain_bound", "fits_in_memory", "ending_prefixes"]

#: Bisection stops when the interval is this fraction of the starting upper bound.
_PRECISION = 1e-6
#: Beyond `EXACT_REPLICAS`, a rung of replica counts spans at most this fraction of its least (module docstring, 7).
_RUNG = 8


@dataclass(frozen=True, eq=False)
class Segments:
    """The compute nodes cut at clean gaps."""

    #: (nodes,) segment index of each node in topological order; -1 for a node the bound drops.
    of: np.ndarray
    #: Number of segments.
    count: int
    #: Per segment, its downsets (each a row: which of its nodes, in order, it holds); None where there are more than
    #: `MOST_DOWNSETS` (a stage's end is then only known to be where its work is, fractionally).
    downsets: tuple[np.ndarray | None, ...]


#: The most downsets of one segment that `segments` lists: LLaMA's export has 4,004 in each attention segment, BERT-base's
#: 295, GPT-2's 99; the decoder segment of T5-small's (its cross-attention reads the encoder's output) over 100,000.
MOST_DOWNSETS = 4096
#: The most steps (a node checked against the nodes before it, or joining a downset found) `segments` takes listing one
#: segment's downsets: a long segment with few downsets (a chain beside one node) is given up too, within a few
#: milliseconds. LLaMA's attention segments take 57,752.
_DOWNSET_STEPS = 64 * MOST_DOWNSETS

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
        of, count = max((_cut(ancestors, dropped) for dropped in (0, unreached)), key=lambda cut: cut[1])
        _CACHE[key] = Segments(of=of, count=count, downsets=tuple(_downsets(ancestors, nodes) for nodes in _members(of, count)))
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


def _cut(ancestors: list[int], dropped: int) -> tuple[np.ndarray, int]:
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
    return np.where(kept, index, -1), int(index[kept].max()) + 1


def _downsets(ancestors: list[int], nodes: np.ndarray) -> np.ndarray | None:
    """The downsets of `nodes` (topologically ordered) under the graph's ancestry, or None past `MOST_DOWNSETS` or
    `_DOWNSET_STEPS`: each node joins every downset holding its ancestors among them, so each is made once."""
    found, steps = [0], 0
    for b, v in enumerate(nodes):
        steps += b + len(found)
        if steps > _DOWNSET_STEPS:
            return None
        needs = sum(1 << c for c, u in enumerate(nodes[:b]) if ancestors[v] >> int(u) & 1)
        found += [d | 1 << b for d in found if d & needs == needs]
        if len(found) > MOST_DOWNSETS:
            return None
    width = (len(nodes) + 7) // 8
    rows = np.frombuffer(b"".join(d.to_bytes(width, "little") for d in found), dtype=np.uint8).reshape(len(found), width)
    return np.unpackbits(rows, axis=1, bitorder="little")[:, : len(nodes)].astype(bool)


def chain_bound(problem: Problem, stages: int, replicas: bool = True, deadline: Deadline | None = None, share: float = 1.0) -> float:
    """Least bottleneck (seconds per micro-batch) of the chain relaxation; 0 when no walk fits. When `deadline`
    passes, the bisection's lower end so far: every bottleneck below it was proven infeasible, so it is a bound. The
    bisection takes at most `share` of the deadline's budget, counted from when it starts; the chain it walks is built
    before, once per problem (`_chain_of`). Counted from before, the share could run out while the chain's cuts were
    found and the bound was 0: on a slow machine, the 10,000-node transformer on hetero at 8 stages planned in 10 s took
    0.45 s to build its chain against a share of 0.3 s, and the work bound was reported, 18.8% below the plan, instead
    of the chain bound's 0.19%."""
    chain = _chain_of(problem, replicas)
    deadline = deadline.within(share) if deadline is not None else None
    high = min(chain.total(g) for g in range(len(chain.counts)))
    low = 0.0
    try:
        if not _feasible(chain, stages, high, deadline):
            # No stage on the fastest group holds it all in memory: doubling finds a time some walk fits in, if any does.
            if not _feasible(chain, stages, math.inf, deadline):
                return 0.0
            while True:
                low, high = high, 2 * high
                if _feasible(chain, stages, high, deadline):
                    break
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


def fits_in_memory(problem: Problem, stages: int, replicas: bool = True) -> bool:
    """Whether some walk of `stages` stages holds the segments each stage covers whole in its device's memory (module
    docstring, 6): where none does, no plan of that many stages fits, whatever its cuts and recompute."""
    return _feasible(_chain_of(problem, replicas), stages, math.inf)


#: The most steps (a walk's next stage, on one group and replica count) `ending_prefixes` takes from one stage's walks
#: before it gives up (None): many device types, or groups of many devices (8 stages over 4 + 4 devices: at most 1,024).
MOST_STEPS = 4096


def ending_prefixes(problem: Problem, stages: int, ceiling: float, replicas: bool = True) -> set[tuple[int, ...]] | None:
    """The sequences of device groups of a first few stages (each stage on one group) whose walk reaches the end within
    `ceiling`, later stages left empty: a plan whose stages' groups begin with none of them has no bottleneck within it,
    since the walk of a plan on its own groups stays feasible (module docstring, 3-6). None when the steps from one
    stage's walks would be more than `MOST_STEPS`. Kept per sequence of groups so far (`_feasible` merges them across
    sequences, so its bound is the best sequence's); the walks of one sequence are merged into the farthest positions
    and the fewest devices used of each group, which only lets more through."""
    chain = _chain_of(problem, replicas)
    groups = range(len(chain.counts))
    devices = sum(chain.counts)
    ended: set[tuple[int, ...]] = set()
    #: groups so far -> (position in each group's work, devices used of each group)
    level: dict[tuple[int, ...], tuple[tuple[float, ...], tuple[int, ...]]] = {(): ((0.0,) * len(chain.counts), (0,) * len(chain.counts))}
    steps = sum(len(r) for r in chain.rungs)
    for j in range(stages):
        if len(level) * steps > MOST_STEPS:
            return None
        nxt: dict[tuple[int, ...], tuple[tuple[float, ...], tuple[int, ...]]] = {}
        spare = devices - (stages - j - 1)
        for prefix, (x, used) in level.items():
            before = tuple(u > 0 for u in used)
            for g in groups:
                for lo, r in chain.rungs[g]:
                    if lo > chain.counts[g] - used[g] or sum(used) + lo > spare:
                        break
                    after = tuple(n - u - (lo if h == g else 0) > 0 for h, (u, n) in enumerate(zip(used, chain.counts)))
                    y = chain.reach(g, r, x[g], ceiling, before=before, after=after)
                    key = prefix + (g,)
                    if y >= chain.m:
                        ended.add(key)
                        continue
                    walk = (tuple(y if h == g else chain.after(g, h, y, x[h], r * ceiling) for h in groups),
                            used[:g] + (chain.floor[g][used[g] + lo],) + used[g + 1:])
                    kept = nxt.get(key)
                    nxt[key] = walk if kept is None else (tuple(map(max, kept[0], walk[0])), tuple(map(min, kept[1], walk[1])))
        level = nxt
    return ended


_CHAINS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _chain_of(problem: Problem, replicas: bool) -> _Chain:
    """The chain of a problem, built once per `replicas`: its cuts' max-flows and knapsacks take longer than a bisection
    over it (the 10,000-node transformer on hetero: 0.37 s against about 0.1 s), and bounds are asked of many stage counts."""
    chains = _CHAINS.setdefault(problem, {})
    if replicas not in chains:
        chains[replicas] = _Chain(problem, segments(problem), replicas)
    return chains[replicas]


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
        # The least memory a device of a stage holds for each node: its parameter state and one micro-batch of its
        # activations (`pricing.stage`: every replica holds the state; recompute still holds one micro-batch's).
        least = state_bytes(problem.params, problem.trained, problem.optimizer_states, problem.training) + problem.activations
        held = np.bincount(of, weights=least[kept], minlength=self.m)
        self.memory = [[0.0, *np.cumsum(held * t).tolist()] for t in timed]
        self.capacity = problem.capacity.tolist()
        self.seg = [w.tolist() for w in self.seg_work]
        #: Per group and segment: the work on the group of each of the segment's downsets but the whole segment, ascending;
        #: None where they are too many to list (`Segments.downsets`).
        members = _members(of, self.m)
        self.attained = [[None if d is None else _short_of_whole(d @ work[g][nodes]) for d, nodes in zip(segs.downsets, members)]
                         for g in groups]
        #: Per ordered pair of groups (g, h) and segment: the knapsack of `switch`, cumulative work on g and on h of
        #: the segment's nodes, most work on h per work on g first.
        self.knapsack = {(g, h): _knapsacks(members, work[g], work[h]) for g in groups for h in groups if g != h}
        latency = problem.latency
        ok = problem.stage_links
        self.lat_in = [min((float(latency[h, g]) for h in groups if ok[g][h]), default=0.0) for g in groups]
        self.lat_out = [min((float(latency[g, h]) for h in groups if ok[g][h]), default=0.0) for g in groups]
        cuts = _cuts_of(problem, segs)
        #: Per group: the message charges of its stages; None where some node takes no time on it (its positions then
        #: do not tell which segments are done: `_Messages`).
        self.messages = [
            _Messages(cuts, self.prefix[g], problem.forward[g] + problem.backward[g], g, ok, problem)
            if (work[g] > 0).all() and self.m > 1 else None
            for g in groups
        ]
        #: Least latency of any message, for stages replicated over several groups.
        self.lat_any = problem.least_latency
        #: Per group: its rungs of replica counts (lo, hi), and each device count rounded down to a rung's lo (module docstring, 7).
        self.rungs = [_rungs(most) for most in self.most]
        self.floor = [[0, *(lo for lo, hi in _rungs(count) for _ in range(lo, hi + 1))] for count in self.counts]
        #: (group, r, True): a stage on r replicas of one group, r a rung's hi (its least all-reduce); (group, r, False): r
        #: replicas over several groups.
        self.allreduce: dict[tuple[int, int, bool], tuple[float, float, list[float]]] = {}
        for g in groups:
            for lo, hi in self.rungs[g]:
                terms = [problem.allreduce_affine(g, r) if r > 1 else (0.0, 0.0) for r in range(lo, hi + 1)]
                fixed, slope = (min(term) / problem.microbatches for term in zip(*terms))
                self.allreduce[g, hi, True] = (fixed, slope, [w / hi + slope * p for w, p in zip(self.prefix[g], self.params[g])])
            for r in range(2, sum(self.counts) + 1):
                self.allreduce[g, r, False] = (0.0, 0.0, [w / r for w in self.prefix[g]])

    def total(self, g: int) -> float:
        return self.prefix[g][-1]

    def covered(self, g: int, x: float) -> float:
        i = min(int(x), self.m - 1)
        return self.prefix[g][i] + (x - i) * self.seg[g][i]

    def reach(self, g: int, r: int, a: float, t: float, ring: bool = True, before: tuple[bool, ...] | None = None,
              after: tuple[bool, ...] | None = None) -> float:
        """Farthest position (a supremum) a stage on r replicas of g starting at a can cover within t;
        `ring` False: the stage's replicas span several groups (no all-reduce, any link's latency). `before`, `after`: the
        groups earlier and later stages may run on, for the messages it pays (None: latencies alone)."""
        m = self.m
        lat_in = (self.lat_in[g] if ring else self.lat_any) if a > 0 else 0.0
        lat_out = (self.lat_out[g] if ring else self.lat_any) if a < m - 1 else 0.0
        if self._cost(g, r, a, m, ring) + (lat_in if m > max(a, 1.0) else 0.0) <= t:
            y = float(m)
        else:
            early = min(max(a, 1.0), self._solve(g, r, a, t - lat_out, ring))
            y = min(float(m), max(a, early, self._solve(g, r, a, t - lat_in - lat_out, ring)))
        if ring and before is not None and after is not None and self.messages[g] is not None:
            y = self._reach_paying(g, r, a, t, before, after, y)  # both hold: the least of them
        if ring:
            y = min(y, self._fitting(g, a))
        return self._attained(g, a, y)

    def _fitting(self, g: int, a: float) -> float:
        """Farthest position a stage on g starting at a can reach with the segments it holds whole in memory (module
        docstring, 6): into segment j only if those from ceil(a) to j - 1 fit, and never to its end unless it fits too."""
        memory, first = self.memory[g], math.ceil(a)
        if first >= self.m:
            return float(self.m)
        j = bisect.bisect_right(memory, memory[first] + self.capacity[g] * (1 + 1e-12)) - 1  # segments first..j-1 fit whole
        return float(self.m) if j >= self.m else math.nextafter(j + 1.0, j)  # segment j never whole

    def _reach_paying(self, g: int, r: int, a: float, t: float, before: tuple[bool, ...], after: tuple[bool, ...],
                      farthest: float) -> float:
        """`reach` charging the messages of `_Messages` (module docstring, 5), at most `farthest` (the latency-only reach):
        the farthest end segment by segment down from there, each segment's charge its own."""
        m, messages = self.m, self.messages[g]
        assert messages is not None
        paid = messages(r, before, after)
        first = min(int(a), m - 1)
        # What the stage receives, whichever segment its real start (at or before a) lies in: in a's segment, or in an
        # earlier one i, where it also does the work from i's end to a.
        later = paid.skipped[first] + self.covered(g, a) / r
        skips = messages.cuts.skips
        if farthest >= m and self._cost(g, r, a, m, True) + min(paid.into[first] + paid.receiving(skips.past(first, m), r), later) <= t:
            return float(m)
        for j in range(min(int(farthest), m - 1), first - 1, -1):
            if j > first:
                received = min(paid.into[first] + paid.receiving(skips.past(first, j), r), later) + paid.sending(skips.held(first, j), r)
                held = a <= j - 1  # the plan's stage starts before segment j - 1 too: it holds it whole
                stops = messages.stops(paid, r, j, "whole" if held else "sink")
                if stops is not None:
                    end = self._stop(g, r, j, stops, t - received - self._cost(g, r, a, float(j), True))
                    if end is not None:
                        return max(a, min(end, farthest))
                    continue
                charge = received + (paid.whole if held else paid.out)[j]
            elif a == j and (stops := messages.stops(paid, r, j, "sink")) is not None:
                # Starting at the segment's start, the plan's stage holds nothing before it, or started in an earlier segment.
                alone = messages.stops(paid, r, j, "none")
                assert alone is not None
                ends = [self._stop(g, r, j, alone, t - paid.first_in[j]), self._stop(g, r, j, stops, t - later)]
                return min(max([e for e in ends if e is not None], default=a), farthest)
            else:
                charge = min(paid.inside[j], later + paid.out[j])
            y = self._solve(g, r, a, t - charge, True)
            if y >= j:
                # Before the segment's end: one holding it whole ends in a later segment, charged there (`reach` then
                # rounds the end down to a downset's: a one-node segment's start).
                return min(y, math.nextafter(j + 1.0, j), farthest)
        return a

    def _stop(self, g: int, r: int, j: int, stops: tuple[np.ndarray, np.ndarray], budget: float) -> float | None:
        """The farthest end of segment j among `stops` (`_Messages.stops`) whose own work and messages fit in `budget`; None
        if none does."""
        work, cost = stops
        k = int(np.searchsorted(-cost, -budget, side="left"))
        return j + work[k] * r / self.seg[g][j] if k < len(work) else None

    def _attained(self, g: int, a: float, y: float) -> float:
        """`y` rounded down to where a downset of its segment ends, in g's work (never below `a`): a stage's end holds one
        (module docstring, 3)."""
        i = int(y)
        if i >= self.m or y == i or self.attained[g][i] is None or self.seg[g][i] <= 0:
            return y
        sums = self.attained[g][i]  # a position inside the segment holds less than the whole of its work
        j = bisect.bisect_right(sums, (y - i) * self.seg[g][i] * (1 + 1e-9)) - 1  # the float error of y's work
        return max(a, min(y, i + sums[j] / self.seg[g][i]))

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
            before = tuple(u > 0 for u in used)
            for g in groups:
                for lo, r in chain.rungs[g]:  # lo devices used, r replicas charged (module docstring, 7)
                    if lo > chain.counts[g] - used[g] or sum(used) + lo > spare:
                        break
                    after = tuple(n - u - (lo if h == g else 0) > 0 for h, (u, n) in enumerate(zip(used, chain.counts)))
                    y = chain.reach(g, r, x[g], t, before=before, after=after)
                    if y >= chain.m:
                        return True
                    keep(used[:g] + (chain.floor[g][used[g] + lo],) + used[g + 1:], g, x, {g: y}, r)
            for mix in mixes:
                if sum(used) + sum(mix) > spare or any(u + c > n for u, c, n in zip(used, mix, chain.counts)):
                    continue
                ends = {g: chain.reach(g, sum(mix), x[g], t, ring=False) for g in groups if mix[g]}
                if min(ends.values()) >= chain.m:
                    return True
                keep(tuple(u + c for u, c in zip(used, mix)), _MIXED, x, ends, sum(mix))
        level = _undominated(nxt) if len(chain.counts) == 1 else nxt
    return False


def _members(of: np.ndarray, segments: int) -> list[np.ndarray]:
    """Per segment, the positions of its nodes in `of` (a segment index per node; -1, a dropped node, in none), in order."""
    order = np.argsort(of, kind="stable")
    bounds = np.searchsorted(of[order], np.arange(segments + 1))
    return [order[bounds[i]:bounds[i + 1]] for i in range(segments)]


def _knapsacks(members: list[np.ndarray], on_g: np.ndarray, on_h: np.ndarray) -> list[tuple[list[float], list[float]]]:
    """Per segment (`members`): cumulative work on g and on h of its nodes (from 0.0), in order of most work on h per work
    on g (nodes with none on g first)."""
    out = []
    for nodes in members:
        a, b = on_g[nodes], on_h[nodes]
        ratio = np.divide(b, a, out=np.full(len(a), np.inf), where=a > 0)
        rank = np.argsort(-ratio, kind="stable")
        out.append(([0.0, *np.cumsum(a[rank]).tolist()], [0.0, *np.cumsum(b[rank]).tolist()]))
    return out


def _short_of_whole(sums: np.ndarray) -> list[float]:
    """The distinct downset works below the whole segment's, ascending (the empty downset's 0.0 first)."""
    distinct = np.unique(sums)
    return distinct[distinct < distinct[-1] * (1 - 1e-12)].tolist() or [0.0]


def _undominated(level: dict) -> dict:
    """States of one group that no state using fewer devices reaches past (the other is at least as good: more devices
    left, a farther position)."""
    kept, farthest = {}, -math.inf
    for key in sorted(level):
        if level[key][0] > farthest:
            kept[key], farthest = level[key], level[key][0]
    return kept


def _rungs(most: int) -> list[tuple[int, int]]:
    """Replica counts 1..most in rungs (lo, hi): each count its own up to `EXACT_REPLICAS`, then hi / lo at most 1 + 1 / `_RUNG`
    (1,000 devices: 61 rungs)."""
    rungs, lo = [], 1
    while lo <= most:
        hi = lo if lo <= EXACT_REPLICAS else min(most, lo + -(-lo // _RUNG) - 1)
        rungs.append((lo, hi))
        lo = hi + 1
    return rungs


def _mixes(chain: _Chain) -> list[tuple[int, ...]]:
    """Device counts per group of a stage replicated over two or more groups."""
    return [mix for mix in itertools.product(*(range(c + 1) for c in chain.counts)) if sum(1 for c in mix if c) >= 2]


@dataclass(frozen=True, eq=False)
class _Cuts:
    """Per segment, the least (bytes, count) of the tensors crossing into or out of stages around it (module docstring,
    5): rows 0 and 1 of each array. Graph and micro-batch only: computed once per problem."""

    #: A stage that starts in segment i and ends past it: what its first node and the rest of segment i receive.
    into: np.ndarray
    #: A stage that ends in segment j and started before it: what the last node of segment j - 1 it holds and its part of
    #: segment j send (unused at j = 0).
    out: np.ndarray
    #: A stage inside segment i: what its first node receives, and what its last node sends.
    first: np.ndarray
    last: np.ndarray
    #: The nodes of each segment that no other node of it reads from: one of them is in every stage holding its end.
    sinks: tuple[tuple[int, ...], ...]
    #: Tensors that skip segments: a stage starting in segment i and ending in j > i also receives every tensor written
    #: before segment i, not read in it and read in a segment before j (`_Skips.past`); and sends every tensor written in
    #: a segment it holds whole before j - 1 and read after j (`_Skips.held`).
    skips: _Skips
    #: As `out`, for a stage that holds segment j - 1 whole (it started before it): what every node of it writes counts.
    whole: np.ndarray
    #: Per segment j > 0 whose downsets are listed, what a stage ending at each of them sends; None elsewhere.
    ends: tuple[_Ends | None, ...]


@dataclass(frozen=True, eq=False)
class _Ends:
    """The proper downsets E of a segment j (rows over its `nodes`), and per E the least (bytes, count) a stage ending with
    E sends: what E and what the stage holds before segment j write that is read outside E, by what it holds there."""

    nodes: np.ndarray
    rows: np.ndarray
    #: "sink": a last node of segment j - 1 (each at least `_Cuts.out`); "whole": all of segment j - 1 (at least
    #: `_Cuts.whole`); "none": nothing (the stage starts at segment j's start; E not empty: at least what its last node
    #: writes).
    sends: dict[str, np.ndarray]


_CUTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _cuts_of(problem: Problem, segs: Segments) -> _Cuts:
    if problem not in _CUTS:
        _CUTS[problem] = _cuts(problem, segs)
    return _CUTS[problem]


def _cuts(problem: Problem, segs: Segments) -> _Cuts:
    m, of = segs.count, segs.of
    members: list[list[int]] = [[] for _ in range(m)]
    for v in np.flatnonzero(of >= 0):
        members[int(of[v])].append(int(v))
    # Kept nodes only: a dropped node's tensors are not counted (it may sit in any stage); what a kept node writes is read
    # by kept nodes only (what a kept node reaches is kept).
    tensors = [_Tensor(int(p), [int(c) for c in cs], float(b), tuple(sorted({int(of[c]) for c in cs})))
               for p, cs, b in zip(problem.tensor_producer, problem.tensor_consumers, problem.tensor_bytes) if p >= 0 and of[p] >= 0]
    reads: list[list[_Tensor]] = [[] for _ in range(problem.n)]
    writes: list[list[_Tensor]] = [[] for _ in range(problem.n)]
    read_in: list[list[_Tensor]] = [[] for _ in range(m)]
    for t in tensors:
        writes[t.producer].append(t)
        for c in t.readers:
            reads[c].append(t)
        for i in t.segments:
            read_in[i].append(t)

    def least(table: list[list[_Tensor]], nodes: list[int]) -> tuple[float, float]:
        return min(sum(t.nbytes for t in table[v]) for v in nodes), min(len(table[v]) for v in nodes)

    first = np.array([least(reads, members[i]) for i in range(m)]).T
    last = np.array([least(writes, members[i]) for i in range(m)]).T
    into, out, whole = first.copy(), np.zeros((2, m)), np.zeros((2, m))
    # Per segment i > 0: the tensors its nodes write, and those segment i - 1 writes that segment i or a later one reads.
    made_in: list[list[_Tensor]] = [[] for _ in range(m)]
    crossing: list[list[_Tensor]] = [[] for _ in range(m)]
    sinks = [_sinks(nodes, writes, of) for nodes in members]
    memo: dict[tuple, float] = {}
    for i in range(m):
        if len(members[i]) > 1:
            # After any part of segment i done before (maybe none): what its rest reads from before it or from that part.
            terms = [_Term(t.producer if of[t.producer] == i else -1, t, False) for t in read_in[i]]
            into[0, i] = max(into[0, i], _least_cut(members[i], terms, memo))
        if i == 0:
            continue
        out[:, i] = np.minimum(last[:, i - 1], last[:, i])
        made = made_in[i] = [t for v in members[i] for t in writes[v]]
        # A last node s of segment i - 1 and any part of segment i (maybe none): what they write that is read elsewhere.
        sent = min(_least_cut(members[i], [*(_Term(-1, t, t.last > i) for t in writes[s]), *(_Term(t.producer, t, t.last > i) for t in made)],
                              memo) if len(members[i]) > 1 else sum(t.nbytes for t in writes[s]) for s in sinks[i - 1])
        out[0, i] = max(out[0, i], sent)
        # Segment i - 1 whole and any part of segment i: every tensor crossing into segment i or past it from i - 1 too.
        crossing[i] = [t for v in members[i - 1] for t in writes[v] if t.last >= i]
        whole[:, i] = out[:, i]
        whole[0, i] = max(out[0, i], _least_cut(members[i], [*(_Term(-1, t, t.last > i) for t in crossing[i]),
                                                            *(_Term(t.producer, t, t.last > i) for t in made)], memo)
                          if len(members[i]) > 1 else sum(t.nbytes for t in crossing[i]))
    shapes: dict[tuple, tuple] = {}
    ends = tuple(None if i == 0 or segs.downsets[i] is None
                 else _ends(members[i], segs.downsets[i], made_in[i], crossing[i], [writes[s] for s in sinks[i - 1]],
                            out[:, i], whole[:, i], last[:, i], i, of, shapes)
                 for i in range(m))
    return _Cuts(into=into, out=out, whole=whole, first=first, last=last, sinks=tuple(map(tuple, sinks)),
                 skips=_Skips(tensors, of, m), ends=ends)


def _ends(nodes: list[int], downsets: np.ndarray, made: list[_Tensor], crossing: list[_Tensor], sinks: list[list[_Tensor]],
          least: np.ndarray, whole: np.ndarray, last: np.ndarray, i: int, of: np.ndarray, memo: dict[tuple, tuple]) -> _Ends:
    """`_Cuts.ends` of segment i: a tensor counts when its producer is held (in E, or before segment i) and it is read after
    segment i or by a node of it outside E. Segments of the same shape (a model's layers) are counted once: what the
    segment's own tensors are (their producers and readers in it) also fixes its downsets. `made`: what its nodes write;
    `crossing`: what segment i - 1 writes that it or a later one reads; `sinks`: what each last node of segment i - 1 writes."""
    local = {v: n for n, v in enumerate(nodes)}

    def shape(tensors: list[_Tensor]) -> tuple:
        return tuple((local.get(t.producer, -1), tuple(local[c] for c in t.readers if of[c] == i), t.last > i, t.nbytes) for t in tensors)

    key = (len(nodes), shape(made), tuple(shape(tensors) for tensors in sinks), shape(crossing), tuple(least), tuple(whole), tuple(last))
    if key not in memo:
        rows = downsets[~downsets.all(axis=1)]

        def sent(tensors: tuple) -> np.ndarray:
            total = np.zeros((2, len(rows)))
            for producer, inside, beyond, nbytes in tensors:
                counts = np.ones(len(rows), dtype=bool) if beyond else ~rows[:, list(inside)].all(axis=1)
                if producer >= 0:
                    counts &= rows[:, producer]
                total += np.array([nbytes, 1.0])[:, None] * counts
            return total

        own = sent(key[1])
        one = np.min([sent(tensors) for tensors in key[2]], axis=0)
        memo[key] = rows, {"sink": np.maximum(own + one, least[:, None]), "whole": np.maximum(own + sent(key[3]), whole[:, None]),
                           "none": np.where(rows.any(axis=1), np.maximum(own, last[:, None]), own)}
    rows, sends = memo[key]
    return _Ends(np.asarray(nodes), rows, sends)


class _Skips:
    """What tensors that skip segments add to a stage's messages (`_Cuts.skips`), as (bytes, count) sums by binary search."""

    def __init__(self, tensors: list[_Tensor], of: np.ndarray, m: int) -> None:
        # into[i]: (first segment after i that reads it, bytes) of each tensor written before segment i, read after it but
        # not in it; alive[j]: (segment it is written in, bytes) of each tensor written at least two segments before j and
        # read after j.
        into: list[list[tuple[int, float]]] = [[] for _ in range(m)]
        alive: list[list[tuple[int, float]]] = [[] for _ in range(m + 1)]
        for t in tensors:
            made, read = int(of[t.producer]), t.segments
            nxt = 0
            for i in range(made + 1, read[-1]):
                while read[nxt] < i:
                    nxt += 1
                if read[nxt] > i:
                    into[i].append((read[nxt], t.nbytes))
            for j in range(made + 2, read[-1]):
                alive[j].append((made, t.nbytes))
        self._past = [_sums(sorted(pairs)) for pairs in into]
        self._held = [_sums(sorted(pairs)) for pairs in alive]

    def past(self, i: int, j: int) -> tuple[float, int]:
        """Of the tensors written before segment i and not read in it, those read in a segment before j."""
        keys, sums = self._past[i]
        n = bisect.bisect_left(keys, j)
        return sums[n][0], n

    def held(self, i: int, j: int) -> tuple[float, int]:
        """Of the tensors written two or more segments before j and read after it, those written after segment i."""
        keys, sums = self._held[j]
        n = bisect.bisect_right(keys, i)
        return sums[-1][0] - sums[n][0], len(keys) - n


def _sums(pairs: list[tuple[int, float]]) -> tuple[list[int], list[tuple[float, int]]]:
    """The keys, and the running (bytes, count) before each key and after the last."""
    return [k for k, _ in pairs], [(float(b), n) for n, b in enumerate([0.0, *itertools.accumulate(b for _, b in pairs)])]


@dataclass(frozen=True)
class _Tensor:
    producer: int
    readers: list[int]
    nbytes: float
    #: The segments that read it, in order.
    segments: tuple[int, ...]

    @property
    def last(self) -> int:
        return self.segments[-1]


@dataclass(frozen=True)
class _Term:
    """A tensor in a cut problem: its producer (-1: on the source's side whatever the cut), and whether it counts however
    the segment is cut once its producer is on that side (it is read beyond the segment)."""

    producer: int
    tensor: _Tensor
    beyond: bool


def _sinks(nodes: list[int], writes: list[list[_Tensor]], of: np.ndarray) -> list[int]:
    """The nodes of a segment no other node of it reads from."""
    return [v for v in nodes if not any(of[c] == of[v] for t in writes[v] for c in t.readers)]


def _least_cut(nodes: list[int], terms: list[_Term], memo: dict[tuple, float]) -> float:
    """Least bytes of the `terms` over the proper downsets A of a segment's `nodes` (A may be empty, never the whole
    segment): a term counts when its producer is in A and it is read beyond the segment or by a node outside A. A minimum
    cut (A on the source's side) per last node of the segment kept out of A; segments of the same shape (a model's layers)
    are solved once."""
    local = {v: n for n, v in enumerate(nodes)}
    inside = [(local.get(t.producer, -1), tuple(local[c] for c in t.tensor.readers if c in local)) for t in terms]
    key = (len(nodes), tuple((p, rs, term.beyond, term.tensor.nbytes) for (p, rs), term in zip(inside, terms)),
           tuple(sorted({(local[c], local[t.tensor.producer]) for t in terms if t.tensor.producer in local
                         for c in t.tensor.readers if c in local})))
    if key not in memo:
        memo[key] = _cut_value(*key)
    return memo[key]


def _cut_value(count: int, terms: tuple, order: tuple) -> float:
    graph = nx.DiGraph()
    graph.add_nodes_from(["s", "t", *range(count)])
    graph.add_edge("out", "t")  # infinite: a node joined to it is kept out of A
    graph.add_edges_from(order)  # no capacity: infinite; a reader in A has its producer in A
    constant = 0.0
    for n, (p, readers, beyond, nbytes) in enumerate(terms):
        source = "s" if p < 0 else p
        if beyond:
            if p < 0:
                constant += nbytes
            else:
                _add(graph, source, "t", nbytes)
        elif len(readers) == 1:
            _add(graph, source, readers[0], nbytes)
        elif readers:
            graph.add_edge(source, ("term", n), capacity=nbytes)
            graph.add_edges_from((("term", n), c) for c in readers)
    least, fed = math.inf, {p for _, p in order}
    for sink in [v for v in range(count) if v not in fed]:  # a proper downset leaves out a last node
        graph.add_edge(sink, "out")
        least = min(least, nx.maximum_flow_value(graph, "s", "t"))
        graph.remove_edge(sink, "out")
    return constant + least


def _add(graph: nx.DiGraph, a: object, b: object, capacity: float) -> None:
    """An arc's capacity added to any it has (an arc without one stays infinite)."""
    if graph.has_edge(a, b):
        if "capacity" in graph[a][b]:
            graph[a][b]["capacity"] += capacity
    else:
        graph.add_edge(a, b, capacity=capacity)


class _Messages:
    """One group's message charges in seconds, by replica count and by the groups that earlier stages and later ones may
    run on (each tensor priced on the cheapest link from one of the first or to one of the second, its latency the least
    of those links' and its bytes at the most bandwidth), from `_Cuts`; each priced when first asked for."""

    def __init__(self, cuts: _Cuts, prefix: list[float], work: np.ndarray, g: int, ok: list[list[bool]], problem: Problem) -> None:
        self.cuts, self.g, self.ok = cuts, g, ok
        # The links' arrays, not the problem: a chain is kept per problem (`_chain_of`) and must not keep it alive.
        self.latency, self.bandwidth = problem.latency, problem.bandwidth
        # Work on the group up to each segment's end, less the least work of a node that a stage starting inside the segment
        # and ending past it holds (one of its last nodes).
        self.ends = np.asarray(prefix[1:]) - np.array([min(work[v] for v in sinks) for sinks in cuts.sinks])
        #: Per segment with listed ends (`_Cuts.ends`): the work on the group of each of its proper downsets.
        self.held = [None if e is None else e.rows @ work[e.nodes] for e in cuts.ends]
        self._priced: dict[tuple[int, tuple[bool, ...], tuple[bool, ...]], _Priced] = {}
        self._stops: dict[tuple, tuple[np.ndarray, np.ndarray]] = {}

    def __call__(self, r: int, before: tuple[bool, ...], after: tuple[bool, ...]) -> _Priced:
        key = (r, before, after)
        if key not in self._priced:
            g, ok, cuts, groups = self.g, self.ok, self.cuts, range(len(self.ok))
            link_in = self._link([(h, g) for h in groups if ok[g][h] and before[h]])
            link_out = self._link([(g, h) for h in groups if ok[g][h] and after[h]])
            into = _seconds(cuts.into, link_in, r)
            # min over i < first of into(i) - (work up to segment i's end) / r: a start in an earlier segment i does the work
            # from i's end to the walk's start too.
            early = np.minimum.accumulate(into - self.ends / r)
            self._priced[key] = _Priced(into.tolist(), _seconds(cuts.out, link_out, r).tolist(),
                                        (_seconds(cuts.first, link_in, r) + _seconds(cuts.last, link_out, r)).tolist(),
                                        [math.inf, *early.tolist()], link_in, link_out, _seconds(cuts.whole, link_out, r).tolist(),
                                        _seconds(cuts.first, link_in, r).tolist())
        return self._priced[key]

    def stops(self, paid: _Priced, r: int, j: int, held: str) -> tuple[np.ndarray, np.ndarray] | None:
        """The ends a stage of r replicas priced as `paid` may stop at in segment j, as (work / r on the group into the
        segment, that plus what it sends), the first descending, the second too (an end both nearer and dearer never stops
        one); None where the segment's ends are not listed. `held`: what the stage holds before the segment (`_Ends.sends`).
        Found when first asked for."""
        ends = self.cuts.ends[j]
        if ends is None:
            return None
        key = (r, paid.link_out, j, held)
        if key not in self._stops:
            work = self.held[j] / r
            cost = work + _seconds(ends.sends[held], paid.link_out, r)
            order = np.lexsort((cost, -work))
            work, cost = work[order], cost[order]
            keep = cost < np.minimum.accumulate(np.concatenate(([np.inf], cost[:-1])))
            self._stops[key] = work[keep], cost[keep]
        return self._stops[key]

    def _link(self, links: list[tuple[int, int]]) -> tuple[float, float]:
        """The least latency and the most bandwidth of `links` (none: messages cost nothing)."""
        if not links:
            return 0.0, math.inf
        return min(float(self.latency[a, b]) for a, b in links), max(float(self.bandwidth[a, b]) for a, b in links)


@dataclass(frozen=True)
class _Priced:
    """Per segment, in seconds (module docstring, 5): what a stage starting in it and ending past it receives, what a stage
    ending in it that started before sends, what a stage inside it receives and sends; and the least over the earlier
    segments i of what a stage starting in i receives less the work from i's end (`_Chain._reach_paying`)."""

    into: list[float]
    out: list[float]
    inside: list[float]
    skipped: list[float]
    #: (latency, bandwidth) of the cheapest messages in and out.
    link_in: tuple[float, float]
    link_out: tuple[float, float]
    #: `out` for a stage that holds the segment before whole.
    whole: list[float]
    #: What a stage starting at the segment's start receives.
    first_in: list[float]

    def receiving(self, messages: tuple[float, int], r: int) -> float:
        """Seconds that (bytes, count) of messages in cost a stage of r replicas."""
        return float(_seconds(messages, self.link_in, r))

    def sending(self, messages: tuple[float, int], r: int) -> float:
        return float(_seconds(messages, self.link_out, r))


def _seconds(messages, link: tuple[float, float], r: int):  # type: ignore[no-untyped-def]
    """What `count` messages of `bytes` in all ((bytes, count), rows of arrays or numbers) cost a stage of r replicas on a
    link of (latency, bandwidth): the pricing rule's `message_seconds`."""
    return message_seconds(messages[1] * link[0], messages[0], r, link[1])
