"""Quantized zoo models end to end: a tiny CNN and a tiny transformer quantized here with onnxruntime's
`quantize_static` (QDQ, int8 weights and activations), planned in inference mode on fpga4 and hetero, split into
stage files that keep their quantization and pass onnx's full check, verified exactly against the quantized
model, run as a pipeline and by plain onnxruntime from the manifest alone; and ResNet-50 in int8 against fp32
on fpga4."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static

from onnxpipe.chain import chain
from onnxpipe.cost import annotate
from onnxpipe.graph import load
from onnxpipe.models import build
from onnxpipe.plan import plan
from onnxpipe.quantized import dequantized_source
from onnxpipe.split import split
from onnxpipe.target import load_target
from onnxpipe.train.infer import run_pipeline
from onnxpipe.verify import random_feeds, relative_error, verify


class _Calibration(CalibrationDataReader):
    """A few random batches in the model's input types (token ids below `vocab`)."""

    def __init__(self, model: onnx.ModelProto, batches: int = 3, vocab: int = 64) -> None:
        rng = np.random.default_rng(0)
        shapes = {i.name: ([d.dim_value for d in i.type.tensor_type.shape.dim], i.type.tensor_type.elem_type) for i in model.graph.input}
        self._feeds = iter([{name: rng.standard_normal(shape).astype(np.float32) if kind == onnx.TensorProto.FLOAT
                             else rng.integers(0, vocab, shape).astype(np.int64) for name, (shape, kind) in shapes.items()}
                            for _ in range(batches)])

    def get_next(self) -> dict[str, np.ndarray] | None:
        return next(self._feeds, None)


@pytest.fixture(scope="module", params=["resnet-tiny", "transformer-tiny"])
def quantized(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param)
    model = build(request.param)
    onnx.save(model, folder / "fp32.onnx")
    quantize_static(str(folder / "fp32.onnx"), str(folder / "int8.onnx"), _Calibration(model), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    return folder / "int8.onnx"


def _int8_kernels(path: Path) -> set[str]:
    graph = load(path)
    return {name for name, c in annotate(graph).nodes.items() if c.dtype == "int8"}


@pytest.mark.parametrize("target", ["fpga4", "hetero"])
def test_a_quantized_model_plans_splits_verifies_and_runs(quantized: Path, target: str, tmp_path: Path) -> None:
    graph = load(quantized)
    costs = annotate(graph)
    kernels = {name for name, c in costs.nodes.items() if c.dtype == "int8"}
    matmuls = {name for name in graph.compute_nodes if graph.node(name).op_type in ("Conv", "MatMul", "Gemm")}
    assert kernels and kernels <= matmuls  # quantize_static quantizes every Conv and Gemm, the MatMuls it can
    planned = plan(graph, costs, load_target(target), mode="inference", stages=3, microbatches=2, time_limit=5)
    assert planned.mode == "inference" and len(planned.stages) == 3

    manifest = split(graph, planned, tmp_path / "stages")
    ops = [n.op_type for n in graph.model.graph.node]  # loaded: the QDQ pairs quantize_static puts on outputs nothing reads are gone
    stage_ops: list[str] = []
    for s in manifest.stages:
        path = tmp_path / "stages" / s.file
        onnx.checker.check_model(str(path), full_check=True)
        stage_ops += [n.op_type for n in onnx.load(path).graph.node]
    # QDQ stays QDQ: every quantize and dequantize of the loaded model is in some stage (a weight's may be in several).
    for op in ("QuantizeLinear", "DequantizeLinear"):
        assert stage_ops.count(op) >= ops.count(op) > 0
    # Every int8 kernel stays one in its stage, except those whose dequantized operand crosses a boundary (noted).
    crossing = {t for s in manifest.stages for t in (i.name for i in s.inputs) if dequantized_source(graph, t)}
    widened = {c for t in crossing for c in graph.consumers(t) if c in kernels}
    in_stages = set().union(*(_int8_kernels(tmp_path / "stages" / s.file) for s in manifest.stages))
    assert in_stages == kernels - widened
    assert bool(crossing) == any("DequantizeLinear widened int8" in note for note in planned.notes)

    errors = verify(tmp_path / "stages", quantized, samples=2)
    assert errors and all(e == 0.0 for e in errors.values()), errors

    # The pipeline runs the stage files as they are (onnxruntime's fusions on): each micro-batch as the chained stages give it.
    feeds = random_feeds(manifest.inputs, np.random.default_rng(1))
    other = {name: value[::-1].copy() for name, value in feeds.items()}
    ran = run_pipeline(tmp_path / "stages", {name: np.concatenate([feeds[name], other[name]]) for name in feeds}, microbatches=2,
                       processes=target == "fpga4")
    n = len(next(iter(feeds.values())))
    for part, given in ((slice(0, n), feeds), (slice(n, 2 * n), other)):
        for name, value in chain(tmp_path / "stages", given).items():
            assert relative_error(ran[name][part], value) <= 1e-5, name

    # Plain onnxruntime runs the quantized stages from the manifest alone, onnxpipe not importable.
    np.savez(tmp_path / "in.npz", **feeds)
    blocker = "import runpy, sys; sys.modules['onnxpipe'] = None; sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')"
    subprocess.run([sys.executable, "-c", blocker, str(Path(__file__).with_name("chain_without_onnxpipe.py")), str(tmp_path / "stages"),
                    str(tmp_path / "in.npz"), str(tmp_path / "out.npz")], check=True, cwd=tmp_path)
    plain = np.load(tmp_path / "out.npz")
    for name, value in chain(tmp_path / "stages", feeds).items():
        assert relative_error(plain[name], value) <= 1e-5, name


def test_resnet50_in_int8_is_predicted_over_5x_the_fp32_throughput_on_fpga4(tmp_path: Path) -> None:
    """fpga4's U280 runs int8 at 24.5 TOP/s against 1.08 TFLOP/s in float32: ResNet-50's convolutions, nearly all
    its work, run 22x faster; its Q/DQ nodes (memory-bound, a launch each) and float BatchNormalizations keep the
    whole at 6-7x for micro-batches of 8."""
    model = build("resnet50", batch=8)
    onnx.save(model, tmp_path / "fp32.onnx")
    quantize_static(str(tmp_path / "fp32.onnx"), str(tmp_path / "int8.onnx"), _Calibration(model, batches=1), quant_format=QuantFormat.QDQ,
                    activation_type=QuantType.QInt8, weight_type=QuantType.QInt8)
    throughput = {}
    for name in ("fp32", "int8"):
        graph = load(tmp_path / f"{name}.onnx")
        planned = plan(graph, annotate(graph), load_target("fpga4"), mode="inference", stages=1, microbatches=4, time_limit=5)
        throughput[name] = planned.batch / planned.iteration_seconds
    assert throughput["int8"] >= 5 * throughput["fp32"], throughput
