"""Cost annotation: per-op formulas against hand counts, published full-size figures, unknown ops,
tied weights, control flow, measured mode, the annotated-ONNX round trip and the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.cost import annotate, read_annotated, summarize, write_annotated
from onnxpipe.cost_profile import profile_times
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=(), opset=17):
    """A model from nodes, (name, shape) inputs, output names and {name: array} initializers."""
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, F, s) for n, s in inputs],
        [helper.make_empty_tensor_value_info(o) for o in outputs],
        [numpy_helper.from_array(np.asarray(v), k) for k, v in dict(inits).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 9
    return model


def _one(nodes, inputs, outputs, inits=(), opset=17):
    graph = load(_model(nodes, inputs, outputs, inits, opset))
    return graph, annotate(graph)


def _zeros(*shape):
    return np.zeros(shape, np.float32)


# --- formulas against hand counts ------------------------------------------


def test_conv_groups_strides_pads_bias():
    # out (1,6,4,4) = 96 elements, each 4/2 channels x 3x3 = 18 MACs; bias adds 96
    node = helper.make_node("Conv", ["x", "W", "B"], ["y"], name="conv", group=2, strides=[2, 2], pads=[1, 1, 1, 1], kernel_shape=[3, 3])
    graph, costs = _one([node], [("x", [1, 4, 8, 8])], ["y"], {"W": _zeros(6, 2, 3, 3), "B": _zeros(6)})
    assert graph.tensors["y"].shape == (1, 6, 4, 4)
    c = costs.nodes["conv"]
    # x is a model input: training computes the weight gradient only
    assert (c.op_class, c.flops, c.backward_flops, c.backward_kernels) == ("conv", 2 * 96 * 18 + 96, 2 * 96 * 18 + 96, 1)
    assert (c.gemm_k, c.gemm_n, c.winograd) == (2 * 9, 6, False)  # grouped: 2 channels x 3x3 per group, 6 columns side by side
    assert c.param_bytes == (6 * 2 * 9 + 6) * 4
    assert c.bytes_read == 4 * 64 * 4 + c.param_bytes
    assert c.bytes_written == c.activation_bytes == 96 * 4


def test_conv_after_a_trained_node_computes_both_gradients_and_is_winograd_shaped():
    nodes = [helper.make_node("Mul", ["x", "scale"], ["r"], name="scale"),  # a trained scale upstream: r needs a gradient
             helper.make_node("Conv", ["r", "W"], ["y"], name="conv", pads=[1, 1, 1, 1])]
    _, costs = _one(nodes, [("x", [2, 4, 8, 8])], ["y"], {"W": _zeros(6, 4, 3, 3), "scale": np.ones((4, 1, 1), np.float32)})
    assert costs.nodes["scale"].backward_kernels == 1
    c = costs.nodes["conv"]
    assert (c.backward_flops, c.backward_kernels) == (2 * c.flops, 2)
    assert (c.gemm_k, c.gemm_n, c.winograd) == (4 * 9, 6, True)


def test_depthwise_conv_has_no_gemm_shape():
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="dw", group=4, pads=[1, 1, 1, 1])
    _, costs = _one([node], [("x", [1, 4, 8, 8])], ["y"], {"W": _zeros(4, 1, 3, 3)})
    assert (costs.nodes["dw"].gemm_k, costs.nodes["dw"].gemm_n, costs.nodes["dw"].winograd) == (0, 0, False)


def test_batch_norm_reads_its_input_twice_in_training():
    # statistics pass + normalize pass: 2 x 512 B of input (+ 4 vectors of 4 floats); backward dY + 2 x that
    node = helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y"], name="bn")
    vec = np.ones(4, np.float32)
    _, costs = _one([node], [("x", [2, 4, 4, 4])], ["y"], {"s": vec, "b": vec, "m": vec, "v": vec})
    c = costs.nodes["bn"]
    assert c.bytes_read == 2 * 512 + 4 * 16
    assert c.backward_bytes == 512 + 2 * c.bytes_read


def test_conv_dilations_shrink_the_output():
    # dilation 2 on a 3x3 kernel spans 5: out spatial 8-4 = 4
    node = helper.make_node("Conv", ["x", "W"], ["y"], name="conv", dilations=[2, 2])
    _, costs = _one([node], [("x", [1, 4, 8, 8])], ["y"], {"W": _zeros(6, 4, 3, 3)})
    assert costs.nodes["conv"].flops == 2 * (6 * 4 * 4) * (4 * 9)


def test_conv_transpose_counts_scattered_inputs():
    # every input element (4x5x5) feeds C_out 3 x 3x3 outputs
    node = helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="deconv", strides=[2, 2])
    graph, costs = _one([node], [("x", [1, 4, 5, 5])], ["y"], {"W": _zeros(4, 3, 3, 3)})
    assert graph.tensors["y"].shape == (1, 3, 11, 11)
    assert costs.nodes["deconv"].flops == 2 * 100 * 27


def test_matmul_batched_broadcast():
    # (2,1,3,4) @ (5,4,6) -> (2,5,3,6): 180 dot products of length 4
    node = helper.make_node("MatMul", ["a", "W"], ["y"], name="mm")
    _, costs = _one([node], [("a", [2, 1, 3, 4])], ["y"], {"W": _zeros(5, 4, 6)})
    c = costs.nodes["mm"]
    assert c.flops == 2 * 180 * 4
    assert (c.bytes_read, c.bytes_written, c.param_bytes) == (96 + 480, 720, 480)
    assert c.backward_bytes == 720 + 2 * (96 + 480)


@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm_transposes_and_bias(trans_a):
    a_shape = [4, 3] if trans_a else [3, 4]
    node = helper.make_node("Gemm", ["a", "W", "C"], ["y"], name="gemm", transA=trans_a, transB=1, alpha=0.5)
    _, costs = _one([node], [("a", a_shape)], ["y"], {"W": _zeros(5, 4), "C": _zeros(5)})
    assert costs.nodes["gemm"].flops == 2 * 15 * 4 + 15


@pytest.mark.parametrize(
    ("equation", "shapes", "expected"),
    [
        ("bij,bjk->bik", ([2, 3, 4], [2, 4, 5]), 2 * (2 * 3 * 4 * 5)),
        ("...ij,jk->...ik", ([2, 3, 4], [4, 5]), 2 * (2 * 3 * 4 * 5)),
        ("ii->i", ([6, 6],), 6),
    ],
)
def test_einsum_counts_every_index(equation, shapes, expected):
    names = [f"x{i}" for i in range(len(shapes))]
    node = helper.make_node("Einsum", names, ["y"], name="ein", equation=equation)
    _, costs = _one([node], list(zip(names, shapes)), ["y"])
    assert costs.nodes["ein"].flops == expected


def test_lstm_times_sequence_and_gates():
    # per step: 4 gates x 4 hidden over [x(3), h(4)] + 9 cell ops x 4 + 2 biases x 16; 5 steps, batch 2
    node = helper.make_node("LSTM", ["x", "W", "R", "B"], ["y", "h"], name="lstm", hidden_size=4)
    _, costs = _one([node], [("x", [5, 2, 3])], ["y", "h"], {"W": _zeros(1, 16, 3), "R": _zeros(1, 16, 4), "B": _zeros(1, 32)})
    c = costs.nodes["lstm"]
    assert (c.op_class, c.flops) == ("rnn", 5 * 2 * (2 * 16 * 7 + 9 * 4 + 2 * 16))
    assert c.backward_flops == 2 * c.flops


def test_bidirectional_gru_batch_first():
    node = helper.make_node("GRU", ["x", "W", "R"], ["y"], name="gru", hidden_size=4, direction="bidirectional", layout=1)
    _, costs = _one([node], [("x", [2, 5, 3])], ["y"], {"W": _zeros(2, 12, 3), "R": _zeros(2, 12, 4)})
    assert costs.nodes["gru"].flops == 2 * 5 * 2 * (2 * 12 * 7 + 7 * 4)


def test_pools():
    nodes = [
        helper.make_node("MaxPool", ["x"], ["m"], name="max", kernel_shape=[3, 3]),
        helper.make_node("AveragePool", ["x"], ["a"], name="avg", kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("GlobalAveragePool", ["x"], ["g"], name="gap"),
    ]
    _, costs = _one(nodes, [("x", [1, 2, 6, 6])], ["m", "a", "g"])
    flops = {n: c.flops for n, c in costs.nodes.items()}
    assert flops == {"max": 32 * 9, "avg": 18 * 4, "gap": 72}
    assert {c.op_class for c in costs.nodes.values()} == {"pool"}


def test_norms_softmax_reduce_elementwise_data():
    nodes = [
        helper.make_node("LayerNormalization", ["x", "s", "b"], ["ln"], name="ln", axis=-1),
        helper.make_node("Softmax", ["ln"], ["sm"], name="sm", axis=-1),
        helper.make_node("Erf", ["sm"], ["e"], name="erf"),
        helper.make_node("Add", ["e", "b"], ["ad"], name="add"),
        helper.make_node("ReduceSum", ["ad"], ["r"], name="sum", keepdims=0),
        helper.make_node("Reshape", ["ad", "shape"], ["flat"], name="reshape"),
    ]
    # a bias of distinct values: a tie (one tensor, two readers), not an exporter's merge of equal constants
    inits = {"s": _zeros(4), "b": np.arange(4, dtype=np.float32), "shape": np.array([6, 4], np.int64)}
    _, costs = _one(nodes, [("x", [2, 3, 4])], ["r", "flat"], inits)
    c = costs.nodes
    assert (c["ln"].flops, c["ln"].backward_flops, c["ln"].op_class) == (24 * 8, 2 * 24 * 8, "norm")
    assert (c["sm"].flops, c["sm"].backward_flops) == (24 * 5, 2 * 24 * 5)
    assert (c["erf"].flops, c["add"].flops, c["add"].backward_flops) == (24 * 4, 24, 24)
    assert (c["sum"].flops, c["sum"].op_class) == (24, "reduce")
    reshape = c["reshape"]
    # the int64 shape table is free to read; the gradient is only moved back
    assert (reshape.flops, reshape.op_class, reshape.bytes_read) == (0, "data", 96)
    assert (reshape.backward_flops, reshape.backward_bytes) == (0, 96 + 96)
    # the bias is read by LayerNormalization first: Add reads it but does not own it
    assert (c["ln"].param_bytes, c["add"].param_bytes) == (32, 0)


def test_unknown_op_gets_a_bytes_only_estimate():
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Det", ["r"], ["d"], name="det")]
    _, costs = _one(nodes, [("x", [2, 3, 3])], ["d"])
    det = costs.nodes["det"]
    assert (det.known, det.flops, det.op_class, det.bytes_read, det.bytes_written) == (False, 0, "other", 72, 8)
    assert costs.unknown_ops == ("Det",)
    assert costs.nodes["relu"].known


def test_tied_weight_counts_once_even_through_a_folded_transpose():
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"], name="first"),
        helper.make_node("Transpose", ["W"], ["Wt"], name="fold", perm=[1, 0]),
        helper.make_node("MatMul", ["h", "Wt"], ["y"], name="second"),
        helper.make_node("Transpose", ["V"], ["Vt"], name="fold_v", perm=[1, 0]),
        helper.make_node("MatMul", ["y", "Vt"], ["z"], name="third"),
    ]
    # W of distinct values: a tie, not an exporter's merge of equal constants (those are untied on load)
    graph, costs = _one(nodes, [("x", [2, 4])], ["z"], {"W": np.arange(16, dtype=np.float32).reshape(4, 4), "V": _zeros(4, 4)})
    assert "fold" not in costs.nodes and "fold" in graph.constant_nodes
    owned = {n: c.param_bytes for n, c in costs.nodes.items()}
    assert owned == {"first": 64, "second": 0, "third": 64}
    assert costs.nodes["second"].bytes_read == 32 + 64  # every reader still reads the weight
    assert summarize(costs)[1]["params_bytes"] == 128


def _loop_model(trip_count_input: bool):
    body = helper.make_graph(
        [helper.make_node("MatMul", ["h", "W"], ["h2"], name="body_mm"), helper.make_node("Identity", ["c"], ["c2"], name="body_cond")],
        "body",
        [helper.make_tensor_value_info("i", TensorProto.INT64, []), helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("h", F, None)],
        [helper.make_tensor_value_info("c2", TensorProto.BOOL, []), helper.make_tensor_value_info("h2", F, None)],
    )
    inits = {"W": _zeros(4, 4), "T": np.array(True)}
    inputs = [helper.make_tensor_value_info("x", F, [2, 4])]
    if trip_count_input:
        inputs.append(helper.make_tensor_value_info("M", TensorProto.INT64, []))
    else:
        inits["M"] = np.array(3, np.int64)
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"], name="relu"), helper.make_node("Loop", ["M", "T", "r"], ["y"], name="loop", body=body)],
        "g", inputs, [helper.make_empty_tensor_value_info("y")], [numpy_helper.from_array(np.asarray(v), k) for k, v in inits.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


def test_loop_costs_its_body_times_a_constant_trip_count():
    graph = load(_loop_model(trip_count_input=False))
    loop = annotate(graph).nodes["loop"]
    assert (loop.flops, loop.backward_flops, loop.known) == (3 * 2 * 8 * 4, 3 * 2 * 2 * 8 * 4, True)
    assert loop.param_bytes == 64  # the captured weight


def test_loop_with_unknown_trip_count_counts_once_and_is_flagged():
    costs = annotate(load(_loop_model(trip_count_input=True)))
    assert (costs.nodes["loop"].flops, costs.nodes["loop"].known) == (2 * 8 * 4, False)
    assert costs.unknown_ops == ("Loop",)


def test_if_costs_its_costlier_branch():
    then = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["t"], name="then_mm")], "then", [], [helper.make_empty_tensor_value_info("t")])
    other = helper.make_graph([helper.make_node("Add", ["x", "x"], ["e"], name="else_add")], "else", [], [helper.make_empty_tensor_value_info("e")])
    nodes = [helper.make_node("ReduceSum", ["x"], ["s"], name="sum", keepdims=0),
             helper.make_node("Greater", ["s", "zero"], ["cond"], name="gt"),
             helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)]
    _, costs = _one(nodes, [("x", [2, 4])], ["y"], {"W": _zeros(4, 4), "zero": np.array(0, np.float32)})
    assert costs.nodes["branch"].flops == 2 * 8 * 4


# --- published figures -------------------------------------------------------


@pytest.fixture(scope="module")
def full_size(tmp_path_factory):
    """Costs read shapes alone: the models are built with sparse weights (`models.build_sparse`), not drawn."""
    from onnxpipe import models

    folder = tmp_path_factory.mktemp("full-size")
    graphs = {name: load(models.build_sparse(name, folder / f"{name}.onnx")[0]) for name in ("resnet50", "vgg16")}
    return {name: (graph, annotate(graph)) for name, graph in graphs.items()}


@pytest.mark.parametrize(("name", "macs", "params"), [("resnet50", 4.1e9, 25.6e6), ("vgg16", 15.5e9, 138.4e6)])
def test_published_figures(full_size, name, macs, params):
    graph, costs = full_size[name]
    rows, totals = summarize(costs)
    assert totals["flops"] / 2 == pytest.approx(macs, rel=0.05)
    assert totals["params_bytes"] / 4 == pytest.approx(params, rel=0.01)
    assert rows[0].op_type == "Conv" and rows[0].flops_share > 0.95
    # every conv and matmul computes two gradients but the first, fed by the image: its weight gradient only
    first = next(r for r in rows if r.op_type == "Conv")
    first_flops = next(costs.nodes[n].flops for n in graph.compute_nodes if costs.nodes[n].op_type == "Conv")
    assert totals["backward_flops"] == pytest.approx(2 * totals["flops"] - first_flops, rel=0.02)
    assert first.backward_flops < 2 * first.flops


# --- measured mode and the round trip ----------------------------------------


def _small_model():
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="fc1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="bias1"),
        helper.make_node("Relu", ["hb"], ["a"], name="relu"),
        helper.make_node("Reshape", ["a", "shape"], ["r"], name="reshape"),
        helper.make_node("MatMul", ["r", "W2"], ["y"], name="fc2"),
        helper.make_node("Softmax", ["y"], ["p"], name="softmax", axis=-1),
    ]
    inits = {"W1": np.full((16, 32), 0.1, np.float32), "b1": _zeros(32), "shape": np.array([8, 32], np.int64), "W2": np.full((32, 8), 0.1, np.float32)}
    return _model(nodes, [("x", [8, 16])], ["p"], inits)


@pytest.fixture(scope="module")
def profiled():
    graph = load(_small_model())
    return graph, annotate(graph, profile=True, runs=3, warmup=1)


def test_profile_measures_every_compute_node(profiled):
    graph, costs = profiled
    assert costs.profiled and set(costs.nodes) == set(graph.compute_nodes)
    for name, cost in costs.nodes.items():
        assert cost.measured_seconds > 0 and cost.measured_backward_seconds > 0 and cost.measured_inference_seconds > 0, name
    totals = summarize(costs)[1]
    assert totals["measured_seconds"] == pytest.approx(sum(c.measured_seconds for c in costs.nodes.values()))


def test_annotated_model_round_trips(profiled, tmp_path):
    graph, costs = profiled
    assert read_annotated(graph) is None
    path = tmp_path / "annotated.onnx"
    write_annotated(graph, costs, path)
    onnx.checker.check_model(str(path), full_check=True)
    again = read_annotated(load(path))
    assert again == costs
    props = {p.key: p.value for p in onnx.load(str(path)).graph.node[0].metadata_props}
    assert props["onnxpipe.op_class"] == "matmul" and float(props["onnxpipe.flops"]) == 2 * 8 * 32 * 16
    assert [p.name for p in tmp_path.iterdir()] == ["annotated.onnx"]


def test_large_models_keep_weights_beside_the_annotated_file(profiled, tmp_path, monkeypatch):
    import onnxpipe.cost

    graph, costs = profiled
    monkeypatch.setattr(onnxpipe.cost, "_EXTERNAL_DATA_BYTES", 1)
    path = tmp_path / "big.onnx"
    write_annotated(graph, costs, path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.onnx", "big.onnx.data"]
    again = load(path)
    assert read_annotated(again) == costs
    assert np.array_equal(numpy_helper.to_array(next(t for t in again.model.graph.initializer if t.name == "W1")), np.full((16, 32), 0.1, np.float32))


# --- command line --------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "onnxpipe", "annotate", *args], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})


def test_cli_annotate_writes_model_and_json(tmp_path):
    model = _small_model()
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    model.graph.node[3].input[1] = "shape_dyn"
    model.graph.node.insert(3, helper.make_node("Shape", ["hb"], ["shape_dyn"], name="shape_of"))
    src, out, summary = tmp_path / "m.onnx", tmp_path / "out.onnx", tmp_path / "costs.json"
    onnx.save(model, str(src))
    run = _cli(str(src), "-o", str(out), "--json", str(summary), "--dim", "batch=4")
    assert run.returncode == 0, run.stderr
    assert "total: 6 nodes" in run.stdout and "warning" not in run.stderr  # Shape of a bound activation: folded
    data = json.loads(summary.read_text())
    assert set(data) >= {"totals", "op_types", "unknown_ops", "nodes"}
    assert set(data["totals"]) >= {"flops", "params_bytes", "activation_bytes", "nodes"}
    expected = summarize(annotate(load(model, {"batch": 4})))[1]
    assert data["totals"]["flops"] == expected["flops"] == 2 * 4 * 32 * 16 + 4 * 32 + 4 * 32 + 2 * 4 * 32 * 8 + 5 * 4 * 8
    assert read_annotated(load(out)) is not None


def test_cli_annotate_rejects_a_bad_dim_in_one_line(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_small_model(), str(src))
    run = _cli(str(src), "--dim", "batch=4")
    assert run.returncode == 2
    assert "names no symbolic dim" in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("name, knobs, op", [("gnmt-tiny", {}, "LSTM"), ("resnet-tiny", {"batchnorm": True}, "BatchNormalization")])
def test_profile_times_the_backward_of_ops_training_rewrites(name, knobs, op):
    """LSTM and BatchNormalization train only after onnxruntime's rewrites; the profile times them as
    training runs them (the LSTM gradient costs several forwards), not by the FLOP ratio."""
    from onnxpipe.models import build

    graph = load(build(name, train=True, **knobs))
    # Five runs, the default: an LSTM's forward takes 50-100 us, and a busy machine may stop one run's for milliseconds; the
    # median of two then reads it slower than the backward (5 of 60 tries beside three busy loops; none of 60 with five).
    costs = annotate(graph, profile=True, runs=5, warmup=1)
    rewritten = [c for n, c in costs.nodes.items() if graph.node(n).op_type == op]
    assert rewritten and all(c.measured_backward_seconds is not None and c.measured_backward_seconds > 0 for c in rewritten)
    if op == "LSTM":
        assert all(c.measured_backward_seconds > 2 * c.measured_seconds for c in rewritten)


def test_profile_times_the_backward_of_a_dynamo_export_as_training_builds_it() -> None:
    """torch.onnx's dynamo exporter writes LayerNormalization with its output alone (the gradient builder needs its Mean
    and InvStdDev) and CastLike (which has no gradient): the profile's gradient graph is built as training builds it,
    optional outputs spelled out and `rewrites` applied, so it times the backward instead of guessing it by FLOPs."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="matmul"),
             helper.make_node("LayerNormalization", ["h", "gamma", "beta"], ["n"], name="norm", axis=-1),
             helper.make_node("CastLike", ["half", "n"], ["scale"], name="castlike"),
             helper.make_node("Mul", ["n", "scale"], ["y"], name="scaled"),
             helper.make_node("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0)]
    inits = [numpy_helper.from_array(rng.normal(size=(64, 64)).astype(np.float32), "w"),
             numpy_helper.from_array(np.ones(64, np.float32), "gamma"), numpy_helper.from_array(np.zeros(64, np.float32), "beta"),
             numpy_helper.from_array(np.array(0.5, np.float64), "half")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [32, 64])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    measured = profile_times(load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)), runs=2, warmup=1)
    assert all(measured.backward.get(n, 0.0) > 0 for n in ("matmul", "norm"))  # timed, not the FLOP-ratio fallback `annotate` fills in


@pytest.mark.parametrize("fixture, op", [("torch_gru.onnx", "GRU"), ("torch_unet.onnx", "ConvTranspose"), ("torch_unet.onnx", "Resize"),
                                         ("torch_unet.onnx", "InstanceNormalization")])
def test_profile_times_the_backward_of_ops_onnxpipe_writes_out(fixture: str, op: str) -> None:
    """GRU, ConvTranspose, Resize and InstanceNormalization train as the ops `onnxpipe.rewrites` writes in their place,
    named `<node>/onnxpipe_<rewrite>/...`: their gradient nodes' times are summed under the node they replace."""
    graph = load(Path(__file__).parent / "data" / fixture, {"batch": 4})
    measured = profile_times(graph, runs=2, warmup=1)
    nodes = [n for n in graph.compute_nodes if graph.node(n).op_type == op]
    assert nodes and all(measured.backward.get(n, 0.0) > 0 for n in nodes)


def test_every_weight_counts_at_its_real_bytes() -> None:
    """An int8 weight behind DequantizeLinear counts its 64 KiB (as stored), and a weight a ConstantOfShape
    makes from a shape vector counts its 128 KiB; the shape vector itself is no weight."""
    inits = [numpy_helper.from_array(np.ones((256, 256), np.int8), "w8"), numpy_helper.from_array(np.array(0.1, np.float32), "s"),
             numpy_helper.from_array(np.array(0, np.int8), "zp"), numpy_helper.from_array(np.array([256, 128], np.int64), "shape")]
    nodes = [helper.make_node("DequantizeLinear", ["w8", "s", "zp"], ["w"], name="deq"),
             helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("ConstantOfShape", ["shape"], ["w2"], name="fill", value=numpy_helper.from_array(np.array([0.01], np.float32))),
             helper.make_node("MatMul", ["h", "w2"], ["y"], name="mm2")]
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 256])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 128])], inits)
    costs = annotate(load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)))
    assert {name: c.param_bytes for name, c in costs.nodes.items()} == {"mm": 256 * 256, "mm2": 256 * 128 * 4}


def test_profiling_refuses_a_model_larger_than_memory_before_allocating() -> None:
    """The bytes a profile run needs (inputs, weights, every activation) are checked against the memory given:
    a run that fits passes, one that does not names the bound dim that sets it and the ways out."""
    from onnxpipe.cost_profile import ensure_fits_in_memory

    vi = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.ones((16, 16), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["y"])], "g",
                              [vi("x", TensorProto.FLOAT, ["batch", 16])], [vi("y", TensorProto.FLOAT, ["batch", 16])], [w])
    g = load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), {"batch": 1000})
    needed = 3 * 1000 * 16 * 4 + 16 * 16 * 4  # x, h, y and the weight
    ensure_fits_in_memory(g, needed)
    with pytest.raises(OnnxpipeError, match=r"needs 188 KiB \(inputs 62.5 KiB, weights 1 KiB, activations 125 KiB\) but 94.\d KiB are available: "
                                            r"dim 'batch' = 1000 sets most of it; bind a smaller one with --dim batch=N or a smaller --batch"):
        ensure_fits_in_memory(g, needed // 2)


def _conv_relu_softmax() -> onnx.ModelProto:
    """A convolution with its activation (one fused kernel in an optimized session), then a Softmax (a kernel of its own)."""
    nodes = [
        helper.make_node("Conv", ["x", "w", "b"], ["c"], name="conv", pads=[1, 1, 1, 1]),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("Softmax", ["r"], ["p"], name="softmax", axis=-1),
    ]
    rng = np.random.default_rng(0)
    inits = {"w": rng.standard_normal((16, 8, 3, 3)).astype(np.float32), "b": _zeros(16)}
    return _model(nodes, [("x", [2, 8, 16, 16])], ["p"], inits)


def test_a_fused_kernel_is_shared_over_the_nodes_it_replaced(tmp_path):
    from onnxpipe.cost_profile import fused_shares, kernel_fusion, kernel_ops, trace_medians
    from onnxpipe.ortutil import cpu_session

    graph = load(_conv_relu_softmax())
    session = cpu_session(graph.model.SerializeToString(), threads=1, profile_prefix=str(tmp_path / "optimized"))
    for _ in range(4):
        session.run(None, {"x": np.ones((2, 8, 16, 16), np.float32)})
    with open(session.end_profiling()) as f:
        events = json.load(f)
    kernels, ops = trace_medians(events, 1), kernel_ops(events)
    # onnxruntime ran the convolution and its Relu as one kernel, named after one of them or its output ("r_nchwc").
    fused = [k for k in kernels if ops[k] != "Softmax" and not ops[k].startswith("Reorder")]
    assert len(fused) == 1 and ops[fused[0]] in ("Conv", "FusedConv") and fused[0].startswith(("conv", "relu", "c_", "r_")), (fused, ops)
    shares = fused_shares(graph, {"conv": 3e-3, "relu": 1e-3, "softmax": 1e-3}, kernel_fusion(graph, kernels, ops))
    # The fused kernel's time goes to both nodes (3:1 as they ran apart), the Softmax keeps its own kernel's;
    # kernels of no node (layout reorders) are shared over all in proportion, and nothing is lost.
    assert shares["conv"] == pytest.approx(3 * shares["relu"])
    assert (shares["conv"] + shares["relu"]) / shares["softmax"] == pytest.approx(kernels[fused[0]] / kernels["softmax"])
    assert sum(shares.values()) == pytest.approx(sum(kernels.values()))


def test_fused_shares_follow_the_fusion_rules():
    from onnxpipe.cost_profile import fused_shares, kernel_fusion

    graph = load(_conv_relu_softmax())
    unfused = {"conv": 3e-3, "relu": 1e-3, "softmax": 2e-3}
    # Renamed with a suffix, the Conv into the Relu's kernel; the Softmax untouched.
    shares = fused_shares(graph, unfused, kernel_fusion(graph, {"relu_nchwc": 2e-3, "softmax": 1e-3}, {"relu_nchwc": "Conv", "softmax": "Softmax"}))
    assert shares == pytest.approx({"conv": 1.5e-3, "relu": 0.5e-3, "softmax": 1e-3})
    # A convolution joins only a kernel whose op names its op: the Relu kept as it was takes nothing, and the
    # time of a kernel named after no node goes to the nodes left.
    shares = fused_shares(graph, unfused, kernel_fusion(graph, {"relu": 1e-4, "softmax": 1e-3, "QLinearConv_token_3": 4e-3}, {"relu": "Relu", "softmax": "Softmax",
                                                                                                      "QLinearConv_token_3": "QLinearConv"}))
    assert shares == pytest.approx({"conv": 4e-3, "relu": 1e-4, "softmax": 1e-3})
    # Nothing of the model's: every kernel's time over every node, in proportion to its unoptimized time.
    shares = fused_shares(graph, unfused, kernel_fusion(graph, {"FusedThing": 6e-3}, {"FusedThing": "Fused"}))
    assert shares == pytest.approx({"conv": 3e-3, "relu": 1e-3, "softmax": 2e-3})


def _trace(kernels: dict[str, tuple[str, float]]) -> list[dict]:
    """One profiled run of the named kernels ({name: (op, microseconds)}), back to back, in onnxruntime's trace form."""
    events, ts = [], 100
    for name, (op, us) in kernels.items():
        events.append({"cat": "Node", "name": f"{name}_kernel_time", "ts": ts, "dur": us, "args": {"op_name": op}})
        ts += us
    return [{"cat": "Session", "name": "model_run", "ts": 100, "dur": ts - 100}, *events]


def test_the_optimized_run_prices_inference_only(monkeypatch):
    from onnxpipe import cost_profile

    traces = {
        "forward": _trace({"conv": ("Conv", 300), "relu": ("Relu", 100), "softmax": ("Softmax", 100)}),
        "inference": _trace({"r_nchwc": ("Conv", 200), "softmax": ("Softmax", 100)}),
        "probe": _trace({"ReorderInput": ("ReorderInput", 40), "probe_nchwc": ("Conv", 300), "ReorderOutput": ("ReorderOutput", 80)}),
        "backward": _trace({"conv": ("Conv", 330), "relu": ("Relu", 110), "softmax": ("Softmax", 120), "conv_Grad/ConvGrad_0": ("ConvGrad", 600),
                            "relu_Grad/ReluGrad_0": ("ReluGrad", 50), "softmax_Grad/SoftmaxGrad_0": ("SoftmaxGrad", 80)}),
    }
    graph = load(_conv_relu_softmax())
    monkeypatch.setattr(cost_profile, "_profile", lambda model, feeds, tmp, tag, *args, **kw: traces[tag])
    measured = cost_profile.profile_times(graph, runs=1, warmup=0)
    forward, backward, inference = measured.forward, measured.backward, measured.inference
    # Training's figures come from the unoptimized and gradient runs alone (the gradient graph's form of each forward).
    assert forward == pytest.approx({"conv": 330e-6, "relu": 110e-6, "softmax": 120e-6})
    assert backward == pytest.approx({"conv": 600e-6, "relu": 50e-6, "softmax": 80e-6})
    # Inference's: the fused Conv+Relu kernel over both, 3:1 as the unoptimized run had them.
    assert inference == pytest.approx({"conv": 150e-6, "relu": 50e-6, "softmax": 100e-6})
    # The optimized run computed both in the blocked layout; a probe of the model's largest blocked tensor (c, r: [2, 16, 16, 16]) gives the host's rates.
    assert measured.nchwc == {"conv", "relu"}
    assert measured.reorder is not None
    assert (measured.reorder.into_blocks, measured.reorder.out_of_blocks) == pytest.approx((2 * 16 * 16 * 16 * 4 / 40e-6, 2 * 16 * 16 * 16 * 4 / 80e-6))
    traces["inference"] = []  # onnxruntime could not optimize it: training's figures unchanged, no inference ones, no layout
    assert cost_profile.profile_times(graph, runs=1, warmup=0) == cost_profile.Profile(forward, backward, {})


def test_the_blocked_layout_is_read_off_the_optimized_kernels():
    from onnxpipe.cost_profile import kernel_fusion, nchwc_nodes

    graph = load(_conv_relu_softmax())
    # The Relu fused into the convolution's blocked kernel: both ran blocked; the Softmax, a plain kernel, did not.
    assert nchwc_nodes(kernel_fusion(graph, {"r_nchwc": 2e-3, "softmax": 1e-3}, {"r_nchwc": "Conv", "softmax": "Softmax"})) == {"conv", "relu"}
    # The same fusion in the plain layout, and a blocked kernel named after no node: nothing ran blocked.
    assert nchwc_nodes(kernel_fusion(graph, {"relu": 2e-3, "softmax": 1e-3}, {"relu": "FusedConv", "softmax": "Softmax"})) == set()
    assert nchwc_nodes(kernel_fusion(graph, {"Conv_token_1_nchwc": 2e-3}, {"Conv_token_1_nchwc": "Conv"})) == set()


def test_the_reorder_probe_measures_both_reorders_here(tmp_path):
    """The probe, run as profiling runs it, reorders its tensor into blocks and back out on a host whose onnxruntime
    computes convolutions blocked (x86 with AVX2 or AVX-512); the rates come from those two kernels' times."""
    from onnxpipe.cost_layout import probe_model, reorder_rates
    from onnxpipe.ortutil import cpu_session

    shape = (2, 32, 16, 16)
    session = cpu_session(probe_model(shape).SerializeToString(), threads=1, profile_prefix=str(tmp_path / "probe"))
    for _ in range(3):
        session.run(None, {"x": np.ones(shape, np.float32)})
    with open(session.end_profiling()) as f:
        events = json.load(f)
    ops = {e["args"].get("op_name") for e in events if e.get("cat") == "Node"}
    if "ReorderInput" not in ops:
        pytest.skip("onnxruntime computes no convolution in the blocked layout on this host")
    rates = reorder_rates(events, 1, 2 * 32 * 16 * 16 * 4)
    assert rates is not None and 1e8 < rates.into_blocks < 1e12 and 1e8 < rates.out_of_blocks < 1e12
    assert reorder_rates([e for e in events if e.get("args", {}).get("op_name") != "ReorderOutput"], 1, 1) is None


def test_the_layout_and_the_reorder_rates_round_trip_through_an_annotated_model(tmp_path):
    from dataclasses import replace

    from onnxpipe.cost import with_measurements, write_summary
    from onnxpipe.cost_layout import ReorderRates

    graph = load(_conv_relu_softmax())
    times = {n: 1e-4 for n in graph.compute_nodes}
    measured = with_measurements(annotate(graph), times, times, "cpu", "profile:CPUExecutionProvider", times, blocked={"conv", "relu"},
                                 reorder=ReorderRates(1.25e10, 5.5e9))
    assert [measured.nodes[n].layout for n in ("conv", "relu", "softmax")] == ["nchwc", "nchwc", ""]
    write_annotated(graph, measured, tmp_path / "a.onnx")
    assert read_annotated(load(tmp_path / "a.onnx")) == measured
    write_annotated(graph, replace(measured, reorder=None), tmp_path / "b.onnx")
    assert read_annotated(load(tmp_path / "b.onnx")).reorder is None
    write_summary(measured, tmp_path / "costs.json")
    data = json.loads((tmp_path / "costs.json").read_text())
    assert data["reorder"] == {"into_blocks": 1.25e10, "out_of_blocks": 5.5e9} and data["nodes"]["relu"]["layout"] == "nchwc"
