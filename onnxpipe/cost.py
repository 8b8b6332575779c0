"""Per-node cost annotation: analytic FLOPs and bytes per op class, or measured times from onnxruntime."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

__all__ = ["OP_CLASSES", "NodeCost", "Costs"]

#: Op classes; a target gives each its own efficiency.
OP_CLASSES = ("matmul", "conv", "rnn", "norm", "pool", "reduce", "elementwise", "data", "other")


@dataclass(frozen=True)
class NodeCost:
    """What one node costs for one pass at the batch the graph was loaded with."""

    op_type: str
    #: One of OP_CLASSES.
    op_class: str
    #: Forward floating-point operations (2 per multiply-add).
    flops: float
    bytes_read: float
    bytes_written: float
    #: Bytes of the parameters (float initializers) this node is the first reader of.
    param_bytes: float
    #: Bytes of the node's outputs (what a stash keeps for backward).
    activation_bytes: float
    backward_flops: float
    backward_bytes: float
    #: False when no formula exists for the op and only bytes were estimated.
    known: bool = True
    #: Median measured forward seconds (profile mode), else None.
    measured_seconds: float | None = None
    #: Median measured backward seconds (profile mode), else None.
    measured_backward_seconds: float | None = None


@dataclass(frozen=True)
class Costs:
    """Costs of every compute node of a graph."""

    #: Node name -> cost, for every node in `Graph.compute_nodes`.
    nodes: Mapping[str, NodeCost]
    #: Op types that got a bytes-only estimate.
    unknown_ops: tuple[str, ...]
    #: True when measured times are present.
    profiled: bool
