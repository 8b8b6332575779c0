"""Check a stage directory against the model it was cut from: same random inputs, chained stages vs
the unsplit model in onnxruntime, max relative error per output.

A quantized model is compared op by op (onnxruntime's graph fusions off on both sides): fused int8 kernels
(DequantizeLinear -> op -> QuantizeLinear made one QLinear kernel) round differently from the nodes they replace,
and a stage boundary inside such a pattern leaves it unfused in the stages while the whole model fuses it, so
fused runs differ by quantization steps that say nothing about the cut. Op by op, the stages compute exactly
the model's arithmetic."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx

from onnxpipe.batching import BatchBinding, stage_binding
from onnxpipe.chain import chain, session
from onnxpipe.errors import OnnxpipeError
from onnxpipe.manifest import Manifest, StageInput
from onnxpipe.nodes import is_float_dtype
from onnxpipe.ortutil import MAX_IR_VERSION, cpu_session, ort_reason
from onnxpipe.protostream import read_user_model
from onnxpipe.quantized import is_quantized
from onnxpipe.safepath import ensure_external_data_inside

__all__ = ["verify", "stage_batch", "op_by_op", "random_feeds", "relative_error", "tolerance", "TOLERANCE"]

#: Max relative error (fp32, fp64) accepted between chained stages and the unsplit model.
TOLERANCE = 1e-5
#: Half-precision outputs: a stage boundary rounds activations to the format, whose unit roundoff is
#: 4.9e-4 (float16) and 3.9e-3 (bfloat16); a few roundings through a layer or two stay within these.
_HALF_TOLERANCES = {"float16": 1e-2, "bfloat16": 5e-2}


def tolerance(dtype: str, rtol: float | None = None) -> float:
    """The relative error accepted for an output of `dtype`: `rtol` when given, else by precision
    (integers and booleans must match exactly)."""
    if rtol is not None:
        return rtol
    if dtype in _HALF_TOLERANCES:
        return _HALF_TOLERANCES[dtype]
    return TOLERANCE if dtype == "unknown" or dtype.startswith(("float", "complex")) else 0.0


def random_feeds(inputs: tuple[StageInput, ...], rng: np.random.Generator) -> dict[str, np.ndarray]:
    """Floats ~ N(0, 1); integers (token ids, labels, counts) in [0, 2) so any vocabulary or trip count
    accepts them; booleans at random."""
    feeds = {}
    for spec in inputs:
        dtype = np.dtype(spec.dtype)
        if is_float_dtype(dtype):
            feeds[spec.name] = rng.standard_normal(spec.shape).astype(dtype)
        elif dtype == np.bool_:
            feeds[spec.name] = rng.random(spec.shape) < 0.5
        else:
            feeds[spec.name] = rng.integers(0, 2, size=spec.shape).astype(dtype)
    return feeds


def relative_error(got: np.ndarray, want: np.ndarray, atol: float = 0.0) -> float:
    """max |got - want| / max |want|: relative to the output's scale, so entries near zero do not blow up;
    differences up to `atol` count as none."""
    got, want = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    if got.shape != want.shape:
        return float("inf")
    diff = max(0.0, float(np.max(np.abs(got - want), initial=0.0)) - atol)
    scale = float(np.max(np.abs(want), initial=0.0))
    return diff / scale if scale > 0 else diff


def verify(directory: str | os.PathLike, model_path: str | os.PathLike, *, dims: Mapping[str, int] | None = None,
           samples: int = 2, seed: int = 0, atol: float = 0.0) -> dict[str, float]:
    """Max relative error per model output over `samples` random input sets (beyond `atol`)."""
    if samples < 1:
        raise OnnxpipeError(f"--samples {samples}: must be at least 1")
    manifest = Manifest.read(directory)
    manifest.ensure_numpy_types("verify")
    fused = not op_by_op(model_path)
    original = _original_session(Path(model_path), fused)
    stage_batch(directory, model_path, dims)
    names = [o.name for o in manifest.outputs]
    _ensure_same_interface(manifest, original, model_path)
    rng = np.random.default_rng(seed)
    errors = dict.fromkeys(names, 0.0)
    for _ in range(samples):
        feeds = random_feeds(manifest.inputs, rng)
        try:
            want = dict(zip(names, original.run(names, feeds)))  # type: ignore[attr-defined]
        except Exception as exc:  # onnxruntime raises its own types
            raise OnnxpipeError(f"{model_path}: onnxruntime cannot run the model itself ({ort_reason(exc)}), so there is nothing to compare the "
                                "stages with; `run` the stages, or verify against a model onnxruntime runs") from exc
        got = chain(directory, feeds, optimize=fused)
        for name in names:
            errors[name] = max(errors[name], relative_error(got[name], want[name], atol))
    return errors


def _ensure_same_interface(manifest: Manifest, original: object, model_path: str | os.PathLike) -> None:
    """The model takes the inputs the stages take and makes the outputs they make."""
    for kind, theirs, ours in (("inputs", original.get_inputs(), manifest.inputs), ("outputs", original.get_outputs(), manifest.outputs)):  # type: ignore[attr-defined]
        have, want = sorted(v.name for v in theirs), sorted(v.name for v in ours)
        if have != want:
            raise OnnxpipeError(f"{model_path}: its {kind} {have} differ from the stages' {want}; pass the model the stages were split from")


def stage_batch(directory: str | os.PathLike, model_path: str | os.PathLike, dims: Mapping[str, int] | None = None) -> tuple[BatchBinding, int, int]:
    """How the stages bind the model's batch (their files' shapes; `dims` must agree with them), and the
    (global batch, micro-batches) of the directory's plan, or one micro-batch when it has none."""
    from onnxpipe.plan.result import Plan

    manifest = Manifest.read(directory)
    binding = stage_binding(model_path, {i.name: i.shape for i in manifest.inputs}, dims)
    micro = binding.microbatch or 1
    plan_path = Path(directory) / "plan.json"
    plan = Plan.read(plan_path) if plan_path.is_file() else None
    if plan is not None and plan.batch == micro * plan.microbatches:
        return binding, plan.batch, plan.microbatches
    return binding, micro, 1


def op_by_op(model_path: str | os.PathLike) -> bool:
    """Whether `verify` compares this model and its stages op by op (a quantized model), read from its header."""
    return is_quantized(_header(Path(model_path)))


def _header(path: Path) -> onnx.ModelProto:
    way_out = "pass the model the stages were split from"
    return read_user_model(path, way_out, way_out, weights=False)


def _original_session(path: Path, optimize: bool) -> object:
    """A session on the unsplit model; models above the IR version onnxruntime loads are lowered in memory."""
    ensure_external_data_inside(path, _header(path), "keep a model's external-data files in its own directory and re-save it")
    try:
        return session(path, optimize)
    except OnnxpipeError:
        model = onnx.load(str(path))
        if model.ir_version <= MAX_IR_VERSION:
            raise
        model.ir_version = MAX_IR_VERSION
        return cpu_session(model.SerializeToString(), optimize=optimize)
