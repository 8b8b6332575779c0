"""Inference as a pipeline (`onnxpipe run`, `Pipeline.evaluate`): the same schedule tables (forward only),
stage servers and backends as training; stage i works on micro-batch j while stage i+1 works on j-1.

Reading order: `run_pipeline` -> `join_microbatches`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np

from onnxpipe.chain import check_feeds
from onnxpipe.errors import OnnxpipeError
from onnxpipe.feeds import index_ranges
from onnxpipe.manifest import Manifest
from onnxpipe.train.executor import Executor
from onnxpipe.train.leftovers import sweep_dead_runs
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.prepare import prepare_inference, stage_threads
from onnxpipe.train.processes import ProcessPipeline

__all__ = ["run_pipeline", "join_microbatches"]


def run_pipeline(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray], microbatches: int = 1, *,
                 processes: bool = True) -> dict[str, np.ndarray]:
    """Run the stage files as they are over `feeds` cut along axis 0 into micro-batches of the stage
    files' batch; outputs joined along axis 0 (scalar outputs stacked, one per micro-batch). One worker
    process per stage (`processes`), else every stage in this process, taking turns."""
    if microbatches < 1:
        raise OnnxpipeError(f"--microbatches {microbatches}: must be at least 1")
    manifest = Manifest.read(directory)
    full = check_feeds(manifest.inputs, feeds, microbatches, index_ranges(directory, manifest))
    parts = {name: [a] * microbatches if a.ndim == 0 else np.split(a, microbatches) for name, a in full.items()}
    slices = [{name: p[j] for name, p in parts.items()} for j in range(microbatches)]
    specs = prepare_inference(directory, manifest, microbatches, stage_threads(manifest))
    if processes:
        sweep_dead_runs()
    engine: Executor = ProcessPipeline(specs) if processes else LocalPipeline(specs)
    with engine:
        try:
            per_mb = engine.infer(slices)
        except OnnxpipeError as exc:  # the stage files are run as they are: a bad file or bad values in the inputs
            raise OnnxpipeError(f"{exc}; check the inputs' values, or re-split the model with `onnxpipe split`") from exc
    return join_microbatches(per_mb, [o.name for o in manifest.outputs])


def join_microbatches(per_microbatch: Sequence[Mapping[str, np.ndarray]], names: Sequence[str]) -> dict[str, np.ndarray]:
    """Each named output over all micro-batches: joined along axis 0, scalars stacked."""
    out = {}
    for name in names:
        parts = [np.asarray(mb[name]) for mb in per_microbatch]
        out[name] = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts, axis=0)
    return out
