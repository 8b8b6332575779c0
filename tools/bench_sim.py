"""Simulator fidelity: predicted iteration time of a plan against `onnxpipe train` measuring the same plan.

For each trainable zoo model x cpu target x schedule: plan with profiled node costs (the cpu targets
profile on this machine), split, train the stage directory as worker processes, and compare the
measured median step time with `simulate(plan, target)`. Prints the table and rewrites its section of
docs/benchmarks.md.
Run: .venv/bin/python tools/bench_sim.py [--steps N] [--models a,b] [--targets cpu2,cpu4]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import onnx

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan import plan_model
from onnxpipe.simulate import simulate
from onnxpipe.split import split
from onnxpipe.train.fit import data_source
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline

NAME = Path(__file__).stem
DOC = Path(__file__).resolve().parent.parent / "docs" / "benchmarks.md"
MODELS = ("mlp", "resnet-tiny", "inception-tiny", "transformer-tiny", "gpt2-tiny", "bert-tiny", "two-io")
#: Stages and micro-batches per target: one stage per worker, 2 x stages micro-batches.
SHAPES = {"cpu2": (2, 4), "cpu4": (4, 8)}
SCHEDULES = ("gpipe", "1f1b")
GOAL = 0.15
NOTE = (
    "Known gap: the simulator prices the plan's compute (profiled node times summed per stage), transfers and optimizer "
    "step only; the executor's fixed cost per action (an onnxruntime session run, shared-memory hand-off and queue "
    "signalling, visible as the mlp cases' 2-6 ms against 0.1-0.3 ms predicted) and CPU contention with other processes "
    "(load average above the 2 cores) are not modelled yet, so every prediction is low."
)


def measure(model_name: str, target: str, schedule: str, steps: int, work: Path) -> dict:
    """Plan with profiled costs, split, train; the measured and simulated figures of one case."""
    k, m = SHAPES[target]
    path = work / f"{model_name}.onnx"
    if not path.exists():
        onnx.save(models.build(model_name, train=True), str(path))
    graph, _, tgt, plan = plan_model(path, target, stages=k, microbatches=m, schedule=schedule, optimizer="sgd", time_limit=5.0)
    stages = work / f"{model_name}-{target}-{schedule}"
    split(graph, plan, stages, force=True)
    with Pipeline(stages, target, microbatches=m, schedule=schedule, optimizer=OptimizerConfig("sgd", lr=0.01)) as pipe:
        source = data_source(pipe, "synthetic")
        for s in range(steps):
            pipe.train_step(source.batch(s))
        measured = pipe.metrics()
    sim = simulate(plan, tgt)
    return {
        "case": f"{model_name} {target} k={len(plan.stages)} m={m} {schedule}",
        "measured": measured["iteration_seconds"],
        "simulated": sim.iteration_seconds,
        "planner": plan.iteration_seconds,
        "bubble_measured": measured["bubble_fraction"],
        "bubble_simulated": sim.bubble_fraction,
        "error": sim.iteration_seconds / measured["iteration_seconds"] - 1.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default=",".join(SHAPES))
    args = parser.parse_args()
    rows, failures = [], []
    load = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        for model_name in args.models.split(","):
            for target in args.targets.split(","):
                for schedule in SCHEDULES:
                    try:
                        rows.append(measure(model_name, target, schedule, args.steps, Path(tmp)))
                        print(rows[-1], flush=True)
                    except OnnxpipeError as exc:
                        failures.append(f"{model_name} {target} {schedule}: {exc}")
                        print(failures[-1], flush=True)
    within = sum(abs(r["error"]) <= GOAL for r in rows)
    lines = [
        f"<!-- {NAME}:start -->",
        "## Simulator fidelity (predicted vs measured iteration time)",
        "",
        f"Regenerate: `.venv/bin/python tools/{NAME}.py --steps {args.steps} --models {args.models} --targets {args.targets}` ({os.cpu_count()} cores, load average {load:.1f} at the start). "
        "Each case: `onnxpipe plan` with profiled node costs (the cpu targets profile on this machine), `onnxpipe split`, "
        "then `onnxpipe train` on the stage directory (worker processes, shared-memory transport, SGD; median step after the first) "
        "against `onnxpipe simulate` of the same plan. Error = simulated / measured - 1; goal |error| <= 15%. "
        "Bubble = 1 - sum(busy) / (k x iteration), busy = F + B + optimizer step compute, in both.",
        "",
        "| case | measured ms | simulated ms | error | planner ms | bubble measured | bubble simulated |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['measured'] * 1e3:.2f} | {r['simulated'] * 1e3:.2f} | {r['error']:+.1%} | {r['planner'] * 1e3:.2f} | "
            f"{r['bubble_measured']:.1%} | {r['bubble_simulated']:.1%} |"
        )
    lines += ["", f"Within 15%: **{within} of {len(rows)}** cases. {NOTE}"]
    lines += [f"- not run: {f}" for f in failures]
    lines.append(f"<!-- {NAME}:end -->")
    section = "\n".join(lines)
    print(section)
    write_section(section)


def write_section(section: str) -> None:
    """Replace this tool's section of docs/benchmarks.md (or append it), atomically."""
    DOC.parent.mkdir(parents=True, exist_ok=True)
    text = DOC.read_text() if DOC.exists() else "# Benchmarks\n"
    start, end = f"<!-- {NAME}:start -->", f"<!-- {NAME}:end -->"
    if start in text and end in text:
        text = text[: text.index(start)] + section + text[text.index(end) + len(end) :]
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    tmp = DOC.with_name(DOC.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, DOC)


if __name__ == "__main__":
    main()
