"""two-io: two inputs, two outputs (one leaving mid-graph as an early head) and skip connections,
for the splitter's bookkeeping of values that cross several stages or leave the model early."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["two_io"]


def two_io(*, width: int, batch: int, in_features: int, classes: int, train: bool, seed: int) -> onnx.ModelProto:
    """Inputs `x` [batch, in_features] and `y` [batch, width]; outputs `early` [batch, classes] (from
    the first trunk layer) and `logits` [batch, classes]; `x`'s first layer skips to the last one.

    Training variant: outputs loss, `logits`, `early`; the loss is the cross-entropy of `logits`
    against labels [batch] plus 0.3 x that of `early` (an auxiliary loss, as in Inception), so every
    weight, the early head's included, gets a gradient.
    """
    for key, value in {"width": width, "batch": batch, "in_features": in_features, "classes": classes}.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")
    b = GraphBuilder("two-io", seed)
    x = b.input("x", (batch, in_features))
    y = b.input("y", (batch, width))
    h1 = b.op("Relu", [b.gemm(x, in_features, width, name="trunk1")], name="trunk1/relu")
    with b.scope("early_head"):
        early = b.op("Identity", [b.gemm(h1, width, classes)], outputs=["early"])
    mixed = b.op("Add", [h1, b.op("Relu", [b.gemm(y, width, width, name="side")], name="side/relu")], name="mix")
    h2 = b.op("Relu", [b.gemm(mixed, width, width, name="trunk2")], name="trunk2/relu")
    h3 = b.op("Relu", [b.op("Add", [b.gemm(h2, width, width, name="trunk3"), h1], name="skip")], name="trunk3/relu")
    h4 = b.op("Add", [b.gemm(h3, width, width, name="trunk4"), y], name="skip_y")
    logits = b.op("Identity", [b.gemm(h4, width, classes, name="head")], outputs=["logits"])
    if train:
        labels = b.input("labels", (batch,), TensorProto.INT64)
        main, aux = b.softmax_cross_entropy(logits, labels), b.softmax_cross_entropy(early, labels)
        weighted = b.op("Mul", [aux, b.const(np.float32(0.3))], name="loss/aux_weight")
        b.output(b.op("Add", [main, weighted], outputs=["loss"], name="loss/total"), [])
    b.output(logits, (batch, classes))
    b.output(early, (batch, classes))
    return b.model()
