"""Tensors an export stores like weights that the model never trains: held, not trained.

torch trains its parameters only. The dynamo exporter stores buffers (a rotary embedding's inverse frequencies),
lifted constants and tensors it folded from constants alone (the ones and zeros its GroupNorm export normalizes
with) as initializers beside the parameters, and says which is which in each initializer's value_info metadata
(`pkg.torch.export.graph_signature.InputSpec.kind`, `pkg.onnxscript.optimizer.folded_from`). The TorchScript
exporter writes such constants as Constant nodes, which loading turns into initializers (`graph._normalize`
holds them). Trained, each would give the model degrees of freedom torch's model lacks: Llama's rotary
frequencies would move, each GroupNorm group would gain a scale and shift of its own.

A folded tensor is held when every name it was folded from is a graph-local one (no dot: torch names parameters,
buffers and lifted constants by their dotted module path), a lifted constant (torch.export names those
`<module>.lifted_tensor_<k>`: Swin's shifted-window masks) or, where the file carries the export's graph signature
(`pkg.torch.export.ExportedProgram.graph_signature`), anything it does not call a PARAMETER (a causal-mask buffer
folded into the additive mask nn.MultiheadAttention adds: trained, the mask itself moved); one folded from a
parameter (a weight the exporter transposed ahead of time) stays trained, and so does one folded from any other
dotted name where there is no signature to tell.

Reading order: `exporter_constants` -> `hold_exporter_constants` -> `hold_merged_constants`.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping

import onnx

from onnxpipe.nodes import hold

__all__ = ["exporter_constants", "hold_exporter_constants", "hold_merged_constants"]

_KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
_FOLDED = "pkg.onnxscript.optimizer.folded_from"
_SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"
#: Input kinds of torch.export's graph signature that are not trained.
_HELD_KINDS = {"BUFFER": "buffer", "CONSTANT_TENSOR": "lifted constant"}


def _sources(value: str) -> list[str] | None:
    try:
        names = ast.literal_eval(value)
    except (ValueError, SyntaxError):
        return None
    return [str(n) for n in names] if isinstance(names, (list, tuple)) else None


def _parameters(model: onnx.ModelProto) -> frozenset[str] | None:
    """The targets the export's graph signature calls PARAMETER (lines `p_x: PARAMETER target='x'`); None without one."""
    text = next((p.value for p in model.graph.metadata_props if p.key == _SIGNATURE), None)
    return None if text is None else frozenset(re.findall(r"^\S+: PARAMETER target='([^']+)'", text, re.MULTILINE))


def _constant_source(name: str, parameters: frozenset[str] | None) -> bool:
    if parameters is not None and name not in parameters:
        return True
    return "." not in name or name.rsplit(".", 1)[1].startswith("lifted_tensor_")


def exporter_constants(model: onnx.ModelProto) -> dict[str, str]:
    """Initializer -> why it is held, from the exporter's value_info metadata (read before shape inference
    rewrites the value_info)."""
    inits = {t.name for t in model.graph.initializer}
    parameters = _parameters(model)
    held: dict[str, str] = {}
    for vi in model.graph.value_info:
        if vi.name not in inits:
            continue
        meta = {p.key: p.value for p in vi.metadata_props}
        if meta.get(_KIND) in _HELD_KINDS:
            held[vi.name] = f"the exporter's {_HELD_KINDS[meta[_KIND]]}"
        elif _FOLDED in meta:
            sources = _sources(meta[_FOLDED])
            if sources is not None and all(_constant_source(name, parameters) for name in sources):
                held[vi.name] = "folded by the exporter from constants"
    return held


def hold_exporter_constants(model: onnx.ModelProto) -> dict[str, str]:
    """Mark every `exporter_constants` tensor held, in place; what was marked."""
    held = exporter_constants(model)
    for t in model.graph.initializer:
        if t.name in held:
            hold(t, held[t.name])
    return held


def hold_merged_constants(model: onnx.ModelProto, copies: Mapping[str, str]) -> None:
    """Hold each untied copy (copy -> the module it was made for, `initializers.untie_in_place`) made for a module that the export's
    graph signature gives no parameter at all: the exporter merges tensors of equal values, so a LayerNorm without
    affine weights read the ones of an RMSNorm's weight, and its untied copy was trained as a weight the module does
    not have. A module with parameters keeps its copy trained: a functional call in it (Swin's attention reading its
    qkv bias) names the module, not the parameter's own."""
    parameters = _parameters(model)
    if parameters is None:
        return
    owners = {p.rsplit(".", i)[0] for p in parameters for i in range(1, p.count(".") + 1)}
    made = {c for c, module in copies.items() if c not in parameters and module not in owners}
    for t in model.graph.initializer:
        if t.name in made:
            hold(t, "a constant the exporter merged with a parameter of equal values")
