"""Run a stage directory on plain onnxruntime by following its manifest: in sequence (`chain`) or as
an inference pipeline over micro-batches (`run_pipeline`, one thread and session per stage).

Reading order: `chain` -> `check_feeds` -> `run_pipeline` -> `_StageWorker`.
"""

from __future__ import annotations

import os
import threading
import zipfile
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import atomic_path
from onnxpipe.manifest import Manifest, Stage, StageInput
from onnxpipe.ortutil import cpu_session, ort_reason

__all__ = ["chain", "run_pipeline", "check_feeds", "session", "read_npz", "write_npz"]


def session(path: str | os.PathLike) -> object:
    """An onnxruntime CPU session with quiet logs."""
    try:
        return cpu_session(path)
    except Exception as exc:  # onnxruntime raises its own unrelated types
        raise OnnxpipeError(f"{path}: onnxruntime cannot load it ({ort_reason(exc)}); re-split the model with `onnxpipe split`") from exc


def check_feeds(inputs: tuple[StageInput, ...], feeds: Mapping[str, np.ndarray], microbatches: int = 1) -> dict[str, np.ndarray]:
    """Feeds as arrays of the manifest's dtypes; a missing or wrongly shaped array is an OnnxpipeError
    naming it and the expected shape (axis 0 holds `microbatches` stage batches)."""
    checked = {}
    for spec in inputs:
        expected = _full_shape(spec.shape, microbatches)
        if spec.name not in feeds:
            raise OnnxpipeError(f"input '{spec.name}' is missing; give an array of shape {expected} ({spec.dtype})")
        value = np.asarray(feeds[spec.name])
        if tuple(value.shape) != expected:
            hint = f" ({microbatches} micro-batches of {spec.shape[0]})" if microbatches > 1 and spec.shape else ""
            raise OnnxpipeError(f"input '{spec.name}' has shape {tuple(value.shape)}; the stages expect {expected}{hint}")
        checked[spec.name] = value.astype(spec.dtype, copy=False) if spec.dtype != "unknown" else value
    return checked


def _full_shape(shape: tuple[int, ...], microbatches: int) -> tuple[int, ...]:
    return (shape[0] * microbatches, *shape[1:]) if shape else ()


def chain(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Run the stages in order, each on the model inputs and earlier stages' outputs it lists."""
    manifest = Manifest.read(directory)
    values: dict[str, np.ndarray] = dict(check_feeds(manifest.inputs, feeds))
    for stage in manifest.stages:
        values.update(_run_stage(session(Path(directory) / stage.file), stage, values))
    return {out.name: values[out.name] for out in manifest.outputs}


def _run_stage(sess: object, stage: Stage, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    names = [o.name for o in stage.outputs]
    try:
        results = sess.run(names, {i.name: values[i.name] for i in stage.inputs})  # type: ignore[attr-defined]
    except Exception as exc:  # onnxruntime raises its own unrelated types
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]
        raise OnnxpipeError(f"stage {stage.index} ({stage.file}) failed in onnxruntime: {first}; re-split the model with `onnxpipe split`") from exc
    return dict(zip(names, results))


def run_pipeline(directory: str | os.PathLike, feeds: Mapping[str, np.ndarray], microbatches: int = 1) -> dict[str, np.ndarray]:
    """Inference as a pipeline: inputs cut along axis 0 into micro-batches of the stage files' batch;
    stage i works on micro-batch j while stage i+1 works on j-1; outputs joined along axis 0
    (scalar outputs stacked, one per micro-batch)."""
    if microbatches < 1:
        raise OnnxpipeError(f"--microbatches {microbatches}: must be at least 1")
    manifest = Manifest.read(directory)
    full = check_feeds(manifest.inputs, feeds, microbatches)
    slices = [
        {name: (a if a.ndim == 0 else np.split(a, microbatches)[j]) for name, a in full.items()} for j in range(microbatches)
    ]
    store: list[dict[str, np.ndarray]] = [dict(s) for s in slices]
    workers = [_StageWorker(Path(directory), stage, store) for stage in manifest.stages]
    for worker in workers:
        worker.upstream = [workers[i] for i in sorted({i.source for i in worker.stage.inputs if i.source != "model"})]  # type: ignore[misc]
        worker.start()
    for worker in workers:
        worker.join()
    failed = next((w.error for w in workers if w.error is not None), None)
    if failed is not None:
        raise failed
    outputs = {}
    for out in manifest.outputs:
        parts = [store[j][out.name] for j in range(microbatches)]
        outputs[out.name] = np.stack(parts) if parts[0].ndim == 0 else np.concatenate(parts, axis=0)
    return outputs


class _StageWorker(threading.Thread):
    """One stage: its own session; runs micro-batches in order once every upstream stage has
    finished the same one (onnxruntime releases the GIL, so stages overlap)."""

    def __init__(self, directory: Path, stage: Stage, store: list[dict[str, np.ndarray]]) -> None:
        super().__init__(name=f"stage-{stage.index}", daemon=True)
        self.stage = stage
        self.directory = directory
        self.store = store
        self.upstream: list[_StageWorker] = []
        self.done = [threading.Event() for _ in store]
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            sess = session(self.directory / self.stage.file)
            for j, values in enumerate(self.store):
                for up in self.upstream:
                    up.done[j].wait()
                    if up.error is not None:
                        return
                values.update(_run_stage(sess, self.stage, values))
                self.done[j].set()
        except BaseException as exc:  # reported by run_pipeline after join
            self.error = exc
        finally:
            for event in self.done:
                event.set()


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of an .npz file by name."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except FileNotFoundError:
        raise OnnxpipeError(f"{path}: no such file; pass an .npz with one array per model input (np.savez)") from None
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        raise OnnxpipeError(f"{path}: not a readable .npz ({exc}); write it with np.savez(path, name=array, ...)") from exc


def write_npz(arrays: Mapping[str, np.ndarray], path: str | os.PathLike) -> None:
    """Write atomically: a temp file beside the target, then renamed."""
    target = Path(path)
    try:
        with atomic_path(target) as tmp, open(tmp, "wb") as f:
            np.savez(f, **arrays)
    except OSError as exc:
        raise OnnxpipeError(f"{target}: cannot write ({exc.strerror}); choose another -o") from exc
