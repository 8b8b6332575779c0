"""GRU, RNN and LSTM written out one time step at a time, in ops onnxruntime-training differentiates.

onnxruntime-training 1.19.2 has no gradient for GRU or RNN, and trains LSTM (after its pre-training rewrite) in the
forward direction only: its LSTMGrad kernel refuses a reverse or bidirectional one (torch's bidirectional=True).
Over a sequence of static length each is a short loop of MatMuls, Sigmoid and Tanh, so the loop is unrolled
(`onnxpipe.lowerings` applies this to a copy of a stage before its gradient graph is built; stage files keep the
op); a forward LSTM is left to onnxruntime. The input projection of all steps is one MatMul; each step adds the
recurrent projection, as the ONNX operator's equations say (GRU's gates z, r, h with `linear_before_reset` either
way; LSTM's i, o, f, c with peepholes; forward, reverse, bidirectional; either layout). Nodes with other
activations, `clip`, `sequence_lens`, LSTM's `input_forget` or a shape not known statically are left alone (the
gradient check then names them).

Reading order: `unrolled` -> `_Builder` -> `_gru_step` / `_rnn_step` / `_lstm_step`.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from onnxpipe.nodebuilder import NodeBuilder

__all__ = ["unrolled", "UNROLLED_OPS"]

#: Op -> its default activations, the only ones unrolled (one list per direction).
_ACTIVATIONS = {"GRU": ["Sigmoid", "Tanh"], "RNN": ["Tanh"], "LSTM": ["Sigmoid", "Tanh", "Tanh"]}
#: Op -> its gates (blocks of W, R and each bias).
_GATES = {"GRU": 3, "RNN": 1, "LSTM": 4}
#: The ops `unrolled` writes out (LSTM in the reverse and bidirectional directions only).
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


def _recurrent_term(b: _Builder, block: str, bias: str | None, state: str) -> str:
    """state R_gate^T (+ Rb_gate)."""
    out = b.op("MatMul", [state, block])
    return b.op("Add", [out, bias]) if bias else out


#: A step: (builder, X_t W^T + Wb [batch, gates x H], the state (h, or h and c), R^T's [H, H] blocks and Rb's parts per
#: gate, the peepholes per gate (LSTM), linear_before_reset (GRU)) -> the next state.
Step = Callable[[_Builder, str, tuple[str, ...], list[str], list[str | None], list[str | None], bool], tuple[str, ...]]


def _gru_step(b: _Builder, x_proj: str, state: tuple[str, ...], blocks: list[str], biases: list[str | None], _peep: list[str | None],
              before_reset: bool) -> tuple[str, ...]:
    """One GRU step, gates z, r, h."""
    (h,) = state
    xz, xr, xh = b.split(x_proj, [b.hidden] * 3, -1)
    (rz, rr, rh), (bz, br, bh) = blocks, biases
    z = b.op("Sigmoid", [b.op("Add", [xz, _recurrent_term(b, rz, bz, h)])])
    r = b.op("Sigmoid", [b.op("Add", [xr, _recurrent_term(b, rr, br, h)])])
    if before_reset:
        candidate = b.op("Tanh", [b.op("Add", [xh, b.op("Mul", [r, _recurrent_term(b, rh, bh, h)])])])
    else:
        candidate = b.op("Tanh", [b.op("Add", [xh, _recurrent_term(b, rh, bh, b.op("Mul", [r, h]))])])
    keep = b.op("Sub", [b.one, z])
    return (b.op("Add", [b.op("Mul", [keep, candidate]), b.op("Mul", [z, h])]),)


def _rnn_step(b: _Builder, x_proj: str, state: tuple[str, ...], blocks: list[str], biases: list[str | None], _peep: list[str | None],
              _before_reset: bool) -> tuple[str, ...]:
    """One RNN step: Tanh(X_t W^T + Wb + H R^T + Rb)."""
    return (b.op("Tanh", [b.op("Add", [x_proj, _recurrent_term(b, blocks[0], biases[0], state[0])])]),)


def _lstm_step(b: _Builder, x_proj: str, state: tuple[str, ...], blocks: list[str], biases: list[str | None], peep: list[str | None],
               _before_reset: bool) -> tuple[str, ...]:
    """One LSTM step, gates i, o, f, c (peepholes on i and f from the old cell, on o from the new)."""
    h, c = state
    parts = b.split(x_proj, [b.hidden] * 4, -1)

    def gate(k: int, cell: str | None) -> str:
        total = b.op("Add", [parts[k], _recurrent_term(b, blocks[k], biases[k], h)])
        return b.op("Add", [total, b.op("Mul", [peep[k], cell])]) if peep[k] and cell else total

    i, f = b.op("Sigmoid", [gate(0, c)]), b.op("Sigmoid", [gate(2, c)])
    cell = b.op("Add", [b.op("Mul", [f, c]), b.op("Mul", [i, b.op("Tanh", [gate(3, None)])])])
    o = b.op("Sigmoid", [gate(1, cell)])
    return b.op("Mul", [o, b.op("Tanh", [cell])]), cell


_STEPS: dict[str, Step] = {"GRU": _gru_step, "RNN": _rnn_step, "LSTM": _lstm_step}


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
    if (activations and activations != _ACTIVATIONS[node.op_type] * directions) or "clip" in attrs or attrs.get("input_forget", 0) \
            or "activation_alpha" in attrs or "activation_beta" in attrs or "hidden_size" not in attrs \
            or (node.op_type == "LSTM" and direction == "forward"):  # onnxruntime trains that one itself
        return None
    inputs = list(node.input) + [""] * (8 - len(node.input))
    x, w, r, bias, lengths, initial, initial_cell, peepholes = inputs[:8]
    if lengths:
        return None
    layout, hidden = int(attrs.get("layout", 0)), int(attrs["hidden_size"])
    steps, batch = (x_shape[1], x_shape[0]) if layout else (x_shape[0], x_shape[1])
    b = _Builder(graph, prefix, dtype, opset, hidden)
    step, gates = _STEPS[node.op_type], _GATES[node.op_type]
    if node.op_type == "GRU":
        b.one = b.const(np.array(1, dtype))
    seq = b.op("Transpose", [x], perm=[1, 0, 2]) if layout else x
    batch_axis = 1 if layout else 0

    def start(given: str, d: int) -> str:
        return b.pick(given, d, axis=batch_axis) if given else b.const(np.zeros((batch, hidden), dtype))

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
        peep: list[str | None] = [None] * gates
        if peepholes:  # P's parts i, o, f; the cell gate has none
            peep[:3] = b.split(b.pick(peepholes, d), [hidden] * 3, -1)
        state = (start(initial, d),) + ((start(initial_cell, d),) if node.op_type == "LSTM" else ())
        outputs: dict[int, str] = {}
        reverse = direction == "reverse" or d == 1
        for t in (range(steps - 1, -1, -1) if reverse else range(steps)):
            state = step(b, b.pick(projected, t), state, blocks, biases, peep, bool(attrs.get("linear_before_reset", 0)))
            outputs[t] = state[0]
        ys.append(b.op("Concat", [b.unsqueeze(outputs[t], 0) for t in range(steps)], axis=0))
        finals.append(state)
    y_out, h_out, c_out = (list(node.output) + ["", "", ""])[:3]
    if y_out:
        stacked = b.op("Concat", [b.unsqueeze(y, 1) for y in ys], axis=1)  # [seq, directions, batch, H]
        b.op("Transpose", [stacked], y_out, perm=[2, 0, 1, 3]) if layout else b.op("Identity", [stacked], y_out)
    for out, k in ((h_out, 0), (c_out, 1)):
        if out:
            last = b.op("Concat", [b.unsqueeze(f[k], 0) for f in finals], axis=0)  # [directions, batch, H]
            b.op("Transpose", [last], out, perm=[1, 0, 2]) if layout else b.op("Identity", [last], out)
    return b.nodes
