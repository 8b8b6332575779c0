"""Every value's shape without running the model: onnx shape inference with data propagation, and the
small shape subgraphs (Shape, Gather, Concat, Unsqueeze, Range, ...) folded to constants in between.

Why this and not onnxruntime's symbolic shape inference: once `--dim` has bound the inputs, every dim
is a number, so symbolic algebra (sympy, per node in Python) buys nothing; onnx's own inference is C++
and fast, and the one thing it misses on exporters' graphs, values computed from shapes (a Reshape's
target from Shape -> Gather -> Concat, a mask from Range), is recovered by folding those few small
nodes on constants with numpy. The weights never take part: inference sees their dims, not their bytes.

Reading order: `infer` -> `_probe` -> `_fold_pass` -> `evaluate` (numpy table, else onnx's reference
implementation for rarer ops).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper, shape_inference

from onnxpipe.nodes import RANDOM_OPS, has_subgraph, subgraph_captures
from onnxpipe.protostream import ON_DISK_BYTES, skeleton

__all__ = ["Inferred", "infer", "static_shape", "FOLD_ELEMENTS", "STANDARD_DOMAINS"]

#: A value is folded to a constant only when it has at most this many elements (shapes, indices, small masks).
FOLD_ELEMENTS = 1 << 16
#: Rounds of inference + folding; each round can only add known values, real exports settle in 2-3.
_MAX_ROUNDS = 8
STANDARD_DOMAINS = ("", "ai.onnx")


@dataclass(frozen=True)
class Inferred:
    """What static analysis learned about a model's values."""

    #: Type and static shape of every value it could find (inputs, node outputs, outputs).
    value_info: Mapping[str, onnx.ValueInfoProto]
    #: Values of small tensors computed from constants and static shapes alone, by node output name.
    folded: Mapping[str, np.ndarray]
    #: Node names whose every output was folded.
    folded_nodes: frozenset[str]


def static_shape(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    """The concrete shape of a typed value, None when its type, rank or any dim is unknown."""
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or tt.elem_type == 0:
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def infer(model: onnx.ModelProto) -> Inferred:
    """Infer shapes on a weightless copy of `model` (its inputs' dims already bound), folding shape
    arithmetic between rounds until nothing new is learned. Raises what onnx's inference raises."""
    probe = _probe(model)
    known: dict[str, np.ndarray] = {}
    folded_nodes: set[str] = set()
    infos: dict[str, onnx.ValueInfoProto] = {}
    for _ in range(_MAX_ROUNDS):
        inferred = shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
        infos = {}
        for vi in [*inferred.graph.input, *inferred.graph.value_info, *inferred.graph.output]:
            if vi.name not in infos or static_shape(infos[vi.name]) is None:  # a declared output may say less
                infos[vi.name] = vi
        shapes = {name: s for name, vi in infos.items() if (s := static_shape(vi)) is not None}
        shapes.update({t.name: tuple(t.dims) for t in model.graph.initializer})
        types = {name: vi.type.tensor_type.elem_type for name, vi in infos.items() if vi.type.HasField("tensor_type")}
        new = _fold_pass(model, shapes, types, known)
        loops = _loop_outputs(model, infos, shapes, known)
        if not new and not loops:
            break
        folded_nodes.update(new)
        _replace_folded(probe, known, folded_nodes)
        probe.graph.value_info.extend(loops)
    initializers = {t.name for t in model.graph.initializer}
    for name, value in known.items():
        if name not in initializers and (name not in infos or static_shape(infos[name]) is None):
            infos[name] = helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(value.dtype), list(value.shape))
    return Inferred(value_info=infos, folded=known, folded_nodes=frozenset(folded_nodes))


def _loop_outputs(model: onnx.ModelProto, infos: Mapping[str, onnx.ValueInfoProto], shapes: Mapping[str, tuple[int, ...]],
                  known: Mapping[str, np.ndarray]) -> list[onnx.ValueInfoProto]:
    """Shapes of Loop outputs onnx's inference leaves open: the body is inferred on its own with its
    inputs typed (iteration, condition, the carried values' initial shapes) and the outer tensors it
    reads as inputs; carried outputs take the body's shapes, scan outputs gain the trip count ahead."""
    found: list[onnx.ValueInfoProto] = []
    types = {t.name: t.data_type for t in model.graph.initializer}
    types.update({n: vi.type.tensor_type.elem_type for n, vi in infos.items() if vi.type.HasField("tensor_type")})
    for node in model.graph.node:
        if node.op_type != "Loop" or node.domain not in STANDARD_DOMAINS or all(o in shapes or not o for o in node.output):
            continue
        body = next(a.g for a in node.attribute if a.name == "body")
        carried = list(node.input[2:])
        if any(c not in shapes for c in carried):
            continue
        captured = [c for c in subgraph_captures(node) if c not in carried]
        if any(c not in shapes or c not in types for c in captured):
            continue
        graph = skeleton(body, "input")
        del graph.value_info[:]
        graph.input.extend([
            helper.make_tensor_value_info(body.input[0].name, onnx.TensorProto.INT64, []),
            helper.make_tensor_value_info(body.input[1].name, onnx.TensorProto.BOOL, []),
            *(helper.make_tensor_value_info(b.name, types[c], list(shapes[c])) for b, c in zip(body.input[2:], carried)),
            *(helper.make_tensor_value_info(c, types[c], list(shapes[c])) for c in captured),
        ])
        sub = helper.make_model(graph, opset_imports=list(model.opset_import))
        sub.ir_version = model.ir_version
        try:
            inner = infer(sub).value_info
        except Exception:  # noqa: BLE001 - a body inference cannot do leaves the outputs open, reported by the caller
            continue
        trips = known.get(node.input[0]) if node.input[0] else None
        for i, out in enumerate(node.output):
            body_out = inner.get(body.output[i + 1].name)
            shape = static_shape(body_out) if body_out is not None else None
            if not out or out in shapes or shape is None:
                continue
            if i >= len(carried):
                if trips is None:
                    continue
                shape = (int(np.asarray(trips).reshape(-1)[0]), *shape)
            found.append(helper.make_tensor_value_info(out, body_out.type.tensor_type.elem_type, list(shape)))
    return found


def _probe(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy of the model whose large initializers carry dims but no bytes (external ones: no location
    either), so inference costs the same for a 10 MB and a 10 GB model."""
    probe = skeleton(model, "graph")
    probe.graph.CopyFrom(skeleton(model.graph, "initializer"))
    del probe.graph.value_info[:]
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL or _nbytes(t) > ON_DISK_BYTES:
            probe.graph.initializer.add(name=t.name, data_type=t.data_type, dims=t.dims)
        else:
            probe.graph.initializer.append(t)
    return probe


def _nbytes(t: onnx.TensorProto) -> int:
    if t.data_type in (onnx.TensorProto.STRING, onnx.TensorProto.UNDEFINED):
        return 0
    return math.prod(t.dims) * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize


def _small_constants(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer
            if t.data_location != onnx.TensorProto.EXTERNAL and _nbytes(t) <= ON_DISK_BYTES and math.prod(t.dims) <= FOLD_ELEMENTS}


def _fold_pass(model: onnx.ModelProto, shapes: Mapping[str, tuple[int, ...]], types: Mapping[str, int],
               known: dict[str, np.ndarray]) -> set[str]:
    """Fold, in graph order, every standard node whose inputs are known small values (for Shape and Size:
    whose input's shape is known; for CastLike: the value and the other input's type) and whose outputs
    are small; returns the nodes newly folded."""
    if not known:
        known.update(_small_constants(model))
    new: set[str] = set()
    # Folding computes what the model computes: T5's position buckets take log(0) and cast -inf to int, values its
    # Where then drops; numpy's warnings about them would reach the user as noise.
    with np.errstate(all="ignore"):
        for node in model.graph.node:
            outs = [o for o in node.output if o]
            if not outs or all(o in known for o in outs) or not _foldable(node):
                continue
            if node.op_type in ("Shape", "Size"):
                shape = shapes.get(node.input[0])
                if shape is None:
                    continue
                values = [_shape_value(node, shape)]
            elif node.op_type == "CastLike":
                if node.input[0] not in known or not types.get(node.input[1]):
                    continue
                values = [known[node.input[0]].astype(helper.tensor_dtype_to_np_dtype(types[node.input[1]]))]
            else:
                inputs = [i for i in node.input]
                if any(i and i not in known for i in inputs):
                    continue
                if any(shapes.get(o) is None or math.prod(shapes[o]) > FOLD_ELEMENTS for o in outs):
                    continue
                try:
                    values = evaluate(node, [known[i] if i else None for i in inputs], _opset(model, node.domain))
                except Exception:  # noqa: BLE001 - an op we cannot fold stays a node; inference copes or reports it
                    continue
            for name, value in zip(node.output, values):
                if name:
                    known[name] = np.asarray(value)
            new.add(node.name)
    return new


def _foldable(node: onnx.NodeProto) -> bool:
    return node.domain in STANDARD_DOMAINS and node.op_type not in RANDOM_OPS and not has_subgraph(node)


def _opset(model: onnx.ModelProto, domain: str) -> int:
    return next((o.version for o in model.opset_import if o.domain in ((domain, "ai.onnx") if domain in STANDARD_DOMAINS else (domain,))), 21)


def _shape_value(node: onnx.NodeProto, shape: tuple[int, ...]) -> np.ndarray:
    if node.op_type == "Size":
        return np.array(math.prod(shape), dtype=np.int64)
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    rank = len(shape)
    start, end = attrs.get("start", 0), attrs.get("end", rank)
    return np.array(shape[slice(start if start >= 0 else start + rank, end if end >= 0 else end + rank)], dtype=np.int64)


def _replace_folded(probe: onnx.ModelProto, known: Mapping[str, np.ndarray], folded_nodes: set[str]) -> None:
    """Folded nodes leave the probe; their outputs become initializers there, so the next round of
    inference reads them as data."""
    have = {t.name for t in probe.graph.initializer}
    kept = [n for n in probe.graph.node if n.name not in folded_nodes]
    del probe.graph.node[:]
    probe.graph.node.extend(kept)
    for node_out, value in known.items():
        if node_out not in have:
            probe.graph.initializer.append(numpy_helper.from_array(value, node_out))
            have.add(node_out)


def evaluate(node: onnx.NodeProto, inputs: Sequence[np.ndarray | None], opset: int) -> list[np.ndarray]:
    """The outputs of one node on constant inputs: numpy for the ops shape subgraphs are made of, onnx's
    reference implementation for the rest."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    fn = _NUMPY.get(node.op_type)
    if fn is not None:
        return [np.asarray(fn(inputs, attrs))]
    from onnx.reference import ReferenceEvaluator  # imported on demand: a second or more on a loaded machine

    names = [f"in{i}" if x is not None else "" for i, x in enumerate(inputs)]
    clone = helper.make_node(node.op_type, names, [f"out{i}" for i in range(len(node.output))], domain=node.domain)
    clone.attribute.extend(node.attribute)
    evaluator = ReferenceEvaluator(clone, opsets={"": opset})
    return list(evaluator.run(None, {n: x for n, x in zip(names, inputs) if n}))


def _axes(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object], index: int) -> list[int]:
    if len(inputs) > index and inputs[index] is not None:
        return [int(a) for a in np.asarray(inputs[index]).reshape(-1)]
    return [int(a) for a in attrs.get("axes", [])]  # type: ignore[union-attr]


def _unsqueeze(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x = inputs[0]
    axes = _axes(inputs, attrs, 1)
    rank = np.ndim(x) + len(axes)
    return np.expand_dims(x, tuple(sorted(a % rank for a in axes)))


def _squeeze(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x = inputs[0]
    axes = _axes(inputs, attrs, 1)
    return np.squeeze(x, tuple(a % np.ndim(x) for a in axes)) if axes else np.squeeze(x)


def _slice(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x = np.asarray(inputs[0])
    starts, ends = np.asarray(inputs[1]).reshape(-1), np.asarray(inputs[2]).reshape(-1)
    axes = _axes(inputs, {}, 3) or list(range(len(starts)))
    steps = np.asarray(inputs[4]).reshape(-1) if len(inputs) > 4 and inputs[4] is not None else np.ones(len(starts), np.int64)
    for s, e, a, st in zip(starts, ends, axes, steps):
        bounds = slice(int(s), int(e), int(st)).indices(x.shape[a])  # clamps as ONNX does, for range()
        x = np.take(x, np.arange(*bounds), axis=a)
    return x


def _reshape(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x, shape = inputs[0], [int(d) for d in np.asarray(inputs[1]).reshape(-1)]
    if not attrs.get("allowzero", 0):
        shape = [np.shape(x)[i] if d == 0 else d for i, d in enumerate(shape)]
    return np.reshape(x, shape)


def _cast(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    return np.asarray(inputs[0]).astype(helper.tensor_dtype_to_np_dtype(int(attrs["to"])))  # type: ignore[call-overload]


def _constant_of_shape(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    value = numpy_helper.to_array(attrs["value"]) if "value" in attrs else np.zeros(1, np.float32)  # type: ignore[arg-type]
    return np.full([int(d) for d in np.asarray(inputs[0]).reshape(-1)], value.reshape(-1)[0], dtype=value.dtype)


def _gather(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x, idx = np.asarray(inputs[0]), np.asarray(inputs[1])
    axis = int(attrs.get("axis", 0)) % max(1, x.ndim)  # type: ignore[call-overload]
    return np.take(x, np.where(idx < 0, idx + x.shape[axis], idx), axis=axis)


Rule = Callable[[Sequence[np.ndarray | None], Mapping[str, object]], np.ndarray]


def _binary(fn: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> Rule:
    return lambda x, a: fn(np.asarray(x[0]), np.asarray(x[1]))


def _expand(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x = np.asarray(inputs[0])
    return np.broadcast_to(x, np.broadcast_shapes(x.shape, tuple(int(d) for d in np.asarray(inputs[1]).reshape(-1)))).copy()


def _gather_nd(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x, idx, b = np.asarray(inputs[0]), np.asarray(inputs[1]), int(attrs.get("batch_dims", 0))  # type: ignore[call-overload]
    xs, ids = x.reshape((-1, *x.shape[b:])), idx.reshape((-1, *idx.shape[b:]))
    picked = [xs[i][tuple(np.moveaxis(ids[i if len(ids) > 1 else 0], -1, 0))] for i in range(len(xs))]
    return np.stack(picked).reshape(*x.shape[:b], *idx.shape[b:-1], *x.shape[b + idx.shape[-1]:])


def _cumsum(inputs: Sequence[np.ndarray | None], attrs: Mapping[str, object]) -> np.ndarray:
    x, axis = np.asarray(inputs[0]), int(np.asarray(inputs[1]).reshape(-1)[0])
    if attrs.get("reverse", 0):
        x = np.flip(x, axis)
    out = np.cumsum(x, axis=axis, dtype=x.dtype)
    if attrs.get("exclusive", 0):
        out = out - x
    return np.flip(out, axis) if attrs.get("reverse", 0) else out


def _div(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    if np.issubdtype(a.dtype, np.integer):
        return np.trunc(a / b).astype(a.dtype)  # ONNX integer Div truncates toward zero
    return a / b


_NUMPY: dict[str, Rule] = {
    "Identity": lambda x, a: x[0],
    "Gather": _gather,
    "Concat": lambda x, a: np.concatenate([np.asarray(v) for v in x if v is not None], axis=int(a["axis"])),  # type: ignore[call-overload]
    "Unsqueeze": _unsqueeze,
    "Squeeze": _squeeze,
    "Slice": _slice,
    "Reshape": _reshape,
    "Cast": _cast,
    "ConstantOfShape": _constant_of_shape,
    "Range": lambda x, a: np.arange(x[0], x[1], x[2]).astype(np.asarray(x[0]).dtype),
    "Add": _binary(np.add),
    "Sub": _binary(np.subtract),
    "Mul": _binary(np.multiply),
    "Div": _binary(_div),
    "Max": lambda x, a: np.maximum.reduce([np.asarray(v) for v in x]),
    "Min": lambda x, a: np.minimum.reduce([np.asarray(v) for v in x]),
    "Equal": _binary(np.equal),
    "Less": _binary(np.less),
    "Greater": _binary(np.greater),
    "LessOrEqual": _binary(np.less_equal),
    "GreaterOrEqual": _binary(np.greater_equal),
    "Not": lambda x, a: np.logical_not(x[0]),
    "And": lambda x, a: np.logical_and(x[0], x[1]),
    "Or": lambda x, a: np.logical_or(x[0], x[1]),
    "Where": lambda x, a: np.where(x[0], x[1], x[2]),
    "Neg": lambda x, a: np.negative(x[0]),
    "Abs": lambda x, a: np.abs(x[0]),
    "Sqrt": lambda x, a: np.sqrt(x[0]),
    "Transpose": lambda x, a: np.transpose(x[0], a.get("perm")),  # type: ignore[arg-type]
    "GatherElements": lambda x, a: np.take_along_axis(x[0], np.where(x[1] < 0, x[1] + np.shape(x[0])[int(a.get("axis", 0))], x[1]),  # type: ignore[operator, call-overload]
                                                      int(a.get("axis", 0))),  # type: ignore[call-overload]
    "GatherND": _gather_nd,
    "CumSum": _cumsum,
    "Reciprocal": lambda x, a: np.reciprocal(x[0]),
    "Floor": lambda x, a: np.floor(x[0]),
    "Ceil": lambda x, a: np.ceil(x[0]),
    "Expand": _expand,
}
