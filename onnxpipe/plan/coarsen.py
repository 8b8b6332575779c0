"""Coarsening: contract runs of the topological order into blocks whose boundaries sit where few bytes
are live, so the solvers see hundreds of blocks instead of thousands of nodes; `refine` splits them
again around a plan's stage cuts, so a second solve can place those cuts between single nodes.

Among the gaps of least live bytes in a window, a block ends at the one that leaves the most enclosing
modules (`scopes.boundary_depths`: the exporter's module paths or the nodes' names). Why: on a stack of
repeated layers several gaps carry equally few bytes (the residual stream alone, before each sublayer), and
the first of them was an accident of the window; the layer's end makes coarse stages hold whole layers, as a
user reads the model. It never costs bytes (a module boundary wins only among gaps that carry equally few),
and refinement still moves every cut node by node, so no plan the blocks miss is lost for that reason.

A node that starts a branch of its own also starts a block (`_branch_starts`): every tensor it reads was made before
the block ahead of its own and no node since has read it, or it reads none (model inputs and weights alone). Why: such a
node (an encoder-decoder's cross-attention projections of the encoder's output, the decoder's embedding of its own
input) may sit in any stage between its inputs' and its readers', and the best plans use that freedom, which a block
gluing it to its neighbours in the order takes away. Measured on T5-small's export (683 nodes, forward only): the CP-SAT
over blocks found 34.78 ms at 8 stages on fpga4 where the least plan node by node has 32.09 (32.90 with these blocks;
the planner proved 32.09 least in 4.3-4.5 s instead of 7.6-8.4), and at 4 stages on gpu4 the proof from the better start
came within 0.5% in 2.5 s (three runs) where it had ended at its 9 s, 0.7-1.1% short. A node reading what its
neighbours read (a projection beside another) is no such start: GPT-2's and Swin-T's exports and the zoo's stacks have
none, LLaMA's 12 at 8 stages (182 blocks), BART-base's and T5-small's 9-28.

No block starts at a sealed gap (`Problem.sealed`: a sequence live across it in training), so no solver cuts one.

Rounding a cut of the node-level problem that falls inside a block to that block's nearer boundary
(by work) moves at most `rounding_seconds` of work onto a stage: what coarsening can cost in compute
(boundary traffic aside).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxpipe.plan.scopes import boundary_depths
from onnxpipe.pricing.problem import Problem

__all__ = ["Blocks", "coarsen", "refine", "live_bytes"]


@dataclass(frozen=True, eq=False)
class Blocks:
    """Contiguous runs of the topological order; per-block sums of the problem's arrays."""

    #: (blocks + 1,) start positions; the last entry is the node count.
    starts: np.ndarray
    #: (groups, blocks) seconds; (blocks,) bytes.
    forward: np.ndarray
    backward: np.ndarray
    params: np.ndarray
    activations: np.ndarray
    #: (blocks,) trained parameter bytes (`Problem.trained`).
    trained: np.ndarray
    #: (blocks,) True where a node of the block draws random numbers (`Problem.random`): its stage never recomputes.
    random: np.ndarray
    #: Tensors crossing blocks: producer block (-1: model input), bytes, sorted distinct consumer blocks.
    producer: np.ndarray
    nbytes: np.ndarray
    consumers: tuple[np.ndarray, ...]
    #: (groups, crossing tensors) forward seconds each costs the producer's stage and a receiving stage
    #: (`Problem.crossing_sent`, `crossing_received`).
    crossing_sent: np.ndarray
    crossing_received: np.ndarray
    #: Most work (forward + recomputed forward + backward, slowest group) a cut inside a block moves
    #: when rounded to the block's nearer boundary.
    rounding_seconds: float

    @property
    def count(self) -> int:
        return len(self.starts) - 1

    def nodes(self, problem: Problem, first: int, last: int) -> tuple[str, ...]:
        """Names of the nodes of blocks first..last-1."""
        return problem.nodes[self.starts[first] : self.starts[last]]

    def per_node(self, values: np.ndarray) -> np.ndarray:
        """(nodes,) the value of each node's block."""
        return np.repeat(values, np.diff(self.starts))


def live_bytes(problem: Problem) -> np.ndarray:
    """(n + 1,) bytes produced before each gap of the order and read after it (model inputs excluded)."""
    diff = np.zeros(problem.n + 2)
    last = np.array([c[-1] for c in problem.tensor_consumers], dtype=np.int64) if problem.tensor_consumers else np.zeros(0, np.int64)
    keep = (problem.tensor_producer >= 0) & (last > problem.tensor_producer)
    np.add.at(diff, problem.tensor_producer[keep] + 1, problem.tensor_bytes[keep])
    np.add.at(diff, last[keep] + 1, -problem.tensor_bytes[keep])
    return np.cumsum(diff)[: problem.n + 1]


def coarsen(problem: Problem, max_blocks: int) -> Blocks:
    """Blocks of about equal work, each ending at the gap of least live bytes in its window (of those, the one
    of shallowest module boundary, then the first)."""
    n = problem.n
    if n <= max_blocks:
        starts = np.arange(n + 1)
    else:
        work = (problem.forward + problem.backward).mean(axis=0)
        cumulative = np.concatenate([[0.0], np.cumsum(work)])
        live = np.where(problem.sealed, np.inf, live_bytes(problem))
        depth = boundary_depths(problem.graph, problem.nodes)
        target = cumulative[-1] / max_blocks
        cuts = [0]
        while True:
            pos = cuts[-1]
            lo = max(pos + 1, int(np.searchsorted(cumulative, cumulative[pos] + 0.5 * target)))
            hi = max(lo, int(np.searchsorted(cumulative, cumulative[pos] + 1.5 * target)))
            if hi >= n:
                break
            window = live[lo : hi + 1]
            least = np.flatnonzero(window <= window.min())
            cuts.append(lo + int(least[np.argmin(depth[lo + least])]))
        cuts.append(n)
        starts = np.union1d(cuts, _branch_starts(problem, np.array(cuts)))
    return _blocks(problem, starts)


def _branch_starts(problem: Problem, starts: np.ndarray) -> np.ndarray:
    """Nodes inside a block (`starts`) that start a branch of their own (module docstring)."""
    reads: list[list[int]] = [[] for _ in range(problem.n)]
    for t, p in enumerate(problem.tensor_producer):
        if p >= 0:
            for c in problem.tensor_consumers[t]:
                reads[int(c)].append(t)
    branches = []
    for b in range(len(starts) - 1):
        near = int(starts[max(0, b - 1)])  # the start of the block ahead
        for g in range(int(starts[b]) + 1, int(starts[b + 1])):
            if all(problem.tensor_producer[t] < near and not ((near <= (c := problem.tensor_consumers[t])) & (c < g)).any() for t in reads[g]):
                branches.append(g)
    return np.array(branches, dtype=np.int64)


def refine(problem: Problem, blocks: Blocks, node_stage: np.ndarray) -> Blocks:
    """Blocks for the neighbourhood of a plan (`node_stage`: stage of each node): every block holding a node
    on either side of a stage change split into single nodes; each run of the other blocks (all of one
    stage) merged into one. The plan itself, and every plan moving its cuts within the split blocks, is
    made of them (a cut at a block boundary may move by a block either way)."""
    block_of = blocks.per_node(np.arange(blocks.count))
    cuts = np.flatnonzero(node_stage[1:] != node_stage[:-1]) + 1
    split = np.zeros(blocks.count + 1, dtype=np.int64)
    np.add.at(split, block_of[cuts - 1], 1)
    np.add.at(split, block_of[cuts] + 1, -1)
    chosen = np.flatnonzero(np.cumsum(split)[:-1] > 0)
    inner = [np.arange(blocks.starts[b], blocks.starts[b + 1] + 1) for b in chosen]
    return _blocks(problem, np.unique(np.concatenate([[0, problem.n], *inner])))


def _blocks(problem: Problem, starts: np.ndarray) -> Blocks:
    starts = starts[~problem.sealed[starts]]

    def sums(values: np.ndarray) -> np.ndarray:
        return np.add.reduceat(values, starts[:-1], axis=-1)

    block_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))  # Blocks.per_node, before the Blocks exist
    producer, nbytes, consumers, kept = [], [], [], []
    for t, p in enumerate(problem.tensor_producer):
        pb = block_of[p] if p >= 0 else -1
        cbs = np.unique(block_of[problem.tensor_consumers[t]])
        cbs = cbs[cbs != pb]
        if len(cbs):
            producer.append(pb)
            nbytes.append(problem.tensor_bytes[t])
            consumers.append(cbs)
            kept.append(t)
    forward, backward = sums(problem.forward), sums(problem.backward)
    return Blocks(
        starts=starts,
        forward=forward,
        backward=backward,
        params=sums(problem.params),
        activations=sums(problem.activations),
        trained=sums(problem.trained),
        random=sums(problem.random.astype(np.int64)) > 0,
        producer=np.array(producer, dtype=np.int64),
        nbytes=np.array(nbytes, dtype=float),
        consumers=tuple(consumers),
        crossing_sent=problem.crossing_sent[:, kept],
        crossing_received=problem.crossing_received[:, kept],
        rounding_seconds=_rounding(problem, starts),
    )


def _rounding(problem: Problem, starts: np.ndarray) -> float:
    work = (2 * problem.forward + problem.backward).max(axis=0)
    cumulative = np.concatenate([[0.0], np.cumsum(work)])
    block_of = np.repeat(np.arange(len(starts) - 1), np.diff(starts))
    inner = np.arange(problem.n)[np.arange(problem.n) != starts[block_of]]
    if not len(inner):
        return 0.0
    owner = block_of[inner]
    left = cumulative[inner] - cumulative[starts[owner]]
    right = cumulative[starts[owner + 1]] - cumulative[inner]
    return float(np.minimum(left, right).max())
