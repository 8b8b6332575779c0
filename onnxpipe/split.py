"""Plan -> stage directory: one standalone ONNX model per stage plus the manifest that chains them.

Reading order: `split` (public entry) -> `_ensure_plan_fits` -> `_layout` (which tensors cross
which cut) -> `_stage_model` (build one stage's ModelProto from its nodes and initializers only)
-> `_write_stage` -> `_publish` (temp dir renamed into place); `cut_stages` turns hand-given cut
tensors into node groups; `annotate_stages` writes the model with each node tagged by its stage.

Memory: the whole model is never copied; each stage's nodes and small initializers are copied into a
fresh ModelProto, its large initializers' bytes are streamed from the source model to the file
(`protostream.write_model`), and the file is checked from disk before the next stage is built.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import onnx
from onnx import helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import atomic_path, fresh_dir_beside, swap_in
from onnxpipe.graph import Graph
from onnxpipe.manifest import Manifest, SharedInitializer, Stage, StageInput, StageOutput
from onnxpipe.ortutil import MAX_IR_VERSION
from onnxpipe.protostream import inline_external_data, is_external, is_streamable, raw_nbytes, skeleton, write_model
from onnxpipe.units import plural

if TYPE_CHECKING:  # the planner package pulls in the solver; splitting a given plan does not need it
    from onnxpipe.cost import Costs
    from onnxpipe.plan.deadline import Deadline
    from onnxpipe.plan.result import Plan
    from onnxpipe.pricing.problem import Problem
    from onnxpipe.target import Target

__all__ = ["split", "cut_stages", "plan_cuts", "annotate_stages", "STAGE_METADATA_KEY", "RECOMPUTE_POLICIES"]

#: Activation policies for hand-given cuts: "auto" recomputes only in stages that would not fit otherwise.
RECOMPUTE_POLICIES = ("auto", "never", "always")

#: Node metadata key holding the stage index in annotated models.
STAGE_METADATA_KEY = "onnxpipe.stage"
#: Protobuf refuses files over 2 GiB; models above this write each stage's weights to a side file.
_EXTERNAL_DATA_BYTES = 2**31 - 2**26
#: Initializers above this are streamed from the source model to the stage file instead of copied.
_STREAM_BYTES = 1 << 16


@dataclass(frozen=True)
class _StageLayout:
    """What one stage holds and exchanges, before any proto is built."""

    nodes: tuple[str, ...]
    #: Constant-chain and derived nodes (`Graph.derived_nodes`) copied in, in topological order.
    copied_nodes: tuple[str, ...]
    initializers: tuple[str, ...]
    #: (tensor, source): source is "model" or the producing stage.
    inputs: tuple[tuple[str, str | int], ...]
    #: (tensor, consumers).
    outputs: tuple[tuple[str, tuple[str | int, ...]], ...]


def split(graph: Graph, plan: Plan, out_dir: str | os.PathLike, *, force: bool = False,
          annotated_path: str | os.PathLike | None = None) -> Manifest:
    """Write `out_dir/stage_<i>.onnx`, `manifest.json` and `plan.json`; all or nothing."""
    assignment = _ensure_plan_fits(graph, plan)
    layouts = _layout(graph, plan, assignment)
    target = Path(out_dir)
    _ensure_destination(target, force)
    external = sum(graph.tensors[name].nbytes for name in graph.initializers) > _EXTERNAL_DATA_BYTES
    originals = _originals(graph)
    tmp: Path | None = None
    try:
        tmp = _temp_dir(target)
        stages = tuple(
            _write_stage(graph, plan, i, layout, originals, tmp, external) for i, layout in enumerate(layouts)
        )
        manifest = _manifest(graph, plan, stages, layouts)
        manifest.write(tmp)
        dataclasses.replace(plan, model=graph.source).save(tmp / "plan.json")  # the model split, whichever copy the plan was made on
        if annotated_path is not None:  # before publishing: a failure here leaves no stage directory behind
            annotate_stages(graph, plan, annotated_path)
        _publish(tmp, target, force)
    except BaseException:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    return manifest


def _ensure_plan_fits(graph: Graph, plan: Plan) -> dict[str, int]:
    if plan.fingerprint != graph.fingerprint:
        raise OnnxpipeError(f"the plan was made for another model (fingerprint {plan.fingerprint}, this model's is {graph.fingerprint}); re-plan this model")
    if graph.inputs and plan.batch != graph.batch * plan.microbatches:
        raise OnnxpipeError(
            f"the plan is for batch {plan.batch} in {plural(plan.microbatches, 'micro-batch')} of {plan.batch / plan.microbatches:g}, but the stage files "
            f"would hold the model's batch {graph.batch}: pass --batch {graph.batch * plan.microbatches}, or give a symbolic batch dim its "
            "value through --batch and --microbatches")
    compute = set(graph.compute_nodes)
    assignment: dict[str, int] = {}
    for stage in plan.stages:
        if not stage.nodes:
            raise OnnxpipeError(f"plan stage {stage.index} has no nodes; re-plan with fewer stages")
        for name in stage.nodes:
            if name not in compute:
                raise OnnxpipeError(f"plan stage {stage.index} lists node '{name}', which is not a compute node of this model; re-plan this model")
            if name in assignment:
                raise OnnxpipeError(f"plan places node '{name}' in stages {assignment[name]} and {stage.index}; re-plan this model")
            assignment[name] = stage.index
    left_out = [n for n in graph.compute_nodes if n not in assignment]
    if left_out:
        raise OnnxpipeError(f"plan leaves {plural(len(left_out), 'node')} out (first: '{left_out[0]}'); re-plan this model")
    if [s.index for s in plan.stages] != list(range(len(plan.stages))):
        raise OnnxpipeError("plan stages are not numbered 0..k-1 in order; regenerate the plan")
    for name in graph.compute_nodes:
        for tensor in graph.node_inputs(name):
            producer = graph.producer(tensor)
            if producer in assignment and assignment[producer] > assignment[name]:
                raise OnnxpipeError(
                    f"node '{name}' (stage {assignment[name]}) reads '{tensor}' from a later stage ({assignment[producer]}); "
                    "stages must follow the data flow, re-plan"
                )
    return assignment


def _layout(graph: Graph, plan: Plan, assignment: dict[str, int]) -> list[_StageLayout]:
    """Per stage: nodes, copied constant chains and initializers, and the tensors crossing each cut."""
    k = len(plan.stages)
    order_index = {name: i for i, name in enumerate(graph.order)}
    model_outputs = set(graph.outputs)
    consumers: dict[str, set[str | int]] = {}
    reads: list[dict[str, None]] = [{} for _ in range(k)]  # ordered sets
    for name in graph.compute_nodes:
        reads[assignment[name]].update(dict.fromkeys(graph.node_inputs(name)))
    # Outputs that are constants or derived have no compute producer: the last stage computes them.
    copied_outputs = [o for o in graph.outputs if o in graph.constants or o in graph.derived]
    reads[k - 1].update(dict.fromkeys(copied_outputs))

    closure: dict[str, _Closure] = {}
    layouts = []
    for s in range(k):
        copied: set[str] = set()
        inits: set[str] = set()
        inputs: list[tuple[str, str | int]] = []
        for tensor in reads[s]:
            producer = graph.producer(tensor)
            if tensor in graph.constants or tensor in graph.derived:
                nodes, weights, read = _copied_closure(graph, tensor, closure)
                copied |= nodes
                inits |= weights
                inputs += [(name, "model") for name in graph.inputs if name in read and (name, "model") not in inputs]
            elif producer is None:
                if (tensor, "model") not in inputs:
                    inputs.append((tensor, "model"))
            elif assignment[producer] != s:
                inputs.append((tensor, assignment[producer]))
                consumers.setdefault(tensor, set()).add(s)
        layouts.append((s, copied, inits, inputs))

    result = []
    for s, copied, inits, inputs in layouts:
        nodes = tuple(n for n in graph.compute_nodes if assignment[n] == s)
        produced = [o for n in nodes for o in graph.node(n).output if o]
        if s == k - 1:
            produced += [o for o in copied_outputs if o not in produced]
        outputs = []
        for tensor in produced:
            users: list[str | int] = sorted(consumers.get(tensor, ()))  # type: ignore[arg-type]
            if tensor in model_outputs:
                users.append("model")
            if users:
                outputs.append((tensor, tuple(users)))
        if not outputs and produced:
            outputs.append((produced[-1], ()))  # a stage must output something, even a dead end
        result.append(_StageLayout(
            nodes=nodes,
            copied_nodes=tuple(sorted(copied, key=order_index.__getitem__)),
            initializers=tuple(sorted(inits)),
            inputs=tuple(inputs),
            outputs=tuple(outputs),
        ))
    return result


#: The nodes, initializers and model inputs a stage needs to compute a tensor without its producer's stage.
_Closure = tuple[set[str], set[str], set[str]]


def _copied_closure(graph: Graph, tensor: str, memo: dict[str, _Closure]) -> _Closure:
    """The constant-chain and derived nodes, initializers and model inputs needed to compute a constant or derived tensor."""
    if tensor in memo:
        return memo[tensor]
    producer = graph.producer(tensor)
    if producer is None:
        found: _Closure = (set(), {tensor} if tensor in graph.initializers else set(), set() if tensor in graph.initializers else {tensor})
    else:
        nodes, inits, read = {producer}, set(), set()
        for t in graph.node_inputs(producer):
            more = _copied_closure(graph, t, memo)
            nodes |= more[0]
            inits |= more[1]
            read |= more[2]
        found = (nodes, inits, read)
    for out in graph.node(producer).output if producer else (tensor,):
        if out:
            memo[out] = found
    return found


#: What `split` writes into a stage directory: the only names `--force` may replace.
_STAGE_DIRECTORY_FILE = re.compile(r"^(manifest\.json|plan\.json|stage_\d+\.onnx(\.data)?)$")


def _ensure_destination(target: Path, force: bool) -> None:
    """The output directory is new, empty, or (with force) a stage directory onnxpipe wrote: --force
    never deletes a model or any file of the user's."""
    if target.exists() and not target.is_dir():
        raise OnnxpipeError(f"{target}: exists and is not a directory; choose another -o")
    if not target.is_dir() or not any(target.iterdir()):
        return
    if not force:
        raise OnnxpipeError(f"{target}: exists and is not empty; pass --force to replace it or choose another -o")
    foreign = sorted(p.name for p in target.iterdir() if not _STAGE_DIRECTORY_FILE.match(p.name) or not p.is_file() or p.is_symlink())
    if foreign or not (target / "manifest.json").is_file():
        what = f"holds {foreign[0]!r}, which onnxpipe did not write" if foreign else "has no manifest.json"
        raise OnnxpipeError(f"{target}: {what}; --force replaces only a stage directory written by `onnxpipe split`, choose another -o")
    try:
        Manifest.from_json(json.loads((target / "manifest.json").read_text()), str(target / "manifest.json"))
    except (OnnxpipeError, ValueError, UnicodeDecodeError, AttributeError):
        raise OnnxpipeError(f"{target}: its manifest.json is not an onnxpipe manifest; --force replaces only a stage directory "
                            "written by `onnxpipe split`, choose another -o") from None


def _temp_dir(target: Path) -> Path:
    """A fresh directory beside the destination, so the final rename stays on one file system."""
    try:
        return fresh_dir_beside(target)
    except OSError as exc:
        raise OnnxpipeError(f"{target.absolute().parent}: cannot write there ({exc.strerror}); choose a writable -o") from exc


def _publish(tmp: Path, target: Path, force: bool) -> None:
    """Rename the finished directory into place (an old one only with force, checked again: it may
    have changed while the stages were written)."""
    _ensure_destination(target, force)
    swap_in(tmp, target)


def _value_info(graph: Graph, name: str, originals: dict[str, onnx.ValueInfoProto]) -> onnx.ValueInfoProto:
    """A boundary tensor's ValueInfo with the graph's static shape (or the model's own type for
    non-tensor values such as sequences)."""
    info = graph.tensors.get(name)
    if info is not None and not (name in originals and originals[name].type.HasField("sequence_type")):
        return helper.make_tensor_value_info(name, helper.np_dtype_to_tensor_dtype(np.dtype(info.dtype)), list(info.shape))
    if name in originals:
        return originals[name]
    raise OnnxpipeError(f"{graph.source}: tensor '{name}' crosses a stage cut but has no known type; re-export the model with shapes")


def _stage_model(graph: Graph, index: int, layout: _StageLayout, originals: dict[str, onnx.ValueInfoProto]
                 ) -> tuple[onnx.ModelProto, list[onnx.TensorProto]]:
    """A standalone model holding only this stage's nodes and small initializers, and the stage's
    large raw-data initializers (the source model's own protos, streamed to the file, not copied)."""
    source = graph.model
    model = onnx.ModelProto()
    model.ir_version = min(source.ir_version, MAX_IR_VERSION)
    model.opset_import.extend(source.opset_import)
    model.functions.extend(source.functions)
    model.producer_name = "onnxpipe"
    model.domain = source.domain
    model.model_version = source.model_version
    stage_graph = model.graph
    stage_graph.name = f"{source.graph.name or 'model'}_stage{index}"
    for name in layout.copied_nodes + layout.nodes:
        stage_graph.node.add().CopyFrom(graph.node(name))
    inits = _initializers_by_name(graph)
    large = []
    for name in layout.initializers:
        tensor = inits[name]
        if is_external(tensor) or (is_streamable(tensor) and raw_nbytes(tensor) > _STREAM_BYTES):
            large.append(tensor)
        else:
            stage_graph.initializer.add().CopyFrom(tensor)
    stage_graph.input.extend(_value_info(graph, name, originals) for name, _ in layout.inputs)
    stage_graph.output.extend(_value_info(graph, name, originals) for name, _ in layout.outputs)
    boundary = {name for name, _ in layout.inputs} | {name for name, _ in layout.outputs}
    for name in layout.copied_nodes + layout.nodes:
        for out in graph.node(name).output:
            if out and out not in boundary and out in originals:
                stage_graph.value_info.add().CopyFrom(originals[out])
    return model, large


def _initializers_by_name(graph: Graph) -> dict[str, onnx.TensorProto]:
    cache = graph.__dict__.get("_initializer_cache")
    if cache is None:
        cache = {t.name: t for t in graph.model.graph.initializer}
        object.__setattr__(graph, "_initializer_cache", cache)
    return cache


def _originals(graph: Graph) -> dict[str, onnx.ValueInfoProto]:
    g = graph.model.graph
    return {vi.name: vi for vi in [*g.input, *g.value_info, *g.output]}


def _write_stage(graph: Graph, plan: Plan, index: int, layout: _StageLayout, originals: dict[str, onnx.ValueInfoProto],
                 directory: Path, external: bool) -> Stage:
    """Build, check and write one stage; the proto is dropped on return."""
    model, large = _stage_model(graph, index, layout, originals)
    path = directory / f"stage_{index}.onnx"
    data_file = f"{path.name}.data"
    try:
        # Weights go to a side file first so the checker reads the file from disk without loading them;
        # models under 2 GB then get them copied back inline, chunk by chunk.
        write_model(model, path, large, external_data=data_file, base_dir=graph.weights_dir)
        del model, large
        onnx.checker.check_model(str(path), full_check=True)
        if not external:
            inline_external_data(path)
            data_file = None
    except onnx.checker.ValidationError as exc:
        first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else type(exc).__name__
        raise OnnxpipeError(f"stage {index} fails onnx.checker ({first}); the model itself may not pass it, run onnx.checker on it") from exc
    except onnx.shape_inference.InferenceError as exc:
        first = str(exc).strip().splitlines()[0][:300]
        raise OnnxpipeError(f"stage {index} fails shape inference ({first}); run onnx.checker with full_check on the model") from exc
    except OSError as exc:
        raise OnnxpipeError(f"{directory.parent}: cannot write stage {index} ({exc.strerror}); free space or choose another -o") from exc
    if data_file and not (directory / data_file).exists():
        data_file = None  # no initializer large enough for the side file
    size = path.stat().st_size + ((directory / data_file).stat().st_size if data_file else 0)
    parameters = set(graph.parameters)
    params = tuple(n for n in layout.initializers if n in parameters)
    stage_plan = plan.stages[index]
    return Stage(
        index=index,
        file=path.name,
        devices=tuple(stage_plan.devices),
        inputs=tuple(_stage_input(graph, name, src) for name, src in layout.inputs),
        outputs=tuple(_stage_output(graph, name, users) for name, users in layout.outputs),
        parameters=params,
        recompute=stage_plan.recompute,
        nodes=len(layout.nodes),
        parameter_bytes=sum(graph.tensors[n].nbytes for n in params),
        file_bytes=size,
        data_file=data_file,
    )


def _tensor_type(graph: Graph, name: str) -> tuple[str, tuple[int, ...]]:
    info = graph.tensors.get(name)
    return (info.dtype, tuple(info.shape)) if info is not None else ("unknown", ())


def _stage_input(graph: Graph, name: str, source: str | int) -> StageInput:
    dtype, shape = _tensor_type(graph, name)
    return StageInput(name, dtype, shape, source)


def _stage_output(graph: Graph, name: str, consumers: Iterable[str | int]) -> StageOutput:
    dtype, shape = _tensor_type(graph, name)
    return StageOutput(name, dtype, shape, tuple(consumers))


def _manifest(graph: Graph, plan: Plan, stages: tuple[Stage, ...], layouts: Sequence[_StageLayout]) -> Manifest:
    parameters = set(graph.parameters)
    holders: dict[str, list[int]] = {}
    for i, layout in enumerate(layouts):
        for name in layout.initializers:
            if name in parameters:
                holders.setdefault(name, []).append(i)
    shared = tuple(SharedInitializer(name, tuple(where)) for name, where in sorted(holders.items()) if len(where) > 1)
    return Manifest(
        model=graph.source,
        target=plan.target,
        inputs=tuple(_stage_input(graph, name, "model") for name in graph.inputs),
        outputs=tuple(_stage_output(graph, name, ("model",)) for name in graph.outputs),
        stages=stages,
        shared=shared,
        loss=graph.loss,
        untied=graph.untied,
    )


def cut_stages(graph: Graph, cuts: Sequence[str]) -> tuple[tuple[str, ...], ...]:
    """Node groups for hand-given cut tensors: stage i ends with the producer of `cuts[i]` (all compute
    nodes up to it in topological order not in earlier stages); the last stage takes the rest."""
    compute = graph.compute_nodes
    position = {name: i for i, name in enumerate(compute)}
    ends = []
    for tensor in cuts:
        if tensor not in graph.tensors and graph.producer(tensor) is None:
            raise OnnxpipeError(f"--cuts: no tensor '{tensor}' in the model; name node outputs (see `onnxpipe inspect`)")
        producer = graph.producer(tensor)
        if producer is None or producer not in position:
            raise OnnxpipeError(f"--cuts: tensor '{tensor}' is a model input, a constant or derived from the inputs alone (each stage "
                                "reading it makes it); cut at a computed tensor")
        end = position[producer]
        if ends and end <= ends[-1]:
            raise OnnxpipeError(f"--cuts: tensor '{tensor}' is produced before (or with) the previous cut; list cuts in data-flow order")
        ends.append(end)
    if ends and ends[-1] >= len(compute) - 1:
        raise OnnxpipeError(f"--cuts: tensor '{cuts[-1]}' is produced by the last node, leaving the last stage empty; drop it")
    bounds = [0, *(e + 1 for e in ends), len(compute)]
    return tuple(compute[a:b] for a, b in zip(bounds, bounds[1:]))


def plan_cuts(graph: Graph, costs: Costs, target: Target, cuts: Sequence[str], *, batch: int | None = None, microbatches: int = 1,
              schedule: str = "1f1b", optimizer: str = "adam", recompute: str = "auto", mode: str = "training",
              deadline: Deadline | None = None) -> Plan:
    """A priced plan for hand-given cuts, one device per stage taken in the target's order. Its lower bound stops at
    `deadline`: untimed, on 1,000 devices it took over a minute."""
    from onnxpipe.plan.baselines import with_recompute
    from onnxpipe.plan.bounds import Bounds
    from onnxpipe.pricing.problem import build_problem

    if recompute not in RECOMPUTE_POLICIES:
        raise OnnxpipeError(f"--recompute {recompute}: choose one of {', '.join(RECOMPUTE_POLICIES)}")
    groups = cut_stages(graph, cuts)
    if len(groups) > len(target.devices):
        raise OnnxpipeError(f"--cuts: {len(groups)} stages need {len(groups)} devices; target {target.name} has {len(target.devices)}, give fewer cuts")
    problem = build_problem(graph, costs, target, batch=batch or graph.batch * microbatches, microbatches=microbatches,
                            schedule=schedule, optimizer=optimizer, mode=mode)
    _ensure_no_sealed_cut(problem, cuts, groups)
    devices = tuple((d.name,) for d in target.devices[: len(groups)])
    return with_recompute(problem, groups, devices, recompute, "given", Bounds(problem, deadline))


def _ensure_no_sealed_cut(problem: Problem, cuts: Sequence[str], groups: tuple[tuple[str, ...], ...]) -> None:
    """A hand cut where a sequence is live in training (`Problem.sealed`) is refused, naming the sequence: the planner never makes one."""
    gaps = np.cumsum([len(g) for g in groups[:-1]])
    for tensor, gap in zip(cuts, gaps):
        if problem.sealed[gap]:
            sequences = problem.graph.sequences
            live = next(name for t, name in enumerate(problem.tensor_names) if name in sequences
                        and problem.tensor_producer[t] < gap <= problem.tensor_consumers[t][-1])
            raise OnnxpipeError(f"--cuts: the cut after '{tensor}' hands the next stage sequence '{live}', which has no gradient to send back "
                                "in training; cut before the sequence's producer or after its last reader, or plan without --cuts")


def annotate_stages(graph: Graph, plan: Plan, path: str | os.PathLike) -> None:
    """Write a copy of the model whose nodes carry `onnxpipe.stage` metadata (constant-chain and derived nodes:
    every stage that copies them), so a viewer such as Netron shows the cut."""
    assignment = {name: str(stage.index) for stage in plan.stages for name in stage.nodes}
    layouts = _layout(graph, plan, {n: int(s) for n, s in assignment.items()})
    for i, layout in enumerate(layouts):
        for name in layout.copied_nodes:
            assignment[name] = f"{assignment[name]},{i}" if name in assignment else str(i)
    model = skeleton(graph.model, "graph")
    model.graph.CopyFrom(skeleton(graph.model.graph, "initializer"))
    large = [t for t in graph.model.graph.initializer if is_external(t) or (is_streamable(t) and raw_nbytes(t) > _STREAM_BYTES)]
    streamed = {t.name for t in large}
    model.graph.initializer.extend(t for t in graph.model.graph.initializer if t.name not in streamed)
    for node in model.graph.node:
        if node.name in assignment:
            entry = next((p for p in node.metadata_props if p.key == STAGE_METADATA_KEY), None) or node.metadata_props.add()
            entry.key, entry.value = STAGE_METADATA_KEY, assignment[node.name]
    target = Path(path)
    external = sum(raw_nbytes(t) for t in large) > _EXTERNAL_DATA_BYTES
    try:
        with atomic_path(target) as tmp:
            write_model(model, tmp, large, external_data=f"{target.name}.data" if external else None, base_dir=graph.weights_dir)
    except OSError as exc:
        raise OnnxpipeError(f"{target}: cannot write the annotated model ({exc.strerror}); choose another --annotated path") from exc
