"""transformers' T5 (2 + 2 layers, vocab 64, d 32, freshly initialised) exported by the TorchScript exporter with its
loss (tools/export_torch_fixtures.py): pipelined training reproduces the losses PyTorch's own SGD reached on the same
batches. Its attention adds the relative position bias under a broadcast Where, whose gradient onnxruntime-training
builds only after `onnxpipe.rewrites` expands the bias; and the exporter wrote its head, tied to the embedding, as a
transposed copy of its own, which loading ties back (`onnxpipe.initializers`)."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from torch_reference import DATA, pipelined_losses, reference

from onnxpipe.graph import load

REFERENCE = reference("torch_t5")


def test_the_fixture_has_the_broadcast_where() -> None:
    model = onnx.load(str(DATA / "torch_t5.onnx"))
    unsqueezed = {n.output[0] for n in model.graph.node if n.op_type == "Unsqueeze"}
    assert any(n.op_type == "Where" and n.input[1] in unsqueezed for n in model.graph.node)


@pytest.mark.parametrize("stages,schedule", [(2, "1f1b"), (2, "zb-h1")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(pipelined_losses("torch_t5", stages, schedule), REFERENCE["losses"], rtol=1e-6)


def test_the_head_trained_apart_from_the_embedding_leaves_pytorch() -> None:
    """`--untie` the exporter's copy: head and embedding move apart, which torch's tied model never does."""
    losses = pipelined_losses("torch_t5", 2, "1f1b", untie=("onnx::MatMul_1168",))
    assert losses[0] == pytest.approx(REFERENCE["losses"][0], rel=1e-6)  # the first step's loss comes before any update
    assert abs(losses[-1] / REFERENCE["losses"][-1] - 1) > 1e-5


def test_loading_it_warns_of_nothing() -> None:
    """Folding its position buckets takes log(0) and casts -inf to int, as the model itself does: no RuntimeWarning
    reaches a user of the Python API (the CLI hides warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(DATA / "torch_t5.onnx", {"batch": REFERENCE["batch"]})
    assert [str(w.message) for w in caught] == []


def test_the_exported_model_computes_pytorchs_next_loss(tmp_path) -> None:
    """`Pipeline.export` after two steps: the exported model's loss on the third batch is PyTorch's third loss, so the
    head the exporter wrote as a transposed copy of the embedding is exported as the trained embedding's transpose
    (it kept its first values before, and the exported head was untrained)."""
    from onnxpipe.ortutil import cpu_session
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.pipeline import Pipeline

    batches = np.load(DATA / "torch_t5.npz")
    with Pipeline(DATA / "torch_t5.onnx", "cpu4", stages=2, batch=REFERENCE["batch"], microbatches=2,
                  optimizer=OptimizerConfig("sgd", lr=REFERENCE["lr"]), processes=False) as pipe:
        for step in range(2):
            pipe.train_step({name: batches[name][step] for name in batches.files})
        pipe.export(tmp_path / "trained.onnx")
    loss = cpu_session(str(tmp_path / "trained.onnx")).run(["loss"], {name: batches[name][2] for name in batches.files})[0]
    assert float(loss) == pytest.approx(REFERENCE["losses"][2], rel=1e-6)  # 2.3e-5 off with the head untrained
