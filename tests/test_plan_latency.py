"""`--max-latency`: an inference plan's latency (one micro-batch through the whole pipeline) bounded; the
planner takes only plans within it, or fails in one line naming the least latency it found."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.cost import annotate
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.models import build
from onnxpipe.plan import Plan, compare, plan, simulate_plan
from onnxpipe.target import load_target

_OPTIONS = dict(microbatches=4, time_limit=10, mode="inference")


@pytest.fixture(scope="module")
def model() -> tuple:
    graph = load(build("gpt2-tiny"))
    return graph, annotate(graph), load_target("hetero")


@pytest.fixture(scope="module")
def free(model: tuple) -> Plan:
    """The unbounded inference plan: its stage count chosen for throughput."""
    return plan(*model, **_OPTIONS)  # type: ignore[arg-type]


def _least(model: tuple, **options: object) -> float:
    """The least latency the planner finds, as its error names it for a bound nothing keeps."""
    with pytest.raises(OnnxpipeError) as caught:
        plan(*model, max_latency=1e-9, **{**_OPTIONS, **options})  # type: ignore[arg-type]
    message = str(caught.value)
    assert "\n" not in message and "raise --max-latency to at least" in message
    return float(re.search(r"the least latency among the \d+ plans priced that fit is ([0-9.e+-]+) ms", message).group(1)) / 1e3


@pytest.fixture(scope="module")
def least(model: tuple) -> float:
    return _least(model)


def test_the_bound_trades_throughput_for_latency(model: tuple, free: Plan, least: float) -> None:
    # One stage on the faster device group has less latency than the free plan, which also takes the slower devices.
    assert least < free.latency_seconds
    bound = (least + free.latency_seconds) / 2
    bounded = plan(*model, max_latency=bound, **_OPTIONS)  # type: ignore[arg-type]
    assert bounded.latency_seconds <= bound
    assert bounded.iteration_seconds >= free.iteration_seconds * (1 - 1e-9)  # a bound never buys throughput
    # Recorded latency is the simulated one: micro-batch 0 through every stage's forward and transfers.
    assert simulate_plan(bounded, model[2]).latency_seconds == pytest.approx(bounded.latency_seconds, rel=1e-9)
    # No baseline of its stage count within the bound is faster.
    for name, other in compare(*model, bounded).items():
        if other.latency_seconds <= bound and len(other.stages) == len(bounded.stages):
            assert bounded.iteration_seconds <= other.iteration_seconds * (1 + 1e-9), name


def test_a_bound_the_free_plan_keeps_changes_nothing(model: tuple, free: Plan) -> None:
    again = plan(*model, max_latency=free.latency_seconds * 1.01, **_OPTIONS)  # type: ignore[arg-type]
    assert [s.nodes for s in again.stages] == [s.nodes for s in free.stages]
    assert again.iteration_seconds == pytest.approx(free.iteration_seconds, rel=1e-9)


def test_exploration_keeps_the_bound(model: tuple, least: float, free: Plan) -> None:
    bound = (least + free.latency_seconds) / 2
    explored = plan(*model, max_latency=bound, **{**_OPTIONS, "microbatches": "auto"})  # type: ignore[arg-type]
    assert explored.latency_seconds <= bound
    assert all(c.latency_seconds <= bound for c in explored.explored if c.feasible)


def test_an_unreachable_bound_names_the_least_latency_found(model: tuple, least: float) -> None:
    # The latency it names is reachable: a bound just above it plans.
    reached = plan(*model, max_latency=least * 1.001, **_OPTIONS)  # type: ignore[arg-type]
    assert reached.latency_seconds <= least * 1.001


def test_a_bound_at_a_fixed_stage_count(model: tuple, least: float) -> None:
    two = plan(*model, stages=2, **_OPTIONS)  # type: ignore[arg-type]
    least_two = _least(model, stages=2)  # the least latency of 2 stages, which the error names (to 4 digits)
    assert least <= least_two <= two.latency_seconds * 1.001
    bound = least_two * 1.001  # reachable with 2 stages, whether or not the unbounded 2-stage plan is the one
    bounded = plan(*model, stages=2, max_latency=bound, **_OPTIONS)  # type: ignore[arg-type]
    assert len(bounded.stages) == 2 and bounded.latency_seconds <= bound
    assert bounded.iteration_seconds >= two.iteration_seconds * (1 - 1e-9)
    with pytest.raises(OnnxpipeError, match=r"no plan of 4 stages has a latency within --max-latency .* or drop --stages"):
        plan(*model, stages=4, max_latency=1e-9, **_OPTIONS)  # type: ignore[arg-type]


def test_training_refuses_a_latency_bound(model: tuple) -> None:
    with pytest.raises(OnnxpipeError, match="--max-latency bounds an inference pipeline's latency; add --mode inference"):
        plan(*model, stages=2, max_latency=1.0)  # type: ignore[arg-type]


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxpipe", *args], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "COLUMNS": "200"})


def test_the_cli_bound_is_one_line_or_a_plan_within_it(tmp_path: Path) -> None:
    path = tmp_path / "mlp.onnx"
    path.write_bytes(build("mlp").SerializeToString())
    failed = _cli("plan", str(path), "--target", "fpga4", "--mode", "inference", "--max-latency", "1e-9", "--time-limit", "5")
    assert failed.returncode == 2 and "Traceback" not in failed.stderr and len(failed.stderr.strip().splitlines()) == 1
    assert "--max-latency" in failed.stderr and "the least latency" in failed.stderr
    least = float(re.search(r"is ([0-9.e+-]+) ms", failed.stderr).group(1)) / 1e3
    out = tmp_path / "plan.json"
    ok = _cli("split", str(path), "--target", "fpga4", "--mode", "inference", "--max-latency", repr(least * 1.01), "--time-limit", "5",
              "-o", str(tmp_path / "stages"))
    assert ok.returncode == 0, ok.stderr
    written = Plan.read(tmp_path / "stages" / "plan.json")
    assert written.latency_seconds <= least * 1.01
    trainable = tmp_path / "mlp-loss.onnx"
    trainable.write_bytes(build("mlp", train=True).SerializeToString())
    training = _cli("plan", str(trainable), "--target", "fpga4", "--max-latency", "1", "-o", str(out))
    assert training.returncode == 2 and "add --mode inference" in training.stderr and not out.exists()
