"""`onnxpipe run DIR`: micro-batches streamed through the stage workers, measured; its `--json` speaks the
simulator's language (the keys of `simulate --json` on the same inference plan), and its outputs are the
unsplit model's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from onnxpipe.models import build
from onnxpipe.plan.predict import read_plan, simulate_plan
from onnxpipe.target import load_target

MICROBATCHES = 4


def _cli(*args: str, cwd: Path) -> str:
    done = subprocess.run([sys.executable, "-m", "onnxpipe", *args], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    return done.stdout


def _keys(value: object) -> object:
    """The key structure of a JSON value: dicts by their keys (recursively), lists by their first item."""
    if isinstance(value, dict):
        return {k: _keys(v) for k, v in value.items()}
    if isinstance(value, list) and value and isinstance(value[0], (dict, list)):
        return [_keys(value[0])]
    return type(value).__name__ if not isinstance(value, (int, float)) or isinstance(value, bool) else "number"


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict, dict, np.ndarray]:
    work = tmp_path_factory.mktemp("run")
    (work / "model.onnx").write_bytes(build("resnet-tiny").SerializeToString())
    _cli("split", "model.onnx", "--target", "cpu2", "--stages", "2", "--microbatches", str(MICROBATCHES), "--mode", "inference", "-o", "stages", cwd=work)
    image = np.random.default_rng(0).standard_normal((4 * MICROBATCHES, 3, 16, 16)).astype(np.float32)
    np.savez(work / "in.npz", image=image)
    out = _cli("run", "stages", "--inputs", "in.npz", "-o", "out.npz", "--microbatches", str(MICROBATCHES), "--repeat", "3", "--json", "run.json", cwd=work)
    assert "measured:" in out and "samples/s" in out and "latency" in out and "median of 2 passes after a warm-up" in out
    _cli("simulate", "stages", "--json", "sim.json", cwd=work)
    return work, json.loads((work / "run.json").read_text()), json.loads((work / "sim.json").read_text()), image


def test_run_json_has_the_keys_of_simulate_json(ran: tuple[Path, dict, dict, np.ndarray]) -> None:
    _, measured, simulated, _ = ran
    assert _keys(measured) == _keys(simulated)
    assert len(measured["events"][0]) == len(simulated["events"][0])
    assert (measured["microbatches"], measured["batch"], measured["schedule"]) == (simulated["microbatches"], simulated["batch"], simulated["schedule"])
    assert [s["devices"] for s in measured["stages"]] == [s["devices"] for s in simulated["stages"]]


def test_the_measured_figures_hang_together(ran: tuple[Path, dict, dict, np.ndarray]) -> None:
    _, measured, _, _ = ran
    assert measured["samples_per_s"] == pytest.approx(measured["batch"] / measured["iteration_seconds"])
    assert 0 < measured["latency_seconds"] <= measured["iteration_seconds"]
    forwards = {(stage, mb): (start, end) for stage, kind, mb, start, end, _ in measured["events"] if kind == "F"}
    assert sorted(forwards) == [(s, j) for s in range(2) for j in range(MICROBATCHES)]  # every stage ran every micro-batch, forward only
    assert {kind for _, kind, *_ in measured["events"]} <= {"F", "SEND", "RECV"}
    for j in range(MICROBATCHES):  # stage 1 computes a micro-batch only after stage 0 finished it
        assert forwards[(1, j)][0] >= forwards[(0, j)][1]
    # The latency is micro-batch 0's first forward start to last forward end, as the simulator's.
    assert measured["latency_seconds"] <= measured["iteration_seconds"]
    assert all(0 < s["busy_seconds"] <= measured["iteration_seconds"] for s in measured["stages"])


def test_run_outputs_are_the_unsplit_models(ran: tuple[Path, dict, dict, np.ndarray]) -> None:
    work, _, _, image = ran
    session = ort.InferenceSession(str(work / "model.onnx"), providers=["CPUExecutionProvider"])
    want = np.concatenate([session.run(None, {"image": part})[0] for part in np.split(image, MICROBATCHES)])
    with np.load(work / "out.npz") as got:
        np.testing.assert_allclose(got[got.files[0]], want, rtol=1e-5, atol=1e-6)


def test_an_inference_plan_simulates_to_an_end_on_a_cpu_target(ran: tuple[Path, dict, dict, np.ndarray]) -> None:
    """On a host with shared cores an inference row ends in an F still running there: the iteration waits for it."""
    work, _, simulated, _ = ran
    plan = read_plan(work / "stages")
    sim = simulate_plan(plan, load_target("cpu2"))
    last = max(e.end for e in sim.events)
    assert np.isfinite(sim.iteration_seconds) and sim.iteration_seconds >= last
    assert simulated["iteration_seconds"] == pytest.approx(plan.iteration_seconds, rel=1e-9)
