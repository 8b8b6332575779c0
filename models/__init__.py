"""Builders of ONNX models for tests, demos and planning studies, written with onnx.helper alone (no torch).

`names()` lists the zoo, `spec(name)` describes one model and its knobs, `build(name, **knobs)`
returns an `onnx.ModelProto` (opset 17, IR 8, static shapes, seeded random fp32 weights), `save`
writes one (external data when large). `legacy` rewrites models into older exporters' shapes.
"""

from onnxpipe.models.registry import EXTERNAL_DATA_THRESHOLD, ModelSpec, build, names, parse_knob, save, spec, specs

__all__ = ["ModelSpec", "names", "spec", "specs", "build", "parse_knob", "save", "EXTERNAL_DATA_THRESHOLD"]
