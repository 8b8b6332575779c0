"""Files named by other files stay inside the directory that holds the file naming them.

A manifest names stage files and weight files, a checkpoint index names its arrays, a model names
its external data. onnxpipe follows such a name only when it is a relative path without `..` that
resolves, symlinks followed, inside that directory: checked before the file is opened, so a tampered
directory or model cannot make onnxpipe read a file elsewhere on the machine (and copy it into an output).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import onnx

from onnxpipe.errors import OnnxpipeError

__all__ = ["inside", "external_locations", "ensure_external_data_inside", "reference_from", "reference_to"]


def inside(directory: str | os.PathLike, name: object, what: str, fix: str) -> Path:
    """`directory / name`, or an OnnxpipeError naming `what` when `name` is not a relative path that
    stays inside `directory`."""
    root = Path(directory)

    def refuse(reason: str) -> OnnxpipeError:
        return OnnxpipeError(f"{what} {name!r} {reason}; {fix}")

    if not isinstance(name, str) or not name or "\0" in name:
        raise refuse("is not a file name")
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if PurePosixPath(name).is_absolute() or Path(name).is_absolute() or (parts and parts[0].endswith(":")):
        raise refuse(f"is an absolute path; only files inside {root} are read")
    if ".." in parts:
        raise refuse(f"climbs out of {root} with '..'; only files inside it are read")
    path = root / name
    if not path.resolve().is_relative_to(root.resolve()):
        raise refuse(f"leads out of {root} through a symlink; only files inside it are read")
    return path


def external_locations(model: onnx.ModelProto) -> Iterator[tuple[str, str]]:
    """(tensor name, location) of every tensor whose bytes live in an external file: initializers,
    sparse initializers and attribute tensors, in subgraphs and functions too."""

    def tensors(graph: onnx.GraphProto) -> Iterator[onnx.TensorProto]:
        yield from graph.initializer
        for sparse in graph.sparse_initializer:
            yield from (sparse.values, sparse.indices)
        for node in graph.node:
            yield from node_tensors(node)

    def node_tensors(node: onnx.NodeProto) -> Iterator[onnx.TensorProto]:
        for attr in node.attribute:
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [*([attr.sparse_tensor] if attr.HasField("sparse_tensor") else []), *attr.sparse_tensors]:
                yield from (sparse.values, sparse.indices)
            for sub in [*([attr.g] if attr.HasField("g") else []), *attr.graphs]:
                yield from tensors(sub)

    everything = [tensors(model.graph), *(node_tensors(n) for f in model.functions for n in f.node)]
    for source in everything:
        for tensor in source:
            if tensor.data_location == onnx.TensorProto.EXTERNAL:
                entries = {e.key: e.value for e in tensor.external_data}
                yield tensor.name, entries.get("location", "")


def ensure_external_data_inside(path: str | os.PathLike, model: onnx.ModelProto, fix: str) -> None:
    """Every external-data file `model` (read from `path`) names lies inside the model's own directory
    (or is the model file itself, as `protostream.read_model` refers to weights it leaves on disk)."""
    for name, location in external_locations(model):
        if location != Path(path).name:
            inside(Path(path).parent, location, f"{path}: the external data of tensor '{name}'", fix)


def reference_from(path: str, folder: str | os.PathLike) -> str:
    """How a file in `folder` records `path` (the model a plan or stage directory was made from): relative
    to `folder`, so the pair can move together and be read from any working directory."""
    if path == "<memory>" or not path:
        return path
    return os.path.relpath(os.path.abspath(path), os.path.abspath(folder))


def reference_to(recorded: str, folder: str | os.PathLike) -> str:
    """The path a file in `folder` recorded with `reference_from`, usable from the working directory.
    Files written before references were relative to their folder held the path as given then: kept
    when only that one exists."""
    if recorded == "<memory>" or not recorded or os.path.isabs(recorded):
        return recorded
    joined = os.path.normpath(os.path.join(folder, recorded))
    return recorded if not os.path.exists(joined) and os.path.exists(recorded) else joined
