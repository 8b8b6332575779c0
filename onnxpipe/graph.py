"""The graph IR: an ONNX model bound to concrete shapes, seen as a networkx multigraph of its nodes.

Reading order: `load` (public entry) -> `_read_model` -> `_normalize` -> `_bind_dims`
-> `_infer_shapes` -> `Graph` construction helpers.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import networkx as nx
import numpy as np
import onnx
from onnx import helper, shape_inference

from onnxpipe.errors import OnnxpipeError
from onnxpipe.initializers import SharedInitializer, TieChoice, shared_initializers, untie_in_place
from onnxpipe.ortutil import cpu_session
from onnxpipe.protostream import is_streamable, raw_nbytes, read_model, skeleton

__all__ = ["TensorInfo", "Graph", "load", "is_weight", "subgraph_captures", "RANDOM_OPS"]

#: Ops whose outputs differ per run even with constant inputs: never constant-folded or duplicated.
RANDOM_OPS = frozenset({"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"})

#: Initializers larger than this have their bytes lifted out during shape inference.
_LIFT_BYTES = 4096


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
        """Topologically ordered nodes that depend on user inputs (what the planner places)."""
        return tuple(n for n in self.order if n not in self.constant_nodes)

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
    def parameters(self) -> tuple[str, ...]:
        """Floating-point initializers of more than one element: the trainable weights. Scalars (a Pow
        exponent, a 1/sqrt(d) scale) are constants of the formula, not weights."""
        return tuple(sorted(n for n in self.initializers if is_weight(self.tensors[n].dtype, self.tensors[n].shape)))

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


def is_weight(dtype: str, shape: tuple[int, ...]) -> bool:
    """A floating-point initializer of more than one element is a trainable weight; scalars and
    one-element tensors (a Pow exponent, a 1/sqrt(d) scale, a mask fill value) are constants."""
    return bool(np.issubdtype(np.dtype(dtype), np.floating)) and math.prod(shape) > 1


def load(source: str | os.PathLike | onnx.ModelProto, dims: Mapping[str, int] | None = None, ties: TieChoice | None = None) -> Graph:
    """Load a model, untie exporter-merged weights (`onnxpipe.initializers`; `ties` overrides), bind
    its symbolic dims, infer every shape and build the node DAG."""
    model, origin = _read_model(source)
    model = _normalize(model)
    shared = shared_initializers(model, ties or TieChoice())
    untie_in_place(model, (s.name for s in shared if s.untied))
    dims = dict(dims or {})
    _bind_dims(model, dims, origin)
    model = _infer_shapes(model, origin)
    tensors = _tensor_infos(model, origin)
    _ensure_valid(model, tensors, origin)
    return dataclasses.replace(_build(model, tensors, dims, origin), shared=shared)


def _read_model(source: str | os.PathLike | onnx.ModelProto) -> tuple[onnx.ModelProto, str]:
    if isinstance(source, onnx.ModelProto):
        model = onnx.ModelProto()
        model.CopyFrom(source)
        return model, "<memory>"
    path = Path(source)
    if not path.exists():
        raise OnnxpipeError(f"{path}: no such file; pass the path of an .onnx model")
    if not path.is_file():
        raise OnnxpipeError(f"{path}: not a file; pass the path of an .onnx model")
    try:
        model = read_model(path)
    except OnnxpipeError:
        raise
    except Exception as exc:  # protobuf raises several unrelated types on garbage
        raise OnnxpipeError(
            f"{path}: not a readable ONNX model ({type(exc).__name__}); re-export it or check the file is complete"
        ) from exc
    if not model.graph.node and not model.graph.output:
        raise OnnxpipeError(f"{path}: not an ONNX model (no graph found); pass a model exported to .onnx")
    return model, str(path)


def _normalize(model: onnx.ModelProto) -> onnx.ModelProto:
    """Give every node a unique name, turn weight-holding Constant nodes into initializers, drop
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
        if node.op_type == "Constant" and node.domain in ("", "ai.onnx") and len(node.attribute) == 1 and node.attribute[0].name == "value":
            tensor = onnx.TensorProto()
            tensor.CopyFrom(node.attribute[0].t)
            tensor.name = node.output[0]
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
    for vi in model.graph.input:
        shape = vi.type.tensor_type.shape
        if not vi.type.HasField("tensor_type"):
            continue
        if not vi.type.tensor_type.HasField("shape"):
            raise OnnxpipeError(f"{origin}: input '{vi.name}' has no shape; re-export with shapes or give them with --dim")
        for d in shape.dim:
            if not d.HasField("dim_value"):
                label = d.dim_param or "?"
                hint = f"--dim {d.dim_param}=VALUE" if d.dim_param else "a model exported with named or fixed dims"
                raise OnnxpipeError(f"{origin}: dim '{label}' of input '{vi.name}' is unbound; costs depend on it, set it with {hint}")


def _infer_shapes(model: onnx.ModelProto, origin: str) -> onnx.ModelProto:
    """Infer shapes on a copy of the model whose large weights carry dims but no bytes: shape
    inference needs only their dims, and this keeps peak memory near one copy of the model."""
    probe = skeleton(model, "graph")
    probe.graph.CopyFrom(skeleton(model.graph, "initializer"))
    for t in model.graph.initializer:
        probe.graph.initializer.append(skeleton(t, "raw_data") if is_streamable(t) and raw_nbytes(t) > _LIFT_BYTES else t)
    try:
        inferred = shape_inference.infer_shapes(probe, strict_mode=False, data_prop=True)
    except Exception as exc:
        raise OnnxpipeError(
            f"{origin}: shape inference failed ({str(exc).splitlines()[0][:200]}); run onnx.checker on the model and fix the reported node"
        ) from exc
    del model.graph.value_info[:]
    model.graph.value_info.extend(inferred.graph.value_info)
    for mine, theirs in zip(model.graph.output, inferred.graph.output):
        mine.CopyFrom(theirs)
    return model


def _ensure_valid(model: onnx.ModelProto, tensors: Mapping[str, TensorInfo], origin: str) -> None:
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
        info = tensors.get(vi.name)
        if info is not None and (not vi.type.HasField("tensor_type") or not vi.type.tensor_type.HasField("shape")
                                 or not vi.type.tensor_type.elem_type):
            vi.CopyFrom(helper.make_tensor_value_info(vi.name, helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype)), list(info.shape)))
    try:
        onnx.checker.check_model(probe)
    except onnx.checker.ValidationError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise OnnxpipeError(f"{origin}: fails onnx.checker ({first}); fix the reported node or attribute in the exporter and re-export") from exc


def _value_infos(model: onnx.ModelProto) -> Iterable[onnx.ValueInfoProto]:
    yield from model.graph.input
    yield from model.graph.value_info
    yield from model.graph.output


def _static_shape(vi: onnx.ValueInfoProto) -> tuple[int, ...] | None:
    tt = vi.type.tensor_type
    if not vi.type.HasField("tensor_type") or not tt.HasField("shape") or tt.elem_type == 0:
        return None
    dims = []
    for d in tt.shape.dim:
        if not d.HasField("dim_value"):
            return None
        dims.append(int(d.dim_value))
    return tuple(dims)


def _tensor_infos(model: onnx.ModelProto, origin: str) -> dict[str, TensorInfo]:
    infos: dict[str, TensorInfo] = {}
    for t in model.graph.initializer:
        infos[t.name] = TensorInfo(t.name, helper.tensor_dtype_to_np_dtype(t.data_type).name, tuple(int(d) for d in t.dims))
    for vi in _value_infos(model):
        shape = _static_shape(vi)
        if shape is not None and vi.name not in infos:
            infos[vi.name] = TensorInfo(vi.name, helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type).name, shape)
    missing = [o for n in model.graph.node for o in n.output if o and o not in infos]
    if missing:
        infos.update(_shapes_by_running(model, missing, origin))
    return infos


def _shapes_by_running(model: onnx.ModelProto, missing: list[str], origin: str) -> dict[str, TensorInfo]:
    """Shapes static inference could not find, read off one run on zero inputs in onnxruntime."""
    probe = onnx.ModelProto()
    probe.CopyFrom(model)
    del probe.graph.output[:]
    probe.graph.output.extend(helper.make_empty_tensor_value_info(name) for name in missing)
    if probe.ir_version > 10:
        probe.ir_version = 10
    try:
        session = cpu_session(probe.SerializeToString(), optimize=False)
        feeds = {}
        for vi in model.graph.input:
            dtype = helper.tensor_dtype_to_np_dtype(vi.type.tensor_type.elem_type)
            feeds[vi.name] = np.zeros(_static_shape(vi) or (), dtype=dtype)
        values = session.run(missing, feeds)
    except Exception as exc:
        raise OnnxpipeError(
            f"{origin}: shapes of {len(missing)} tensors (first: '{missing[0]}') are unknown and the model could not be run to find them; "
            "bind every symbolic dim with --dim or re-export with static shapes"
        ) from exc
    return {name: TensorInfo(name, np.asarray(v).dtype.name, tuple(np.asarray(v).shape)) for name, v in zip(missing, values)}


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
    order = tuple(nx.lexicographical_topological_sort(dag, key=lambda name: index[name]))

    constants = set(init_names)
    constant_nodes: set[str] = set()
    for name in order:
        n = graph.node[index[name]]
        if n.op_type in RANDOM_OPS:
            continue
        if all(t in constants for t in reads[name]):
            constant_nodes.add(name)
            constants.update(o for o in n.output if o)
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
        dims=dict(dims),
        source=origin,
    )
