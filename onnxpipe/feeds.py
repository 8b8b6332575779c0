"""What a stage directory accepts as model inputs: arrays read safely from .npz files, dtypes checked
before anything runs, and integer inputs kept inside the ranges the model states.

onnxruntime does not check for us: an out-of-range token id in a Gather on the CPU reads out of
bounds (or kills the process with SIGSEGV), a float id is truncated and a negative one wraps.

Reading order: `read_npz` -> `index_ranges` -> `ensure_feed`.
"""

from __future__ import annotations

import math
import os
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.manifest import Manifest, StageInput

__all__ = ["IndexRange", "read_npz", "index_ranges", "ensure_feed"]

#: Deflate never expands data more than ~1032-fold: an array declaring more bytes than that lies.
_MAX_DEFLATE_RATIO = 1100
#: Array kinds fed to a model: booleans, integers, floats.
_NUMERIC_KINDS = "biuf"
#: Ops whose second input indexes their first: a model input read there has a range.
_INDEXING_OPS = frozenset({"Gather", "SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"})


@dataclass(frozen=True)
class IndexRange:
    """Values an integer input may hold: [0, high), plus `also` (a loss's ignore_index)."""

    high: int
    #: What the model does with it, for the error message.
    what: str
    also: int | None = None


def read_npz(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """Arrays of an .npz file by name, each header checked before its array is read: numbers and
    booleans only, and no more bytes than the file can hold (a forged shape would allocate terabytes)."""
    path = Path(path)
    if not path.is_file():
        raise OnnxpipeError(f"{path}: no such file; pass an .npz with one array per model input (np.savez)")
    try:
        with zipfile.ZipFile(path) as archive:
            for info in archive.infolist():
                with archive.open(info) as f:
                    version = np.lib.format.read_magic(f)
                    reader = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
                    shape, _, dtype = reader(f)
                name = info.filename.removesuffix(".npy")
                if dtype.hasobject or dtype.kind not in _NUMERIC_KINDS:
                    raise OnnxpipeError(f"{path}: array '{name}' holds {dtype} values; give numbers or booleans (np.savez(path, name=array, ...))")
                room = min(info.file_size, info.compress_size * _MAX_DEFLATE_RATIO, path.stat().st_size * _MAX_DEFLATE_RATIO)
                if math.prod(shape) * dtype.itemsize > room:
                    raise OnnxpipeError(f"{path}: array '{name}' declares shape {tuple(shape)}, more than the file holds; write it again with np.savez")
        with np.load(path, allow_pickle=False) as data:
            return {name: data[name] for name in data.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise OnnxpipeError(f"{path}: not a readable .npz ({first}); write it with np.savez(path, name=array, ...)") from exc


def index_ranges(directory: str | os.PathLike, manifest: Manifest) -> dict[str, IndexRange]:
    """The range of every integer model input the stages use as an index: the rows of a table a
    Gather reads (token ids) or the classes a loss scores (labels). Read off each stage file's nodes and
    the shapes static inference finds (an initializer's own dims first), so a stage whose other shapes
    depend on data (a Range) still gives its ranges."""
    from onnx import helper

    from onnxpipe.protostream import read_model
    from onnxpipe.shapes import infer, static_shape

    model_inputs = {i.name for i in manifest.inputs}
    ranges: dict[str, IndexRange] = {}
    for stage in manifest.stages:
        model = read_model(Path(directory) / stage.file)
        graph = model.graph
        dims = {t.name: tuple(int(d) for d in t.dims) for t in graph.initializer}
        if not any(n.op_type in _INDEXING_OPS for n in graph.node):
            continue
        infos = infer(model).value_info

        def shape(name: str) -> tuple[int, ...] | None:
            return dims.get(name) or (static_shape(infos[name]) if name in infos else None)

        for node in graph.node:
            attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
            for name in (n for n in node.input[1:2] if n in model_inputs):
                operand = shape(node.input[0])
                if node.op_type == "Gather" and operand:
                    axis = int(attrs.get("axis", 0)) % len(operand)
                    found = IndexRange(operand[axis], f"rows of the table Gather '{node.name}' reads")
                elif node.op_type in ("SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss") and operand and len(operand) > 1:
                    found = IndexRange(operand[1], f"classes {node.op_type} '{node.name}' scores", attrs.get("ignore_index"))
                else:
                    continue
                if name not in ranges or found.high < ranges[name].high:
                    ranges[name] = found
    return ranges


def ensure_feed(spec: StageInput, value: object, ranges: Mapping[str, IndexRange]) -> np.ndarray:
    """`value` as an array of the input's dtype, refused (one line naming the input) when its dtype
    does not fit (floats or strings for integer ids, ...) or an index falls outside the model's range."""
    array = np.asarray(value)
    if spec.dtype == "unknown":
        return array
    want, kind = np.dtype(spec.dtype), array.dtype.kind
    fits = {"i": "iu", "u": "iu", "b": "b", "f": "biuf"}.get(want.kind, _NUMERIC_KINDS)
    if kind not in fits:
        hint = "integers (ids, labels, counts)" if want.kind in "iu" else "booleans" if want.kind == "b" else "numbers"
        raise OnnxpipeError(f"input '{spec.name}' holds {array.dtype} values; the model takes {want}: give {hint}, e.g. array.astype(np.{want})")
    if want.kind in "iu" and array.size:
        low, high = int(array.min()), int(array.max())
        limits = np.iinfo(want)
        if low < limits.min or high > limits.max:
            raise OnnxpipeError(f"input '{spec.name}' holds values in [{low}, {high}], outside {want}; give values that fit {want}")
        known = ranges.get(spec.name)
        if known is not None:
            bad = (array < 0) | (array >= known.high)
            if known.also is not None:
                bad &= array != known.also
            if bad.any():
                where = tuple(int(i) for i in np.argwhere(bad)[0])
                raise OnnxpipeError(f"input '{spec.name}' holds {int(array[where])} at {list(where)}; it indexes the {known.high} {known.what}: "
                                    f"give values in [0, {known.high})")
    return array.astype(want, copy=False)
