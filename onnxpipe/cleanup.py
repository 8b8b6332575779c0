"""Clean an exported graph before planning, without changing what it computes at the bound shapes:
shape arithmetic folded to the constants it computes, and Identity nodes on activations removed (their
readers read the original tensor), so the planner sees the compute nodes a human would count.

Exporters spell `x.view(b, s, h, d)` as Shape -> Gather -> Unsqueeze -> Concat -> Reshape: read from an
activation, those nodes tie a far-away Reshape to it and look like work. Once the dims are bound their
values are known (`shapes.infer` folded them); here the nodes are replaced by those values. Weights are
never folded (a Transpose of a weight stays a constant chain, so training still updates the weight),
nor are values that would look like weights (float tensors of more than one element stay computed), nor
quantization nodes (a DequantizeLinear of an int8 scalar stays one, so the stages keep the model's quantization).
Nodes whose outputs then reach no graph output are dropped: the TorchScript export of F.mse_loss adds its input to a
fill only to read the sum's Shape, which folding makes a constant, and a stage would compute that sum and send it on.
A dilated Conv padded by `auto_pad` SAME (the TorchScript export of padding="same") gets its pads written out:
onnxruntime's CPU Conv refuses dilation with auto_pad, so the model could not run at all.

An If whose condition folds (the TorchScript export of repeat_interleave tests a shape) is replaced by the branch it
takes, before shapes are inferred again (`inline_decided_branches`): static inference cannot tell an If's output shape.

Reading order: `inline_decided_branches`; `clean` -> `_fold` -> `_drop_identities` -> `_drop_dead` -> `_explicit_pads`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.nodes import QUANTIZATION_OPS, has_subgraph, is_weight, subgraph_captures
from onnxpipe.shapes import STANDARD_DOMAINS, Inferred, static_shape

__all__ = ["Cleaned", "clean", "inline_decided_branches"]


@dataclass(frozen=True)
class Cleaned:
    """A cleaned model and what was taken out of it."""

    #: The model, rewritten in place.
    model: onnx.ModelProto
    #: Nodes replaced by the constants they computed.
    folded: tuple[str, ...]
    #: Identity nodes removed, by name -> the tensor their readers now read.
    identities: Mapping[str, str]


def inline_decided_branches(model: onnx.ModelProto, folded: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """Each If of the main graph whose condition folded to a value, replaced by the nodes of the branch it takes (named
    under the If's name; Identity nodes hand the branch's outputs to the If's), unless a name of the branch is taken in
    the main graph; the Ifs replaced."""
    graph = model.graph
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    nodes: list[onnx.NodeProto] = []
    inlined: list[str] = []
    for node in graph.node:
        branch = _taken_branch(node, folded)
        if branch is None or ({o for n in branch.node for o in n.output} | {t.name for t in branch.initializer}) & taken:
            nodes.append(node)
            continue
        for k, inner in enumerate(branch.node):
            copy = onnx.NodeProto()
            copy.CopyFrom(inner)
            copy.name = f"{node.name}/{inner.name or inner.op_type + str(k)}"
            nodes.append(copy)
        nodes.extend(helper.make_node("Identity", [out.name], [mine], name=f"{node.name}/out{i}") for i, (out, mine) in enumerate(zip(branch.output, node.output)))
        graph.initializer.extend(branch.initializer)
        inlined.append(node.name)
    if inlined:
        del graph.node[:]
        graph.node.extend(nodes)
    return tuple(inlined)


def _taken_branch(node: onnx.NodeProto, folded: Mapping[str, np.ndarray]) -> onnx.GraphProto | None:
    """The branch an If takes where its condition folded to one value; None otherwise."""
    if node.op_type != "If" or node.domain not in STANDARD_DOMAINS or node.input[0] not in folded:
        return None
    cond = np.asarray(folded[node.input[0]])
    if cond.size != 1:
        return None
    wanted = "then_branch" if bool(cond.reshape(-1)[0]) else "else_branch"
    return next((a.g for a in node.attribute if a.name == wanted), None)


def clean(model: onnx.ModelProto, inferred: Inferred) -> Cleaned:
    """Replace the folded nodes that read no weight and compute no weight-like value by their values,
    then remove Identity nodes between activations and nodes whose outputs reach no graph output, and write out
    the pads of dilated SAME-padded Convs."""
    taken = _fold(model, inferred.folded, inferred.folded_nodes)
    identities = _drop_identities(model)
    _drop_dead(model)
    _explicit_pads(model, inferred.value_info)
    return Cleaned(model, taken, identities)


def _fold(model: onnx.ModelProto, folded: Mapping[str, np.ndarray], folded_nodes: frozenset[str]) -> tuple[str, ...]:
    graph = model.graph
    weights = {t.name for t in graph.initializer if is_weight(helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims))}
    taken: list[str] = []
    tainted = set(weights)  # weights, and values computed from them: they stay computed in the graph
    for node in graph.node:
        outs = [o for o in node.output if o]
        if node.name not in folded_nodes or any(o not in folded for o in outs):
            continue
        if (any(i in tainted for i in node.input) or any(is_weight(folded[o].dtype, folded[o].shape) for o in outs)
                or node.op_type in QUANTIZATION_OPS):
            tainted.update(outs)
            continue
        taken.append(node.name)
    if not taken:
        return ()
    gone = set(taken)
    produced = {o for n in graph.node if n.name in gone for o in n.output if o}
    kept = [n for n in graph.node if n.name not in gone]
    read = {i for n in kept for i in [*n.input, *_captures(n)] if i} | {o.name for o in graph.output}
    del graph.node[:]
    graph.node.extend(kept)
    graph.initializer.extend(numpy_helper.from_array(folded[name], name) for name in sorted(produced & read))
    drop = {vi.name for vi in graph.value_info if vi.name in produced}
    if drop:
        kept_infos = [vi for vi in graph.value_info if vi.name not in drop]
        del graph.value_info[:]
        graph.value_info.extend(kept_infos)
    return tuple(taken)


def _drop_identities(model: onnx.ModelProto) -> dict[str, str]:
    """Identity nodes reading a node's output: readers are pointed at the source instead. Kept when the
    copy is a graph output (the model's interface) or read inside a subgraph (renaming there is not worth it)."""
    graph = model.graph
    produced = {o for n in graph.node for o in n.output if o}
    outputs = {o.name for o in graph.output}
    captured = {c for n in graph.node for c in _captures(n)}
    rename: dict[str, str] = {}
    removed: dict[str, str] = {}
    for node in graph.node:
        if (node.op_type == "Identity" and node.domain in STANDARD_DOMAINS and len(node.input) == 1 and node.input[0] in produced
                and node.output[0] not in outputs and node.output[0] not in captured):
            source = rename.get(node.input[0], node.input[0])
            rename[node.output[0]] = source
            removed[node.name] = source
    if not removed:
        return removed
    kept = [n for n in graph.node if n.name not in removed]
    for node in kept:
        for i, name in enumerate(node.input):
            if name in rename:
                node.input[i] = rename[name]
    del graph.node[:]
    graph.node.extend(kept)
    infos = [vi for vi in graph.value_info if vi.name not in rename]
    del graph.value_info[:]
    graph.value_info.extend(infos)
    return removed


def _drop_dead(model: onnx.ModelProto) -> None:
    """Nodes none of whose outputs a kept node reads (its subgraphs' captures included) or the graph returns, removed,
    with the initializers only they read."""
    graph = model.graph
    needed = {o.name for o in graph.output}
    kept = []
    for node in reversed(graph.node):
        if any(o in needed for o in node.output if o):
            kept.append(node)
            needed.update(i for i in [*node.input, *_captures(node)] if i)
    if len(kept) == len(graph.node):
        return
    del graph.node[:]
    graph.node.extend(reversed(kept))
    unread = {t.name for t in graph.initializer} - needed
    for field in (graph.initializer, graph.input):  # an initializer of an old IR is listed among the inputs too
        left = [v for v in field if v.name not in unread]
        del field[:]
        field.extend(left)


def _explicit_pads(model: onnx.ModelProto, shapes: Mapping[str, onnx.ValueInfoProto]) -> None:
    """A dilated Conv with auto_pad SAME_UPPER or SAME_LOWER and static shapes gets the pads that rule gives (the total
    an axis needs for ceil(in / stride) outputs, the odd one at the end for UPPER, at the start for LOWER)."""
    dims = {t.name: tuple(t.dims) for t in model.graph.initializer}
    for node in model.graph.node:
        if node.op_type != "Conv" or node.domain not in STANDARD_DOMAINS:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("auto_pad") not in (b"SAME_UPPER", b"SAME_LOWER"):
            continue
        x = static_shape(shapes[node.input[0]]) if node.input[0] in shapes else None
        w = dims.get(node.input[1]) or (static_shape(shapes[node.input[1]]) if node.input[1] in shapes else None)
        if x is None or w is None:
            continue
        spatial = len(x) - 2
        dilations, strides = attrs.get("dilations", [1] * spatial), attrs.get("strides", [1] * spatial)
        if all(d == 1 for d in dilations):  # type: ignore[union-attr]
            continue  # onnxruntime pads these itself
        kernel = attrs.get("kernel_shape", list(w[2:]))
        begins, ends = [], []
        for size, k, s, d in zip(x[2:], kernel, strides, dilations):  # type: ignore[call-overload]
            total = max((-(-size // s) - 1) * s + (k - 1) * d + 1 - size, 0)
            small, large = total // 2, total - total // 2
            begins.append(small if attrs["auto_pad"] == b"SAME_UPPER" else large)
            ends.append(large if attrs["auto_pad"] == b"SAME_UPPER" else small)
        kept = [a for a in node.attribute if a.name not in ("auto_pad", "pads")]
        del node.attribute[:]
        node.attribute.extend([*kept, helper.make_attribute("pads", begins + ends)])


def _captures(node: onnx.NodeProto) -> tuple[str, ...]:
    return subgraph_captures(node) if has_subgraph(node) else ()
