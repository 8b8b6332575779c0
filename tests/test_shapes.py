"""Shapes without running the model, and the clean-up before planning: exporter-style shape arithmetic
(Shape -> Gather -> Unsqueeze -> Concat -> Reshape on a symbolic batch) is folded, Identity copies
leave the planning graph, what the model computes is unchanged, and weights are never read."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxpipe.graph as graph_module
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.shapes import evaluate


def _exporter_style(batch: int | str = "batch") -> onnx.ModelProto:
    """x [batch, 4, 64] -> MatMul -> view(batch, 256) via Shape/Gather/Unsqueeze/Concat -> Identity -> Relu,
    plus a Range over the sequence length (a position table) added to the result."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, 64)).astype(np.float32), "w"),
        numpy_helper.from_array(np.array(0, np.int64), "zero"),
        numpy_helper.from_array(np.array(1, np.int64), "one"),
        numpy_helper.from_array(np.array([0], np.int64), "axis0"),
        numpy_helper.from_array(np.array([256], np.int64), "flat"),
        numpy_helper.from_array(np.array(8, np.int64), "eight"),
        numpy_helper.from_array(np.array([32], np.int64), "thirty_two"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
        helper.make_node("Shape", ["h"], ["h_shape"], name="shape"),
        helper.make_node("Gather", ["h_shape", "zero"], ["b"], name="take_batch", axis=0),
        helper.make_node("Unsqueeze", ["b", "axis0"], ["b1"], name="unsqueeze"),
        helper.make_node("Concat", ["b1", "flat"], ["target"], name="concat", axis=0),
        helper.make_node("Reshape", ["h", "target"], ["v"], name="view"),
        helper.make_node("Identity", ["v"], ["v_copy"], name="copy"),
        helper.make_node("Identity", ["v_copy"], ["v_copy2"], name="copy2"),
        helper.make_node("Relu", ["v_copy2"], ["r"], name="act"),
        helper.make_node("Mul", ["eight", "b"], ["n"], name="count"),
        helper.make_node("Div", ["n", "b"], ["n_per"], name="per_row"),
        helper.make_node("Mul", ["n_per", "thirty_two"], ["width"], name="width"),
        helper.make_node("Squeeze", ["width"], ["width_scalar"], name="squeeze"),
        helper.make_node("Range", ["zero", "width_scalar", "one"], ["positions"], name="positions"),
        helper.make_node("Cast", ["positions"], ["positions_f"], name="cast", to=TensorProto.FLOAT),
        helper.make_node("Add", ["r", "positions_f"], ["y"], name="add_positions"),
        helper.make_node("Identity", ["y"], ["out"], name="output_copy"),
    ]
    graph = helper.make_graph(nodes, "exported", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 4, 64])],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def test_shape_arithmetic_is_folded_without_running_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the model was run to learn its shapes")

    monkeypatch.setattr(graph_module, "cpu_session", refuse)
    g = load(_exporter_style(), {"batch": 6})
    assert g.tensors["v"].shape == (6, 256) and g.tensors["positions_f"].shape == (256,) and g.tensors["out"].shape == (6, 256)
    # shape nodes are gone, their value a constant; Identity copies between activations are gone too
    for gone in ("shape", "take_batch", "unsqueeze", "concat", "count", "per_row", "width", "squeeze", "positions", "copy", "copy2"):
        assert gone not in g.order
    assert list(numpy_helper.to_array(next(t for t in g.model.graph.initializer if t.name == "target"))) == [6, 256]
    assert g.compute_nodes == ("proj", "view", "act", "add_positions", "output_copy")
    assert g.node("act").input[0] == "v"
    # the float position table computed from the folded Range stays computed (a constant chain, not a weight)
    assert "cast" in g.constant_nodes and g.parameters == ("w",)


def test_cleaned_model_computes_what_the_original_does() -> None:
    original = _exporter_style(batch=6)
    g = load(original)
    x = np.random.default_rng(1).standard_normal((6, 4, 64)).astype(np.float32)
    want = ort.InferenceSession(original.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    got = ort.InferenceSession(g.model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_weights_are_never_read(tmp_path: Path) -> None:
    """The weight's bytes deleted from its external-data file: loading reads its dims, never its bytes."""
    model = _exporter_style(batch=2)
    onnx.save(model, str(tmp_path / "m.onnx"), save_as_external_data=True, all_tensors_to_one_file=True, location="m.data", size_threshold=1024)
    (tmp_path / "m.data").write_bytes(b"")
    g = load(tmp_path / "m.onnx")
    assert g.tensors["out"].shape == (2, 256) and g.tensors["w"].shape == (64, 64)


def test_unknown_shapes_name_the_node_and_the_opt_in_fallback() -> None:
    """NonZero's output length depends on the data: static inference cannot know it."""
    graph = helper.make_graph(
        [helper.make_node("NonZero", ["x"], ["nz"], name="nonzero"), helper.make_node("Cast", ["nz"], ["y"], name="cast", to=TensorProto.FLOAT)],
        "data_dependent", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxpipeError, match=r"cannot tell the shapes of 2 tensors \(first: 'nz' of NonZero node 'nonzero'\).*--shapes-by-running"):
        load(model)
    g = load(model, shapes_by_running=True)
    assert g.tensors["nz"].shape == (2, 0)  # zeros in: no non-zero element


@pytest.mark.parametrize(("op", "inputs", "attrs"), [
    ("GatherND", [np.arange(40).reshape(8, 5), np.random.default_rng(0).integers(0, 5, (8, 1, 1, 5, 1))], {"batch_dims": 1}),
    ("GatherND", [np.arange(20).reshape(4, 5), np.array([[0, 1], [3, 4], [-1, -2]])], {}),
    ("GatherElements", [np.arange(50).reshape(1, 50), np.array([[3, -1, 7]])], {"axis": 1}),
    ("CumSum", [np.arange(40).reshape(8, 5), np.array(1)], {"reverse": 1, "exclusive": 1}),
    ("CumSum", [np.arange(40).reshape(8, 5), np.array(0)], {}),
    ("Transpose", [np.arange(24).reshape(2, 3, 4)], {"perm": [2, 0, 1]}),
    ("Slice", [np.arange(10), np.array([8]), np.array([-2**62]), np.array([0]), np.array([-2])], {}),
    ("Slice", [np.arange(24).reshape(4, 6), np.array([1, -1]), np.array([3, -2**63]), np.array([0, 1]), np.array([1, -1])], {}),
    ("Div", [np.array([-7, 7]), np.array([2, -2])], {}),
    ("Expand", [np.array([[1], [2]]), np.array([2, 3])], {}),
    ("Range", [np.array(0), np.array(10), np.array(3)], {}),
    ("Gather", [np.array([2, 3, 4]), np.array(-1)], {"axis": 0}),
    ("Unsqueeze", [np.array(5), np.array([0])], {}),
    ("Squeeze", [np.array([[5]]), np.array([0, 1])], {}),
    ("Where", [np.array([True, False]), np.array([1, 2]), np.array([3, 4])], {}),
    ("ConstantOfShape", [np.array([2, 3])], {"value": numpy_helper.from_array(np.array([1.5], np.float32))}),
    ("Reshape", [np.arange(6), np.array([0, -1])], {}),
])
def test_folding_rules_agree_with_onnx_reference(op: str, inputs: list[np.ndarray], attrs: dict) -> None:
    names = [f"in{i}" for i in range(len(inputs))]
    if op == "Reshape":
        inputs = [inputs[0].reshape(2, 3), inputs[1]]
    node = helper.make_node(op, names, ["out"], **attrs)
    want = ReferenceEvaluator(node).run(None, dict(zip(names, inputs)))[0]
    got = evaluate(node, inputs, 18)[0]
    assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)


def test_checks_before_training_never_read_weights_left_on_disk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A 1-D weight over 4 KiB stays on disk; the gradient check's constant reading skips it, from any
    working directory (it used to read it relative to the working directory and fail)."""
    from onnxpipe.gradients import missing_gradients

    bias = numpy_helper.from_array(np.ones(2048, np.float32), "bias")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["h"], name="add"), helper.make_node("Relu", ["h"], ["y"], name="act")],
        "biased", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2048])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [bias],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    (tmp_path / "model").mkdir()
    onnx.save(model, str(tmp_path / "model" / "m.onnx"))
    monkeypatch.chdir(tmp_path)
    g = load(tmp_path / "model" / "m.onnx")
    assert next(t for t in g.model.graph.initializer if t.name == "bias").data_location == onnx.TensorProto.EXTERNAL
    assert not missing_gradients(g.model)
