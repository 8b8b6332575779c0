"""Measured times from elsewhere: profile once on the machine that has the hardware, plan anywhere.

Reading order: `import_times` (public entry: reads the file, tells the two formats apart) ->
`_trace_times` (onnxruntime's own profiling JSON) / `_block_times` (per-block times) -> `_spread`
(a block's time over its nodes) -> the small `_ensure_*` validators.

Two formats:
- onnxruntime's profiling JSON (`SessionOptions.enable_profiling`; a list of trace events), of the model
  itself or of its gradient graph: node names as in the model, gradient nodes `<node>_Grad/...`. Run with
  graph optimizations off so nodes keep their names; the first run is taken as warm-up when there are more.
- Block times, as a PyTorch user measures per module: `{"blocks": [{"block": "layer1.0", "nodes":
  ["/layer1/layer1.0/"], "fwd_ms": 2.47, "bwd_ms": 4.27}, ...]}`. A pattern with `*`, `?` or `[` is a glob
  over node names, any other a prefix; a node belongs to the block of its longest matching pattern. A
  block's time is spread over its nodes in proportion to their analytic time on the device.

Nodes the file does not cover keep their analytic cost. Every measured node records where its time came
from (`NodeCost.source`: "import:FILE" or "import:FILE#BLOCK") and the device kind it was taken on.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from dataclasses import replace
from fnmatch import fnmatchcase
from pathlib import Path
from typing import Any

from onnxpipe.cost import Costs, NodeCost, with_measurements
from onnxpipe.cost_profile import backward_by_forward, own_names, trace_medians
from onnxpipe.cost_trace import is_kernel, is_run
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph

__all__ = ["import_times", "PROVIDER_KINDS"]

#: Device kind of each onnxruntime execution provider whose traces can be imported without a device.
PROVIDER_KINDS = {
    "CPUExecutionProvider": "cpu", "CUDAExecutionProvider": "gpu", "ROCMExecutionProvider": "gpu",
    "TensorrtExecutionProvider": "gpu", "DmlExecutionProvider": "gpu", "MIGraphXExecutionProvider": "gpu",
}
#: Nodes onnxruntime adds to a session (copies between devices) and the loss `--profile` appends: not the model's.
_SESSION_NODES = ("Memcpy", "onnxpipe.profile_loss")
#: Analytic seconds of a node's forward (False) or backward (True) pass on the device the times were taken on.
AnalyticSeconds = Callable[[NodeCost, bool], float]


def import_times(graph: Graph, costs: Costs, path: str | Path, *, device_kind: str | None = None,
                 analytic: AnalyticSeconds | None = None) -> Costs:
    """`costs` with the times of `path` (either format, see the module doc). `device_kind`: the kind of device
    the times were taken on (block times need it; a trace says it by its provider). `analytic`: each node's
    analytic time on that device, which block times are spread by."""
    path = Path(path)
    data = _read_json(path)
    if isinstance(data, list):
        return _trace_times(graph, costs, data, path, device_kind)
    if isinstance(data, dict) and "blocks" in data:
        if device_kind is None or analytic is None:
            raise OnnxpipeError(f"{path}: block times are spread over each block's nodes by their analytic time on a device; "
                                "name the target they were measured on (--target)")
        return _block_times(graph, costs, data, path, device_kind, analytic)
    raise OnnxpipeError(f"{path}: not a times file; pass onnxruntime's profiling JSON (a list of trace events) "
                        'or block times {"blocks": [{"block", "nodes", "fwd_ms", "bwd_ms"}, ...]}')


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise OnnxpipeError(f"{path}: no such times file; pass the path of a profiling or block-times JSON") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise OnnxpipeError(f"{path}: cannot read the times file ({exc}); pass a readable JSON file") from exc
    except json.JSONDecodeError as exc:
        raise OnnxpipeError(f"{path}: not JSON ({exc.msg} at line {exc.lineno}); pass onnxruntime's profiling JSON or a block-times file") from exc


def _trace_times(graph: Graph, costs: Costs, events: list[Any], path: Path, device_kind: str | None) -> Costs:
    """Median per-run kernel time per node of an onnxruntime trace; gradient nodes summed per forward node."""
    nodes = [e for e in events if isinstance(e, dict) and is_kernel(e)]
    runs = [e for e in events if isinstance(e, dict) and is_run(e)]
    if not nodes or not runs:
        raise OnnxpipeError(f"{path}: no node kernel times and model runs in this trace; profile with "
                            "SessionOptions.enable_profiling = True and run the model at least once")
    for e in nodes + runs:
        if not isinstance(e.get("dur"), (int, float)) or isinstance(e.get("dur"), bool) or e["dur"] < 0 or not isinstance(e.get("ts"), (int, float)):
            raise OnnxpipeError(f"{path}: event {e.get('name')!r} has no valid ts/dur (got dur={e.get('dur')!r}); pass the trace onnxruntime wrote, unedited")
    kind = device_kind or _trace_kind(nodes, path)
    times = trace_medians(events, 1 if len(runs) > 1 else 0)
    known = set(graph.compute_nodes)
    merged = own_names({n: t for n, t in times.items() if not n.startswith(_SESSION_NODES)}, {n: 0.0 for n in known})
    unknown = sorted(n for n in merged if n.partition("_Grad/")[0] not in known)
    if unknown:
        raise OnnxpipeError(f"{path}: {len(unknown)} node name(s) are not compute nodes of {graph.source} (first: {unknown[0]!r}); "
                            "profile this same model with graph optimizations off (ORT_DISABLE_ALL) so nodes keep their names")
    forward = {n: t for n, t in merged.items() if "_Grad/" not in n}
    return with_measurements(costs, forward, backward_by_forward(merged), kind, f"import:{path.name}")


def _trace_kind(nodes: list[dict[str, Any]], path: Path) -> str:
    providers = [str(e.get("args", {}).get("provider", "")) for e in nodes]
    main = max(set(providers), key=providers.count)
    if main not in PROVIDER_KINDS:
        raise OnnxpipeError(f"{path}: nodes ran on {main or 'an unnamed provider'}, whose device kind onnxpipe does not know; "
                            "name the target the trace was taken on (--target)")
    return PROVIDER_KINDS[main]


def _block_times(graph: Graph, costs: Costs, data: dict[str, Any], path: Path, kind: str, analytic: AnalyticSeconds) -> Costs:
    blocks = data["blocks"]
    if not isinstance(blocks, list) or not blocks:
        raise OnnxpipeError(f"{path}: blocks: expected a non-empty list of {{\"block\", \"nodes\", \"fwd_ms\", \"bwd_ms\"}} entries")
    parsed = [_ensure_block(b, i, path) for i, b in enumerate(blocks)]
    owner = _assign(graph, parsed, path)
    forward: dict[str, float] = {}
    backward: dict[str, float] = {}
    for i, (label, _, fwd, bwd) in enumerate(parsed):
        members = [n for n in graph.compute_nodes if owner.get(n) == i]
        forward.update(_spread(members, fwd, [analytic(costs.nodes[n], False) for n in members]))
        backward.update(_spread(members, bwd, [analytic(costs.nodes[n], True) for n in members]))
    out = with_measurements(costs, forward, backward, kind, f"import:{path.name}")
    labels = {n: parsed[i][0] for n, i in owner.items()}
    return replace(out, nodes={n: _labelled(c, labels.get(n)) for n, c in out.nodes.items()})


def _labelled(cost: NodeCost, block: str | None) -> NodeCost:
    return replace(cost, source=f"{cost.source}#{block}") if block is not None and cost.source else cost


def _ensure_block(block: Any, i: int, path: Path) -> tuple[str, tuple[str, ...], float, float]:
    where = f"{path}: blocks[{i}]"
    if not isinstance(block, dict):
        raise OnnxpipeError(f"{where}: expected an object {{\"block\", \"nodes\", \"fwd_ms\", \"bwd_ms\"}}, got {block!r:.60}")
    label = block.get("block")
    if not isinstance(label, str) or not label:
        raise OnnxpipeError(f"{where}: missing \"block\" (its name, e.g. \"layer1.0\")")
    where += f" ({label!r})"
    patterns = block.get("nodes")
    if isinstance(patterns, str):
        patterns = [patterns]
    if not isinstance(patterns, list) or not patterns or not all(isinstance(p, str) and p for p in patterns):
        raise OnnxpipeError(f"{where}: missing \"nodes\": the node-name prefixes or globs of its nodes, e.g. [\"/layer1/layer1.0/\"]")
    seconds = []
    for key in ("fwd_ms", "bwd_ms"):
        value = block.get(key)
        if value is None:
            raise OnnxpipeError(f"{where}: missing {key}; give the block's forward and backward milliseconds (fwd_ms, bwd_ms)")
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise OnnxpipeError(f"{where}: {key} must be a number of milliseconds >= 0, got {value!r}")
        seconds.append(float(value) * 1e-3)
    return label, tuple(patterns), seconds[0], seconds[1]


def _assign(graph: Graph, blocks: list[tuple[str, tuple[str, ...], float, float]], path: Path) -> dict[str, int]:
    """Node -> index of the block whose matching pattern is longest; every pattern must match some node."""
    best: dict[str, tuple[int, int]] = {}
    for i, (label, patterns, _, _) in enumerate(blocks):
        for pattern in patterns:
            glob = any(ch in pattern for ch in "*?[")
            hits = [n for n in graph.compute_nodes if (fnmatchcase(n, pattern) if glob else n.startswith(pattern))]
            if not hits:
                example = graph.compute_nodes[len(graph.compute_nodes) // 2] if graph.compute_nodes else ""
                raise OnnxpipeError(f"{path}: block {label!r}: no compute node of {graph.source} matches {pattern!r} "
                                    f"(node names look like {example!r}); use a prefix or glob of the model's node names")
            for n in hits:
                if n not in best or len(pattern) > best[n][0]:
                    best[n] = (len(pattern), i)
                elif len(pattern) == best[n][0] and best[n][1] != i:
                    raise OnnxpipeError(f"{path}: node {n!r} matches blocks {blocks[best[n][1]][0]!r} and {label!r} equally; "
                                        "make one of the patterns more specific")
    return {n: i for n, (_, i) in best.items()}


def _spread(nodes: list[str], seconds: float, weights: list[float]) -> Mapping[str, float]:
    """A block's seconds over its nodes in proportion to their analytic times (evenly when all are zero)."""
    total = sum(weights)
    if not nodes:
        return {}
    if total <= 0:
        return {n: seconds / len(nodes) for n in nodes}
    return {n: seconds * w / total for n, w in zip(nodes, weights)}
