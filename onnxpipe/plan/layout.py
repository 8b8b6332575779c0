"""A solver's answer on blocks (stage per block, group, replicas and recompute per stage), turned into
an `Assignment` of node and device names."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from onnxpipe.plan.coarsen import Blocks
from onnxpipe.pricing.stage import Assignment
from onnxpipe.pricing.problem import Problem

__all__ = ["Layout", "to_assignment", "replica_choices", "EXACT_REPLICAS"]

#: Groups up to this many devices may give a stage any replica count; a larger group of identical devices
#: (interchangeable: same kind, same links) offers about as many counts (`replica_choices`), so the DP and CP-SAT
#: choose among as many for 1,000 devices as for 32.
EXACT_REPLICAS = 32
#: Above EXACT_REPLICAS: the large counts are multiples of count / _MULTIPLES, and below two such steps the counts are
#: at most _LADDER apart.
_MULTIPLES = 12
_LADDER = 1.25


@dataclass(frozen=True, eq=False)
class Layout:
    #: (blocks,) stage index of each block.
    block_stage: np.ndarray
    #: Per stage: device group index, replica count, recompute flag.
    groups: tuple[int, ...]
    replicas: tuple[int, ...]
    recompute: tuple[bool, ...]


def to_assignment(problem: Problem, blocks: Blocks, layout: Layout) -> Assignment:
    """Stages get device instances of their group in target order."""
    node_stage = blocks.per_node(layout.block_stage)
    k = len(layout.groups)
    taken = [0] * len(problem.groups)
    devices = []
    for g, r in zip(layout.groups, layout.replicas):
        devices.append(problem.group_devices[g][taken[g] : taken[g] + r])
        taken[g] += r
    stages = tuple(tuple(problem.nodes[i] for i in np.flatnonzero(node_stage == s)) for s in range(k))
    return Assignment(stages=stages, devices=tuple(devices), recompute=tuple(bool(x) for x in layout.recompute))


def replica_choices(count: int, most: int) -> tuple[int, ...]:
    """The replica counts a stage may take from a group of `count` devices, at most `most`: every count up to
    EXACT_REPLICAS devices; above, counts at most `_LADDER` apart (1, 2, ... 8, 10, 12, 15, ...) below two steps of
    count / `_MULTIPLES`, the multiples of that step, and `most` itself (1,000 devices: 33 counts). Multiples of count / 32
    alone gave a stage no fewer than 32 of 1,000 devices, where a stage's all-reduce over 32 costs more than its work
    saves: transformer-tiny's 4 stages took 0.107 ms each there against 0.064 ms with 8, 7, 8 and 9 replicas on 32 devices."""
    most = min(count, most)
    if count <= EXACT_REPLICAS:
        return tuple(range(1, most + 1))
    step = -(-count // _MULTIPLES)
    small, r = [], 1
    while r < 2 * step:
        small.append(r)
        r = max(r + 1, int(r * _LADDER))
    return tuple(c for c in sorted({*small, *range(2 * step, count + 1, step), most}) if c <= most) if most >= 1 else ()
