"""A backend's measured costs in a target ([backends.ray]): parsed and validated, put in place of the local
transport's figures by `Target.for_backend`, and priced by the simulator (`simulate --backend`)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan import simulate_plan
from onnxpipe.target import load_target
from test_simulate import make_plan

TARGET = """
name = "twocpu"
description = "2 cpu workers"

[[devices]]
name = "cpu"
kind = "cpu"
count = 2
threads = 1
memory = "8 GiB"
memory_bandwidth = "25 GB/s"
op_overhead = "0 us"
peak_flops = { float32 = "100 GFLOP/s" }
efficiency = { default = 1.0 }

[[links]]
between = ["cpu", "cpu"]
bandwidth = "1 GB/s"
latency = "0.5 s"
topology = "shm"
"""

RAY = """
[backends.ray]
action_overhead = "0.25 s"
step_overhead = "0.5 s"
latency = "0.1 s"
send_overhead = "0.2 s"
send_bandwidth = "1 GB/s"
recv_overhead = "0.1 s"
recv_bandwidth = "2 GB/s"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "t.toml"
    path.write_text(text)
    return path


def plan():
    """2 stages, 1 micro-batch, F and B of 1 s, 1 GB between the stages, on cpu_0 and cpu_1."""
    return replace(make_plan(2, 1, forward=1.0, backward=1.0, comm_bytes=1e9, devices=(("cpu_0",), ("cpu_1",))), target="twocpu")


def test_ray_costs_priced_in_place_of_the_local_transport(tmp_path: Path) -> None:
    target = load_target(str(write(tmp_path, TARGET + RAY)))
    # Local: F0 1, hop 1 GB / 1 GB/s + 0.5 latency, F1 1, B1 1, hop 1.5, B0 1.
    assert simulate_plan(plan(), target.for_backend("local")).iteration_seconds == pytest.approx(7.0)
    # Ray: each F/B 1.25; a SEND is 0.2 + 1 s of the sender's CPU, arrives 0.1 later, its RECV takes 0.1 + 0.5 s;
    # F0 1.25, send 1.2, wake 0.1, recv 0.6, F1 1.25, B1 1.25, send 1.2, wake 0.1, recv 0.6, B0 1.25, then 0.5 per step.
    ray = simulate_plan(plan(), target.for_backend("ray"))
    assert ray.iteration_seconds == pytest.approx(4 * 1.25 + 2 * (1.2 + 0.1 + 0.6) + 0.5)


def test_local_predictions_unchanged_by_a_backend_table(tmp_path: Path) -> None:
    with_ray = load_target(str(write(tmp_path, TARGET + RAY)))
    assert with_ray.for_backend("local") is with_ray
    without = load_target(str(write(tmp_path, TARGET)))
    assert simulate_plan(plan(), with_ray).iteration_seconds == simulate_plan(plan(), without).iteration_seconds
    cpu2 = load_target("cpu2")
    assert cpu2.for_backend("local") is cpu2 and "ray" in cpu2.backends
    ray = cpu2.for_backend("ray")
    assert ray.devices[0].step_overhead == cpu2.backends["ray"].step_overhead != cpu2.devices[0].step_overhead


@pytest.mark.parametrize(("extra", "message"), [
    (RAY.replace("[backends.ray]", "[backends.spark]"), r"backends\.spark: unknown backend; use ray"),
    (RAY.replace('latency = "0.1 s"\n', ""), r"backends\.ray\.latency: missing"),
    (RAY.replace('recv_bandwidth = "2 GB/s"', 'recv_bandwidth = "0 GB/s"'), r"backends\.ray\.recv_bandwidth"),
    (RAY + 'mystery = "1 s"\n', r"backends\.ray\.mystery: unknown key"),
])
def test_bad_backend_tables_are_one_line(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(OnnxpipeError, match=message) as info:
        load_target(str(write(tmp_path, TARGET + extra)))
    assert "\n" not in str(info.value) and "t.toml" in str(info.value)


def test_unmeasured_or_unknown_backend_is_one_line(tmp_path: Path) -> None:
    target = load_target(str(write(tmp_path, TARGET)))
    with pytest.raises(OnnxpipeError, match=r"no measured costs for the ray backend; add a \[backends\.ray\] table"):
        target.for_backend("ray")
    with pytest.raises(OnnxpipeError, match="'spark' is not one of local, ray"):
        target.for_backend("spark")


def test_cli_simulate_backend(tmp_path: Path) -> None:
    path = write(tmp_path, TARGET + RAY)
    (tmp_path / "stages").mkdir()
    plan().save(tmp_path / "stages" / "plan.json")
    for backend, expected in (("local", 7.0), ("ray", 4 * 1.25 + 2 * 1.9 + 0.5)):
        run = subprocess.run([sys.executable, "-m", "onnxpipe", "simulate", "stages", "--target", str(path), "--backend", backend,
                              "--json", f"{backend}.json"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        assert json.loads((tmp_path / f"{backend}.json").read_text())["iteration_seconds"] == pytest.approx(expected)
    bad = subprocess.run([sys.executable, "-m", "onnxpipe", "simulate", "stages", "--target", str(path), "--backend", "spark"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "'spark' is not one of local, ray" in bad.stderr and "Traceback" not in bad.stderr
