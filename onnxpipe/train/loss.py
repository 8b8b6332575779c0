"""Appending a loss to a model output, for models exported without one (`--loss cross_entropy|mse --labels NAME`)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.errors import OnnxpipeError

__all__ = ["LossSpec", "LOSSES", "append_loss", "labels_info"]

LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class LossSpec:
    #: "cross_entropy" (scores [N, C] or [N, ..., C]; int64 labels without the class axis) or "mse" (float labels, output's shape).
    kind: str
    #: The model output the loss reads.
    output: str
    #: Name of the new labels input.
    labels: str = "labels"
    #: Name of the new scalar loss output.
    name: str = "onnxpipe/loss"

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise OnnxpipeError(f"unknown loss {self.kind!r}; choose one of: {', '.join(LOSSES)}")


def labels_info(spec: LossSpec, output_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """dtype and shape of the labels input."""
    if spec.kind == "mse":
        return "float32", tuple(output_shape)
    if len(output_shape) < 2:
        raise OnnxpipeError(f"--loss cross_entropy needs class scores of rank >= 2 in {spec.output!r} (shape {output_shape}); use --loss mse")
    return "int64", tuple(output_shape[:-1])


def append_loss(model: onnx.ModelProto, spec: LossSpec) -> onnx.ModelProto:
    """A copy of `model` with input `spec.labels` and scalar output `spec.name` (mean over the batch)."""
    outputs = {o.name: o for o in model.graph.output}
    if spec.output not in outputs:
        raise OnnxpipeError(f"--loss: the model has no output {spec.output!r}; its outputs: {', '.join(outputs)}")
    if spec.labels in {i.name for i in model.graph.input}:
        raise OnnxpipeError(f"--labels {spec.labels!r} is already a model input; pick a new name")
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    shape = tuple(d.dim_value for d in outputs[spec.output].type.tensor_type.shape.dim)
    dtype, lshape = labels_info(spec, shape)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    g.input.append(helper.make_tensor_value_info(spec.labels, elem, list(lshape)))
    p = "onnxpipe/loss_"
    if spec.kind == "cross_entropy":
        flat = helper.make_tensor(f"{p}shape", TensorProto.INT64, [2], [-1, shape[-1]])
        flat_l = helper.make_tensor(f"{p}lshape", TensorProto.INT64, [1], [-1])
        g.initializer.extend([flat, flat_l])
        g.node.extend([
            helper.make_node("Reshape", [spec.output, f"{p}shape"], [f"{p}scores"], name=f"{p}scores"),
            helper.make_node("Reshape", [spec.labels, f"{p}lshape"], [f"{p}labels"], name=f"{p}labels"),
            helper.make_node("SoftmaxCrossEntropyLoss", [f"{p}scores", f"{p}labels"], [spec.name, f"{p}log_prob"], name=f"{p}sce", reduction="mean"),
        ])
    else:
        g.node.extend([
            helper.make_node("Sub", [spec.output, spec.labels], [f"{p}diff"], name=f"{p}diff"),
            helper.make_node("Mul", [f"{p}diff", f"{p}diff"], [f"{p}sq"], name=f"{p}sq"),
            helper.make_node("ReduceMean", [f"{p}sq"], [spec.name], name=f"{p}mean", keepdims=0),
        ])
    g.output.insert(0, helper.make_tensor_value_info(spec.name, TensorProto.FLOAT, []))
    return out
