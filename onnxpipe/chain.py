"""Run a stage directory on plain onnxruntime by following its manifest, in sequence (`chain`); the
feed checks and .npz files that `run` shares. (Inference as a pipeline over micro-batches runs on the
executor: `onnxpipe.train.infer.run_pipeline`.)

Reading order: `chain` -> `check_feeds` -> `write_npz`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.feeds import IndexRange, ensure_feed, index_ranges
from onnxpipe.fileio import atomic_path
from onnxpipe.manifest import Manifest, Stage, StageInput
from onnxpipe.ortutil import cpu_session, ort_reason

__all__ = ["chain", "check_feeds", "session", "write_npz"]


def session(path: str | os.PathLike, optimize: bool = True) -> object:
    """An onnxruntime CPU session with quiet logs; `optimize=False` runs the file's own nodes one by one."""
    try:
        return cpu_session(path, optimize=optimize)
    except Exception as exc:  # onnxruntime raises its own unrelated types
        raise OnnxpipeError(f"{path}: onnxruntime cannot load it ({ort_reason(exc)}); re-split the model with `onnxpipe split`") from exc


def check_feeds(inputs: tuple[StageInput, ...], feeds: Mapping[str, np.ndarray], microbatches: int = 1,
                ranges: Mapping[str, IndexRange] | None = None) -> dict[str, np.ndarray]:
    """Feeds as arrays of the manifest's dtypes; a missing or wrongly shaped array, a dtype that does not
    fit or an index outside `ranges` is an OnnxpipeError naming it (axis 0 holds `microbatches` stage batches)."""
    checked = {}
    for spec in inputs:
        expected = _full_shape(spec.shape, microbatches)
        if spec.name not in feeds:
            raise OnnxpipeError(f"input '{spec.name}' is missing; give an array of shape {expected} ({spec.dtype})")
        value = np.asarray(feeds[spec.name])
        if tuple(value.shape) != expected:
            hint = f" ({microbatches} micro-batches of {spec.shape[0]})" if microbatches > 1 and spec.shape else ""
            raise OnnxpipeError(f"input '{spec.name}' has shape {tuple(value.shape)}; the stages expect {expected}{hint}")
        checked[spec.name] = ensure_feed(spec, value, ranges or {})
    return checked


def _full_shape(shape: tuple[int, ...], microbatches: int) -> tuple[int, ...]:
    return (shape[0] * microbatches, *shape[1:]) if shape else ()


def chain(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray], optimize: bool = True) -> dict[str, np.ndarray]:
    """Run the stages in order, each on the model inputs and earlier stages' outputs it lists (`optimize=False`:
    each stage's nodes one by one, without onnxruntime's graph fusions)."""
    manifest = Manifest.read(directory)
    manifest.ensure_numpy_types("run")
    values: dict[str, np.ndarray] = dict(check_feeds(manifest.inputs, feeds, ranges=index_ranges(directory, manifest)))
    for stage in manifest.stages:
        values.update(_run_stage(session(Path(directory) / stage.file, optimize), stage, values))
    return {out.name: values[out.name] for out in manifest.outputs}


def _run_stage(sess: object, stage: Stage, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in stage.outputs]
    try:
        results = sess.run(names, {i.name: values[i.name] for i in stage.inputs})  # type: ignore[attr-defined]
    except Exception as exc:  # onnxruntime raises its own unrelated types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise OnnxpipeError(f"stage {stage.index} ({stage.file}) failed in onnxruntime: {first}; re-split the model with `onnxpipe split`") from exc
    return dict(zip(names, results))




def write_npz(arrays: Mapping[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write atomically: a temp file beside the target, then renamed."""
    target = Path(path)
    try:
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        raise OnnxpipeError(f"{target}: cannot write ({exc.strerror}); choose another -o") from exc
