"""Prediction snapshot: every number the planner and the simulator predict for a fixed set of zoo models x
targets x stage counts x schedules, written to JSON, and a comparison of two such snapshots.

Used to show that a change to the code leaves the predictions as they were: run `record` on the old and on
the new code (with the same saved costs), then `diff`. The node costs are annotated once (profiled for the
cpu targets) and saved with `costs`, so profiling noise is out of the comparison.

Usage:
    .venv/bin/python tools/compare_predictions.py costs --out DIR
    .venv/bin/python tools/compare_predictions.py record --costs DIR --out FILE.json
    .venv/bin/python tools/compare_predictions.py diff OLD.json NEW.json [--rel 1e-9]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import onnxpipe
from onnxpipe.cost import Costs, NodeCost, annotate
from onnxpipe.graph import Graph, load
from onnxpipe.models import build
from onnxpipe.models.registry import spec
from onnxpipe.plan import compare
from onnxpipe.target import load_target

MODELS = ("mlp", "resnet-tiny", "gpt2-tiny", "bert-tiny", "gnmt-tiny", "inception-tiny", "two-io")
TARGETS = ("fpga4", "gpu4", "hetero", "cpu2", "cpu4")
SCHEDULES = ("gpipe", "1f1b")


def _graph(model: str) -> Graph:
    return load(build(model, train=spec(model).trainable))


def save_costs(out: Path) -> None:
    """Annotate each model once analytically and once profiled; write both as JSON."""
    out.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        graph = _graph(model)
        for profile in (False, True):
            costs = annotate(graph, profile=profile)
            data = {"unknown_ops": list(costs.unknown_ops), "profiled": costs.profiled,
                    "nodes": {n: dataclasses.asdict(c) for n, c in costs.nodes.items()}}
            (out / f"{model}.{'profiled' if profile else 'analytic'}.json").write_text(json.dumps(data))
            print(f"{model} profile={profile}: {len(costs.nodes)} nodes", flush=True)


def _load_costs(folder: Path, model: str, profiled: bool) -> Costs:
    data = json.loads((folder / f"{model}.{'profiled' if profiled else 'analytic'}.json").read_text())
    known = {f.name for f in dataclasses.fields(NodeCost)}
    nodes = {n: NodeCost(**{k: v for k, v in c.items() if k in known}) for n, c in data["nodes"].items()}
    return Costs(nodes=nodes, unknown_ops=tuple(data["unknown_ops"]), profiled=data["profiled"])


def _plan_row(plan: onnxpipe.Plan) -> dict[str, Any]:
    return {
        "bottleneck": plan.bottleneck_seconds,
        "lower_bound": plan.lower_bound_seconds,
        "iteration": plan.iteration_seconds,
        "status": plan.solver.status,
        "bound": plan.solver.bound_seconds,
        "gap": plan.solver.gap,
        "stages": [[list(s.devices), len(s.nodes), s.recompute, s.forward_seconds, s.backward_seconds, s.comm_in_seconds, s.comm_out_seconds,
                    s.allreduce_seconds, s.memory.total, s.stash_bytes, s.corun_slowdown] for s in plan.stages],
    }


def _sim_row(plan: onnxpipe.Plan, target: onnxpipe.Target, **options: Any) -> dict[str, Any]:
    sim = onnxpipe.simulate(plan, target, **options)
    return {"iteration": sim.iteration_seconds, "bubble": sim.bubble_fraction, "peak": list(sim.peak_memory_bytes), "busy": list(sim.busy_seconds)}


def record(costs_dir: Path, out: Path, time_limit: float) -> None:
    rows: dict[str, Any] = {}
    started = time.perf_counter()
    for model in MODELS:
        graph = _graph(model)
        for target_name in TARGETS:
            target = load_target(target_name)
            costs = _load_costs(costs_dir, model, target.profile)
            counts = sorted({1, 2, len(target.devices)})
            for k in counts:
                for schedule in SCHEDULES:
                    key = f"{model}/{target_name}/k={k}/{schedule}"
                    try:
                        plan = onnxpipe.make_plan(graph, costs, target, stages=k, schedule=schedule, time_limit=time_limit)
                    except onnxpipe.OnnxpipeError as exc:
                        rows[key] = {"error": str(exc)}
                        continue
                    row = _plan_row(plan)
                    row["sim"] = _sim_row(plan, target)
                    other = "1f1b" if schedule == "gpipe" else "gpipe"
                    row["sim_other"] = _sim_row(plan, target, schedule=other, microbatches=max(1, plan.microbatches // 2))
                    row["baselines"] = {name: _plan_row(p) for name, p in compare(graph, costs, target, plan).items()}
                    rows[key] = row
                    print(key, row["status"], f"{row['bottleneck']:.6g}", f"{row['iteration']:.6g}", flush=True)
            key = f"{model}/{target_name}/auto"
            try:
                plan = onnxpipe.make_plan(graph, costs, target, schedule="auto", microbatches="auto", time_limit=time_limit)
                rows[key] = {**_plan_row(plan), "sim": _sim_row(plan, target),
                             "explored": [[c.schedule, c.microbatches, c.stages, c.replicas, c.iteration_seconds, c.peak_memory_bytes, c.feasible]
                                          for c in plan.explored]}
                print(key, rows[key]["status"], flush=True)
            except onnxpipe.OnnxpipeError as exc:
                rows[key] = {"error": str(exc)}
    out.write_text(json.dumps(rows, indent=1))
    print(f"{len(rows)} rows in {time.perf_counter() - started:.0f} s -> {out}")


def _differences(old: Any, new: Any, rel: float, path: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        found = [f"{path}/{k}: only in one" for k in sorted(set(old) ^ set(new))]
        for k in sorted(set(old) & set(new)):
            found += _differences(old[k], new[k], rel, f"{path}/{k}")
        return found
    if isinstance(old, list) and isinstance(new, list):
        if len(old) != len(new):
            return [f"{path}: length {len(old)} != {len(new)}"]
        return [d for i, (a, b) in enumerate(zip(old, new)) for d in _differences(a, b, rel, f"{path}[{i}]")]
    if isinstance(old, float) or isinstance(new, float):
        if old == new or (math.isfinite(old) and math.isfinite(new) and abs(old - new) <= rel * max(abs(old), abs(new))):
            return []
        return [f"{path}: {old!r} != {new!r}"]
    return [] if old == new else [f"{path}: {old!r} != {new!r}"]


def diff(old_path: Path, new_path: Path, rel: float) -> int:
    old, new = json.loads(old_path.read_text()), json.loads(new_path.read_text())
    found = _differences(old, new, rel, "")
    numbers = sum(1 for _ in _leaves(old))
    statuses = sorted({r.get("status", "error") for r in old.values()})
    optimal = sum(1 for r in old.values() if r.get("status") == "OPTIMAL")
    print(f"{len(old)} configurations, {numbers} values compared at {rel:g} relative; statuses {statuses}; {optimal} OPTIMAL")
    for line in found[:50]:
        print(line)
    print(f"{len(found)} differences")
    return 1 if found else 0


def _leaves(value: Any):  # type: ignore[no-untyped-def]
    if isinstance(value, dict):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("costs")
    c.add_argument("--out", type=Path, required=True)
    r = sub.add_parser("record")
    r.add_argument("--costs", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--time-limit", type=float, default=30.0)
    d = sub.add_parser("diff")
    d.add_argument("old", type=Path)
    d.add_argument("new", type=Path)
    d.add_argument("--rel", type=float, default=1e-9)
    args = parser.parse_args()
    if args.command == "costs":
        save_costs(args.out)
    elif args.command == "record":
        record(args.costs, args.out, args.time_limit)
    else:
        sys.exit(diff(args.old, args.new, args.rel))


if __name__ == "__main__":
    main()
