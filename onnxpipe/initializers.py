"""Weights read by several nodes, decided on purpose: a real tie stays one tensor, an exporter's merge is untied.

Exporters merge initializers whose values are identical (torch.onnx's default optimisation turns
every all-ones LayerNorm weight of a fresh model into one tensor; the TorchScript exporter reads each
duplicate through an Identity of the one it keeps, so the deep-copied layers of a fresh
nn.TransformerEncoder become one set of weights). Trained as one parameter, such a merge silently makes
a different model: after the first step the user's separate weights would have moved apart. A tie
torch made (one Parameter in two modules) is read directly by both, never through an Identity. A tensor read in one module is a reuse, and a non-constant tensor read across
modules is a tie the user made (embedding and output projection); both stay shared.

The TorchScript exporter writes a tie the other way round: the output projection reads a transposed copy
of the embedding, a weight of its own. Trained so, the two move apart where torch kept them one. A copy
(a weight equal to another's transpose) is tied back by default: it becomes Transpose(original), so the
original is read twice, a tie. Square weights are never taken for copies (a tie pairs [vocab, d] with [d, vocab]).

Reading order: `SharedInitializer` -> `TieChoice` -> `shared_initializers` (classify and decide, `_copies`)
-> `untie` (one copy per reading module) -> `tie_copies_in_place` -> `module_of` (where a node came from).
"""

from __future__ import annotations

import ast
import math
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.nodes import is_weight
from onnxpipe.protostream import all_equal

__all__ = ["SharedInitializer", "TieChoice", "KINDS", "shared_initializers", "untie", "untie_in_place", "tie_copies_in_place", "module_of", "describe"]

#: "merge": constant-valued and read across modules, or read through an Identity (an exporter merged equal tensors;
#: untied by default);
#: "tie": read across modules with distinct values (a tie the model made); "reuse": read within one module;
#: "copy": another weight's transpose (an exporter's copy of a tie; tied back to it by default).
KINDS = ("merge", "tie", "reuse", "copy")


@dataclass(frozen=True)
class SharedInitializer:
    """One weight read by more than one compute node, and what is done with it."""

    #: The initializer's name in the user's model.
    name: str
    #: (node name, module name or None) of every reader, in graph order.
    readers: tuple[tuple[str, str | None], ...]
    #: One of `KINDS`.
    kind: str
    #: True: every reading module gets its own copy (trained apart); False: trained as one tensor. A copy:
    #: True keeps it a weight of its own, False makes it the transpose of `of`.
    untied: bool
    #: A copy's original: the weight it is the transpose of.
    of: str | None = None

    @property
    def modules(self) -> tuple[str | None, ...]:
        return tuple(dict.fromkeys(m for _, m in self.readers))


@dataclass(frozen=True)
class TieChoice:
    """The user's per-tensor overrides of the default (untie merges, keep ties and reuses)."""

    #: Keep these shared (train them as one tensor).
    tie: frozenset[str] = frozenset()
    #: Give each reading module its own copy.
    untie: frozenset[str] = frozenset()
    #: True: untie exactly `untie` and keep every other (a stage directory's record of what was decided).
    exact: bool = False

    @classmethod
    def of(cls, tie: Iterable[str] | None = None, untie: Iterable[str] | None = None) -> TieChoice:
        choice = cls(frozenset(tie or ()), frozenset(untie or ()))
        both = sorted(choice.tie & choice.untie)
        if both:
            raise OnnxpipeError(f"--tie {both[0]} and --untie {both[0]} both given; keep one")
        return choice


def module_of(node: onnx.NodeProto) -> str | None:
    """The source module a node was exported from: torch's dynamo exporter records its name scopes
    in the node's metadata; the TorchScript exporter names nodes /module/path/Op. None when unknown."""
    meta = {p.key: p.value for p in node.metadata_props}
    scopes = meta.get("pkg.torch.onnx.name_scopes")
    if scopes:
        try:
            names = ast.literal_eval(scopes)
        except (ValueError, SyntaxError):
            names = None
        if isinstance(names, list) and len(names) >= 2 and names[-2]:
            return str(names[-2])
    if node.name.startswith("/") and node.name.count("/") >= 2:
        return node.name[1:].rsplit("/", 1)[0].replace("/", ".")
    return None


def _constant_valued(tensor: onnx.TensorProto, base_dir: str | os.PathLike | None) -> bool:
    """Every element equal (ones, zeros, a fill): what a fresh model's norms and biases hold. A weight
    on disk is read from `base_dir` chunk by chunk (the model keeps only its reference)."""
    try:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                return False
            return math.prod(tensor.dims) > 1 and all_equal(tensor, base_dir)
        values = numpy_helper.to_array(tensor)
    except Exception:  # external data not beside the model: unknown, so not a merge
        return False
    return values.size > 1 and bool(np.all(values == values.flat[0]))


def _readers(graph: onnx.GraphProto) -> dict[str, list[tuple[int, int]]]:
    """(node index, input index) of every read of every tensor by a top-level node."""
    found: dict[str, list[tuple[int, int]]] = {}
    for i, node in enumerate(graph.node):
        for k, name in enumerate(node.input):
            if name:
                found.setdefault(name, []).append((i, k))
    return found


def shared_initializers(model: onnx.ModelProto, choice: TieChoice = TieChoice(), base_dir: str | os.PathLike | None = None
                        ) -> tuple[SharedInitializer, ...]:
    """Every weight read by more than one node, and every transposed copy of another weight, classified and
    decided (overrides in `choice`); weights on disk are read from `base_dir`, the model's folder."""
    graph = model.graph
    reads = _readers(graph)
    found = []
    for tensor in graph.initializer:
        nodes = list(dict.fromkeys(i for i, _ in reads.get(tensor.name, ())))
        if len(nodes) < 2 or not is_weight(helper.tensor_dtype_to_np_dtype(tensor.data_type), tuple(tensor.dims)):
            continue
        readers = tuple((graph.node[i].name or f"{graph.node[i].op_type}_{i}", module_of(graph.node[i])) for i in nodes)
        modules = {m for _, m in readers}
        if len(modules) == 1 and None not in modules:
            kind = "reuse"
        elif _constant_valued(tensor, base_dir) or any(graph.node[i].op_type == "Identity" for i in nodes):
            kind = "merge"
        else:
            kind = "tie"
        if choice.exact:
            untied = tensor.name in choice.untie
        else:
            untied = tensor.name in choice.untie or (kind == "merge" and tensor.name not in choice.tie)
        found.append(SharedInitializer(tensor.name, readers, kind, untied))
    for copy, original in _copies(model, base_dir).items():
        readers = tuple((graph.node[i].name or f"{graph.node[i].op_type}_{i}", module_of(graph.node[i])) for i in dict.fromkeys(i for i, _ in reads[copy]))
        found.append(SharedInitializer(copy, readers, "copy", copy in choice.untie, of=original))
    names = {s.name for s in found}
    unknown = sorted((choice.tie | choice.untie) - names)
    if unknown:
        have = ", ".join(sorted(names)[:12]) or "none"
        raise OnnxpipeError(f"--tie/--untie {unknown[0]}: not a weight read by several nodes of the model (shared weights: {have})")
    return tuple(found)


def _copies(model: onnx.ModelProto, base_dir: str | os.PathLike | None) -> dict[str, str]:
    """copy -> original for every weight equal to another's transpose (not square, not a row or a column; read by some
    node). Of the two,
    the copy is the one the exporter named (`onnx::...`) where only one is, else the later; a weight is one copy's
    original at most, and no original is a copy."""
    reads = _readers(model.graph)
    weights = [t for t in model.graph.initializer
               if len(t.dims) == 2 and t.dims[0] != t.dims[1] and min(t.dims) > 1 and t.name in reads and is_weight(helper.tensor_dtype_to_np_dtype(t.data_type), tuple(t.dims))]
    by_shape: dict[tuple[int, int, int], list[onnx.TensorProto]] = {}
    for t in weights:
        by_shape.setdefault((t.data_type, *t.dims), []).append(t)
    order = {t.name: i for i, t in enumerate(weights)}
    values: dict[str, np.ndarray | None] = {}
    found: dict[str, str] = {}
    for a in weights:
        for b in by_shape.get((a.data_type, a.dims[1], a.dims[0]), []):
            if order[a.name] > order[b.name] or a.name in found or b.name in found or a.name in found.values() or b.name in found.values():
                continue
            first, second = (values.setdefault(t.name, _matrix(t, base_dir)) for t in (a, b))
            if first is None or second is None or not _transposed(first, second):
                continue
            named = [t.name.startswith("onnx::") for t in (a, b)]
            copy, original = (a.name, b.name) if named == [True, False] else (b.name, a.name)
            found[copy] = original
    return found


def _matrix(tensor: onnx.TensorProto, base_dir: str | os.PathLike | None) -> np.ndarray | None:
    """A 2-D weight's values; mapped from disk where they live there, so only the pages compared are read. None where
    they cannot be read."""
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    try:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            if base_dir is None:
                return None
            place = {e.key: e.value for e in tensor.external_data}
            return np.memmap(Path(base_dir) / place["location"], dtype=np.dtype(dtype).newbyteorder("<"), mode="r",
                             offset=int(place.get("offset", 0)), shape=tuple(tensor.dims))
        return numpy_helper.to_array(tensor)
    except Exception:  # external data not beside the model, or shorter than it says: unknown, so not a copy
        return None


def _transposed(a: np.ndarray, b: np.ndarray, rows: int = 256) -> bool:
    """b == a.T, and not a fill (zeros equal any zeros' transpose): three elements first (distinct weights differ there;
    an MLP's [d, 4d] and [4d, d] pair up by shape in every layer), then b's first row, then a block of b's rows at a time."""
    if not (b[0, 0] == a[0, 0] and b[0, 1] == a[1, 0] and b[1, 0] == a[0, 1]) or b[0, 0] == b[0, 1] == b[1, 0]:
        return False
    if not np.array_equal(b[0], a[:, 0]):
        return False
    return all(np.array_equal(b[r : r + rows], a[:, r : r + rows].T) for r in range(0, b.shape[0], rows))


def untie(model: onnx.ModelProto, names: Iterable[str]) -> onnx.ModelProto:
    """A copy of `model` where each module reading one of `names` reads its own copy of it.

    The module the name belongs to keeps it (else the first reading module); the others' copies are named after their
    module (`<module>.<last part of the name>`, which gives back torch's own parameter names) or,
    without one, `<name>.<k>`. Deterministic, so the same call on the same model names the same copies."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    untie_in_place(out, names)
    return out


def untie_in_place(model: onnx.ModelProto, names: Iterable[str]) -> dict[str, str]:
    """`untie` without the copy (loading a large model holds it once); the copies made for a module -> the module."""
    wanted = set(names)
    if not wanted:
        return {}
    made: dict[str, str] = {}
    graph = model.graph
    reads = _readers(graph)
    taken = {t.name for t in graph.initializer} | {i.name for i in graph.input} | {o for n in graph.node for o in n.output}
    inits = {t.name: t for t in graph.initializer}
    listed = {i.name: i for i in graph.input}
    for name in [t.name for t in graph.initializer if t.name in wanted]:
        groups: dict[object, list[tuple[int, int]]] = {}
        owner = name.rsplit(".", 1)[0]
        for i, slot in sorted(reads.get(name, ()), key=lambda read: module_of(graph.node[read[0]]) != owner):
            module = module_of(graph.node[i])
            groups.setdefault(module if module is not None else ("node", i), []).append((i, slot))
        for g, (key, slots) in enumerate(groups.items()):
            if g == 0:
                continue
            base = f"{key}.{name.rsplit('.', 1)[-1]}" if isinstance(key, str) else f"{name}.{g}"
            copy_name, n = base, 1
            while copy_name in taken:
                copy_name, n = f"{base}.{n}", n + 1
            taken.add(copy_name)
            copy = onnx.TensorProto()
            copy.CopyFrom(inits[name])
            copy.name = copy_name
            graph.initializer.append(copy)
            if name in listed:  # IR 3 lists initializers among the inputs
                entry = graph.input.add()
                entry.CopyFrom(listed[name])
                entry.name = copy_name
            for i, slot in slots:
                graph.node[i].input[slot] = copy_name
            if isinstance(key, str):
                made[copy_name] = key
    return made


def tie_copies_in_place(model: onnx.ModelProto, copies: Mapping[str, str]) -> None:
    """Each copy (name -> original) made Transpose(original), computed first: the copy's readers are unchanged, and
    the original, read twice, trains as one weight (gradients summed, as torch's tie)."""
    if not copies:
        return
    graph = model.graph
    kept = [t for t in graph.initializer if t.name not in copies]
    del graph.initializer[:]
    graph.initializer.extend(kept)
    inputs = [i for i in graph.input if i.name not in copies]  # IR 3 lists initializers among the inputs
    del graph.input[:]
    graph.input.extend(inputs)
    nodes = [helper.make_node("Transpose", [original], [copy], name=f"{original}/transposed", perm=[1, 0]) for copy, original in copies.items()]
    nodes += list(graph.node)
    del graph.node[:]
    graph.node.extend(nodes)


def describe(shared: Iterable[SharedInitializer]) -> str:
    """One line saying what was untied and what was kept, for split/plan/train output."""
    shared = tuple(shared)
    untied = [s for s in shared if s.untied and s.kind != "copy"]
    kept = [s for s in shared if not s.untied and s.kind != "copy"]
    parts = []
    for apart, verb in ((False, "tied back"), (True, "kept apart")):
        copies = [s for s in shared if s.kind == "copy" and s.untied == apart]
        if copies:
            parts.append(f"{verb} {len(copies)} transposed {'copy' if len(copies) == 1 else 'copies'} "
                         f"({', '.join(f'{s.name} = {s.of} transposed' for s in copies[:4])}{' ...' if len(copies) > 4 else ''})")
    if untied:
        parts.append(f"untied {len(untied)} ({', '.join(f'{s.name} [{s.kind}, {len(s.modules)} modules]' for s in untied[:4])}"
                     f"{' ...' if len(untied) > 4 else ''})")
    if kept:
        parts.append(f"kept {len(kept)} shared ({', '.join(f'{s.name} [{s.kind}]' for s in kept[:4])}{' ...' if len(kept) > 4 else ''})")
    return "shared weights: " + "; ".join(parts) + "; override with --tie/--untie NAME"
