"""Appends nodes and constant initializers under one name prefix: what every lowering that writes several nodes in
place of one (Einsum, GRU/RNN, grouped Conv) needs, so their names never collide with the graph's or each other's;
ops whose axes moved from attribute to input (opset 13) written either way."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

__all__ = ["NodeBuilder"]


class NodeBuilder:
    """Nodes in `nodes` (the caller puts them in the graph); constants go into `graph` at once."""

    def __init__(self, graph: onnx.GraphProto, prefix: str, opset: int) -> None:
        self.graph, self.prefix, self.opset = graph, prefix, opset
        self.nodes: list[onnx.NodeProto] = []
        self._count = 0

    def name(self) -> str:
        """A tensor name not used before under the prefix."""
        self._count += 1
        return f"{self.prefix}/{self._count}"

    def const(self, value: np.ndarray) -> str:
        name = self.name()
        self.graph.initializer.append(numpy_helper.from_array(value, name))
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.array(list(values), np.int64))

    def op(self, op_type: str, inputs: Sequence[str], out: str | None = None, **attrs: object) -> str:
        """One node of one output (`out`, else a fresh name); its output's name."""
        name = out or self.name()
        self.nodes.append(helper.make_node(op_type, list(inputs), [name], name=f"{self.prefix}/{op_type}{len(self.nodes)}", **attrs))
        return name

    def unsqueeze(self, x: str, axis: int, out: str | None = None) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", [x, self.ints([axis])], out)
        return self.op("Unsqueeze", [x], out, axes=[axis])

    def squeeze(self, x: str, axis: int, out: str | None = None) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", [x, self.ints([axis])], out)
        return self.op("Squeeze", [x], out, axes=[axis])

    def split(self, x: str, sizes: Sequence[int], axis: int) -> list[str]:
        """x cut into parts of `sizes` along `axis`; the parts' names."""
        names = [self.name() for _ in sizes]
        if self.opset >= 13:
            self.nodes.append(helper.make_node("Split", [x, self.ints(sizes)], names, name=f"{names[0]}/split", axis=axis))
        else:
            self.nodes.append(helper.make_node("Split", [x], names, name=f"{names[0]}/split", axis=axis, split=list(sizes)))
        return names
