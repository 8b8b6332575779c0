"""`Pipeline`: the public face of pipelined training. From a model (planned on a target and split
into a temporary stage directory) or from a stage directory; runs stages as worker processes, one
per stage replica (or in-process), and saves, loads and exports what it trained.

Reading order: `Pipeline.__init__` -> `_stage_directory` -> train_step / evaluate -> metrics
-> save / load / export.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import atomic_path
from onnxpipe.gradients import ensure_gradients
from onnxpipe.initializers import SharedInitializer, TieChoice, untie
from onnxpipe.manifest import Manifest
from onnxpipe.protostream import load_weights, read_model
from onnxpipe.simulate import Event
from onnxpipe.train.checkpoint import load_checkpoint, save_checkpoint
from onnxpipe.train.data import split_microbatches
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.loss import LossSpec
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.prepare import TrainConfig, model_inputs, prepare_single, prepare_stages
from onnxpipe.train.timeline import step_events

__all__ = ["Pipeline"]


class Pipeline:
    """Pipelined training of one model. Use as a context manager: workers stop on exit."""

    def __init__(
        self,
        source: str | os.PathLike | onnx.ModelProto,
        target: str = "cpu2",
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
        tie: tuple[str, ...] = (),
        untie: tuple[str, ...] = (),
        shapes_by_running: bool = False,
    ) -> None:
        self.config = TrainConfig(schedule, microbatches, optimizer or OptimizerConfig(), loss, recompute)
        self._tmp: Path | None = None
        self.model: onnx.ModelProto | None = None
        #: Shapes static inference cannot find are read off one run on zeros (`onnxpipe.graph.load`).
        self.shapes_by_running = shapes_by_running
        #: The model's weights read by several nodes and what was decided (`onnxpipe.initializers`); empty from a stage directory.
        self.shared: tuple[SharedInitializer, ...] = ()
        self.directory, self.manifest = self._stage_directory(source, target, stages, batch, dims, time_limit, TieChoice.of(tie, untie))
        #: What the stages were cut from: the model with exactly the manifest's untied weights untied.
        self.ties = TieChoice(untie=frozenset(self.manifest.untied), exact=True)
        self.inputs = model_inputs(self.manifest, self.config)
        self.batch = microbatches * (self.inputs[0].shape[0] if self.inputs[0].shape else 1)
        threads = tuple(self._threads(target, s.devices) for s in self.manifest.stages)
        specs = prepare_stages(self.directory, self.manifest, self.config, threads)
        self.stages = len(self.manifest.stages)
        #: Per worker: (stage, replica).
        self.places = tuple((s.index, s.replica) for s in specs)
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
        if processes:
            from onnxpipe.train.executor import ProcessPipeline

            self.engine: Any = ProcessPipeline(specs)
        else:
            self.engine = LocalPipeline(specs)

    def _stage_directory(self, source: Any, target: str, stages: int | None, batch: int | None, dims: Mapping[str, int] | None,
                         time_limit: float, ties: TieChoice) -> tuple[Path, Manifest]:
        if isinstance(source, (str, os.PathLike)) and Path(source).is_dir():
            manifest = Manifest.read(source)
            model_path = Path(source) / manifest.model
            if model_path.is_file():
                self.model = onnx.load(str(model_path))
            return Path(source), manifest
        from onnxpipe.cost import annotate
        from onnxpipe.graph import load
        from onnxpipe.plan import plan
        from onnxpipe.split import split
        from onnxpipe.target import load_target

        model = source if isinstance(source, onnx.ModelProto) else _read_model(source)
        self.model = model
        dims = dict(dims or {})
        m = self.config.microbatches
        for vi in model.graph.input:
            shape = vi.type.tensor_type.shape.dim
            if shape and shape[0].dim_param and shape[0].dim_param not in dims:
                if batch is None:
                    raise OnnxpipeError(f"input {vi.name!r} has a symbolic batch dim {shape[0].dim_param!r}; pass --batch B (or --dim {shape[0].dim_param}=V)")
                dims[shape[0].dim_param] = batch // m
        graph = load(model, dims, ties, shapes_by_running=self.shapes_by_running)
        ensure_gradients(graph.model, None, graph.source if isinstance(source, onnx.ModelProto) else str(source))  # before planning and workers
        self.shared = graph.shared
        if not isinstance(source, onnx.ModelProto):  # errors and the manifest name the file, not "<memory>"
            graph = dataclasses.replace(graph, source=str(source))
        if batch is not None and batch != graph.batch * m:
            raise OnnxpipeError(f"--batch {batch} must be {m} micro-batches of the model's batch {graph.batch}: pass --batch {graph.batch * m} or change --microbatches")
        tgt = load_target(target)
        the_plan = plan(graph, annotate(graph), tgt, stages=stages, microbatches=m, schedule=self.config.schedule,
                        optimizer="adam" if self.config.optimizer.name == "adamw" else "sgd", recompute=self.config.recompute,
                        time_limit=time_limit)
        self._tmp = Path(tempfile.mkdtemp(prefix="onnxpipe-train-"))
        manifest = split(graph, the_plan, self._tmp / "stages", force=True)
        return self._tmp / "stages", manifest

    @staticmethod
    def _threads(target: str, devices: tuple[str, ...]) -> int:
        try:
            from onnxpipe.target import load_target

            by_name = {d.name: d for d in load_target(target).devices}
            return max(1, max((by_name[d].threads for d in devices if d in by_name), default=1))
        except OnnxpipeError:
            return 1

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.engine.close()
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def microbatches(self, batch: Mapping[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
        return split_microbatches(batch, self.inputs, self.config.microbatches)

    def train_step(self, batch: Mapping[str, np.ndarray]) -> float:
        """One optimizer step on a global batch (every model input, labels included); returns its mean loss."""
        mbs = self.microbatches(batch)
        before = [r.busy_seconds for r in self.engine.runners] if isinstance(self.engine, LocalPipeline) else None
        start = time.perf_counter()
        loss = self.engine.train_step(mbs)
        seconds = time.perf_counter() - start
        if before is not None:
            self.last_events = step_events(start, [p.take_timings() for p in self.engine.programs], [s for s, _ in self.places])
            self._busy.append(tuple(r.busy_seconds - b for r, b in zip(self.engine.runners, before)))
            self._copy.append(tuple(0.0 for _ in before))
            self._copy_cpu.append(tuple(0.0 for _ in before))
            self._stash_peaks = tuple(r.peak_stash_bytes for r in self.engine.runners)
        else:
            last = self.engine.last
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
        """Forward only: every model output over the global batch (joined along axis 0), and the mean loss."""
        per_mb = self.engine.evaluate(self.microbatches(batch))
        loss_name = self.config.loss.name if self.config.loss else self.manifest.loss
        out: dict[str, Any] = {}
        for o in self.manifest.outputs:
            if o.name != loss_name and o.name in per_mb[0]:
                out[o.name] = np.concatenate([mb[o.name] for mb in per_mb], axis=0)
        if loss_name and loss_name in per_mb[0]:
            out["loss"] = float(np.mean([float(mb[loss_name]) for mb in per_mb]))
        return out

    def parameters(self) -> dict[str, np.ndarray]:
        return self.engine.parameters()

    def metrics(self) -> dict[str, Any]:
        """Measured numbers under the simulator's names (per-step medians after the first step).

        Measurements are per worker; `stages` keeps one entry per stage whose figures are the largest
        over its replicas, and `replicas` lists each replica's own (one entry for an unreplicated stage).
        Fractions are over all workers: bubble = 1 - sum(busy) / (workers x step seconds)."""
        steady = slice(1, None) if len(self._seconds) > 1 else slice(None)
        seconds = statistics.median(self._seconds[steady]) if self._seconds else 0.0
        busy = [statistics.median(col) for col in zip(*self._busy[steady])] if self._busy else []
        copy = [statistics.median(col) for col in zip(*self._copy[steady])] if self._copy else []
        copy_cpu = [statistics.median(col) for col in zip(*self._copy_cpu[steady])] if self._copy_cpu else []
        workers = len(self.places)
        per_worker = [
            {"replica": r, "busy_seconds": b, "transfer_seconds": c,
             "peak_memory_bytes": self._peaks[w] if w < len(self._peaks) else None,
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
            "bubble_fraction": max(0.0, 1 - sum(busy) / (workers * seconds)) if seconds else 0.0,
            "transfer_fraction": sum(copy) / (workers * seconds) if seconds else 0.0,
            "transfer_cpu_fraction": sum(copy_cpu) / (workers * seconds) if seconds else 0.0,
            "stages": stages,
            "schedule": self.config.schedule,
            "microbatches": self.config.microbatches,
            "batch": self.batch,
        }

    def save(self, directory: str | os.PathLike) -> None:
        """Checkpoint weights, optimizer state and the step (the data cursor)."""
        save_checkpoint(directory, self.step, self.engine.state(), {"losses": self.losses, "schedule": self.config.schedule,
                                                                  "optimizer": self.config.optimizer.name, "stages": self.stages})

    def load(self, directory: str | os.PathLike) -> int:
        """Restore a checkpoint; returns the step training continues from."""
        step, states, meta = load_checkpoint(directory)
        trained_with = meta.get("optimizer", self.config.optimizer.name)
        if trained_with != self.config.optimizer.name:
            raise OnnxpipeError(f"{directory}: the checkpoint was trained with {trained_with}, this run uses {self.config.optimizer.name}; "
                                f"resume with --optimizer {trained_with} or start without --resume")
        if len(states) != self.stages:
            raise OnnxpipeError(f"{directory}: checkpoint has {len(states)} stages, this pipeline {self.stages}; resume with the same stage directory")
        self.engine.load_state(states)
        self.step = step
        self.losses = list(meta.get("losses", []))[:step]
        return step

    def export(self, path: str | os.PathLike) -> None:
        """The original model with its initializers replaced by the trained weights (atomic write).

        Initializers keep the model's names; an untied one is written as its separate copies (the
        first reading module keeps the name, the others' copies are named after their modules)."""
        if self.model is None:
            raise OnnxpipeError(f"{self.directory}: the original model {self.manifest.model!r} is not beside the stages; build the Pipeline from the model to export")
        trained = self.parameters()
        model = untie(self.model, self.manifest.untied)
        for i, t in enumerate(model.graph.initializer):
            if t.name in trained:
                model.graph.initializer[i].CopyFrom(numpy_helper.from_array(trained[t.name].astype(numpy_helper.to_array(t).dtype), t.name))
        path = Path(path)
        with atomic_path(path) as tmp:
            onnx.save(model, str(tmp))

    def reference(self) -> LocalPipeline:
        """The unpartitioned model trained in one process on the same micro-batches (for --check)."""
        if self.model is None:
            raise OnnxpipeError(f"{self.directory}: --check needs the original model beside the stages; pass the model instead of the directory")
        from onnxpipe.graph import load

        return LocalPipeline([prepare_single(load(self.model, ties=self.ties, shapes_by_running=self.shapes_by_running).model, self.config, self.manifest.loss)])


def _read_model(path: str | os.PathLike) -> onnx.ModelProto:
    if not Path(path).is_file():
        raise OnnxpipeError(f"{path}: no such model file or stage directory; pass an .onnx file or a directory written by `onnxpipe split`")
    try:
        model = read_model(path)
        load_weights(model, Path(path).parent)  # training reads every weight
        return model
    except OnnxpipeError:
        raise
    except Exception as exc:
        raise OnnxpipeError(f"{path}: not a readable ONNX model ({type(exc).__name__}); export it again") from exc
