"""Which ops onnxruntime-training cannot differentiate, asked of onnxruntime itself, before any training starts.

No hand-kept list: for each op type on a gradient path (a float input that depends on a trained
tensor, a float output), one node of that type is put alone in a tiny model whose loss sums its
float outputs, and onnxruntime-training's gradient builder is asked for the gradients of its
trained inputs. The answer is cached per op type, opset and differentiated inputs, so a model
asks once per op type. Exporter patterns with a differentiable equivalent are rewritten first
(`onnxpipe.rewrites`) and opsets below 13 lifted (`onnxpipe.opset`), as training does.

Reading order: `MissingGradient` -> `missing_gradients` -> `ensure_gradients` -> `_probe` -> `_tiny_model`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.nodes import trained_initializers
from onnxpipe.opset import training_opset
from onnxpipe.ortutil import REWRITTEN_OPS, cpu_session, gradient_model, state_inputs
from onnxpipe.protostream import is_streamable, raw_nbytes, skeleton
from onnxpipe.rewrites import FLOAT_TYPES, for_gradient_builder

__all__ = ["MissingGradient", "missing_gradients", "ensure_gradients", "describe_missing"]

#: Initializers above this many bytes reach the probes without their values (as graph inputs).
_SMALL = 4096
#: The gradient builder's verdict per (domain, op type, opset, differentiated input slots): a cache,
#: since every stage of every model asks again and one probe costs milliseconds.
_VERDICTS: dict[tuple[str, str, int, tuple[int, ...]], bool] = {}


@dataclass(frozen=True)
class MissingGradient:
    """An op type onnxruntime-training cannot differentiate, and the nodes of it on a gradient path."""

    op_type: str
    nodes: tuple[str, ...]


def _types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    graph = model.graph
    types = {v.name: v.type for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    made = {o for n in graph.node for o in n.output if o}
    if any(o not in types for o in made):
        probe = onnx.ModelProto()
        probe.CopyFrom(model)
        try:
            inferred = onnx.shape_inference.infer_shapes(probe, strict_mode=False)
            types.update({v.name: v.type for v in inferred.graph.value_info})
        except Exception:  # contrib ops: keep what is declared; nodes without types are not probed
            pass
    for t in graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def _is_float(t: onnx.TypeProto | None) -> bool:
    return t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type in FLOAT_TYPES


def missing_gradients(model: onnx.ModelProto, trained: Iterable[str] | None = None) -> tuple[MissingGradient, ...]:
    """Every op type on a gradient path that onnxruntime-training 1.19.2 cannot differentiate, after
    `rewrites.for_gradient_builder`. `trained`: the tensors gradients are wanted for (default: the weights
    training updates, `nodes.trained_initializers`)."""
    model = for_gradient_builder(training_opset(_light(model)))
    graph = model.graph
    types = _types(model)
    if trained is None:
        trained = trained_initializers(graph)
    live = set(trained) - state_inputs(graph)
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)
    bad: dict[str, list[str]] = {}
    for node in graph.node:
        slots = tuple(k for k, name in enumerate(node.input) if name in live and _is_float(types.get(name)))
        outs = [o for o in node.output if o and (_is_float(types.get(o)) or _is_sequence(types.get(o)))]
        if not slots or not outs:
            continue
        live.update(outs)
        if node.op_type in REWRITTEN_OPS and node.domain in ("", "ai.onnx"):
            continue  # differentiable after onnxruntime's own pre-training rewrites, which training runs
        key = (node.domain, node.op_type, opset, slots)
        if key not in _VERDICTS:
            tiny = _tiny_model(model, node, slots, types)
            if tiny is None:
                continue
            _VERDICTS[key] = _probe(tiny, {f"{node.input[k]}/probe_in" for k in slots})
        if not _VERDICTS[key]:
            bad.setdefault(node.op_type, []).append(node.name or node.op_type)
    return tuple(MissingGradient(op, tuple(nodes)) for op, nodes in bad.items())


def _light(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with its large initializers' bytes left out: the probes need their types, not their values."""
    light = skeleton(model, "graph")
    light.graph.CopyFrom(skeleton(model.graph, "initializer"))
    for t in model.graph.initializer:
        light.graph.initializer.append(skeleton(t, "raw_data") if is_streamable(t) and raw_nbytes(t) > _SMALL else t)
    return light


def _is_sequence(t: onnx.TypeProto | None) -> bool:
    return t is not None and t.HasField("sequence_type")


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


def _probe(model: onnx.ModelProto, wanted: set[str]) -> bool:
    """Whether onnxruntime-training builds the gradient of the tiny model's loss for every wanted input, and the
    CPU runs it: ConvTranspose's gradient builds, but its ConvTransposeGrad kernel exists for CUDA only, which
    a worker found only when it loaded its stage."""
    try:
        grad = gradient_model(model.SerializeToString(), "onnxpipe/probe_loss", wanted)
    except Exception:  # onnxruntime's "no gradient for op" / "unreachable from the output" and kin
        return False
    produced = {o for n in grad.graph.node for o in n.output}
    if not all(f"{w}_grad" in produced for w in wanted):
        return False
    try:
        cpu_session(grad.SerializeToString(), optimize=False)
    except Exception:  # NOT_IMPLEMENTED: no CPU kernel for a gradient op
        return False
    return True


def _tiny_model(model: onnx.ModelProto, node: onnx.NodeProto, slots: tuple[int, ...], types: dict[str, onnx.TypeProto]) -> onnx.ModelProto | None:
    """`node` alone: differentiated inputs and runtime inputs as graph inputs, constants as initializers,
    loss = sum of its float outputs (a sequence output read at position 0). None when a type is unknown."""
    inits = {t.name: t for t in model.graph.initializer}
    inputs, initializers, feeds = [], [], []
    seen: set[str] = set()
    for k, name in enumerate(node.input):
        if not name or name in seen:
            continue
        seen.add(name)
        if name in inits and k not in slots and raw_nbytes(inits[name]) <= _SMALL:
            initializers.append(inits[name])
        elif name in types:
            # differentiated inputs pass an Identity: the builder writes `<input>_grad` twice for a
            # graph input read twice by one node (x * x), which is no fault of the op
            fed = f"{name}/probe_in" if k in slots else name
            vi = onnx.ValueInfoProto(name=fed)
            vi.type.CopyFrom(types[name])
            inputs.append(vi)
            if k in slots:
                feeds.append(helper.make_node("Identity", [fed], [name]))
        else:
            return None
    nodes = [*feeds, node]
    terms = []
    for i, out in enumerate(o for o in node.output if o):
        t = types.get(out)
        if _is_sequence(t):
            initializers.append(helper.make_tensor(f"onnxpipe/probe_at{i}", TensorProto.INT64, [], [0]))
            nodes.append(helper.make_node("SequenceAt", [out, f"onnxpipe/probe_at{i}"], [f"{out}/at"]))
            out = f"{out}/at"
            elem = t.sequence_type.elem_type.tensor_type.elem_type
        elif _is_float(t):
            elem = t.tensor_type.elem_type
        else:
            continue
        term = f"onnxpipe/probe_sum{i}"
        nodes.append(helper.make_node("ReduceSum", [out], [term], keepdims=0))
        if elem != TensorProto.FLOAT:
            nodes.append(helper.make_node("Cast", [term], [f"{term}/f"], to=TensorProto.FLOAT))
            term = f"{term}/f"
        terms.append(term)
    if not terms:
        return None
    total = terms[0]
    for k, term in enumerate(terms[1:]):  # Add, not Sum: Sum has no gradient builder
        nodes.append(helper.make_node("Add", [total, term], [f"onnxpipe/probe_acc{k}"]))
        total = f"onnxpipe/probe_acc{k}"
    nodes.append(helper.make_node("Identity", [total], ["onnxpipe/probe_loss"]))
    graph = helper.make_graph(nodes, "probe", inputs, [helper.make_tensor_value_info("onnxpipe/probe_loss", TensorProto.FLOAT, [])], initializers)
    tiny = helper.make_model(graph, opset_imports=list(model.opset_import))
    tiny.ir_version = min(model.ir_version or 10, 10)
    return tiny
