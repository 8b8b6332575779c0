"""The stage-directory contract: `manifest.json` says how the `stage_<i>.onnx` files chain into the model.

Plain JSON on purpose: a runtime without onnxpipe chains the stages by reading it alone.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.ortutil import ensure_numpy_types
from onnxpipe.records import RecordError, read_record
from onnxpipe.safepath import reference_from, reference_to

__all__ = ["MANIFEST_FORMAT", "StageInput", "StageOutput", "Stage", "SharedInitializer", "Manifest"]

MANIFEST_FORMAT = "onnxpipe.stages/1"


@dataclass(frozen=True)
class StageInput:
    name: str
    dtype: str
    shape: tuple[int, ...]
    #: "model" for a model input, else the index of the producing stage.
    source: str | int


@dataclass(frozen=True)
class StageOutput:
    name: str
    dtype: str
    shape: tuple[int, ...]
    #: Stage indices that read it, and/or "model" when it is a model output.
    consumers: tuple[str | int, ...]


@dataclass(frozen=True)
class Stage:
    index: int
    #: File name relative to the directory.
    file: str
    #: Device instance names from the plan.
    devices: tuple[str, ...]
    inputs: tuple[StageInput, ...]
    outputs: tuple[StageOutput, ...]
    #: Trainable initializers held by the stage.
    parameters: tuple[str, ...]
    #: Activation policy chosen by the plan: recompute in backward instead of stashing.
    recompute: bool
    #: Compute nodes placed in the stage (constant chains copied in are not counted).
    nodes: int = 0
    #: Bytes of the stage's trainable initializers.
    parameter_bytes: int = 0
    #: Bytes of the stage file plus its external-data file, if any.
    file_bytes: int = 0
    #: External-data file beside the stage file (models over 2 GB), else None.
    data_file: str | None = None


@dataclass(frozen=True)
class SharedInitializer:
    """An initializer copied into several stages (tied weights): its gradients are summed across them."""

    name: str
    stages: tuple[int, ...]


@dataclass(frozen=True)
class Manifest:
    model: str
    target: str
    inputs: tuple[StageInput, ...]
    #: Model outputs in the original order; `consumers` is ("model",) and the producing stage is found from the stages.
    outputs: tuple[StageOutput, ...]
    stages: tuple[Stage, ...]
    shared: tuple[SharedInitializer, ...]
    #: Name of the model's scalar loss output when it has one.
    loss: str | None = None
    #: Initializers of the model file that were untied (one copy per reading module, `onnxpipe.initializers.untie`):
    #: loading the model again with exactly these untied gives the graph the stages were cut from.
    untied: tuple[str, ...] = ()

    def ensure_numpy_types(self, doing: str) -> None:
        """`ensure_numpy_types` of the model's inputs, outputs and cut tensors."""
        crossing = [*self.inputs, *self.outputs, *(t for s in self.stages for t in (*s.inputs, *s.outputs))]
        ensure_numpy_types(self.model, ((t.name, t.dtype) for t in crossing), doing)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["format"] = MANIFEST_FORMAT
        return data

    @classmethod
    def from_json(cls, data: object, origin: str = "<manifest>") -> Manifest:
        """The manifest in `data`, every field's type and value checked (an OnnxpipeError naming the field)."""
        return read_record(cls, data, origin, MANIFEST_FORMAT, _ensure_values, kind="manifest",
                           write="write the directory with `onnxpipe split`", rewrite="rewrite the directory with `onnxpipe split`")

    @classmethod
    def read(cls, directory: str | os.PathLike) -> Manifest:
        path = Path(directory) / "manifest.json"
        if not path.is_file():
            raise OnnxpipeError(f"{directory}: no manifest.json; pass a directory written by `onnxpipe split`")
        try:
            data = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as exc:
            raise OnnxpipeError(f"{path}: not valid JSON ({exc}); rewrite the directory with `onnxpipe split`") from exc
        manifest = cls.from_json(data, str(path))
        _ensure_consistent(manifest, Path(directory))
        return dataclasses.replace(manifest, model=reference_to(manifest.model, directory))

    def write(self, directory: str | os.PathLike) -> None:
        """manifest.json in `directory`, the model's path recorded relative to it."""
        path = Path(directory) / "manifest.json"
        path.write_text(json.dumps(self.to_json() | {"model": reference_from(self.model, directory)}, indent=2))


#: Bytes one tensor named in a manifest may have: far beyond any real model, short of what numpy refuses to allocate.
_MAX_TENSOR_BYTES = 2**40


@functools.cache
def _dtype_names() -> frozenset[str]:
    """The numpy names of ONNX's tensor types (what `split` writes), plus "unknown" for untyped values."""
    import onnx
    from onnx import helper

    names = {"unknown"}
    for code in onnx.TensorProto.DataType.values():
        try:
            names.add(np.dtype(helper.tensor_dtype_to_np_dtype(code)).name)
        except (KeyError, TypeError, ValueError):
            continue
    return frozenset(names)


def _ensure_values(manifest: Manifest) -> None:
    """Values the types alone do not rule out: dtypes, shapes, sources and consumers."""
    tensors = [("inputs", manifest.inputs), ("outputs", manifest.outputs),
               *((f"stages[{i}].inputs", s.inputs) for i, s in enumerate(manifest.stages)),
               *((f"stages[{i}].outputs", s.outputs) for i, s in enumerate(manifest.stages))]
    for where, specs in tensors:
        for k, spec in enumerate(specs):
            path = f"{where}[{k}]"
            if spec.dtype not in _dtype_names():
                raise RecordError(f"{path}.dtype: {spec.dtype!r} is no ONNX tensor type")
            if any(d < 0 for d in spec.shape):
                raise RecordError(f"{path}.shape: {list(spec.shape)} has a negative dim")
            if spec.dtype != "unknown" and math.prod(spec.shape) * np.dtype(spec.dtype).itemsize > _MAX_TENSOR_BYTES:
                raise RecordError(f"{path}.shape: {list(spec.shape)} is larger than any tensor onnxpipe handles")
            ends = (spec.source,) if isinstance(spec, StageInput) else spec.consumers
            if any(isinstance(e, str) and e != "model" or isinstance(e, int) and e < 0 for e in ends):
                raise RecordError(f"{path}: {'source' if isinstance(spec, StageInput) else 'consumers'} must be \"model\" or stage indices")
    for i, stage in enumerate(manifest.stages):
        if min(stage.nodes, stage.parameter_bytes, stage.file_bytes) < 0:
            raise RecordError(f"stages[{i}]: nodes, parameter_bytes and file_bytes must not be negative")


def _ensure_consistent(manifest: Manifest, directory: Path) -> None:
    """The manifest agrees with itself (stages in order, every input made by an earlier stage that
    says it sends it) and with its stage files' graph inputs and outputs (names, dtypes, shapes),
    read from the files' headers without their weights."""
    where = directory / "manifest.json"

    def fail(problem: str) -> None:
        raise OnnxpipeError(f"{where}: {problem}; the directory was edited or is incomplete, rewrite it with `onnxpipe split`")

    if not manifest.stages:
        fail("no stages")
    model_inputs = {i.name for i in manifest.inputs}
    sent = {(s.index, o.name): o.consumers for s in manifest.stages for o in s.outputs}
    for position, stage in enumerate(manifest.stages):
        if stage.index != position:
            fail(f"stage {position} is listed with index {stage.index}; stages must be numbered 0..{len(manifest.stages) - 1} in order")
        for i in stage.inputs:
            if i.source == "model":
                if i.name not in model_inputs:
                    fail(f"stage {stage.index} input '{i.name}' comes from the model, which has no such input")
            elif not isinstance(i.source, int) or not 0 <= i.source < stage.index:
                fail(f"stage {stage.index} input '{i.name}' comes from stage {i.source!r}, not an earlier stage")
            elif stage.index not in sent.get((i.source, i.name), ()):
                fail(f"stage {stage.index} input '{i.name}' is not sent to it by stage {i.source}")
        _ensure_stage_file(stage, directory, fail)
    made = {name for _, name in sent} | model_inputs
    for out in manifest.outputs:
        if out.name not in made:
            fail(f"model output '{out.name}' is made by no stage")
    for shared in manifest.shared:
        if any(not 0 <= s < len(manifest.stages) for s in shared.stages):
            fail(f"shared initializer '{shared.name}' names a stage out of range {tuple(shared.stages)}")


def _ensure_stage_file(stage: Stage, directory: Path, fail: Callable[[str], None]) -> None:
    import onnx
    from onnx import helper

    from onnxpipe.protostream import read_header
    from onnxpipe.safepath import ensure_external_data_inside, inside

    fix = "stage directories name only files inside themselves, rewrite it with `onnxpipe split`"
    path = inside(directory, stage.file, f"{directory / 'manifest.json'}: stage {stage.index} file", fix)
    if not path.is_file():
        fail(f"stage {stage.index} file {stage.file} is missing")
    if stage.data_file is not None:
        data_file = inside(directory, stage.data_file, f"{directory / 'manifest.json'}: stage {stage.index} weights file", fix)
        if not data_file.is_file():
            fail(f"stage {stage.index} weights file {stage.data_file} is missing")
    try:
        header = read_header(path)
    except OnnxpipeError:
        raise  # a model onnxruntime cannot load, said as read_header says it
    except Exception as exc:  # protobuf raises several unrelated types on garbage
        fail(f"stage {stage.index} file {stage.file} is not a readable ONNX model ({type(exc).__name__})")
    ensure_external_data_inside(path, header, fix)
    graph = header.graph
    declared = {vi.name: vi for vi in [*graph.input, *graph.output]}
    initializers = {t.name for t in graph.initializer}
    for kind, specs, names in (("input", stage.inputs, [vi.name for vi in graph.input if vi.name not in initializers]),
                               ("output", stage.outputs, [vi.name for vi in graph.output])):
        if sorted(s.name for s in specs) != sorted(names):
            fail(f"stage {stage.index} {kind}s {sorted(s.name for s in specs)} differ from {stage.file}'s {sorted(names)}")
        for spec in specs:
            tensor = declared[spec.name].type.tensor_type
            if not declared[spec.name].type.HasField("tensor_type") or spec.dtype == "unknown":
                continue
            dtype = helper.tensor_dtype_to_np_dtype(tensor.elem_type).name if tensor.elem_type != onnx.TensorProto.UNDEFINED else spec.dtype
            dims = tuple(d.dim_value if d.HasField("dim_value") else None for d in tensor.shape.dim)
            fixed = tensor.HasField("shape") and None not in dims
            if dtype != spec.dtype or (fixed and dims != tuple(spec.shape)):
                fail(f"stage {stage.index} {kind} '{spec.name}' is {spec.dtype} {tuple(spec.shape)} in the manifest but "
                     f"{dtype} {dims if fixed else '(dynamic)'} in {stage.file}")
