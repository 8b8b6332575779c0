"""Whether onnxruntime-training can differentiate one node, asked of onnxruntime itself (cached per op type).

One node is put alone in a tiny model whose loss sums its float outputs, and onnxruntime-training's gradient
builder is asked for the gradients of the inputs wanted; the gradient graph must also load on the CPU (a gradient
whose kernel exists for CUDA only counts as none). The gradient check (`onnxpipe.gradients`) asks this of every
node on a gradient path, and the rewrites (`onnxpipe.rewrites`) before they expand an op into its ONNX function body.

Reading order: `tensor_types` -> `differentiable` -> `_signature` -> `_probe` -> `_tiny_model`.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.ortutil import cpu_session, gradient_model
from onnxpipe.protostream import raw_nbytes

__all__ = ["FLOAT_TYPES", "SMALL", "tensor_types", "is_float", "is_sequence", "differentiable"]

#: Element types a gradient flows through.
FLOAT_TYPES = frozenset({TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16})
#: Initializers above this many bytes reach the probes without their values (as graph inputs).
SMALL = 4096
#: The gradient builder's verdict per node signature (`_signature`): a cache, since every stage of every model asks
#: again and one probe costs milliseconds.
_VERDICTS: dict[tuple, bool] = {}


def tensor_types(model: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    """Every value's type the model declares, plus what onnx shape inference finds where a node output has none."""
    graph = model.graph
    types = {v.name: v.type for v in list(graph.input) + list(graph.value_info) + list(graph.output)}
    if any(o not in types for n in graph.node for o in n.output if o):
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            types.update({v.name: v.type for v in inferred.graph.value_info if v.name not in types})
        except Exception:  # contrib ops: keep what is declared; nodes without types are not probed
            pass
    for t in graph.initializer:
        types.setdefault(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims)))
    return types


def is_float(t: onnx.TypeProto | None) -> bool:
    return t is not None and t.HasField("tensor_type") and t.tensor_type.elem_type in FLOAT_TYPES


def is_sequence(t: onnx.TypeProto | None) -> bool:
    return t is not None and t.HasField("sequence_type")


def differentiable(model: onnx.ModelProto, node: onnx.NodeProto, slots: tuple[int, ...], types: dict[str, onnx.TypeProto], opset: int) -> bool | None:
    """Whether onnxruntime-training gives `node` (of `model`) gradients for its input `slots` that run on the CPU;
    None where a type is unknown (nothing asked)."""
    key = _signature(model, node, slots, types, opset)
    if key not in _VERDICTS:
        tiny = _tiny_model(model, node, slots, types)
        if tiny is None:
            return None
        _VERDICTS[key] = _probe(tiny, {f"{node.input[k]}/probe_in" for k in slots})
    return _VERDICTS[key]


def _signature(model: onnx.ModelProto, node: onnx.NodeProto, slots: tuple[int, ...], types: dict[str, onnx.TypeProto], opset: int) -> tuple:
    """What the verdict depends on: the op, its attributes (Pad has a gradient in constant mode only) and, per input,
    the value the probe holds it at where it is a constant (Slice's steps), its element type and rank. Not the op
    type alone: a cache keyed so answered for every Pad what the first one asked got, in every model of the process."""
    inits = {t.name: t for t in model.graph.initializer}
    inputs = []
    for k, name in enumerate(node.input):
        found = types.get(name)
        dims = len(found.tensor_type.shape.dim) if found is not None and found.tensor_type.HasField("shape") else None
        held = _held_constant(inits, name, k, slots)
        value = (inits[name].data_type, tuple(inits[name].dims), numpy_helper.to_array(inits[name]).tobytes()) if held else None
        inputs.append((bool(name), value, found.tensor_type.elem_type if found is not None else None, dims))
    return (node.domain, node.op_type, opset, slots, tuple(sorted(a.SerializeToString() for a in node.attribute)), tuple(inputs))


def _held_constant(inits: dict[str, onnx.TensorProto], name: str, k: int, slots: tuple[int, ...]) -> bool:
    """Whether the probe of a node holds its input `name` (slot `k`) as a constant: a small initializer not differentiated."""
    return name in inits and k not in slots and raw_nbytes(inits[name]) <= SMALL


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
        if _held_constant(inits, name, k, slots):
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
        if is_sequence(t):
            initializers.append(helper.make_tensor(f"onnxpipe/probe_at{i}", TensorProto.INT64, [], [0]))
            nodes.append(helper.make_node("SequenceAt", [out, f"onnxpipe/probe_at{i}"], [f"{out}/at"]))
            out = f"{out}/at"
            elem = t.sequence_type.elem_type.tensor_type.elem_type
        elif is_float(t):
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
