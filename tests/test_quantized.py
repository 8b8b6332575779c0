"""Quantized models priced as they run: int8 kernels (QDQ patterns and the integer ops) at the device's int8 rate
reading int8 operands, QuantizeLinear/DequantizeLinear as memory-bound elementwise nodes, int8 stage boundaries
sending int8 bytes, a boundary on a dequantized tensor priced at its float size and its int8 readers beyond it at the
float rate, noted, and a device without an int8 rate falling back to float32, noted."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.cost import annotate, read_annotated, write_annotated
from onnxpipe.graph import load
from onnxpipe.pricing.timemodel import node_seconds
from onnxpipe.split import plan_cuts
from onnxpipe.target import load_target

F, I8, U8, I32 = TensorProto.FLOAT, TensorProto.INT8, TensorProto.UINT8, TensorProto.INT32
FPGA = load_target("fpga4").devices[0]


def _model(nodes, inputs, output, inits):
    graph = helper.make_graph(nodes, "q", [helper.make_tensor_value_info(n, t, s) for n, t, s in inputs],
                              [helper.make_empty_tensor_value_info(output)], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _scales(**extra: np.ndarray) -> dict[str, np.ndarray]:
    return {"s": np.array(0.05, np.float32), "z": np.array(0, np.int8), **extra}


def _qdq_chain() -> onnx.ModelProto:
    """x -> Q -> DQ -> MatMul(DQ(W1)) -> Q -> DQ -> MatMul(DQ(W2)) -> y: two QDQ matmuls of [8, 64] activations."""
    rng = np.random.default_rng(0)
    inits = _scales(W1=rng.integers(-100, 100, (64, 64)).astype(np.int8), W2=rng.integers(-100, 100, (64, 32)).astype(np.int8))
    nodes = [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["xq"], name="qx"),
             helper.make_node("DequantizeLinear", ["xq", "s", "z"], ["xd"], name="dqx"),
             helper.make_node("DequantizeLinear", ["W1", "s", "z"], ["w1"], name="dqw1"),
             helper.make_node("MatMul", ["xd", "w1"], ["h"], name="mm1"),
             helper.make_node("QuantizeLinear", ["h", "s", "z"], ["hq"], name="qh"),
             helper.make_node("DequantizeLinear", ["hq", "s", "z"], ["hd"], name="dqh"),
             helper.make_node("DequantizeLinear", ["W2", "s", "z"], ["w2"], name="dqw2"),
             helper.make_node("MatMul", ["hd", "w2"], ["y"], name="mm2")]
    return _model(nodes, [("x", F, [8, 64])], "y", inits)


def test_a_qdq_matmul_runs_at_the_int8_rate_reading_int8_operands() -> None:
    costs = annotate(load(_qdq_chain()))
    mm = costs.nodes["mm1"]
    assert (mm.op_class, mm.dtype, mm.flops) == ("matmul", "int8", 2 * 8 * 64 * 64)
    # The fused kernel reads the int8 activation and the int8 weight, not their float copies.
    assert mm.bytes_read == 8 * 64 + 64 * 64
    assert mm.param_bytes == 64 * 64
    peak = FPGA.peak_flops["int8"] * FPGA.efficiency["matmul"]
    memory = (mm.bytes_read + mm.bytes_written) / FPGA.memory_bandwidth
    assert node_seconds(FPGA, mm) == pytest.approx(max(mm.flops / peak, memory) + FPGA.op_overhead)
    assert FPGA.peak_flops["int8"] > 20 * FPGA.peak_flops["float32"]  # fpga4.toml: 24.5 TOP/s against 1.08 TFLOP/s


def test_quantize_and_dequantize_are_memory_bound_elementwise_nodes() -> None:
    costs = annotate(load(_qdq_chain()))
    for name, read, written in (("qx", 8 * 64 * 4, 8 * 64), ("dqh", 8 * 64, 8 * 64 * 4)):
        c = costs.nodes[name]
        assert (c.op_class, c.dtype, c.flops) == ("elementwise", "", 2 * 8 * 64)
        assert (c.bytes_read - 4, c.bytes_written) == (read, written)  # the float scale is read too
        memory = (c.bytes_read + c.bytes_written) / FPGA.memory_bandwidth
        assert memory > c.flops / (FPGA.peak_flops["float32"] * FPGA.efficiency["default"])
        assert node_seconds(FPGA, c) == pytest.approx(memory + FPGA.op_overhead)
    assert "dqw1" not in costs.nodes  # a weight's DequantizeLinear is a constant chain, copied into its stage


def test_a_weight_only_quantized_matmul_stays_float() -> None:
    """Float activations against a dequantized int8 weight: the kernel multiplies floats."""
    nodes = [helper.make_node("DequantizeLinear", ["W", "s", "z"], ["w"], name="dqw"), helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")]
    costs = annotate(load(_model(nodes, [("x", F, [8, 64])], "y", _scales(W=np.ones((64, 16), np.int8)))))
    assert costs.nodes["mm"].dtype == ""
    assert costs.nodes["mm"].bytes_read == 8 * 64 * 4 + 64 * 16 * 4


@pytest.mark.parametrize("op, inputs, weight, flops, read", [
    # QLinearConv: x, x_scale, x_zp, w, w_scale, w_zp, y_scale, y_zp, bias; out [1, 8, 6, 6] x 4 x 3 x 3 MACs + bias
    ("QLinearConv", ["x", "s", "zu", "W", "s", "z", "s", "zu", "B"], np.ones((8, 4, 3, 3), np.int8),
     2 * 288 * 36 + 288, 4 * 64 + 8 * 36 + 8 * 4 + 3 * 4),  # x, W, the int32 bias and three float scales
    # ConvInteger: x, w, x_zp (no bias: its third input is a zero point)
    ("ConvInteger", ["x", "W", "zu"], np.ones((8, 4, 3, 3), np.uint8), 2 * 288 * 36, 4 * 64 + 8 * 36),
])
def test_integer_convolutions_run_at_the_int8_rate(op, inputs, weight, flops, read) -> None:
    node = helper.make_node(op, inputs, ["y"], name="conv", kernel_shape=[3, 3])
    inits = _scales(zu=np.array(0, np.uint8), W=weight, B=np.zeros(8, np.int32))
    c = annotate(load(_model([node], [("x", U8, [1, 4, 8, 8])], "y", {k: v for k, v in inits.items() if k in inputs}))).nodes["conv"]
    assert (c.op_class, c.dtype, c.flops, c.gemm_k, c.gemm_n, c.winograd) == ("conv", "int8", flops, 36, 8, False)
    assert c.bytes_read == read


@pytest.mark.parametrize("op, inputs, scales", [("QLinearMatMul", ["a", "s", "zu", "W", "s", "zu", "s", "zu"], 3), ("MatMulInteger", ["a", "W", "zu", "zu"], 0)])
def test_integer_matmuls_run_at_the_int8_rate(op, inputs, scales) -> None:
    node = helper.make_node(op, inputs, ["y"], name="mm")
    inits = {k: v for k, v in _scales(zu=np.array(0, np.uint8), W=np.ones((32, 16), np.uint8)).items() if k in inputs}
    c = annotate(load(_model([node], [("a", U8, [4, 32])], "y", inits))).nodes["mm"]
    assert (c.op_class, c.dtype, c.flops, c.gemm_k, c.gemm_n) == ("matmul", "int8", 2 * 4 * 16 * 32, 32, 16)
    assert c.bytes_read == 4 * 32 + 32 * 16 + 4 * scales and c.param_bytes == 32 * 16


def test_the_kernel_dtype_round_trips_through_an_annotated_model(tmp_path) -> None:
    graph = load(_qdq_chain())
    write_annotated(graph, annotate(graph), tmp_path / "a.onnx")
    stored = read_annotated(load(tmp_path / "a.onnx"))
    assert stored is not None and stored.nodes["mm1"].dtype == "int8" and stored.nodes["qx"].dtype == ""


def test_an_int8_boundary_sends_int8_bytes_and_a_dequantized_one_its_float_size_noted() -> None:
    graph = load(_qdq_chain())
    costs, target = annotate(graph), load_target("fpga4")
    on_int8 = plan_cuts(graph, costs, target, ["hq"], mode="inference")
    on_float = plan_cuts(graph, costs, target, ["hd"], mode="inference")
    assert on_int8.stages[0].comm_out_bytes == 8 * 64
    assert on_float.stages[0].comm_out_bytes == 8 * 64 * 4
    assert on_float.stages[0].comm_out_seconds > on_int8.stages[0].comm_out_seconds
    assert on_int8.notes == ()
    assert len(on_float.notes) == 1 and "'hd'" in on_float.notes[0] and "'hq'" in on_float.notes[0] and "float size" in on_float.notes[0]


@pytest.mark.parametrize("mode", ["inference", "training"])
def test_an_int8_kernel_cut_off_from_its_dequantizelinear_is_priced_at_the_float_rate(mode: str) -> None:
    """Its stage file reads the float tensor as an input: nothing fuses it with its DequantizeLinear, it runs as a float kernel."""
    from dataclasses import replace

    graph = load(_qdq_chain())
    costs, target = annotate(graph), load_target("fpga4")
    batch = graph.batch * 1024  # enough work that the rates, not the per-node overhead, set the kernel's time
    scaled = plan_cuts(graph, costs, target, [], batch=batch, mode=mode)
    scale = batch / graph.batch

    def seconds(name: str, **changes: str) -> float:
        c = replace(costs.nodes[name], **changes)
        return node_seconds(FPGA, replace(c, flops=c.flops * scale, bytes_read=c.bytes_read * scale, bytes_written=c.bytes_written * scale))

    on_int8 = plan_cuts(graph, costs, target, ["hq"], batch=batch, mode=mode)  # dqh and mm2 in stage 1: the QDQ pattern whole
    on_float = plan_cuts(graph, costs, target, ["hd"], batch=batch, mode=mode)  # dqh in stage 0, mm2 alone in stage 1
    assert on_int8.stages[1].forward_seconds == pytest.approx(seconds("dqh") + seconds("mm2"))
    assert on_float.stages[1].forward_seconds == pytest.approx(seconds("mm2", dtype=""))
    assert seconds("mm2", dtype="") > 3 * seconds("mm2")
    assert on_float.stages[0].forward_seconds == pytest.approx(scaled.stages[0].forward_seconds - seconds("mm2"))  # the rest as before
    assert "its int8 readers beyond the cut at the float rate" in on_float.notes[0]


def test_a_device_without_an_int8_rate_prices_int8_at_float32_and_says_so() -> None:
    graph = load(_qdq_chain())
    costs, cpu = annotate(graph), load_target("cpu2")
    assert "int8" not in cpu.devices[0].peak_flops
    mm = costs.nodes["mm1"]
    assert node_seconds(cpu.devices[0], mm) == node_seconds(cpu.devices[0], mm, dtype="float32")
    noted = plan_cuts(graph, costs, cpu, ["hq"], mode="inference").notes
    assert noted == ("cpu in cpu2 lists no int8 rate: its int8 kernels are priced at float32 (add peak_flops.int8, with its source, to the target)",)
    assert plan_cuts(graph, costs, load_target("fpga4"), ["hq"], mode="inference").notes == ()


def test_a_plan_keeps_its_notes_through_json(tmp_path) -> None:
    from onnxpipe.plan import Plan

    graph = load(_qdq_chain())
    noted = plan_cuts(graph, annotate(graph), load_target("fpga4"), ["hd"], mode="inference")
    noted.save(tmp_path / "plan.json")
    assert Plan.read(tmp_path / "plan.json").notes == noted.notes != ()


def test_split_says_what_a_dequantized_cut_costs(tmp_path) -> None:
    from typer.testing import CliRunner

    from onnxpipe.cli import app

    onnx.save(_qdq_chain(), tmp_path / "q.onnx")
    result = CliRunner().invoke(app, ["split", str(tmp_path / "q.onnx"), "-t", "fpga4", "--cuts", "hd", "-o", str(tmp_path / "s")],
                                env={"COLUMNS": "400"})
    assert result.exit_code == 0, result.output
    assert "mode: inference (forward only), as the model has no loss output" in result.output
    assert "note: 'hd' (float32, 2 KiB per micro-batch) leaves stage 0 as a DequantizeLinear widened int8 'hq' (512 B)" in result.output
