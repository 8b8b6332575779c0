"""Old opsets made trainable: onnx's version converter lifts a model below opset 13 before its training graphs are built.

onnxruntime-training differentiates opset 13+ forms (the appended SoftmaxCrossEntropyLoss has no
opset-9 version, opset-9 Gemm's gradient is invalid, Dropout-9 fails in DropoutGrad). Only the
training graphs are converted: stage files keep the user's opset.
"""

from __future__ import annotations

import onnx
from onnx import version_converter

from onnxpipe.errors import OnnxpipeError

__all__ = ["TRAINING_OPSET", "training_opset"]

#: The lowest default-domain opset training graphs are built at.
TRAINING_OPSET = 13


def training_opset(model: onnx.ModelProto, origin: str = "model") -> onnx.ModelProto:
    """`model` itself at opset >= TRAINING_OPSET, else a copy converted by onnx's version converter."""
    version = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if version is None or version >= TRAINING_OPSET:
        return model
    try:
        converted = version_converter.convert_version(model, TRAINING_OPSET)
    except Exception as exc:  # the converter raises plain RuntimeError/ValidationError naming the node
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise OnnxpipeError(f"{origin}: opset {version} is below what training needs ({TRAINING_OPSET}) and onnx's version converter "
                            f"could not lift it ({first}); re-export the model at opset {TRAINING_OPSET} or later") from exc
    converted.ir_version = max(converted.ir_version, model.ir_version)
    return converted
