"""Builders of ONNX models for tests, demos and planning studies, written with onnx.helper alone (no torch).

`names()` lists the zoo, `spec(name)` describes one model and its knobs, `build(name, **knobs)`
returns an `onnx.ModelProto` (opset 17, IR 8, static shapes, seeded random fp32 weights), `save`
writes one (external data when large), `build_sparse` writes one with its weights in a sparse file, never drawn (planning
full-size models without their weights in memory). `legacy` rewrites models into older exporters' shapes.
"""

from onnxpipe.models.registry import EXTERNAL_DATA_THRESHOLD, ModelSpec, build, build_sparse, names, parse_knob, save, spec, specs

__all__ = ["ModelSpec", "names", "spec", "specs", "build", "build_sparse", "parse_knob", "save", "EXTERNAL_DATA_THRESHOLD"]
