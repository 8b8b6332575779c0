"""A stage's backward in two parts, for the zero-bubble schedules: B, the gradients of the stage inputs
(which the previous stage waits for), and W, the gradients of the weights (which only the optimizer
step needs, so a schedule may run it later, in what would be a bubble).

Both parts come from the one gradient graph `graphs.build_stage_graphs` builds with onnxruntime-training's
GradientGraphBuilder: B is every backward node that the input gradients need, W every other node that
the weight gradients need. W reads what B leaves (intermediate gradients and, with recompute, the
rebuilt activations): B returns those tensors and the worker stashes them from B to W (`left`), the
rest of the stage's stash being freed after W. The same nodes run on the same inputs, so B then W
gives the fused backward's gradients bit for bit.

Reading order: `SplitBackward` -> `split_backward` -> `left_bytes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx

from onnxpipe.train.graphs import StageGraphs, _ancestors, _free_inputs, _ort_types, _submodel, grad_name

__all__ = ["SplitBackward", "split_backward", "left_bytes", "SEPARABLE"]

#: Gradient ops that make input and weight gradients in one node and make any subset of them when
#: the others are left out: B runs them for the input gradient, W again for the weight gradients.
#: (LayerNormalizationGrad and BatchNormalizationGrad need all their outputs, and LSTMGrad with some
#: left out crashes onnxruntime 1.19.2: B makes their weight gradients, `b_trained`.)
SEPARABLE = frozenset({"ConvGrad"})


@dataclass(frozen=True)
class SplitBackward:
    """B and W models of one stage's backward, serialized, and what each reads and returns."""

    #: Inputs: `b_inputs`. Outputs: grads of the stage's `grad_inputs` (in order), of `b_trained`, then
    #: `left`. None when no input gets a gradient (the first stage): all its backward is W.
    b: bytes | None
    #: Inputs: `w_inputs`. Outputs: grads of `w_trained`. None when B makes every weight gradient.
    w: bytes | None
    #: What B reads: output-gradient feeds, stash names, parameters (a subset of the fused backward's inputs).
    b_inputs: tuple[str, ...]
    #: What W reads: fused-backward inputs (feeds, stash, parameters) and `left`.
    w_inputs: tuple[str, ...]
    #: Tensors B computes and W reads: held from B to W.
    left: tuple[str, ...]
    #: Trained parameters whose gradient B makes (one node gives it with an input gradient, as ConvGrad does).
    b_trained: tuple[str, ...]
    #: Trained parameters whose gradient W makes.
    w_trained: tuple[str, ...]


def split_backward(graphs: StageGraphs) -> SplitBackward:
    """B and W of a stage whose `graphs.backward` is the fused backward (see the module docstring)."""
    if graphs.backward is None:
        raise ValueError("a stage without a backward has nothing to split")
    fused = onnx.load_from_string(graphs.backward)
    inputs = {i.name for i in fused.graph.input}
    input_grads = tuple(grad_name(x) for x in graphs.grad_inputs)
    _separate(fused.graph, _ancestors(fused.graph, input_grads), input_grads)
    b_nodes = _ancestors(fused.graph, input_grads)
    made_by_b = {o for n in b_nodes for o in n.output if o}
    b_trained = tuple(p for p in graphs.trained if grad_name(p) in made_by_b)
    w_trained = tuple(p for p in graphs.trained if grad_name(p) not in made_by_b)
    in_b = {id(n) for n in b_nodes}
    w_nodes = [n for n in _ancestors(fused.graph, [grad_name(p) for p in w_trained]) if id(n) not in in_b]
    w_reads = _free_inputs(fused.graph, w_nodes)
    left = tuple(x for x in w_reads if x in made_by_b)
    types = _types(fused, left)
    b_inputs = tuple(x for x in _free_inputs(fused.graph, b_nodes) if x in inputs)
    w_inputs = tuple(x for x in w_reads if x in inputs) + left
    b_outputs = input_grads + tuple(grad_name(p) for p in b_trained) + left
    b = _submodel(fused, b_nodes, b_inputs, b_outputs, types).SerializeToString() if input_grads else None
    w = _submodel(fused, w_nodes, w_inputs, tuple(grad_name(p) for p in w_trained), types).SerializeToString() if w_trained else None
    return SplitBackward(b, w, b_inputs, w_inputs, left, b_trained, w_trained)


def _separate(graph: onnx.GraphProto, b_nodes: list[onnx.NodeProto], input_grads: tuple[str, ...]) -> None:
    """Cut each gradient node of `SEPARABLE` that B runs into two: one making what B needs, one (for W)
    making the rest (its weight gradients), each output computed once either way."""
    needed = set(input_grads) | {i for n in b_nodes for i in n.input}
    for node in b_nodes:
        if node.op_type not in SEPARABLE or all(o in needed for o in node.output if o):
            continue
        w_part = onnx.NodeProto()
        w_part.CopyFrom(node)
        w_part.name = f"{node.name}/w"
        for k, o in enumerate(node.output):
            if o in needed:
                w_part.output[k] = ""
            else:
                node.output[k] = ""
        graph.node.insert(list(graph.node).index(node) + 1, w_part)


def _types(model: onnx.ModelProto, names: tuple[str, ...]) -> dict[str, onnx.TypeProto]:
    """Types of intermediate tensors: declared ones, else as onnxruntime infers them for `names` made
    graph outputs (gradient ops are contrib ops, which onnx's shape inference does not know)."""
    declared = {v.name: v.type for v in model.graph.value_info}
    missing = [x for x in names if x not in declared]
    if not missing:
        return declared
    return {**declared, **_ort_types(model, missing)}


def left_bytes(split: SplitBackward, values: dict[str, np.ndarray]) -> int:
    """Bytes a worker holds from B to W for one micro-batch: B's `left` outputs, and the fused backward's
    inputs W reads that B does not (stash and feeds kept for W; parameters are held anyway)."""
    names = set(split.left) | (set(split.w_inputs) - set(split.b_inputs))
    return sum(values[x].nbytes for x in names if x in values)
