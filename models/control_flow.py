"""control-flow: a model with an If and a Loop whose bodies read outer-scope tensors (captures),
for tests of the graph loader's dependency tracking and of the splitter keeping captures available."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["control_flow"]


def _branch(name: str, hidden: str, weight: str, op_type: str, shape: tuple[int, int]) -> onnx.GraphProto:
    """An If branch without inputs: `op_type`(hidden, weight), both read from the enclosing graph."""
    body = GraphBuilder(name)
    with body.scope(name):
        out = body.op(op_type, [hidden, weight])
    body.output(out, shape)
    return body.graph()


def _loop_body(hidden: str, weight: str, shape: tuple[int, int]) -> onnx.GraphProto:
    """state <- Tanh(state @ weight + hidden): `weight` and `hidden` are outer-scope captures."""
    body = GraphBuilder("loop_body")
    body.input("iteration", [], TensorProto.INT64)
    cond = body.input("cond_in", [], TensorProto.BOOL)
    state = body.input("state_in", shape)
    with body.scope("loop_body"):
        new_state = body.op("Tanh", [body.op("Add", [body.op("MatMul", [state, weight]), hidden])])
        cond_out = body.op("Identity", [cond], name="cond_out")
    body.output(cond_out, [], TensorProto.BOOL)
    body.output(new_state, shape)
    return body.graph()


def control_flow(*, width: int, batch: int, in_features: int, classes: int, steps: int, seed: int) -> onnx.ModelProto:
    """x -> Gemm+Relu = h -> If(sum(h) > 0: h * w_then, else: h + w_else) -> Loop `steps` times
    (state = Tanh(state @ w_loop + h)) -> Gemm -> logits [batch, classes]."""
    for key, value in {"width": width, "batch": batch, "in_features": in_features, "classes": classes, "steps": steps}.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")
    b = GraphBuilder("control-flow", seed)
    shape = (batch, width)
    x = b.input("x", (batch, in_features))
    h = b.op("Relu", [b.gemm(x, in_features, width, name="fc_in")], name="hidden")
    cond = b.op("Greater", [b.op("ReduceSum", [h], keepdims=0, name="total"), b.const(np.float32(0.0))], name="positive")
    w_then, w_else = b.weight("w_then", (width,), fan_in=1), b.weight("w_else", (width,), fan_in=1)
    branched = b.op("If", [cond], name="branch", then_branch=_branch("then", h, w_then, "Mul", shape),
                    else_branch=_branch("else", h, w_else, "Add", shape))
    w_loop = b.weight("w_loop", (width, width))
    state = b.op("Loop", [b.const(np.int64(steps)), "", branched], name="refine", body=_loop_body(h, w_loop, shape))
    logits = b.gemm(state, width, classes, name="fc_out")
    b.output(logits, (batch, classes))
    return b.model()
