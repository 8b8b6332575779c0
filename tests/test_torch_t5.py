"""transformers' T5 (2 + 2 layers, vocab 64, d 32, freshly initialised) exported by the TorchScript exporter with its
loss (tools/export_torch_fixtures.py): pipelined training reproduces the losses PyTorch's own SGD reached on the same
batches. Its attention adds the relative position bias under a broadcast Where, whose gradient onnxruntime-training
builds only after `onnxpipe.rewrites` expands the bias; and the exporter wrote its head, tied to the embedding, as a
transposed copy of its own, which loading ties back (`onnxpipe.initializers`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe.graph import load
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline

DATA = Path(__file__).parent / "data"
REFERENCE = json.loads((DATA / "torch_t5.json").read_text())
BATCHES = np.load(DATA / "torch_t5.npz")
INPUTS = ("input_ids", "attention_mask", "decoder_input_ids", "labels")


def test_the_fixture_has_the_broadcast_where() -> None:
    model = onnx.load(str(DATA / "torch_t5.onnx"))
    unsqueezed = {n.output[0] for n in model.graph.node if n.op_type == "Unsqueeze"}
    assert any(n.op_type == "Where" and n.input[1] in unsqueezed for n in model.graph.node)


def _train(stages: int, schedule: str, **options: object) -> np.ndarray:
    with Pipeline(DATA / "torch_t5.onnx", "cpu4", stages=stages, batch=REFERENCE["batch"], microbatches=2, schedule=schedule,
                  optimizer=OptimizerConfig("sgd", lr=REFERENCE["lr"]), processes=False, **options) as pipe:
        assert pipe.stages == stages
        return np.array([pipe.train_step({name: BATCHES[name][s] for name in INPUTS}) for s in range(REFERENCE["steps"])])


@pytest.mark.parametrize("stages,schedule", [(2, "1f1b"), (2, "zb-h1")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(_train(stages, schedule), REFERENCE["losses"], rtol=1e-6)


def test_the_head_trained_apart_from_the_embedding_leaves_pytorch() -> None:
    """`--untie` the exporter's copy: head and embedding move apart, which torch's tied model never does."""
    losses = _train(2, "1f1b", untie=("onnx::MatMul_1168",))
    assert losses[0] == pytest.approx(REFERENCE["losses"][0], rel=1e-6)  # the first step's loss comes before any update
    assert abs(losses[-1] / REFERENCE["losses"][-1] - 1) > 1e-5


def test_loading_it_warns_of_nothing() -> None:
    """Folding its position buckets takes log(0) and casts -inf to int, as the model itself does: no RuntimeWarning
    reaches a user of the Python API (the CLI hides warnings)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        load(DATA / "torch_t5.onnx", {"batch": REFERENCE["batch"]})
    assert [str(w.message) for w in caught] == []
