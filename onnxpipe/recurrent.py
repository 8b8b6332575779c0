"""GRU and RNN written out one time step at a time, in ops onnxruntime-training differentiates.

onnxruntime-training 1.19.2 trains LSTM (after its pre-training rewrite) but has no gradient for GRU or RNN.
Over a sequence of static length each is a short loop of MatMuls, Sigmoid and Tanh, so the loop is unrolled
(`onnxpipe.rewrites` applies this to a copy of a stage before its gradient graph is built; stage files keep the
op). The input projection of all steps is one MatMul; each step adds the recurrent projection, as the ONNX
operator's equations say (gates z, r, h; `linear_before_reset` either way; forward, reverse, bidirectional;
either layout). Nodes with other activations, `clip`, `sequence_lens` or a shape not known statically are left
alone (the gradient check then names them).

Reading order: `unrolled` -> `_Builder` -> `_gru_step` / `_rnn_step`.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper

from onnxpipe.nodebuilder import NodeBuilder

__all__ = ["unrolled", "UNROLLED_OPS"]

#: Op -> its default activations, the only ones unrolled (one list per direction).
_ACTIVATIONS = {"GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"]}
#: The ops `unrolled` writes out.
UNROLLED_OPS = frozenset(_ACTIVATIONS)


class _Builder(NodeBuilder):
    """A builder that knows the step's float type and hidden size."""

    def __init__(self, graph: onnx.GraphProto, prefix: str, dtype: np.dtype, opset: int, hidden: int) -> None:
        super().__init__(graph, prefix, opset)
        self.dtype, self.hidden = dtype, hidden
        #: The constant 1 a GRU step subtracts its gate from (made once, by `unrolled`).
        self.one = ""

    def pick(self, x: str, index: int, axis: int = 0) -> str:
        """x[index] along `axis`, the axis dropped."""
        return self.op("Gather", [x, self.const(np.array(index, np.int64))], axis=axis)


def _gru_step(b: _Builder, x_proj: str, h: str, blocks: list[str], biases: list[str | None], before_reset: bool) -> str:
    """One GRU step. x_proj [batch, 3H]: X_t W^T + Wb; blocks: R^T's [H, H] blocks and biases Rb's parts, gates z, r, h."""
    xz, xr, xh = b.split(x_proj, [b.hidden] * 3, -1)
    (rz, rr, rh), (bz, br, bh) = blocks, biases

    def recurrent(block: str, bias: str | None, state: str) -> str:
        out = b.op("MatMul", [state, block])
        return b.op("Add", [out, bias]) if bias else out

    z = b.op("Sigmoid", [b.op("Add", [xz, recurrent(rz, bz, h)])])
    r = b.op("Sigmoid", [b.op("Add", [xr, recurrent(rr, br, h)])])
    if before_reset:
        candidate = b.op("Tanh", [b.op("Add", [xh, b.op("Mul", [r, recurrent(rh, bh, h)])])])
    else:
        candidate = b.op("Tanh", [b.op("Add", [xh, recurrent(rh, bh, b.op("Mul", [r, h]))])])
    keep = b.op("Sub", [b.one, z])
    return b.op("Add", [b.op("Mul", [keep, candidate]), b.op("Mul", [z, h])])


def _rnn_step(b: _Builder, x_proj: str, h: str, blocks: list[str], biases: list[str | None], before_reset: bool) -> str:
    """One RNN step: Tanh(X_t W^T + Wb + H R^T + Rb)."""
    out = b.op("MatMul", [h, blocks[0]])
    return b.op("Tanh", [b.op("Add", [x_proj, b.op("Add", [out, biases[0]]) if biases[0] else out])])


def unrolled(node: onnx.NodeProto, graph: onnx.GraphProto, x_shape: tuple[int, ...] | None, dtype: np.dtype, opset: int,
             prefix: str) -> list[onnx.NodeProto] | None:
    """The nodes computing `node`'s outputs step by step, named under `prefix` (their constants appended to `graph`),
    or None where the node is not one this writes out. `x_shape`: X's static shape."""
    if node.op_type not in UNROLLED_OPS or node.domain not in ("", "ai.onnx") or x_shape is None or len(x_shape) != 3:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    direction = attrs.get("direction", b"forward").decode()
    directions = 2 if direction == "bidirectional" else 1
    activations = [a.decode() for a in attrs.get("activations", [])]
    if (activations and activations != _ACTIVATIONS[node.op_type] * directions) or "clip" in attrs \
            or "activation_alpha" in attrs or "activation_beta" in attrs or "hidden_size" not in attrs:
        return None
    inputs = list(node.input) + [""] * (6 - len(node.input))
    x, w, r, bias, lengths, initial = inputs[:6]
    if lengths:
        return None
    layout, hidden = int(attrs.get("layout", 0)), int(attrs["hidden_size"])
    steps, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    b = _Builder(graph, prefix, dtype, opset, hidden)
    step = _gru_step if node.op_type == "GRU" else _rnn_step
    if node.op_type == "GRU":
        b.one = b.const(np.array(1, dtype))
    gates = 3 if node.op_type == "GRU" else 1
    seq = b.op("Transpose", [x], perm=[1, 0, 2]) if layout else x
    ys, finals = [], []
    for d in range(directions):
        w_t = b.op("Transpose", [b.pick(w, d)], perm=[1, 0])
        r_t = b.op("Transpose", [b.pick(r, d)], perm=[1, 0])
        projected = b.op("MatMul", [seq, w_t])
        blocks = b.split(r_t, [hidden] * gates, -1) if gates > 1 else [r_t]  # once per direction, not per step
        biases: list[str | None] = [None] * gates
        if bias:
            w_bias, r_bias = b.split(b.pick(bias, d), [gates * hidden] * 2, -1)
            projected = b.op("Add", [projected, w_bias])
            biases = list(b.split(r_bias, [hidden] * gates, -1)) if gates > 1 else [r_bias]
        h = b.pick(initial, d, axis=1 if layout else 0) if initial else b.const(np.zeros((batch, hidden), dtype))
        states: dict[int, str] = {}
        reverse = direction == "reverse" or d == 1
        for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
            h = step(b, b.pick(projected, t), h, blocks, biases, bool(attrs.get("linear_before_reset", 0)))
            states[t] = h
        ys.append(b.op("Concat", [b.unsqueeze(states[t], 0) for t in range(steps)], axis=0))
        finals.append(h)
    y_out, h_out = (list(node.output) + ["", ""])[:2]
    if y_out:
        stacked = b.op("Concat", [b.unsqueeze(y, 1) for y in ys], axis=1)  # [seq, directions, batch, H]
        b.op("Transpose", [stacked], y_out, perm=[2, 0, 1, 3]) if layout else b.op("Identity", [stacked], y_out)
    if h_out:
        last = b.op("Concat", [b.unsqueeze(f, 0) for f in finals], axis=0)  # [directions, batch, H]
        b.op("Transpose", [last], h_out, perm=[1, 0, 2]) if layout else b.op("Identity", [last], h_out)
    return b.nodes
