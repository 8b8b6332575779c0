"""Activations onnxruntime-training 1.19.2 cannot differentiate as torch exports them (HardSwish and HardSigmoid as in
MobileNetV3, PReLU, PixelShuffle's DepthToSpace, ELU, SELU, CELU, Mish, Softplus, torch.amax and an adaptive max
pool's ReduceMax), by both exporters (tools/export_torch_fixtures.py): pipelined training reproduces the losses
PyTorch's own SGD reached on the same batches, so the ONNX function bodies and rewrites `onnxpipe.rewrites` writes in
their place compute what torch computes, gradients included."""

from __future__ import annotations

import numpy as np
import pytest
from torch_reference import DATA, pipelined_losses, reference

from onnxpipe.gradients import missing_gradients
from onnxpipe.graph import load
from onnxpipe.rewrites import rewrite_for_training

EXPECTED = {"HardSwish", "HardSigmoid", "PRelu", "DepthToSpace", "Elu", "Selu", "Celu", "Softplus", "ReduceMax"}


@pytest.mark.parametrize("name", ["torch_activations", "torch_activations_ts"])
def test_the_fixtures_have_the_ops_and_no_op_lacks_a_gradient_after_the_rewrites(name: str) -> None:
    model = load(DATA / f"{name}.onnx", {"batch": 4}).model
    assert EXPECTED <= {n.op_type for n in model.graph.node}
    left = {n.op_type for n in rewrite_for_training(model)[0].graph.node}
    assert not left & (EXPECTED | {"Mish"}) and missing_gradients(model) == ()


@pytest.mark.parametrize("name,stages,schedule", [("torch_activations", 2, "1f1b"), ("torch_activations", 3, "zb-h1"), ("torch_activations_ts", 2, "1f1b")])
def test_pipelined_training_reproduces_pytorch_sgd(name: str, stages: int, schedule: str) -> None:
    # both exports are of one model with one reference
    np.testing.assert_allclose(pipelined_losses(name, stages, schedule, data="torch_activations"), reference("torch_activations")["losses"], rtol=1e-5)
