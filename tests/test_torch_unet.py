"""A small UNet exported by torch's dynamo exporter with its MSE loss (tools/export_torch_fixtures.py): GroupNorm
(exported as InstanceNormalization, which onnxruntime-training cannot differentiate), bilinear and nearest
upsampling (Resize) and a grouped ConvTranspose with output padding (gradients without CPU kernels). Pipelined
training reproduces the losses PyTorch's own SGD reached on the same batches: `onnxpipe.rewrites` writes those ops
out in ops onnxruntime-training differentiates on the CPU, and the rewrites compute what torch computes."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from torch_reference import DATA, pipelined_losses, reference


def test_the_fixture_has_the_ops_the_rewrites_replace() -> None:
    model = onnx.load(str(DATA / "torch_unet.onnx"))
    ops = [n.op_type for n in model.graph.node]
    modes = sorted(onnx.helper.get_attribute_value(a).decode() for n in model.graph.node if n.op_type == "Resize"
                   for a in n.attribute if a.name == "mode")
    assert ops.count("InstanceNormalization") == 2 and ops.count("ConvTranspose") == 1 and modes == ["linear", "nearest"]


@pytest.mark.parametrize("stages,schedule", [(2, "1f1b"), (3, "zb-h1")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(pipelined_losses("torch_unet", stages, schedule), reference("torch_unet")["losses"], rtol=1e-5)


def test_inspect_says_what_training_writes_out() -> None:
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-m", "onnxpipe", "inspect", str(DATA / "torch_unet.onnx"), "--dim", "batch=4"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    said = " ".join(run.stdout.split())
    assert ("written out for training (the stage files keep them): InstanceNormalization -> ReduceMean, Sub, Mul, Sqrt, Div x2, "
            "Resize -> MatMul by interpolation matrices x1, Resize -> Expand of each element x1, ConvTranspose -> MatMul by spacing matrices, Conv x1") in said
