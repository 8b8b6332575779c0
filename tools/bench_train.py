"""Pipelined training on the real cpu targets: throughput against the unpartitioned model in one process
on the same cores, measured bubble against (k-1)/(m+k-1) (1F1B, and ZB-H1 beside it), transfer share of a step, and 1F1B vs GPipe
peak activation memory per stage. Prints the table and rewrites its section of docs/benchmarks.md.

Run: .venv/bin/python tools/bench_train.py [--steps N] [--ray]   (--ray: the Ray backend's step time over the local
backend's for the same plan, its own section)
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

from onnxpipe import models
from onnxpipe.train.fit import data_source
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline
from onnxpipe.train.prepare import TrainConfig, prepare_single
from onnxpipe.units import format_bytes
from benchdoc import write_section

NAME = Path(__file__).stem
CASES = [("gpt2-tiny", "cpu2", 2, 4), ("gpt2-tiny", "cpu2", 2, 8), ("resnet-tiny", "cpu2", 2, 8), ("gpt2-tiny", "cpu4", 4, 8)]


def single_process(model_name: str, m: int, steps: int, threads: int) -> float:
    """Median step seconds of the unpartitioned model in one process, `threads` intra-op threads."""
    model = models.build(model_name, train=True)
    config = TrainConfig(microbatches=m, optimizer=OptimizerConfig("sgd", lr=0.01), threads=threads)
    engine = LocalPipeline([prepare_single(model, config, "loss")])
    with Pipeline(model, "cpu2", stages=1, microbatches=m, processes=False) as probe:
        source = data_source(probe, "synthetic")
        batches = [probe.microbatches(source.batch(s)) for s in range(steps)]
    times = []
    for mbs in batches:
        start = time.perf_counter()
        engine.train_step(mbs)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def pipelined(model_name: str, target: str, k: int, m: int, schedule: str, steps: int) -> dict:
    with Pipeline(models.build(model_name, train=True), target, stages=k, microbatches=m, schedule=schedule,
                  optimizer=OptimizerConfig("sgd", lr=0.01)) as pipe:
        source = data_source(pipe, "synthetic")
        for s in range(steps):
            pipe.train_step(source.batch(s))
        out = pipe.metrics()
        out["stages_count"] = pipe.stages
        return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--ray", action="store_true", help="only the Ray backend against the local one")
    args = parser.parse_args()
    if args.ray:
        section = ray_rows(args.steps)
        print(section)
        write_section(NAME + "_ray", section)
        return
    rows = []
    for model_name, target, k, m in CASES:
        base = min(single_process(model_name, m, args.steps, threads=t) for t in sorted({1, min(k, os.cpu_count() or 1)}))
        runs = {s: pipelined(model_name, target, k, m, s, args.steps) for s in ("gpipe", "1f1b", "zb-h1")}
        one = runs["1f1b"]
        kk = one["stages_count"]
        rows.append({
            "case": f"{model_name} {target} k={kk} m={m}",
            "single_ms": base * 1e3, "pipe_ms": one["step_seconds"] * 1e3, "speedup": base / one["step_seconds"],
            "bubble": one["bubble_fraction"], "ideal": (kk - 1) / (m + kk - 1),
            "zb_ms": runs["zb-h1"]["step_seconds"] * 1e3, "zb_bubble": runs["zb-h1"]["bubble_fraction"], "transfer": one["transfer_fraction"], "transfer_cpu": one["transfer_cpu_fraction"],
            "act_gpipe": [s["peak_activation_bytes"] for s in runs["gpipe"]["stages"]],
            "act_1f1b": [s["peak_activation_bytes"] for s in one["stages"]],
        })
        print(rows[-1], flush=True)
    lines = [
        "## Pipelined training (measured)",
        "",
        f"Regenerate: `.venv/bin/python tools/{NAME}.py` ({args.steps} steps per run, medians after the first step; "
        f"{os.cpu_count()} cores). Baseline: the unpartitioned model's gradient graph in one process, the faster of 1 intra-op thread and one per core. Load average at the start: {os.getloadavg()[0]:.1f}.",
        "",
        "| case | 1 process ms/step | pipeline ms/step (1F1B) | speedup | bubble measured | (k-1)/(m+k-1) | ZB-H1 ms/step | ZB-H1 bubble measured | transfer share (wall) | transfer share (CPU) | peak activations GPipe | peak activations 1F1B |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['single_ms']:.2f} | {r['pipe_ms']:.2f} | {r['speedup']:.2f}x | {r['bubble']:.1%} | {r['ideal']:.1%} | {r['zb_ms']:.2f} | {r['zb_bubble']:.1%} | {r['transfer']:.1%} | {r['transfer_cpu']:.1%} | "
            f"{' / '.join(format_bytes(x) for x in r['act_gpipe'])} | {' / '.join(format_bytes(x) for x in r['act_1f1b'])} |"
        )
    lines += ["", "Bubble measured = 1 - sum of stage busy time / (k x step time): it also counts transfer, driver and scheduling overheads, "
              "so it sits above the ideal (k-1)/(m+k-1); ZB-H1's ideal at equal F, B and W times is (k-1)/(3m+k-1). Transfer share = time in the transport (copy into a reused shared-memory slot, "
              "header on the receiver's pipe, zero-copy read) / (k x step time), as wall-clock time (which on a loaded machine also counts "
              "preemption inside those calls) and as the calling thread's CPU time (the transport's own cost)."]
    section = "\n".join(lines)
    print(section)
    write_section(NAME, section)



# --- Ray backend against the local backend (`--ray`): same plan, steps interleaved -----------------

#: (model, size knobs, micro-batches): the quick-start sizes, and batches where a step takes 100-500 ms here.
RAY_CASES = [("gpt2-tiny", {}, 4), ("gpt2-tiny", {"batch": 64}, 4), ("gpt2-tiny", {"batch": 128}, 4),
             ("resnet-tiny", {}, 4), ("resnet-tiny", {"batch": 256}, 4), ("resnet-tiny", {"batch": 512}, 4)]
#: Ray / local step time allowed at steps of 100 ms and above; the simulator's Ray step error allowed.
RAY_RATIO_GOAL, RAY_PREDICTION_GOAL = 1.10, 0.15


def ray_rows(steps: int) -> str:
    """Median step time of the Ray backend over the local one for the same stage directory (gpt2-tiny and
    resnet-tiny, k=2 on cpu2), both pipelines alive, one step of each in turn; with the simulator's
    prediction for each backend (`Target.for_backend`: the Ray one prices cpu2's measured [backends.ray]).
    Ray runs on an instance of its own on this machine (loopback)."""
    import onnxpipe
    from onnxpipe.plan.result import Plan
    from onnxpipe.target import load_target

    target = load_target("cpu2")
    load0 = os.getloadavg()[0]
    lines, ratios, errors = [], [], []
    for name, knobs, m in RAY_CASES:
        model = models.build(name, train=True, **knobs)
        opt = OptimizerConfig("sgd", lr=0.01)
        with Pipeline(model, "cpu2", stages=2, microbatches=m, optimizer=opt) as local:
            with Pipeline(local.directory, "cpu2", microbatches=m, optimizer=opt, backend="ray") as on_ray:
                source = data_source(local, "synthetic")
                for s in range(steps):
                    batch = source.batch(s)
                    local.train_step(batch)
                    on_ray.train_step(batch)
                a, b = local.metrics()["step_seconds"], on_ray.metrics()["step_seconds"]
                plan = Plan.read(local.directory / "plan.json")
                p_local = onnxpipe.simulate(plan, target.for_backend("local")).iteration_seconds
                p_ray = onnxpipe.simulate(plan, target.for_backend("ray")).iteration_seconds
        if a >= 0.1:
            ratios.append(b / a)
        errors.append(abs(p_ray - b) / b)
        size = ", ".join(f"{k}={v}" for k, v in knobs.items()) or "quick-start size"
        lines.append(f"| {name} ({size}) k=2 m={m} | {a * 1e3:.1f} | {b * 1e3:.1f} | {b / a:.2f}x | {p_local * 1e3:.1f} ({(p_local - a) / a:+.0%}) "
                     f"| {p_ray * 1e3:.1f} | {(p_ray - b) / b:+.0%} |")
        print(lines[-1], flush=True)
    load1 = os.getloadavg()[0]
    held = lambda ok: "**holds**" if ok else "**MISSED**"  # noqa: E731
    return "\n".join([
        "## Ray backend against the local backend (measured)",
        "",
        f"`tools/{NAME}.py --ray` ({steps} steps of each backend in turn, medians after the first step; Ray on an instance of its "
        f"own on this 2-core machine; load average {load0:.1f} before, {load1:.1f} after"
        f"{': loaded, other work was running' if max(load0, load1) > 2.5 else ''}). Same stage directory (cpu2, 2 stages, 1F1B). "
        "Predicted: the simulator's step for that plan on cpu2 with the local backend's costs (error against the local step) "
        "and with the Ray backend's (`simulate --backend ray`: cpu2's [backends.ray], measured by tools/measure_ray.py --costs). "
        "What Ray adds per step (step_overhead, and per message the send, receive and latency figures): Ray's own work in the "
        "actors and the driver (serializing into and reading out of its channels, its threads); a command and its reply "
        "travel on the channels, and a receiver reads a tensor in place in the channel's buffer, as the local backend's "
        "receivers read their shared-memory slots.",
        "",
        "| case | local ms/step | Ray ms/step | Ray / local | predicted local ms (error) | predicted Ray ms | error vs Ray |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *lines,
        "",
        f"Goals: Ray / local at most {RAY_RATIO_GOAL:.2f}x at steps of 100 ms and above (worst: "
        f"{max(ratios, default=0.0):.2f}x): {held(bool(ratios) and max(ratios) <= RAY_RATIO_GOAL)}; the simulator's Ray step within "
        f"{RAY_PREDICTION_GOAL:.0%} of the measured one (worst: {max(errors):.0%}): {held(max(errors) <= RAY_PREDICTION_GOAL)}.",
    ])


if __name__ == "__main__":
    main()
