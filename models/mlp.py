"""The multi-layer perceptron: the smallest trainable model, for fast tests of every pipeline step."""

from __future__ import annotations

import onnx

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["mlp"]


def mlp(*, layers: int, width: int, batch: int, in_features: int, classes: int, mse: bool, train: bool, seed: int) -> onnx.ModelProto:
    """`layers` hidden Gemm+Relu layers of `width`, then a Gemm to `classes` logits.

    Training variant: cross-entropy against int64 labels [batch], or with `mse` a mean squared error
    against float targets [batch, classes] (the two loss forms pipeline training must handle).
    """
    for key, value in {"layers": layers, "width": width, "batch": batch, "in_features": in_features, "classes": classes}.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")
    b = GraphBuilder("mlp", seed)
    x, n_in = b.input("x", (batch, in_features)), in_features
    for i in range(layers):
        x = b.op("Relu", [b.gemm(x, n_in, width, name=f"fc{i}")], name=f"fc{i}/relu")
        n_in = width
    logits = b.gemm(x, n_in, classes, name="out")
    b.classifier_outputs(logits, (batch, classes), train, (batch,), mse=mse)
    return b.model()
