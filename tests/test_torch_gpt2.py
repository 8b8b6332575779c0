"""transformers' GPT-2 (2 layers, vocab 256, d 64, freshly initialised) exported by torch.onnx's dynamo exporter
(tools/export_torch_fixtures.py): pipelined training reproduces the losses PyTorch's own SGD reached on the same
batches, and the exported weights come back under torch's parameter names with torch's trained values.

The default export merges the five all-ones LayerNorm weights into one initializer (and the zeros into
another); trained as one tensor they would stay equal, where torch's move apart."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "torch_gpt2.json").read_text())
BATCHES = np.load(DATA / "torch_gpt2.npz")


def _train(model: str, stages: int, schedule: str, export: Path | None = None, **options: object) -> list[float]:
    with Pipeline(DATA / model, "cpu4", stages=stages, batch=REFERENCE["batch"], microbatches=2, schedule=schedule,
                  optimizer=OptimizerConfig("sgd", lr=REFERENCE["lr"]), processes=False, **options) as pipe:
        assert pipe.stages == stages
        losses = [pipe.train_step({"input_ids": BATCHES["input_ids"][s], "labels": BATCHES["labels"][s]}) for s in range(REFERENCE["steps"])]
        if export is not None:
            pipe.export(export)
    return losses


@pytest.mark.parametrize("stages,schedule", [(2, "gpipe"), (2, "1f1b"), (3, "gpipe"), (3, "1f1b")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str, tmp_path: Path) -> None:
    losses = _train("torch_gpt2_dynamo.onnx", stages, schedule, export=tmp_path / "trained.onnx")
    np.testing.assert_allclose(losses, REFERENCE["losses"], rtol=1e-5)
    trained = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(tmp_path / "trained.onnx")).graph.initializer}
    norms = [k.removeprefix("final/") for k in BATCHES.files if k.startswith("final/")]
    assert len(norms) == 10 and set(norms) <= set(REFERENCE["parameters"])
    for name in norms:
        np.testing.assert_allclose(trained[name], BATCHES[f"final/{name}"], atol=1e-6, err_msg=name)


def test_unoptimized_export_trains_after_its_split_to_sequence_is_rewritten() -> None:
    """`optimize=False` writes `tensor.split` as SplitToSequence + SequenceAt, which onnxruntime-training cannot
    differentiate; the pre-training rewrite to Split makes it train like PyTorch (its weights are not merged)."""
    model = onnx.load(str(DATA / "torch_gpt2_unoptimized.onnx"))
    assert {"SplitToSequence", "SequenceAt"} <= {n.op_type for n in model.graph.node}
    losses = _train("torch_gpt2_unoptimized.onnx", 2, "1f1b", shapes_by_running=True)  # its Range shapes need a run
    np.testing.assert_allclose(losses, REFERENCE["losses"], rtol=1e-5)


def test_the_cli_trains_the_unoptimized_export_from_an_npz(tmp_path: Path) -> None:
    """`onnxpipe train` reads the index ranges of its inputs off the stage files: a stage whose Range shapes
    static inference cannot tell (this export's) still gives them, so training starts and matches PyTorch."""
    import subprocess
    import sys

    np.savez(tmp_path / "data.npz", input_ids=BATCHES["input_ids"].reshape(-1, 16), labels=BATCHES["labels"].reshape(-1, 16))
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "train", str(DATA / "torch_gpt2_unoptimized.onnx"), "--target", "cpu4", "--stages", "2",
                          "--batch", str(REFERENCE["batch"]), "--microbatches", "2", "--steps", str(REFERENCE["steps"]), "--lr", str(REFERENCE["lr"]),
                          "--data", "data.npz", "--shapes-by-running", "--json", "out.json"], capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert run.returncode == 0, run.stderr
    np.testing.assert_allclose(json.loads((tmp_path / "out.json").read_text())["losses"], REFERENCE["losses"], rtol=1e-5)


def test_no_plan_cuts_a_sequence_it_trains() -> None:
    """A cut between SplitToSequence and its SequenceAt readers hands the next stage a sequence, which has no
    gradient (a CI run's plan once made one, and training failed): in training no solver block starts inside the
    pattern, so no plan cuts it; served, the sequence may cross a cut."""
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load
    from onnxpipe.plan import baselines, build_problem
    from onnxpipe.plan.baselines import balanced_cuts
    from onnxpipe.plan.coarsen import coarsen, refine
    from onnxpipe.plan.solve import solve
    from onnxpipe.target import load_target

    graph = load(DATA / "torch_gpt2_unoptimized.onnx", {"batch": REFERENCE["batch"]}, shapes_by_running=True)
    costs, target = annotate(graph), load_target("cpu4")
    trained = build_problem(graph, costs, target, batch=REFERENCE["batch"], microbatches=2)
    served = build_problem(graph, costs, target, batch=REFERENCE["batch"], microbatches=2, mode="inference")
    position = {n: i for i, n in enumerate(trained.nodes)}
    patterns = [(n, graph.consumers(graph.node(n).output[0])) for n in trained.nodes if graph.node(n).op_type == "SplitToSequence"]
    inside = {g for n, readers in patterns for g in range(position[n] + 1, max(position[r] for r in readers) + 1)}
    assert len(patterns) == 2 and inside
    nodes = coarsen(trained, trained.n)
    assert not inside & set(nodes.starts.tolist())
    cut_everywhere = np.arange(trained.n) % 2  # a stage change at every gap: refine splits every block it can
    assert not inside & set(refine(trained, nodes, cut_everywhere).starts.tolist())
    assert inside <= set(coarsen(served, served.n).starts.tolist())
    for gap in inside:  # weights whose balanced cut is `gap`: the baselines' cut moves past the pattern
        weights = np.zeros(trained.n)
        weights[[gap - 1, -1]] = 1
        assert balanced_cuts(weights, 2, np.zeros(trained.n + 1, bool))[1] == gap
        after = next(g for g in range(gap, trained.n + 1) if g not in inside)
        assert balanced_cuts(weights, 2, trained.sealed)[1] == after
    for stages in (2, 3, 4):
        for name, plan in [("planner", solve(trained, stages, time_limit=10)), *baselines(trained, stages).items()]:
            stage_of = {n: i for i, s in enumerate(plan.stages) for n in s.nodes}
            assert all(stage_of[r] == stage_of[n] for n, readers in patterns for r in readers), (name, stages)


def test_a_hand_cut_through_a_sequence_is_refused_in_training_and_kept_in_inference(tmp_path: Path) -> None:
    """`split --cuts` at a SplitToSequence's output would leave the next stage a sequence with no gradient: one line
    naming the sequence and the way out, no directory. Served, the same cut is a valid split."""
    import subprocess
    import sys

    def split(*options: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "onnxpipe", "split", str(DATA / "torch_gpt2_unoptimized.onnx"), "-t", "fpga4", "--cuts", "split_1",
                               "--dim", f"batch={REFERENCE['batch']}", "--shapes-by-running", *options], capture_output=True, text=True, cwd=tmp_path, timeout=600)

    refused = split("-o", "trained")
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "--cuts: the cut after 'split_1' hands the next stage sequence 'split_1', which has no gradient to send back in training" in refused.stderr
    assert not (tmp_path / "trained").exists()
    served = split("--mode", "inference", "-o", "served")
    assert served.returncode == 0, served.stderr
    assert any(i.type.HasField("sequence_type") for i in onnx.load(str(tmp_path / "served" / "stage_1.onnx")).graph.input)


def test_a_failed_onnxruntime_check_reads_as_its_message() -> None:
    """onnxruntime's failed checks lead with a source location and a C++ signature that filled the whole line we show."""
    from onnxpipe.ortutil import ort_reason

    raised = RuntimeError("/onnxruntime_src/orttraining/orttraining/core/graph/gradient_builder_registry.cc:29 onnxruntime::training::GradientDef "
                          "onnxruntime::training::GetGradientForOp(const onnxruntime::training::GradientGraphConfiguration&, onnxruntime::Graph*, "
                          "const std::unordered_set<std::__cxx11::basic_string<char> >&) gradient_builder != nullptr was false. "
                          "The gradient builder has not been registered: SequenceAt for node n0_4")
    assert ort_reason(raised) == "The gradient builder has not been registered: SequenceAt for node n0_4"
    assert ort_reason(RuntimeError("[ONNXRuntimeError] : 1 : FAIL : Load model failed\nmore")) == "Load model failed"
