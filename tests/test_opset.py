"""Opset-9 models train: onnx's version converter lifts the training graphs to opset 13 (where the appended
SoftmaxCrossEntropyLoss, Gemm's gradient and Dropout's exist), while the stage files keep opset 9."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.ortutil import cpu_session
from onnxpipe.train.loss import LossSpec
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline


def _mlp9() -> onnx.ModelProto:
    rng = np.random.default_rng(0)

    def init(name: str, *shape: int) -> onnx.TensorProto:
        return numpy_helper.from_array((rng.normal(size=shape) * 0.3).astype(np.float32), name)

    nodes = [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"], name="fc1", transB=1),
             helper.make_node("Relu", ["h"], ["r"], name="relu"),
             helper.make_node("Dropout", ["r"], ["d"], name="drop", ratio=0.5),
             helper.make_node("Gemm", ["d", "w2", "b2"], ["logits"], name="fc2", transB=1)]
    graph = helper.make_graph(nodes, "mlp9", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 6])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 5])],
                              [init("w1", 8, 6), init("b1", 8), init("w2", 5, 8), init("b2", 5)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 9)])
    model.ir_version = 4
    return model


def test_opset9_model_trains_and_its_stage_files_keep_opset9() -> None:
    model = _mlp9()
    rng = np.random.default_rng(1)
    batch = {"x": rng.normal(size=(8, 6)).astype(np.float32), "labels": rng.integers(0, 5, (8,))}
    logits = cpu_session(model.SerializeToString()).run(None, {"x": batch["x"]})[0]
    logp = logits - np.log(np.exp(logits).sum(1, keepdims=True))
    want = float(-logp[np.arange(8), batch["labels"]].mean())
    with Pipeline(model, "cpu2", stages=2, batch=8, microbatches=2, loss=LossSpec("cross_entropy", "logits"),
                  optimizer=OptimizerConfig("sgd", lr=0.5), processes=False) as pipe:
        assert pipe.stages == 2
        assert {o.version for st in pipe.manifest.stages for o in onnx.load(str(pipe.directory / st.file)).opset_import} == {9}
        losses = [pipe.train_step(batch) for _ in range(3)]
    assert abs(losses[0] - want) <= 1e-5 * want
    assert losses[2] < losses[1] < losses[0]
