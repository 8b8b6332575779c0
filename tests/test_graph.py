"""The graph IR: loading real-world model shapes, binding dims, telling constants from activations."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load, subgraph_captures


def _mlp(batch: int | str = 4) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((8, 16)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((16, 3)).astype(np.float32), "w2")
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="fc1"),
        helper.make_node("Relu", ["h"], ["r"], name="act"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="fc2"),
        helper.make_node("Slice", ["r", "starts", "ends", "axes"], ["r_skip"], name="narrow"),
        helper.make_node("Add", ["y", "r_skip"], ["z"], name="skip"),
    ]
    consts = [
        numpy_helper.from_array(np.array([0], np.int64), "starts"),
        numpy_helper.from_array(np.array([3], np.int64), "ends"),
        numpy_helper.from_array(np.array([1], np.int64), "axes"),
    ]
    graph = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 8])],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)],
        [w1, w2, *consts],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_load_builds_dag_with_edge_tensors_and_shapes() -> None:
    g = load(_mlp())
    assert g.order == ("fc1", "act", "fc2", "narrow", "skip")
    assert g.tensors["h"].shape == (4, 16) and g.tensors["h"].nbytes == 4 * 16 * 4
    edge = g.dag.get_edge_data("act", "fc2")["r"]
    assert (edge["tensor"], edge["dtype"], edge["shape"], edge["bytes"]) == ("r", "float32", (4, 16), 256)
    assert g.inputs == ("x",) and g.outputs == ("z",)
    assert g.parameters == ("w1", "w2")
    assert g.batch == 4
    assert g.consumers("r") == ("fc2", "narrow")


def test_symbolic_dims_bind_and_unbound_dims_name_the_flag() -> None:
    g = load(_mlp("batch"), {"batch": 6})
    assert g.tensors["z"].shape == (6, 3) and g.dims == {"batch": 6}
    with pytest.raises(OnnxpipeError, match=r"dim 'batch' of input 'x' is unbound.*--dim batch=VALUE"):
        load(_mlp("batch"))
    with pytest.raises(OnnxpipeError, match=r"--dim seq names no symbolic dim of the model \(its dims: batch\)"):
        load(_mlp("batch"), {"batch": 2, "seq": 4})
    two = _mlp("batch")
    two.graph.input[0].type.tensor_type.shape.dim[1].dim_param = "features"
    with pytest.raises(OnnxpipeError, match=r"dims 'batch' \(input 'x'\), 'features' \(input 'x'\) are unbound; costs depend on them, "
                                            r"set them with --dim batch=VALUE --dim features=VALUE$"):
        load(two)


def test_legacy_ir3_initializers_listed_as_inputs_are_not_user_inputs() -> None:
    model = _mlp()
    for init in model.graph.initializer:
        model.graph.input.append(helper.make_tensor_value_info(init.name, init.data_type, list(init.dims)))
    model.ir_version = 3
    g = load(model)
    assert g.inputs == ("x",)
    assert {"w1", "w2"} <= g.initializers
    assert g.model.ir_version >= 4


def test_weights_produced_by_constant_nodes_become_parameters() -> None:
    """Held, not trained: an exporter writes constants as Constant nodes, never the model's parameters (the
    TorchScript exporter's GroupNorm normalizes with Constant ones and zeros, which torch never trains)."""
    model = _mlp()
    w1 = next(t for t in model.graph.initializer if t.name == "w1")
    kept = [t for t in model.graph.initializer if t.name != "w1"]
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    model.graph.node.insert(0, helper.make_node("Constant", [], ["w1"], value=w1))
    g = load(model)
    assert "w1" in g.parameters and g.trained == ("w2",)
    assert g.compute_nodes == ("fc1", "act", "fc2", "narrow", "skip")


def test_constant_chains_are_told_apart_from_activations() -> None:
    """Integer arithmetic on constants is folded away; a chain computing a weight-like float tensor
    stays a constant chain (not a parameter, not a compute node)."""
    model = _mlp()
    model.graph.node.insert(0, helper.make_node("Mul", ["ends", "axes"], ["ends2"], name="fold"))
    model.graph.node.insert(1, helper.make_node("ConstantOfShape", ["ends2"], ["zeros"], name="zeros_of"))
    model.graph.node.append(helper.make_node("Add", ["zeros", "y"], ["y_plus"], name="use_zeros"))
    model.graph.output[0].name = "y_plus"
    g = load(model)
    assert "fold" not in g.order and "ends2" in g.initializers
    assert "zeros_of" in g.constant_nodes and g.tensors["zeros"].shape == (3,)
    assert {"zeros", "w1"} <= g.constants and "zeros" not in g.parameters
    assert "h" not in g.constants
    assert "zeros_of" not in g.compute_nodes


def test_nodes_whose_outputs_reach_no_output_once_shapes_fold_are_dropped() -> None:
    """The TorchScript export of F.mse_loss adds its input to a fill only to read the sum's Shape: folded, the sum feeds
    nothing, and a stage would compute it and send it on (a later stage then asked a gradient of it, which onnxruntime
    refused as unreachable). It is dropped with the weight only it read; what the model computes is unchanged."""
    from onnxpipe.ortutil import cpu_session

    model = _mlp()
    model.ir_version = 8
    model.graph.initializer.append(numpy_helper.from_array(np.ones((4, 3), np.float32), "bias_only_dead"))
    model.graph.node.extend([helper.make_node("Add", ["y", "bias_only_dead"], ["broadcast"], name="dead_sum"),
                             helper.make_node("Shape", ["broadcast"], ["broadcast_shape"], name="dead_shape"),
                             helper.make_node("Expand", ["z", "broadcast_shape"], ["z_out"], name="expand")])
    model.graph.output[0].name = "z_out"
    g = load(model)
    assert "dead_sum" not in g.order and "bias_only_dead" not in g.initializers and "expand" in g.compute_nodes
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    want = cpu_session(model.SerializeToString()).run(["z_out"], {"x": x})[0]
    np.testing.assert_array_equal(cpu_session(g.model.SerializeToString()).run(["z_out"], {"x": x})[0], want)


def test_unnamed_and_duplicate_node_names_are_made_unique_and_order_is_deterministic() -> None:
    model = _mlp()
    for node in model.graph.node:
        node.name = "" if node.name != "act" else "fc2"
    first, second = load(model), load(model)
    assert first.order == second.order
    assert len(set(first.order)) == len(first.order) == 5


def test_if_and_loop_bodies_capture_outer_tensors_as_node_inputs() -> None:
    then_body = helper.make_graph(
        [helper.make_node("Mul", ["h", "w_then"], ["t_out"], name="then_mul")],
        "then", [], [helper.make_tensor_value_info("t_out", TensorProto.FLOAT, [2, 4])],
    )
    else_body = helper.make_graph(
        [helper.make_node("Neg", ["h"], ["e_out"], name="else_neg")],
        "else", [], [helper.make_tensor_value_info("e_out", TensorProto.FLOAT, [2, 4])],
    )
    loop_body = helper.make_graph(
        [
            helper.make_node("Identity", ["cond_in"], ["cond_out"], name="keep"),
            helper.make_node("Add", ["acc_in", "branch"], ["acc_out"], name="accumulate"),
        ],
        "loop",
        [
            helper.make_tensor_value_info("i", TensorProto.INT64, []),
            helper.make_tensor_value_info("cond_in", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_in", TensorProto.FLOAT, [2, 4]),
        ],
        [
            helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
            helper.make_tensor_value_info("acc_out", TensorProto.FLOAT, [2, 4]),
        ],
    )
    nodes = [
        helper.make_node("Relu", ["x"], ["h"], name="relu"),
        helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
        helper.make_node("Greater", ["s", "zero"], ["flag"], name="positive"),
        helper.make_node("If", ["flag"], ["branch"], name="choose", then_branch=then_body, else_branch=else_body),
        helper.make_node("Loop", ["trips", "true", "h"], ["acc"], name="repeat", body=loop_body),
    ]
    inits = [
        numpy_helper.from_array(np.full((2, 4), 2.0, np.float32), "w_then"),
        numpy_helper.from_array(np.array(0.0, np.float32), "zero"),
        numpy_helper.from_array(np.array(3, np.int64), "trips"),
        numpy_helper.from_array(np.array(True), "true"),
    ]
    graph = helper.make_graph(
        nodes, "cf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("acc", TensorProto.FLOAT, [2, 4])], inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    g = load(model)
    assert set(subgraph_captures(g.node("choose"))) == {"h", "w_then"}
    assert set(g.node_inputs("repeat")) == {"trips", "true", "h", "branch"}
    assert g.dag.has_edge("relu", "choose") and g.dag.has_edge("choose", "repeat")
    assert g.order.index("choose") < g.order.index("repeat")


def test_bad_files_give_one_line_errors(tmp_path) -> None:
    with pytest.raises(OnnxpipeError, match="no such file"):
        load(tmp_path / "missing.onnx")
    with pytest.raises(OnnxpipeError, match="not a file"):
        load(tmp_path)
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"\x00\xffnot a protobuf at all" * 10)
    with pytest.raises(OnnxpipeError, match="not (a readable ONNX|an ONNX) model"):
        load(junk)
    good = tmp_path / "good.onnx"
    onnx.save(_mlp(), good)
    truncated = tmp_path / "truncated.onnx"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(OnnxpipeError) as info:
        load(truncated)
    assert "\n" not in str(info.value)


def test_external_data_models_load(tmp_path) -> None:
    path = tmp_path / "ext.onnx"
    onnx.save(_mlp(), path, save_as_external_data=True, all_tensors_to_one_file=True, location="ext.onnx.data", size_threshold=0)
    g = load(path)
    weights = numpy_helper.to_array(next(t for t in g.model.graph.initializer if t.name == "w1"))
    assert weights.shape == (8, 16) and np.isfinite(weights).all()


def test_a_bfloat16_model_is_planned_as_one_that_trains_in_bfloat16() -> None:
    """numpy holds bfloat16 as a type of its own kind (ml_dtypes), not a floating one: its weights were not weights, its
    loss no loss and its compute priced at the float32 rate (a 15x slower peak on an H100), with no gradients or
    optimizer state in memory."""
    from onnxpipe.cost import annotate
    from onnxpipe.plan import Assignment, build_problem, evaluate
    from onnxpipe.pricing.problem import dominant_dtype
    from onnxpipe.target import load_target

    vi = helper.make_tensor_value_info
    n = 2048
    weights = [numpy_helper.from_array(np.full((n, n), 0.01, np.float32).astype("bfloat16"), f"w{i}") for i in range(2)]
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"), helper.make_node("MatMul", ["h", "w1"], ["y"], name="mm1"),
             helper.make_node("ReduceMean", ["y"], ["loss"], name="mean", keepdims=0)]
    model = helper.make_model(helper.make_graph(nodes, "bf16", [vi("x", TensorProto.BFLOAT16, [n, n])], [vi("loss", TensorProto.BFLOAT16, [])],
                                                weights), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    graph = load(model)
    assert graph.trained == ("w0", "w1") and graph.loss == "loss" and dominant_dtype(graph) == "bfloat16"
    target, costs = load_target("h100x8"), annotate(graph)
    problem = build_problem(graph, costs, target, batch=n, microbatches=1, optimizer="adam")
    priced = evaluate(problem, Assignment((graph.compute_nodes,), ((target.devices[0].name,),), (False,)))
    assert priced.stages[0].memory.optimizer == 2 * 2 * n * n * 2  # two moments of two bfloat16 weights
    at_float32 = build_problem(graph, costs, target, batch=n, microbatches=1, optimizer="adam", dtype="float32")
    assert problem.forward[0, 0] * 5 < at_float32.forward[0, 0]  # the bfloat16 peak (989 TFLOP/s), not float32's (67)


@pytest.mark.parametrize("mode,size,stride,pads", [("SAME_UPPER", 7, 1, [2, 2, 2, 2]), ("SAME_UPPER", 8, 2, [1, 1, 2, 2]),
                                                   ("SAME_LOWER", 8, 2, [2, 2, 1, 1])])
def test_a_dilated_same_padded_conv_gets_its_pads_written_out(mode: str, size: int, stride: int, pads: list[int]) -> None:
    """The TorchScript export of Conv2d(padding="same", dilation=2) pads with auto_pad, which onnxruntime's CPU Conv refuses
    with a dilation ("Dilation not supported for AutoPad"): the model could not run, profile or train. The pads the
    spec's rule gives are written out (the odd one at the end for SAME_UPPER, at the start for SAME_LOWER)."""
    from onnxpipe.ortutil import cpu_session

    w = numpy_helper.from_array(np.random.default_rng(3).standard_normal((4, 2, 3, 3)).astype(np.float32), "w")
    node = helper.make_node("Conv", ["x", "w"], ["y"], name="conv", auto_pad=mode, dilations=[2, 2], strides=[stride, stride])
    out = -(-size // stride)
    model = helper.make_model(helper.make_graph([node], "same", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 2, size, size])],
                                                [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 4, out, out])], [w]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    x = np.random.default_rng(4).standard_normal((1, 2, size, size)).astype(np.float32)
    with pytest.raises(Exception, match="Dilation not supported"):
        cpu_session(model.SerializeToString()).run(["y"], {"x": x})
    g = load(model)
    conv = g.node("conv")
    assert {a.name: list(a.ints) for a in conv.attribute if a.name == "pads"} == {"pads": pads} and "auto_pad" not in {a.name for a in conv.attribute}
    explicit = helper.make_node("Conv", ["x", "w"], ["y"], dilations=[2, 2], strides=[stride, stride], pads=pads)
    expected = helper.make_model(helper.make_graph([explicit], "explicit", list(model.graph.input), list(model.graph.output), [w]),
                                 opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    y = cpu_session(g.model.SerializeToString()).run(["y"], {"x": x})[0]
    assert y.shape == (1, 4, out, out)
    np.testing.assert_array_equal(y, cpu_session(expected.SerializeToString()).run(["y"], {"x": x})[0])


def test_an_if_whose_condition_folds_is_replaced_by_the_branch_it_takes() -> None:
    """The TorchScript exporter writes shape tests as If nodes (repeat_interleave): with branches of other shapes, static
    inference cannot tell the If's output shape and the model could not load without running it. Once the condition
    folds, the taken branch's nodes stand in the main graph and shapes are inferred again; values unchanged."""
    from onnxpipe.ortutil import cpu_session

    vi = helper.make_tensor_value_info
    then_branch = helper.make_graph([helper.make_node("Concat", ["x", "x"], ["wide"], name="twice", axis=1)], "then", [], [vi("wide", TensorProto.FLOAT, None)])
    else_branch = helper.make_graph([helper.make_node("Identity", ["x"], ["same"], name="keep")], "else", [], [vi("same", TensorProto.FLOAT, None)])
    nodes = [helper.make_node("Shape", ["x"], ["s"], name="shape"), helper.make_node("Gather", ["s", "zero"], ["rows"], name="rows"),
             helper.make_node("Greater", ["rows", "one"], ["many"], name="test"),
             helper.make_node("If", ["many"], ["h"], name="branch", then_branch=then_branch, else_branch=else_branch),
             helper.make_node("MatMul", ["h", "w"], ["y"], name="fc")]
    inits = [numpy_helper.from_array(np.array(0, np.int64), "zero"), numpy_helper.from_array(np.array(1, np.int64), "one"),
             numpy_helper.from_array(np.random.default_rng(5).standard_normal((6, 4)).astype(np.float32), "w")]
    model = helper.make_model(helper.make_graph(nodes, "if", [vi("x", TensorProto.FLOAT, [2, 3])], [vi("y", TensorProto.FLOAT, None)], inits),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    g = load(model)
    assert "branch" not in g.order and g.order == ("branch/twice", "fc") and g.tensors[g.node("fc").input[0]].shape == (2, 6)
    assert g.derived_nodes == {"branch/twice"}  # a Concat of the input with itself: each stage reading it makes it
    x = np.random.default_rng(6).standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_array_equal(cpu_session(g.model.SerializeToString()).run(["y"], {"x": x})[0],
                                  cpu_session(model.SerializeToString()).run(["y"], {"x": x})[0])


def test_streaming_nodes_on_the_inputs_alone_are_derived_and_placed_by_no_plan() -> None:
    """An additive mask made from an input by elementwise and data-movement ops with scalar constants is derived (each
    stage reading it makes it again); an op reading a weight, a contraction or a random op on the inputs is not."""
    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w")
    one, big = numpy_helper.from_array(np.float32(1.0), "one"), numpy_helper.from_array(np.float32(-1e4), "big")
    nodes = [
        helper.make_node("Sub", ["one", "pad"], ["dropped"], name="dropped"),
        helper.make_node("Mul", ["dropped", "big"], ["bias"], name="bias"),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "bias"], ["h_masked"], name="mask1"),
        helper.make_node("Mul", ["pad", "w"], ["weighted"], name="weighted"),  # reads a weight
        helper.make_node("Transpose", ["pad"], ["pad_t"], name="pad_t"),
        helper.make_node("MatMul", ["pad", "pad_t"], ["gram"], name="gram"),  # a contraction
        helper.make_node("RandomNormalLike", ["pad"], ["noise"], name="noise"),
        helper.make_node("Add", ["h_masked", "weighted"], ["s1"], name="s1"),
        helper.make_node("MatMul", ["gram", "s1"], ["s2"], name="s2"),
        helper.make_node("Add", ["s2", "noise"], ["y"], name="y"),
    ]
    graph = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [8, 8]) for n in ("x", "pad")],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [8, 8])], [w, one, big])
    g = load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert g.derived_nodes == {"dropped", "bias", "pad_t"}
    assert g.derived == {"dropped", "bias", "pad_t"}
    assert not g.derived_nodes & set(g.compute_nodes) and set(g.compute_nodes) == {"fc1", "mask1", "weighted", "gram", "noise", "s1", "s2", "y"}


def test_a_model_of_derived_nodes_alone_places_them() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="r"), helper.make_node("Neg", ["r"], ["y"], name="y")]
    graph = helper.make_graph(nodes, "weightless", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    g = load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    assert g.derived_nodes == frozenset() and g.compute_nodes == ("r", "y")
