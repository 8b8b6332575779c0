"""Stage training graphs: one stage model becomes a forward and a backward onnxruntime model.

Reading order: `StageGraphs` -> `build_stage_graphs` (public entry) -> preparation passes
(`_separate_repeated_inputs`, `ortutil.lift_initializers`, `_add_total_loss`)
-> `for_gradient_builder` + `ensure_gradients` (onnxpipe.rewrites, onnxpipe.gradients) -> `_pretraining_rewrite` -> `_gradient_model` -> `_split` (forward part, backward part, stash).

The trick: the stage's loss is its real loss (when it holds the model's loss) plus, for every
output a later stage reads, the surrogate sum(output * output_grad), where output_grad is a new
graph input. Its gradient graph then turns output gradients into input and parameter gradients.
The forward part is every node the stage outputs need; the rest is the backward part. Tensors
crossing from one to the other are the stash (or, with recompute, the backward runs the forward
part again from the stage inputs).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.gradients import ensure_gradients
from onnxpipe.nodes import trained_initializers
from onnxpipe.ortutil import REWRITTEN_OPS, cpu_session, gradient_model, lift_initializers, ort_reason, pretraining_rewrite
from onnxpipe.rewrites import for_gradient_builder
from onnxpipe.opset import training_opset

__all__ = [
    "StageGraphs",
    "build_stage_graphs",
    "grad_input_name",
    "grad_name",
    "TOTAL_LOSS",
]

#: Name of the stage's total (real + surrogate) loss output.
TOTAL_LOSS = "onnxpipe/total_loss"


def grad_input_name(output: str) -> str:
    """Graph input carrying the gradient of a stage output (fed from the stages that read it)."""
    return f"onnxpipe/grad_in/{output}"


def grad_name(tensor: str) -> str:
    """Output of the gradient graph holding d loss / d tensor."""
    return f"{tensor}_grad"


@dataclass(frozen=True)
class StageGraphs:
    """A stage's forward and backward models, serialized, and what the worker feeds and keeps."""

    #: Inputs: stage inputs (+ labels) + parameters. Outputs: `outputs` (+ `loss`) + `stash`.
    forward: bytes
    #: Inputs: `backward_inputs`. Outputs: grads of `grad_inputs` then of `trained`. None when nothing is trained.
    backward: bytes | None
    #: Data inputs of the stage model, in order (activations, model inputs, labels).
    inputs: tuple[str, ...]
    #: Stage outputs the forward returns.
    outputs: tuple[str, ...]
    #: Trainable parameters, fed as graph inputs; their starting values are in `initial`.
    params: tuple[str, ...]
    #: The parameters that get a gradient (the others do not reach the loss and stay fixed).
    trained: tuple[str, ...]
    #: Float inputs from earlier stages whose gradients the backward returns.
    grad_inputs: tuple[str, ...]
    #: Stage outputs that receive a gradient (graph inputs `grad_input_name(o)` of the backward).
    grad_outputs: tuple[str, ...]
    #: Tensors the forward returns for the backward (empty with recompute).
    stash: tuple[str, ...]
    #: What the backward reads besides output gradients: stash names, and with recompute the stage inputs and params.
    backward_inputs: tuple[str, ...]
    #: The model's scalar loss output when this stage computes it.
    loss: str | None
    recompute: bool
    initial: dict[str, np.ndarray] = field(repr=False, compare=False)


def build_stage_graphs(
    model: onnx.ModelProto,
    *,
    params: Iterable[str],
    grad_inputs: Iterable[str],
    grad_outputs: Iterable[str],
    loss: str | None,
    recompute: bool,
    origin: str = "stage",
) -> StageGraphs:
    """Forward and backward models of one stage.

    params: initializers to train (those `nodes.trained_initializers` admits, the rule pricing uses too); grad_inputs: float inputs whose gradients go back to earlier
    stages; grad_outputs: outputs later stages send gradients for; loss: the scalar loss output held here.
    """
    work = onnx.ModelProto()
    work.CopyFrom(training_opset(model, origin))
    inits = {t.name: t for t in work.graph.initializer}
    trainable = trained_initializers(work.graph)
    params = tuple(p for p in dict.fromkeys(params) if p in trainable)
    grad_inputs, grad_outputs = tuple(grad_inputs), tuple(grad_outputs)
    data_inputs = tuple(i.name for i in work.graph.input if i.name not in inits)
    outputs = tuple(o.name for o in work.graph.output if o.name != loss)
    initial = {p: numpy_helper.to_array(inits[p]).copy() for p in params}

    _separate_repeated_inputs(work.graph, set(params) | set(grad_inputs))
    lift_initializers(work.graph, params)  # the worker holds them as numpy arrays and feeds them
    forward_outputs = outputs + ((loss,) if loss else ())

    def forward_only() -> StageGraphs:
        forward = _submodel(work, _ancestors(work.graph, forward_outputs), data_inputs + params, forward_outputs, {})
        return StageGraphs(forward.SerializeToString(), None, data_inputs, outputs, params, (), (), (), (), (), loss, recompute, initial)

    if not (params or grad_inputs) or not (grad_outputs or loss):
        return forward_only()
    work = for_gradient_builder(work)  # exporter patterns onnxruntime cannot differentiate rewritten (forward values unchanged)
    ensure_gradients(work, set(params) | set(grad_inputs), origin)
    if any(n.op_type in REWRITTEN_OPS for n in work.graph.node):
        work = _pretraining_rewrite(work, set(params) | set(grad_inputs), origin)
    _add_total_loss(work, loss, grad_outputs)
    grad_model = _gradient_model(work, set(params) | set(grad_inputs), origin)
    produced = {o for n in grad_model.graph.node for o in n.output}
    # Tensors off every path to the loss (a side head's weights) get no gradient: they stay fixed, as in torch.
    grad_inputs = tuple(x for x in grad_inputs if grad_name(x) in produced)
    trained = tuple(p for p in params if grad_name(p) in produced)
    wanted = tuple(grad_name(x) for x in grad_inputs + trained)
    if not wanted:
        return forward_only()
    fwd_nodes = _ancestors(grad_model.graph, forward_outputs)
    types = _value_types(grad_model, fwd_nodes)
    bwd_nodes = _ancestors(grad_model.graph, wanted)
    if not recompute:
        in_forward = {id(f) for f in fwd_nodes}
        bwd_nodes = [n for n in bwd_nodes if id(n) not in in_forward]
    grad_feeds = tuple(grad_input_name(o) for o in grad_outputs)
    backward_inputs = tuple(x for x in _free_inputs(grad_model.graph, bwd_nodes) if x not in grad_feeds)
    graph_inputs = {i.name for i in grad_model.graph.input}
    stash = tuple(x for x in backward_inputs if x not in graph_inputs)
    forward = _submodel(grad_model, fwd_nodes, data_inputs + params, tuple(dict.fromkeys(forward_outputs + stash)), types)
    backward = _submodel(grad_model, bwd_nodes, grad_feeds + backward_inputs, wanted, types)
    return StageGraphs(
        forward.SerializeToString(), backward.SerializeToString(), data_inputs, outputs, params, trained,
        grad_inputs, grad_outputs, stash, backward_inputs, loss, recompute, initial,
    )


def _separate_repeated_inputs(graph: onnx.GraphProto, trained: set[str]) -> None:
    """One trained tensor feeding two inputs of a node gives two gradients of one name: route repeats through an Identity."""
    extra: list[tuple[int, onnx.NodeProto]] = []
    for i, node in enumerate(graph.node):
        seen: set[str] = set()
        for k, name in enumerate(node.input):
            if name in trained and name in seen:
                alias = f"{name}/onnxpipe_alias{i}_{k}"
                extra.append((i, helper.make_node("Identity", [name], [alias], name=alias)))
                node.input[k] = alias
            seen.add(name)
    for i, node in reversed(extra):
        graph.node.insert(i, node)


def _add_total_loss(model: onnx.ModelProto, loss: str | None, grad_outputs: Sequence[str]) -> None:
    """TOTAL_LOSS = loss + sum_j ReduceSum(output_j * output_grad_j), in float32: a float16 or double term is cast
    (its gradient, 1, is exact in any float type), since the terms of a mixed-precision stage differ in type."""
    graph = model.graph
    types = {v.name: v.type.tensor_type for v in list(graph.output) + list(graph.value_info) + list(graph.input)}
    typed = [(loss, types[loss].elem_type)] if loss else []
    for out in grad_outputs:
        g = grad_input_name(out)
        tt = types[out]
        shape = [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tt.shape.dim]
        graph.input.append(helper.make_tensor_value_info(g, tt.elem_type, shape))
        graph.node.append(helper.make_node("Mul", [out, g], [f"{g}/prod"], name=f"{g}/prod"))
        graph.node.append(helper.make_node("ReduceSum", [f"{g}/prod"], [f"{g}/sum"], name=f"{g}/sum", keepdims=0))
        typed.append((f"{g}/sum", tt.elem_type))
    terms = []
    for term, elem in typed:
        if elem != TensorProto.FLOAT:
            graph.node.append(helper.make_node("Cast", [term], [f"{term}/float"], name=f"{term}/float", to=TensorProto.FLOAT))
            term = f"{term}/float"
        terms.append(term)
    acc = terms[0]
    for k, term in enumerate(terms[1:]):
        acc_next = TOTAL_LOSS if k == len(terms) - 2 else f"{TOTAL_LOSS}/{k}"
        graph.node.append(helper.make_node("Add", [acc, term], [acc_next], name=acc_next))
        acc = acc_next
    if acc != TOTAL_LOSS:
        graph.node.append(helper.make_node("Identity", [acc], [TOTAL_LOSS], name=TOTAL_LOSS))
    graph.output.append(helper.make_tensor_value_info(TOTAL_LOSS, TensorProto.FLOAT, []))


def _pretraining_rewrite(model: onnx.ModelProto, trained: set[str], origin: str) -> onnx.ModelProto:
    """onnxruntime's pre-training graph rewrites, which give LSTM and BatchNormalization their gradients.

    Parameters are graph inputs by now, so the rewrites cannot fold or merge them (equal-valued
    initializers would otherwise be shared). BatchNormalization turns into training mode: it
    normalizes with each micro-batch's statistics, and its running mean and variance are not
    updated (they stay as in the stage file, which export keeps for inference).
    """
    try:
        rewritten = pretraining_rewrite(model.SerializeToString(), trained)
    except Exception as exc:  # onnxruntime raises plain RuntimeError/Fail with a long message
        raise OnnxpipeError(f"{origin}: onnxruntime's pre-training rewrites failed: {ort_reason(exc)}; check the model's ops with `onnxpipe inspect`") from exc
    return onnx.load_from_string(rewritten)


def _gradient_model(model: onnx.ModelProto, trained: set[str], origin: str) -> onnx.ModelProto:
    try:
        return gradient_model(model.SerializeToString(), TOTAL_LOSS, trained)
    except Exception as exc:  # onnxruntime raises plain RuntimeError/Fail with a long message
        raise OnnxpipeError(f"{origin}: onnxruntime-training could not build the gradient graph: {ort_reason(exc)}; check the model's ops with `onnxpipe inspect`") from exc


def _producers(graph: onnx.GraphProto) -> dict[str, onnx.NodeProto]:
    return {o: n for n in graph.node for o in n.output if o}


def _ancestors(graph: onnx.GraphProto, targets: Iterable[str]) -> list[onnx.NodeProto]:
    """Nodes needed to compute `targets`, in graph order."""
    producer = _producers(graph)
    needed: set[int] = set()
    stack = [producer[t] for t in targets if t in producer]
    while stack:
        node = stack.pop()
        if id(node) in needed:
            continue
        needed.add(id(node))
        stack.extend(producer[i] for i in node.input if i in producer)
    return [n for n in graph.node if id(n) in needed]


def _free_inputs(graph: onnx.GraphProto, nodes: Sequence[onnx.NodeProto]) -> tuple[str, ...]:
    """Tensors the nodes read that they do not make and that are not initializers, in first-use order."""
    made = {o for n in nodes for o in n.output}
    inits = {t.name for t in graph.initializer}
    reads: dict[str, None] = {}
    for n in nodes:
        for i in n.input:
            if i and i not in made and i not in inits:
                reads[i] = None
    return tuple(reads)


def _value_types(model: onnx.ModelProto, forward_nodes: Sequence[onnx.NodeProto]) -> dict[str, onnx.TypeProto]:
    """Types of every value: declared ones, plus onnx shape inference over the forward part (standard ops)."""
    types = {v.name: v.type for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)}
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.node[:]
    probe.graph.node.extend(forward_nodes)
    del probe.graph.output[:]
    try:
        inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
        types.update({v.name: v.type for v in inferred.graph.value_info})
    except Exception:  # contrib ops in the forward part: fall back to declared types
        pass
    if any(n.domain not in ("", "ai.onnx") for n in forward_nodes):
        types.update(_ort_types(probe))
    for t in model.graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _ort_types(probe: onnx.ModelProto, names: Iterable[str] | None = None) -> dict[str, onnx.TypeProto]:
    """Types onnxruntime infers for every node output, or for `names` (onnx knows no contrib op such as
    LSTMTraining): they become untyped graph outputs of a session whose declared outputs are then read."""
    typed = onnx.ModelProto()
    typed.CopyFrom(probe)
    del typed.graph.output[:]
    wanted = names if names is not None else (o for n in typed.graph.node for o in n.output if o)
    typed.graph.output.extend(onnx.ValueInfoProto(name=o) for o in wanted)
    try:
        outputs = cpu_session(typed.SerializeToString(), optimize=False).get_outputs()
    except Exception:  # leave the declared types; `_value_info` names the tensor it misses
        return {}
    types = {}
    for out in outputs:
        elem = TensorProto.DataType.Value(out.type.removeprefix("tensor(").removesuffix(")").upper())
        shape = [d if isinstance(d, int) else None for d in out.shape] if out.shape is not None else None
        types[out.name] = helper.make_tensor_type_proto(elem, shape)
    return types


def _submodel(model: onnx.ModelProto, nodes: Sequence[onnx.NodeProto], inputs: Sequence[str], outputs: Sequence[str],
              types: dict[str, onnx.TypeProto]) -> onnx.ModelProto:
    """A standalone model of `nodes` with the given inputs and outputs and the initializers they use."""
    known = {v.name: v.type for v in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)}
    known.update(types)
    used = {i for n in nodes for i in n.input} | set(outputs)
    graph = helper.make_graph(
        list(nodes),
        model.graph.name or "stage",
        [_value_info(x, known) for x in inputs],
        [_value_info(x, known) for x in outputs],
        [t for t in model.graph.initializer if t.name in used and t.name not in set(inputs)],
    )
    boundary = set(inputs) | set(outputs)
    made = [o for n in nodes for o in n.output if o and o not in boundary and o in known]
    # Declared intermediate types: some gradient kernels (MaxPoolGrad) cannot infer their output shape alone.
    graph.value_info.extend(_value_info(x, known) for x in made)
    out = helper.make_model(graph, opset_imports=list(model.opset_import))
    out.ir_version = min(model.ir_version, 10)
    return out


def _value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    vi = onnx.ValueInfoProto()
    vi.name = name
    if name not in types:
        raise OnnxpipeError(f"internal: no type known for tensor {name!r} while building stage graphs; report this model")
    vi.type.CopyFrom(types[name])
    return vi
