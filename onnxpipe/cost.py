"""Per-node cost annotation: analytic FLOPs and bytes per op class, or measured times from onnxruntime.

Reading order: `NodeCost`, `Costs` -> `annotate` -> `weight_owners` (parameter ownership) ->
`_node_cost` (bytes and the backward rule) -> `_control_flow` (If/Loop/Scan bodies) ->
`summarize` -> `write_annotated` / `read_annotated` (annotated ONNX) -> `write_summary`.
Forward FLOP formulas live in `cost_formulas`, measured times in `cost_profile`.

Bytes: a node reads its non-constant inputs plus the float constants it uses (weights are read
by every reader, shape and index tables are free) and writes its outputs; its activation bytes
are its outputs. `param_bytes` goes to the first compute node (topological order) that reads a
weight, directly or through a constant chain, so tied weights count once. A weight is any constant
of more than one element at its real bytes: float initializers, int8 ones (a quantized model) and
tensors that constant subgraphs make (a ConstantOfShape fill).

Backward rule per op class (dY = bytes written, read = bytes read):

| class                  | backward FLOPs                                    | backward bytes     |
|------------------------|---------------------------------------------------|--------------------|
| matmul, conv           | forward x operands needing a gradient (input, weight; a model input needs none), one kernel each | dY + 2 x read |
| rnn                    | 2 x forward (grad wrt input and wrt weight)       | dY + 2 x read      |
| norm (and Softmax)     | 2 x forward (mean/variance terms of the gradient) | dY + 2 x read      |
| elementwise, pool, reduce | 1 x forward                                    | dY + 2 x read      |
| data                   | 0 (the gradient is moved, not computed)           | dY + read          |
| other (no formula)     | 0                                                 | dY + 2 x read      |
| If / Loop / Scan       | body's backward x trip count                      | body's x trips + own |

BatchNormalization, InstanceNormalization and GroupNormalization read their input twice in training
(a pass for the batch statistics, then one to normalize: PyTorch's `batch_norm_collect_statistics_kernel`
and `batch_norm_transform_input_kernel`), so their read bytes count it twice, and their backward (a reduce
pass and an elementwise pass over dY and X) dY + 2 x that.

Quantized kernels (`onnxpipe.quantized`): QLinearConv, QLinearMatMul, ConvInteger, MatMulInteger and a
Conv/MatMul/Gemm fed by DequantizeLinear of int8 or uint8 data on both operands (the QDQ form) carry
`dtype="int8"`, so the time model prices them at the device's int8 rate, and read their operands at int8
bytes (what the fused kernel reads). QuantizeLinear and DequantizeLinear themselves are elementwise nodes.

Control flow: a Loop costs its body times the trip count when that count is a constant (else
once, and "Loop" is listed in `unknown_ops`); a Scan its body times the scanned axis length;
an If its costlier branch (only one runs).
"""

from __future__ import annotations

import math
import os
import shutil
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.cost_formulas import CONTROL_FLOW_OPS, TWO_PASS_NORMS, MissingShape, forward_flops, gemm_shape, op_class
from onnxpipe.cost_layout import NCHWC, ReorderRates
from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import fresh_dir_beside, write_json
from onnxpipe.graph import Graph, TensorInfo, load, subgraph_captures
from onnxpipe.nodes import is_float_dtype
from onnxpipe.protostream import load_weights
from onnxpipe.quantized import int8_operands

__all__ = [
    "OP_CLASSES", "NodeCost", "Costs", "OpTypeSummary", "annotate", "weight_owners", "with_measurements", "summarize",
    "write_annotated", "read_annotated", "write_summary",
]

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
    #: Bytes of the weights (constants of more than one element, any dtype) this node is the first reader of.
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
    #: Median measured forward seconds as an inference stage runs the node: in an optimized session, its
    #: share of the fused kernel it became part of (`cost_profile.fused_shares`; profile mode), else None
    #: (the forward time prices inference too).
    measured_inference_seconds: float | None = None
    #: Implicit-GEMM shape of a matmul or convolution, which its efficiency depends on: the reduction length K
    #: (input channels per group x kernel size, or the inner dimension) and the output columns N (output
    #: channels, or the last output dimension); 0 for other ops and depthwise convolutions (memory-bound).
    gemm_k: float = 0.0
    gemm_n: float = 0.0
    #: A 3x3, stride-1, undilated, ungrouped convolution: GPUs run these with Winograd-class algorithms.
    winograd: bool = False
    #: Kernels the backward pass runs for this node (a convolution's input and weight gradients are two).
    backward_kernels: float = 1.0
    #: Device kind the measured times were taken on ("cpu", "gpu", ...); measured times price only that kind.
    measured_on: str | None = None
    #: Where the measured times come from ("profile:CPUExecutionProvider", "import:times.json", ...); "" when analytic.
    source: str = ""
    #: The numeric type whose peak rate the kernel runs at when it is not the model's float type: "int8" for
    #: a quantized matmul or convolution; "" otherwise (the float type the problem prices).
    dtype: str = ""
    #: "nchwc" when the optimized profile computed the node in onnxruntime's blocked layout (`cost_layout`:
    #: a stage cut next to it reorders the cut tensor); "" otherwise.
    layout: str = ""


@dataclass(frozen=True)
class Costs:
    """Costs of every compute node of a graph."""

    #: Node name -> cost, for every node in `Graph.compute_nodes`.
    nodes: Mapping[str, NodeCost]
    #: Op types that got a bytes-only estimate.
    unknown_ops: tuple[str, ...]
    #: True when measured times are present.
    profiled: bool
    #: The profiling host's rates for reordering a cut tensor into and out of the blocked layout (`cost_layout`),
    #: when its optimized session computed nodes in it; they price inference stages on cpu devices.
    reorder: ReorderRates | None = None


_BACKWARD_FACTOR = {"matmul": 2.0, "conv": 2.0, "rnn": 2.0, "norm": 2.0, "elementwise": 1.0, "pool": 1.0, "reduce": 1.0, "data": 0.0, "other": 0.0}


def annotate(graph: Graph, *, profile: bool = False, runs: int = 5, warmup: int = 2, device_kind: str = "cpu", provider: str = "") -> Costs:
    """Cost every compute node and derived node (`Graph.derived_nodes`: each stage reading them runs them); with
    `profile`, add median times measured in onnxruntime with the execution provider of a `device_kind` device
    (`provider` when named; the CPU on one thread for "cpu")."""
    owners = {node: float(sum(graph.tensors[w].nbytes for w in mine if w in graph.tensors)) for node, mine in weight_owners(graph).items()}
    graded = _gradient_tensors(graph)
    nodes: dict[str, NodeCost] = {}
    unknown: set[str] = set()
    for name in (n for n in graph.order if n not in graph.constant_nodes):
        cost, missing = _node_cost(graph.node(name), graph.node_inputs(name), graph, graph.constants, owners.get(name, 0), graded)
        nodes[name] = cost
        unknown |= missing
    costs = Costs(nodes=nodes, unknown_ops=tuple(sorted(unknown)), profiled=False)
    if not profile:
        return costs
    from onnxpipe.cost_profile import execution_provider, profile_times

    chosen = execution_provider(device_kind, provider)
    measured = profile_times(graph, runs=runs, warmup=warmup, provider=chosen)
    return with_measurements(costs, measured.forward, measured.backward, device_kind, f"profile:{chosen}", measured.inference,
                             blocked=measured.nchwc, reorder=measured.reorder)


def with_measurements(costs: Costs, forward: Mapping[str, float], backward: Mapping[str, float], device_kind: str, source: str,
                      inference: Mapping[str, float] | None = None, *, blocked: Iterable[str] = (), reorder: ReorderRates | None = None) -> Costs:
    """`costs` with measured seconds where `forward` has them (taken on a `device_kind` device, from `source`);
    a node without a measured backward gets its forward time x its backward/forward FLOP ratio. `inference`:
    forward times as an optimized inference session runs the nodes, where measured; `blocked`: the nodes it
    computed in the blocked layout, `reorder`: the host's rates for reordering into and out of it."""
    blocked = frozenset(blocked)
    nodes = {}
    for name, cost in costs.nodes.items():
        fwd = forward.get(name)
        bwd = backward.get(name)
        if fwd is None:
            nodes[name] = cost
            continue
        if bwd is None:
            bwd = fwd * ((cost.backward_flops / cost.flops if cost.flops else 0.0) or 1.0)
        nodes[name] = replace(cost, measured_seconds=fwd, measured_backward_seconds=bwd, measured_inference_seconds=(inference or {}).get(name),
                              measured_on=device_kind, source=source, layout=NCHWC if name in blocked else "")
    return replace(costs, nodes=nodes, profiled=True, reorder=reorder)


def _is_float(graph: Graph, tensor: str) -> bool:
    info = graph.tensors.get(tensor)
    return info is not None and is_float_dtype(info.dtype)


def weight_owners(graph: Graph) -> dict[str, frozenset[str]]:
    """The weights each compute node holds: each constant of more than one element (an initializer of any
    dtype, or what a constant subgraph makes from scalars, such as a ConstantOfShape fill), reached
    directly or through constant-only nodes (a folded Transpose of a weight), belongs to its first compute
    reader, so a tied weight counts once. Named by initializer (a fill by the tensor made)."""
    origins: dict[str, frozenset[str]] = {t: frozenset({t}) for t in graph.initializers if _is_block(graph, t)}
    for name in graph.order:
        if name in graph.constant_nodes:
            source = frozenset().union(*(origins.get(t, frozenset()) for t in graph.node_inputs(name)))
            for out in (o for o in graph.node(name).output if o):
                origins[out] = source or (frozenset({out}) if _is_block(graph, out) else frozenset())
    claimed: set[str] = set()
    owned: dict[str, frozenset[str]] = {}
    for name in graph.compute_nodes:
        mine = frozenset().union(*(origins.get(t, frozenset()) for t in graph.node_inputs(name))) - claimed
        claimed |= mine
        owned[name] = mine
    return owned


def _gradient_tensors(graph: Graph) -> frozenset[str]:
    """Tensors training computes a gradient for: the trained parameters (`Graph.trained`), constant chains of
    them (a folded Transpose of a weight), and every compute output downstream of one. A model input gets
    none, so the first convolution of a network computes its weight gradient only; nor does a frozen weight."""
    graded = set(graph.trained)
    for name in graph.order:
        if any(t in graded for t in graph.node_inputs(name)):
            graded.update(o for o in graph.node(name).output if o)
    return frozenset(graded)


def _is_block(graph: Graph, tensor: str) -> bool:
    """A constant that is data: more than one element, and not int64 (ONNX's type of shapes, axes and indices)."""
    info = graph.tensors.get(tensor)
    return info is not None and info.dtype != "int64" and math.prod(info.shape) > 1


def _nbytes(graph: Graph, tensor: str) -> int:
    info = graph.tensors.get(tensor)
    return info.nbytes if info is not None else 0


def _shape_of(graph: Graph):  # noqa: ANN202 - a ShapeOf closure
    def shape(name: str) -> tuple[int, ...]:
        info = graph.tensors.get(name)
        if info is None:
            raise MissingShape(name)
        return info.shape

    return shape


def _node_cost(
    node: onnx.NodeProto, reads: Iterable[str], graph: Graph, constants: frozenset[str], param_bytes: float, graded: frozenset[str] | None = None
) -> tuple[NodeCost, set[str]]:
    """One node's cost in the scope of `graph` (the model or a control-flow body) and the op types it could not
    cost. `graded`: the tensors that get a gradient (None: every input does). A quantized kernel reads its
    data operands as the int8 tensors they come from, and its integer weights and bias."""
    quantized = int8_operands(graph, node)
    read = float(sum(_nbytes(graph, quantized.get(t, t)) for t in reads
                     if t not in constants or _is_float(graph, t) or (quantized and (t in quantized or _is_block(graph, t)))))
    written = float(sum(_nbytes(graph, o) for o in node.output if o))
    if node.op_type in CONTROL_FLOW_OPS and node.domain in ("", "ai.onnx"):
        return _control_flow(node, graph, constants, read, written, param_bytes)
    klass = op_class(node.op_type)
    shape = _shape_of(graph)
    try:
        flops = forward_flops(node, shape)
    except (MissingShape, KeyError, IndexError, ValueError):  # a formula that cannot apply is no formula
        flops = None
    known = flops is not None
    try:
        gemm = gemm_shape(node, shape)
    except (MissingShape, KeyError, IndexError, ValueError):
        gemm = None
    if node.op_type in TWO_PASS_NORMS and node.input:
        read += _nbytes(graph, node.input[0])  # training: one pass for the batch statistics, one to normalize
    factor, kernels = _BACKWARD_FACTOR[klass], 1.0
    if klass in ("matmul", "conv"):  # one gradient GEMM per operand that needs a gradient
        grads = sum(1 for t in node.input[:2] if t and (graded is None or t in graded))
        factor, kernels = float(grads), float(max(1, grads))
    cost = NodeCost(
        op_type=node.op_type,
        op_class=klass,
        flops=flops or 0.0,
        bytes_read=read,
        bytes_written=written,
        param_bytes=param_bytes,
        activation_bytes=written,
        backward_flops=factor * (flops or 0.0),
        backward_bytes=written + (1 if klass == "data" else 2) * read,
        known=known,
        gemm_k=float(gemm[0]) if gemm else 0.0,
        gemm_n=float(gemm[1]) if gemm else 0.0,
        winograd=bool(gemm and gemm[2]) and not quantized,  # int8 kernels run as GEMMs, not Winograd transforms
        backward_kernels=kernels,
        dtype="int8" if quantized else "",
    )
    return cost, set() if known else {node.op_type}


def _control_flow(node: onnx.NodeProto, graph: Graph, constants: frozenset[str], read: float, written: float, param_bytes: float) -> tuple[NodeCost, set[str]]:
    bodies = [helper.get_attribute_value(a) for a in node.attribute if a.type == onnx.AttributeProto.GRAPH]
    totals = [_body_total(node, body, graph, constants) for body in bodies]
    unknown = set().union(*(missing for _, missing in totals))
    if node.op_type == "If":
        body, known = max(((t, k) for (t, k), _ in totals), key=lambda tk: tk[0]["flops"], default=(_ZERO, True))
    else:
        body = {key: sum(t[key] for (t, _), _ in totals) for key in _ZERO}
        known = all(k for (_, k), _ in totals)
    trips = _trip_count(node, graph)
    if trips is None:
        known = False
        unknown.add(node.op_type)
    n = trips if trips is not None else 1
    cost = NodeCost(
        op_type=node.op_type,
        op_class="other",
        flops=n * body["flops"],
        bytes_read=read + n * body["bytes_read"],
        bytes_written=written + n * body["bytes_written"],
        param_bytes=param_bytes,
        activation_bytes=written + n * body["activation_bytes"],
        backward_flops=n * body["backward_flops"],
        backward_bytes=written + 2 * read + n * body["backward_bytes"],
        known=known,
    )
    return cost, unknown


_ZERO = dict.fromkeys(("flops", "bytes_read", "bytes_written", "activation_bytes", "backward_flops", "backward_bytes"), 0.0)


def _body_total(node: onnx.NodeProto, body: onnx.GraphProto, graph: Graph, constants: frozenset[str]) -> tuple[tuple[dict[str, float], bool], set[str]]:
    """Summed costs of a body's nodes, shapes inferred from the outer values it is run on."""
    inner = _body_graph(node, body, graph)
    if inner is None:
        return (dict(_ZERO), False), {node.op_type}
    scope = constants | inner.constants
    total, known, unknown = dict(_ZERO), True, set()
    for name in inner.order:
        cost, missing = _node_cost(inner.node(name), inner.node_inputs(name), inner, scope, 0.0)
        for key in total:
            total[key] += getattr(cost, key)
        known &= cost.known
        unknown |= missing
    return (total, known), unknown


def _body_graph(node: onnx.NodeProto, body: onnx.GraphProto, graph: Graph) -> Graph | None:
    """The body as a standalone Graph whose inputs carry the shapes of what the node feeds it."""
    fed = _body_feeds(node, body, graph)
    defined = {i.name for i in body.input} | {t.name for t in body.initializer} | {o for n in body.node for o in n.output}
    inputs = []
    for formal in body.input:
        info = fed.get(formal.name)
        inputs.append(_value_info(formal.name, info.dtype, info.shape) if info else formal)
    for name in subgraph_captures(node):
        info = graph.tensors.get(name)
        if name not in defined and info is not None:
            inputs.append(_value_info(name, info.dtype, info.shape))
    outputs = [helper.make_empty_tensor_value_info(o.name) for o in body.output]
    probe = helper.make_model(
        helper.make_graph(list(body.node), body.name or "body", inputs, outputs, list(body.initializer)),
        opset_imports=list(graph.model.opset_import),
    )
    probe.ir_version = min(graph.model.ir_version, 10) or 10
    try:
        return load(probe)
    except OnnxpipeError:
        return None


def _value_info(name: str, dtype: str, shape: tuple[int, ...]) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), shape)


def _body_feeds(node: onnx.NodeProto, body: onnx.GraphProto, graph: Graph) -> dict[str, TensorInfo]:
    """Formal body input name -> the dtype and shape the node passes it."""
    formal = [i.name for i in body.input]
    actual = list(node.input)
    fed: dict[str, TensorInfo] = {}
    if node.op_type == "Loop" and len(formal) >= 2:
        fed[formal[0]] = TensorInfo(formal[0], "int64", ())
        fed[formal[1]] = TensorInfo(formal[1], "bool", ())
        for f, a in zip(formal[2:], actual[2:]):
            if a in graph.tensors:
                fed[f] = graph.tensors[a]
    elif node.op_type == "Scan":
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        n_scan = int(attrs.get("num_scan_inputs", 0))
        axes = list(attrs.get("scan_input_axes", [])) or [0] * n_scan
        n_state = len(actual) - n_scan
        for i, (f, a) in enumerate(zip(formal, actual)):
            info = graph.tensors.get(a)
            if info is None:
                continue
            if i >= n_state:
                axis = axes[i - n_state] % max(1, len(info.shape))
                info = TensorInfo(f, info.dtype, info.shape[:axis] + info.shape[axis + 1:])
            fed[f] = info
    return fed


def _trip_count(node: onnx.NodeProto, graph: Graph) -> int | None:
    """Iterations of a Loop (constant max trip count) or Scan (scanned axis length); 1 for If; None when unknown."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type == "Loop":
        bound = node.input[0] if node.input else ""
        tensor = _initializer(graph, bound) if bound else None
        return int(numpy_helper.to_array(tensor).reshape(-1)[0]) if tensor is not None else None
    if node.op_type == "Scan":
        n_scan = int(attrs.get("num_scan_inputs", 0))
        first = graph.tensors.get(node.input[len(node.input) - n_scan]) if n_scan else None
        if first is None or not first.shape:
            return None
        axis = (list(attrs.get("scan_input_axes", [])) or [0])[0] % len(first.shape)
        return first.shape[axis]
    return 1


def _initializer(graph: Graph, name: str) -> onnx.TensorProto | None:
    cache = graph.__dict__.get("_onnxpipe_initializers")
    if cache is None:
        cache = {t.name: t for t in graph.model.graph.initializer}
        object.__setattr__(graph, "_onnxpipe_initializers", cache)
    return cache.get(name)


@dataclass(frozen=True)
class OpTypeSummary:
    """Costs of all nodes of one op type."""

    op_type: str
    op_class: str
    count: int
    flops: float
    param_bytes: float
    activation_bytes: float
    #: Fraction of the model's forward FLOPs (0 when the model has none).
    flops_share: float
    backward_flops: float
    #: Summed measured forward seconds, None when not profiled.
    measured_seconds: float | None = None


def summarize(costs: Costs) -> tuple[list[OpTypeSummary], dict[str, float]]:
    """Rows per op type, largest FLOPs share first, and the model totals."""
    total_flops = sum(c.flops for c in costs.nodes.values())
    groups: dict[str, list[NodeCost]] = {}
    for cost in costs.nodes.values():
        groups.setdefault(cost.op_type, []).append(cost)
    rows = [
        OpTypeSummary(
            op_type=op,
            op_class=group[0].op_class,
            count=len(group),
            flops=sum(c.flops for c in group),
            param_bytes=sum(c.param_bytes for c in group),
            activation_bytes=sum(c.activation_bytes for c in group),
            flops_share=sum(c.flops for c in group) / total_flops if total_flops else 0.0,
            backward_flops=sum(c.backward_flops for c in group),
            measured_seconds=sum(c.measured_seconds or 0.0 for c in group) if costs.profiled else None,
        )
        for op, group in groups.items()
    ]
    rows.sort(key=lambda r: (-r.flops, -r.activation_bytes, r.op_type))
    nodes = costs.nodes.values()
    totals: dict[str, float] = {
        "nodes": len(costs.nodes),
        "flops": total_flops,
        "backward_flops": sum(c.backward_flops for c in nodes),
        "params_bytes": sum(c.param_bytes for c in nodes),
        "activation_bytes": sum(c.activation_bytes for c in nodes),
        "bytes_read": sum(c.bytes_read for c in nodes),
        "bytes_written": sum(c.bytes_written for c in nodes),
    }
    if costs.profiled:
        totals["measured_seconds"] = sum(c.measured_seconds or 0.0 for c in nodes)
        totals["measured_backward_seconds"] = sum(c.measured_backward_seconds or 0.0 for c in nodes)
    return rows, totals


_PREFIX = "onnxpipe."
#: Models this large keep their weights in a side file: protobuf cannot serialize 2 GB.
_EXTERNAL_DATA_BYTES = 2**31 - 2**20
_TEXT_FIELDS = ("op_type", "op_class", "known", "winograd", "measured_on", "source", "dtype", "layout")
#: Model metadata keys of `Costs.reorder`'s two rates (bytes/s).
_REORDER_KEYS = (f"{_PREFIX}reorder_into_blocks", f"{_PREFIX}reorder_out_of_blocks")
_NUMBER_FIELDS = tuple(f.name for f in fields(NodeCost) if f.name not in _TEXT_FIELDS)


def write_annotated(graph: Graph, costs: Costs, path: str | os.PathLike) -> None:
    """Write the model with every costed node's `metadata_props` holding its cost (Netron shows them).
    Models past protobuf's 2 GB limit keep their weights in `<file>.data` beside it."""
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    load_weights(model, graph.weights_dir or ".")
    for node in model.graph.node:
        cost = costs.nodes.get(node.name)
        if cost is not None:
            _set_props(node.metadata_props, _node_props(cost))
    rates = dict(zip(_REORDER_KEYS, (repr(costs.reorder.into_blocks), repr(costs.reorder.out_of_blocks)))) if costs.reorder else {}
    _set_props(model.metadata_props, {f"{_PREFIX}unknown_ops": ",".join(costs.unknown_ops), f"{_PREFIX}profiled": str(costs.profiled).lower(), **rates})
    _save_model_atomically(model, Path(path))


def _node_props(cost: NodeCost) -> dict[str, str]:
    props = {f"{_PREFIX}op_class": cost.op_class, f"{_PREFIX}known": str(cost.known).lower(), f"{_PREFIX}winograd": str(cost.winograd).lower()}
    props.update({_PREFIX + key: getattr(cost, key) for key in ("measured_on", "source", "dtype", "layout") if getattr(cost, key)})
    for key in _NUMBER_FIELDS:
        value = getattr(cost, key)
        if value is not None:
            props[_PREFIX + key] = repr(float(value))
    return props


def _set_props(props, values: Mapping[str, str]) -> None:  # noqa: ANN001 - a protobuf repeated field
    kept = [(p.key, p.value) for p in props if not p.key.startswith(_PREFIX)]
    del props[:]
    for key, value in kept + sorted(values.items()):
        props.add(key=key, value=value)


def read_annotated(graph: Graph) -> Costs | None:
    """The costs stored in an annotated model, None when some compute node carries none."""
    nodes: dict[str, NodeCost] = {}
    for name in graph.compute_nodes:
        node = graph.node(name)
        props = {p.key[len(_PREFIX):]: p.value for p in node.metadata_props if p.key.startswith(_PREFIX)}
        if "flops" not in props:
            return None
        try:
            numbers = {key: float(props[key]) if key in props else None for key in _NUMBER_FIELDS}
            numbers = {key: value for key, value in numbers.items() if value is not None or key.startswith("measured")}
            measured_on = props.get("measured_on") or ("cpu" if numbers.get("measured_seconds") is not None else None)
            nodes[name] = NodeCost(op_type=node.op_type, op_class=props["op_class"], known=props.get("known", "true") == "true",
                                   winograd=props.get("winograd") == "true", measured_on=measured_on, source=props.get("source", ""),
                                   dtype=props.get("dtype", ""), layout=props.get("layout", ""),
                                   **numbers)  # type: ignore[arg-type]
        except (KeyError, ValueError, TypeError) as exc:
            raise OnnxpipeError(f"{graph.source}: node '{name}' has a damaged cost annotation ({exc}); re-run `onnxpipe annotate`") from exc
    model_props = {p.key: p.value for p in graph.model.metadata_props}
    unknown = tuple(op for op in model_props.get(f"{_PREFIX}unknown_ops", "").split(",") if op)
    try:
        rates = [float(model_props[key]) for key in _REORDER_KEYS if key in model_props]
    except ValueError as exc:
        raise OnnxpipeError(f"{graph.source}: the model's reorder rates are damaged ({exc}); re-run `onnxpipe annotate`") from exc
    reorder = ReorderRates(*rates) if len(rates) == 2 and min(rates) > 0 else None
    return Costs(nodes=nodes, unknown_ops=unknown, profiled=model_props.get(f"{_PREFIX}profiled") == "true", reorder=reorder)


def _save_model_atomically(model: onnx.ModelProto, path: Path) -> None:
    """Write into a temp dir beside `path`, then move the weights file (if any) and the model into place."""
    tmp: Path | None = None
    try:
        tmp = fresh_dir_beside(path)
        data_name = path.name + ".data"
        if model.ByteSize() >= _EXTERNAL_DATA_BYTES:
            onnx.save_model(model, str(tmp / path.name), save_as_external_data=True, all_tensors_to_one_file=True, location=data_name)
            os.replace(tmp / data_name, path.parent / data_name)
        else:
            onnx.save_model(model, str(tmp / path.name))
        os.replace(tmp / path.name, path)
    except OSError as exc:
        raise OnnxpipeError(f"{path}: cannot write the annotated model ({exc.strerror}); choose a writable -o path") from exc
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)


def write_summary(costs: Costs, path: str | os.PathLike) -> None:
    """The JSON summary: totals, rows per op type, unknown op types and every node's cost; written atomically."""
    rows, totals = summarize(costs)
    data = {
        "totals": totals,
        "op_types": [asdict(r) for r in rows],
        "unknown_ops": list(costs.unknown_ops),
        "profiled": costs.profiled,
        "reorder": asdict(costs.reorder) if costs.reorder else None,
        "nodes": {name: asdict(c) for name, c in costs.nodes.items()},
    }
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, data)
    except OSError as exc:
        raise OnnxpipeError(f"{path}: cannot write the cost summary ({exc.strerror}); choose a writable --json path") from exc
