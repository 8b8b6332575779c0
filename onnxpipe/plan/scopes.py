"""Module paths of compute nodes, from what exporters leave in the graph, and how deep each gap of the
topological order cuts into them: coarsening prefers to end blocks where a module (a layer, a block of
layers) ends.

Sources, first found wins: the dynamo exporter's `pkg.torch.onnx.name_scopes` metadata (the module path
as a list, the op's own name last), its `namespace` metadata (`name: Class/name: Class/.../op: aten.op`),
and TorchScript-style node names (`/encoder/layer.0/attention/MatMul`: the path, then the op). A node
with none of them (one an optimiser made, say) is placed in the modules its nearest named neighbours in the
order share, so it adds no boundary of its own; a graph without any names has no boundaries and is
coarsened as before.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

import numpy as np
import onnx

from onnxpipe.graph import Graph

__all__ = ["module_path", "boundary_depths"]

_NAME_SCOPES = "pkg.torch.onnx.name_scopes"
_NAMESPACE = "namespace"


def module_path(node: onnx.NodeProto) -> tuple[str, ...]:
    """The modules enclosing `node`, outermost first (its own op name left out)."""
    meta = {p.key: p.value for p in node.metadata_props}
    if _NAME_SCOPES in meta:
        try:
            scopes = ast.literal_eval(meta[_NAME_SCOPES])
        except (ValueError, SyntaxError):
            scopes = None
        if isinstance(scopes, list) and all(isinstance(s, str) for s in scopes):
            return tuple(s for s in scopes[:-1] if s)
    if _NAMESPACE in meta:
        names = [part.split(":", 1)[0].strip() for part in meta[_NAMESPACE].split("/")]
        return tuple(n for n in names[:-1] if n)
    if "/" in node.name:
        return tuple(p for p in node.name.split("/")[:-1] if p)
    return ()


def boundary_depths(graph: Graph, nodes: Sequence[str]) -> np.ndarray:
    """(len(nodes) + 1,) per gap of `nodes` (in order): how many enclosing modules the nodes on both sides
    share (0 at both ends: the graph itself ends there). The lower, the more of a module boundary."""
    paths = _filled([module_path(graph.node(n)) for n in nodes])
    depths = np.zeros(len(nodes) + 1, dtype=np.int64)
    for p in range(1, len(nodes)):
        depths[p] = len(_shared(paths[p - 1], paths[p]))
    return depths


def _filled(paths: list[tuple[str, ...]]) -> list[tuple[str, ...]]:
    """Each empty path replaced by what the nearest non-empty ones before and after it share (the one
    there is at either end)."""
    known = [i for i, p in enumerate(paths) if p]
    out = list(paths)
    for before, after in zip([None, *known], [*known, None]):
        lo = before + 1 if before is not None else 0
        hi = after if after is not None else len(paths)
        if lo >= hi or (before is None and after is None):
            continue
        fill = _shared(paths[before], paths[after]) if before is not None and after is not None else paths[before if after is None else after]
        out[lo:hi] = [fill] * (hi - lo)
    return out


def _shared(a: tuple[str, ...], b: tuple[str, ...]) -> tuple[str, ...]:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return a[:n]
