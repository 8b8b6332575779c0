"""A two-layer batch-first LSTM exported by torch's dynamo exporter with its MSE loss (tools/export_torch_fixtures.py).
The exporter reorders the gates of the weights it does not fold with Slices, and feeds one zeros tensor as both
initial states. Profiling it on a CPU target (`plan`, and `train` on a cpu target) crashed onnxruntime: the
profiler's gradient graph left out the weights read only through those Slices, and onnxruntime's LSTMGrad kernel
crashes when its weight gradients are not asked for. Pipelined training reproduces PyTorch's own SGD losses."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from torch_reference import DATA, pipelined_losses, reference


def test_planning_on_a_cpu_target_profiles_it_without_crashing() -> None:
    # a separate process: were onnxruntime to crash again, this test fails instead of the test run
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "plan", str(DATA / "torch_lstm.onnx"), "--target", "cpu2", "--stages", "2",
                          "--dim", "batch=4"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-500:])
    assert "solver:" in run.stdout


def test_the_profile_times_both_lstms_backward() -> None:
    code = ("import json; from onnxpipe.cost_profile import profile_times; from onnxpipe.graph import load; "
            f"g = load({str(DATA / 'torch_lstm.onnx')!r}, {{'batch': 4}}); p = profile_times(g, runs=1, warmup=0); "
            "lstms = [n for n in g.compute_nodes if g.node(n).op_type == 'LSTM']; "
            "print(json.dumps([lstms, [n for n in lstms if p.backward.get(n, 0) > 0]]))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, (run.returncode, run.stderr[-500:])
    lstms, timed = json.loads(run.stdout.strip().splitlines()[-1])
    assert len(lstms) == 2 and timed == lstms


@pytest.mark.parametrize("stages,schedule", [(1, "1f1b"), (2, "1f1b")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(pipelined_losses("torch_lstm", stages, schedule), reference("torch_lstm")["losses"], rtol=1e-5)
