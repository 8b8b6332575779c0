"""Training data: global batches (from an .npz file or seeded synthetic draws) and their micro-batches.

Step i takes batch i (cycling through a file), so a resumed run sees exactly the data it would have.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.feeds import IndexRange, ensure_feed, read_npz
from onnxpipe.manifest import StageInput
from onnxpipe.units import plural

__all__ = ["split_microbatches", "BatchSource", "SyntheticData", "FileData", "open_data"]

Batch = dict[str, np.ndarray]


def split_microbatches(batch: Mapping[str, np.ndarray], inputs: Sequence[StageInput], microbatches: int) -> list[Batch]:
    """Cut a global batch along axis 0 into micro-batches of the stage files' batch size."""
    parts: list[Batch] = [{} for _ in range(microbatches)]
    for spec in inputs:
        if spec.name not in batch:
            raise OnnxpipeError(f"the batch has no array {spec.name!r}; it needs: {', '.join(i.name for i in inputs)}")
        array = np.asarray(batch[spec.name])
        want = (microbatches * spec.shape[0], *spec.shape[1:]) if spec.shape else ()
        if tuple(array.shape) != want:
            raise OnnxpipeError(
                f"input {spec.name!r} has shape {tuple(array.shape)}, expected {want} "
                f"({plural(microbatches, 'micro-batch')} of {spec.shape[0] if spec.shape else 1}); pass --batch {microbatches * (spec.shape[0] if spec.shape else 1)} or re-split the model for another batch"
            )
        array = ensure_feed(spec, array, {})
        for i, piece in enumerate(np.split(array, microbatches, axis=0)):
            parts[i][spec.name] = np.ascontiguousarray(piece)
    return parts


class BatchSource:
    """Global batch number `step`."""

    def batch(self, step: int) -> Batch:
        raise NotImplementedError


@dataclass(frozen=True)
class SyntheticData(BatchSource):
    """Seeded random batches: floats ~ N(0, 1), integers uniform in [0, high) with `high` from `ranges`."""

    inputs: tuple[StageInput, ...]
    microbatches: int
    ranges: Mapping[str, int]
    seed: int = 0

    def batch(self, step: int) -> Batch:
        rng = np.random.default_rng([self.seed, step])
        out: Batch = {}
        for spec in self.inputs:
            shape = (self.microbatches * spec.shape[0], *spec.shape[1:])
            if np.issubdtype(np.dtype(spec.dtype), np.integer):
                out[spec.name] = rng.integers(0, self.ranges.get(spec.name, 2), size=shape).astype(spec.dtype)
            elif spec.dtype == "bool":
                out[spec.name] = rng.integers(0, 2, size=shape).astype(bool)
            else:
                out[spec.name] = rng.standard_normal(shape).astype(spec.dtype)
        return out


@dataclass(frozen=True)
class FileData(BatchSource):
    """Consecutive batches of `batch` rows of every array in an .npz file, cycling."""

    arrays: Mapping[str, np.ndarray]
    batch_size: int

    def batch(self, step: int) -> Batch:
        rows = len(next(iter(self.arrays.values())))
        count = rows // self.batch_size
        start = (step % count) * self.batch_size
        return {k: v[start:start + self.batch_size] for k, v in self.arrays.items()}


def open_data(path: str | Path, inputs: Sequence[StageInput], batch_size: int, ranges: Mapping[str, IndexRange] | None = None) -> FileData:
    """Read an .npz holding one array per model input (and labels); checks names, row counts, dtypes and index ranges."""
    path = Path(path)
    arrays = read_npz(path)
    missing = [i.name for i in inputs if i.name not in arrays]
    if missing:
        raise OnnxpipeError(f"{path}: no array for input(s) {', '.join(missing)}; it holds: {', '.join(arrays) or 'nothing'}")
    flat = [i.name for i in inputs if arrays[i.name].ndim == 0]
    if flat:
        raise OnnxpipeError(f"{path}: array '{flat[0]}' is a single value (0-d); give one row per sample, batch axis first")
    rows = {len(arrays[i.name]) for i in inputs}
    if len(rows) != 1 or min(rows) < batch_size:
        raise OnnxpipeError(f"{path}: arrays need the same number of rows, at least --batch {batch_size} (got {sorted(rows)})")
    return FileData({i.name: ensure_feed(i, arrays[i.name], ranges or {}) for i in inputs}, batch_size)
