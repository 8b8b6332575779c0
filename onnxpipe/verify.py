"""Check a stage directory against the model it was cut from: same random inputs, chained stages vs
the unsplit model in onnxruntime, max relative error per output."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from onnxpipe.chain import chain, session
from onnxpipe.errors import OnnxpipeError
from onnxpipe.manifest import Manifest, StageInput
from onnxpipe.ortutil import cpu_session
from onnxpipe.protostream import read_header
from onnxpipe.safepath import ensure_external_data_inside
from onnxpipe.split import MAX_IR_VERSION

__all__ = ["verify", "random_feeds", "relative_error", "TOLERANCE"]

#: Max relative error (fp32) accepted between chained stages and the unsplit model.
TOLERANCE = 1e-5


def random_feeds(inputs: tuple[StageInput, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Floats ~ N(0, 1); integers (token ids, labels, counts) in [0, 2) so any vocabulary or trip count
    accepts them; booleans at random."""
    feeds = {}
    for spec in inputs:
        dtype = np.dtype(spec.dtype)
        if np.issubdtype(dtype, np.floating):
            feeds[spec.name] = rng.standard_normal(spec.shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[spec.name] = rng.random(spec.shape) < 0.5
        else:
            feeds[spec.name] = rng.integers(0, 2, size=spec.shape).astype(dtype)
    return feeds


def relative_error(got: np.ndarray, want: np.ndarray) -> float:
    """max |got - want| / max |want|: relative to the output's scale, so entries near zero do not blow up."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    diff = float(np.max(np.abs(got - want), initial=0.0))
    scale = float(np.max(np.abs(want), initial=0.0))
    return diff / scale if scale > 0 else diff


def verify(directory: str | os.PathLike, model_path: str | os.PathLike, *, dims: Mapping[str, int] | None = None,
           samples: int = 2, seed: int = 0) -> dict[str, float]:
    """Max relative error per model output over `samples` random input sets."""
    if samples < 1:
        raise OnnxpipeError(f"--samples {samples}: must be at least 1")
    manifest = Manifest.read(directory)
    _ensure_same_dims(Path(directory), dims)
    original = _original_session(Path(model_path))
    names = [o.name for o in manifest.outputs]
    rng = np.random.default_rng(seed)
    errors = dict.fromkeys(names, 0.0)
    for _ in range(samples):
        feeds = random_feeds(manifest.inputs, rng)
        want = dict(zip(names, original.run(names, feeds)))  # type: ignore[attr-defined]
        got = chain(directory, feeds)
        for name in names:
            errors[name] = max(errors[name], relative_error(got[name], want[name]))
    return errors


def _ensure_same_dims(directory: Path, dims: Mapping[str, int] | None) -> None:
    plan_path = directory / "plan.json"
    if not dims or not plan_path.is_file():
        return
    used = json.loads(plan_path.read_text()).get("dims", {})
    differ = {k: v for k, v in dims.items() if used.get(k) != v}
    if differ:
        name, value = next(iter(differ.items()))
        raise OnnxpipeError(f"--dim {name}={value}: the stages were split with {name}={used.get(name)}; verify with the dims used to split")


def _original_session(path: Path) -> object:
    """A session on the unsplit model; models above the IR version onnxruntime loads are lowered in memory."""
    import onnx

    if not path.is_file():
        raise OnnxpipeError(f"{path}: no such file; pass the model the stages were split from")
    try:
        header = read_header(path)
    except Exception as exc:  # protobuf raises several unrelated types on garbage
        raise OnnxpipeError(f"{path}: not a readable ONNX model ({type(exc).__name__}); pass the model the stages were split from") from exc
    ensure_external_data_inside(path, header, "keep a model's external-data files in its own directory and re-save it")
    try:
        return session(path)
    except OnnxpipeError:
        model = onnx.load(str(path))
        if model.ir_version <= MAX_IR_VERSION:
            raise
        model.ir_version = MAX_IR_VERSION
        return cpu_session(model.SerializeToString())
