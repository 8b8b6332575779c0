"""Measured times against a target: import them (`import_for_target`, spreading block times by the target's
analytic times) and calibrate a target from them: fit one device group's time-model parameters (per-op-class
efficiencies, the launch overhead per kernel, and its `KernelModel`: achieved memory bandwidth, GEMM shape
half-points, Winograd speed-up) to models whose costs carry measured times, and write a new target file.

Reading order: `import_for_target` -> `units` (what was measured: a block of an imported block-times file, or one node) ->
`calibrate` (public entry: `_free_parameters` -> `_fit`, coordinate search on the weighted squared log error
of every unit's forward and backward time) -> `_report` (error per block and per op class) ->
`target_text` (the new TOML; `_toml` writes it).

The per-op-class error attributes each unit's measured time to the op classes by their shares of its
predicted time (exact for node-level measurements, an attribution for block times).
"""

from __future__ import annotations

import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from onnxpipe.cost import OP_CLASSES, Costs, NodeCost
from onnxpipe.cost_import import import_times
from onnxpipe.errors import OnnxpipeError
from onnxpipe.fileio import write_bytes
from onnxpipe.graph import Graph
from onnxpipe.pricing.timemodel import node_seconds
from onnxpipe.target import Device, KernelModel, Target

__all__ = ["Unit", "FitRow", "Calibration", "import_for_target", "units", "calibrate", "target_text", "write_target"]


@dataclass(frozen=True)
class Unit:
    """Something measured as a whole: a block of a block-times file, or one node."""

    #: "model: block" or "model: node".
    name: str
    nodes: tuple[NodeCost, ...]
    forward_seconds: float
    backward_seconds: float


@dataclass(frozen=True)
class FitRow:
    """Measured against predicted seconds (forward + backward) of a block or op class, before and after the fit."""

    name: str
    measured: float
    before: float
    after: float


@dataclass(frozen=True)
class Calibration:
    """The fitted device group and how well the fit holds."""

    #: The base target with the fitted group's parameters replaced.
    target: Target
    group: str
    #: Fitted parameter -> value ("efficiency.conv", "op_overhead", "kernels.winograd_speedup", ...).
    parameters: Mapping[str, float]
    blocks: tuple[FitRow, ...]
    classes: tuple[FitRow, ...]
    #: Root mean square of log(predicted / measured) over the units, weighted by measured time.
    error_before: float
    error_after: float


def import_for_target(graph: Graph, costs: Costs, path: str | Path, target: Target | None = None) -> Costs:
    """`costs` with the measured times of `path` (`onnxpipe.cost_import.import_times`), taken to be measured on
    `target`'s first device group: block times are spread by their nodes' analytic times there."""
    device = target.devices[0] if target is not None else None
    if device is None:
        return import_times(graph, costs, path)
    return import_times(graph, costs, path, device_kind=device.kind, analytic=lambda c, backward: node_seconds(device, c, backward=backward))


def units(model: str, costs: Costs) -> list[Unit]:
    """The measured units of a model's costs: nodes of one imported block together (their `source` ends in
    "#block"), every other measured node alone."""
    grouped: dict[str, list[NodeCost]] = {}
    for name, cost in costs.nodes.items():
        if cost.measured_seconds is None:
            continue
        _, mark, block = cost.source.partition("#")
        grouped.setdefault(block if mark else name, []).append(cost)
    return [
        Unit(f"{model}: {key}", tuple(replace(c, measured_seconds=None, measured_backward_seconds=None, measured_inference_seconds=None)
                                      for c in members),
             sum(c.measured_seconds or 0.0 for c in members), sum(c.measured_backward_seconds or 0.0 for c in members))
        for key, members in grouped.items()
    ]


def calibrate(measured: Sequence[Unit], target: Target, group: str | None = None, *, sweeps: int = 4) -> Calibration:
    """Fit `group`'s (default: the first group's) parameters to the measured units."""
    if not measured:
        raise OnnxpipeError("no measured times to calibrate on; annotate the model with --profile or --times first")
    groups = target.groups()
    group = group or target.devices[0].group
    if group not in groups:
        raise OnnxpipeError(f"no device group {group!r} in {target.name}; groups: {', '.join(groups)}")
    base = groups[group][0]
    free = _free_parameters(measured, base)
    start = {key: _get(base, key) for key in free}
    fitted = _fit(measured, base, free, start, sweeps)
    device = _with(base, fitted)
    devices = tuple(_with(d, fitted) if d.group == group else d for d in target.devices)
    blocks, classes = _report(measured, base, device)
    return Calibration(
        target=replace(target, devices=devices), group=group, parameters=fitted, blocks=blocks, classes=classes,
        error_before=_error(measured, base), error_after=_error(measured, device),
    )


#: Search range of each kind of parameter.
_BOUNDS = {"efficiency": (0.02, 1.0), "op_overhead": (0.0, 50e-6), "kernels.memory_efficiency": (0.2, 1.0),
           "kernels.reduction_half": (0.0, 1024.0), "kernels.columns_half": (0.0, 1024.0), "kernels.winograd_speedup": (1.0, 4.0)}


def _free_parameters(measured: Sequence[Unit], device: Device) -> list[str]:
    """The parameters the measurements say something about: the efficiency of each op class with at least 1%
    of the measured FLOPs, the launch overhead, the memory efficiency, and the GEMM shape terms when GEMMs
    (and Winograd-shaped convolutions) are measured."""
    flops: dict[str, float] = {}
    for unit in measured:
        for c in unit.nodes:
            flops[c.op_class] = flops.get(c.op_class, 0.0) + c.flops
    total = sum(flops.values()) or 1.0
    free = [f"efficiency.{k}" for k in OP_CLASSES if flops.get(k, 0.0) / total >= 0.01]
    free += ["op_overhead", "kernels.memory_efficiency"]
    nodes = [c for u in measured for c in u.nodes]
    if any(c.gemm_k for c in nodes):
        free += ["kernels.reduction_half", "kernels.columns_half"]
    if sum(c.flops for c in nodes if c.winograd) / total >= 0.01:
        free.append("kernels.winograd_speedup")
    return free


def _get(device: Device, key: str) -> float:
    head, _, tail = key.partition(".")
    if head == "efficiency":
        return device.efficiency.get(tail, device.efficiency.get("default", 1.0))
    if head == "kernels":
        return float(getattr(device.kernels, tail))
    return float(getattr(device, key))


def _with(device: Device, values: Mapping[str, float]) -> Device:
    efficiency = dict(device.efficiency)
    kernels = {f.name: getattr(device.kernels, f.name) for f in fields(KernelModel)}
    plain = {}
    for key, value in values.items():
        head, _, tail = key.partition(".")
        if head == "efficiency":
            efficiency[tail] = value
        elif head == "kernels":
            kernels[tail] = value
        else:
            plain[key] = value
    return replace(device, efficiency=efficiency, kernels=KernelModel(**kernels), **plain)


def _predict(unit: Unit, device: Device) -> tuple[float, float]:
    return (sum(node_seconds(device, c) for c in unit.nodes), sum(node_seconds(device, c, backward=True) for c in unit.nodes))


def _error(measured: Sequence[Unit], device: Device) -> float:
    """Weighted root mean square of log(predicted / measured) over forward and backward times."""
    total = weighted = 0.0
    for unit in measured:
        for predicted, actual in zip(_predict(unit, device), (unit.forward_seconds, unit.backward_seconds)):
            if actual > 0 and predicted > 0:
                weighted += actual * math.log(predicted / actual) ** 2
                total += actual
    return math.sqrt(weighted / total) if total else 0.0


def _objective(measured: Sequence[Unit], base: Device, values: Mapping[str, float], start: Mapping[str, float]) -> float:
    """Squared fit error plus a pull toward the base values (a log-normal prior: moving a parameter by a factor f
    costs PRIOR x log(f)^2), so parameters the measurements barely tell apart stay near their datasheet values."""
    pull = sum(math.log((values[k] + _SOFT) / (start[k] + _SOFT)) ** 2 for k in values)
    return _error(measured, _with(base, values)) ** 2 + PRIOR * pull


#: Weight of the pull toward the base target's values (see `_objective`): a factor e costs as much as a 55% RMS fit
#: error. Chosen on shared/measured/h100 (calibrating on one model, pricing the other): 0.03 and 0.1 fit ResNet-50
#: from VGG-16 so that its k=2 partition ran 1.07x the best; 0.3 keeps both within 1.05x.
PRIOR = 0.3
#: Added to a parameter before taking its log, so zero-valued ones (a half-point of 0) can move.
_SOFT = 1e-9


def _fit(measured: Sequence[Unit], base: Device, free: list[str], start: dict[str, float], sweeps: int) -> dict[str, float]:
    """Coordinate search: each parameter in turn over a grid of its range, then finer grids around the best."""
    values = dict(start)
    score = _objective(measured, base, values, start)
    for _ in range(sweeps):
        for key in free:
            low, high = _BOUNDS.get(key, _BOUNDS["efficiency"] if key.startswith("efficiency") else (0.0, 1.0))
            best, best_score = values[key], score
            lo, hi = low, high
            for _round in range(3):
                for candidate in _grid(lo, hi, 9):
                    trial = _objective(measured, base, {**values, key: candidate}, start)
                    if trial < best_score - 1e-12:
                        best, best_score = candidate, trial
                span = (hi - lo) / 8
                lo, hi = max(low, best - span), min(high, best + span)
            values[key], score = best, best_score
    return values


def _grid(low: float, high: float, n: int) -> list[float]:
    """n points from low to high, geometric when the range allows it (scale parameters), else even."""
    if low > 0:
        return [low * (high / low) ** (i / (n - 1)) for i in range(n)]
    return [low + (high - low) * i / (n - 1) for i in range(n)]


def _report(measured: Sequence[Unit], before: Device, after: Device) -> tuple[tuple[FitRow, ...], tuple[FitRow, ...]]:
    blocks = tuple(FitRow(u.name, u.forward_seconds + u.backward_seconds, sum(_predict(u, before)), sum(_predict(u, after))) for u in measured)
    classes: dict[str, list[float]] = {}
    for unit in measured:
        actual = unit.forward_seconds + unit.backward_seconds
        shares = {k: [0.0, 0.0] for k in OP_CLASSES}
        for c in unit.nodes:
            for i, device in enumerate((before, after)):
                shares[c.op_class][i] += node_seconds(device, c) + node_seconds(device, c, backward=True)
        predicted_after = sum(s[1] for s in shares.values()) or 1.0
        for k, (b, a) in shares.items():
            if b or a:
                row = classes.setdefault(k, [0.0, 0.0, 0.0])
                row[0] += actual * a / predicted_after
                row[1] += b
                row[2] += a
    return blocks, tuple(FitRow(k, m, b, a) for k, (m, b, a) in classes.items())


def target_text(calibration: Calibration, base_source: str, note: str) -> str:
    """The base target's TOML with the calibrated group's fitted values, each marked with `note`."""
    try:
        doc = tomllib.loads(Path(base_source).read_text(encoding="utf-8"))
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise OnnxpipeError(f"{base_source}: cannot re-read the base target ({exc}); pass a readable target file") from exc
    doc["name"] = f"{doc['name']}-calibrated"
    comments: dict[str, str] = {}
    for table in doc["devices"]:
        if table["name"] != calibration.group:
            continue
        for key, value in calibration.parameters.items():
            head, _, tail = key.partition(".")
            if head == "op_overhead":
                table["op_overhead"] = f"{value * 1e6:.3g} us"
            else:
                table.setdefault(head, {})[tail] = round(value, 4)
            comments[key] = note
    header = (f"# {doc['name']}: {base_source} calibrated by `onnxpipe calibrate` ({note}).\n"
              f"# Fit error (weighted RMS of log predicted/measured): {calibration.error_before:.3f} before, {calibration.error_after:.3f} after.\n")
    return header + _toml(doc, comments)


def _toml(doc: dict[str, Any], comments: Mapping[str, str]) -> str:
    """A target document as TOML: top-level keys, then [[devices]] (with their sub-tables) and [[links]]."""
    lines = [f"{k} = {_value(v)}" for k, v in doc.items() if not isinstance(v, (dict, list)) or (isinstance(v, list) and not _tables(v))]
    lines += [f"[{k}]\n" + "\n".join(f"{kk} = {_value(vv)}" for kk, vv in v.items()) for k, v in doc.items() if isinstance(v, dict)]
    for key, value in doc.items():
        if isinstance(value, list) and _tables(value):
            for table in value:
                lines.append(f"\n[[{key}]]")
                lines += [f"{k} = {_value(v)}{_note(comments, k)}" for k, v in table.items() if not isinstance(v, dict)]
                for sub, entries in table.items():
                    if isinstance(entries, dict):
                        lines.append(f"[{key}.{sub}]")
                        lines += [f"{k} = {_value(v)}{_note(comments, f'{sub}.{k}')}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def _tables(value: list[Any]) -> bool:
    return bool(value) and all(isinstance(v, dict) for v in value)


def _note(comments: Mapping[str, str], key: str) -> str:
    return f"  # fitted: {comments[key]}" if key in comments else ""


def _value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    return repr(value)


def write_target(calibration: Calibration, base_source: str, note: str, path: str | Path) -> None:
    """Write the calibrated target file atomically, and check it loads."""
    text = target_text(calibration, base_source, note)
    try:
        tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:  # a value the writer does not know how to spell
        raise OnnxpipeError(f"cannot write {base_source} back as TOML ({exc}); simplify the base target file") from exc
    try:
        write_bytes(path, text.encode())
    except OSError as exc:
        raise OnnxpipeError(f"{path}: cannot write the calibrated target ({exc.strerror}); choose a writable -o path") from exc
