"""Read and write ONNX models piece by piece so a model's weights are never held in memory.

`onnx.load` holds the file's bytes and the parsed model at once (2x the model); `read_model` parses
the file record by record and leaves every large weight on disk: an inline tensor's bytes become an
external-data reference into the model file itself (location = the file, offset = where its bytes
are), an external one keeps its reference. Loading, costing and planning need only dims and types;
`write_model` streams the bytes from disk to a new file (inline, or to an external-data file) in
chunks, and `load_weights` reads them where a whole model must run. `skeleton` copies a message
without one repeated field, so weights can be left out of a copy.

Reading order: `read_model` -> `_parse` -> `_reference` -> `_tensor_head`; `read_header`; `write_model` -> `_tensor_record`
-> `_stream`; `load_weights`; `skeleton`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import BinaryIO, TypeVar

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.ortutil import ensure_runtime_loads
from onnxpipe.safepath import ensure_external_data_inside

__all__ = ["read_model", "read_header", "read_user_model", "weights_dir", "write_model", "inline_external_data", "load_weights", "skeleton", "is_streamable",
           "is_external", "raw_nbytes", "all_equal", "ON_DISK_BYTES"]

#: Weights larger than this stay on disk when a model is read; smaller ones (shape tables, scalars) are read.
ON_DISK_BYTES = 4096

_GRAPH_FIELD = 7  # ModelProto.graph
_INITIALIZER_FIELD = 5  # GraphProto.initializer
_RAW_DATA_FIELD = 9  # TensorProto.raw_data
#: TensorProto's data fields (float_data, int32_data, string_data, int64_data, raw_data, double_data,
#: uint64_data): what a tensor's head leaves out.
_TENSOR_DATA_FIELDS = frozenset({4, 5, 6, 7, 9, 10, 11})
_LENGTH_DELIMITED = 2

M = TypeVar("M", bound=Message)


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(f: BinaryIO) -> tuple[int, bytes]:
    raw = bytearray()
    value, shift = 0, 0
    while True:
        chunk = f.read(1)
        if not chunk:
            raise EOFError("truncated protobuf varint")
        raw += chunk
        value |= (chunk[0] & 0x7F) << shift
        if not chunk[0] & 0x80:
            return value, bytes(raw)
        shift += 7


def _read_record(f: BinaryIO, key: int, key_bytes: bytes) -> bytes:
    """The bytes of one field (tag included) whose tag was just read."""
    wire = key & 7
    if wire == 0:
        _, raw = _read_varint(f)
        return key_bytes + raw
    if wire == 1:
        return key_bytes + f.read(8)
    if wire == 5:
        return key_bytes + f.read(4)
    if wire == _LENGTH_DELIMITED:
        length, raw = _read_varint(f)
        payload = f.read(length)
        if len(payload) != length:
            raise EOFError("truncated protobuf field")
        return key_bytes + raw + payload
    raise ValueError(f"unsupported protobuf wire type {wire}")


def read_model(path: str | os.PathLike) -> onnx.ModelProto:
    """Parse a model file one record at a time, its weights over ON_DISK_BYTES left on disk as
    external-data references (relative to the file's folder); small external tensors are read in.
    A model onnxruntime cannot load (`ortutil.ensure_runtime_loads`) is refused here."""
    path = Path(path)
    if path.resolve() != path.absolute():  # reached through a link: weights are read beside the real file
        path = path.resolve()
    model = _parse(path, weights=True)
    ensure_runtime_loads(model, str(path))
    ensure_external_data_inside(path, model, "keep a model's external-data files in its own directory and re-save it")
    for tensor in model.graph.initializer:
        if is_external(tensor) and raw_nbytes(tensor) <= ON_DISK_BYTES:
            onnx.external_data_helper.load_external_data_for_tensor(tensor, str(path.parent))
            tensor.ClearField("data_location")
            del tensor.external_data[:]
    return model


def weights_dir(path: str | os.PathLike) -> Path:
    """The folder a model file's on-disk weights are read from (its external data and `read_model`'s
    references): the real file's, a symlinked model followed, as onnx refuses weights read through a link."""
    return Path(path).resolve().parent


def read_header(path: str | os.PathLike) -> onnx.ModelProto:
    """A model file without its weights' bytes (skipped, never read): the graph's nodes, inputs,
    outputs and initializer heads (name, dtype, dims, external-data location) of a model of any size
    at the cost of its small parts. A model onnxruntime cannot load is refused here too."""
    header = _parse(Path(path), weights=False)
    ensure_runtime_loads(header, str(path))
    return header


def read_user_model(path: Path, missing: str, unreadable: str, *, weights: bool = True) -> onnx.ModelProto:
    """`read_model` (or `read_header` without `weights`) of a file the user named, each failure one line:
    `missing` is the way out for a path that is no file, `unreadable` for bytes that are no model."""
    if not path.exists():
        raise OnnxpipeError(f"{path}: no such file; {missing}")
    if not path.is_file():
        raise OnnxpipeError(f"{path}: not a file; {missing}")
    try:
        return read_model(path) if weights else read_header(path)
    except OnnxpipeError:
        raise
    except Exception as exc:  # protobuf raises several unrelated types on garbage
        raise OnnxpipeError(f"{path}: not a readable ONNX model ({type(exc).__name__}); {unreadable}") from exc


def _parse(path: Path, weights: bool) -> onnx.ModelProto:
    model = onnx.ModelProto()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        while f.tell() < size:
            key, key_bytes = _read_varint(f)
            if key >> 3 == _GRAPH_FIELD and key & 7 == _LENGTH_DELIMITED:
                length, _ = _read_varint(f)
                end = f.tell() + length
                while f.tell() < end:
                    inner, inner_bytes = _read_varint(f)
                    if inner >> 3 == _INITIALIZER_FIELD and inner & 7 == _LENGTH_DELIMITED:
                        record, _ = _read_varint(f)
                        if f.tell() + record > end:
                            raise EOFError("truncated protobuf initializer")
                        if not weights:
                            model.graph.initializer.append(_tensor_head(f, f.tell() + record, _TENSOR_DATA_FIELDS)[0])
                        elif record > ON_DISK_BYTES:
                            model.graph.initializer.append(_reference(f, f.tell() + record, path.name))
                        else:
                            payload = f.read(record)
                            model.graph.initializer.add().ParseFromString(payload)
                    else:
                        model.graph.MergeFromString(_read_record(f, inner, inner_bytes))
                if f.tell() != end:
                    raise EOFError("truncated protobuf graph")
            else:
                model.MergeFromString(_read_record(f, key, key_bytes))
    return model


def _tensor_head(f: BinaryIO, end: int, skipped: frozenset[int]) -> tuple[onnx.TensorProto, tuple[int, int] | None]:
    """The TensorProto record ending at `end` without its `skipped` fields (never read), and where its
    raw bytes are in the file (offset, length) when it has some."""
    tensor = onnx.TensorProto()
    place: tuple[int, int] | None = None
    while f.tell() < end:
        key, key_bytes = _read_varint(f)
        if key >> 3 in skipped and key & 7 == _LENGTH_DELIMITED:
            length, _ = _read_varint(f)
            if key >> 3 == _RAW_DATA_FIELD:
                place = (f.tell(), length)
            f.seek(length, os.SEEK_CUR)
        else:
            tensor.MergeFromString(_read_record(f, key, key_bytes))
    if f.tell() != end:
        raise EOFError("truncated protobuf tensor")
    return tensor, place


def _reference(f: BinaryIO, end: int, location: str) -> onnx.TensorProto:
    """One TensorProto record read up to `end`, its raw bytes skipped and referenced as external data
    at their place in the file."""
    tensor, place = _tensor_head(f, end, frozenset({_RAW_DATA_FIELD}))
    if place is not None and not is_external(tensor):
        tensor.data_location = onnx.TensorProto.EXTERNAL
        for key, value in (("location", location), ("offset", str(place[0])), ("length", str(place[1]))):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, value
    return tensor


def is_external(tensor: onnx.TensorProto) -> bool:
    """Whether the tensor's bytes are on disk (an external-data reference)."""
    return tensor.data_location == onnx.TensorProto.EXTERNAL


def all_equal(tensor: onnx.TensorProto, base_dir: str | os.PathLike, chunk: int = 1 << 24) -> bool:
    """Whether every element of an on-disk tensor equals its first, read from disk in chunks (never the
    whole tensor in memory)."""
    place = {e.key: e.value for e in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    length = int(place.get("length", raw_nbytes(tensor)))
    step = max(dtype.itemsize, chunk - chunk % dtype.itemsize)
    first = None
    with open(Path(base_dir) / place["location"], "rb") as f:
        f.seek(int(place.get("offset", 0)))
        while length > 0:
            values = np.frombuffer(f.read(min(step, length)), dtype=dtype)
            if not len(values):
                raise EOFError("external data file is shorter than its tensors say")
            first = values[0] if first is None else first
            if not np.all(values == first):
                return False
            length -= values.nbytes
    return True


def load_weights(model: onnx.ModelProto, base_dir: str | os.PathLike) -> None:
    """Read every on-disk weight of `model` into it (for the few uses that run the whole model)."""
    for tensor in model.graph.initializer:
        if is_external(tensor):
            onnx.external_data_helper.load_external_data_for_tensor(tensor, str(base_dir))
            tensor.ClearField("data_location")
            del tensor.external_data[:]


def is_streamable(tensor: onnx.TensorProto) -> bool:
    """Whether the tensor's data is inline raw bytes (what `write_model` streams)."""
    return tensor.HasField("raw_data") and tensor.data_location != onnx.TensorProto.EXTERNAL


def raw_nbytes(tensor: onnx.TensorProto) -> int:
    """Bytes of a raw-data tensor's data, from its dims and type (reading `raw_data` would copy it)."""
    count = math.prod(tensor.dims)
    if tensor.data_type in _FOUR_BIT:
        return (count + 1) // 2
    return count * helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize


_FOUR_BIT = frozenset(getattr(onnx.TensorProto, n) for n in ("INT4", "UINT4", "FLOAT4E2M1") if hasattr(onnx.TensorProto, n))


def _bare(tensor: onnx.TensorProto) -> onnx.TensorProto:
    """The tensor's header: everything but its data and where the data lives."""
    head = skeleton(tensor, "raw_data")
    if is_external(head):
        del head.external_data[:]
        head.ClearField("data_location")
    return head


def _tensor_record(tensor: onnx.TensorProto) -> tuple[bytes, int]:
    """What precedes a tensor's bytes in a GraphProto: the initializer tag and length, the tensor's
    other fields, and the raw-data tag and length. Returns (prefix, raw byte count)."""
    head = _bare(tensor).SerializeToString()
    raw_len = raw_nbytes(tensor)
    body = head + bytes([(_RAW_DATA_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(raw_len)
    prefix = bytes([(_INITIALIZER_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(len(body) + raw_len) + body
    return prefix, raw_len


def _stream(tensor: onnx.TensorProto, expected: int, dst: BinaryIO, base_dir: Path | None) -> None:
    """Write a tensor's bytes to `dst`: from memory, or copied from disk in chunks for an on-disk one."""
    if not is_external(tensor):
        raw = tensor.raw_data
        if len(raw) != expected:
            raise ValueError(f"initializer '{tensor.name}' holds {len(raw)} bytes of raw data, its dims and type say {expected}")
        dst.write(raw)
        return
    place = {e.key: e.value for e in tensor.external_data}
    if base_dir is None:
        raise ValueError(f"initializer '{tensor.name}' is on disk ({place.get('location')}) but no folder to read it from was given")
    length = int(place.get("length", expected))
    if length != expected:
        raise ValueError(f"initializer '{tensor.name}' has {length} bytes on disk, its dims and type say {expected}")
    with open(base_dir / place["location"], "rb") as src:
        src.seek(int(place.get("offset", 0)))
        _copy(src, dst, length)


def write_model(model: onnx.ModelProto, path: str | os.PathLike, large: Sequence[onnx.TensorProto] = (),
                external_data: str | None = None, base_dir: str | os.PathLike | None = None) -> None:
    """Write `model` with the tensors `large` (raw-data or on-disk tensors, not copied) added to its
    graph's initializers; with `external_data`, their bytes go to that file beside `path` instead.
    On-disk tensors are read from `base_dir` (the folder of the model they were read from)."""
    path = Path(path)
    source = Path(base_dir) if base_dir is not None else None
    if external_data is not None and large:
        with open(path.parent / external_data, "wb") as data:
            for tensor in large:
                head = _bare(tensor)
                length = raw_nbytes(tensor)
                head.data_location = onnx.TensorProto.EXTERNAL
                for key, value in (("location", external_data), ("offset", str(data.tell())), ("length", str(length))):
                    entry = head.external_data.add()
                    entry.key, entry.value = key, value
                _stream(tensor, length, data, source)
                model.graph.initializer.append(head)
        with open(path, "wb") as f:
            f.write(model.SerializeToString())
        return
    top = skeleton(model, "graph")
    graph = model.graph.SerializeToString()
    records = [_tensor_record(t) for t in large]
    graph_len = len(graph) + sum(len(prefix) + n for prefix, n in records)
    with open(path, "wb") as f:
        f.write(top.SerializeToString())
        f.write(bytes([(_GRAPH_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(graph_len))
        f.write(graph)
        for tensor, (prefix, n) in zip(large, records):
            f.write(prefix)
            _stream(tensor, n, f, source)


def inline_external_data(path: str | os.PathLike) -> None:
    """Rewrite a model whose tensors live in external-data files beside it into one self-contained
    file, copying their bytes from disk in chunks (never a whole tensor in memory); the data files
    are removed once the new file is in place."""
    path = Path(path)
    model = onnx.load(str(path), load_external_data=False)
    external = [t for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if not external:
        return
    inline = [t for t in model.graph.initializer if t.data_location != onnx.TensorProto.EXTERNAL]
    places = [{e.key: e.value for e in t.external_data} for t in external]
    heads = [skeleton(skeleton(t, "external_data"), "data_location") for t in external]
    top = skeleton(model, "graph")
    graph = skeleton(model.graph, "initializer")
    graph.initializer.extend(inline)
    graph_bytes = graph.SerializeToString()
    records = []
    for head, place in zip(heads, places):
        length = int(place.get("length", raw_nbytes(head)))
        body = head.SerializeToString() + bytes([(_RAW_DATA_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(length)
        records.append((bytes([(_INITIALIZER_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(len(body) + length) + body, length))
    tmp = path.with_name(f".{path.name}.inline")
    data_files = {path.parent / place["location"] for place in places}
    try:
        with open(tmp, "wb") as f:
            f.write(top.SerializeToString())
            f.write(bytes([(_GRAPH_FIELD << 3) | _LENGTH_DELIMITED]) + _varint(len(graph_bytes) + sum(len(r) + n for r, n in records)))
            f.write(graph_bytes)
            for (prefix, length), place in zip(records, places):
                f.write(prefix)
                with open(path.parent / place["location"], "rb") as data:
                    data.seek(int(place.get("offset", 0)))
                    _copy(data, f, length)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    for data_file in data_files:
        data_file.unlink(missing_ok=True)


def _copy(src: BinaryIO, dst: BinaryIO, length: int, chunk: int = 1 << 24) -> None:
    while length > 0:
        block = src.read(min(chunk, length))
        if not block:
            raise EOFError("external data file is shorter than its tensors say")
        dst.write(block)
        length -= len(block)


def skeleton(message: M, leave_out: str) -> M:
    """A copy of a message without the field `leave_out` (e.g. a graph without its initializers)."""
    copy = type(message)()
    for field in message.DESCRIPTOR.fields:  # not ListFields: it would read (copy) the left-out field too
        if field.name == leave_out:
            continue
        value = getattr(message, field.name)
        if field.is_repeated:
            if not value:
                continue
        elif not message.HasField(field.name):
            continue
        if field.is_repeated:
            getattr(copy, field.name).extend(value)
        elif field.message_type is not None:
            getattr(copy, field.name).CopyFrom(value)
        else:
            setattr(copy, field.name, value)
    return copy
