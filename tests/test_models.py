"""The model zoo: every small model builds, passes the full checker, runs in onnxruntime with the
right shapes and loads into the graph IR; training variants give a finite scalar loss first; the
full-size CNNs have their published compute; registry and CLI errors are one clear line."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, shape_inference

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.models import legacy

SMALL = [s.name for s in models.specs() if not s.full_size]
TRAINABLE = [s.name for s in models.specs() if s.trainable and not s.full_size]

#: Output shapes of each small model at its default knobs (inference variant).
EXPECTED_OUTPUTS = {
    "mlp": [(8, 10)],
    "resnet-tiny": [(4, 10)],
    "inception-tiny": [(4, 10)],
    "transformer-tiny": [(4, 16, 64)],
    "gpt2-tiny": [(8, 32, 256)],
    "bert-tiny": [(4, 32, 256)],
    "gnmt-tiny": [(4, 8, 64)],
    "two-io": [(8, 10), (8, 10)],
    "control-flow": [(4, 4)],
}


def _feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    """Random inputs: token ids and labels in [0, 4) (below every vocab/class count), floats N(0, 1)."""
    rng = np.random.default_rng(seed)
    feeds = {}
    for vi in model.graph.input:
        shape = [d.dim_value for d in vi.type.tensor_type.shape.dim]
        if vi.type.tensor_type.elem_type == TensorProto.INT64:
            feeds[vi.name] = rng.integers(0, 4, shape).astype(np.int64)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(np.float32)
    return feeds


def _run(model: onnx.ModelProto, feeds: dict[str, np.ndarray] | None = None) -> list[np.ndarray]:
    options = ort.SessionOptions()
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])
    return session.run(None, feeds if feeds is not None else _feeds(model))


def _float_weights(model: onnx.ModelProto) -> set[str]:
    """Trainable weights: float initializers of more than one element (scalars are formula constants)."""
    return {t.name for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and math.prod(t.dims) > 1}


def _param_count(model: onnx.ModelProto) -> int:
    """Elements of float initializers with at least one axis (scalar formula constants excluded)."""
    return sum(math.prod(t.dims) for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.dims))


def _macs(model: onnx.ModelProto) -> int:
    """Multiply-adds of Conv and Gemm nodes, from their weight and output shapes."""
    inferred = shape_inference.infer_shapes(model)
    graph = inferred.graph
    shapes = {vi.name: [d.dim_value for d in vi.type.tensor_type.shape.dim] for vi in [*graph.value_info, *graph.output]}
    weights = {t.name: list(t.dims) for t in graph.initializer}
    total = 0
    for node in graph.node:
        if node.op_type == "Conv":  # every output element: c_in/group * kh * kw multiply-adds
            total += math.prod(shapes[node.output[0]]) * math.prod(weights[node.input[1]][1:])
        elif node.op_type == "Gemm":  # transB=1: weight [out, in]
            total += math.prod(shapes[node.output[0]]) * weights[node.input[1]][1]
    return total


# -- small models ----------------------------------------------------------------------------


@pytest.mark.parametrize("name", SMALL)
def test_small_model_checks_runs_and_has_expected_shapes(name: str) -> None:
    model = models.build(name)
    onnx.checker.check_model(model, full_check=True)
    assert model.ir_version == 8 and [(o.domain, o.version) for o in model.opset_import] == [("", 17)]
    assert model.graph.name == name
    node_names = [n.name for n in model.graph.node]
    assert all(node_names) and len(set(node_names)) == len(node_names)
    outputs = _run(model)
    assert [o.shape for o in outputs] == EXPECTED_OUTPUTS[name]
    assert all(np.isfinite(o).all() for o in outputs)


@pytest.mark.parametrize("name", TRAINABLE)
def test_training_variant_gives_finite_scalar_loss_first(name: str) -> None:
    model = models.build(name, train=True)
    onnx.checker.check_model(model, full_check=True)
    assert model.graph.output[0].name == "loss" and model.graph.input[-1].name == "labels"
    outputs = _run(model)
    assert outputs[0].shape == () and np.isfinite(outputs[0]) and outputs[0] > 0
    assert [o.shape for o in outputs[1:]] == EXPECTED_OUTPUTS[name]
    for node in model.graph.node:
        if node.op_type == "SoftmaxCrossEntropyLoss":
            assert len(node.output) == 2 and node.output[1], "log_prob output is needed by the gradient builder"
        if node.op_type == "LayerNormalization":
            assert len(node.output) == 3 and all(node.output), "Mean and InvStdDev are needed by the gradient builder"
        assert node.op_type != "BatchNormalization"


@pytest.mark.parametrize("name", [n for n in TRAINABLE if n != "gnmt-tiny"])  # LSTM needs onnxruntime's rewrite first (tests/test_train.py)
def test_training_variant_has_a_gradient_for_every_weight(name: str) -> None:
    from onnxruntime.capi._pybind_state import GradientGraphBuilder  # the C++ builder; no torch import

    model = models.build(name, train=True)
    weights = _float_weights(model)
    options = ort.SessionOptions()
    options.log_severity_level = 3
    builder = GradientGraphBuilder(model.SerializeToString(), {"loss"}, weights, "loss", options)
    builder.build()
    gradients = {o.name for o in onnx.load_from_string(builder.get_model()).graph.output}
    assert {f"{w}_grad" for w in weights} <= gradients


def test_mlp_mse_variant_reads_float_targets() -> None:
    model = models.build("mlp", train=True, mse=True)
    labels = model.graph.input[-1]
    assert labels.type.tensor_type.elem_type == TensorProto.FLOAT
    assert [d.dim_value for d in labels.type.tensor_type.shape.dim] == [8, 10]
    assert {"Sub", "Mul", "ReduceMean"} <= {n.op_type for n in model.graph.node}
    loss = _run(model)[0]
    assert loss.shape == () and np.isfinite(loss)


def test_knobs_set_static_shapes_and_depth() -> None:
    model = models.build("gpt2-tiny", layers=1, batch=2, seq=8, d_model=32, heads=2, vocab=50)
    assert [o.shape for o in _run(model)] == [(2, 8, 50)]
    assert sum(n.op_type == "LayerNormalization" for n in model.graph.node) == 2 * 1 + 1
    resnet = models.build("resnet-tiny", blocks=3, channels=4, batch=2, image=8, classes=3, batchnorm=True)
    assert "BatchNormalization" in {n.op_type for n in resnet.graph.node}
    assert [o.shape for o in _run(resnet)] == [(2, 3)]


def test_seed_makes_weights_reproducible() -> None:
    assert models.build("mlp").SerializeToString() == models.build("mlp", seed=0).SerializeToString()
    assert models.build("mlp").SerializeToString() != models.build("mlp", seed=1).SerializeToString()


@pytest.mark.parametrize("name", ["gpt2-tiny", "bert-tiny"])
def test_output_embedding_is_tied_to_the_token_gather(name: str) -> None:
    model = models.build(name)
    gathers = [n for n in model.graph.node if n.op_type == "Gather" and n.input[1] == "input_ids"]
    transposes = [n for n in model.graph.node if n.op_type == "Transpose" and n.input[0] == gathers[0].input[0]]
    assert len(gathers) == 1 and len(transposes) == 1
    ops = {n.op_type for n in model.graph.node}
    assert "Erf" in ops and "Gelu" not in ops


def test_decoder_is_causal_and_its_mask_is_constant() -> None:
    model = models.build("transformer-tiny")
    feeds = _feeds(model)
    before = _run(model, feeds)[0]
    feeds["input_ids"][:, 10] = (feeds["input_ids"][:, 10] + 1) % 4
    after = _run(model, feeds)[0]
    np.testing.assert_array_equal(before[:, :10], after[:, :10])
    assert not np.allclose(before[:, 10:], after[:, 10:])
    g = load(model)
    mask_nodes = [n for n in g.order if g.node(n).op_type in ("ConstantOfShape", "Trilu")]
    assert len(mask_nodes) == 2 and set(mask_nodes) <= g.constant_nodes


# -- graph IR loading, legacy shapes, control flow ---------------------------------------------


def _variants(name: str) -> list[tuple[str, onnx.ModelProto]]:
    base = models.build(name)
    found = [("plain", base), ("ir3", legacy.initializers_as_inputs(base)), ("constants", legacy.constant_weights(base))]
    if models.spec(name).trainable:
        found.append(("train", models.build(name, train=True)))
    return found


@pytest.mark.parametrize("name", SMALL)
def test_graph_loads_every_model_and_its_legacy_shapes(name: str) -> None:
    for variant, model in _variants(name):
        onnx.checker.check_model(model, full_check=True)
        g = load(model)
        data_inputs = tuple(vi.name for vi in model.graph.input if vi.name not in {t.name for t in model.graph.initializer})
        assert g.inputs == data_inputs, variant
        assert g.outputs == tuple(vi.name for vi in model.graph.output), variant
        base = models.build(name, train=True) if variant == "train" else models.build(name)
        assert set(g.parameters) == _float_weights(base), variant
        assert len(g.order) == len(base.graph.node), variant
        assert all(name in g.tensors for n in g.order for name in g.node(n).output if name), variant
        assert g.batch == EXPECTED_OUTPUTS[name][0][0], variant


def test_legacy_rewrites_compute_the_same_outputs() -> None:
    model = models.build("two-io")
    feeds = _feeds(model)
    expected = _run(model, feeds)
    ir3 = legacy.initializers_as_inputs(model)
    assert ir3.ir_version == 3 and {vi.name for vi in ir3.graph.input} >= {t.name for t in ir3.graph.initializer}
    constants = legacy.constant_weights(model)
    assert not constants.graph.initializer
    assert sum(n.op_type == "Constant" for n in constants.graph.node) == len(model.graph.initializer)
    for rewritten in (ir3, constants):
        for got, want in zip(_run(rewritten, feeds), expected):
            np.testing.assert_array_equal(got, want)


def test_control_flow_captures_are_node_inputs() -> None:
    g = load(models.build("control-flow"))
    ops = {g.node(n).op_type: n for n in g.order}
    branch, loop = ops["If"], ops["Loop"]
    assert {"hidden", "w_then", "w_else"} <= set(g.node_inputs(branch))
    assert {"hidden", "w_loop"} <= set(g.node_inputs(loop))
    assert g.dag.has_edge(ops["Relu"], loop, key="hidden") and g.dag.has_edge(ops["Relu"], branch, key="hidden")
    assert g.consumers("hidden") == (ops["ReduceSum"], branch, loop)


# -- full-size models --------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "macs", "params"), [("vgg16", 15.47e9, 138.36e6), ("resnet50", 4.09e9, 25.56e6)])
def test_full_size_cnns_have_published_compute(name: str, macs: float, params: float, tmp_path) -> None:
    """Shapes alone: built with sparse weights, not drawn (`models.build_sparse`)."""
    model = onnx.load(str(models.build_sparse(name, tmp_path / "m.onnx", batch=1)[0]), load_external_data=False)
    assert models.spec(name).full_size
    assert _macs(model) == pytest.approx(macs, rel=0.05)
    assert _param_count(model) == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize(("name", "params", "rel"), [("gpt2", 124_439_808, 0.0), ("bert", 110e6, 0.03)])
def test_full_size_transformers_have_published_sizes(name: str, params: float, rel: float, tmp_path) -> None:
    """Built at one and two layers (cheap; weights sparse, not drawn), extrapolated to the default depth: GPT-2 small
    exactly; BERT-base within 3% (no token-type table or pooler here, a masked-LM head instead)."""
    depth = models.spec(name).knobs["layers"]
    built = (models.build_sparse(name, tmp_path / f"{n}.onnx", layers=n, seq=8)[0] for n in (1, 2))
    one, two = (_param_count(onnx.load(str(path), load_external_data=False)) for path in built)
    assert one + (depth - 1) * (two - one) == pytest.approx(params, rel=rel)


def test_full_size_gnmt_builder_runs_when_shrunk() -> None:
    model = models.build("gnmt8", layers=3, hidden=16, seq=4, vocab=40)
    onnx.checker.check_model(model, full_check=True)
    assert sum(n.op_type == "LSTM" for n in model.graph.node) == 6
    assert [o.shape for o in _run(model)] == [(1, 4, 40)]
    assert models.spec("gnmt8").knobs["layers"] == 8 and models.spec("gnmt8").knobs["hidden"] == 1024


# -- registry, saving, CLI ---------------------------------------------------------------------


def test_registry_lists_specs_that_are_frozen() -> None:
    assert {"mlp", "resnet-tiny", "inception-tiny", "transformer-tiny", "gpt2-tiny", "bert-tiny", "gnmt-tiny", "two-io",
            "control-flow", "vgg16", "resnet50", "gnmt8", "gpt2", "bert"} <= set(models.names())
    spec = models.spec("gpt2-tiny")
    assert spec.trainable and not spec.full_size and spec.knobs["train"] is False and spec.knobs["layers"] == 4
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.name = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        spec.knobs["layers"] = 1  # type: ignore[index]


@pytest.mark.parametrize(
    ("name", "knobs", "message"),
    [
        ("nope", {}, r"unknown model 'nope'; choose one of: mlp, "),
        ("mlp", {"depth": 2}, r"model 'mlp' has no knob 'depth'; its knobs: layers, width"),
        ("mlp", {"layers": 2.5}, r"knob layers=2.5 of model 'mlp' must be an integer"),
        ("mlp", {"layers": 0}, r"knob layers=0 must be at least 1"),
        ("gpt2-tiny", {"d_model": 30, "heads": 4}, r"d_model=30 must be a multiple of heads=4"),
        ("control-flow", {"train": True}, r"model 'control-flow' has no training variant"),
    ],
)
def test_registry_errors_are_one_line(name: str, knobs: dict, message: str) -> None:
    with pytest.raises(OnnxpipeError, match=message) as info:
        models.build(name, **knobs)
    assert "\n" not in str(info.value)


def test_save_with_external_data_round_trips(tmp_path) -> None:
    model = models.build("mlp")
    written = models.save(model, tmp_path / "mlp.onnx", external=True)
    assert [p.name for p in written] == ["mlp.onnx", "mlp.onnx.data"]
    reloaded = onnx.load(str(written[0]))
    feeds = _feeds(model)
    np.testing.assert_array_equal(_run(reloaded, feeds)[0], _run(model, feeds)[0])
    assert set(load(written[0]).parameters) == _float_weights(model)
    assert models.save(model, tmp_path / "small.onnx") == [tmp_path / "small.onnx"]


def test_cli_lists_and_builds_models(tmp_path) -> None:
    from typer.testing import CliRunner  # imported here: the model tests do not depend on the CLI

    from onnxpipe.cli import app

    runner = CliRunner()
    listed = runner.invoke(app, ["models"])
    assert listed.exit_code == 0 and "gpt2-tiny" in listed.output and "resnet50" in listed.output
    out = tmp_path / "m.onnx"
    built = runner.invoke(app, ["models", "build", "mlp", "-o", str(out), "--set", "layers=2", "--set", "mse=true", "--train"])
    assert built.exit_code == 0, built.output
    model = onnx.load(str(out))
    assert model.graph.output[0].name == "loss" and sum(n.op_type == "Gemm" for n in model.graph.node) == 3
    bad = runner.invoke(app, ["models", "build", "mlp", "-o", str(out), "--set", "layers=two"])
    assert bad.exit_code == 2 and "layers of model 'mlp' must be an integer" in bad.output


def test_a_sparse_build_has_the_full_models_graph_sizes_and_costs_without_its_weights(tmp_path) -> None:
    """GPT-2 at full size (124 M parameters): every weight an external-data header into one file whose length is their
    bytes but which holds next to none on disk; loaded, it has the dense build's nodes, weights, trained set (its tied
    embedding tied, its MLP projections apart) and costs."""
    from onnxpipe.cost import annotate

    dense = models.build("gpt2", train=True)
    written = models.build_sparse("gpt2", tmp_path / "gpt2.onnx", train=True)
    assert [p.name for p in written] == ["gpt2.onnx", "gpt2.onnx.data"]
    headers = onnx.load(str(written[0]), load_external_data=False)
    external = [t for t in headers.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    lengths = [int(dict((e.key, e.value) for e in t.external_data)["length"]) for t in external]
    offsets = [int(dict((e.key, e.value) for e in t.external_data)["offset"]) for t in external]
    assert offsets == [sum(lengths[:i]) for i in range(len(lengths))]  # one after another, none shared
    assert lengths == [4 * math.prod(t.dims) for t in external] and sum(lengths) > 0.95 * 4 * _param_count(dense)
    data = written[1].stat()
    assert data.st_size == sum(lengths) > 400 * 2**20 and data.st_blocks * 512 < 2**20  # sparse: a block per weight
    sparse_graph, dense_graph = load(written[0]), load(dense)
    assert sparse_graph.compute_nodes == dense_graph.compute_nodes and sparse_graph.parameters == dense_graph.parameters
    assert sparse_graph.trained == dense_graph.trained and annotate(sparse_graph) == annotate(dense_graph)


def test_cli_builds_a_sparse_model(tmp_path) -> None:
    from typer.testing import CliRunner

    from onnxpipe.cli import app

    out = tmp_path / "gnmt8.onnx"
    built = CliRunner().invoke(app, ["models", "build", "gnmt8", "-o", str(out), "--sparse"])
    assert built.exit_code == 0, built.output
    said = " ".join(built.output.split())  # the console wraps long lines
    assert "gnmt8.onnx.data" in said and "weights sparse on disk, not for training" in said
    written = onnx.load(str(out), load_external_data=False)
    external = [t for t in written.graph.initializer if t.data_location == TensorProto.EXTERNAL]
    assert (tmp_path / "gnmt8.onnx.data").stat().st_size == 4 * sum(math.prod(t.dims) for t in external) > 2**30  # ~295 M weights
