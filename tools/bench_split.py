"""Split speed and memory against plain onnx.load + onnx.save of the same ~500 MB model (GPT-2 small).

Each measurement runs in a fresh process (wall time, peak RSS from getrusage of that process alone);
the two are run alternately, `--rounds` times, and the medians compared. Goals: split into 8 stages
takes at most 2x the load + save time, with peak RSS at most 2x the model size. The plan (8 even
stages) is written beforehand so no solver time is counted.

Usage: python tools/bench_split.py [--rounds 3] [--work DIR]
Rewrites its section of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from benchdoc import write_section

ROOT = Path(__file__).resolve().parent.parent
SECTION = "bench_split"
STAGES = 8

#: Runs a command and reports its wall time and its own peak RSS (this wrapper holds no model).
_MEASURE = (
    "import json, resource, subprocess, sys, time\n"
    "t = time.perf_counter()\n"
    "subprocess.run(sys.argv[1:], check=True, stdout=subprocess.DEVNULL)\n"
    "print(json.dumps({'seconds': time.perf_counter() - t, 'rss': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024}))\n"
)

_LOAD_SAVE = "import onnx, sys; onnx.save(onnx.load(sys.argv[1]), sys.argv[2])"


def measure(command: list[str]) -> dict[str, float]:
    done = subprocess.run([sys.executable, "-c", _MEASURE, *command], check=True, capture_output=True, text=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def build_model(work: Path) -> Path:
    from onnxpipe import models

    path = work / "gpt2.onnx"
    if not path.exists():
        models.save(models.build("gpt2"), path)
    return path


def even_plan(model: Path, out: Path) -> None:
    """8 stages of equal node counts on 8 copies of the fpga4 device (split ignores the numbers)."""
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load
    from onnxpipe.plan import Assignment, build_problem, evaluate
    from onnxpipe.target import load_target

    graph = load(model)
    nodes = graph.compute_nodes
    base = load_target("fpga4")
    device = base.devices[0]
    target = dataclasses.replace(base, devices=tuple(dataclasses.replace(device, name=f"{device.group}_{i}") for i in range(STAGES)))
    groups = tuple(nodes[len(nodes) * i // STAGES: len(nodes) * (i + 1) // STAGES] for i in range(STAGES))
    problem = build_problem(graph, annotate(graph), target, batch=graph.batch, microbatches=1)
    evaluate(problem, Assignment(groups, tuple((d.name,) for d in target.devices), (False,) * STAGES)).save(out)



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--work", type=Path, default=None, help="Keep the model and outputs here (default: a temp dir).")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        model = build_model(work)
        size = model.stat().st_size
        even_plan(model, work / "plan.json")
        onnxpipe = str(Path(sys.executable).with_name("onnxpipe"))
        runs: dict[str, list[dict[str, float]]] = {"load+save": [], "split": []}
        for _ in range(args.rounds):
            runs["load+save"].append(measure([sys.executable, "-c", _LOAD_SAVE, str(model), str(work / "copy.onnx")]))
            runs["split"].append(measure([onnxpipe, "split", str(model), "--plan", str(work / "plan.json"), "-o", str(work / "stages"), "--force"]))
        stage_bytes = sum(p.stat().st_size for p in (work / "stages").iterdir() if p.name.startswith("stage_"))

    seconds = {k: statistics.median(r["seconds"] for r in v) for k, v in runs.items()}
    rss = {k: max(r["rss"] for r in v) for k, v in runs.items()}
    time_ratio = seconds["split"] / seconds["load+save"]
    rss_ratio = rss["split"] / size
    verdict = lambda ok: "ok" if ok else "MISSED"  # noqa: E731
    lines = [
        "## Split: speed and memory",
        "",
        f"GPT-2 small (`onnxpipe.models.build(\"gpt2\")`, {size / 1e6:.0f} MB file) split into {STAGES} even stages from a saved plan",
        f"(stage files: {stage_bytes / 1e6:.0f} MB, the tied embedding copied into the first and last stage), against `onnx.load` +",
        f"`onnx.save` of the same model. Fresh process per run, median of {args.rounds} alternating runs; peak RSS is the process's own.",
        "",
        "| run | wall time (s) | peak RSS (MB) | peak RSS / model size |",
        "|---|---:|---:|---:|",
        *(f"| {k} | {seconds[k]:.2f} | {rss[k] / 1e6:.0f} | {rss[k] / size:.2f} |" for k in runs),
        "",
        f"- time split / time load+save: **{time_ratio:.2f}** (goal <= 2: {verdict(time_ratio <= 2)})",
        f"- peak RSS of split / model size: **{rss_ratio:.2f}** (goal <= 2: {verdict(rss_ratio <= 2)})",
        "",
        "Regenerate: `python tools/bench_split.py`",
    ]
    text = "\n".join(lines)
    print(text)
    write_section(SECTION, text)


if __name__ == "__main__":
    main()
