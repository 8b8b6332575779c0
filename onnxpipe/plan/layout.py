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
#: (interchangeable: same kind, same links) gives stages multiples of count / EXACT_REPLICAS devices, so
#: the DP and CP-SAT choose among as many counts for 1,000 devices as for 32.
EXACT_REPLICAS = 32


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
    """The replica counts a stage may take from a group of `count` devices, at most `most`: every count
    up to EXACT_REPLICAS devices; above, multiples of ceil(count / EXACT_REPLICAS) and `most` itself."""
    most = min(count, most)
    if count <= EXACT_REPLICAS:
        return tuple(range(1, most + 1))
    unit = -(-count // EXACT_REPLICAS)
    return tuple(sorted({*range(unit, most + 1, unit), most})) if most >= 1 else ()
