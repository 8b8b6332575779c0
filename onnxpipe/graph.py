"""The graph IR: an ONNX model bound to concrete shapes, seen as a networkx multigraph of its nodes.

Reading order: `load` (public entry) -> `_read_model` -> `_normalize` -> `_bind_dims`
-> `_infer_shapes` (`shapes.infer`) -> `_ensure_valid` -> `cleanup.clean` -> `_tensor_infos` -> `_build`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import heapq
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.buffers import hold_exporter_constants, hold_merged_constants
from onnxpipe.cleanup import clean, inline_decided_branches
from onnxpipe.errors import OnnxpipeError
from onnxpipe.initializers import SharedInitializer, TieChoice, shared_initializers, tie_copies_in_place, untie_in_place
from onnxpipe.cost_formulas import op_class
from onnxpipe.nodes import QUANTIZATION_OPS, RANDOM_OPS, has_subgraph, hold, is_float_dtype, is_weight, subgraph_captures, trained_initializers
from onnxpipe.ortutil import MAX_IR_VERSION, cpu_session, ensure_runtime_loads
from onnxpipe.protostream import read_user_model, skeleton, weights_dir
from onnxpipe.shapes import Inferred, infer, static_shape
from onnxpipe.units import plural

__all__ = ["TensorInfo", "Graph", "load", "is_weight", "subgraph_captures", "RANDOM_OPS"]




@dataclass(frozen=True)
class TensorInfo:
    """A value flowing in the graph, with its concrete shape."""

    name: str
    #: numpy dtype name, e.g. "float32".
    dtype: str
    #: Concrete dims; () for scalars.
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        """Size in bytes of one instance of the tensor."""
        return int(math.prod(self.shape)) * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class Graph:
    """An ONNX model with every value's shape known, and its node DAG.

    `dag` is a networkx MultiDiGraph keyed by node name; each edge carries one tensor
    (edge key = tensor name) with attributes `tensor`, `dtype`, `shape`, `bytes`.
    Node attributes: `op_type`, `index` (position in `order`), `constant` (bool).
    """

    #: The normalized model: unique node names, dims bound, shapes inferred, ir_version >= 4.
    model: onnx.ModelProto
    dag: nx.MultiDiGraph
    #: Node names in deterministic topological order.
    order: tuple[str, ...]
    #: Every named value (graph inputs, initializers, node outputs) with its shape.
    tensors: Mapping[str, TensorInfo]
    #: Graph inputs fed by the user (initializers excluded).
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    #: Initializer names (weights and constant tables).
    initializers: frozenset[str]
    #: Tensors whose value is known without any user input: initializers and outputs of constant chains.
    constants: frozenset[str]
    #: Nodes that compute only constants (Constant, ConstantOfShape, foldable chains).
    constant_nodes: frozenset[str]
    #: Nodes each stage reading their outputs computes again from the model's inputs (`_derived_nodes`): cheap streaming
    #: ops on inputs alone, such as an attention mask made from the input's padding mask.
    derived_nodes: frozenset[str]
    #: Symbolic dims bound while loading.
    dims: Mapping[str, int]
    #: Where the model came from (path or "<memory>").
    source: str
    #: Weights the file shares among several nodes and what loading decided (untied ones have a copy per module).
    shared: tuple[SharedInitializer, ...] = ()

    @property
    def untied(self) -> tuple[str, ...]:
        """Names of the file's initializers that were given one copy per reading module."""
        return tuple(s.name for s in self.shared if s.untied)

    @property
    def weights_dir(self) -> str | None:
        """The folder the model's on-disk weights are read from (external-data locations are relative
        to it); None for a model given in memory."""
        return None if self.source == "<memory>" else str(weights_dir(self.source))

    def node(self, name: str) -> onnx.NodeProto:
        """The NodeProto of a node name."""
        return self._nodes_by_name()[name]

    def _nodes_by_name(self) -> dict[str, onnx.NodeProto]:
        cache = self.__dict__.get("_node_cache")
        if cache is None:
            cache = {n.name: n for n in self.model.graph.node}
            object.__setattr__(self, "_node_cache", cache)
        return cache

    def node_inputs(self, name: str) -> tuple[str, ...]:
        """Every tensor a node reads: its listed inputs plus subgraph outer-scope captures."""
        node = self.node(name)
        listed = tuple(i for i in node.input if i)
        captured = tuple(c for c in subgraph_captures(node) if c not in listed)
        return listed + captured

    @property
    def compute_nodes(self) -> tuple[str, ...]:
        """Topologically ordered nodes that depend on user inputs, but for the derived ones (what the planner places)."""
        return tuple(n for n in self.order if n not in self.constant_nodes and n not in self.derived_nodes)

    @property
    def derived(self) -> frozenset[str]:
        """Tensors the derived nodes write."""
        cache = self.__dict__.get("_derived")
        if cache is None:
            cache = frozenset(o for n in self.derived_nodes for o in self.node(n).output if o)
            object.__setattr__(self, "_derived", cache)
        return cache

    @property
    def fingerprint(self) -> str:
        """Digest of the compute nodes (names, op types, input and output names): plans carry it so one
        made for another model is refused."""
        cache = self.__dict__.get("_fingerprint")
        if cache is None:
            digest = hashlib.sha256()
            for name in self.compute_nodes:
                node = self.node(name)
                digest.update(f"{name}|{node.op_type}|{','.join(node.input)}|{','.join(node.output)}\n".encode())
            cache = digest.hexdigest()[:16]
            object.__setattr__(self, "_fingerprint", cache)
        return cache

    @property
    def batch(self) -> int:
        """Size of axis 0 of the first input: the batch the graph's shapes (and so its costs) are for."""
        first = self.tensors[self.inputs[0]] if self.inputs else None
        return first.shape[0] if first is not None and first.shape else 1

    @property
    def loss(self) -> str | None:
        """The model's loss: its first output when that is a float scalar (or a one-element float named like a
        loss), what a training model computes; None for a model without one (it can only be served)."""
        info = self.tensors.get(self.outputs[0]) if self.outputs else None
        if info is None or not is_float_dtype(info.dtype):
            return None
        scalar = info.shape == ()
        named = "loss" in info.name.lower() and math.prod(info.shape) == 1
        return info.name if scalar or named else None

    @property
    def parameters(self) -> tuple[str, ...]:
        """Floating-point initializers of more than one element: the trainable weights. Scalars (a Pow
        exponent, a 1/sqrt(d) scale) are constants of the formula, not weights."""
        return tuple(sorted(n for n in self.initializers if is_weight(self.tensors[n].dtype, self.tensors[n].shape)))

    @property
    def trained(self) -> tuple[str, ...]:
        """The parameters training updates (`nodes.trained_initializers`, the trainer's own rule): what has a
        gradient, optimizer state and an all-reduce. Other weights (int8, constant fills, BatchNorm statistics) are only held."""
        return tuple(sorted(trained_initializers(self.model.graph) & self.initializers))

    @property
    def sequences(self) -> frozenset[str]:
        """Values typed as sequences of tensors (a SplitToSequence's output, say)."""
        return frozenset(vi.name for vi in _value_infos(self.model) if vi.type.HasField("sequence_type"))

    def producer(self, tensor: str) -> str | None:
        """The node producing a tensor, None for graph inputs and initializers."""
        return self._producers().get(tensor)

    def _producers(self) -> dict[str, str]:
        cache = self.__dict__.get("_producer_cache")
        if cache is None:
            cache = {o: n.name for n in self.model.graph.node for o in n.output if o}
            object.__setattr__(self, "_producer_cache", cache)
        return cache

    def consumers(self, tensor: str) -> tuple[str, ...]:
        """Nodes reading a tensor (listed input or subgraph capture), in topological order."""
        cache = self.__dict__.get("_consumer_cache")
        if cache is None:
            found: dict[str, list[str]] = {}
            for n in self.order:
                for t in self.node_inputs(n):
                    found.setdefault(t, []).append(n)
            cache = {t: tuple(ns) for t, ns in found.items()}
            object.__setattr__(self, "_consumer_cache", cache)
        return cache.get(tensor, ())


def load(source: str | os.PathLike | onnx.ModelProto, dims: Mapping[str, int] | None = None, ties: TieChoice | None = None, *,
         shapes_by_running: bool = False) -> Graph:
    """Load a model (its weights' bytes stay on disk), untie exporter-merged weights and tie exporter-copied ones
    back (`onnxpipe.initializers`; `ties` overrides), bind its symbolic dims, infer every shape without running it, fold its shape
    arithmetic and drop Identity copies (`cleanup`), and build the node DAG. `shapes_by_running`: shapes
    static inference cannot find are read off one run of the model on zeros (opt-in: it needs the model's
    full memory and time)."""
    model, origin = _read_model(source)
    model = _normalize(model)
    hold_exporter_constants(model)
    shared = shared_initializers(model, ties or TieChoice(), None if origin == "<memory>" else weights_dir(origin))
    hold_merged_constants(model, untie_in_place(model, (s.name for s in shared if s.untied and s.kind != "copy")))
    tie_copies_in_place(model, {s.name: s.of for s in shared if s.kind == "copy" and not s.untied and s.of})
    dims = dict(dims or {})
    _bind_dims(model, dims, origin)
    inferred = _infer_shapes(model, origin)
    if inline_decided_branches(model, inferred.folded):  # the shapes of what the branch computes, now in the main graph
        inferred = _infer_shapes(model, origin)
    _ensure_valid(model, inferred, origin)
    clean(model, inferred)
    tensors = _tensor_infos(model, origin, shapes_by_running)
    return dataclasses.replace(_build(model, tensors, dims, origin), shared=shared)


def _read_model(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        ensure_runtime_loads(model, "<memory>")
        return model, "<memory>"
    path = Path(source)
    model = read_user_model(path, "pass the path of an .onnx model", "re-export it or check the file is complete")
    if not model.graph.node and not model.graph.output:
        raise OnnxpipeError(f"{path}: not an ONNX model (no graph found); pass a model exported to .onnx")
    return model, str(path)


def _normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique name, turn weight-holding Constant nodes into initializers (held: an exporter
    writes constants so, never parameters; `nodes.hold`), drop
    initializers from the graph inputs (IR-3 style) and raise the IR version to at least 4."""
    graph = model.graph
    used: set[str] = set()
    for i, node in enumerate(graph.node):
        base = node.name or f"{node.op_type}_{i}"
        name, k = base, 1
        while name in used:
            name, k = f"{base}_{k}", k + 1
        node.name = name
        used.add(name)

    kept = []
    for node in graph.node:
        tensor = _constant_value(node)
        if tensor is not None:
            if is_weight(helper.tensor_dtype_to_np_dtype(tensor.data_type), tuple(tensor.dims)):
                hold(tensor, "a Constant node")
            graph.initializer.append(tensor)
        else:
            kept.append(node)
    if len(kept) != len(graph.node):
        del graph.node[:]
        graph.node.extend(kept)

    init_names = {t.name for t in graph.initializer}
    real_inputs = [vi for vi in graph.input if vi.name not in init_names]
    if len(real_inputs) != len(graph.input):
        del graph.input[:]
        graph.input.extend(real_inputs)
    if model.ir_version < 4:
        model.ir_version = 4
    return model


#: Constant's attribute forms other than a tensor, and the numpy type of each.
_CONSTANT_FORMS = {"value_float": np.float32, "value_floats": np.float32, "value_int": np.int64, "value_ints": np.int64}


def _constant_value(node: onnx.NodeProto) -> onnx.TensorProto | None:
    """The initializer a Constant node stands for (any of its numeric forms), None for other nodes."""
    if node.op_type != "Constant" or node.domain not in ("", "ai.onnx") or len(node.attribute) != 1:
        return None
    attr = node.attribute[0]
    if attr.name == "value":
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
    elif attr.name in _CONSTANT_FORMS:
        tensor = numpy_helper.from_array(np.asarray(helper.get_attribute_value(attr), dtype=_CONSTANT_FORMS[attr.name]))
    else:
        return None
    tensor.name = node.output[0]
    return tensor


def _bind_dims(model: onnx.ModelProto, dims: dict[str, int], origin: str) -> None:
    seen: set[str] = set()
    for vi in list(model.graph.input) + list(model.graph.output):
        for d in vi.type.tensor_type.shape.dim:
            if d.HasField("dim_param") and d.dim_param:
                seen.add(d.dim_param)
                if d.dim_param in dims:
                    d.dim_value = int(dims[d.dim_param])
    unknown = sorted(set(dims) - seen)
    if unknown:
        have = ", ".join(sorted(seen)) or "none"
        raise OnnxpipeError(f"{origin}: --dim {unknown[0]} names no symbolic dim of the model (its dims: {have})")
    unbound: dict[str, str] = {}  # symbolic dim -> the first input that has it
    for vi in model.graph.input:
        shape = vi.type.tensor_type.shape
        if not vi.type.HasField("tensor_type"):
            continue
        if not vi.type.tensor_type.HasField("shape"):
            raise OnnxpipeError(f"{origin}: input '{vi.name}' has no shape; re-export with shapes or give them with --dim")
        for d in shape.dim:
            if not d.HasField("dim_value"):
                if not d.dim_param:
                    raise OnnxpipeError(f"{origin}: dim '?' of input '{vi.name}' is unbound; costs depend on it, set it with a model exported with named or fixed dims")
                unbound.setdefault(d.dim_param, vi.name)
    if len(unbound) == 1:
        (label, name), = unbound.items()
        raise OnnxpipeError(f"{origin}: dim '{label}' of input '{name}' is unbound; costs depend on it, set it with --dim {label}=VALUE")
    if unbound:  # every one in one line: a transformer's batch and sequence alike
        listed = ", ".join(f"'{label}' (input '{name}')" for label, name in unbound.items())
        flags = " ".join(f"--dim {label}=VALUE" for label in unbound)
        raise OnnxpipeError(f"{origin}: dims {listed} are unbound; costs depend on them, set them with {flags}")


def _infer_shapes(model: onnx.ModelProto, origin: str) -> Inferred:
    """Every value's type and shape from static inference (weights seen as dims, never bytes), the
    model's value_info and outputs updated with them."""
    try:
        inferred = infer(model)
    except Exception as exc:
        raise OnnxpipeError(
            f"{origin}: shape inference failed ({str(exc).splitlines()[0][:200]}); run onnx.checker on the model and fix the reported node"
        ) from exc
    del model.graph.value_info[:]
    outputs = {vi.name for vi in model.graph.output}
    inputs = {vi.name for vi in model.graph.input}
    model.graph.value_info.extend(vi for name, vi in inferred.value_info.items() if name not in outputs and name not in inputs)
    for mine in model.graph.output:
        theirs = inferred.value_info.get(mine.name)
        if theirs is not None and static_shape(theirs) is not None:
            mine.CopyFrom(theirs)
    return inferred


def _ensure_valid(model: onnx.ModelProto, inferred: Inferred, origin: str) -> None:
    """onnx.checker on the model's structure (nodes, attributes, opsets, order) without its weights:
    initializers become typed graph inputs, so the check costs the same for 10 KB and 10 GB models.
    Types the file leaves out but shape inference found are filled in; the checker would reject
    them, and loading does not need them."""
    probe = skeleton(model, "graph")
    probe.graph.CopyFrom(skeleton(model.graph, "initializer"))
    del probe.graph.value_info[:]
    for t in model.graph.initializer:
        probe.graph.input.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    for vi in [*probe.graph.input, *probe.graph.output]:
        info = inferred.value_info.get(vi.name)
        if info is not None and (not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape")
                                 or not vi.type.tensor_type.elem_type):
            vi.CopyFrom(info)
    try:
        onnx.checker.check_model(probe)
    except onnx.checker.ValidationError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise OnnxpipeError(f"{origin}: fails onnx.checker ({first}); fix the reported node or attribute in the exporter and re-export") from exc


def _value_infos(model: onnx.ModelProto) -> Iterable[onnx.ValueInfoProto]:
    yield from model.graph.input
    yield from model.graph.value_info
    yield from model.graph.output


def _tensor_infos(model: onnx.ModelProto, origin: str, run_for_shapes: bool) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for t in model.graph.initializer:
        infos[t.name] = TensorInfo(t.name, helper.tensor_dtype_to_np_dtype(t.data_type).name, tuple(int(d) for d in t.dims))
    for vi in _value_infos(model):
        shape = static_shape(vi)
        if shape is not None and vi.name not in infos:
            infos[vi.name] = TensorInfo(vi.name, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name, shape)
    infos.update(_sequence_infos(model, infos))
    missing = [o for n in model.graph.node for o in n.output if o and o not in infos]
    if missing and run_for_shapes:
        infos.update(_shapes_by_running(model, missing, origin))
    elif missing:
        first = next(n for n in model.graph.node if missing[0] in n.output)
        raise OnnxpipeError(
            f"{origin}: static shape inference cannot tell the shapes of {plural(len(missing), 'tensor')} (first: '{missing[0]}' of "
            f"{first.op_type} node '{first.name}'); bind every symbolic dim with --dim, or pass --shapes-by-running to learn "
            "them by running the whole model once on zeros in onnxruntime (needs the model's full memory)"
        )
    return infos


def _sequence_infos(model: onnx.ModelProto, infos: Mapping[str, TensorInfo]) -> dict[str, TensorInfo]:
    """Sequences of equal-shaped tensors as one tensor of shape (count, *element shape), so their bytes
    are known: the count of a SplitToSequence is its input's size over an element's, of a
    SequenceConstruct its input count."""
    producers = {o: n for n in model.graph.node for o in n.output if o}
    found: dict[str, TensorInfo] = {}
    for vi in _value_infos(model):
        node = producers.get(vi.name)
        if vi.name in infos or node is None or not vi.type.HasField("sequence_type"):
            continue
        elem = onnx.ValueInfoProto(name=vi.name, type=vi.type.sequence_type.elem_type)
        shape = static_shape(elem)
        if shape is None:
            continue
        whole = infos.get(node.input[0]) if node.input else None
        if node.op_type == "SplitToSequence" and whole is not None and math.prod(shape):
            count = math.prod(whole.shape) // math.prod(shape)
        elif node.op_type == "SequenceConstruct":
            count = len(node.input)
        else:
            continue
        found[vi.name] = TensorInfo(vi.name, helper.tensor_dtype_to_np_dtype(elem.type.tensor_type.elem_type).name, (count, *shape))
    return found


def _shapes_by_running(model: onnx.ModelProto, missing: list[str], origin: str) -> dict[str, TensorInfo]:
    """Shapes static inference could not find, read off one run on zero inputs in onnxruntime: the
    opt-in fallback for ops whose output shapes depend on data."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    if any(t.data_location == onnx.TensorProto.EXTERNAL for t in probe.graph.initializer):
        onnx.external_data_helper.load_external_data_for_model(probe, str(weights_dir(origin)))
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in missing)
    probe.ir_version = min(probe.ir_version, MAX_IR_VERSION)
    try:
        session = cpu_session(probe.SerializeToString(), optimize=False)
        feeds = {}
        for vi in model.graph.input:
            dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = np.zeros(static_shape(vi) or (), dtype=dtype)
        values = session.run(missing, feeds)
    except Exception as exc:
        raise OnnxpipeError(
            f"{origin}: shapes of {plural(len(missing), 'tensor')} (first: '{missing[0]}') are unknown and the model could not be run to find them; "
            "bind every symbolic dim with --dim or re-export with static shapes"
        ) from exc
    return {name: TensorInfo(name, np.asarray(v).dtype.name, tuple(np.asarray(v).shape)) for name, v in zip(missing, values)}


def _topological_order(dag: nx.MultiDiGraph, index: Mapping[str, int]) -> tuple[str, ...]:
    """Kahn's order, ties broken by file position: the file's own order when it is already topological.
    (networkx's lexicographical sort walks multigraph edge views, seconds on a few thousand nodes.)"""
    preds = {n: set(dag.pred[n]) - {n} for n in dag}
    succs: dict[str, set[str]] = {n: set() for n in dag}
    for n, ps in preds.items():
        for p in ps:
            succs[p].add(n)
    waiting = {n: len(ps) for n, ps in preds.items()}
    ready = [(index[n], n) for n, k in waiting.items() if k == 0]
    heapq.heapify(ready)
    order: list[str] = []
    while ready:
        _, n = heapq.heappop(ready)
        order.append(n)
        for s in succs[n]:
            waiting[s] -= 1
            if waiting[s] == 0:
                heapq.heappush(ready, (index[s], s))
    return tuple(order)


def _build(model: onnx.ModelProto, tensors: dict[str, TensorInfo], dims: dict[str, int], origin: str) -> Graph:
    graph = model.graph
    init_names = frozenset(t.name for t in graph.initializer)
    producers = {o: n.name for n in graph.node for o in n.output if o}
    index = {n.name: i for i, n in enumerate(graph.node)}
    dag = nx.MultiDiGraph()
    for n in graph.node:
        dag.add_node(n.name, op_type=n.op_type)
    reads: dict[str, tuple[str, ...]] = {}
    for n in graph.node:
        listed = tuple(i for i in n.input if i)
        reads[n.name] = listed + tuple(c for c in subgraph_captures(n) if c not in listed)
        for t in reads[n.name]:
            src = producers.get(t)
            if src is not None and src != n.name:
                info = tensors.get(t)
                if info is None:
                    raise OnnxpipeError(f"{origin}: tensor '{t}' has no known shape; re-export the model with shapes")
                dag.add_edge(src, n.name, key=t, tensor=t, dtype=info.dtype, shape=info.shape, bytes=info.nbytes)
    if not nx.is_directed_acyclic_graph(dag):
        raise OnnxpipeError(f"{origin}: the graph has a cycle; the model is malformed, re-export it")
    order = _topological_order(dag, index)

    constants = set(init_names)
    constant_nodes: set[str] = set()
    for name in order:
        n = graph.node[index[name]]
        if n.op_type in RANDOM_OPS:
            continue
        if all(t in constants for t in reads[name]):
            constant_nodes.add(name)
            constants.update(o for o in n.output if o)
    derived_nodes = _derived_nodes(graph, order, index, reads, tensors, constants, constant_nodes)
    for i, name in enumerate(order):
        dag.nodes[name]["index"] = i
        dag.nodes[name]["constant"] = name in constant_nodes

    return Graph(
        model=model,
        dag=dag,
        order=order,
        tensors=tensors,
        inputs=tuple(vi.name for vi in graph.input),
        outputs=tuple(vi.name for vi in graph.output),
        initializers=init_names,
        constants=frozenset(constants),
        constant_nodes=frozenset(constant_nodes),
        derived_nodes=derived_nodes,
        dims=dict(dims),
        source=origin,
    )


def _derived_nodes(graph: onnx.GraphProto, order: tuple[str, ...], index: Mapping[str, int], reads: Mapping[str, tuple[str, ...]],
                   tensors: Mapping[str, TensorInfo], constants: set[str], constant_nodes: set[str]) -> frozenset[str]:
    """The nodes of standard elementwise and data-movement ops that read only model inputs, what other such nodes write,
    and constants made from scalars alone (a ConstantOfShape fill, never a weight nor anything made from one): each stage
    reading one of their outputs computes them again.

    Why: an exporter builds an attention mask from the input's padding mask once, and every layer reads it: sent, an
    encoder-decoder's 8-MiB cross-attention mask goes from the first stage to every decoder stage (T5-small's export at 8
    stages on gpu4: 1.78 ms of its least plan's 4.99 ms of messages). Made again where it is read, it costs each such stage
    its bytes at memory bandwidth instead of link bandwidth, and no weight is copied. Never random ops or ops with a
    subgraph; quantization nodes stay where the plan puts them."""
    weighty = {t.name for t in graph.initializer if _weight_like(tensors.get(t.name))}
    for name in order:  # what a constant node makes from a weight is one too (a Transpose of it), and a Constant's own value
        node = graph.node[index[name]]
        if name not in constant_nodes:
            continue
        if any(t in weighty for t in reads[name]):
            weighty.update(o for o in node.output if o)
        elif not reads[name]:
            weighty.update(o for o in node.output if o and _weight_like(tensors.get(o)))
    found: set[str] = set()
    available = {i.name for i in graph.input} - constants
    for name in order:
        node = graph.node[index[name]]
        if name in constant_nodes or not _streaming(node):
            continue
        if all(t in available or (t in constants and t not in weighty) for t in reads[name]):
            found.add(name)
            available.update(o for o in node.output if o)
    if len(found) + len(constant_nodes) == len(order):  # nothing else to place (no weight anywhere): place them instead
        return frozenset()
    return frozenset(found)


def _streaming(node: onnx.NodeProto) -> bool:
    """A standard op whose time is its bytes (`cost_formulas.op_class`: elementwise or data movement), drawing nothing."""
    return (node.domain in ("", "ai.onnx") and op_class(node.op_type) in ("elementwise", "data") and not has_subgraph(node)
            and node.op_type not in QUANTIZATION_OPS and node.op_type not in RANDOM_OPS and node.op_type != "Dropout")


def _weight_like(info: TensorInfo | None) -> bool:
    return info is None or is_weight(info.dtype, info.shape)
