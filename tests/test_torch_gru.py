"""A two-layer bidirectional batch-first GRU exported by the TorchScript exporter with its MSE loss
(tools/export_torch_fixtures.py). onnxruntime-training 1.19.2 has no GRU gradient; `onnxpipe.recurrent` unrolls
its steps, and pipelined training reproduces the losses PyTorch's own SGD reached on the same batches."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from torch_reference import DATA, pipelined_losses, reference


def test_the_fixture_has_bidirectional_grus() -> None:
    model = onnx.load(str(DATA / "torch_gru.onnx"))
    grus = [n for n in model.graph.node if n.op_type == "GRU"]
    assert len(grus) == 2 and all(onnx.helper.get_attribute_value(a) == b"bidirectional" for n in grus for a in n.attribute if a.name == "direction")


@pytest.mark.parametrize("stages,schedule", [(1, "1f1b"), (2, "1f1b"), (3, "zb-h1")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(pipelined_losses("torch_gru", stages, schedule), reference("torch_gru")["losses"], rtol=1e-5)
