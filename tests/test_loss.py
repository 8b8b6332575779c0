"""An appended cross-entropy reads the class scores on axis 1, as PyTorch and ONNX do ([N, C, 1, 1] heads such as
SqueezeNet's train), or on the axis --class-axis names; equal to numpy's cross-entropy."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.ortutil import cpu_session
from onnxpipe.train.loss import LossSpec, append_loss, labels_info

RNG = np.random.default_rng(0)


def _identity(shape: list[int]) -> onnx.ModelProto:
    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["scores"], name="id")], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, shape)],
                              [helper.make_tensor_value_info("scores", TensorProto.FLOAT, shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _numpy_ce(scores: np.ndarray, labels: np.ndarray, axis: int) -> float:
    moved = np.moveaxis(scores, axis, -1)
    logp = moved - np.log(np.exp(moved - moved.max(-1, keepdims=True)).sum(-1, keepdims=True)) - moved.max(-1, keepdims=True)
    return float(-np.take_along_axis(logp, labels[..., None], -1).mean())


@pytest.mark.parametrize("shape,axis", [([4, 5, 1, 1], 1), ([4, 5], 1), ([2, 3, 7], -1), ([2, 3, 7], 2), ([2, 6, 3, 2], 1)])
def test_cross_entropy_on_the_class_axis(shape: list[int], axis: int) -> None:
    spec = LossSpec("cross_entropy", "scores", class_axis=axis)
    dtype, lshape = labels_info(spec, tuple(shape))
    cls = shape[axis]
    assert dtype == "int64" and lshape == tuple(d for i, d in enumerate(shape) if i != axis % len(shape))
    model = append_loss(_identity(shape), spec)
    x = RNG.normal(size=shape).astype(np.float32)
    y = RNG.integers(0, cls, lshape)
    loss = cpu_session(model.SerializeToString()).run([spec.name], {"x": x, "labels": y})[0]
    assert loss > 0.1
    assert loss == pytest.approx(_numpy_ce(x, y, axis), rel=1e-5)


def test_a_one_class_axis_is_refused_with_the_way_out() -> None:
    with pytest.raises(OnnxpipeError, match=r"holds 1 class; the loss would always be 0: pass the axis of the class scores with --class-axis"):
        labels_info(LossSpec("cross_entropy", "scores", class_axis=-1), (4, 5, 1, 1))
    with pytest.raises(OnnxpipeError, match=r"--class-axis 3: 'scores' has rank 2"):
        labels_info(LossSpec("cross_entropy", "scores", class_axis=3), (4, 5))
