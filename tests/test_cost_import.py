"""Measured times from elsewhere and on the stage's own device: the execution provider per device kind, importing
onnxruntime traces and per-block times (spread, provenance, one-line errors), the GPU time model's shape terms,
calibrating a target back from times it produced, the bundled h100x8 target, and the CLI end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from dataclasses import replace

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.calibrate import calibrate, import_for_target, units, write_target
from onnxpipe.cost import NodeCost, annotate, read_annotated, write_annotated
from onnxpipe.cost_import import import_times
from onnxpipe.cost_profile import execution_provider
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.pricing.timemodel import node_seconds, shape_factor
from onnxpipe.target import GPU_KERNELS, KernelModel, load_target


def _model():
    """Two named "blocks" (/enc/..., /dec/...) and a head node no block covers."""
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"], name="/enc/fc/MatMul"),
        helper.make_node("Relu", ["h"], ["a"], name="/enc/act/Relu"),
        helper.make_node("MatMul", ["a", "W2"], ["y"], name="/dec/fc/MatMul"),
        helper.make_node("Softmax", ["y"], ["p"], name="/head/Softmax", axis=-1),
    ]
    inits = [numpy_helper.from_array(np.full((64, 128), 0.1, np.float32), "W1"), numpy_helper.from_array(np.full((128, 32), 0.1, np.float32), "W2")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 64])],
                              [helper.make_tensor_value_info("p", TensorProto.FLOAT, [16, 32])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model


@pytest.fixture(scope="module")
def small():
    graph = load(_model())
    return graph, annotate(graph)


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text
    return text


# --- the execution provider per device kind ----------------------------------


def test_provider_follows_the_device_kind():
    assert execution_provider("gpu") == "CUDAExecutionProvider"
    assert execution_provider("cpu") == "CPUExecutionProvider"
    assert execution_provider("fpga", "VitisAIExecutionProvider") == "VitisAIExecutionProvider"
    with pytest.raises(OnnxpipeError) as exc:
        execution_provider("fpga")
    assert 'provider = "' in _one_line(exc) and "without --profile" in str(exc.value)


def test_profiling_on_a_missing_provider_fails_in_one_line_naming_the_fix(small):
    graph, _ = small
    with pytest.raises(OnnxpipeError) as exc:
        annotate(graph, profile=True, device_kind="gpu")
    text = _one_line(exc)  # this onnxruntime-training lists CUDA but cannot load it without the CUDA libraries
    assert ("has no CUDAExecutionProvider" in text or "could not start CUDAExecutionProvider" in text) and "--times" in text


def test_a_provider_this_onnxruntime_lacks_is_named(small):
    graph, _ = small
    with pytest.raises(OnnxpipeError) as exc:
        annotate(graph, profile=True, device_kind="fpga", provider="VitisAIExecutionProvider")
    assert "this onnxruntime has no VitisAIExecutionProvider (it has " in _one_line(exc)


def test_profiling_on_the_cpu_provider_records_the_device_kind(small):
    graph, _ = small
    costs = annotate(graph, profile=True, runs=2, warmup=1, device_kind="cpu")
    assert all(c.measured_on == "cpu" and c.source == "profile:CPUExecutionProvider" and c.measured_seconds > 0 for c in costs.nodes.values())


# --- onnxruntime traces ----------------------------------------------------


def _trace(names_durations, runs=3, provider="CUDAExecutionProvider", run_us=100):
    events = []
    for r in range(runs):
        start = r * 1000
        events.append({"cat": "Session", "name": "model_run", "ts": start, "dur": run_us})
        for i, (name, dur) in enumerate(names_durations):
            events.append({"cat": "Node", "name": f"{name}_kernel_time", "ts": start + 1 + i, "dur": dur, "args": {"provider": provider}})
    return events


def test_trace_import_takes_medians_maps_gradients_and_keeps_the_rest_analytic(small, tmp_path):
    graph, costs = small
    path = tmp_path / "trace.json"
    # per run: 40 + 30 us in kernels of 100 us: the 30 us between them shared out, 15 us per kernel
    path.write_text(json.dumps(_trace([("/enc/fc/MatMul", 40), ("/enc/fc/MatMul_Grad/Gemm_0", 30)])))
    out = import_times(graph, costs, path)
    fc = out.nodes["/enc/fc/MatMul"]
    assert fc.measured_seconds == pytest.approx(55e-6) and fc.measured_backward_seconds == pytest.approx(45e-6)
    assert (fc.measured_on, fc.source) == ("gpu", "import:trace.json")
    assert out.nodes["/dec/fc/MatMul"].measured_seconds is None and out.nodes["/dec/fc/MatMul"].source == ""
    device = load_target("h100x8").device("h100_0")
    assert node_seconds(device, fc) == fc.measured_seconds  # measured on a gpu: prices the gpu
    assert node_seconds(load_target("cpu2").device("cpu_0"), fc) != fc.measured_seconds  # not a cpu worker


@pytest.mark.parametrize(("events", "message"), [
    (_trace([("/enc/fc/MatMul", 40), ("/nowhere/Conv", 5)]), r"1 node name\(s\) are not compute nodes .* \(first: '/nowhere/Conv'\); profile this same model with graph optimizations off"),
    (_trace([("/enc/fc/MatMul", -4)]), r"has no valid ts/dur \(got dur=-4\)"),
    ([{"cat": "Session", "name": "model_run", "ts": 0, "dur": 5}], r"no node kernel times and model runs in this trace"),
    (_trace([("/enc/fc/MatMul", 4)], provider="MyChipExecutionProvider"), r"nodes ran on MyChipExecutionProvider.*name the target"),
])
def test_bad_traces_fail_in_one_line(small, tmp_path, events, message):
    graph, costs = small
    path = tmp_path / "trace.json"
    path.write_text(json.dumps(events))
    with pytest.raises(OnnxpipeError, match=message) as exc:
        import_times(graph, costs, path)
    _one_line(exc)


def test_a_real_onnxruntime_trace_imports(small, tmp_path):
    """A trace onnxruntime wrote itself (CPU provider, graph optimizations off) covers every node."""
    from onnxpipe.ortutil import cpu_session

    graph, costs = small
    session = cpu_session(graph.model.SerializeToString(), threads=1, optimize=False, profile_prefix=str(tmp_path / "ort"))
    for _ in range(3):
        session.run(None, {"x": np.ones((16, 64), np.float32)})
    out = import_times(graph, costs, session.end_profiling())
    assert all(c.measured_on == "cpu" and c.measured_seconds > 0 for c in out.nodes.values())


# --- block times -----------------------------------------------------------


def _blocks(tmp_path, blocks):
    path = tmp_path / "blocks.json"
    path.write_text(json.dumps({"blocks": blocks}))
    return path


def test_block_times_spread_by_analytic_time_and_round_trip(small, tmp_path):
    graph, costs = small
    target = load_target("h100x8")
    device = target.devices[0]
    path = _blocks(tmp_path, [{"block": "enc", "nodes": ["/enc/"], "fwd_ms": 2.0, "bwd_ms": 3.0},
                              {"block": "dec", "nodes": "/dec/*", "fwd_ms": 1.0, "bwd_ms": 0.0}])
    out = import_for_target(graph, costs, path, target)
    enc = ["/enc/fc/MatMul", "/enc/act/Relu"]
    assert sum(out.nodes[n].measured_seconds for n in enc) == pytest.approx(2e-3)
    assert sum(out.nodes[n].measured_backward_seconds for n in enc) == pytest.approx(3e-3)
    analytic = [node_seconds(device, costs.nodes[n]) for n in enc]
    assert out.nodes[enc[0]].measured_seconds / out.nodes[enc[1]].measured_seconds == pytest.approx(analytic[0] / analytic[1])
    assert out.nodes["/dec/fc/MatMul"].measured_backward_seconds == 0.0
    assert {out.nodes[n].source for n in enc} == {"import:blocks.json#enc"} and out.nodes["/dec/fc/MatMul"].measured_on == "gpu"
    head = out.nodes["/head/Softmax"]
    assert head.measured_seconds is None and node_seconds(device, head) == node_seconds(device, costs.nodes["/head/Softmax"])
    write_annotated(graph, out, tmp_path / "a.onnx")
    assert read_annotated(load(tmp_path / "a.onnx")) == out


def test_the_longest_pattern_wins(small, tmp_path):
    graph, costs = small
    path = _blocks(tmp_path, [{"block": "all", "nodes": ["/"], "fwd_ms": 1, "bwd_ms": 1},
                              {"block": "act", "nodes": ["/enc/act/"], "fwd_ms": 5, "bwd_ms": 5}])
    out = import_for_target(graph, costs, path, load_target("h100x8"))
    assert out.nodes["/enc/act/Relu"].measured_seconds == pytest.approx(5e-3)
    assert sum(c.measured_seconds for n, c in out.nodes.items() if n != "/enc/act/Relu") == pytest.approx(1e-3)


@pytest.mark.parametrize(("text", "message"), [
    ('{"blocks": [{"block": "enc", "nodes": ["/enc/"], "fwd_ms": 1}]}', r"blocks\[0\] \('enc'\): missing bwd_ms; give the block's forward and backward milliseconds"),
    ('{"blocks": [{"block": "enc", "nodes": ["/enc/"], "fwd_ms": -1, "bwd_ms": 1}]}', r"fwd_ms must be a number of milliseconds >= 0, got -1"),
    ('{"blocks": [{"block": "enc", "nodes": ["/encoder/"], "fwd_ms": 1, "bwd_ms": 1}]}', r"block 'enc': no compute node of .* matches '/encoder/' \(node names look like"),
    ('{"blocks": [{"block": "enc", "fwd_ms": 1, "bwd_ms": 1}]}', r"missing \"nodes\": the node-name prefixes or globs"),
    ('{"blocks": [{"block": "a", "nodes": ["/enc/"], "fwd_ms": 1, "bwd_ms": 1}, {"block": "b", "nodes": ["/enc*"], "fwd_ms": 1, "bwd_ms": 1}]}',
     r"matches blocks 'a' and 'b' equally; make one of the patterns more specific"),
    ('{"times": []}', r"not a times file; pass onnxruntime's profiling JSON .* or block times"),
    ('{"blocks": [', r"not JSON \("),
])
def test_bad_block_times_fail_in_one_line(small, tmp_path, text, message):
    graph, costs = small
    path = tmp_path / "blocks.json"
    path.write_text(text)
    with pytest.raises(OnnxpipeError, match=message) as exc:
        import_for_target(graph, costs, path, load_target("h100x8"))
    _one_line(exc)


def test_block_times_need_a_target(small, tmp_path):
    graph, costs = small
    with pytest.raises(OnnxpipeError, match=r"name the target they were measured on \(--target\)"):
        import_times(graph, costs, _blocks(tmp_path, [{"block": "enc", "nodes": ["/enc/"], "fwd_ms": 1, "bwd_ms": 1}]))


# --- the GPU time model's shape terms and the h100x8 target -----------------------


def _conv(k, n, winograd=False, kernels=2.0, flops=1e12, nbytes=1e6):
    return NodeCost(op_type="Conv", op_class="conv", flops=flops, bytes_read=nbytes, bytes_written=nbytes, param_bytes=0, activation_bytes=nbytes,
                    backward_flops=2 * flops, backward_bytes=3 * nbytes, gemm_k=k, gemm_n=n, winograd=winograd, backward_kernels=kernels)


def _vgg_conv(side, c_in, c_out, batch=32):
    """A VGG-shaped 3x3 stride-1 convolution at `side` x `side`: FLOPs and activation bytes as onnxpipe counts them."""
    rows = batch * side * side
    return _conv(9 * c_in, c_out, winograd=True, flops=2.0 * rows * 9 * c_in * c_out, nbytes=4.0 * rows * (c_in + c_out) / 2)


def test_gemm_shape_terms():
    model = replace(GPU_KERNELS, multiprocessors=0)  # the shape terms alone, without the wave term
    assert shape_factor(model, _conv(4608, 512)) == pytest.approx(4608 / (4608 + 64) * 512 / (512 + 32))
    assert shape_factor(model, _conv(27, 64)) < 0.25 * shape_factor(model, _conv(4608, 512))  # 3 input channels x 3x3: far from peak
    assert shape_factor(KernelModel(), _conv(27, 64, winograd=True)) == 1.0  # neutral: the plain roofline
    device = load_target("h100x8").devices[0]
    big = _conv(4608, 512)  # 1e12 FLOPs: 211,928 rows x 512 columns, 1,656 x 4 tiles of 128, on 132 SMs
    expected = 1e12 / (67e12 * 0.7 * shape_factor(model, big) * 6624 / (6624 + 132 / 2))
    assert node_seconds(device, big) == pytest.approx(expected + 5e-6)
    assert node_seconds(device, big, backward=True) == pytest.approx(2 * expected + 2 * 5e-6)  # two kernels, two launches


def test_few_output_tiles_leave_multiprocessors_idle():
    """The wave term: a GEMM of fewer tiles than multiprocessors runs at tiles/(tiles + SMs/2) of its rate."""
    h100, no_waves = replace(GPU_KERNELS, multiprocessors=132), replace(GPU_KERNELS, multiprocessors=0)
    batch32 = NodeCost(op_type="Gemm", op_class="matmul", flops=2.0 * 32 * 25088 * 4096, bytes_read=4.0 * 25088 * 4096, bytes_written=4.0 * 32 * 4096,
                       param_bytes=0, activation_bytes=0, backward_flops=0, backward_bytes=0, gemm_k=25088, gemm_n=4096)  # VGG-16's fc6 at batch 32
    assert shape_factor(h100, batch32) == pytest.approx(shape_factor(no_waves, batch32) * 32 / (32 + 66))  # 1 x 32 tiles
    large = _vgg_conv(56, 256, 256)  # 100,352 rows x 256: 1,568 tiles, 12 waves
    assert 0.95 < shape_factor(h100, large) / shape_factor(no_waves, large) < 1.0


@pytest.mark.parametrize("side,c_in,c_out,gain", [(224, 3, 64, (1.0, 1.0)), (224, 32, 32, (1.0, 1.0)), (224, 64, 64, (1.0, 1.1)), (28, 512, 512, (1.5, 2.25))])
def test_winograd_pays_for_its_transforms(side, c_in, c_out, gain):
    """A 3x3 stride-1 convolution runs the faster of implicit GEMM and Winograd: 2.25x less arithmetic, but its
    transforms move 8x the operands through memory, so large maps with few channels keep little or none of it."""
    device = replace(load_target("h100x8").devices[0], op_overhead=0.0)
    conv = _vgg_conv(side, c_in, c_out)
    direct = node_seconds(device, replace(conv, winograd=False))
    rate = 67e12 * 0.7 * shape_factor(device.kernels, conv)
    bandwidth = 3350e9 * 0.9
    nbytes = conv.bytes_read + conv.bytes_written
    winograd = max(conv.flops / (rate * 2.25), nbytes / bandwidth) + 8 * nbytes / bandwidth
    assert node_seconds(device, conv) == pytest.approx(min(direct, winograd))
    assert gain[0] <= direct / node_seconds(device, conv) <= gain[1]
    neutral = replace(device, kernels=replace(device.kernels, winograd_speedup=1.0))
    assert node_seconds(neutral, conv) == pytest.approx(direct)


@pytest.mark.parametrize("line,message", [
    ("multiprocessors = 0", None),  # 0: no wave term
    ("winograd_traffic = 0", None),
    ("tile = 0", r"devices\[0\]\.kernels\.tile: expected a positive number, got 0"),
    ("winograd_traffic = -8", r"devices\[0\]\.kernels\.winograd_traffic: expected a number >= 0, got -8"),
    ("multiprocessors = \"132\"", r"devices\[0\]\.kernels\.multiprocessors: expected a number >= 0, got '132'"),
])
def test_kernel_table_values_are_checked(tmp_path, line, message):
    text = open(load_target("h100x8").source).read()
    key = line.split(" = ")[0]
    lines = [f"{line}  # edited" if row.startswith(f"{key} = ") else row for row in text.splitlines()]
    path = tmp_path / "edited.toml"
    path.write_text("\n".join(lines))
    if message is None:
        assert getattr(load_target(str(path)).devices[0].kernels, key) == 0
    else:
        with pytest.raises(OnnxpipeError, match=message):
            load_target(str(path))


def test_h100x8_is_one_dgx_node():
    target = load_target("h100x8")
    assert target.summary() == "8x h100 (gpu)"
    d = target.devices[0]
    assert (d.peak_flops["float32"], d.memory_bandwidth, d.memory_bytes, d.kernels) == (67e12, 3350e9, 80e9, replace(GPU_KERNELS, multiprocessors=132))
    assert load_target("gpu4").devices[0].kernels == replace(GPU_KERNELS, multiprocessors=80)  # V100: 80 SMs
    link = target.link("h100_0", "h100_7")
    assert (link.bandwidth, link.topology) == (450e9, "switch")


# --- calibration -----------------------------------------------------------------


def test_calibration_recovers_a_device_from_the_times_it_produced(tmp_path):
    """Times made by a slower device (conv at 0.35, memory at 60%, 12 us launches): the fit moves toward it, its error
    falls, and the written target loads with the fitted values."""
    from onnxpipe import models

    graph = load(models.build("resnet-tiny"))
    costs = annotate(graph)
    base = load_target("h100x8")
    truth = replace(base.devices[0], efficiency={**base.devices[0].efficiency, "conv": 0.35}, op_overhead=12e-6,
                    kernels=replace(base.devices[0].kernels, memory_efficiency=0.6))
    forward = {n: node_seconds(truth, c) for n, c in costs.nodes.items()}
    backward = {n: node_seconds(truth, c, backward=True) for n, c in costs.nodes.items()}
    from onnxpipe.cost import with_measurements

    measured = with_measurements(costs, forward, backward, "gpu", "profile:CUDAExecutionProvider")
    result = calibrate(units("resnet-tiny", measured), base)
    assert result.error_after < 0.5 * result.error_before
    assert abs(result.parameters["efficiency.conv"] - 0.35) < abs(0.7 - 0.35)
    assert result.parameters["op_overhead"] > 5e-6 and result.parameters["kernels.memory_efficiency"] < 0.9
    assert {r.name for r in result.classes} >= {"conv", "elementwise"}
    out = tmp_path / "cal.toml"
    write_target(result, base.source, "synthetic", out)
    loaded = load_target(str(out))
    assert loaded.devices[0].efficiency["conv"] == pytest.approx(result.parameters["efficiency.conv"], abs=1e-4)
    assert "fitted: synthetic" in out.read_text() and tomllib.loads(out.read_text())["name"] == "h100x8-calibrated"


def test_calibration_without_measurements_fails_in_one_line():
    with pytest.raises(OnnxpipeError, match=r"no measured times to calibrate on; annotate the model with --profile or --times first"):
        calibrate([], load_target("h100x8"))


# --- the CLI ---------------------------------------------------------------------


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "onnxpipe", *args], capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})


def test_cli_imports_calibrates_and_plans_with_the_result(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_model(), str(src))
    times = _blocks(tmp_path, [{"block": "enc", "nodes": ["/enc/"], "fwd_ms": 2.0, "bwd_ms": 3.0},
                               {"block": "dec", "nodes": ["/dec/"], "fwd_ms": 1.0, "bwd_ms": 1.5}])
    run = _cli("annotate", str(src), "--times", str(times), "-t", "h100x8", "-o", str(tmp_path / "a.onnx"))
    assert run.returncode == 0, run.stderr
    assert "3 from import:blocks.json (gpu), 1 from analytic" in run.stdout
    run = _cli("calibrate", str(tmp_path / "a.onnx"), "-t", "h100x8", "-o", str(tmp_path / "cal.toml"))
    assert run.returncode == 0, run.stderr
    assert "fit error" in run.stdout and "a: enc" in run.stdout
    assert load_target(str(tmp_path / "cal.toml")).name == "h100x8-calibrated"
    run = _cli("plan", str(tmp_path / "a.onnx"), "-t", str(tmp_path / "cal.toml"), "--stages", "2", "--microbatches", "2")
    assert run.returncode == 0, run.stderr
    assert "2 stages of" in run.stdout
    bad = _cli("calibrate", str(src), "-t", "h100x8", "-o", str(tmp_path / "x.toml"))
    assert bad.returncode == 2 and "no measured times in it" in bad.stderr and not (tmp_path / "x.toml").exists()
    bad = _cli("annotate", str(src), "--times", str(times))
    assert bad.returncode == 2 and "(--target)" in bad.stderr and "Traceback" not in bad.stderr
