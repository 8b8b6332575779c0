"""Gradient availability asked of onnxruntime-training itself (no hand-kept list), before training starts,
and the exporter-pattern rewrites that keep every forward value bit-identical while making them differentiable."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.gradients import ensure_gradients, missing_gradients
from onnxpipe.ortutil import cpu_session, gradient_model
from onnxpipe.rewrites import rewrite_for_training
from onnxpipe.train.pipeline import Pipeline

RNG = np.random.default_rng(0)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           inits: list[onnx.TensorProto], opset: int = 17) -> onnx.ModelProto:
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _untrainable() -> onnx.ModelProto:
    """x [2, 3, 4, 4] -> Mul w -> LRN -> CumSum -> Sum(with itself) -> Relu -> ReduceMean = loss; an int
    CumSum off the gradient path (counting positions) must not count."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"], name="scale"),
        helper.make_node("LRN", ["a"], ["b"], name="lrn", size=3),
        helper.make_node("CumSum", ["b", "axis"], ["c"], name="cumsum"),
        helper.make_node("Sum", ["c", "c"], ["d"], name="sum"),
        helper.make_node("Relu", ["d"], ["e"], name="relu"),
        helper.make_node("ReduceMean", ["e"], ["loss"], name="mean", keepdims=0),
        helper.make_node("CumSum", ["ids", "axis"], ["positions"], name="positions"),
    ]
    inits = [numpy_helper.from_array(RNG.normal(size=(1, 3, 4, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array(1, np.int64), "axis")]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4]),
                          helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 5])],
                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                   helper.make_tensor_value_info("positions", TensorProto.INT64, [2, 5])], inits)


def test_every_op_without_a_gradient_is_found_on_the_gradient_path_only() -> None:
    missing = {m.op_type: m.nodes for m in missing_gradients(_untrainable())}
    assert missing == {"LRN": ("lrn",), "CumSum": ("cumsum",), "Sum": ("sum",)}


def test_training_refuses_before_any_worker_with_every_op_named() -> None:
    with pytest.raises(OnnxpipeError) as err:
        ensure_gradients(_untrainable(), None, "m.onnx")
    message = str(err.value)
    assert "\n" not in message
    for op in ("LRN (1 node: lrn)", "CumSum (1 node: cumsum)", "Sum (1 node: sum)"):
        assert op in message
    with pytest.raises(OnnxpipeError, match=r"no gradient for LRN .*CumSum .*Sum "):
        Pipeline(_untrainable(), "cpu2", stages=1, microbatches=1, processes=False)


def test_inspect_lists_them(tmp_path: Path) -> None:
    onnx.save(_untrainable(), tmp_path / "m.onnx")
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "inspect", str(tmp_path / "m.onnx")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "LRN (1 node: lrn), CumSum (1 node: cumsum), Sum (1 node: sum)" in " ".join(run.stdout.split())


def _split_to_sequence(split: np.ndarray | None, keepdims: int, opset: int = 17) -> onnx.ModelProto:
    """x [2, 6, 3] (times weight w) cut on axis 1 by SplitToSequence, every piece read back by SequenceAt and summed."""
    pieces = 6 if split is None else len(split) if split.ndim == 1 else -(-6 // int(split))
    inits = [numpy_helper.from_array(RNG.normal(size=(2, 6, 3)).astype(np.float32), "w")]
    ins = ["xw"]
    if split is not None:
        inits.append(numpy_helper.from_array(split.astype(np.int64), "split"))
        ins.append("split")
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"], name="mul"),
             helper.make_node("SplitToSequence", ins, ["seq"], name="s2s", axis=1, keepdims=keepdims)]
    outputs = []
    for i in range(pieces):
        inits.append(numpy_helper.from_array(np.array(i - pieces if i % 2 else i, np.int64), f"pos{i}"))
        nodes.append(helper.make_node("SequenceAt", ["seq", f"pos{i}"], [f"p{i}"], name=f"at{i}"))
        nodes.append(helper.make_node("ReduceSum", [f"p{i}"], [f"r{i}"], name=f"rs{i}", keepdims=0))
        outputs.append(f"p{i}")
    total = "r0"
    for i in range(1, pieces):
        nodes.append(helper.make_node("Add", [total, f"r{i}"], [f"t{i}"], name=f"add{i}"))
        total = f"t{i}"
    nodes.append(helper.make_node("Identity", [total], ["loss"], name="loss"))
    outs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])] + [helper.make_tensor_value_info(p, TensorProto.FLOAT, None) for p in outputs]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6, 3])], outs, inits, opset)


@pytest.mark.parametrize("split,keepdims", [(np.array([1, 3, 2]), 1), (np.array(2), 1), (None, 0), (None, 1)])
@pytest.mark.parametrize("opset", [12, 17])
def test_split_to_sequence_becomes_split_bit_identically(split: np.ndarray | None, keepdims: int, opset: int) -> None:
    model = _split_to_sequence(split, keepdims, opset)
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == ["SplitToSequence+SequenceAt -> Split"]
    assert not {"SplitToSequence", "SequenceAt"} & {n.op_type for n in rewritten.graph.node}
    x = RNG.normal(size=(2, 6, 3)).astype(np.float32)
    before = cpu_session(model.SerializeToString(), optimize=False).run(None, {"x": x})
    after = cpu_session(rewritten.SerializeToString(), optimize=False).run(None, {"x": x})
    assert len(before) == len(after) and all(a.shape == b.shape and np.array_equal(a, b) for a, b in zip(before, after))
    with pytest.raises(Exception):
        gradient_model(model.SerializeToString(), "loss", {"w"})
    grad = gradient_model(rewritten.SerializeToString(), "loss", {"w"})
    assert "w_grad" in {o for n in grad.graph.node for o in n.output}
    assert missing_gradients(model) == ()  # the check sees the model as training will


def test_cast_like_becomes_cast_bit_identically() -> None:
    nodes = [helper.make_node("Mul", ["x", "w"], ["a"], name="mul"),
             helper.make_node("CastLike", ["half", "a"], ["scale"], name="castlike"),
             helper.make_node("Mul", ["a", "scale"], ["b"], name="scaled"),
             helper.make_node("ReduceSum", ["b"], ["loss"], name="sum", keepdims=0)]
    inits = [numpy_helper.from_array(RNG.normal(size=(3,)).astype(np.float32), "w"), numpy_helper.from_array(np.array(0.5, np.float64), "half")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])], [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    assert [m.op_type for m in missing_gradients(model)] == []
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == ["CastLike -> Cast"]
    x = RNG.normal(size=(2, 3)).astype(np.float32)
    assert np.array_equal(cpu_session(model.SerializeToString()).run(None, {"x": x})[0], cpu_session(rewritten.SerializeToString()).run(None, {"x": x})[0])


@pytest.mark.parametrize("batch", [2, "batch"])
def test_broadcast_where_values_and_pow_base_get_gradients_of_their_own_shape(batch: int | str) -> None:
    """onnxruntime-training differentiates Where's values and Pow's base without summing over the axes they were
    broadcast along: the weights' gradients would come out [2, 3, 4]. Expanded first, they are summed back; with a
    symbolic batch the output's shape is known only at run time (Shape + Expand)."""
    nodes = [helper.make_node("Greater", ["x", "zero"], ["mask"], name="mask"),
             helper.make_node("Where", ["mask", "w", "zero"], ["picked"], name="where"),
             helper.make_node("Mul", ["picked", "x"], ["weighted"], name="weighted"),
             helper.make_node("Pow", ["v", "e"], ["powered"], name="pow"),
             helper.make_node("Add", ["weighted", "powered"], ["both"], name="both"),
             helper.make_node("ReduceSum", ["both"], ["loss"], name="sum", keepdims=0)]
    w, v = RNG.normal(size=(1, 3, 4)).astype(np.float32), RNG.uniform(0.5, 1.5, size=(1, 3, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(v, "v"), numpy_helper.from_array(np.array(0, np.float32), "zero")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3, 4]),
                           helper.make_tensor_value_info("e", TensorProto.FLOAT, [batch, 3, 4])],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    rewritten, done = rewrite_for_training(model)
    # Where's scalar zero, broadcast too, is a constant: no gradient, so left as it is
    assert sorted(r.pattern for r in done) == ["Pow broadcast input -> Expand", "Where broadcast input -> Expand"]
    assert [n.input[2] for n in rewritten.graph.node if n.op_type == "Where" and n.name == "where"] == ["zero"]
    x, e = RNG.normal(size=(2, 3, 4)).astype(np.float32), RNG.uniform(1, 3, size=(2, 3, 4)).astype(np.float32)
    feeds = {"x": x, "e": e}
    assert np.array_equal(cpu_session(model.SerializeToString(), optimize=False).run(None, feeds)[0],
                          cpu_session(rewritten.SerializeToString(), optimize=False).run(None, feeds)[0])
    grad = gradient_model(rewritten.SerializeToString(), "loss", {"w", "v"})
    w_grad, v_grad = cpu_session(grad.SerializeToString()).run(["w_grad", "v_grad"], feeds)
    np.testing.assert_allclose(w_grad, np.where(x > 0, x, 0).sum(axis=0, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(v_grad, (e * v ** (e - 1)).sum(axis=0, keepdims=True), rtol=1e-5)


def test_inputs_of_the_output_shape_are_left_alone() -> None:
    nodes = [helper.make_node("Greater", ["x", "zero"], ["mask"], name="mask"),
             helper.make_node("Where", ["mask", "x", "y"], ["picked"], name="where"),
             helper.make_node("Pow", ["picked", "two"], ["loss"], name="pow")]
    inits = [numpy_helper.from_array(np.array(0, np.float32), "zero"), numpy_helper.from_array(np.array(2, np.float32), "two")]
    model = _model(nodes, [helper.make_tensor_value_info(name, TensorProto.FLOAT, [2, 3]) for name in ("x", "y")],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [2, 3])], inits)
    rewritten, done = rewrite_for_training(model)
    assert done == () and [n.op_type for n in rewritten.graph.node] == ["Greater", "Where", "Pow"]
