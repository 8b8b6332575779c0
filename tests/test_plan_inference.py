"""Inference mode: a forward-only pipeline priced and simulated as it runs (no backward, gradients,
optimizer state, stash or all-reduce), the bottleneck as the throughput objective and the latency reported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.cost import annotate
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.models import build
from onnxpipe.plan import Plan, build_problem, choose_mode, lower_bound, plan, simulate_plan
from onnxpipe.target import load_target


@pytest.fixture(scope="module")
def planned() -> tuple[Plan, Plan]:
    graph = load(build("gpt2-tiny"))
    costs = annotate(graph)
    target = load_target("fpga4")
    options = dict(stages=2, microbatches=4, time_limit=10)
    return plan(graph, costs, target, mode="inference", **options), plan(graph, costs, target, **options)  # type: ignore[arg-type]


def test_an_inference_plan_prices_the_forward_only(planned: tuple[Plan, Plan]) -> None:
    inference, training = planned
    assert (inference.mode, training.mode) == ("inference", "training")
    for s in inference.stages:
        assert s.backward_seconds == 0 and s.allreduce_seconds == 0 and not s.recompute
        assert s.memory.gradients == 0 and s.memory.optimizer == 0 and s.memory.parameters > 0
        # One micro-batch's activations: its stash is what it computes, held while its forward runs.
        assert s.memory.activations == pytest.approx(s.stash_bytes)
    assert inference.bottleneck_seconds == pytest.approx(max(s.forward_seconds + s.comm_in_seconds + s.comm_out_seconds for s in inference.stages))
    assert inference.lower_bound_seconds <= inference.bottleneck_seconds * (1 + 1e-9)
    assert inference.solver.status == "OPTIMAL"
    assert inference.bottleneck_seconds < training.bottleneck_seconds
    assert inference.iteration_seconds < training.iteration_seconds
    assert training.latency_seconds == 0.0


def test_an_inference_plan_simulates_forwards_and_reports_its_latency(planned: tuple[Plan, Plan]) -> None:
    inference, _ = planned
    sim = simulate_plan(inference, load_target("fpga4"))
    assert {e.kind for e in sim.events} <= {"F", "SEND", "RECV"}
    assert sum(e.kind == "F" for e in sim.events) == len(inference.stages) * inference.microbatches
    assert sim.iteration_seconds == pytest.approx(inference.iteration_seconds, rel=1e-9)
    assert sim.latency_seconds == pytest.approx(inference.latency_seconds, rel=1e-9)
    # A micro-batch passes through every stage's forward (one replica each), at least.
    assert inference.latency_seconds >= sum(s.forward_seconds * len(s.devices) for s in inference.stages)
    # Each stage peaks at its parameters plus one micro-batch's activations, as planned.
    assert sim.peak_memory_bytes == pytest.approx(tuple(s.memory.total for s in inference.stages), rel=1e-9)


def test_the_mode_round_trips_and_old_plans_are_training(planned: tuple[Plan, Plan], tmp_path: Path) -> None:
    inference, _ = planned
    inference.save(tmp_path / "plan.json")
    again = Plan.read(tmp_path / "plan.json")
    assert (again.mode, again.latency_seconds) == ("inference", inference.latency_seconds)
    data = json.loads((tmp_path / "plan.json").read_text())
    del data["mode"], data["latency_seconds"]
    assert Plan.from_json(data).mode == "training"


def test_an_unknown_mode_is_one_clear_error(tmp_path: Path) -> None:
    graph = load(build("mlp"))
    with pytest.raises(OnnxpipeError, match="unknown mode 'serving'; choose one of: training, inference"):
        build_problem(graph, annotate(graph), load_target("fpga4"), batch=graph.batch, microbatches=1, mode="serving")
    model = tmp_path / "mlp.onnx"
    model.write_bytes(build("mlp").SerializeToString())
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "plan", str(model), "--target", "fpga4", "--stages", "2", "--mode", "serving"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2 and "Traceback" not in run.stderr and len(run.stderr.strip().splitlines()) == 1
    assert "unknown mode 'serving'" in run.stderr


def test_the_cli_plans_an_inference_pipeline(tmp_path: Path) -> None:
    model = tmp_path / "mlp.onnx"
    model.write_bytes(build("mlp").SerializeToString())
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "plan", str(model), "--target", "fpga4", "--stages", "2", "--mode", "inference",
                          "-o", str(tmp_path / "plan.json")], capture_output=True, text=True, timeout=120, env={"COLUMNS": "200", **__import__("os").environ})
    assert run.returncode == 0, run.stderr
    assert "inference (forward only):" in run.stdout and "latency" in run.stdout
    written = Plan.read(tmp_path / "plan.json")
    # a forward-only pipeline has no backward to schedule: the iteration line names none
    assert f"{written.microbatches} micro-batches)" in run.stdout and written.schedule not in run.stdout
    assert written.mode == "inference" and written.latency_seconds > 0
    bound = lower_bound(build_problem(load(str(model)), annotate(load(str(model))), load_target("fpga4"), batch=written.batch,
                                      microbatches=written.microbatches, mode="inference"), 2)
    # the inference bound (no backward work); its chain part gets a share of the time limit and may stop early, weaker but valid
    assert max(bound.work_seconds, bound.node_seconds) * (1 - 1e-9) <= written.lower_bound_seconds <= bound.seconds * (1 + 1e-9)


def _plan_cli(model: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "onnxpipe", "plan", str(model), "--target", "fpga4", "--stages", "2", "--time-limit", "5", *args],
                          capture_output=True, text=True, timeout=120, env={**__import__("os").environ, "COLUMNS": "200"})


def test_a_model_without_a_loss_is_planned_for_inference_and_refused_training(tmp_path: Path) -> None:
    served, trained = tmp_path / "mlp.onnx", tmp_path / "mlp-loss.onnx"
    served.write_bytes(build("mlp").SerializeToString())
    trained.write_bytes(build("mlp", train=True).SerializeToString())
    assert (load(str(served)).loss, load(str(trained)).loss) == (None, "loss")
    run = _plan_cli(served, "-o", str(tmp_path / "plan.json"))
    assert run.returncode == 0, run.stderr
    assert "mode: inference (forward only), as the model has no loss output" in run.stdout
    assert Plan.read(tmp_path / "plan.json").mode == "inference"
    refused = _plan_cli(served, "--mode", "training", "-o", str(tmp_path / "refused.json"))
    assert refused.returncode == 2 and "Traceback" not in refused.stderr and len(refused.stderr.strip().splitlines()) == 1
    assert "has no loss output" in refused.stderr and "--mode inference" in refused.stderr and "`onnxpipe train` appends one with --loss" in refused.stderr
    assert not (tmp_path / "refused.json").exists()
    run = _plan_cli(trained, "-o", str(tmp_path / "trained.json"))
    assert run.returncode == 0 and "mode: inference" not in run.stdout
    assert Plan.read(tmp_path / "trained.json").mode == "training"


def test_choose_mode_follows_the_loss_unless_one_is_appended() -> None:
    served, trained = load(build("mlp")), load(build("mlp", train=True))
    assert (choose_mode(served, None), choose_mode(trained, None)) == ("inference", "training")
    assert choose_mode(served, None, adds_loss=True) == choose_mode(served, "training", adds_loss=True) == "training"
    assert choose_mode(trained, "inference") == "inference"
    with pytest.raises(OnnxpipeError, match="has no loss output.*, so it cannot be trained as it is; `onnxpipe train` appends one with --loss .* "
                       "and plan or split serve it forward-only with --mode inference"):
        choose_mode(served, "training")


def test_inference_prices_profiled_nodes_at_their_optimized_times_and_training_does_not() -> None:
    import dataclasses

    import numpy as np

    from onnxpipe.cost import with_measurements

    graph = load(build("gpt2-tiny"))
    costs = annotate(graph)
    nodes = graph.compute_nodes
    forward = {n: 1e-4 * (1 + i % 3) for i, n in enumerate(nodes)}
    backward = {n: 2 * t for n, t in forward.items()}
    optimized = {n: t / 2 for n, t in forward.items()}
    plain = with_measurements(costs, forward, backward, "cpu", "profile:CPUExecutionProvider")
    fused = with_measurements(costs, forward, backward, "cpu", "profile:CPUExecutionProvider", optimized)
    assert all(c.measured_inference_seconds is None for c in plain.nodes.values())
    options = dict(batch=8, microbatches=4)
    for target in ("cpu2", "gpu4"):
        for mode in ("training", "inference"):
            before = build_problem(graph, plain, load_target(target), mode=mode, **options)
            after = build_problem(graph, fused, load_target(target), mode=mode, **options)
            assert np.array_equal(before.backward, after.backward) and np.array_equal(before.weight, after.weight)
            if mode == "training" or target == "gpu4":  # training, and devices of another kind, are priced as before
                assert np.array_equal(before.forward, after.forward), (target, mode)
    inference = build_problem(graph, fused, load_target("cpu2"), mode="inference", **options)
    scale = 8 / 4 / graph.batch
    assert inference.forward[0] == pytest.approx([optimized[n] * scale for n in nodes])
    assert dataclasses.replace(fused.nodes[nodes[0]], measured_inference_seconds=None) == plain.nodes[nodes[0]]


def _blocked(costs, graph, blocked: set[str]):  # type: ignore[no-untyped-def]
    """`costs` as profiled on a host that computed `blocked` in the NCHWc layout and reorders at 4 / 2 GB/s into / out of it."""
    import dataclasses

    from onnxpipe.cost_layout import NCHWC, ReorderRates

    nodes = {n: dataclasses.replace(c, layout=NCHWC if n in blocked else "") for n, c in costs.nodes.items()}
    return dataclasses.replace(costs, nodes=nodes, reorder=ReorderRates(into_blocks=4e9, out_of_blocks=2e9))


@pytest.mark.parametrize("cut, sent, received", [
    ("block0/skip", True, True),  # a residual sum (blocked) read by its Relu (blocked): reordered out of blocks and back in
    ("head/GlobalAveragePool", True, False),  # read by Flatten, a plain node: reordered out of blocks only
    ("head/Flatten", False, False),  # between plain nodes: nothing reordered
])
def test_a_cut_tensor_in_the_blocked_layout_costs_its_reorders_in_inference_on_cpu_only(cut: str, sent: bool, received: bool) -> None:
    from onnxpipe.split import plan_cuts

    graph = load(build("resnet-tiny"))
    costs = annotate(graph)
    blocked = _blocked(costs, graph, {n for n in graph.compute_nodes if not n.startswith("head/") or n == "head/GlobalAveragePool"})
    nbytes = graph.tensors[cut].nbytes
    for target in ("cpu2", "gpu4"):
        for mode in ("training", "inference"):
            plain = plan_cuts(graph, costs, load_target(target), [cut], mode=mode)
            priced = plan_cuts(graph, blocked, load_target(target), [cut], mode=mode)
            if (target, mode) == ("cpu2", "inference"):
                assert priced.stages[0].forward_seconds == pytest.approx(plain.stages[0].forward_seconds + sent * nbytes / 2e9, rel=1e-12)
                assert priced.stages[1].forward_seconds == pytest.approx(plain.stages[1].forward_seconds + received * nbytes / 4e9, rel=1e-12)
                # The simulator runs what was priced.
                assert (priced.iteration_seconds > plain.iteration_seconds) == (sent or received)
            else:  # training's sessions, and devices of another kind, reorder nothing
                assert priced.to_json() == plain.to_json(), (target, mode)


def test_the_planner_weighs_the_reorders_of_its_cuts() -> None:
    """With reorders slower than the whole model, the only cut worth making on cpu2 in inference is the one no
    reorder crosses (between the plain Flatten and Gemm): the DP and CP-SAT price them as `price` does."""
    import dataclasses

    graph = load(build("resnet-tiny"))
    costs = annotate(graph)
    blocked = _blocked(costs, graph, set(graph.compute_nodes) - {"head/Flatten", "head/fc/Gemm"})
    slow = dataclasses.replace(blocked, reorder=dataclasses.replace(blocked.reorder, into_blocks=1e6, out_of_blocks=1e6))
    options = dict(stages=2, microbatches=4, mode="inference", time_limit=10)
    made = plan(graph, slow, load_target("cpu2"), **options)  # type: ignore[arg-type]
    assert made.stages[1].nodes == ("head/fc/Gemm",), [s.nodes[-1] for s in made.stages]
    assert made.bottleneck_seconds == pytest.approx(max(s.forward_seconds + s.comm_in_seconds + s.comm_out_seconds for s in made.stages))
    # In training the same costs reorder nothing: the planner balances the convolutions instead.
    assert plan(graph, slow, load_target("cpu2"), stages=2, microbatches=4, time_limit=10).stages[1].nodes != ("head/fc/Gemm",)
