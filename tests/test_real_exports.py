"""Models exported by torch.onnx (tools/export_torch_fixtures.py made them): the TorchScript exporter at
opset 17 with a loss output and merged duplicate initializers, a dynamic batch axis at opset 18, and the
dynamo exporter at IR 10 / opset 20 with external data. Each loads, costs, splits into stages that chain
back to the original, and the one with a loss trains pipelined exactly like unpartitioned."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from onnxpipe.cost import annotate
from onnxpipe.graph import load
from onnxpipe.split import plan_cuts, split
from onnxpipe.target import load_target
from onnxpipe.verify import verify

DATA = Path(__file__).parent / "data"
EXPORTS = {
    "torch_gpt_legacy.onnx": {},
    "torch_cnn_dynamic.onnx": {"batch": 3},
    "torch_cnn_dynamo.onnx": {},
}


@pytest.mark.parametrize("name", EXPORTS)
def test_exports_load_cost_split_and_chain(name: str, tmp_path: Path) -> None:
    dims = EXPORTS[name]
    graph = load(DATA / name, dims)
    costs = annotate(graph)
    assert set(costs.nodes) == set(graph.compute_nodes) | graph.derived_nodes
    assert sum(c.flops for c in costs.nodes.values()) > 0
    nodes = graph.compute_nodes
    cuts = [graph.node(nodes[len(nodes) * i // 3]).output[0] for i in (1, 2)]
    plan = plan_cuts(graph, costs, load_target("fpga4"), cuts)
    manifest = split(graph, plan, tmp_path / "stages")
    assert len(manifest.stages) == 3
    errors = verify(tmp_path / "stages", DATA / name, dims=dims)
    assert errors and max(errors.values()) <= 1e-5


def test_dynamic_batch_is_bound_by_dim() -> None:
    assert load(DATA / "torch_cnn_dynamic.onnx", {"batch": 5}).tensors["logits"].shape == (5, 10)


def test_torch_export_trains_pipelined_like_unpartitioned(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    run = subprocess.run(
        [sys.executable, "-m", "onnxpipe", "train", str(DATA / "torch_gpt_legacy.onnx"), "--target", "cpu2", "--stages", "2",
         "--batch", "8", "--microbatches", "2", "--steps", "3", "--optimizer", "sgd", "--lr", "0.05", "--check", "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    check = json.loads(out.read_text())["check"]
    assert check["max_loss_rel_diff"] <= 1e-5
    assert check["max_weight_abs_diff"] <= 1e-5
    losses = json.loads(out.read_text())["losses"]
    assert len(losses) == 3 and np.isfinite(losses).all()


def test_the_torchscript_export_trains_like_pytorch() -> None:
    """TinyGPT's two layers are deep copies, equal when fresh: the TorchScript exporter stores each weight once and
    reads the duplicate through an Identity (an exporter's merge, untied), and writes the head, tied to the embedding,
    as a transposed copy (tied back). Trained so, it follows PyTorch's own SGD; with the duplicates trained as one it
    did not (15% off by the third step)."""
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.pipeline import Pipeline

    reference = json.loads((DATA / "torch_gpt_legacy.json").read_text())
    batches = np.load(DATA / "torch_gpt_legacy.npz")
    graph = load(DATA / "torch_gpt_legacy.onnx")
    kinds = {s.kind for s in graph.shared if s.name.startswith(("blocks.", "onnx::MatMul_4"))} | {s.kind for s in graph.shared if s.name == "onnx::MatMul_475"}
    assert kinds == {"merge", "copy"}
    with Pipeline(DATA / "torch_gpt_legacy.onnx", "cpu4", stages=2, batch=reference["batch"], microbatches=1, schedule="1f1b",
                  optimizer=OptimizerConfig("sgd", lr=reference["lr"]), processes=False) as pipe:
        losses = [pipe.train_step({"ids": batches["ids"][s], "labels": batches["labels"][s]}) for s in range(reference["steps"])]
    np.testing.assert_allclose(losses, reference["losses"], rtol=1e-6)
