"""Exporter patterns onnxruntime-training cannot differentiate, rewritten to equivalents it can, and the rounds
that run every rewrite (these and the per-node ones of `onnxpipe.lowerings`).

Each rewrite runs on a copy of a stage model before its gradient graph is built; stage files keep the
user's ops. The first three keep every forward value bit-identical (they only move the same elements).

- SplitToSequence + SequenceAt at constant positions (torch.onnx's dynamo exporter without
  optimisation writes `tensor.split(...)` so) -> Split (+ Identity, or Squeeze for keepdims=0).
- CastLike(x, like) -> Cast(x, to=like's dtype): the same conversion, and onnxruntime-training
  has no CastLike gradient (the same export scales attention scores with it).
- Where's values and Pow's base, when broadcast to a larger output, -> Expand to the output's shape
  first: onnxruntime-training differentiates both elementwise without summing the gradient back over
  the broadcast axes, so the gradient comes out in the output's shape (T5's attention, Where(mask,
  position bias [1, heads, q, k], ...), fails to build; a weight read so would get a gradient of the
  wrong shape). Expand's gradient sums back.
- An op onnxruntime-training cannot differentiate that the ONNX spec defines as a function (HardSwish, HardSigmoid,
  Elu, Selu, Celu, Softplus, Mish, PRelu, ...) -> its function body (`onnxpipe.expand`), asked of the gradient probe
  (`onnxpipe.gradprobe`) node type by node type; last in each round of rewrites, which repeat while any applies
  (bodies use CastLike and broadcast Where).
- The per-node rewrites of `onnxpipe.lowerings` (InstanceNormalization, Resize, ConvTranspose, grouped Conv, Slice with a
  negative step, Pad in reflect/edge/wrap mode, Einsum, DepthToSpace,
  ReduceMax/Min, Sum/Mean, CumSum, GRU/RNN, float16 LayerNormalization), one node at a time (`_each_node`).

Reading order: `Rewrite` -> `for_gradient_builder` -> `rewrite_for_training` -> `_split_to_sequence` -> `_cast_like`
-> `_expand_broadcast` -> `_each_node` -> `_function_bodies`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.nodes import is_weight
from onnxpipe.ortutil import complete_optional_outputs
from onnxpipe.expand import body, inlined
from onnxpipe.gradprobe import FLOAT_TYPES, differentiable, is_float, tensor_types
from onnxpipe.lowerings import PER_NODE, REWRITE_MARK, NodeRewrite, node_base, tensor_dims

__all__ = ["Rewrite", "rewrite_for_training", "for_gradient_builder"]


@dataclass(frozen=True)
class Rewrite:
    """One pattern replaced."""

    #: What was replaced and by what, e.g. "SplitToSequence+SequenceAt -> Split".
    pattern: str
    #: The node that anchored the pattern (the SplitToSequence).
    node: str


def for_gradient_builder(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of `model` as onnxruntime-training's gradient builder needs it: the one preparation the trainer, the
    gradient check and the profiler share (the profiler once lacked a step and timed no dynamo export's backward).
    Exporter patterns rewritten (`rewrite_for_training`) and optional outputs spelled out (LayerNormalization's
    gradient reads its Mean and InvStdDev: `ortutil.complete_optional_outputs`), those of nodes the rewrites wrote too."""
    out, _ = rewrite_for_training(model)
    complete_optional_outputs(out.graph)
    return out


def rewrite_for_training(model: onnx.ModelProto) -> tuple[onnx.ModelProto, tuple[Rewrite, ...]]:
    """A copy of `model` with every known non-differentiable exporter pattern replaced, and what was replaced. Rounds
    until one replaces nothing: a function body may hold a CastLike, a broadcast Where or another function op.
    Optional outputs are spelled out first: the gradient probe that decides which function ops to expand asks with
    them, as training builds the gradient (a LayerNormalization without its Mean has no gradient)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    complete_optional_outputs(out.graph)
    done: list[Rewrite] = []
    for _ in range(_ROUNDS):
        step = _split_to_sequence(out) + _cast_like(out) + _expand_broadcast(out)
        for ops, rewrite in PER_NODE:
            step += _each_node(out, ops, rewrite)
        step += _function_bodies(out)
        if not step:
            break
        done += step
    return out, tuple(done)


def _opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 1)


def _constants(graph: onnx.GraphProto) -> dict[str, np.ndarray]:
    values = {t.name: t for t in graph.initializer}
    for node in graph.node:
        if node.op_type == "Constant" and len(node.attribute) == 1 and node.attribute[0].name == "value":
            values[node.output[0]] = node.attribute[0].t
    return {name: numpy_helper.to_array(t) for name, t in values.items() if len(t.dims) <= 1 and _has_values(t)}


def _has_values(tensor: onnx.TensorProto) -> bool:
    """Whether the tensor's values are in memory: not a weight left on disk (an external-data reference)
    nor one whose bytes were left out of a light copy."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL:
        return False
    return tensor.HasField("raw_data") or any(len(getattr(tensor, f)) for f in ("float_data", "int32_data", "int64_data", "double_data", "uint64_data"))


def _dim(types: Mapping[str, onnx.TypeProto], tensor: str, axis: int) -> int | None:
    """A static dim of a tensor."""
    found = types.get(tensor)
    if found is None:
        return None
    dims = found.tensor_type.shape.dim
    axis = axis + len(dims) if axis < 0 else axis
    if not 0 <= axis < len(dims) or not dims[axis].HasField("dim_value"):
        return None
    return int(dims[axis].dim_value)


def _cast_like(model: onnx.ModelProto) -> list[Rewrite]:
    done: list[Rewrite] = []
    if not any(n.op_type == "CastLike" for n in model.graph.node):
        return done
    types = tensor_types(model)
    for node in model.graph.node:
        if node.op_type != "CastLike" or node.domain not in ("", "ai.onnx"):
            continue
        like = types.get(node.input[1])
        if like is None or not like.tensor_type.elem_type:
            continue
        saturate = [a for a in node.attribute if a.name == "saturate"]
        name = node.name
        cast = helper.make_node("Cast", [node.input[0]], [node.output[0]], name=name, to=like.tensor_type.elem_type)
        cast.attribute.extend(saturate)
        node.CopyFrom(cast)
        done.append(Rewrite("CastLike -> Cast", name))
    return done


def _sizes(model: onnx.ModelProto, node: onnx.NodeProto, consts: Mapping[str, np.ndarray], axis: int) -> list[int] | None:
    """The piece sizes SplitToSequence cuts, when they are known statically."""
    split = node.input[1] if len(node.input) > 1 and node.input[1] else None
    if split is not None and split not in consts:
        return None
    if split is not None and consts[split].ndim == 1:
        return [int(v) for v in consts[split]]
    total = _dim(tensor_types(model), node.input[0], axis)
    if total is None:
        return None
    chunk = 1 if split is None else int(consts[split])
    return [chunk] * (total // chunk) + ([total % chunk] if total % chunk else [])


def _split_to_sequence(model: onnx.ModelProto) -> list[Rewrite]:
    graph = model.graph
    opset = _opset(model)
    consts = _constants(graph)
    nodes = list(graph.node)
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in node.input:
            readers.setdefault(name, []).append(i)
    outputs = {o.name for o in graph.output}
    done: list[Rewrite] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for at, node in enumerate(nodes):
        if node.op_type != "SplitToSequence" or node.domain not in ("", "ai.onnx") or node.output[0] in outputs:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axis, keepdims = int(attrs.get("axis", 0)), int(attrs.get("keepdims", 1))
        uses = [nodes[i] for i in readers.get(node.output[0], [])]
        if not uses or any(u.op_type != "SequenceAt" or u.input[1] not in consts for u in uses):
            continue
        sizes = _sizes(model, node, consts, axis)
        if sizes is None:
            continue
        squeeze = keepdims == 0 and not (len(node.input) > 1 and node.input[1])
        parts = [f"{node.output[0]}/part{i}" for i in range(len(sizes))]
        base = node.name or node.output[0]
        new: list[onnx.NodeProto] = []
        if opset >= 13:
            sizes_name = f"{base}/sizes"
            graph.initializer.append(numpy_helper.from_array(np.array(sizes, np.int64), sizes_name))
            new.append(helper.make_node("Split", [node.input[0], sizes_name], parts, name=f"{base}/split", axis=axis))
        else:
            new.append(helper.make_node("Split", [node.input[0]], parts, name=f"{base}/split", axis=axis, split=sizes))
        if squeeze and opset >= 13:
            graph.initializer.append(numpy_helper.from_array(np.array([axis], np.int64), f"{base}/axes"))
        for i, use in zip(readers.get(node.output[0], []), uses):
            pos = int(consts[use.input[1]])
            part = parts[pos + len(parts) if pos < 0 else pos]
            if not squeeze:
                new.append(helper.make_node("Identity", [part], [use.output[0]], name=use.name or f"{use.output[0]}/at"))
            elif opset >= 13:
                new.append(helper.make_node("Squeeze", [part, f"{base}/axes"], [use.output[0]], name=use.name or f"{use.output[0]}/at"))
            else:
                new.append(helper.make_node("Squeeze", [part], [use.output[0]], name=use.name or f"{use.output[0]}/at", axes=[axis]))
            replaced[i] = []
        replaced[at] = new
        done.append(Rewrite("SplitToSequence+SequenceAt -> Split", node.name))
    if done:
        _replace(graph, nodes, replaced)
    return done


#: Op -> the input slots onnxruntime-training 1.19.2 differentiates without summing back a broadcast (asked of its
#: gradient builder: Add, Sub, Mul, Div, Min and Max sum back; Where's two values and Pow's base do not).
_UNREDUCED = {"Where": (1, 2), "Pow": (0,)}


def _expand_broadcast(model: onnx.ModelProto) -> list[Rewrite]:
    graph = model.graph
    if not any(n.op_type in _UNREDUCED and n.domain in ("", "ai.onnx") for n in graph.node):
        return []
    types = tensor_types(model)
    # Constants take no gradient (a masked fill's -inf, a scalar): expanding them would only cost memory.
    constants = {t.name for t in graph.initializer if not is_weight(helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims))}
    constants |= {o for n in graph.node if n.op_type == "Constant" for o in n.output}
    done: list[Rewrite] = []
    nodes: list[onnx.NodeProto] = []
    mark = f"{REWRITE_MARK}expand"
    for node in graph.node:
        slots = _UNREDUCED.get(node.op_type, ()) if node.domain in ("", "ai.onnx") and mark not in node.name else ()
        for slot in slots:
            name = node.input[slot] if slot < len(node.input) else ""
            found = types.get(name)
            if not name or name in constants or mark in name or found is None or found.tensor_type.elem_type not in FLOAT_TYPES:
                continue  # (`mark`: expanded already, in an earlier round, or the node run once more for a shape)
            out = tensor_dims(types, node.output[0])
            if out is not None and tensor_dims(types, name) == out:
                continue  # not broadcast
            base = f"{node.name or node.output[0]}{REWRITE_MARK}expand{slot}"
            if out is not None and all(isinstance(d, int) for d in out):
                graph.initializer.append(numpy_helper.from_array(np.array(out, np.int64), f"{base}/shape"))
                nodes.append(helper.make_node("Expand", [name, f"{base}/shape"], [base], name=base))
            else:  # known at run time only: the shape of the node run once more (Shape passes no gradient back)
                nodes += [helper.make_node(node.op_type, list(node.input), [f"{base}/like"], name=f"{base}/like"),
                          helper.make_node("Shape", [f"{base}/like"], [f"{base}/shape"], name=f"{base}/shape"),
                          helper.make_node("Expand", [name, f"{base}/shape"], [base], name=base)]
            node.input[slot] = base
            done.append(Rewrite(f"{node.op_type} broadcast input -> Expand", node.name))
        nodes.append(node)
    if done:
        del graph.node[:]
        graph.node.extend(nodes)
    return done


def _replace(graph: onnx.GraphProto, nodes: list[onnx.NodeProto], replaced: Mapping[int, list[onnx.NodeProto]]) -> None:
    """The graph's nodes become `nodes` with the node at each key's position replaced by its list. Positions, not
    ids: protobuf makes a new wrapper per access, so an id can come back for another node."""
    new = [n for i, old in enumerate(nodes) for n in replaced.get(i, [old])]
    del graph.node[:]
    graph.node.extend(new)


#: Rounds of rewrites at most: a body may call another function op (HardSwish -> HardSigmoid), itself expanded next round.
_ROUNDS = 4


def _function_bodies(model: onnx.ModelProto) -> list[Rewrite]:
    """Every node onnxruntime-training cannot differentiate whose op the spec defines as a function, inlined: last in
    a round, so that the rewrites above keep the ops they handle better (CastLike, a float16 LayerNormalization)."""
    graph = model.graph
    types, opset = tensor_types(model), _opset(model)
    done: list[Rewrite] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    nodes = list(graph.node)
    for at, node in enumerate(nodes):
        slots = tuple(k for k, name in enumerate(node.input) if name and is_float(types.get(name)))
        if not slots or not any(is_float(types.get(o)) for o in node.output if o):
            continue
        found = body(node, opset, [types.get(name, onnx.TypeProto()) for name in node.input])
        if found is None or differentiable(model, node, slots, types, opset) is not False:
            continue
        new = inlined(node, *found, node_base(node, "body"))
        if new is not None:
            replaced[at] = new
            done.append(Rewrite(f"{node.op_type} -> its ONNX function body", node.name))
    if done:
        _replace(graph, nodes, replaced)
    return done


def _each_node(model: onnx.ModelProto, ops: frozenset[str], rewrite: NodeRewrite) -> list[Rewrite]:
    """`rewrite` applied to every node of the default domain whose op is in `ops`, in place."""
    graph = model.graph
    if not any(n.op_type in ops and n.domain in ("", "ai.onnx") for n in graph.node):
        return []
    types, opset, consts = tensor_types(model), _opset(model), _constants(graph)
    done: list[Rewrite] = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    nodes = list(graph.node)
    for at, node in enumerate(nodes):
        if node.op_type in ops and node.domain in ("", "ai.onnx"):
            made = rewrite(node, types, opset, graph, consts)
            if made is not None:
                pattern, replaced[at] = made
                done.append(Rewrite(pattern, node.name))
    if done:
        _replace(graph, nodes, replaced)
    return done
