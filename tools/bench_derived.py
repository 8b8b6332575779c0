"""Derived nodes benchmark: each real export with derived nodes (`Graph.derived_nodes`: elementwise and data-movement
ops on the inputs alone, such as an attention mask made from the padding mask) planned twice in one run, on gpu4,
hetero and fpga4 with 2, 4 and 8 stages: as `onnxpipe plan` plans it (each stage reading a derived tensor makes it
again) and with those nodes placed by the plan as compute nodes (their tensors sent from the stage holding them).
Reports each one's least bottleneck found and gap over its bound, the plan's predicted iteration time, and the
ratios made again / placed (< 1: making them again is faster).

Usage: .venv/bin/python tools/bench_derived.py [--time-limit S] [--only a,b,...]   (exports: tools/export_real_models.py)
Prints the table and rewrites its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from pathlib import Path

from onnxpipe.cost import annotate
from onnxpipe.graph import Graph, load
from onnxpipe.plan import choose_mode, plan
from onnxpipe.target import load_target
from bench_plan import EXPORT_TARGETS, EXPORTS, EXPORTS_DIR, STAGES, doubled, least_bottleneck, least_gap
from benchdoc import cpu_model, write_section

SECTION = "bench_derived"


def run(time_limit: float, only: list[str]) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in only:
            model = EXPORTS_DIR / f"{name}.onnx"
            if not model.exists():
                print(f"{model}: missing; run tools/export_real_models.py first", flush=True)
                continue
            graph = load(model, EXPORTS[name])
            if not graph.derived_nodes:
                print(f"{name}: no derived nodes", flush=True)
                continue
            placed: Graph = dataclasses.replace(graph, derived_nodes=frozenset())
            costs = annotate(graph)
            for t in EXPORT_TARGETS:
                for k in STAGES:
                    target = load_target(doubled(t, Path(tmp)) if k > len(load_target(t).devices) else t)
                    made, sent = (plan(g, costs, target, stages=k, time_limit=time_limit, mode=choose_mode(g, None)) for g in (graph, placed))
                    row = dict(model=name, derived=len(graph.derived_nodes), target=t, k=k,
                               made=least_bottleneck(made), made_gap=least_gap(made), made_iteration=made.iteration_seconds, made_solve=made.solver.solve_seconds,
                               sent=least_bottleneck(sent), sent_gap=least_gap(sent), sent_iteration=sent.iteration_seconds, sent_solve=sent.solver.solve_seconds)
                    rows.append(row)
                    print(row, flush=True)
    return rows


def report(rows: list[dict], time_limit: float, load_avg: tuple[float, float]) -> str:
    lines = [
        "## Derived nodes: made again in each stage or placed and sent",
        "",
        f"Regenerate: `.venv/bin/python tools/bench_derived.py --time-limit {time_limit:g}` ({os.cpu_count()} cores of {cpu_model()}, "
        f"1-minute load average {load_avg[0]:.1f} to {load_avg[1]:.1f}). Each export with derived nodes (`Graph.derived_nodes`) planned",
        "in one run both ways with the same costs and limit: `made`, as `onnxpipe plan` does (each stage reading a derived tensor",
        "makes it again, paying its makers' time), `sent`, those nodes placed by the plan as compute nodes and their tensors",
        "sent. Bottleneck: the least found (ms per micro-batch), with its gap over the bound valid for every plan and the",
        "seconds of solving (at most the limit); iteration:",
        "the returned plan's predicted iteration (the least of the solver's and the baselines'). Ratios made / sent: < 1 is faster.",
        "",
        "| model | derived nodes | target | k | made bottleneck | gap | solve s | sent bottleneck | gap | solve s | bottleneck ratio | iteration ratio |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(f"| {r['model']} | {r['derived']} | {r['target']} | {r['k']} | {r['made'] * 1e3:.3f} | {r['made_gap']:.2%} | {r['made_solve']:.1f} | "
                     f"{r['sent'] * 1e3:.3f} | {r['sent_gap']:.2%} | {r['sent_solve']:.1f} | {r['made'] / r['sent']:.3f} | {r['made_iteration'] / r['sent_iteration']:.3f} |")
    if rows:
        ratios = [r["made"] / r["sent"] for r in rows]
        lines += ["", f"Bottleneck ratio: least {min(ratios):.3f}, most {max(ratios):.3f} over {len(rows)} configurations."]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--time-limit", type=float, default=10.0)
    parser.add_argument("--only", default=",".join(EXPORTS), help="which exports")
    args = parser.parse_args()
    start = os.getloadavg()[0]
    rows = run(args.time_limit, [m for m in args.only.split(",") if m])
    text = report(rows, args.time_limit, (start, os.getloadavg()[0]))
    print(text)
    write_section(SECTION, text)


if __name__ == "__main__":
    main()
