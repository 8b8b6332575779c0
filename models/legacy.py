"""Rewrites of a built model into the shapes older exporters produced, for loader and splitter tests:
initializers also listed as graph inputs (IR 3 style) and weights held by Constant nodes."""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["initializers_as_inputs", "constant_weights"]


def initializers_as_inputs(model: onnx.ModelProto, ir_version: int = 3) -> onnx.ModelProto:
    """A copy whose initializers are also graph inputs (required before IR 4, allowed after),
    with the IR version lowered to `ir_version`."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    listed = {vi.name for vi in out.graph.input}
    out.graph.input.extend(
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)) for t in out.graph.initializer if t.name not in listed
    )
    out.ir_version = ir_version
    return out


def constant_weights(model: onnx.ModelProto) -> onnx.ModelProto:
    """A copy without initializers: each becomes a Constant node (named `const/<weight>`) at the top."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    constants = [helper.make_node("Constant", [], [t.name], name=f"const/{t.name}", value=t) for t in graph.initializer]
    nodes = constants + list(graph.node)
    del graph.initializer[:]
    del graph.node[:]
    graph.node.extend(nodes)
    return out
