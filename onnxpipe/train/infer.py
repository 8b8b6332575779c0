"""Inference as a pipeline (`onnxpipe run`, `Pipeline.evaluate`): the same schedule tables (forward only),
stage servers and backends as training; stage i works on micro-batch j while stage i+1 works on j-1.

`stream` also measures: each pass over the micro-batches is timed per worker action, and `inference_metrics`
turns the passes into the figures `onnxpipe simulate --json` predicts, under the same keys.

Reading order: `feed_microbatches` -> `run_pipeline` -> `stream` -> `inference_metrics` -> `join_microbatches`.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe.chain import check_feeds
from onnxpipe.errors import OnnxpipeError
from onnxpipe.feeds import index_ranges
from onnxpipe.manifest import Manifest
from onnxpipe.plan.result import Plan
from onnxpipe.simulate import pipeline_latency
from onnxpipe.target import load_target
from onnxpipe.train.executor import Executor, InferStats
from onnxpipe.train.leftovers import sweep_dead_runs
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.prepare import prepare_inference, stage_threads
from onnxpipe.train.processes import ProcessPipeline

__all__ = ["feed_microbatches", "run_pipeline", "stream", "Streamed", "inference_metrics", "join_microbatches"]


@dataclass(frozen=True)
class Streamed:
    """What `stream` returns: the outputs (of the last pass) and the measured figures (`inference_metrics`)."""

    outputs: dict[str, np.ndarray] = field(repr=False)
    metrics: dict[str, Any]


def feed_microbatches(manifest: Manifest, feeds: Mapping[str, np.ndarray]) -> int:
    """Micro-batches in `feeds` by the batch convention: their global batch (axis 0 of the first input with
    one) over the stage files' micro-batch; 1 when that does not divide (the shape check then names the fix)."""
    for spec in manifest.inputs:
        value = feeds.get(spec.name)
        if spec.shape and value is not None and np.ndim(value):
            rows, micro = len(value), spec.shape[0]
            return rows // micro if micro and rows >= micro and rows % micro == 0 else 1
    return 1


def run_pipeline(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray], microbatches: int | None = None, *,
                 processes: bool = True) -> dict[str, np.ndarray]:
    """Run the stage files as they are over `feeds` cut along axis 0 into micro-batches of the stage
    files' batch (`microbatches` of them; default: as many as the feeds hold); outputs joined along axis 0
    (scalar outputs stacked, one per micro-batch). One worker process per stage (`processes`), else every
    stage in this process, taking turns."""
    return stream(directory, feeds, microbatches, processes=processes).outputs


def stream(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray], microbatches: int | None = None, *, repeat: int = 1,
           processes: bool = True) -> Streamed:
    """`run_pipeline`, streaming the micro-batches through the stages `repeat` times (the same inputs; each
    pass starts with an empty pipeline), measured: with more than one pass the first is a warm-up and the
    figures are the medians of the others."""
    manifest = Manifest.read(directory)
    manifest.ensure_numpy_types("run")
    microbatches = feed_microbatches(manifest, feeds) if microbatches is None else microbatches
    if microbatches < 1:
        raise OnnxpipeError(f"--microbatches {microbatches}: must be at least 1")
    if repeat < 1:
        raise OnnxpipeError(f"--repeat {repeat}: must be at least 1")
    full = check_feeds(manifest.inputs, feeds, microbatches, index_ranges(directory, manifest))
    parts = {name: [a] * microbatches if a.ndim == 0 else np.split(a, microbatches) for name, a in full.items()}
    slices = [{name: p[j] for name, p in parts.items()} for j in range(microbatches)]
    specs = prepare_inference(directory, manifest, microbatches, stage_threads(manifest))
    if processes:
        sweep_dead_runs()
    engine: Executor = ProcessPipeline(specs) if processes else LocalPipeline(specs)
    passes: list[InferStats] = []
    with engine:
        try:
            for _ in range(repeat):
                per_mb = engine.infer(slices)
                assert engine.last_inference is not None
                passes.append(engine.last_inference)
        except OnnxpipeError as exc:  # the stage files are run as they are: a bad file or bad values in the inputs
            raise OnnxpipeError(f"{exc}; check the inputs' values, or re-split the model with `onnxpipe split`") from exc
    rows = next((len(a) for a in full.values() if a.ndim), microbatches)
    metrics = inference_metrics(passes[1:] or passes, batch=rows, microbatches=microbatches, schedule=_schedule(directory),
                                devices=tuple(s.devices for s in manifest.stages), capacity=_capacity(manifest))
    return Streamed(join_microbatches(per_mb, [o.name for o in manifest.outputs]), metrics)


def inference_metrics(passes: Sequence[InferStats], *, batch: int, microbatches: int, schedule: str,
                      devices: Sequence[Sequence[str]], capacity: Sequence[float]) -> dict[str, Any]:
    """Measured passes under `Simulation.to_json`'s keys (medians over the passes): a pass's seconds are the
    driver's wall time for it (posting the inputs, the workers' rows, collecting the outputs: what the
    simulator's iteration and the targets' `step_overhead` count), the latency is micro-batch 0's first
    stage's forward start to its last stage's forward end, in a pipeline it entered empty."""
    stages = len(devices)
    seconds = statistics.median(p.seconds for p in passes)
    places = passes[0].places
    busy = [statistics.median(col) for col in zip(*(p.busy_seconds for p in passes))]
    rss = [max(col) for col in zip(*(p.peak_rss_bytes for p in passes))]
    replicas: list[list[dict[str, Any]]] = [[] for _ in range(stages)]
    for (stage, replica), b, m in zip(places, busy, rss):
        replicas[stage].append({"replica": replica, "busy_seconds": b, "peak_memory_bytes": float(m)})
    last = passes[-1]
    first = min(e.start for e in last.events)
    return {
        "schedule": schedule,
        "microbatches": microbatches,
        "batch": batch,
        "iteration_seconds": seconds,
        "samples_per_s": batch / seconds if seconds > 0 else 0.0,
        "bubble_fraction": max(0.0, 1 - sum(busy) / (len(places) * seconds)) if seconds > 0 else 0.0,
        "latency_seconds": statistics.median(pipeline_latency(p.events, stages) for p in passes),
        "stages": [
            {"stage": s, "devices": list(devices[s]), "busy_seconds": max(r["busy_seconds"] for r in replicas[s]),
             "peak_memory_bytes": max(r["peak_memory_bytes"] for r in replicas[s]), "capacity_bytes": float(capacity[s]), "replicas": replicas[s]}
            for s in range(stages)
        ],
        "events": [[e.stage, e.kind, e.microbatch, e.start - first, e.end - first, e.replica] for e in last.events],
    }


def join_microbatches(per_microbatch: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Each named output over all micro-batches: joined along axis 0, scalars stacked."""
    out = {}
    for name in names:
        parts = [np.asarray(mb[name]) for mb in per_microbatch]
        out[name] = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts, axis=0)
    return out


def _schedule(directory: str | os.PathLike) -> str:
    """The schedule the directory's plan names (its forward-only rows are what ran), 1f1b without a plan."""
    try:
        return Plan.read(Path(directory) / "plan.json").schedule
    except OnnxpipeError:
        return "1f1b"


def _capacity(manifest: Manifest) -> tuple[float, ...]:
    """Per stage: the memory of its first device in the manifest's target; 0 where the target cannot be found."""
    try:
        by_name = {d.name: d.memory_bytes for d in load_target(manifest.target).devices}
    except OnnxpipeError:
        return tuple(0.0 for _ in manifest.stages)
    return tuple(float(by_name.get(s.devices[0], 0.0)) for s in manifest.stages)
