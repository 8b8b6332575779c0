"""The planning problem as arrays: per-micro-batch node times on each device group, parameter and
activation bytes, the tensors that may cross stages, and the links between groups.

Every solver, baseline and bound reads one `Problem`, built by the pure function `build_problem`.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass
from functools import cached_property, lru_cache

import networkx as nx
import numpy as np

from onnxpipe import schedule as schedules
from onnxpipe.cost import Costs, NodeCost, weight_owners
from onnxpipe.cost_layout import NCHWC
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.nodes import draws_random, is_float_dtype
from onnxpipe.pricing.timemodel import corun_seconds, node_seconds, ring_seconds, rings
from onnxpipe.quantized import dequantized_source
from onnxpipe.target import Device, Target
from onnxpipe.units import plural

__all__ = ["OPTIMIZER_STATES", "MASTER_SUFFIX", "PLANNED_OPTIMIZERS", "optimizer_states", "MODES", "Problem", "build_problem", "in_flight", "flights", "schedule_table"]

#: Ops whose gradient node makes the input and the weight gradients at once (onnxruntime-training 1.19.2;
#: `train.splitgrad`): a split backward runs them whole in B, leaving W nothing of theirs.
FUSED_GRADIENT_OPS = frozenset({"LayerNormalization", "BatchNormalization", "LSTM"})
#: Optimizer state per parameter byte.
OPTIMIZER_STATES = {"sgd": 0.0, "momentum": 1.0, "adam": 2.0}
#: An optimizer's name with this suffix keeps float32 master copies of float16 and bfloat16 weights (`optimizer_states`).
MASTER_SUFFIX = "-master"
#: Every optimizer name the planner prices (the trainer's are `train.optimizer.OPTIMIZERS`, each planned as one of these).
PLANNED_OPTIMIZERS = (*OPTIMIZER_STATES, *(f"{name}{MASTER_SUFFIX}" for name in OPTIMIZER_STATES))


def optimizer_states(optimizer: str, dtype: str) -> float:
    """Optimizer bytes per trained parameter byte. With master weights of a 16-bit model, a float32 copy of each weight
    and float32 state: (states + 1) x 2 (Adam: 12 bytes per 2-byte weight, as DeepSpeed counts it); a float32 or
    float64 model keeps no copy."""
    base = optimizer.removesuffix(MASTER_SUFFIX)
    states = OPTIMIZER_STATES[base]
    if base != optimizer and dtype in ("float16", "bfloat16"):
        return 2.0 * (states + 1.0)
    return states


#: "training": forward, backward and an optimizer step per iteration; "inference": forward only (no
#: gradients, optimizer state, stash or all-reduce), micro-batches streamed through the stages.
MODES = ("training", "inference")


@dataclass(frozen=True, eq=False)
class Problem:
    """A graph's costs on a target for one micro-batch of `batch / microbatches` samples."""

    graph: Graph
    costs: Costs
    target: Target
    batch: int
    microbatches: int
    #: "gpipe" or "1f1b".
    schedule: str
    optimizer: str
    #: Numpy dtype whose peak FLOP/s the node times use.
    dtype: str
    #: Micro-batch size over the batch the costs were annotated for.
    scale: float
    #: Compute nodes in topological order; positions index every per-node array.
    nodes: tuple[str, ...]
    #: Device group names in target order, and the device instances of each.
    groups: tuple[str, ...]
    group_devices: tuple[tuple[str, ...], ...]
    #: (groups, nodes) forward and backward seconds per micro-batch.
    forward: np.ndarray
    backward: np.ndarray
    #: (groups, nodes) the seconds of each node's backward a split backward runs in W (weight gradients) when its B
    #: runs the node (`pricing.stage`: a node no received tensor reaches is all W's): half the backward of a node
    #: reading a weight (its weight gradient has the forward's FLOPs, its input gradient the other half), none of
    #: FUSED_GRADIENT_OPS or of nodes without weights.
    weight: np.ndarray
    #: (nodes,) parameter bytes (not scaled by the batch) and activation bytes per micro-batch.
    params: np.ndarray
    activations: np.ndarray
    #: (nodes,) the part of `params` training updates (`Graph.trained`, the trainer's own rule), owned as `params`
    #: are: what has gradients, optimizer state and an all-reduce. Frozen weights (int8 behind a DequantizeLinear,
    #: constant fills, BatchNorm statistics) are only held.
    trained: np.ndarray
    #: Tensors read by compute nodes: name, producer position (-1: model input, or a derived tensor each stage reading it
    #: makes: `Graph.derived_nodes`), bytes per micro-batch (a derived tensor's: the model inputs its makers read, what a
    #: recomputing stage stashes for it), and the sorted distinct positions of their consumers.
    tensor_names: tuple[str, ...]
    tensor_producer: np.ndarray
    tensor_bytes: np.ndarray
    tensor_consumers: tuple[np.ndarray, ...]
    #: (nodes + 1,) the gaps of the order no stage boundary may take (`_sealed`); the solvers' blocks never start at one.
    sealed: np.ndarray
    #: (groups, tensors) forward seconds per micro-batch a stage on the group's devices spends because the tensor
    #: crosses a cut: the sending stage (once per tensor) and each receiving stage. Compute, not link time:
    #: - in inference on cpu devices, reordering it out of and into onnxruntime's blocked layout (`cost_layout`),
    #:   for a tensor a blocked node writes (sent) or reads (received), at the profiled host's rates;
    #: - a dequantized tensor (`quantized.dequantized_source`) received: its int8 readers run as float kernels in
    #:   that stage (their DequantizeLinear is in another stage file, so nothing fuses them), priced at the float
    #:   rate (measured: their unfused time) instead of the int8 rate (received: the difference);
    #: - a tensor the derived nodes write (`Graph.derived_nodes`), listed as a model input is (producer -1): every stage
    #:   reading it runs the derived nodes that make it (received: their forward).
    #: Zeros otherwise (training sends no reordered tensor; other devices; models without either).
    crossing_sent: np.ndarray
    crossing_received: np.ndarray
    #: (tensor index, int8 source) of the stage-crossable tensors a DequantizeLinear made from int8 data.
    dequantized: tuple[tuple[int, str], ...]
    #: (groups, groups) link bandwidth (bytes/s) and latency (s); inf/0 where no link exists.
    bandwidth: np.ndarray
    latency: np.ndarray
    #: (groups,) device memory capacity and memory bandwidth.
    capacity: np.ndarray
    memory_bandwidth: np.ndarray
    #: (groups, nodes) extra forward and backward seconds per micro-batch while other workers compute on the
    #: target's shared cores overflowing its shared cache (`timemodel.corun_seconds` of the node's weights);
    #: zeros on targets without `corun_bandwidth`.
    corun_forward: np.ndarray
    corun_backward: np.ndarray
    #: (nodes,) True where the node's outputs are drawn anew on every run (`nodes.draws_random`: Dropout in training
    #: mode, random ops): a stage holding one never recomputes, since its backward would see other draws than its loss.
    random: np.ndarray
    #: One of MODES; in inference the backward arrays are zeros.
    mode: str = "training"
    #: Inference: the most seconds a plan's latency may take (`Plan.latency_seconds`); plans above it are not taken.
    max_latency: float = math.inf
    #: The device group stage s must run on, for each stage s, where the schedule places the stages (`plan.virtual`: a
    #: device holding several stages runs them all on its type); empty: the solvers choose. Like `max_latency`, plans
    #: breaking it are not taken (`plan.evaluate.within`); the DP and CP-SAT only build such plans.
    stage_groups: tuple[int, ...] = ()

    @property
    def training(self) -> bool:
        return self.mode == "training"

    @property
    def n(self) -> int:
        return len(self.nodes)

    @cached_property
    def tensors_by_producer(self) -> np.ndarray:
        """Tensor indices, their producers in topological order (model inputs first): pricing walks them once per plan."""
        return np.argsort(self.tensor_producer, kind="stable")

    @property
    def device_count(self) -> int:
        return sum(len(d) for d in self.group_devices)

    @property
    def stage_links(self) -> list[list[bool]]:
        """stage_links[g][h]: a stage on group g can exchange messages with another on group h, two distinct devices: a
        group's own link only where it has two devices (stages hold devices of their own)."""
        counts = [len(d) for d in self.group_devices]
        return [[counts[h] >= (2 if h == g else 1) for h in range(len(counts))] for g in range(len(counts))]

    @property
    def least_latency(self) -> float:
        """The least latency a message between two stages can pay, over the `stage_links`."""
        links = self.stage_links
        return min((float(self.latency[g, h]) for g, row in enumerate(links) for h, ok in enumerate(row) if ok), default=0.0)

    @cached_property
    def parts(self) -> int:
        """Weakly connected parts of the compute nodes, joined by the tensors between them: stages holding nodes of one
        part exchange messages."""
        joined = nx.Graph()
        joined.add_nodes_from(range(self.n))
        joined.add_edges_from((int(p), int(c)) for p, cs in zip(self.tensor_producer, self.tensor_consumers) if p >= 0 for c in cs)
        return nx.number_connected_components(joined)

    @property
    def optimizer_states(self) -> float:
        return optimizer_states(self.optimizer, self.dtype)

    def group_of(self, device: str) -> int:
        for g, names in enumerate(self.group_devices):
            if device in names:
                return g
        raise OnnxpipeError(f"device '{device}' is not in target {self.target.name}; its devices: {', '.join(d.name for d in self.target.devices)}")

    def with_options(self, **changes: object) -> Problem:
        """The same graph and target under another batch, micro-batch count, schedule or optimizer."""
        keep = {k: getattr(self, k) for k in ("batch", "microbatches", "schedule", "optimizer")}
        keep.update(changes)
        if keep["batch"] == self.batch and keep["microbatches"] == self.microbatches:
            return dataclasses.replace(self, schedule=keep["schedule"], optimizer=keep["optimizer"])
        rebuilt = build_problem(self.graph, self.costs, self.target, dtype=self.dtype, mode=self.mode, **keep)  # type: ignore[arg-type]
        return dataclasses.replace(rebuilt, max_latency=self.max_latency, stage_groups=self.stage_groups)

    def flights(self, stages: int) -> tuple[int, ...]:
        """Micro-batches whose activations each of `stages` stages holds at once: the schedule's in flight
        in training; in inference one, the micro-batch its forward is computing."""
        return flights(self.mode, self.schedule, stages, self.microbatches)

    def allreduce_affine(self, group: int, replicas: int) -> tuple[float, float]:
        """(seconds, seconds per byte) of an all-reduce of gradients over `replicas` devices of a group
        (none in inference). The bounds and solvers ask for every replica count of a group: its rings' slowest links
        are found once per problem, in one pass (`timemodel.rings`)."""
        if not self.training:
            return 0.0, 0.0
        if replicas < 2:
            return 0.0, 0.0
        cache = self.__dict__.setdefault("_rings", {})
        if group not in cache:
            cache[group] = rings(self.target, self.group_devices[group])
        latency, bandwidth = cache[group][replicas - 2]
        one = ring_seconds(replicas, latency, bandwidth, 1.0)
        slope = ring_seconds(replicas, latency, bandwidth, 2.0) - one
        return one - slope, slope


@lru_cache(maxsize=256)
def in_flight(schedule: str, stages: int, microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at once under a schedule."""
    table = schedules.table(schedule, stages, microbatches)
    rows = schedules.stage_rows(table)
    # A device holding several stages: each stage's own micro-batches at most at once (their sum bounds the device's).
    return tuple(round(schedules.peak_held(table[rows[s]], {t: float(t == s) for t in range(stages)})) for s in range(stages))


def flights(mode: str, schedule: str, stages: int, microbatches: int) -> tuple[int, ...]:
    """Micro-batches whose activations each stage holds at once: the schedule's in flight in training; in
    inference one, the micro-batch its forward is computing."""
    return in_flight(schedule, stages, microbatches) if mode == "training" else (1,) * stages


def schedule_table(mode: str, schedule: str, stages: int, microbatches: int) -> schedules.Table:
    """The actions of one iteration: the named training schedule, or in inference forwards only."""
    return schedules.table(schedule, stages, microbatches) if mode == "training" else schedules.forward_only(stages, microbatches)


def dominant_dtype(graph: Graph) -> str:
    """The float dtype holding most parameter (else tensor) bytes: the one whose peak applies."""
    weights: Counter[str] = Counter()
    for name in graph.parameters or tuple(graph.tensors):
        info = graph.tensors[name]
        if is_float_dtype(info.dtype):
            weights[info.dtype] += info.nbytes
    return weights.most_common(1)[0][0] if weights else "float32"


def build_problem(
    graph: Graph,
    costs: Costs,
    target: Target,
    *,
    batch: int,
    microbatches: int,
    schedule: str = "1f1b",
    optimizer: str = "adam",
    dtype: str | None = None,
    mode: str = "training",
    max_latency: float = math.inf,
) -> Problem:
    """Scale the graph's costs to one micro-batch and tabulate them per device group."""
    _ensure_options(graph, batch, microbatches, schedule, optimizer)
    if mode not in MODES:
        raise OnnxpipeError(f"unknown mode '{mode}'; choose one of: {', '.join(MODES)}")
    if not max_latency > 0:
        raise OnnxpipeError(f"--max-latency {max_latency}: must be a positive number of seconds")
    if mode == "training" and max_latency < math.inf:
        raise OnnxpipeError("--max-latency bounds an inference pipeline's latency; add --mode inference")
    nodes = graph.compute_nodes
    missing = [n for n in (*nodes, *sorted(graph.derived_nodes)) if n not in costs.nodes]
    if missing:
        raise OnnxpipeError(f"costs miss {plural(len(missing), 'node')} (first: '{missing[0]}'); annotate this model again with `onnxpipe annotate`")
    dtype = dtype or dominant_dtype(graph)
    scale = batch / microbatches / graph.batch
    groups: list[str] = []
    members: dict[str, list[str]] = {}
    for d in target.devices:
        if d.group not in members:
            groups.append(d.group)
            members[d.group] = []
        members[d.group].append(d.name)
    node_costs = [costs.nodes[n] for n in nodes]
    scaled = [_scaled(_inference_form(c) if mode == "inference" else c, scale) for c in node_costs]
    forward = np.array([[node_seconds(target.device(members[g][0]), c, dtype) for c in scaled] for g in groups], dtype=float).reshape(len(groups), len(nodes))
    backward = np.array(
        [[node_seconds(target.device(members[g][0]), c, dtype, backward=True) for c in scaled] for g in groups], dtype=float
    ).reshape(len(groups), len(nodes))
    # Weights whole at any micro-batch size: read in forward; read again and their gradient written in backward.
    corun_forward = np.array([[corun_seconds(target, members[g][0], c.param_bytes) for c in node_costs] for g in groups], dtype=float).reshape(
        len(groups), len(nodes))
    params = np.array([c.param_bytes for c in node_costs], dtype=float)
    trained = np.maximum(params - _frozen_bytes(graph, nodes), 0.0)
    weighted = np.array([float(p > 0 and graph.node(n).op_type not in FUSED_GRADIENT_OPS) for n, p in zip(nodes, params)])
    activations = np.array([c.activation_bytes * scale for c in node_costs], dtype=float)
    sources = _derived_sources(graph)
    names, producer, nbytes, consumers = _tensors(graph, nodes, scale, sources)
    bandwidth = np.full((len(groups), len(groups)), np.inf)
    latency = np.zeros((len(groups), len(groups)))
    for a, ga in enumerate(groups):
        for b, gb in enumerate(groups):
            try:
                link = target.link(members[ga][0], members[gb][0])
            except KeyError:
                continue
            bandwidth[a, b], latency[a, b] = link.bandwidth, link.latency
    firsts = [target.device(members[g][0]) for g in groups]
    sent, received = _reorders(costs, firsts, nodes, producer, nbytes, consumers, mode)
    drawn = set(draws_random(graph.model.graph))
    dequantized = tuple((t, source) for t, name in enumerate(names) if producer[t] >= 0 and (source := dequantized_source(graph, name)) is not None)
    received += _dequantized_readers(costs, firsts, nodes, dequantized, consumers, forward, scale, dtype)
    received += _derived_makers(costs, firsts, names, sources, scale, dtype, mode)
    return Problem(
        graph=graph,
        costs=costs,
        target=target,
        batch=batch,
        microbatches=microbatches,
        schedule=schedule,
        optimizer=optimizer,
        dtype=dtype,
        scale=scale,
        nodes=nodes,
        groups=tuple(groups),
        group_devices=tuple(tuple(members[g]) for g in groups),
        forward=forward,
        backward=backward if mode == "training" else np.zeros_like(backward),
        weight=backward * weighted / 2 if mode == "training" else np.zeros_like(backward),
        params=params,
        activations=activations,
        trained=trained,
        tensor_names=names,
        tensor_producer=producer,
        tensor_bytes=nbytes,
        tensor_consumers=consumers,
        sealed=_sealed(graph, len(nodes), names, producer, consumers, mode),
        crossing_sent=sent,
        crossing_received=received,
        dequantized=dequantized,
        bandwidth=bandwidth,
        latency=latency,
        capacity=np.array([d.memory_bytes for d in firsts], dtype=float),
        memory_bandwidth=np.array([d.memory_bandwidth for d in firsts], dtype=float),
        corun_forward=corun_forward,
        corun_backward=2 * corun_forward if mode == "training" else np.zeros_like(corun_forward),
        random=np.array([n in drawn for n in nodes], dtype=bool),
        mode=mode,
        max_latency=max_latency,
    )


def _sealed(graph: Graph, n: int, names: tuple[str, ...], producer: np.ndarray, consumers: tuple[np.ndarray, ...], mode: str) -> np.ndarray:
    """In training, the gaps a sequence is live across. A cut hands tensors forward and their gradients back, and
    a sequence has no gradient in onnxruntime-training: its SplitToSequence + SequenceAt trains only as the Split
    a stage file holding the whole pattern is rewritten to (`rewrites`)."""
    gaps = np.zeros(n + 1, dtype=np.int64)
    if mode == "training":
        sequences = graph.sequences
        for t, name in enumerate(names):
            if name in sequences and producer[t] >= 0:
                gaps[producer[t] + 1] += 1
                gaps[consumers[t][-1] + 1] -= 1
    return np.cumsum(gaps) > 0


def _frozen_bytes(graph: Graph, nodes: tuple[str, ...]) -> np.ndarray:
    """Per node, the bytes of the weights it holds (`cost.weight_owners`: each once, at its first reader) that
    training does not update; its parameter bytes less these are trained."""
    trained = set(graph.trained)
    owners = weight_owners(graph)
    return np.array([float(sum(graph.tensors[w].nbytes for w in owners.get(n, ()) if w not in trained and w in graph.tensors)) for n in nodes],
                    dtype=float)


def _ensure_options(graph: Graph, batch: int, microbatches: int, schedule: str, optimizer: str) -> None:
    schedules.virtual(schedule)  # any table: the planner admits those it plans (`schedule.ensure_plannable`)
    if optimizer not in PLANNED_OPTIMIZERS:
        raise OnnxpipeError(f"unknown optimizer '{optimizer}'; choose one of: {', '.join(PLANNED_OPTIMIZERS)}")
    if microbatches < 1 or batch < 1:
        raise OnnxpipeError(f"batch {batch} and micro-batches {microbatches} must be positive integers")
    if batch % microbatches:
        raise OnnxpipeError(f"batch {batch} does not split into {microbatches} micro-batches; pick a divisor of the batch for --microbatches")
    if not graph.compute_nodes:
        raise OnnxpipeError(f"{graph.source}: the model has no compute nodes (everything is constant); nothing to plan")


def _reorders(costs: Costs, devices: list[Device], nodes: tuple[str, ...], producer: np.ndarray, nbytes: np.ndarray, consumers: tuple[np.ndarray, ...],
              mode: str) -> tuple[np.ndarray, np.ndarray]:
    """(groups, tensors) reordering seconds of a sent and of a received tensor (`Problem.crossing_sent`,
    `crossing_received`); `devices`: each group's first device."""
    sent, received = np.zeros((len(devices), len(nbytes))), np.zeros((len(devices), len(nbytes)))
    rates = costs.reorder
    if mode != "inference" or rates is None:
        return sent, received
    blocked = np.array([costs.nodes[n].layout == NCHWC for n in nodes], dtype=bool)
    writes = np.array([p >= 0 and blocked[p] for p in producer], dtype=bool)
    reads = np.array([bool(blocked[c].any()) for c in consumers], dtype=bool)
    for g, device in enumerate(devices):
        if device.kind == "cpu":
            sent[g] = np.where(writes, rates.seconds(nbytes, sent=True), 0.0)
            received[g] = np.where(reads & (producer >= 0), rates.seconds(nbytes, sent=False), 0.0)
    return sent, received


def _dequantized_readers(costs: Costs, devices: list[Device], nodes: tuple[str, ...], dequantized: tuple[tuple[int, str], ...],
                         consumers: tuple[np.ndarray, ...], forward: np.ndarray, scale: float, dtype: str) -> np.ndarray:
    """(groups, tensors) seconds the int8 readers of a received dequantized tensor take more as float kernels (`forward`:
    the problem's node times; `devices`: each group's first device)."""
    extra = np.zeros((len(devices), len(consumers)))
    for t, _ in dequantized:
        for c in consumers[t]:
            cost = costs.nodes[nodes[c]]
            if cost.dtype:
                floated = _scaled(dataclasses.replace(cost, dtype="", measured_inference_seconds=None), scale)
                extra[:, t] += [max(0.0, node_seconds(d, floated, dtype) - forward[g, c]) for g, d in enumerate(devices)]
    return extra


#: Per derived tensor, the derived nodes that make it and the model inputs they read.
_Sources = dict[str, tuple[frozenset[str], frozenset[str]]]


def _derived_sources(graph: Graph) -> _Sources:
    """Computed once per problem: the tensor table (bytes) and the crossing seconds both read it."""
    sources: _Sources = {}
    inputs = set(graph.inputs)
    for name in graph.order:  # topological: a derived node's derived inputs have their sources already
        if name in graph.derived_nodes:
            reads = graph.node_inputs(name)
            makers = frozenset({name}).union(*(sources[t][0] for t in reads if t in sources))
            fed = frozenset(t for t in reads if t in inputs).union(*(sources[t][1] for t in reads if t in sources))
            sources.update((o, (makers, fed)) for o in graph.node(name).output if o)
    return sources


def _derived_makers(costs: Costs, devices: list[Device], names: tuple[str, ...], sources: _Sources, scale: float, dtype: str, mode: str) -> np.ndarray:
    """(groups, tensors) forward seconds of the derived nodes that make each derived tensor, which every stage reading it
    runs (`devices`: each group's first device)."""
    made = np.zeros((len(devices), len(names)))
    for t, name in enumerate(names):
        for node in sources[name][0] if name in sources else ():
            cost = _scaled(_inference_form(costs.nodes[node]) if mode == "inference" else costs.nodes[node], scale)
            made[:, t] += [node_seconds(d, cost, dtype) for d in devices]
    return made


def _inference_form(cost: NodeCost) -> NodeCost:
    """The node as an inference stage runs it: its measured time in an optimized session where profiled."""
    if cost.measured_inference_seconds is None:
        return cost
    return dataclasses.replace(cost, measured_seconds=cost.measured_inference_seconds)


def _scaled(cost, scale: float):  # type: ignore[no-untyped-def]
    if scale == 1.0:
        return cost
    measured = None if cost.measured_seconds is None else cost.measured_seconds * scale
    measured_b = None if cost.measured_backward_seconds is None else cost.measured_backward_seconds * scale
    return dataclasses.replace(
        cost,
        flops=cost.flops * scale,
        bytes_read=cost.bytes_read * scale,
        bytes_written=cost.bytes_written * scale,
        activation_bytes=cost.activation_bytes * scale,
        backward_flops=cost.backward_flops * scale,
        backward_bytes=cost.backward_bytes * scale,
        measured_seconds=measured,
        measured_backward_seconds=measured_b,
    )


def _tensors(graph: Graph, nodes: tuple[str, ...], scale: float, sources: _Sources) -> tuple[tuple[str, ...], np.ndarray, np.ndarray, tuple[np.ndarray, ...]]:
    position = {n: i for i, n in enumerate(nodes)}
    readers: dict[str, set[int]] = {}
    producer: dict[str, int] = {}
    for src, dst, key in graph.dag.edges(keys=True):
        if src in position and dst in position:
            producer[key] = position[src]
            readers.setdefault(key, set()).add(position[dst])
    for name in (*graph.inputs, *sorted(graph.derived)):  # a derived tensor has no producer stage: each reader makes it
        found = {position[c] for c in graph.consumers(name) if c in position}
        if found:
            producer[name] = -1
            readers[name] = found
    names = tuple(readers)
    fed = {t: sum(graph.tensors[i].nbytes for i in inputs) for t, (_, inputs) in sources.items()}
    return (
        names,
        np.array([producer[t] for t in names], dtype=np.int64),
        np.array([fed.get(t, graph.tensors[t].nbytes) * scale for t in names], dtype=float),
        tuple(np.array(sorted(readers[t]), dtype=np.int64) for t in names),
    )
