"""Measured node times: the model (and its gradient graph) profiled in onnxruntime with the execution provider
of the device the stage will run on (one thread on the CPU; `execution_provider` picks it per device kind).

Reading order: `execution_provider`, `ensure_provider` -> `Profile` -> `profile_times` -> `_feeds` -> `_profile` (session + JSON trace)
-> `trace_medians` (median per node) -> `kernel_fusion` (the optimized run's kernels on the model's nodes) -> `fused_shares`, `nchwc_nodes`
-> `_training_model` (loss + GradientGraphBuilder) -> `backward_by_forward`.

Graph optimizations are off so trace events keep the model's own node names; onnxruntime 1.19
names gradient nodes `<forward node>_Grad/<op>_<i>`, which maps them back to forward nodes. Forward
times come from the gradient graph's run where it has the node (training's form of the node).
Inference stage workers run optimized sessions, which fuse nodes (a convolution with its activation
and a residual Add, Q/DQ pairs into an int8 kernel) and pick other kernels (NCHWc convolutions):
a third run, optimized, gives the inference times (`fused_shares`), the nodes it computed in the blocked NCHWc
layout (`nchwc_nodes`) and, from a probe profiled the same way, the host's rates for reordering a cut tensor
into and out of that layout (`cost_layout`).
Trace durations are whole microseconds: a kernel faster than that counts as half a microsecond. A run's
time outside its kernels (the session's per-node work) is shared out over its kernels (`trace_medians`).
"""

from __future__ import annotations

import json
import os
import statistics
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.cost_formulas import op_class
from onnxpipe.cost_layout import ReorderRates, probe_model, probe_shape, reorder_rates
from onnxpipe.cost_trace import is_run, kernels, run_starts
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.nodes import is_float_dtype
from onnxpipe.ortutil import (
    CPU_PROVIDER, MAX_IR_VERSION, REWRITTEN_OPS, REWRITTEN_SUFFIXES, available_providers, gradient_model, lift_initializers, pretraining_rewrite,
    ort_reason, quiet_stderr,
)
from onnxpipe.ortutil import session as ort_session
from onnxpipe.protostream import load_weights
from onnxpipe.lowerings import REWRITE_MARK
from onnxpipe.rewrites import for_gradient_builder
from onnxpipe.units import format_bytes

__all__ = [
    "Profile", "profile_times", "ensure_fits_in_memory", "execution_provider", "ensure_provider", "trace_medians", "kernel_ops", "Fusion",
    "kernel_fusion", "fused_shares", "nchwc_nodes", "NCHWC_SUFFIX", "own_names", "backward_by_forward",
]

#: Each device kind's own execution provider.
_KIND_PROVIDERS = {"gpu": "CUDAExecutionProvider", "cpu": CPU_PROVIDER}

_RESOLUTION_FLOOR = 0.5e-6
_GRAD_MARK = "_Grad/"
_LOSS = "onnxpipe.profile_loss"
_TWO_GB = 2**31
#: What onnxruntime appends to the name of a kernel it computes in the blocked NCHWc layout.
NCHWC_SUFFIX = "_nchwc"


def execution_provider(kind: str, named: str = "") -> str:
    """The onnxruntime execution provider that measures a device of `kind`: the one its target entry names,
    else the kind's own (CUDA for gpu, CPU for cpu); other kinds must name one."""
    if named:
        return named
    if kind not in _KIND_PROVIDERS:
        raise OnnxpipeError(f"{kind} devices have no onnxruntime execution provider of their own; name one in the target's "
                            f'[[devices]] entry (provider = "VitisAIExecutionProvider", say), or plan without --profile')
    return _KIND_PROVIDERS[kind]


class _NotStarted(Exception):
    """The session fell back from the provider asked for to the CPU."""


def ensure_provider(provider: str) -> None:
    """Fail in one line when this onnxruntime lacks `provider`."""
    have = available_providers()
    if provider not in have:
        raise OnnxpipeError(f"this onnxruntime has no {provider} (it has {', '.join(have)}); install an onnxruntime-training "
                            f"build with {provider} on the machine that has the device and profile there, or import times "
                            f"measured there with `onnxpipe annotate --times FILE`")


@dataclass(frozen=True)
class Profile:
    """What profiling measured, per compute node (seconds) unless said otherwise."""

    #: Forward medians (training's form of each node where the gradient graph ran it).
    forward: dict[str, float]
    #: Backward medians per forward node that has gradient nodes (empty when no gradient graph can be built).
    backward: dict[str, float]
    #: Forward medians in an optimized session, as inference runs them (`fused_shares`; empty when onnxruntime
    #: cannot optimize the model).
    inference: dict[str, float]
    #: Nodes the optimized session computed in the blocked NCHWc layout (`nchwc_nodes`).
    nchwc: frozenset[str] = frozenset()
    #: The host's rates for reordering a tensor into and out of that layout, when it has nodes in it (CPU only).
    reorder: ReorderRates | None = None


def profile_times(graph: Graph, *, runs: int = 5, warmup: int = 2, provider: str = CPU_PROVIDER) -> Profile:
    """The model's node times (and the optimized run's layout facts) measured with `provider`."""
    if runs < 1 or warmup < 0:
        raise OnnxpipeError(f"profile runs={runs}, warmup={warmup}: need runs >= 1 and warmup >= 0")
    ensure_provider(provider)
    ensure_fits_in_memory(graph, _available_bytes())
    model = onnx.ModelProto()
    model.CopyFrom(graph.model)
    load_weights(model, graph.weights_dir or ".")  # profiling runs the model: it needs every weight
    model.ir_version = min(model.ir_version, MAX_IR_VERSION)
    feeds = _feeds(graph)
    compute = set(graph.compute_nodes)
    with tempfile.TemporaryDirectory(prefix="onnxpipe-profile-") as tmp:
        forward = trace_medians(_profile(model, feeds, tmp, "forward", runs, warmup, provider), warmup)
        optimized = _profile(model, feeds, tmp, "inference", runs, warmup, provider, optimize=True)
        fusion = kernel_fusion(graph, trace_medians(optimized, warmup), kernel_ops(optimized)) if optimized else None
        inference = fused_shares(graph, forward, fusion) if fusion else {}
        blocked = nchwc_nodes(fusion) & compute if fusion else frozenset()
        shape = probe_shape(graph, blocked) if provider == CPU_PROVIDER else None
        probe = _profile(probe_model(shape), {"x": np.ones(shape, np.float32)}, tmp, "probe", runs, warmup, provider, optimize=True) if shape else []
        reorder = reorder_rates(probe, warmup, 4 * int(np.prod(shape))) if probe else None
        training = _training_model(graph, model)
        events = _profile(training[0], {**feeds, **training[1]}, tmp, "backward", runs, warmup, provider) if training else []
        trained = own_names(trace_medians(events, warmup), forward) if events else {}
    backward = backward_by_forward(trained)
    # Training runs a node's forward in its training form (MaxPool also returning the indices its
    # gradient needs, several times slower): where the gradient graph ran it, that is its forward time.
    forward.update({n: t for n, t in trained.items() if n in forward})
    return Profile({n: t for n, t in forward.items() if n in compute}, {n: t for n, t in backward.items() if n in compute},
                   {n: t for n, t in inference.items() if n in compute}, blocked if reorder else frozenset(), reorder)


def ensure_fits_in_memory(graph: Graph, available: int) -> None:
    """Fail in one line, before anything is allocated, when a profile run would need more than `available`
    bytes: its inputs, every weight and every activation at the inferred shapes (the gradient graph's run
    holds all activations at once). The dim named is the largest bound symbolic dim, else the largest input dim."""
    tensors = graph.tensors
    inputs = sum(tensors[n].nbytes for n in graph.inputs)
    weights = sum(tensors[n].nbytes for n in graph.initializers)
    activations = sum(tensors[o].nbytes for n in graph.compute_nodes for o in graph.node(n).output if o in tensors)
    needed = inputs + weights + activations
    if needed <= available:
        return
    if graph.dims:
        name, value = max(graph.dims.items(), key=lambda kv: kv[1])
        culprit, way_out = f"dim '{name}' = {value}", f"bind a smaller one with --dim {name}=N or a smaller --batch"
    else:
        name, axis, value = max(((i, a, d) for i in graph.inputs for a, d in enumerate(tensors[i].shape)), key=lambda t: t[2], default=("", 0, 0))
        culprit, way_out = f"input '{name}' dim {axis} = {value}", "re-export with a smaller batch"
    raise OnnxpipeError(f"profiling {graph.source} on this machine needs {format_bytes(needed)} (inputs {format_bytes(inputs)}, weights "
                        f"{format_bytes(weights)}, activations {format_bytes(activations)}) but {format_bytes(available)} are available: "
                        f"{culprit} sets most of it; {way_out}, or plan without profiling (plan --no-profile, or a target with profile = false)")


def _available_bytes() -> int:
    """Memory this process can take without swapping: MemAvailable on Linux, free physical pages elsewhere."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _feeds(graph: Graph) -> dict[str, np.ndarray]:
    """Random normal floats; zeros for everything else (always a valid index, length or flag)."""
    rng = np.random.default_rng(0)
    feeds = {}
    for name in graph.inputs:
        info = graph.tensors[name]
        dtype = np.dtype(info.dtype)
        if is_float_dtype(dtype):
            feeds[name] = rng.standard_normal(info.shape, dtype=np.float32).astype(dtype, copy=False)
        else:
            feeds[name] = np.zeros(info.shape, dtype=dtype)
    return feeds


def _profile(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], tmp: str, tag: str, runs: int, warmup: int, provider: str,
             optimize: bool = False) -> list[dict]:
    """The trace events of `warmup + runs` runs (`optimize`: with onnxruntime's graph optimizations, as stage
    workers run); empty when onnxruntime fails on a gradient graph or an optimized session (those are optional)."""
    path = os.path.join(tmp, f"{tag}.onnx")
    if model.ByteSize() >= _TWO_GB:
        onnx.save_model(model, path, save_as_external_data=True, location=f"{tag}.onnx.data")
    else:
        onnx.save_model(model, path)
    try:
        threads = 1 if provider == CPU_PROVIDER else 0
        with quiet_stderr():  # a provider whose libraries fail to load logs at error level, then falls back to the CPU
            session = ort_session(path, provider, threads=threads, optimize=optimize, profile_prefix=os.path.join(tmp, tag))
        if provider not in session.get_providers():
            raise _NotStarted(provider)
        wanted = {i.name for i in session.get_inputs()}
        feed = {k: v for k, v in feeds.items() if k in wanted}
        for _ in range(warmup + runs):
            session.run(None, feed)
        trace = session.end_profiling()
    except _NotStarted:
        raise OnnxpipeError(f"onnxruntime could not start {provider} here (its libraries or the device are missing); run --profile on the "
                            f"machine that has the device, or import times measured there with `onnxpipe annotate --times FILE`") from None
    except Exception as exc:  # onnxruntime raises its own exception types for unsupported models
        if tag in ("backward", "inference", "probe"):
            return []
        raise OnnxpipeError(f"profiling failed in onnxruntime ({ort_reason(exc)}); price the model without measuring it: `plan "
                            "--no-profile`, `annotate` without --profile") from exc
    with open(trace) as f:
        return json.load(f)


def trace_medians(events: list[dict], warmup: int) -> dict[str, float]:
    """Each node's kernel time plus its share of the run's time outside kernels: the session spends
    3-5 us per node between kernels (measured here: 4% of a small decoder's run), far more than a
    kernel launch, and the executor's runs pay it too; it is split evenly over the run's kernels."""
    runs = sorted((e["ts"], e["dur"]) for e in events if is_run(e))
    ran = kernels(events, [ts for ts, _ in runs])
    kernel_sum, kernel_count = [0.0] * len(runs), [0] * len(runs)
    for k in ran:
        kernel_sum[k.run] += k.micros
        kernel_count[k.run] += 1
    gap = [max(0.0, d - k) / c if c else 0.0 for (_, d), k, c in zip(runs, kernel_sum, kernel_count)]
    per_run: dict[str, dict[int, float]] = {}
    for k in ran:
        if k.run < warmup:
            continue
        times = per_run.setdefault(k.name, {})
        times[k.run] = times.get(k.run, 0.0) + (k.micros + gap[k.run]) * 1e-6
    measured = len(runs) - warmup
    return {
        node: max(_RESOLUTION_FLOOR, statistics.median(list(times.values()) + [0.0] * (measured - len(times))))
        for node, times in per_run.items()
    }


def kernel_ops(events: list[dict]) -> dict[str, str]:
    """Each kernel's op type in a trace (`op_name`: an optimized session's fused kernel says what it became)."""
    return {k.name: k.op for k in kernels(events, run_starts(events))}


@dataclass(frozen=True)
class Fusion:
    """An optimized run's kernels put on the model's nodes (`kernel_fusion`): read for the nodes' times
    (`fused_shares`) and for their layout (`nchwc_nodes`)."""

    #: Node -> seconds of the kernels named after it; the seconds of kernels named after no node.
    anchored: dict[str, float]
    stray: float
    #: Node that changed or was fused away -> the node whose kernels it ran in; those kernels' names.
    group: dict[str, str]
    kernels: dict[str, set[str]]


def kernel_fusion(graph: Graph, kernels: Mapping[str, float], ops: Mapping[str, str]) -> Fusion:
    """Which nodes an optimized run's kernels (`kernels`: their times, `ops`: their op types) computed.

    onnxruntime names a fused kernel after one node it replaced or that node's output, now and then with
    a suffix (`<node>/duplicated`, `<output>_nchwc`): the longest node or output name the kernel name
    starts with, whole or before a `_` or `/`, is the kernel's node. A node without a kernel of its own
    was fused away: into the kernel of a neighbour that changed (renamed, or another op: `Relu` -> a `Conv` with an activation,
    `Add` -> `QLinearAdd`) where the tensor between them has no other reader, as fusions require (a
    producer's kernel first, then a reader's; a matmul or convolution only into a kernel whose op names
    its op, `Conv` into `QLinearConv`), else into a kernel named after none of the model's nodes
    (`SkipLayerNormalization`, `QLinearConv`)."""
    compute = graph.compute_nodes
    names = {o: n for n in graph.order for o in graph.node(n).output if o} | {n: n for n in graph.order}
    anchored: dict[str, float] = {}
    stray = 0.0
    kinds: dict[str, set[str]] = {}
    named: dict[str, set[str]] = {}
    changed: set[str] = set()
    for kernel, seconds in kernels.items():
        node = _kernel_node(kernel, names)
        if node is None:
            stray += seconds
            continue
        anchored[node] = anchored.get(node, 0.0) + seconds
        kinds.setdefault(node, set()).add(ops.get(kernel, "") or graph.node(node).op_type)
        named.setdefault(node, set()).add(kernel)
        if kernel != node or kinds[node] != {graph.node(node).op_type}:
            changed.add(node)
    group = {n: n for n in compute if n in changed}

    def joins(node: str, other: str | None) -> bool:
        return other in group and (op_class(graph.node(node).op_type) not in ("matmul", "conv")
                                   or any(graph.node(node).op_type in kind for kind in kinds[group[other]]))

    for n in compute:  # into a producer's kernel
        if n not in anchored:
            fused = next((p for p in map(graph.producer, graph.node_inputs(n)) if joins(n, p) and _only_reader(graph, p) == n), None)
            if fused is not None:
                group[n] = group[fused]
    for n in reversed(compute):  # into a reader's kernel
        reader = _only_reader(graph, n)
        if n not in anchored and n not in group and joins(n, reader):
            group[n] = group[reader]
    return Fusion(anchored, stray, group, named)


def fused_shares(graph: Graph, unfused: Mapping[str, float], fusion: Fusion) -> dict[str, float]:
    """Seconds per compute node of an optimized run (`fusion`: its kernels on the nodes), from the unoptimized
    run's times of the same nodes (`unfused`): a kernel's time is shared over its nodes, the time of the
    kernels named after no node over the nodes left, each in proportion to its unoptimized time."""
    compute = graph.compute_nodes
    computed = set(compute)
    members: dict[str, list[str]] = {}
    for n, owner in fusion.group.items():
        members.setdefault(owner, []).append(n)
    out: dict[str, float] = {}
    for node, seconds in fusion.anchored.items():
        if node in computed:
            out.update(_shared(members.get(node, [node]), seconds, unfused))
    left = [n for n in compute if n not in fusion.anchored and n not in fusion.group]
    for node, seconds in _shared(left, fusion.stray, unfused).items() if left else _shared(list(out), fusion.stray, out).items():
        out[node] = out.get(node, 0.0) + seconds
    return {n: max(_RESOLUTION_FLOOR, out.get(n, 0.0)) for n in compute}


def nchwc_nodes(fusion: Fusion) -> frozenset[str]:
    """The nodes an optimized run computed in onnxruntime's blocked NCHWc layout: those whose kernel, their own
    or the one they were fused into, carries the `_nchwc` suffix. A stage file ends or starts such a run of
    nodes at its cut tensors, which onnxruntime reorders from and to the plain layout there (`cost_layout`)."""
    return frozenset(n for n, owner in fusion.group.items() if any(NCHWC_SUFFIX in k for k in fusion.kernels[owner]))


def _kernel_node(kernel: str, names: Mapping[str, str]) -> str | None:
    """The node of the longest name in `names` (node and output names -> node) that `kernel` is, or starts
    with before a `_` or `/`; None for a kernel of its own."""
    cuts = [len(kernel)] + [i for i in range(len(kernel) - 1, 0, -1) if kernel[i] in "_/"]
    return next((names[kernel[:i]] for i in cuts if kernel[:i] in names), None)


def _only_reader(graph: Graph, node: str) -> str | None:
    """The one node reading all of `node`'s outputs, None when several nodes or the model's outputs read them."""
    outs = [o for o in graph.node(node).output if o]
    readers = {r for o in outs for r in graph.consumers(o)}
    return next(iter(readers)) if len(readers) == 1 and not any(o in graph.outputs for o in outs) else None


def _shared(nodes: list[str], seconds: float, weights: Mapping[str, float]) -> dict[str, float]:
    """`seconds` shared over `nodes` in proportion to their `weights` (evenly when they have none)."""
    total = sum(weights.get(n, 0.0) for n in nodes)
    return {n: seconds * (weights.get(n, 0.0) / total if total > 0 else 1 / len(nodes)) for n in nodes}


def _training_model(graph: Graph, model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, np.ndarray]] | None:
    """The model plus a scalar loss and its gradient graph, and the weights it takes as inputs (fed when it runs);
    None when onnxruntime cannot build one."""
    floats = [o for o in graph.outputs if is_float_dtype(graph.tensors[o].dtype)]
    # The gradients training makes: of every trained weight, those read only through a constant chain included (a
    # dynamo LSTM reorders its gates with Slices of its weights: left out, its LSTMGrad lacked those gradients and
    # onnxruntime crashed running it); never of a model input (the trainer asks none; a first layer makes its
    # weight gradient alone, as `cost._gradient_tensors` prices it).
    wanted = {t.name for t in model.graph.initializer} & set(graph.trained)
    if not floats or not wanted or model.ByteSize() >= _TWO_GB:
        return None
    lossy = for_gradient_builder(model)  # a copy, prepared as training prepares it
    first = graph.tensors[floats[0]]
    if first.shape in ((), (1,)) and first.dtype == "float32" and floats[0] == graph.outputs[0]:
        loss = floats[0]
    else:
        loss = _append_sum_loss(lossy.graph, floats)
    fed: dict[str, np.ndarray] = {}
    try:
        if any(n.op_type in REWRITTEN_OPS for n in lossy.graph.node):
            # as the trainer builds it: the weights lifted to graph inputs, so that onnxruntime's rewrites cannot fold or
            # merge them (BatchNormalization's zero biases, a dynamo LSTM's gate-reordered weights), fed when it runs
            fed = {name: numpy_helper.to_array(t) for name, t in lift_initializers(lossy.graph, sorted(wanted)).items()}
            lossy = onnx.load_from_string(pretraining_rewrite(lossy.SerializeToString(), wanted))
        return gradient_model(lossy.SerializeToString(), loss, wanted), fed
    except Exception:  # ops without gradients: fall back to the FLOP ratio
        return None


def _append_sum_loss(g: onnx.GraphProto, outputs: list[str]) -> str:
    """loss = sum over the float outputs of the sum of their elements, as float32."""
    parts = []
    for i, name in enumerate(outputs):
        summed, cast = f"{_LOSS}.sum{i}", f"{_LOSS}.part{i}"
        g.node.append(helper.make_node("ReduceSum", [name], [summed], name=summed, keepdims=0))
        g.node.append(helper.make_node("Cast", [summed], [cast], name=cast, to=TensorProto.FLOAT))
        parts.append(cast)
    total = parts[0]
    for i, part in enumerate(parts[1:]):
        nxt = f"{_LOSS}.add{i}"
        g.node.append(helper.make_node("Add", [total, part], [nxt], name=nxt))
        total = nxt
    g.output.append(helper.make_tensor_value_info(total, TensorProto.FLOAT, []))
    return total


def own_names(times: Mapping[str, float], forward: Mapping[str, float]) -> dict[str, float]:
    """Times under the model's node names: a node onnxruntime rewrote (`<name>_training`, with gradient nodes
    `<name>_training_Grad/...`, and likewise for the other `REWRITTEN_SUFFIXES`) back under `<name>`, and so are the
    nodes `onnxpipe.rewrites` wrote in its place (`<name>/onnxpipe_<rewrite>/...`, a GRU's unrolled steps say)."""
    out: dict[str, float] = {}
    for node, seconds in times.items():
        head, mark, rest = node.partition(_GRAD_MARK)
        for suffix in REWRITTEN_SUFFIXES:
            if head.endswith(suffix) and head.removesuffix(suffix) in forward:
                node = head.removesuffix(suffix) + mark + rest
        base = head.split(REWRITE_MARK)[0]
        if base != head and base in forward:
            node = base + mark + rest
        out[node] = out.get(node, 0.0) + seconds
    return out


def backward_by_forward(times: Mapping[str, float]) -> dict[str, float]:
    """Gradient node times summed per forward node (`<fwd>_Grad/...`)."""
    backward: dict[str, float] = {}
    for node, seconds in times.items():
        head, mark, _ = node.partition(_GRAD_MARK)
        if mark:
            backward[head] = backward.get(head, 0.0) + seconds
    return backward
