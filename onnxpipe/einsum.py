"""Einsum of one or two operands written as Transpose, ReduceSum, Reshape and MatMul, which onnxruntime-training
differentiates (it has no Einsum gradient; both torch exporters keep `torch.einsum` as Einsum).

Two operands: the letters both share and the output keeps are the batch, those both share and the output drops
are contracted, the rest are each operand's own; each operand is moved to [batch, own, contracted] order (summing
first any letter only it has and the output drops), flattened to three axes, multiplied by one MatMul, and unflattened
and moved to the output's order. One operand: a ReduceSum and a Transpose. Shapes must be static (stage files have
them); a letter repeated within an operand (a diagonal), a batch letter broadcast from 1, or three operands leave the
node alone (the gradient check then names it).

Reading order: `lowered` -> `_parse` -> `_own_sums` -> `_two`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from string import ascii_letters

import onnx
from onnx import helper

from onnxpipe.nodebuilder import NodeBuilder

__all__ = ["lowered"]


def _parse(equation: str, ranks: Sequence[int]) -> tuple[list[str], str] | None:
    """Each operand's letters and the output's, an ellipsis spelled out in letters the equation does not use."""
    equation = equation.replace(" ", "")
    lhs, arrow, rhs = equation.partition("->")
    operands = lhs.split(",")
    if len(operands) != len(ranks):
        return None
    spare = [c for c in ascii_letters if c not in equation]
    widths = {len(ranks) and r - len(op.replace("...", "")) for op, r in zip(operands, ranks) if "..." in op}
    if len(widths) > 1 or any(w < 0 for w in widths):
        return None
    dots = "".join(spare[:widths.pop()]) if widths else ""
    operands = [op.replace("...", dots) for op in operands]
    if not arrow:
        counts = {c: "".join(operands).count(c) for c in "".join(operands)}
        rhs = dots + "".join(sorted(c for c in counts if counts[c] == 1 and c not in dots))
    rhs = rhs.replace("...", dots)
    if any(len(op) != r or len(set(op)) != len(op) for op, r in zip(operands, ranks)) or len(set(rhs)) != len(rhs):
        return None
    return operands, rhs


class _Builder(NodeBuilder):
    def transpose(self, x: str, letters: str, order: str, out: str | None = None) -> str:
        if letters == order and out is None:
            return x
        return self.op("Transpose", [x], out, perm=[letters.index(c) for c in order])

    def reduce_sum(self, x: str, axes: list[int]) -> str:
        if not axes:
            return x
        if self.opset >= 13:
            return self.op("ReduceSum", [x, self.ints(axes)], keepdims=0)
        return self.op("ReduceSum", [x], axes=axes, keepdims=0)


def _own_sums(b: _Builder, x: str, letters: str, keep: set[str]) -> tuple[str, str]:
    """x summed over its letters not in `keep`."""
    dropped = [i for i, c in enumerate(letters) if c not in keep]
    return b.reduce_sum(x, dropped), "".join(c for c in letters if c in keep)


def _two(b: _Builder, a: str, la: str, x: str, lx: str, rhs: str, sizes: dict[str, int], out: str) -> None:
    batch = [c for c in rhs if c in la and c in lx]
    contract = [c for c in la if c in lx and c not in rhs]
    left = [c for c in rhs if c in la and c not in lx]
    right = [c for c in rhs if c in lx and c not in la]
    size = lambda letters: math.prod(sizes[c] for c in letters)  # noqa: E731
    a3 = b.op("Reshape", [b.transpose(a, la, "".join(batch + left + contract)), b.ints([size(batch), size(left), size(contract)])])
    x3 = b.op("Reshape", [b.transpose(x, lx, "".join(batch + contract + right)), b.ints([size(batch), size(contract), size(right)])])
    product = b.op("MatMul", [a3, x3])
    order = "".join(batch + left + right)
    shaped = b.op("Reshape", [product, b.ints([sizes[c] for c in order])], out if order == rhs else None)
    if order != rhs:
        b.transpose(shaped, order, rhs, out)


def lowered(node: onnx.NodeProto, graph: onnx.GraphProto, shapes: Sequence[tuple[int, ...] | None], opset: int, prefix: str) -> list[onnx.NodeProto] | None:
    """The nodes computing the Einsum's output from its operands (constants appended to `graph`), named under
    `prefix`; None where this does not apply. `shapes`: the operands' static shapes."""
    if len(node.input) not in (1, 2) or any(s is None for s in shapes):
        return None
    equation = next((helper.get_attribute_value(a).decode() for a in node.attribute if a.name == "equation"), "")
    parsed = _parse(equation, [len(s) for s in shapes])  # type: ignore[arg-type]
    if parsed is None:
        return None
    letters, rhs = parsed
    sizes: dict[str, int] = {}
    for op, shape in zip(letters, shapes):
        for c, d in zip(op, shape):  # type: ignore[arg-type]
            if sizes.setdefault(c, d) != d:
                return None  # a dim broadcast from 1
    b = _Builder(graph, prefix, opset)
    if len(letters) == 1:
        summed, kept = _own_sums(b, node.input[0], letters[0], set(rhs))
        b.transpose(summed, kept, rhs, node.output[0]) if kept != rhs else b.op("Identity", [summed], node.output[0])
        return b.nodes
    (la, lx), other = letters, [set(letters[1]), set(letters[0])]
    a, la = _own_sums(b, node.input[0], la, set(rhs) | other[0])
    x, lx = _own_sums(b, node.input[1], lx, set(rhs) | other[1])
    _two(b, a, la, x, lx, rhs, sizes, node.output[0])
    return b.nodes
