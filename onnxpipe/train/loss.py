"""Appending a loss to a model output, for models exported without one (`--loss cross_entropy|mse --labels NAME`).

The loss is computed in float32 whatever the output's float type (float16, bfloat16, double outputs are cast
first), as mixed-precision training does: the loss output and mse's labels are float32 alike."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.errors import OnnxpipeError

__all__ = ["LossSpec", "LOSSES", "append_loss", "labels_info", "classes"]

LOSSES = ("cross_entropy", "mse")


@dataclass(frozen=True)
class LossSpec:
    #: "cross_entropy" (class scores on `class_axis`; int64 labels: the output's shape without that axis) or "mse" (float labels, output's shape).
    kind: str
    #: The model output the loss reads.
    output: str
    #: Name of the new labels input.
    labels: str = "labels"
    #: Name of the new scalar loss output.
    name: str = "onnxpipe/loss"
    #: Axis of the class scores for cross_entropy: 1, as PyTorch's CrossEntropyLoss and ONNX's
    #: SoftmaxCrossEntropyLoss read [N, C, d1, ...]; -1 for scores last ([N, S, vocab]).
    class_axis: int = 1

    def __post_init__(self) -> None:
        if self.kind not in LOSSES:
            raise OnnxpipeError(f"unknown loss {self.kind!r}; choose one of: {', '.join(LOSSES)}")


def _class_axis(spec: LossSpec, rank: int) -> int:
    axis = spec.class_axis + rank if spec.class_axis < 0 else spec.class_axis
    if not 1 <= axis < rank:
        raise OnnxpipeError(f"--class-axis {spec.class_axis}: {spec.output!r} has rank {rank}; the class axis is one of 1..{rank - 1} (or -1 for the last)")
    return axis


def labels_info(spec: LossSpec, output_shape: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """dtype and shape of the labels input."""
    if spec.kind == "mse":
        return "float32", tuple(output_shape)
    if len(output_shape) < 2:
        raise OnnxpipeError(f"--loss cross_entropy needs class scores of rank >= 2 in {spec.output!r} (shape {output_shape}); use --loss mse")
    axis = _class_axis(spec, len(output_shape))
    if output_shape[axis] < 2:
        raise OnnxpipeError(f"--loss cross_entropy: axis {axis} of {spec.output!r} (shape {list(output_shape)}) holds {output_shape[axis]} class; "
                            "the loss would always be 0: pass the axis of the class scores with --class-axis")
    return "int64", tuple(output_shape[:axis]) + tuple(output_shape[axis + 1:])


def classes(spec: LossSpec, output_shape: tuple[int, ...]) -> int:
    """How many classes cross_entropy's labels index."""
    return output_shape[_class_axis(spec, len(output_shape))]


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
    source = spec.output
    if outputs[spec.output].type.tensor_type.elem_type != TensorProto.FLOAT:
        g.node.append(helper.make_node("Cast", [spec.output], [f"{p}float"], name=f"{p}float", to=TensorProto.FLOAT))
        source = f"{p}float"
    if spec.kind == "cross_entropy":
        # SoftmaxCrossEntropyLoss reads [N, C, d1, ...] scores and [N, d1, ...] labels: scores whose class axis
        # is elsewhere move it to 1 first (the labels' order already matches)
        axis = _class_axis(spec, len(shape))
        scores = source
        if axis != 1:
            perm = [0, axis, *(i for i in range(1, len(shape)) if i != axis)]
            g.node.append(helper.make_node("Transpose", [source], [f"{p}scores"], name=f"{p}scores", perm=perm))
            scores = f"{p}scores"
        g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [scores, spec.labels], [spec.name, f"{p}log_prob"], name=f"{p}sce", reduction="mean"))
    else:
        g.node.extend([
            helper.make_node("Sub", [source, spec.labels], [f"{p}diff"], name=f"{p}diff"),
            helper.make_node("Mul", [f"{p}diff", f"{p}diff"], [f"{p}sq"], name=f"{p}sq"),
            helper.make_node("ReduceMean", [f"{p}sq"], [spec.name], name=f"{p}mean", keepdims=0),
        ])
    g.output.insert(0, helper.make_tensor_value_info(spec.name, TensorProto.FLOAT, []))
    return out
