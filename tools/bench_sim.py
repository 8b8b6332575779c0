"""Simulator fidelity: predicted iteration time of a plan against `onnxpipe train` measuring the same plan.

For each trainable zoo model x cpu target x schedule: plan with profiled node costs (the cpu targets
profile on this machine) and split (the stage directory holds the plan JSON), then train that directory
with `onnxpipe train DIR --json` in its own process and simulate the saved plan with the same schedule
and micro-batches: measured median `step_seconds` against simulated `iteration_seconds`. Each row notes
the load average when it ran (the cpu targets are this machine's cores, shared with whatever else runs).
Prints the table and rewrites its section of docs/benchmarks.md.
The zoo models run at pipeline sizes (`KNOBS`: one training step of 30-200 ms on cpu2, stage compute of
milliseconds per micro-batch); `--knobs model:k=v,k=v` (repeatable) overrides them.
Run: .venv/bin/python tools/bench_sim.py [--steps N] [--models a,b] [--targets cpu2,cpu4] [--knobs mlp:width=512] [--rows FILE]
`--rows FILE` splits the benchmark into runs short enough to hold the machine quiet: each run replaces FILE's rows
(JSON lines) of the models it measures with its own and writes the table of every row FILE holds, so running it once per
model builds the whole table (and running a model again replaces its rows).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import onnx

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan import plan as plan_for, plan_model
from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan
from onnxpipe.schedule import SCHEDULES, virtual
from onnxpipe.split import split
from onnxpipe.target import Target, load_target
from benchdoc import write_section

NAME = Path(__file__).stem
MODELS = ("mlp", "resnet-tiny", "inception-tiny", "transformer-tiny", "gpt2-tiny", "bert-tiny", "gnmt-tiny", "two-io")
#: Zoo knobs per model: one training step takes 100-160 ms on cpu2, 185-280 ms on cpu4 (per micro-batch stage compute of
#: milliseconds), so fixed per-message costs (tens of microseconds) are small against a stage's compute.
KNOBS: dict[str, dict[str, int | bool]] = {
    "mlp": {"layers": 8, "width": 1024, "in_features": 512, "batch": 128},
    "resnet-tiny": {"channels": 32, "image": 32, "batch": 16},
    "inception-tiny": {"channels": 24, "image": 32, "batch": 16},
    "transformer-tiny": {"layers": 4, "d_model": 192, "heads": 4, "seq": 32, "batch": 16},
    "gpt2-tiny": {"d_model": 192, "seq": 32, "batch": 16},
    "bert-tiny": {"layers": 4, "d_model": 192, "seq": 32, "batch": 16},
    "gnmt-tiny": {"hidden": 128, "seq": 24, "batch": 16, "vocab": 512},
    "two-io": {"width": 1024, "in_features": 512, "batch": 256},
}
#: Devices and micro-batches per target: one worker process per device, 2 x devices micro-batches.
SHAPES = {"cpu2": (2, 4), "cpu4": (4, 8)}
GOAL = 0.15
NOTE = (
    "The simulator adds the targets' measured fixed costs (tools/measure_cpu.py): `action_overhead` per forward and "
    "backward action, `step_overhead` per step (the driver), hand-offs priced as measured inside the executor; the "
    "target's `cores` (1.9 cores' worth for one-thread workers, less the measured background in the simulated column) "
    "are assigned as the OS does: a worker holds a core from waking until it blocks; node times come from the gradient "
    "graph's run, each node's kernel time plus its share of the session's time between kernels (3-5 us per node, "
    "4% of a decoder's run; counting it moved the cpu2 busy error from about -7% to -3%). Each backward also hands its "
    "weight gradients to the executor, which sums them (`gradient_bandwidth`, 12 GB/s: a StageRunner's backward of the "
    "14 MiB perceptron stage runs 1.2-1.3 ms past its profile, alone); this, not contention, was most of mlp's busy "
    "error (-10% to -17% on cpu2 before). Workers computing together whose working sets overflow the shared L3 slow by "
    "their weight bytes / `corun_bandwidth` (105 GB/s: the mean of phases measured at 49-64 GB/s and phases without any "
    "co-run slowdown; the host alternates between them minute to minute). At the smallest zoo sizes "
    "(steps of 0.7-15 ms, bubbles of 40-94%) fixed per-message and wake-up costs dominate and only 16 of 56 runs were "
    "within 15%. Each SEND and RECV costs its worker CPU on a core (`send_overhead` + bytes / `send_bandwidth`, "
    "`recv_overhead`: tools/measure_cpu.py messages, the executor's transport with memory traffic beside it: 85 us + "
    "bytes / 11 GB/s and 124 us, where the same tool read 35 us + bytes / 29 GB/s and 65 us three days earlier), and on cpu4 "
    "(4 workers on the 2 vCPUs) the workers are placed as the OS does, each part measured (tools/measure_cpu.py, see "
    "cpu4.toml): they take 4 ms turns on a vCPU (`time_slice`), a worker woken while both vCPUs are busy runs first on "
    "its waker's (`wake_affine`), and one taking a core another held last pays `switch_cost` (55 us) or, where the "
    "working sets overflow the L3 together, reads back what the rest of its action touches at `switch_bandwidth` "
    "(25 GB/s). Before these, with run-until-blocked core holding and the older hand-off price, cpu4 was simulated low by "
    "a median 9.1% / 11.5% (gpipe / 1f1b), its busy time (the actions' wall time, time slices waited included) by "
    "28.9% / 34.7%; now +0.9% / -2.3% and +3.5% / -4.5%. The host's share of the 2 vCPUs drifts: the same "
    "case measured 20% apart in runs minutes apart, and profiling drifts with it; without the message and switch costs, "
    "one of two runs gave 62 of 64 within 15% (cpu4 1f1b mlp -17.2%, resnet-tiny -17.7%); with them, two of two gave 64 of 64. "
    "Workers keep the memory they free (`train.worker.keep_freed_memory`: glibc's mallopt, no mmap per tensor, no trim); before, "
    "each action faulted in fresh pages for its outputs, gradient sums and optimizer temporaries, which the profile (run in "
    "onnxruntime's arena) never pays. On a host where a 4 KiB page fault costs 2-3.5 us (this VM, weeks later, 2.4x slower "
    "throughout) that made mlp cpu2's optimizer step 10 ms instead of 2.5 ms and its backward 3 ms (10%) longer than its "
    "profile: error -18% / -12% (gpipe / 1f1b), busy error -14% / -8% (one quiet run each)."
)


def _runnable_others(ours: int) -> int:
    """Processes running or ready to run (state R in /proc), other than this one and the tree under `ours`."""
    parent, running = {}, set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        pid = int(stat.parent.name)
        parent[pid] = int(fields[1])
        if fields[0] == "R":
            running.add(pid)

    def mine(pid: int) -> bool:
        while pid > 1:
            if pid in (ours, os.getpid()):
                return True
            pid = parent.get(pid, 0)
        return False

    return sum(1 for pid in running if not mine(pid))


class Background:
    """Context manager: samples the other work's runnable processes (`_runnable_others(ours)`) every 50 ms
    while it is open; `mean` is their mean (0 without a sample)."""

    def __init__(self, ours: int) -> None:
        self.ours = ours
        self.samples: list[int] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(0.05):
            self.samples.append(_runnable_others(self.ours))

    def __enter__(self) -> Background:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()

    @property
    def mean(self) -> float:
        return statistics.mean(self.samples) if self.samples else 0.0


def train_with_background(command: list[str]) -> tuple[subprocess.CompletedProcess, float]:
    """Run `command`; sample the other runnable processes every 50 ms while it runs; return it and their mean."""
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with Background(proc.pid) as others:
        output, _ = proc.communicate()
    return subprocess.CompletedProcess(command, proc.returncode, output, ""), others.mean


def parse_knobs(specs: list[str]) -> dict[str, dict[str, int | float | bool]]:
    """`model:k=v,k=v` strings -> {model: {knob: value}}; values are ints, floats or true/false."""
    knobs: dict[str, dict[str, int | float | bool]] = {}
    for spec in specs:
        model_name, sep, pairs = spec.partition(":")
        if not sep or not pairs:
            raise OnnxpipeError(f"--knobs {spec!r}: expected model:knob=value[,knob=value...], e.g. gpt2-tiny:d_model=256,batch=16")
        for pair in pairs.split(","):
            key, eq, raw = pair.partition("=")
            if not eq:
                raise OnnxpipeError(f"--knobs {spec!r}: {pair!r} is not knob=value")
            knobs.setdefault(model_name, {})[key.strip()] = _knob_value(raw.strip())
    return knobs


def _knob_value(raw: str) -> int | float | bool:
    if raw.lower() in ("true", "false"):
        return raw.lower() == "true"
    try:
        return int(raw)
    except ValueError:
        return float(raw)


def measure(model_name: str, knobs: dict, target: str, schedule: str, steps: int, work: Path, microbatches: int | None = None,
            dedicated: bool = False, train_options: tuple[str, ...] = ()) -> dict:
    """Plan with profiled costs and split; train the stage directory with the CLI (`train_options` added to its
    command); simulate the saved plan (`microbatches` in place of the target's 2 x devices, and `dedicated`: also
    plan and simulate for a core per worker, as `dedicated` and `bubble_dedicated`: tools/bench_train.py --schedules)."""
    k, m = shape(target)
    m = microbatches or m
    path = work / f"{model_name}.onnx"
    if not path.exists():
        onnx.save(models.build(model_name, train=True, **knobs), str(path))
    # k devices: k stages, or v per device where the schedule gives a device v (interleaved 1F1B, ZB-V).
    options = dict(stages=k * virtual(schedule), microbatches=m, schedule=schedule, optimizer="sgd", time_limit=5.0)
    graph, costs, planned_on, plan = plan_model(path, target, **options)
    if dedicated:
        # Planned and simulated for a host with a core per worker: where the workers share fewer cores, plans of one
        # iteration time differ in balance, and the planner's choice there says nothing of the schedule on such a host.
        own = core_per_worker(planned_on)
        alone = simulate_plan(plan_for(graph, costs, own, **options), own, schedule=schedule, microbatches=m)
    stages = work / f"{model_name}-{target}-{schedule}-{m}"
    split(graph, plan, stages, force=True)
    out = stages.with_suffix(".json")
    load = os.getloadavg()[0]
    run, others = train_with_background([sys.executable, "-m", "onnxpipe", "train", str(stages), "--target", target, "--microbatches",
                                         str(m), "--schedule", schedule, "--steps", str(steps), "--optimizer", "sgd", "--json", str(out),
                                         *train_options])
    if run.returncode != 0:
        raise OnnxpipeError(run.stdout.strip().splitlines()[-1])
    measured = json.loads(out.read_text())
    saved = read_plan(stages)
    tgt = plan_target(saved, target)
    quiet = simulate_plan(saved, tgt, schedule=schedule, microbatches=m)
    loaded = simulate_plan(saved, tgt, schedule=schedule, microbatches=m, background=others)
    return {
        "model": model_name,
        "knobs": knobs,
        "steps": steps,
        "case": f"{model_name} {target} k={len(saved.stages)} m={m} {schedule}",
        "load": (load + os.getloadavg()[0]) / 2,
        "background": others,
        "measured": measured["step_seconds"],
        "quiet": quiet.iteration_seconds,
        "simulated": loaded.iteration_seconds,
        "bubble_measured": measured["bubble_fraction"],
        "bubble_simulated": loaded.bubble_fraction,
        "error_quiet": quiet.iteration_seconds / measured["step_seconds"] - 1.0,
        "error": loaded.iteration_seconds / measured["step_seconds"] - 1.0,
        "busy_measured": [st["busy_seconds"] for st in measured["stages"]],
        "busy_simulated": list(loaded.busy_seconds),
        "error_busy": sum(loaded.busy_seconds) / sum(st["busy_seconds"] for st in measured["stages"]) - 1.0,
        **({"dedicated": alone.iteration_seconds, "bubble_dedicated": alone.bubble_fraction} if dedicated else {}),
    }


def shape(target: str) -> tuple[int, int]:
    """Devices and micro-batches of a target: SHAPES' for a bundled one, else its devices and twice as many."""
    if target in SHAPES:
        return SHAPES[target]
    k = len(load_target(target).devices)
    return k, 2 * k


def core_per_worker(target: Target) -> Target:
    """The target on a host with a core for each of its workers, its host model's other measurements kept: what the
    simulator predicts where the workers do not share cores (cpu4's 4 workers on this machine's 2 do)."""
    if target.host is None or not target.host.cores:
        return target
    return dataclasses.replace(target, host=dataclasses.replace(target.host, cores=float(len(target.devices))))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--targets", default=",".join(SHAPES))
    parser.add_argument("--schedules", default=",".join(SCHEDULES))
    parser.add_argument("--repeat", type=int, default=2, help="training runs per case (each its own row: the spread is the noise)")
    parser.add_argument("--knobs", action="append", default=[], help="zoo knobs for one model, model:k=v,k=v (repeatable); overrides KNOBS")
    parser.add_argument("--rows", help="JSON lines file: keep its rows of other models from earlier runs (a model run again replaces "
                                         "its rows), append this run's, table them all")
    args = parser.parse_args()
    given = parse_knobs(args.knobs)
    knobs = {name: {**KNOBS.get(name, {}), **given.get(name, {})} for name in args.models.split(",")}
    if args.rows and Path(args.rows).exists():
        kept = [line for line in Path(args.rows).read_text().splitlines() if line.strip() and json.loads(line)["model"] not in knobs]
        Path(args.rows).write_text("".join(line + "\n" for line in kept))
    rows, failures = [], []
    with tempfile.TemporaryDirectory(prefix="bench-sim-") as tmp:
        for model_name in args.models.split(","):
            for target in args.targets.split(","):
                for schedule in args.schedules.split(","):
                    for _ in range(args.repeat):
                        try:
                            rows.append(measure(model_name, knobs[model_name], target, schedule, args.steps, Path(tmp)))
                            print(rows[-1], flush=True)
                            if args.rows:
                                with open(args.rows, "a") as f:
                                    f.write(json.dumps({**rows[-1], "repeat": args.repeat}) + "\n")
                        except OnnxpipeError as exc:
                            failures.append(f"{model_name} {target} {schedule}: {exc}")
                            print(failures[-1], flush=True)
                            if args.rows:
                                with open(args.rows, "a") as f:
                                    f.write(json.dumps({"model": model_name, "failure": failures[-1]}) + "\n")
    if args.rows:
        saved = [json.loads(line) for line in Path(args.rows).read_text().splitlines() if line.strip()]
        rows, failures = [r for r in saved if "failure" not in r], [r["failure"] for r in saved if "failure" in r]
        knobs = {r["model"]: r["knobs"] for r in rows}
    names = list(dict.fromkeys(r["model"] for r in rows)) or args.models.split(",")
    steps = sorted({r["steps"] for r in rows}) or [args.steps]
    repeats = sorted({r.get("repeat", args.repeat) for r in rows}) or [args.repeat]
    if len(steps) > 1 or len(repeats) > 1:
        raise SystemExit(f"{args.rows}: rows of runs with different --steps {steps} or --repeat {repeats}; table one setting per file")
    chunked = (" (run once per model with `--models M --rows FILE`, each run putting its rows in FILE in place of any earlier rows of "
               "its model: chunks of under 10 minutes on a machine held quiet; the table is all of FILE's rows)") if args.rows else ""
    within = sum(abs(r["error"]) <= GOAL for r in rows)
    lines = [
        "## Simulator fidelity (predicted vs measured iteration time)",
        "",
        f"Regenerate: `.venv/bin/python tools/{NAME}.py --steps {steps[0]} --repeat {repeats[0]} --models {','.join(names)} --targets {args.targets} --schedules {args.schedules}` "
        f"({os.cpu_count()} vCPUs){chunked}. Each case is planned (profiled) and trained {repeats[0]} times (one row per run: their spread is the measurement noise, profiling included). "
        "Each case: plan with profiled node costs (the cpu targets profile on this machine) and split (the stage directory "
        f"keeps the plan JSON); `onnxpipe train DIR --json` ({steps[0]} steps, worker processes, shared-memory transport, SGD; "
        "median step after the first) against `onnxpipe simulate` of the saved plan with the same schedule and micro-batches. "
        "Error = simulated / measured - 1; goal |error| <= 15%. Bubble = 1 - sum(busy) / (k x iteration), busy = F + B + W + "
        "optimizer step compute, in both. Load = the 1-minute load average around the training run; background = "
        "runnable processes of other work while it ran (state R in /proc outside the training's process tree, sampled every 50 ms). Simulated "
        "quiet: the plan on the target alone; simulated: the same with that background sharing the cores "
        "(`simulate_plan(..., background=...)`). Busy error = simulated / measured - 1 of the stages' summed busy seconds "
        "(`train --json` per-stage `busy_seconds` against the simulation's).",
        "",
        "Model sizes (zoo knobs, `onnxpipe.models.build(name, train=True, **knobs)`; `--knobs model:k=v,...` overrides): "
        + "; ".join(f"{name} " + ", ".join(f"{k}={v}" for k, v in knobs[name].items()) for name in names) + ".",
        "",
        "| case | load | background | measured ms | simulated quiet ms | error quiet | simulated ms | error | busy error | bubble measured | bubble simulated |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['load']:.1f} | {r['background']:.1f} | {r['measured'] * 1e3:.2f} | {r['quiet'] * 1e3:.2f} | "
            f"{r['error_quiet']:+.1%} | {r['simulated'] * 1e3:.2f} | {r['error']:+.1%} | {r['error_busy']:+.1%} | {r['bubble_measured']:.1%} | {r['bubble_simulated']:.1%} |"
        )
    within_quiet = sum(abs(r["error_quiet"]) <= GOAL for r in rows)
    lines += ["", f"Within 15%: **{within} of {len(rows)}** cases with the measured background, {within_quiet} of {len(rows)} "
              f"simulated as on a quiet machine. {NOTE}"]
    for target in args.targets.split(","):
        for schedule in args.schedules.split(","):
            mine = [r for r in rows if f" {target} " in r["case"] and r["case"].endswith(f" {schedule}")]
            if mine:
                lines.append(f"- {target} {schedule}: {sum(abs(r['error']) <= GOAL for r in mine)} of {len(mine)} within 15%, median error "
                             f"{statistics.median(r['error'] for r in mine):+.1%}, median busy error {statistics.median(r['error_busy'] for r in mine):+.1%}")
    lines += [f"- not run: {f}" for f in failures]
    section = "\n".join(lines)
    print(section)
    write_section(NAME, section)



if __name__ == "__main__":
    main()
