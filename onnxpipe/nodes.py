"""Facts about single nodes and tensors that the graph IR, shape inference, clean-up, pricing and training
all need: what a node reads from its enclosing scope, which tensors are weights, and which weights are trained."""

from __future__ import annotations

import functools
import math
from collections.abc import Iterable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.ortutil import state_inputs

__all__ = ["FLOAT_DTYPES", "is_float_dtype", "subgraph_captures", "has_subgraph", "draws_random", "is_weight", "trained_initializers", "differentiable_from", "HELD", "hold", "is_held", "RANDOM_OPS", "QUANTIZATION_OPS"]

#: Ops whose outputs differ per run even with constant inputs: never constant-folded or duplicated.
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})
#: Ops that make a model quantized; clean-up never folds them (a quantized model's stages keep its quantization).
QUANTIZATION_OPS = frozenset({"QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear", "QLinearConv", "QLinearMatMul", "ConvInteger",
                              "MatMulInteger"})


def draws_random(graph: onnx.GraphProto) -> tuple[str, ...]:
    """The nodes whose outputs are drawn anew on every run: the random ops, and Dropout in training mode (a model
    exported with torch.onnx.TrainingMode.TRAINING: its training_mode input is not a constant False)."""
    constants = {t.name: t for t in graph.initializer}
    constants.update({n.output[0]: n.attribute[0].t for n in graph.node if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value"})

    def training(node: onnx.NodeProto) -> bool:
        if len(node.input) < 3 or not node.input[2]:
            return False
        flag = constants.get(node.input[2])
        return flag is None or bool(numpy_helper.to_array(flag).any())

    return tuple(n.name or n.op_type for n in graph.node if n.op_type in RANDOM_OPS or (n.op_type == "Dropout" and training(n)))


def has_subgraph(node: onnx.NodeProto) -> bool:
    """Whether the node carries a body (If, Loop, Scan)."""
    return any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute)


def subgraph_captures(node: onnx.NodeProto) -> tuple[str, ...]:
    """Names a node's subgraphs (If/Loop/Scan bodies, recursively) read from the enclosing scope."""
    captured: list[str] = []
    for attr in node.attribute:
        graphs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in graphs:
            defined = {i.name for i in g.input} | {t.name for t in g.initializer}
            for inner in g.node:
                for name in list(inner.input) + list(subgraph_captures(inner)):
                    if name and name not in defined and name not in captured:
                        captured.append(name)
                defined.update(o for o in inner.output if o)
            for out in g.output:
                if out.name not in defined and out.name not in captured:
                    captured.append(out.name)
    return tuple(captured)


#: Dtypes that carry gradients: a stage's inputs of these get one from its backward (the trainer's rule, which the pricing mirrors).
FLOAT_DTYPES = frozenset({"float16", "float32", "float64", "bfloat16"})


def is_float_dtype(dtype: str | np.dtype) -> bool:
    """numpy's floating types and bfloat16, which numpy holds as a type of its own kind (ml_dtypes) that
    `np.issubdtype(..., np.floating)` does not count: a bfloat16 model's weights and loss are floats all the same."""
    found = np.dtype(dtype)
    return found.name in FLOAT_DTYPES or bool(np.issubdtype(found, np.floating))


def is_weight(dtype: str | np.dtype, shape: tuple[int, ...]) -> bool:
    """A floating-point initializer of more than one element is a trainable weight; scalars and
    one-element tensors (a Pow exponent, a 1/sqrt(d) scale, a mask fill value) are constants."""
    return is_float_dtype(dtype) and math.prod(shape) > 1


#: Inputs the ONNX spec calls non-differentiable that onnxruntime-training differentiates all the same (asked of
#: its gradient builder): LSTM's initial hidden and cell states.
_DIFFERENTIATED_ANYWAY = {("", "LSTM"): (5, 6)}


@functools.cache
def _non_differentiable(domain: str, op_type: str, slot: int) -> bool:
    """Whether the ONNX spec marks the input slot non-differentiable (Resize's scales, Clip's bounds, Pad's fill)."""
    if slot in _DIFFERENTIATED_ANYWAY.get((domain, op_type), ()):
        return False
    try:
        schema = onnx.defs.get_schema(op_type, domain)
    except onnx.defs.SchemaError:  # contrib and custom ops: assume a gradient flows
        return False
    inputs = schema.inputs
    formal = inputs[min(slot, len(inputs) - 1)] if inputs else None
    return formal is not None and formal.differentiation_category == onnx.defs.OpSchema.DifferentiationCategory.NonDifferentiable


#: The metadata key loading sets on an initializer the model never trained (`hold`): an exporter's constant or buffer.
HELD = "onnxpipe.held"


def hold(tensor: onnx.TensorProto, why: str) -> None:
    """Mark the tensor as held, never trained, in the tensor itself: the mark travels into stage files."""
    if not is_held(tensor):
        tensor.metadata_props.add(key=HELD, value=why)


def is_held(tensor: onnx.TensorProto) -> bool:
    return any(p.key == HELD for p in tensor.metadata_props)


def differentiable_from(graph: onnx.GraphProto, targets: Iterable[str]) -> frozenset[str]:
    """Every tensor a gradient of one of `targets` can flow back to: the targets, and each input a node reads at a slot
    the spec calls differentiable where one of its outputs is such a tensor (a float a stage receives that feeds only an
    Expand's shape gets none: the gradient builder refuses to make one)."""
    reached = set(targets)
    for node in reversed(graph.node):
        if any(o in reached for o in node.output if o):
            domain = node.domain if node.domain != "ai.onnx" else ""
            reached.update(name for slot, name in enumerate(node.input) if name and not _non_differentiable(domain, node.op_type, slot))
    return frozenset(reached)


def trained_initializers(graph: onnx.GraphProto) -> frozenset[str]:
    """The initializers training updates: the one rule the trainer (`train.graphs`) and the pricing
    (`Graph.trained`: gradients, optimizer state, all-reduce) both apply. Floating-point weights of more than
    one element (`is_weight`), except tensors a node reads as state (BatchNorm's running statistics) and tensors
    every reader reads where no gradient flows (a Resize's scales, which the dynamo exporter may store once with
    a GroupNorm's scale of the same values: untied, the Resize's copy has no gradient to train), and tensors
    loading marked held (`hold`: the exporter's constants and buffers, which torch never trains). Weights
    of other dtypes (int8 behind a DequantizeLinear) and tensors made by constant subgraphs (a ConstantOfShape
    fill) are held, never trained."""
    state = state_inputs(graph)
    differentiable: set[str] = set()
    read: set[str] = set()
    for node in graph.node:
        for slot, name in enumerate(node.input):
            read.add(name)
            if not _non_differentiable(node.domain if node.domain != "ai.onnx" else "", node.op_type, slot):
                differentiable.add(name)
    return frozenset(t.name for t in graph.initializer
                     if t.name not in state and not is_held(t) and (t.name in differentiable or t.name not in read)
                     and is_weight(helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims)))
