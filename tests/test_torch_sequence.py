"""A model of the patterns audio and text models combine, each of which onnxruntime-training 1.19.2 got wrong or could
not train as torch's dynamo exporter writes it (tools/export_torch_fixtures.py, `SequenceNet`): a bidirectional LSTM,
self-attention with a causal-mask buffer, torch.flip, a reflect pad, a grouped dilated Conv1d, an RMSNorm and a LayerNorm
without weights. Pipelined training reproduces the losses PyTorch's own SGD reached on the same batches."""

from __future__ import annotations

import numpy as np
import pytest
from torch_reference import DATA, pipelined_losses, reference

from onnxpipe.graph import load
from onnxpipe.nodes import is_held
from onnxpipe.rewrites import rewrite_for_training


def test_the_fixture_has_the_patterns_and_trains_only_torch_parameters() -> None:
    graph = load(DATA / "torch_sequence.onnx")
    ops = {n.op_type for n in graph.model.graph.node}
    assert {"LSTM", "Slice", "Pad", "Conv", "LayerNormalization"} <= ops
    done = {r.pattern for r in rewrite_for_training(graph.model)[1]}
    assert {"LSTM -> its steps unrolled", "Slice with a negative step -> Gather", "Pad in reflect mode -> Concat of Gathers",
            "grouped Conv over one axis -> Conv over two"} <= done
    # the folded causal mask and the LayerNorm's ones (merged with the RMSNorm's weight) are held, not trained
    held = {t.name: tuple(t.dims) for t in graph.model.graph.initializer if is_held(t)}
    assert held["norm.weight"] == (16,) and (1, 1, 8, 8) in held.values()
    assert "rms.weight" in graph.trained and not set(held) & set(graph.trained)


@pytest.mark.parametrize("stages,schedule", [(1, "1f1b"), (2, "1f1b"), (3, "zb-h1")])
def test_pipelined_training_reproduces_pytorch_sgd(stages: int, schedule: str) -> None:
    np.testing.assert_allclose(pipelined_losses("torch_sequence", stages, schedule), reference("torch_sequence")["losses"], rtol=1e-5)
