"""Layout conversions at stage cuts on the CPU, and the host's rates for them.

onnxruntime's optimized CPU sessions (what stage workers run) compute convolutions, and the pools,
activations and sums around them, in a blocked layout (NCHWc: channels in blocks of 8 or 16), reordering
from the plain NCHW layout where a run of such nodes starts and back where it ends. The unsplit model
reorders at a few places; a stage file cut inside such a run reorders every cut tensor: the sending stage
back to NCHW before it sends (a ReorderOutput kernel), the receiving stage into blocks before its first
blocked node reads it (a ReorderInput). Which nodes ran blocked comes from the optimized profile
(`cost_profile.nchwc_nodes`); the host's rates for the two kernels from a probe profiled the same way:
a 1x1 convolution over the model's largest blocked tensor, which onnxruntime runs as ReorderInput, the
convolution, ReorderOutput (`probe_model`, `reorder_rates`).

Reading order: `ReorderRates` -> `probe_shape` -> `probe_model` -> `reorder_rates`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.cost_trace import kernels, run_starts
from onnxpipe.graph import Graph

__all__ = ["NCHWC", "ReorderRates", "probe_shape", "probe_model", "reorder_rates"]

#: A float, or a numpy array of them.
Num = TypeVar("Num", float, np.ndarray)
#: `NodeCost.layout` of a node an optimized CPU session computed in the blocked layout.
NCHWC = "nchwc"
_INPUT, _OUTPUT = "ReorderInput", "ReorderOutput"


@dataclass(frozen=True)
class ReorderRates:
    """Bytes per second the host reorders between the plain and the blocked layout, one thread."""

    #: NCHW -> NCHWc (ReorderInput: the receiving stage, before its first blocked node).
    into_blocks: float
    #: NCHWc -> NCHW (ReorderOutput: the sending stage, for each cut tensor a blocked node made).
    out_of_blocks: float

    def seconds(self, nbytes: Num, *, sent: bool) -> Num:
        """Seconds to reorder `nbytes` (a float, or an array of them) on the sending (`sent`) or the receiving end of a cut."""
        return nbytes / (self.out_of_blocks if sent else self.into_blocks)


def probe_shape(graph: Graph, blocked: Iterable[str]) -> tuple[int, ...] | None:
    """The shape of the largest 4-D float32 tensor a `blocked` node writes (the model's own cut-sized
    tensor); None when the model has none."""
    shapes = [graph.tensors[o].shape for n in blocked for o in graph.node(n).output
              if o in graph.tensors and graph.tensors[o].dtype == "float32" and len(graph.tensors[o].shape) == 4]
    return max(shapes, key=lambda s: int(np.prod(s)), default=None)


def probe_model(shape: tuple[int, ...]) -> onnx.ModelProto:
    """x (N, C, H, W) -> a 1x1 convolution of C channels -> y: optimized, onnxruntime reorders x into blocks
    and y out of them (when C fits its block size), once each per run."""
    channels = shape[1]
    weight = helper.make_tensor("w", TensorProto.FLOAT, [channels, channels, 1, 1],
                                np.random.default_rng(0).standard_normal((channels, channels), dtype=np.float32).ravel().tolist())
    graph = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["y"], name="probe")], "reorder_probe",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))], [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [weight],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def reorder_rates(events: list[dict], warmup: int, nbytes: int) -> ReorderRates | None:
    """The probe's rates from its trace (`events` of warmup + measured runs; `nbytes`: its tensor's size): per
    kernel, the median over the measured runs of its time in each; None when onnxruntime reordered nothing."""
    per_run: dict[str, dict[int, float]] = {_INPUT: {}, _OUTPUT: {}}
    for k in kernels(events, run_starts(events)):
        if k.op in per_run and k.run >= warmup:
            per_run[k.op][k.run] = per_run[k.op].get(k.run, 0.0) + k.micros * 1e-6
    if not all(per_run.values()):
        return None
    into, out = (max(statistics.median(per_run[op].values()), 0.5e-6) for op in (_INPUT, _OUTPUT))
    return ReorderRates(into_blocks=nbytes / into, out_of_blocks=nbytes / out)
