"""An op onnxruntime-training cannot differentiate, written out as the ONNX spec's own function body for it.

Many activations are defined by the spec as functions of simpler ops (HardSwish = x * HardSigmoid(x), HardSigmoid
= max(0, min(1, alpha x + beta)), Elu, Selu, Celu, Softplus, Mish, PRelu, Softsign, Shrink, ReduceL1,
ReduceSumSquare...), and both torch exporters write MobileNetV3's, ELU's or Mish's as those ops, which
onnxruntime-training 1.19.2 has no gradient for. Their bodies are inlined in their place: the node's inputs,
outputs and attributes (or the schema's defaults) substituted, the body's own values renamed under a prefix.
The body is the one for the model's opset, or a later one whose every op is defined the same at the model's opset.
`onnxpipe.rewrites` expands only nodes the gradient probe (`onnxpipe.gradprobe`) says cannot be differentiated,
and again until none is left (a body may call another function op).

Reading order: `body` -> `inlined`.
"""

from __future__ import annotations

import onnx
from onnx import helper

__all__ = ["body", "inlined"]


def _same_ops(function: onnx.FunctionProto, version: int, opset: int) -> bool:
    """Whether every op of the body (written for `version`) is defined alike at `opset`."""
    for n in function.node:
        if n.domain not in ("", "ai.onnx"):
            return False
        try:
            if onnx.defs.get_schema(n.op_type, version, "").since_version != onnx.defs.get_schema(n.op_type, opset, "").since_version:
                return False
        except onnx.defs.SchemaError:
            return False
    return True


def body(node: onnx.NodeProto, opset: int, types: list[onnx.TypeProto]) -> tuple[onnx.OpSchema, onnx.FunctionProto] | None:
    """The op's schema and its function body for the node (`types`: its inputs' types, for bodies that depend on
    them), or None where the spec defines none usable at `opset`."""
    if node.domain not in ("", "ai.onnx"):
        return None
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, "")
    except onnx.defs.SchemaError:
        return None
    candidates: list[tuple[int, bytes]] = []
    versions = sorted(schema.function_opset_versions)
    candidates += [(v, schema.get_function_with_opset_version(v)) for v in versions]
    for v in sorted(schema.context_dependent_function_opset_versions):
        try:
            made = schema.get_context_dependent_function_with_opset_version(v, node.SerializeToString(), [t.SerializeToString() for t in types])
        except Exception:  # onnx's builder refuses inputs whose type it cannot read: no body then
            continue
        if made:
            candidates.append((v, made))
    earlier = sorted(((v, b) for v, b in candidates if v <= opset), reverse=True)
    later = sorted((v, b) for v, b in candidates if v > opset)
    for version, serialized in earlier[:1] + later:
        function = onnx.FunctionProto.FromString(serialized)
        if version <= opset or _same_ops(function, version, opset):
            return schema, function
    return None


def inlined(node: onnx.NodeProto, schema: onnx.OpSchema, function: onnx.FunctionProto, prefix: str) -> list[onnx.NodeProto] | None:
    """The body's nodes computing `node`'s outputs from its inputs, the body's own values named under `prefix`;
    None where a body node carries a subgraph or is of another domain (the model may not import it)."""
    rename = {formal: actual for formal, actual in zip(function.input, list(node.input) + [""] * len(function.input))}
    rename.update(zip(function.output, node.output))
    given = {a.name: a for a in node.attribute}
    defaults = {name: a.default_value for name, a in schema.attributes.items() if a.default_value.type != onnx.AttributeProto.UNDEFINED}
    nodes = []
    for i, inner in enumerate(function.node):
        if inner.domain not in ("", "ai.onnx") or any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in inner.attribute):
            return None
        new = helper.make_node(inner.op_type, [rename.get(x, f"{prefix}/{x}") if x else "" for x in inner.input],
                               [rename.get(x, f"{prefix}/{x}") if x else "" for x in inner.output], name=f"{prefix}/{i}_{inner.op_type}",
                               domain=inner.domain)
        for a in inner.attribute:
            if not a.ref_attr_name:
                new.attribute.append(a)
                continue
            value = given.get(a.ref_attr_name) or defaults.get(a.ref_attr_name)
            if value is not None:
                copied = onnx.AttributeProto()
                copied.CopyFrom(value)
                copied.name = a.name
                new.attribute.append(copied)
        nodes.append(new)
    return nodes
