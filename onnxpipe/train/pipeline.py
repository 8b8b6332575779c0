"""`Pipeline`: the public face of pipelined training. From a model (planned on a target through the
plan API and split into a temporary stage directory) or from a stage directory (on the target its
manifest names); runs stages as worker processes, one per stage replica or per device holding several
stages (or in-process), evaluates through the same workers, and saves, loads and exports what it trained.

Reading order: `Pipeline.__init__` -> `_stage_directory` -> train_step / evaluate -> metrics
-> save / load / export.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxpipe.batching import BatchBinding, bind_batch, stage_dims
from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import atomic_path
from onnxpipe.gradients import ensure_gradients
from onnxpipe.initializers import SharedInitializer, TieChoice, shared_initializers, untie
from onnxpipe.manifest import Manifest
from onnxpipe.nodes import draws_random, trained_initializers
from onnxpipe.ortutil import ensure_numpy_types, numpy_types
from onnxpipe.protostream import load_weights, read_model, weights_dir
from onnxpipe.simulate import Event
from onnxpipe.target import BACKENDS, load_target
from onnxpipe.train.checkpoint import load_checkpoint, save_checkpoint
from onnxpipe.train.data import split_microbatches
from onnxpipe.train.executor import Executor
from onnxpipe.train.host import hosts
from onnxpipe.train.infer import join_microbatches
from onnxpipe.train.leftovers import sweep_dead_runs, temp_dir
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.loss import LossSpec
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.prepare import TrainConfig, model_inputs, prepare_single, prepare_stages, stage_threads
from onnxpipe.train.processes import ProcessPipeline
from onnxpipe.train.providers import ensure_usable, execution_devices
from onnxpipe.train.stage import StageSpec
from onnxpipe.units import plural

__all__ = ["Pipeline", "DEFAULT_TARGET", "BACKENDS"]

#: The target a model is planned on when none is given.
DEFAULT_TARGET = "cpu2"


class Pipeline:
    """Pipelined training of one model. Use as a context manager: workers stop on exit."""

    def __init__(
        self,
        source: str | os.PathLike | onnx.ModelProto,
        target: str | None = None,
        *,
        stages: int | None = None,
        batch: int | None = None,
        microbatches: int = 4,
        schedule: str = "1f1b",
        optimizer: OptimizerConfig | None = None,
        loss: LossSpec | None = None,
        recompute: str = "auto",
        dims: Mapping[str, int] | None = None,
        processes: bool = True,
        time_limit: float = 10.0,
        backend: str = "local",
        address: str | None = None,
        device: str = "auto",
        tie: tuple[str, ...] = (),
        untie: tuple[str, ...] = (),
        shapes_by_running: bool = False,
        bind_cores: bool = False,
    ) -> None:
        self.config = TrainConfig(schedule, microbatches, optimizer or OptimizerConfig(), loss, recompute)
        #: Leftovers of killed runs removed on the way in (`leftovers.sweep_dead_runs`).
        self.swept = sweep_dead_runs()
        self._tmp: Path | None = None
        self._model: onnx.ModelProto | Path | None = None
        self.engine: Executor | None = None
        #: Shapes static inference cannot find are read off one run on zeros (`onnxpipe.graph.load`).
        self.shapes_by_running = shapes_by_running
        #: The symbolic dims the stages were cut with (bound from --batch / --microbatches, --dim, or a stage directory's shapes).
        self.dims: dict[str, int] = dict(dims or {})
        #: How the model's batch dim was bound (`onnxpipe.batching`); from a stage directory, its stage files' batch.
        self.binding: BatchBinding | None = None
        #: The model's weights read by several nodes and what was decided (`onnxpipe.initializers`); empty from a stage directory.
        self.shared: tuple[SharedInitializer, ...] = ()
        self.step = 0
        self.losses: list[float] = []
        self._seconds: list[float] = []
        self._busy: list[tuple[float, ...]] = []
        self._copy: list[tuple[float, ...]] = []
        self._copy_cpu: list[tuple[float, ...]] = []
        self._peaks: tuple[int, ...] = ()
        self._stash_peaks: tuple[int, ...] = ()
        #: The measured timeline of the last step (seconds from its start), in the simulator's event format.
        self.last_events: tuple[Event, ...] = ()
        try:  # a failure or Ctrl-C on the way leaves no temp directory and no worker
            self.directory, self.manifest = self._stage_directory(source, target, stages, batch, dims, time_limit, TieChoice.of(tie, untie))
            #: What the stages were cut from: the model with exactly the manifest's untied weights untied.
            self.ties = TieChoice(untie=frozenset(self.manifest.untied), exact=True)
            #: The target the stages run on: the one given, else the manifest's (a model is planned on DEFAULT_TARGET).
            self.target = target or self.manifest.target
            self.inputs = model_inputs(self.manifest, self.config)
            self.batch = microbatches * (self.inputs[0].shape[0] if self.inputs[0].shape else 1)
            specs = prepare_stages(self.directory, self.manifest, self.config, stage_threads(self.manifest, self.target))
            self.stages = len(self.manifest.stages)
            #: Per worker: (stage, replica).
            self.places = tuple((s.index, s.replica) for s in specs)
            #: Devices (times replicas) the workers run on: a device holding several stages (`host.hosts`) counts once.
            self.devices = len(hosts(specs))
            self.engine = _engine(specs, self.manifest, self.target, backend, address, device, processes, bind_cores)
        except BaseException:
            self.close()
            raise

    def _stage_directory(self, source: Any, target: str | None, stages: int | None, batch: int | None, dims: Mapping[str, int] | None,
                         time_limit: float, ties: TieChoice) -> tuple[Path, Manifest]:
        if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
            manifest = Manifest.read(source)
            self._model = _beside(Path(source), manifest.model) or Path(source) / manifest.model
            return Path(source), manifest
        from onnxpipe.plan import plan_model
        from onnxpipe.split import split

        if not isinstance(source, onnx.ModelProto) and not Path(source).is_file():
            raise OnnxpipeError(f"{source}: no such model file or stage directory; pass an .onnx file or a directory written by `onnxpipe split`")
        self._model = source if isinstance(source, onnx.ModelProto) else Path(source)
        m = self.config.microbatches
        self.binding = bind_batch(self._original(), dims, batch, m)
        self.dims = self.binding.dims
        # before any worker starts: types the workers cannot hold (the cut tensors are checked with the stages)
        ensure_numpy_types(str(source) if not isinstance(source, onnx.ModelProto) else "the model",
                           numpy_types(self._original(), trained_initializers(self._original().graph)), "train")
        graph, _, _, the_plan = plan_model(source, target or DEFAULT_TARGET, dims=self.dims, stages=stages, microbatches=m,
                                           schedule=self.config.schedule, optimizer=self.config.optimizer.planned_as,
                                           recompute=self.config.recompute, time_limit=time_limit, ties=ties,
                                           shapes_by_running=self.shapes_by_running, mode="training", adds_loss=self.config.loss is not None)
        ensure_gradients(graph.model, None, graph.source)  # before any worker starts
        self.shared = graph.shared
        if batch is not None and batch != graph.batch * m:
            raise OnnxpipeError(f"--batch {batch} must be {plural(m, 'micro-batch')} of the model's batch {graph.batch}: pass --batch {graph.batch * m} or change --microbatches")
        self._tmp = temp_dir()
        manifest = split(graph, the_plan, self._tmp / "stages", force=True)
        return self._tmp / "stages", manifest

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.engine is not None:
            self.engine.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def microbatches(self, batch: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return split_microbatches(batch, self.inputs, self.config.microbatches)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> float:
        """One optimizer step on a global batch (every model input, labels included); returns its mean loss."""
        engine = self._engine()
        mbs = self.microbatches(batch)
        start = time.perf_counter()
        loss = engine.train_step(mbs)
        seconds = time.perf_counter() - start
        last = engine.last
        assert last is not None
        self.last_events = last.events
        self._busy.append(last.busy_seconds)
        self._copy.append(last.copy_seconds)
        self._copy_cpu.append(last.copy_cpu_seconds)
        self._peaks, self._stash_peaks = last.peak_rss_bytes, last.peak_stash_bytes
        self._seconds.append(seconds)
        self.losses.append(loss)
        self.step += 1
        return loss

    def evaluate(self, batch: Mapping[str, np.ndarray]) -> dict[str, Any]:
        """Forward only, through the workers' forward-only rows: every model output over the global batch
        (joined along axis 0), and the mean loss."""
        per_mb = self._engine().infer(self.microbatches(batch))
        loss_name = self.config.loss.name if self.config.loss else self.manifest.loss
        names = [o.name for o in self.manifest.outputs if o.name != loss_name and o.name in per_mb[0]]
        out: dict[str, Any] = join_microbatches(per_mb, names)
        if loss_name and loss_name in per_mb[0]:
            out["loss"] = float(np.mean([float(mb[loss_name]) for mb in per_mb]))
        return out

    def parameters(self) -> dict[str, np.ndarray]:
        return self._engine().parameters()

    def _engine(self) -> Executor:
        if self.engine is None:
            raise OnnxpipeError("the pipeline is closed")
        return self.engine

    @property
    def cpus(self) -> tuple[tuple[int, ...], ...]:
        """Per worker: the CPUs its process is bound to (`bind_cores`; empty where the OS places it, or in-process)."""
        return getattr(self.engine, "cpus", None) or tuple(() for _ in self.places)

    def metrics(self) -> dict[str, Any]:
        """Measured numbers under the simulator's names (per-step medians after the first step).

        Measurements are per worker; `stages` keeps one entry per stage whose figures are the largest
        over its replicas, and `replicas` lists each replica's own (one entry for an unreplicated stage), its `cpus`
        those its process is bound to (`affinity`; empty where the OS places it).
        Fractions are over all devices (a device holding several stages counts once, as in the simulator):
        bubble = 1 - sum(busy) / (devices x step seconds)."""
        steady = slice(1, None) if len(self._seconds) > 1 else slice(None)
        seconds = statistics.median(self._seconds[steady]) if self._seconds else 0.0
        busy = [statistics.median(col) for col in zip(*self._busy[steady])] if self._busy else []
        copy = [statistics.median(col) for col in zip(*self._copy[steady])] if self._copy else []
        copy_cpu = [statistics.median(col) for col in zip(*self._copy_cpu[steady])] if self._copy_cpu else []
        devices = self.devices
        cpus = self.cpus
        per_worker = [
            {"replica": r, "busy_seconds": b, "transfer_seconds": c, "cpus": list(cpus[w]),
             "peak_memory_bytes": (self._peaks[w] or None) if w < len(self._peaks) else None,
             "peak_activation_bytes": self._stash_peaks[w] if w < len(self._stash_peaks) else None}
            for w, ((_, r), b, c) in enumerate(zip(self.places, busy, copy))
        ]
        stages = []
        for i in range(self.stages if per_worker else 0):
            mine = [m for m, (s, _) in zip(per_worker, self.places) if s == i]
            stage: dict[str, Any] = {"stage": i}
            for key in ("busy_seconds", "transfer_seconds", "peak_memory_bytes", "peak_activation_bytes"):
                values = [m[key] for m in mine if m[key] is not None]
                stage[key] = max(values) if values else None
            stage["replicas"] = mine
            stages.append(stage)
        return {
            "losses": list(self.losses),
            "step_seconds": seconds,
            "iteration_seconds": seconds,
            "samples_per_s": self.batch / seconds if seconds else 0.0,
            "bubble_fraction": max(0.0, 1 - sum(busy) / (devices * seconds)) if seconds else 0.0,
            "transfer_fraction": sum(copy) / (devices * seconds) if seconds else 0.0,
            "transfer_cpu_fraction": sum(copy_cpu) / (devices * seconds) if seconds else 0.0,
            "stages": stages,
            "schedule": self.config.schedule,
            "microbatches": self.config.microbatches,
            "batch": self.batch,
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Checkpoint weights, optimizer state and the step (the data cursor)."""
        save_checkpoint(directory, self.step, self._engine().state(), {"losses": self.losses, "schedule": self.config.schedule,
                                                                  "optimizer": self.config.optimizer.name,
                                                                  "master_weights": self.config.optimizer.master_weights, "stages": self.stages})

    def load(self, directory: str | os.PathLike) -> int:
        """Restore a checkpoint; returns the step training continues from."""
        step, states, meta = load_checkpoint(directory)
        trained_with = meta.get("optimizer", self.config.optimizer.name)
        if trained_with != self.config.optimizer.name:
            raise OnnxpipeError(f"{directory}: the checkpoint was trained with {trained_with}, this run uses {self.config.optimizer.name}; "
                                f"resume with --optimizer {trained_with} or start without --resume")
        master = bool(meta.get("master_weights", False))
        if master != self.config.optimizer.master_weights:
            raise OnnxpipeError(f"{directory}: the checkpoint was trained {'with' if master else 'without'} --master-weights, this run "
                                f"{'without' if master else 'with'}; resume {'with' if master else 'without'} it or start without --resume")
        if len(states) != self.stages:
            raise OnnxpipeError(f"{directory}: checkpoint has {plural(len(states), 'stage')}, this pipeline {self.stages}; resume with the same stage directory")
        self._engine().load_state(states)
        self.step = step
        self.losses = list(meta.get("losses", []))[:step]
        return step

    def export(self, path: str | os.PathLike) -> None:
        """The original model with its initializers replaced by the trained weights (atomic write).

        Initializers keep the model's names; an untied one is written as its separate copies (the
        first reading module keeps the name, the others' copies are named after their modules), and an exporter's
        transposed copy that was tied back (`onnxpipe.initializers`) as the transpose of its trained original: it
        was trained as one with it (before, it kept its first values, and an exported T5's head was untrained)."""
        trained = self.parameters()
        original = self._original("export")
        copies = {s.name: s.of for s in shared_initializers(original, self.ties) if s.kind == "copy" and not s.untied and s.of in trained}
        model = untie(original, self.manifest.untied)
        for i, t in enumerate(model.graph.initializer):
            value = trained.get(t.name, trained[copies[t.name]].T if t.name in copies else None)
            if value is not None:
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(np.ascontiguousarray(value).astype(numpy_helper.to_array(t).dtype), t.name))
        path = Path(path)
        with atomic_path(path) as tmp:
            onnx.save(model, str(tmp))

    def reference(self) -> LocalPipeline:
        """The unpartitioned model trained in one process on the same micro-batches (for --check)."""
        from onnxpipe.graph import load

        model = self._original("--check")
        dims = self.dims if self.binding is not None else stage_dims(model, {i.name: i.shape for i in self.manifest.inputs})
        return LocalPipeline([prepare_single(load(model, dims, ties=self.ties, shapes_by_running=self.shapes_by_running).model, self.config, self.manifest.loss)])

    def ensure_checkable(self) -> None:
        """--check trains the unpartitioned model on the same batches and compares: a model that draws random numbers
        (Dropout exported in training mode) draws other masks in the two runs, which then cannot agree."""
        random = [n for st in self.manifest.stages for n in draws_random(onnx.load(str(self.directory / st.file), load_external_data=False).graph)]
        if random:
            raise OnnxpipeError(f"--check: the model draws random numbers ({', '.join(random[:3])}: Dropout in training mode or a random op), "
                                "so the pipelined and the unpartitioned runs cannot agree; export it in eval mode to check it, or train without --check")

    def ensure_original(self, purpose: str) -> None:
        """Fail now, before any step is trained, where `purpose` (-o, --check) will need the model the stages were cut
        from and it is not beside them."""
        if isinstance(self._model, Path) and not self._model.is_file():
            raise OnnxpipeError(f"{self.directory}: {purpose} needs the original model {self.manifest.model!r} beside the stages; "
                                "pass the model instead of the directory")

    def _original(self, purpose: str = "planning") -> onnx.ModelProto:
        """The model the stages were cut from (read when first needed)."""
        if isinstance(self._model, Path):
            self.ensure_original(purpose)
            try:
                model = read_model(self._model)
                load_weights(model, weights_dir(self._model))  # training reads every weight
                self._model = model
            except OnnxpipeError:
                raise
            except Exception as exc:
                raise OnnxpipeError(f"{self._model}: not a readable ONNX model ({type(exc).__name__}); export it again") from exc
        assert self._model is not None
        return self._model


def _beside(directory: Path, recorded: str) -> Path | None:
    """The model a stage directory was cut from: its recorded path as given (absolute or from here), from
    the directory, or by name in the directory or beside it."""
    name = Path(recorded).name
    for candidate in (Path(recorded), directory / recorded, directory / name, directory.parent / name):
        if candidate.is_file():
            return candidate
    return None


def _engine(specs: tuple[StageSpec, ...], manifest: Manifest, target: str, backend: str, address: str | None, device: str,
            processes: bool, bind_cores: bool = False) -> Executor:
    """The executor on the chosen backend: "local" (worker processes, or in-process without `processes`)
    or "ray" (actors on the Ray cluster at `address`, or on one started here). A stage on a gpu device runs
    on CUDA (`providers`) unless `device` is "cpu"; without a usable CUDA provider this fails at once.
    `bind_cores`: each worker process on CPUs of its own (`affinity`)."""
    if backend not in BACKENDS:
        raise OnnxpipeError(f"--backend {backend!r} is not one of {', '.join(BACKENDS)}")
    if bind_cores and not (backend == "local" and processes):
        raise OnnxpipeError("--bind-cores binds the worker processes of --backend local; Ray places its actors itself, and an in-process pipeline has none: drop --bind-cores")
    try:
        devices = {d.name: d for d in load_target(target).devices}
    except OnnxpipeError:
        devices = {}
    names = tuple(_device_of(manifest.stages[s.index].devices, s.replica) for s in specs)
    if backend == "ray":
        try:
            from onnxpipe.train.ray_backend import RayPipeline
            from onnxpipe.train.ray_placement import place
        except ImportError as exc:
            raise OnnxpipeError(f"--backend ray needs Ray ({exc.name} is not installed); pip install 'onnxpipe[ray]'") from exc
        return RayPipeline(specs, place(names, devices, device), address)
    if address is not None:
        raise OnnxpipeError("--address names a Ray cluster; pass --backend ray with it")
    placed = execution_devices(names, devices, device)
    for d in placed:
        ensure_usable(d)
    specs = tuple(dataclasses.replace(s, device=d) for s, d in zip(specs, placed))
    return ProcessPipeline(specs, bind_cores) if processes else LocalPipeline(specs)


def _device_of(devices: tuple[str, ...], replica: int) -> str:
    """The target device a stage's replica runs on ("" where the manifest names none)."""
    return devices[replica] if replica < len(devices) else ""
