"""Which ops onnxruntime-training cannot differentiate, asked of onnxruntime itself, before any training starts.

No hand-kept list: each op type on a gradient path (a float input that depends on a trained
tensor, a float output) is asked of onnxruntime-training itself (`onnxpipe.gradprobe`, cached per op type,
opset and differentiated inputs, so a model asks once per op type). Exporter patterns with a differentiable
equivalent are rewritten first (`onnxpipe.rewrites`) and opsets below 13 lifted (`onnxpipe.opset`), as training does.

Reading order: `MissingGradient` -> `missing_gradients` -> `ensure_gradients`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnxpipe.errors import OnnxpipeError
from onnxpipe.nodes import trained_initializers
from onnxpipe.opset import training_opset
from onnxpipe.gradprobe import SMALL, differentiable, is_float, is_sequence, tensor_types
from onnxpipe.ortutil import REWRITTEN_OPS, state_inputs
from onnxpipe.protostream import is_streamable, raw_nbytes, skeleton
from onnxpipe.rewrites import for_gradient_builder

__all__ = ["MissingGradient", "missing_gradients", "ensure_gradients", "describe_missing"]

@dataclass(frozen=True)
class MissingGradient:
    """An op type onnxruntime-training cannot differentiate, and the nodes of it on a gradient path."""

    op_type: str
    nodes: tuple[str, ...]


def missing_gradients(model: onnx.ModelProto, trained: Iterable[str] | None = None) -> tuple[MissingGradient, ...]:
    """Every op type on a gradient path that onnxruntime-training 1.19.2 cannot differentiate, after
    `rewrites.for_gradient_builder`. `trained`: the tensors gradients are wanted for (default: the weights
    training updates, `nodes.trained_initializers`)."""
    model = for_gradient_builder(training_opset(_light(model)))
    graph = model.graph
    types = tensor_types(model)
    if trained is None:
        trained = trained_initializers(graph)
    live = set(trained) - state_inputs(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    bad: dict[str, list[str]] = {}
    for node in graph.node:
        slots = tuple(k for k, name in enumerate(node.input) if name in live and is_float(types.get(name)))
        outs = [o for o in node.output if o and (is_float(types.get(o)) or is_sequence(types.get(o)))]
        if not slots or not outs:
            continue
        live.update(outs)
        if node.op_type in REWRITTEN_OPS and node.domain in ("", "ai.onnx"):
            if _backward_lstm(node):  # LSTMGrad refuses it ("only supports the forward direction"); not unrolled here
                bad.setdefault(node.op_type, []).append(node.name or node.op_type)
            continue  # differentiable after onnxruntime's own pre-training rewrites, which training runs
        if differentiable(model, node, slots, types, opset) is False:
            bad.setdefault(node.op_type, []).append(node.name or node.op_type)
    return tuple(MissingGradient(op, tuple(nodes)) for op, nodes in bad.items())


def _backward_lstm(node: onnx.NodeProto) -> bool:
    """An LSTM over the sequence backwards (reverse or bidirectional): onnxruntime-training's LSTMGrad runs forward ones only."""
    return node.op_type == "LSTM" and any(a.name == "direction" and a.s != b"forward" for a in node.attribute)


def _light(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its large initializers' bytes left out: the probes need their types, not their values."""
    light = skeleton(model, "graph")
    light.graph.CopyFrom(skeleton(model.graph, "initializer"))
    for t in model.graph.initializer:
        light.graph.initializer.append(skeleton(t, "raw_data") if is_streamable(t) and raw_nbytes(t) > SMALL else t)
    return light


def describe_missing(missing: Iterable[MissingGradient]) -> str:
    """Every op type, with its node count and first nodes: 'CumSum (2 nodes: a, b), Sum (1 node: c)'."""
    parts = []
    for m in missing:
        shown = ", ".join(m.nodes[:3]) + (" ..." if len(m.nodes) > 3 else "")
        parts.append(f"{m.op_type} ({len(m.nodes)} node{'s' if len(m.nodes) != 1 else ''}: {shown})")
    return ", ".join(parts)


def ensure_gradients(model: onnx.ModelProto, trained: Iterable[str] | None, origin: str) -> None:
    """One line naming every op without a gradient on a gradient path, before any worker starts."""
    missing = missing_gradients(model, trained)
    if missing:
        raise OnnxpipeError(
            f"{origin}: onnxruntime-training 1.19.2 has no gradient for {describe_missing(missing)}; "
            "re-export the model without these ops or train it elsewhere"
        )


