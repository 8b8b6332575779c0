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
    """x [2, 3, 4, 4] -> Mul w -> LRN -> Atan -> Sinh -> Relu -> ReduceMean = loss; an int CumSum off the gradient path
    (counting positions) must not count."""
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"], name="scale"),
        helper.make_node("LRN", ["a"], ["b"], name="lrn", size=3),
        helper.make_node("Atan", ["b"], ["c"], name="atan"),
        helper.make_node("Sinh", ["c"], ["d"], name="sinh"),
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
    assert missing == {"LRN": ("lrn",), "Atan": ("atan",), "Sinh": ("sinh",)}


def test_training_refuses_before_any_worker_with_every_op_named() -> None:
    with pytest.raises(OnnxpipeError) as err:
        ensure_gradients(_untrainable(), None, "m.onnx")
    message = str(err.value)
    assert "\n" not in message
    for op in ("LRN (1 node: lrn)", "Atan (1 node: atan)", "Sinh (1 node: sinh)"):
        assert op in message
    with pytest.raises(OnnxpipeError, match=r"no gradient for LRN .*Atan .*Sinh "):
        Pipeline(_untrainable(), "cpu2", stages=1, microbatches=1, processes=False)


def test_inspect_lists_them(tmp_path: Path) -> None:
    onnx.save(_untrainable(), tmp_path / "m.onnx")
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "inspect", str(tmp_path / "m.onnx")], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert "LRN (1 node: lrn), Atan (1 node: atan), Sinh (1 node: sinh)" in " ".join(run.stdout.split())


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


def _group_norm(x: np.ndarray, u: np.ndarray, gamma: np.ndarray, beta: np.ndarray, groups: int, eps: float) -> np.ndarray:
    h = (u * x).reshape(x.shape[0], groups, -1)
    h = (h - h.mean(-1, keepdims=True)) / np.sqrt(h.var(-1, keepdims=True) + eps)
    return h.reshape(x.shape) * gamma + beta


@pytest.mark.parametrize("opset", [17, 20])
def test_group_norm_trains_through_instance_normalization(opset: int) -> None:
    """torch's GroupNorm exports as Reshape + InstanceNormalization + Reshape + Mul + Add (either exporter), and
    onnxruntime-training 1.19.2 has no InstanceNormalization gradient: written out in primitives, the weights
    before and after it get numpy's gradients (central differences in float64)."""
    n, c, groups, eps = 2, 6, 3, 1e-5
    x = RNG.normal(size=(n, c, 4, 4)).astype(np.float32)
    u = RNG.uniform(0.5, 1.5, size=(1, c, 4, 4)).astype(np.float32)
    gamma, beta = RNG.normal(size=(c, 1, 1)).astype(np.float32), RNG.normal(size=(c, 1, 1)).astype(np.float32)
    probe = RNG.normal(size=(n, c, 4, 4)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "u"], ["scaled"], name="scale"),
             helper.make_node("Reshape", ["scaled", "grouped_shape"], ["grouped"], name="group"),
             helper.make_node("InstanceNormalization", ["grouped", "ones", "zeros"], ["normed"], name="norm", epsilon=eps),
             helper.make_node("Reshape", ["normed", "x_shape"], ["ungrouped"], name="ungroup"),
             helper.make_node("Mul", ["ungrouped", "gamma"], ["g"], name="gamma_mul"),
             helper.make_node("Add", ["g", "beta"], ["y"], name="beta_add"),
             helper.make_node("Mul", ["y", "probe"], ["weighted"], name="weighted"),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], name="sum", keepdims=0)]
    inits = [numpy_helper.from_array(a, name) for a, name in [
        (u, "u"), (gamma, "gamma"), (beta, "beta"), (probe, "probe"), (np.ones(groups, np.float32), "ones"),
        (np.zeros(groups, np.float32), "zeros"), (np.array([n, groups, -1], np.int64), "grouped_shape"), (np.array(x.shape, np.int64), "x_shape")]]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(x.shape))],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
                    helper.make_tensor_value_info("y", TensorProto.FLOAT, list(x.shape))], inits, opset)
    with pytest.raises(Exception, match="InstanceNormalization"):
        gradient_model(model.SerializeToString(), "loss", {"u"})
    assert missing_gradients(model) == ()
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == ["InstanceNormalization -> ReduceMean, Sub, Mul, Sqrt, Div"]
    feeds = {"x": x}
    np.testing.assert_allclose(cpu_session(rewritten.SerializeToString()).run(["y"], feeds)[0],
                               cpu_session(model.SerializeToString()).run(["y"], feeds)[0], rtol=1e-5, atol=1e-5)
    grad = gradient_model(rewritten.SerializeToString(), "loss", {"u", "gamma", "beta"})
    got = dict(zip(("u", "gamma", "beta"), cpu_session(grad.SerializeToString()).run(["u_grad", "gamma_grad", "beta_grad"], feeds)))
    args = {"u": u, "gamma": gamma, "beta": beta}

    def loss(**changed: np.ndarray) -> float:
        a = {k: v.astype(np.float64) for k, v in {**args, **changed}.items()}
        return float((_group_norm(x.astype(np.float64), a["u"], a["gamma"], a["beta"], groups, eps) * probe).sum())

    for name, value in args.items():
        numeric = np.zeros(value.shape)
        for i in np.ndindex(value.shape):
            up, down = value.astype(np.float64), value.astype(np.float64)
            up[i] += 1e-6
            down[i] -= 1e-6
            numeric[i] = (loss(**{name: up}) - loss(**{name: down})) / 2e-6
        np.testing.assert_allclose(got[name], numeric, rtol=1e-3, atol=1e-4, err_msg=name)


def _layer_norm_model(dtype: int, opset: int) -> onnx.ModelProto:
    np_dtype = helper.tensor_dtype_to_np_dtype(dtype)
    rng = np.random.default_rng(4)
    inits = [numpy_helper.from_array(a.astype(np_dtype), name) for a, name in [
        (rng.normal(size=(8, 8)) / 3, "w"), (rng.uniform(0.5, 1.5, size=8), "scale"), (rng.normal(size=8), "bias"), (rng.normal(size=(4, 8)), "probe")]]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("LayerNormalization", ["h", "scale", "bias"], ["y"], name="ln"),
             helper.make_node("Mul", ["y", "probe"], ["weighted"], name="weighted"),
             helper.make_node("ReduceSum", ["weighted"], ["total"], name="sum", keepdims=0),
             helper.make_node("Cast", ["total"], ["loss"], name="loss", to=TensorProto.FLOAT)]
    return _model(nodes, [helper.make_tensor_value_info("x", dtype, [4, 8])],
                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), helper.make_tensor_value_info("y", dtype, [4, 8])], inits, opset)


def test_float16_layer_norm_trains_at_opset_18_and_later() -> None:
    """onnxruntime-training's LayerNormalization gradient kernel is float32-only; for float16 it falls back to a
    function body whose ReduceMean reads axes as an attribute, which opset 18 removed: the session failed to load
    (every dynamo export of a half-precision transformer). Normalized in float32 between two Casts, the forward
    differs by float16 rounding (a unit in the last place) and the gradients are float32's within it."""
    from onnxpipe.ortutil import complete_optional_outputs

    half = _layer_norm_model(TensorProto.FLOAT16, 20)
    plain = onnx.ModelProto()
    plain.CopyFrom(half)
    complete_optional_outputs(plain.graph)
    with pytest.raises(Exception, match="axes"):
        cpu_session(gradient_model(plain.SerializeToString(), "loss", {"w", "scale", "bias"}).SerializeToString())
    rewritten, done = rewrite_for_training(half)
    assert [r.pattern for r in done] == ["float16 LayerNormalization -> Cast, LayerNormalization in float32, Cast"]
    assert rewrite_for_training(_layer_norm_model(TensorProto.FLOAT16, 17))[1] == ()  # the float16 kernel loads there
    x = RNG.normal(size=(4, 8))
    np.testing.assert_allclose(cpu_session(rewritten.SerializeToString()).run(["y"], {"x": x.astype(np.float16)})[0],
                               cpu_session(half.SerializeToString()).run(["y"], {"x": x.astype(np.float16)})[0], rtol=2e-3, atol=1e-3)
    complete_optional_outputs(rewritten.graph)
    names = ["w_grad", "scale_grad", "bias_grad"]
    got = cpu_session(gradient_model(rewritten.SerializeToString(), "loss", {"w", "scale", "bias"}).SerializeToString()).run(names, {"x": x.astype(np.float16)})
    full = _layer_norm_model(TensorProto.FLOAT, 20)
    complete_optional_outputs(full.graph)
    want = cpu_session(gradient_model(full.SerializeToString(), "loss", {"w", "scale", "bias"}).SerializeToString()).run(names, {"x": x.astype(np.float32)})
    for name, g, w in zip(names, got, want):
        assert g.dtype == np.float16
        np.testing.assert_allclose(g.astype(np.float32), w, rtol=2e-2, atol=2e-2, err_msg=name)


def test_weights_read_only_where_no_gradient_flows_are_not_trained() -> None:
    """The dynamo exporter stores equal constants once: a GroupNorm's scale of ones and a Resize's scales of ones
    become one tensor, untied per module on loading. The Resize's copy has no gradient (the ONNX spec calls its
    scales non-differentiable): trained, the gradient builder failed to find its gradient."""
    from onnxpipe.nodes import trained_initializers
    from onnxpipe.train.graphs import build_stage_graphs

    nodes = [helper.make_node("Mul", ["x", "w"], ["a"], name="mul"),
             helper.make_node("Resize", ["a", "", "scales"], ["b"], name="resize", mode="nearest"),
             helper.make_node("ReduceSum", ["b"], ["loss"], name="sum", keepdims=0)]
    inits = [numpy_helper.from_array(RNG.normal(size=(1, 2, 4, 4)).astype(np.float32), "w"),
             numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 4, 4])],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    assert trained_initializers(model.graph) == {"w"}
    graphs = build_stage_graphs(model, params=["w", "scales"], grad_inputs=(), grad_outputs=(), loss="loss", recompute=False)
    assert graphs.trained == ("w",)


def _linear_op_model(node: onnx.NodeProto, x_shape: list[int], inits: list[onnx.TensorProto], y_shape: list[int], opset: int = 19) -> onnx.ModelProto:
    """w (x's shape) * x -> `node` (reading `scaled`) -> y; loss = sum(y * probe): linear in w, so central
    differences of one unit are exact up to rounding."""
    probe = numpy_helper.from_array(RNG.normal(size=y_shape).astype(np.float32), "probe")
    w = numpy_helper.from_array(RNG.normal(size=x_shape).astype(np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["scaled"], name="scale"), node,
             helper.make_node("Mul", ["y", "probe"], ["weighted"], name="weighted"),
             helper.make_node("ReduceSum", ["weighted"], ["loss"], name="sum", keepdims=0)]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                  [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape)],
                  [w, probe, *inits], opset)


def _assert_rewritten_like_the_op(model: onnx.ModelProto, pattern: str | list[str], trained: tuple[str, ...], exact: bool, step: float = 1.0) -> None:
    """The rewrite replaced the op, computes its values, and trains: each trained tensor's gradient equals central
    differences of the original model's loss (a few elements each; `step` 1 where the loss is linear in them)."""
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == ([pattern] if isinstance(pattern, str) else pattern)
    x = RNG.normal(size=[d.dim_value for d in model.graph.input[0].type.tensor_type.shape.dim]).astype(np.float32)
    want = cpu_session(model.SerializeToString()).run(["y"], {"x": x})[0]
    got = cpu_session(rewritten.SerializeToString()).run(["y"], {"x": x})[0]
    if exact:
        np.testing.assert_array_equal(got, want)
    else:
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    grads = cpu_session(gradient_model(rewritten.SerializeToString(), "loss", set(trained)).SerializeToString()).run(
        [f"{t}_grad" for t in trained], {"x": x})
    inits = {t.name: t for t in model.graph.initializer}
    for name, grad in zip(trained, grads):
        base = numpy_helper.to_array(inits[name])
        for flat in RNG.choice(base.size, size=min(6, base.size), replace=False):
            values = []
            for sign in (1.0, -1.0):
                changed = base.copy()
                changed.flat[flat] += sign * step
                probe = onnx.ModelProto()
                probe.CopyFrom(model)
                next(t for t in probe.graph.initializer if t.name == name).CopyFrom(numpy_helper.from_array(changed, name))
                values.append(float(cpu_session(probe.SerializeToString()).run(["loss"], {"x": x})[0]))
            assert grad.flat[flat] == pytest.approx((values[0] - values[1]) / (2 * step), rel=1e-3, abs=1e-3 if step == 1.0 else 2e-2), (name, flat)  # float32 rounding over a small step


RESIZES = [  # (attributes, x shape, scales or None, sizes or None, what it becomes)
    ({"mode": "nearest"}, [1, 2, 3, 4], [1, 1, 2, 2], None, "Resize -> Expand of each element"),
    ({"mode": "nearest", "coordinate_transformation_mode": "asymmetric", "nearest_mode": "floor"}, [2, 3, 4], [1, 1, 3], None,
     "Resize -> Expand of each element"),
    ({"mode": "linear"}, [1, 2, 3, 4], [1, 1, 2, 2], None, "Resize -> MatMul by interpolation matrices"),
    ({"mode": "linear", "coordinate_transformation_mode": "align_corners"}, [2, 1, 4, 3], None, [2, 1, 7, 5], "Resize -> MatMul by interpolation matrices"),
    ({"mode": "cubic", "coordinate_transformation_mode": "asymmetric"}, [1, 2, 3, 5], [1, 1, 1, 1.5], None, "Resize -> MatMul by interpolation matrices"),
    ({"mode": "nearest", "nearest_mode": "floor", "coordinate_transformation_mode": "asymmetric"}, [1, 1, 4, 6], [1, 1, 0.5, 1.5], None,
     "Resize -> MatMul by interpolation matrices"),
]


@pytest.mark.parametrize("attrs,x_shape,scales,sizes,pattern", RESIZES, ids=[f"{a['mode']}-{i}" for i, (a, *_rest) in enumerate(RESIZES)])
def test_resize_trains_as_matmuls_by_its_own_interpolation(attrs: dict, x_shape: list[int], scales: list[float] | None, sizes: list[int] | None,
                                                          pattern: str) -> None:
    """onnxruntime-training builds ResizeGrad, but its kernel is CUDA's alone: a model that upsamples could not load
    its gradient graph on the CPU. Resize is linear and acts on each axis alone: MatMuls by the matrices onnxruntime's
    own Resize makes of the identity compute the same values and train; where those matrices repeat each element
    (nearest at an integer scale) an Expand does it."""
    inits = [numpy_helper.from_array(np.array(scales, np.float32), "scales")] if scales else []
    inits += [numpy_helper.from_array(np.array(sizes, np.int64), "sizes")] if sizes else []
    y_shape = sizes or [int(np.floor(d * s)) for d, s in zip(x_shape, scales or [])]
    node = helper.make_node("Resize", ["scaled", "", "scales" if scales else "", "sizes" if sizes else ""], ["y"], name="resize", **attrs)
    model = _linear_op_model(node, x_shape, inits, y_shape)
    assert missing_gradients(model) == ()
    _assert_rewritten_like_the_op(model, pattern, ("w",), exact=attrs["mode"] == "nearest")


CONV_TRANSPOSES = [  # (attributes, x shape, weight shape, bias)
    ({"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1], "group": 2}, [2, 4, 3, 3], [4, 3, 3, 3], True),
    ({}, [1, 2, 4, 4], [2, 3, 2, 2], False),
    ({"strides": [3, 2], "dilations": [2, 1], "pads": [2, 0, 1, 3]}, [1, 2, 3, 4], [2, 2, 2, 3], True),
    ({"strides": [2], "pads": [1, 0]}, [2, 3, 5], [3, 2, 4], True),
]


@pytest.mark.parametrize("attrs,x_shape,w_shape,bias", CONV_TRANSPOSES, ids=[str(i) for i in range(len(CONV_TRANSPOSES))])
def test_conv_transpose_trains_as_a_conv_of_the_spaced_input(attrs: dict, x_shape: list[int], w_shape: list[int], bias: bool) -> None:
    """ConvTransposeGrad has no CPU kernel in onnxruntime-training 1.19.2: written as MatMuls that space and pad the
    input and a Conv with the weight transposed (per group) and flipped, it computes ConvTranspose's values and its
    weight and bias get the gradients central differences give."""
    spatial = len(x_shape) - 2
    group = attrs.get("group", 1)
    pads = attrs.get("pads", [0] * 2 * spatial)
    out = [(x_shape[2 + i] - 1) * attrs.get("strides", [1] * spatial)[i] + attrs.get("output_padding", [0] * spatial)[i]
           + (w_shape[2 + i] - 1) * attrs.get("dilations", [1] * spatial)[i] + 1 - pads[i] - pads[spatial + i] for i in range(spatial)]
    y_shape = [x_shape[0], w_shape[1] * group, *out]
    inits = [numpy_helper.from_array(RNG.normal(size=w_shape).astype(np.float32), "kernel")]
    inits += [numpy_helper.from_array(RNG.normal(size=w_shape[1] * group).astype(np.float32), "bias")] if bias else []
    node = helper.make_node("ConvTranspose", ["scaled", "kernel"] + (["bias"] if bias else []), ["y"], name="up", **attrs)
    model = _linear_op_model(node, x_shape, inits, y_shape)
    with pytest.raises(Exception, match="ConvTransposeGrad"):
        cpu_session(gradient_model(model.SerializeToString(), "loss", {"kernel"}).SerializeToString())
    _assert_rewritten_like_the_op(model, "ConvTranspose -> MatMul by spacing matrices, Conv", ("w", "kernel") + (("bias",) if bias else ()), exact=False)


GROUPED_CONVS = [  # (attributes, x shape, weight shape, what it becomes)
    ({"group": 2, "dilations": [2]}, [2, 4, 10], [4, 2, 3], "grouped Conv over one axis -> Conv over two"),
    ({"group": 4, "strides": [2], "pads": [1, 1]}, [2, 4, 9], [4, 1, 3], "grouped Conv over one axis -> Conv over two"),  # depthwise
    ({"group": 2, "pads": [1, 0, 1, 1, 0, 1]}, [1, 4, 3, 4, 4], [2, 2, 3, 3, 3], "grouped Conv over three axes -> a Conv per group"),
]


@pytest.mark.parametrize("attrs,x_shape,w_shape,pattern", GROUPED_CONVS, ids=[str(i) for i in range(len(GROUPED_CONVS))])
def test_grouped_conv_over_one_or_three_axes_trains_through_the_two_axis_kernel(attrs: dict, x_shape: list[int], w_shape: list[int],
                                                                                 pattern: str) -> None:
    """onnxruntime-training 1.19.2's CPU ConvGrad writes a grouped 1-D or 3-D conv's input gradient past its buffer (each
    group over all C channels' room): written as a 2-D conv (one axis) or a conv per group (three), the weight before it,
    the kernel and the bias get the gradients central differences give."""
    spatial = len(x_shape) - 2
    pads = attrs.get("pads", [0] * 2 * spatial)
    out = [(x_shape[2 + i] + pads[i] + pads[spatial + i] - attrs.get("dilations", [1] * spatial)[i] * (w_shape[2 + i] - 1) - 1)
           // attrs.get("strides", [1] * spatial)[i] + 1 for i in range(spatial)]
    inits = [numpy_helper.from_array(RNG.normal(size=w_shape).astype(np.float32), "kernel"),
             numpy_helper.from_array(RNG.normal(size=w_shape[0]).astype(np.float32), "bias")]
    node = helper.make_node("Conv", ["scaled", "kernel", "bias"], ["y"], name="conv", **attrs)
    _assert_rewritten_like_the_op(_linear_op_model(node, x_shape, inits, [x_shape[0], w_shape[0], *out]), pattern, ("w", "kernel", "bias"),
                                  exact=False)


def _grouped_conv1d() -> onnx.ModelProto:
    """Conv1d -> grouped, dilated Conv1d (a wav2vec2 or Conformer block) -> Relu -> mean -> Gemm, as the dynamo exporter
    writes it: cut after the second conv, the first stage hands its input gradient back through the grouped conv."""
    inits = [numpy_helper.from_array(RNG.normal(size=s).astype(np.float32) * 0.3, n)
             for n, s in (("c1", [8, 4, 5]), ("b1", [8]), ("c2", [8, 4, 3]), ("b2", [8]), ("fc", [2, 8]), ("fb", [2]))]
    nodes = [helper.make_node("Conv", ["x", "c1", "b1"], ["h1"], name="conv1", pads=[2, 2], strides=[2]),
             helper.make_node("Conv", ["h1", "c2", "b2"], ["h2"], name="conv2", group=2, dilations=[2]),
             helper.make_node("Relu", ["h2"], ["r"], name="relu"),
             helper.make_node("ReduceMean", ["r", "axes"], ["m"], name="mean", keepdims=0),
             helper.make_node("Gemm", ["m", "fc", "fb"], ["y"], name="fc", transB=1)]
    inits.append(numpy_helper.from_array(np.array([-1], np.int64), "axes"))
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 4, 32])], [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
                  inits, 18)


def test_a_stage_ending_in_a_grouped_conv1d_trains_as_the_unpartitioned_model() -> None:
    """Before the rewrite the first stage's grouped conv got a weight gradient of zeros for most of its output channels
    (the input gradient written past its buffer landed there), 30-100% of the step off the unpartitioned model's."""
    from onnxpipe.train.fit import check, data_source, fit
    from onnxpipe.train.loss import LossSpec
    from onnxpipe.train.optimizer import OptimizerConfig

    with Pipeline(_grouped_conv1d(), "gpu4", stages=2, microbatches=2, processes=False, loss=LossSpec("mse", "y"),
                  optimizer=OptimizerConfig("sgd", lr=0.1), device="cpu") as pipe:
        assert [st.nodes for st in pipe.manifest.stages] == [2, 3]
        source = data_source(pipe, "synthetic")
        fit(pipe, source, 2)
        diffs = check(pipe, source, 2)
    assert diffs["max_loss_rel_diff"] < 1e-6 and diffs["max_weight_abs_diff"] < 1e-6


PADS = [  # (mode, pads, x shape, y shape)
    ("reflect", [0, 0, 1, 2, 0, 0, 2, 1], [2, 3, 4, 5], [2, 3, 7, 8]),  # F.pad(mode="reflect")
    ("edge", [0, 1, 2, 0, 1, 0], [2, 3, 4], [2, 5, 6]),  # F.pad(mode="replicate")
    ("wrap", [0, 0, 0, 3], [2, 5], [2, 8]),  # F.pad(mode="circular")
]


@pytest.mark.parametrize("mode,pads,x_shape,y_shape", PADS, ids=[p[0] for p in PADS])
def test_pad_in_reflect_edge_and_wrap_mode_trains_as_gathers(mode: str, pads: list[int], x_shape: list[int], y_shape: list[int]) -> None:
    """onnxruntime-training 1.19.2 differentiates Pad in constant mode only: the other modes copy elements, so a Concat of
    Gathers of the copied positions computes the same values exactly and trains."""
    inits = [numpy_helper.from_array(np.array(pads, np.int64), "pads")]
    model = _linear_op_model(helper.make_node("Pad", ["scaled", "pads"], ["y"], name="pad", mode=mode), x_shape, inits, y_shape)
    _assert_rewritten_like_the_op(model, f"Pad in {mode} mode -> Concat of Gathers", ("w",), exact=True)


def test_the_gradient_probe_tells_pads_of_one_mode_from_another() -> None:
    """Its verdicts are cached by what they depend on: the attributes and constant inputs too, not the op type alone,
    under which the first Pad's verdict answered for every Pad of every model the process loaded after it."""
    from onnxpipe.gradprobe import differentiable, tensor_types

    verdicts = {}
    for mode in ("reflect", "constant", "edge"):
        model = _linear_op_model(helper.make_node("Pad", ["scaled", "pads"], ["y"], name="pad", mode=mode), [2, 5],
                                 [numpy_helper.from_array(np.array([0, 1, 0, 1], np.int64), "pads")], [2, 7])
        verdicts[mode] = differentiable(model, model.graph.node[1], (0,), tensor_types(model), 19)
    assert verdicts == {"reflect": False, "constant": True, "edge": False}


@pytest.mark.parametrize("starts,ends,axes,steps", [([-1], [-2**63 + 1], [2], [-1]), ([0, 4], [5, 0], [1, 2], [2, -2])],
                         ids=["flip", "strided"])
def test_slice_with_a_negative_step_trains_as_a_gather(starts: list[int], ends: list[int], axes: list[int], steps: list[int]) -> None:
    """torch.flip exports as a Slice of step -1 from the end to INT64_MIN: onnxruntime-training 1.19.2 builds and loads
    its SliceGrad, which then fails at run time where the negative step is on the last axis ("narrowing_error")."""
    x_shape = [2, 6, 5]
    y_shape = [len(range(*slice(s, e if e > -2**62 else None, p).indices(x_shape[a]))) if a in axes else x_shape[a]
               for a, (s, e, p) in ((a, next(((s, e, p) for s, e, ax, p in zip(starts, ends, axes, steps) if ax == a), (0, 0, 1))) for a in range(3))]
    inits = [numpy_helper.from_array(np.array(v, np.int64), n) for n, v in (("starts", starts), ("ends", ends), ("axes", axes), ("steps", steps))]
    model = _linear_op_model(helper.make_node("Slice", ["scaled", "starts", "ends", "axes", "steps"], ["y"], name="slice"), x_shape, inits, y_shape)
    grad = gradient_model(model.SerializeToString(), "loss", {"w"})
    with pytest.raises(Exception, match="narrowing_error"):
        cpu_session(grad.SerializeToString(), optimize=False).run(["w_grad"], {"x": np.ones(x_shape, np.float32)})
    _assert_rewritten_like_the_op(model, "Slice with a negative step -> Gather", ("w",), exact=True)


@pytest.mark.parametrize("axes,keepdims,x_shape,y_shape", [([1], 0, [2, 5, 3], [2, 3]), ([0, 2], 1, [3, 2, 4], [1, 2, 1]), (None, 0, [2, 3], [])],
                         ids=["odd-axis", "two-axes-kept", "all"])
def test_reduce_prod_trains_as_muls_of_halves(axes: list[int] | None, keepdims: int, x_shape: list[int], y_shape: list[int]) -> None:
    """onnxruntime-training 1.19.2 has no ReduceProd gradient (torch.prod): halves multiplied along each reduced axis (an
    odd last element carried on) compute the product, and the product rule trains it."""
    inits = [numpy_helper.from_array(np.array(axes, np.int64), "axes")] if axes else []
    node = helper.make_node("ReduceProd", ["scaled", *(["axes"] if axes else [])], ["y"], name="prod", keepdims=keepdims)
    assert [m.op_type for m in missing_gradients(_linear_op_model(node, x_shape, inits, y_shape, opset=18), None)] == []
    _assert_rewritten_like_the_op(_linear_op_model(node, x_shape, inits, y_shape, opset=18), "ReduceProd -> Muls of halves", ("w",),
                                  exact=False, step=1e-2)


RECURRENT = [  # (op, attributes, bias, initial state)
    ("GRU", {"linear_before_reset": 0}, True, False),
    ("GRU", {"linear_before_reset": 1, "direction": "reverse", "layout": 1}, False, True),
    ("GRU", {"direction": "bidirectional"}, True, True),
    ("RNN", {"direction": "bidirectional", "layout": 1}, True, False),
    ("RNN", {}, False, True),
]


@pytest.mark.parametrize("op,attrs,bias,initial", RECURRENT, ids=[f"{op}-{i}" for i, (op, *_rest) in enumerate(RECURRENT)])
def test_gru_and_rnn_unrolled_compute_the_op_and_train(op: str, attrs: dict, bias: bool, initial: bool) -> None:
    """onnxruntime-training 1.19.2 has no GRU or RNN gradient: unrolled, they compute what onnxruntime's op computes
    (the variants torch does not export included) and their weights get gradients."""
    seq, batch, inputs, hidden = 5, 2, 3, 4
    dirs, gates = (2 if attrs.get("direction") == "bidirectional" else 1), (3 if op == "GRU" else 1)
    layout = attrs.get("layout", 0)
    x_shape = [batch, seq, inputs] if layout else [seq, batch, inputs]
    names = ["x", "w", "r", "b" if bias else "", "", "h0" if initial else ""]
    inits = [numpy_helper.from_array(RNG.normal(size=(dirs, gates * hidden, inputs)).astype(np.float32), "w"),
             numpy_helper.from_array(RNG.normal(size=(dirs, gates * hidden, hidden)).astype(np.float32) / 2, "r")]
    inits += [numpy_helper.from_array(RNG.normal(size=(dirs, 2 * gates * hidden)).astype(np.float32), "b")] if bias else []
    h0_shape = [batch, dirs, hidden] if layout else [dirs, batch, hidden]
    inits += [numpy_helper.from_array(RNG.normal(size=h0_shape).astype(np.float32), "h0")] if initial else []
    y_shape = [batch, seq, dirs, hidden] if layout else [seq, dirs, batch, hidden]
    nodes = [helper.make_node(op, names, ["y", "y_h"], name="rnn", hidden_size=hidden, **attrs),
             helper.make_node("ReduceSum", ["y"], ["s1"], name="s1", keepdims=0),
             helper.make_node("ReduceSum", ["y_h"], ["s2"], name="s2", keepdims=0),
             helper.make_node("Add", ["s1", "s2"], ["loss"], name="loss")]
    model = _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
                   [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), helper.make_tensor_value_info("y", TensorProto.FLOAT, y_shape),
                    helper.make_tensor_value_info("y_h", TensorProto.FLOAT, h0_shape)], inits)
    with pytest.raises(Exception, match=op):
        gradient_model(model.SerializeToString(), "loss", {"w"})
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == [f"{op} -> its steps unrolled"]
    x = RNG.normal(size=x_shape).astype(np.float32)
    got = cpu_session(rewritten.SerializeToString()).run(["y", "y_h"], {"x": x})
    if layout:  # onnxruntime's kernels run layout 0 only: the reference is the op on the transposed tensors
        reference = onnx.ModelProto()
        reference.CopyFrom(model)
        for a in reference.graph.node[0].attribute:
            if a.name == "layout":
                a.i = 0
        for t in reference.graph.initializer:
            if t.name == "h0":
                t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(t).transpose(1, 0, 2).copy(), "h0"))
        del reference.graph.input[:], reference.graph.output[1:]
        reference.graph.input.append(helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, inputs]))
        reference.graph.output.extend([helper.make_tensor_value_info("y", TensorProto.FLOAT, None), helper.make_tensor_value_info("y_h", TensorProto.FLOAT, None)])
        y, y_h = cpu_session(reference.SerializeToString()).run(["y", "y_h"], {"x": x.transpose(1, 0, 2).copy()})
        want = [y.transpose(2, 0, 1, 3), y_h.transpose(1, 0, 2)]
    else:
        want = cpu_session(model.SerializeToString()).run(["y", "y_h"], {"x": x})
    for w, g in zip(want, got):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    trained = {"w", "r"} | ({"b"} if bias else set()) | ({"h0"} if initial else set())
    grads = cpu_session(gradient_model(rewritten.SerializeToString(), "loss", trained).SerializeToString()).run([f"{t}_grad" for t in sorted(trained)], {"x": x})
    assert all(np.abs(g).sum() > 0 for g in grads)


def _lstm(direction: str, peepholes: bool, lengths: bool = False) -> onnx.ModelProto:
    """An LSTM (initial states, bias, optionally peepholes or sequence lengths) whose three outputs sum into the loss."""
    seq, batch, inputs, hidden, dirs = 5, 2, 3, 4, 2 if direction == "bidirectional" else 1
    shapes = {"w": (dirs, 4 * hidden, inputs), "r": (dirs, 4 * hidden, hidden), "b": (dirs, 8 * hidden), "h0": (dirs, batch, hidden),
              "c0": (dirs, batch, hidden), "p": (dirs, 3 * hidden)}
    inits = [numpy_helper.from_array((RNG.normal(size=shape) / 2).astype(np.float32), name) for name, shape in shapes.items()
             if name != "p" or peepholes]
    if lengths:
        inits.append(numpy_helper.from_array(np.full(batch, seq, np.int32), "len"))
    names = ["x", "w", "r", "b", "len" if lengths else "", "h0", "c0", "p" if peepholes else ""]
    nodes = [helper.make_node("LSTM", names, ["y", "y_h", "y_c"], name="lstm", hidden_size=hidden, direction=direction),
             *(helper.make_node("ReduceSum", [o], [f"s{o}"], name=f"s{o}", keepdims=0) for o in ("y", "y_h", "y_c")),
             helper.make_node("Add", ["sy", "sy_h"], ["s2"], name="a2"), helper.make_node("Add", ["s2", "sy_c"], ["loss"], name="loss")]
    outs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []), helper.make_tensor_value_info("y", TensorProto.FLOAT, [seq, dirs, batch, hidden]),
            *(helper.make_tensor_value_info(o, TensorProto.FLOAT, [dirs, batch, hidden]) for o in ("y_h", "y_c"))]
    return _model(nodes, [helper.make_tensor_value_info("x", TensorProto.FLOAT, [seq, batch, inputs])], outs, inits)


@pytest.mark.parametrize("direction,peepholes", [("bidirectional", False), ("reverse", True), ("bidirectional", True)])
def test_backward_lstm_unrolled_computes_the_op_and_trains(direction: str, peepholes: bool) -> None:
    """onnxruntime-training 1.19.2's LSTMGrad runs forward LSTMs only (torch's bidirectional=True failed to load with
    an internal error): reverse and bidirectional ones are unrolled, compute onnxruntime's LSTM values (all three
    outputs) and every weight, bias, initial state and peephole gets the gradient central differences give."""
    model = _lstm(direction, peepholes)
    rewritten, done = rewrite_for_training(model)
    assert [r.pattern for r in done] == ["LSTM -> its steps unrolled"]
    x = RNG.normal(size=(5, 2, 3)).astype(np.float32)
    for got, want in zip(cpu_session(rewritten.SerializeToString()).run(["y", "y_h", "y_c"], {"x": x}),
                         cpu_session(model.SerializeToString()).run(["y", "y_h", "y_c"], {"x": x})):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    trained = sorted(t.name for t in model.graph.initializer)
    grads = dict(zip(trained, cpu_session(gradient_model(rewritten.SerializeToString(), "loss", set(trained)).SerializeToString()).run(
        [f"{t}_grad" for t in trained], {"x": x})))
    for t in model.graph.initializer:
        base = numpy_helper.to_array(t)
        for flat in RNG.choice(base.size, size=3, replace=False):
            values = []
            for sign in (1.0, -1.0):
                probe = onnx.ModelProto()
                probe.CopyFrom(model)
                changed = base.astype(np.float64)
                changed.flat[flat] += sign * 1e-2
                next(i for i in probe.graph.initializer if i.name == t.name).CopyFrom(numpy_helper.from_array(changed.astype(np.float32), t.name))
                values.append(float(cpu_session(probe.SerializeToString()).run(["loss"], {"x": x})[0]))
            assert grads[t.name].flat[flat] == pytest.approx((values[0] - values[1]) / 2e-2, rel=2e-2, abs=2e-2), (t.name, flat)


def test_a_forward_lstm_is_left_to_onnxruntime_and_one_it_cannot_train_is_named() -> None:
    assert rewrite_for_training(_lstm("forward", False))[1] == ()
    assert [m.op_type for m in missing_gradients(_lstm("forward", False))] == []
    assert [(m.op_type, m.nodes) for m in missing_gradients(_lstm("reverse", False, lengths=True))] == [("LSTM", ("lstm",))]


EINSUMS = [  # (equation, x shape, kernel shape or None for one operand, output shape)
    ("btd,dhe->bthe", [2, 3, 8], [8, 4, 6], [2, 3, 4, 6]),
    ("bik,bkj->bij", [2, 3, 4], [2, 4, 5], [2, 3, 5]),
    ("ij,jk", [3, 4], [4, 2], [3, 2]),
    ("...ij,jk->...ik", [2, 3, 4], [4, 5], [2, 3, 5]),
    ("bij,bij->b", [2, 3, 4], [2, 3, 4], [2]),
    ("bxi,jy->byi", [2, 3, 4], [5, 6], [2, 6, 4]),
    ("bij->bji", [2, 3, 4], None, [2, 4, 3]),
    ("bij->j", [2, 3, 4], None, [4]),
]


@pytest.mark.parametrize("equation,x_shape,k_shape,y_shape", EINSUMS, ids=[e[0] for e in EINSUMS])
def test_einsum_trains_as_transposes_and_a_matmul(equation: str, x_shape: list[int], k_shape: list[int] | None, y_shape: list[int]) -> None:
    """onnxruntime-training 1.19.2 has no Einsum gradient and both torch exporters keep torch.einsum as Einsum:
    written as Transpose, ReduceSum, Reshape and MatMul it computes Einsum's values and trains (letters each
    operand sums alone, a batch, an implicit output and an ellipsis included)."""
    inits = [numpy_helper.from_array(RNG.normal(size=k_shape).astype(np.float32), "kernel")] if k_shape else []
    node = helper.make_node("Einsum", ["scaled"] + (["kernel"] if k_shape else []), ["y"], name="einsum", equation=equation)
    model = _linear_op_model(node, x_shape, inits, y_shape, opset=17)
    assert missing_gradients(model, {"w"}) == ()
    _assert_rewritten_like_the_op(model, "Einsum -> Transpose, ReduceSum, Reshape, MatMul", ("w", "kernel") if k_shape else ("w",), exact=False)


SPACE_AND_EXTREMES = [  # (node, x shape, inputs' constants, y shape, opset, pattern)
    (helper.make_node("DepthToSpace", ["scaled"], ["y"], name="op", blocksize=2), [2, 8, 3, 3], [], [2, 2, 6, 6], 17, "DepthToSpace -> Reshape, Transpose, Reshape"),
    (helper.make_node("DepthToSpace", ["scaled"], ["y"], name="op", blocksize=2, mode="CRD"), [1, 8, 2, 3], [], [1, 2, 4, 6], 17,
     "DepthToSpace -> Reshape, Transpose, Reshape"),
    (helper.make_node("SpaceToDepth", ["scaled"], ["y"], name="op", blocksize=2), [2, 3, 4, 6], [], [2, 12, 2, 3], 17, "SpaceToDepth -> Reshape, Transpose, Reshape"),
    (helper.make_node("ReduceMax", ["scaled"], ["y"], name="op", axes=[1], keepdims=0), [2, 5, 3], [], [2, 3], 17, "ReduceMax -> TopK over the reduced axes"),
    (helper.make_node("ReduceMax", ["scaled", "axes"], ["y"], name="op"), [2, 5, 3, 2], [("axes", [1, 3])], [2, 1, 3, 1], 18, "ReduceMax -> TopK over the reduced axes"),
    (helper.make_node("ReduceMin", ["scaled"], ["y"], name="op", keepdims=0), [2, 5, 3], [], [], 17, "ReduceMin -> TopK over the reduced axes"),
    (helper.make_node("GlobalMaxPool", ["scaled"], ["y"], name="op"), [2, 3, 4, 4], [], [2, 3, 1, 1], 17, "GlobalMaxPool -> TopK over the reduced axes"),
]


@pytest.mark.parametrize("node,x_shape,consts,y_shape,opset,pattern", SPACE_AND_EXTREMES, ids=[f"{c[0].op_type}-{i}" for i, c in enumerate(SPACE_AND_EXTREMES)])
def test_pixel_shuffle_and_max_reductions_train(node: onnx.NodeProto, x_shape: list[int], consts: list, y_shape: list[int], opset: int, pattern: str) -> None:
    """onnxruntime-training 1.19.2 has no gradient for DepthToSpace (PixelShuffle's export), SpaceToDepth, ReduceMax,
    ReduceMin or GlobalMaxPool (torch.amax and a dynamo-exported AdaptiveMaxPool2d): as Reshape/Transpose and as
    TopK(k=1) over the reduced axes they compute the same values and train."""
    inits = [numpy_helper.from_array(np.array(v, np.int64), name) for name, v in consts]
    model = _linear_op_model(node, x_shape, inits, y_shape, opset)
    assert missing_gradients(model) == ()
    _assert_rewritten_like_the_op(model, pattern, ("w",), exact=True, step=1.0 if "Space" in pattern else 1e-3)


FUNCTION_OPS = [  # (op, attributes, extra input constants, opset)
    ("HardSwish", {}, [], 17), ("HardSigmoid", {"alpha": 0.3}, [], 20), ("Elu", {"alpha": 0.7}, [], 17), ("Selu", {}, [], 20),
    ("Celu", {"alpha": 1.5}, [], 17), ("Softplus", {}, [], 20), ("Mish", {}, [], 18), ("Softsign", {}, [], 17),
    ("PRelu", {}, [("slope", np.array([0.25, 0.1, -0.2], np.float32).reshape(3, 1, 1))], 17), ("ThresholdedRelu", {"alpha": 0.2}, [], 17),
]


@pytest.mark.parametrize("op,attrs,consts,opset", FUNCTION_OPS, ids=[f[0] for f in FUNCTION_OPS])
def test_function_ops_train_as_their_onnx_function_bodies(op: str, attrs: dict, consts: list, opset: int) -> None:
    """HardSwish, HardSigmoid, Elu, Selu, Celu, Softplus, Mish, Softsign, PRelu, ThresholdedRelu: the ONNX spec defines
    each as a function of simpler ops, onnxruntime-training 1.19.2 has no gradient for them, and both torch exporters
    write them (MobileNetV3's activations, ELU, Mish...). Inlined as their function bodies (HardSwish's calls
    HardSigmoid's), they compute their values and train, the attributes given or the spec's defaults substituted."""
    inits = [numpy_helper.from_array(v, name) for name, v in consts]
    node = helper.make_node(op, ["scaled", *(name for name, _ in consts)], ["y"], name="act", **attrs)
    model = _linear_op_model(node, [2, 3, 4, 4], inits, [2, 3, 4, 4], opset)
    assert missing_gradients(model) == ()
    rewritten, done = rewrite_for_training(model)
    assert any(r.pattern == f"{op} -> its ONNX function body" for r in done)
    _assert_rewritten_like_the_op(model, [r.pattern for r in done], ("w", *(name for name, _ in consts)), exact=False, step=1e-3)


@pytest.mark.parametrize("op", ["Sum", "Mean"])
def test_sum_and_mean_of_several_tensors_train_as_adds(op: str) -> None:
    """onnxruntime-training 1.19.2 has no gradient for the variadic Sum and Mean: as Adds (and a Div) they broadcast
    alike and train."""
    inits = [numpy_helper.from_array(RNG.normal(size=s).astype(np.float32), n) for n, s in (("k1", [3, 1]), ("k2", [1, 4]))]
    node = helper.make_node(op, ["scaled", "k1", "k2"], ["y"], name="op")
    model = _linear_op_model(node, [2, 3, 4], inits, [2, 3, 4], 17)
    _assert_rewritten_like_the_op(model, f"{op} -> Add", ("w", "k1", "k2"), exact=False)


@pytest.mark.parametrize("axis,exclusive,reverse", [(2, 0, 0), (-2, 1, 0), (0, 0, 1), (1, 1, 1)])
def test_cumsum_trains_as_a_triangular_matmul(axis: int, exclusive: int, reverse: int) -> None:
    """onnxruntime-training 1.19.2 has no CumSum gradient: a MatMul by a triangular matrix of ones along the axis
    computes it (exclusive and reverse included) and trains."""
    node = helper.make_node("CumSum", ["scaled", "axis"], ["y"], name="op", exclusive=exclusive, reverse=reverse)
    model = _linear_op_model(node, [2, 3, 4], [numpy_helper.from_array(np.array(axis, np.int64), "axis")], [2, 3, 4], 17)
    assert missing_gradients(model) == ()
    _assert_rewritten_like_the_op(model, "CumSum -> MatMul by a triangular matrix", ("w",), exact=False)
