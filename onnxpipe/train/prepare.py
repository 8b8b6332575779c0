"""From a stage directory (or one whole model) to the picklable `StageSpec`s the runners execute.

Reading order: `TrainConfig` -> `prepare_stages` (stage directory, for training) -> `prepare_single`
(the unpartitioned model as one stage: the reference) -> `prepare_inference` (the stage files as
they are, forward only) -> `stage_threads`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import onnx

from onnxpipe.errors import OnnxpipeError
from onnxpipe.manifest import Manifest, Stage, StageInput
from onnxpipe.protostream import load_weights, read_model, weights_dir
from onnxpipe.schedule import SCHEDULES, Action, Table, add_communication, build, forward_only, replicate, table
from onnxpipe.target import load_target
from onnxpipe.nodes import FLOAT_DTYPES, differentiable_from, draws_random, trained_initializers
from onnxpipe.train.graphs import StageGraphs, build_stage_graphs
from onnxpipe.train.layout import Layout
from onnxpipe.train.loss import LossSpec, append_loss, labels_info
from onnxpipe.opset import training_opset
from onnxpipe.ortutil import ensure_numpy_types, numpy_types
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.splitgrad import split_backward
from onnxpipe.train.stage import StageSpec, Wiring
from onnxpipe.units import plural

__all__ = ["TrainConfig", "RECOMPUTE", "prepare_stages", "prepare_single", "prepare_inference", "model_inputs", "stage_threads"]

RECOMPUTE = ("auto", "always", "never")


@dataclass(frozen=True)
class TrainConfig:
    schedule: str = "1f1b"
    microbatches: int = 4
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    #: Needed when the model has no loss output.
    loss: LossSpec | None = None
    #: "auto": the plan's choice per stage (`Stage.recompute`); "always" / "never" override it.
    recompute: str = "auto"
    #: Intra-op threads per stage session.
    threads: int = 1

    def __post_init__(self) -> None:
        if self.recompute not in RECOMPUTE:
            raise OnnxpipeError(f"--recompute {self.recompute!r}: choose one of {', '.join(RECOMPUTE)}")


def _loss_name(manifest: Manifest, config: TrainConfig) -> str:
    if config.loss is not None:
        return config.loss.name
    if manifest.loss is None:
        outs = ", ".join(o.name for o in manifest.outputs)
        raise OnnxpipeError(f"model {manifest.model!r} has no loss output; add one with --loss cross_entropy|mse --labels NAME on one of its outputs ({outs})")
    return manifest.loss


def model_inputs(manifest: Manifest, config: TrainConfig) -> tuple[StageInput, ...]:
    """Every input the driver feeds per micro-batch (labels of an appended loss included)."""
    extra: tuple[StageInput, ...] = ()
    if config.loss is not None:
        out = next((o for o in manifest.outputs if o.name == config.loss.output), None)
        if out is None:
            raise OnnxpipeError(f"--loss: the model has no output {config.loss.output!r}; its outputs: {', '.join(o.name for o in manifest.outputs)}")
        dtype, shape = labels_info(config.loss, out.shape)
        extra = (StageInput(config.loss.labels, dtype, shape, "model"),)
    return tuple(manifest.inputs) + extra


def prepare_stages(directory: str | Path, manifest: Manifest, config: TrainConfig, threads: tuple[int, ...] | None = None,
                   replicas: tuple[int, ...] | None = None) -> tuple[StageSpec, ...]:
    """Stage graphs built last stage first (a stage's gradient outputs depend on what later stages send back), wired, with their schedule rows.

    One spec per worker, stage-major: a stage runs on as many replicas as its manifest devices
    (or `replicas[stage]`), each with its share of the stage's schedule row (`schedule.replicate`);
    a replica left without micro-batches (more replicas than micro-batches) adds zero gradients."""
    directory = Path(directory)
    manifest.ensure_numpy_types("train")
    loss = _loss_name(manifest, config)
    k = len(manifest.stages)
    layout = Layout(replicas or tuple(max(1, len(st.devices)) for st in manifest.stages))
    _ensure_replicas(layout, k)
    compute = table(config.schedule, k, config.microbatches)
    split = any(a.op == "W" for row in compute for a in row)
    lowered = add_communication(compute)
    rows = replicate(stage_rows(lowered, k), layout.replicas)
    device_rows = _device_rows(lowered, layout) if len(lowered) < k else {}
    forward_rows = _forward_rows(k, config.microbatches, layout)
    graphs: dict[int, StageGraphs] = {}
    grad_readers: dict[str, list[int]] = {}
    models = {}
    for st in manifest.stages:
        path = directory / st.file
        if not path.is_file():
            raise OnnxpipeError(f"{path}: stage file missing; rewrite the directory with `onnxpipe split`")
        model = training_opset(_read_stage(path), f"stage {st.index} ({st.file})")
        if config.loss is not None and any(o.name == config.loss.output for o in model.graph.output):
            model = append_loss(model, config.loss)
        models[st.index] = model
    ensure_numpy_types(manifest.model, [t for st in manifest.stages for t in numpy_types(models[st.index], st.parameters)], "train")
    holder = {o.name: s.index for s in manifest.stages for o in s.outputs}
    for st in reversed(manifest.stages):
        model = models[st.index]
        recompute = st.recompute if config.recompute == "auto" else config.recompute == "always"
        random = draws_random(model.graph)
        if recompute and random:  # a recomputed forward would draw other masks than the one the loss came from
            if config.recompute == "always":
                raise OnnxpipeError(f"stage {st.index} draws random numbers ({', '.join(random[:3])}: Dropout in training mode or a random op): "
                                    "recomputing its forward in the backward would draw other masks than its loss saw; use --recompute auto or never")
            recompute = False
        grad_outputs = [o.name for o in st.outputs if o.name in grad_readers]
        has_loss = loss in {o.name for o in model.graph.output}
        reached = differentiable_from(model.graph, [*grad_outputs, *([loss] if has_loss else [])])
        grad_inputs = [i.name for i in st.inputs if isinstance(i.source, int) and i.dtype in FLOAT_DTYPES and i.name in reached]
        g = build_stage_graphs(
            model, params=st.parameters, grad_inputs=grad_inputs, grad_outputs=grad_outputs,
            loss=loss if has_loss else None, recompute=recompute, origin=f"stage {st.index} ({st.file})",
        )
        graphs[st.index] = g
        for name in g.grad_inputs:
            grad_readers.setdefault(name, []).append(st.index)
    if not any(g.loss for g in graphs.values()):
        raise OnnxpipeError(f"no stage computes the loss {loss!r}; check the manifest's loss field or --loss")
    shared = {s.name: s.stages for s in manifest.shared}
    specs = []
    for st in manifest.stages:
        g = graphs[st.index]
        wiring = Wiring(
            model_inputs=tuple(i for i in g.inputs if not any(x.name == i and isinstance(x.source, int) for x in st.inputs)),
            recv_f=_recv_f(st),
            send_f=_send_f(st),
            recv_b=tuple((o, tuple(sorted(grad_readers[o]))) for o in g.grad_outputs),
            send_b=tuple((i, holder[i]) for i in g.grad_inputs),
            shared=tuple((p, tuple(x for x in shared[p] if x != st.index)) for p in g.trained if p in shared),
            model_outputs=_model_outputs(st) + ((g.loss,) if g.loss else ()),
        )
        halves = split_backward(g) if split and g.backward else None
        for j in range(layout.count(st.index)):
            w = layout.worker(st.index, j)
            specs.append(StageSpec(st.index, g, wiring, rows[w], config.microbatches, config.optimizer,
                                   threads[st.index] if threads else config.threads, j, layout, halves, forward_rows[w], st.file,
                                   device_row=device_rows.get(w, ())))
    return tuple(specs)


def stage_rows(lowered: Table, stages: int) -> Table:
    """One row per stage: a device holding several stages (interleaved 1F1B, ZB-V) gives each its own
    worker (transport address, spec and row: its actions in the device's order), and one process runs
    them all in the device's order (`_device_rows`, `host`)."""
    if len(lowered) == stages:
        return lowered
    return tuple(tuple(a for row in lowered for a in row if a.stage == s) for s in range(stages))


def _device_rows(lowered: Table, layout: Layout) -> dict[int, tuple[Action, ...]]:
    """Per worker of a device holding several stages: the device's row for its replica (`schedule.replicate`
    deals each row out the same way), which one worker process runs for all of that replica's stages."""
    out: dict[int, tuple[Action, ...]] = {}
    for row in lowered:
        stages = sorted({a.stage for a in row})
        counts = {layout.count(s) for s in stages}
        if len(counts) > 1:
            raise OnnxpipeError(f"stages {', '.join(map(str, stages))} share a device but have different replica counts "
                                f"({', '.join(str(layout.count(s)) for s in stages)}); give them the same count")
        for j, dealt in enumerate(replicate((row,), (counts.pop(),))):
            out.update({layout.worker(s, j): dealt for s in stages})
    return out


def _read_stage(path: Path) -> onnx.ModelProto:
    """A stage file with every weight read in (a session runs the whole stage)."""
    model = read_model(path)
    load_weights(model, weights_dir(path))
    return model


def _forward_rows(stages: int, microbatches: int, layout: Layout) -> Table:
    return replicate(add_communication(forward_only(stages, microbatches)), tuple(layout.count(s) for s in range(stages)))


def _recv_f(stage: Stage) -> tuple[tuple[str, int], ...]:
    return tuple((i.name, i.source) for i in stage.inputs if isinstance(i.source, int))


def _send_f(stage: Stage) -> tuple[tuple[str, tuple[int, ...]], ...]:
    return tuple((o.name, tuple(c for c in o.consumers if isinstance(c, int))) for o in stage.outputs if any(isinstance(c, int) for c in o.consumers))


def _model_outputs(stage: Stage) -> tuple[str, ...]:
    return tuple(o.name for o in stage.outputs if "model" in o.consumers)


def _ensure_replicas(layout: Layout, stages: int) -> None:
    if len(layout.replicas) != stages or min(layout.replicas) < 1:
        raise OnnxpipeError(f"replicas {layout.replicas}: need a count of at least 1 for each of the {plural(stages, 'stage')}")


def prepare_single(model: onnx.ModelProto, config: TrainConfig, loss: str | None = None) -> StageSpec:
    """The whole model as one stage, trained on the same micro-batches: the reference for pipelined training."""
    model = training_opset(model)
    if config.loss is not None:
        model = append_loss(model, config.loss)
        loss = config.loss.name
    if loss is None:
        raise OnnxpipeError("the model has no loss output; add one with --loss cross_entropy|mse --labels NAME")
    trainable = trained_initializers(model.graph)
    params = [t.name for t in model.graph.initializer if t.name in trainable]
    g = build_stage_graphs(model, params=params, grad_inputs=(), grad_outputs=(), loss=loss,
                           recompute=False, origin=f"model {model.graph.name or '<model>'}")
    # The reference runs each backward whole whatever the pipeline's schedule: same sums, in micro-batch order.
    row = add_communication(build(config.schedule if config.schedule in SCHEDULES else "1f1b", 1, config.microbatches))
    wiring = Wiring(tuple(g.inputs), (), (), (), (), model_outputs=(*g.outputs, loss))
    return StageSpec(0, g, wiring, row[0], config.microbatches, config.optimizer, config.threads,
                     forward_actions=_forward_rows(1, config.microbatches, Layout())[0])


def prepare_inference(directory: str | Path, manifest: Manifest, microbatches: int,
                      threads: tuple[int, ...] | None = None) -> tuple[StageSpec, ...]:
    """The stage files as they are (their weights inside, nothing trained), forward only over
    `microbatches` micro-batches: one worker per stage."""
    directory = Path(directory)
    k = len(manifest.stages)
    rows = _forward_rows(k, microbatches, Layout())
    specs = []
    for st in manifest.stages:
        graphs = StageGraphs(forward=_read_stage(directory / st.file).SerializeToString(), backward=None, inputs=tuple(i.name for i in st.inputs),
                             outputs=tuple(o.name for o in st.outputs), params=(), trained=(), grad_inputs=(), grad_outputs=(),
                             stash=(), backward_inputs=(), loss=None, recompute=False, initial={})
        wiring = Wiring(model_inputs=tuple(i.name for i in st.inputs if i.source == "model"),
                        recv_f=_recv_f(st), send_f=_send_f(st), recv_b=(), send_b=(), model_outputs=_model_outputs(st))
        specs.append(StageSpec(st.index, graphs, wiring, (), microbatches, OptimizerConfig(),
                               threads[st.index] if threads else 1, forward_actions=rows[st.index], file=st.file))
    return tuple(specs)


def stage_threads(manifest: Manifest, target: str | None = None) -> tuple[int, ...]:
    """Intra-op threads per stage: its devices' `threads` in the target (default: the one the stages
    were planned for, named in the manifest); 1 where the target has none or cannot be found."""
    try:
        by_name = {d.name: d for d in load_target(target or manifest.target).devices}
    except OnnxpipeError:
        return tuple(1 for _ in manifest.stages)
    return tuple(max(1, max((by_name[d].threads for d in st.devices if d in by_name), default=1)) for st in manifest.stages)
