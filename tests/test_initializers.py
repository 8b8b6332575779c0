"""Weights read by several nodes: a real tie and a reuse inside one module stay shared, an exporter's merge of
constant-valued tensors across modules is untied into one copy per module, and the user can override both."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.initializers import TieChoice, describe, module_of, shared_initializers, untie


def _scoped(node: onnx.NodeProto, module: str) -> onnx.NodeProto:
    """The dynamo exporter's record of where a node came from."""
    entry = node.metadata_props.add()
    parts = module.split(".")
    scopes = ["", *(".".join(parts[: i + 1]) for i in range(len(parts))), node.name]
    entry.key, entry.value = "pkg.torch.onnx.name_scopes", repr(scopes)
    return node


def _model() -> onnx.ModelProto:
    """Embedding table `wte` gathered in `embed` and read again as the output projection in `head` (a tie),
    one all-ones LayerNorm scale read by LayerNorms of two blocks (a merge), and one weight matrix multiplied
    twice inside module `block0.mlp` (a reuse)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.normal(size=(16, 4)).astype(np.float32), "wte"),
        numpy_helper.from_array(np.ones(4, np.float32), "block0.ln.weight"),
        numpy_helper.from_array(np.zeros(4, np.float32), "block0.ln.bias"),
        numpy_helper.from_array(rng.normal(size=(4, 4)).astype(np.float32), "block0.mlp.weight"),
    ]
    nodes = [
        _scoped(helper.make_node("Gather", ["wte", "ids"], ["h0"], name="embed_gather"), "embed"),
        _scoped(helper.make_node("LayerNormalization", ["h0", "block0.ln.weight", "block0.ln.bias"], ["h1"], name="ln0", axis=-1), "block0.ln"),
        _scoped(helper.make_node("MatMul", ["h1", "block0.mlp.weight"], ["h2"], name="mm0"), "block0.mlp"),
        _scoped(helper.make_node("MatMul", ["h2", "block0.mlp.weight"], ["h3"], name="mm1"), "block0.mlp"),
        _scoped(helper.make_node("LayerNormalization", ["h3", "block0.ln.weight", "block0.ln.bias"], ["h4"], name="ln1", axis=-1), "block1.ln"),
        _scoped(helper.make_node("Transpose", ["wte"], ["wte_t"], name="head_t", perm=[1, 0]), "head"),
        _scoped(helper.make_node("MatMul", ["h4", "wte_t"], ["logits"], name="head_mm"), "head"),
    ]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, 16])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _run(model: onnx.ModelProto, ids: np.ndarray) -> np.ndarray:
    from onnxpipe.ortutil import cpu_session

    return cpu_session(model.SerializeToString()).run(None, {"ids": ids})[0]


def test_tie_merge_and_reuse_are_told_apart() -> None:
    kinds = {s.name: (s.kind, s.untied) for s in shared_initializers(_model())}
    assert kinds == {
        "wte": ("tie", False),
        "block0.ln.weight": ("merge", True),
        "block0.ln.bias": ("merge", True),
        "block0.mlp.weight": ("reuse", False),
    }


def test_untying_gives_each_module_a_copy_named_after_it_and_keeps_outputs() -> None:
    model = _model()
    graph = load(model)
    assert graph.untied == ("block0.ln.weight", "block0.ln.bias")
    names = set(graph.initializers)
    assert {"block0.ln.weight", "block0.ln.bias", "block1.ln.weight", "block1.ln.bias"} <= names
    assert graph.node("ln1").input[1:] == ["block1.ln.weight", "block1.ln.bias"]
    assert graph.node("ln0").input[1:] == ["block0.ln.weight", "block0.ln.bias"]
    assert graph.consumers("wte") == ("embed_gather", "head_t")  # the tie stays one tensor
    ids = np.array([[1, 2, 3], [4, 5, 15]], np.int64)
    assert np.array_equal(_run(model, ids), _run(graph.model, ids))


def test_overrides_per_tensor() -> None:
    graph = load(_model(), ties=TieChoice.of(tie=["block0.ln.bias"], untie=["wte"]))
    assert set(graph.untied) == {"wte", "block0.ln.weight"}
    assert graph.node("head_t").input[0] == "head.wte"
    assert graph.node("ln1").input[2] == "block0.ln.bias"


def test_exact_choice_reproduces_a_record() -> None:
    recorded = load(_model()).untied
    again = load(_model(), ties=TieChoice(untie=frozenset(recorded), exact=True))
    assert again.untied == recorded


def test_unknown_override_names_the_shared_weights() -> None:
    with pytest.raises(OnnxpipeError, match=r"--tie/--untie nope: not a weight read by several nodes .*block0.ln.bias"):
        load(_model(), ties=TieChoice.of(untie=["nope"]))
    with pytest.raises(OnnxpipeError, match="both given"):
        TieChoice.of(tie=["wte"], untie=["wte"])


def test_module_from_torchscript_node_names_and_unknown() -> None:
    assert module_of(helper.make_node("Relu", ["a"], ["b"], name="/blocks/layers.0/norm1/LayerNormalization")) == "blocks.layers.0.norm1"
    assert module_of(helper.make_node("Relu", ["a"], ["b"], name="relu_3")) is None


def test_untie_without_modules_numbers_the_copies() -> None:
    model = _model()
    for node in model.graph.node:
        del node.metadata_props[:]
    shared = {s.name: s for s in shared_initializers(model)}
    assert shared["block0.mlp.weight"].kind == "tie"  # nothing says both reads are one module: kept
    assert shared["block0.ln.weight"].untied
    out = untie(model, ["block0.ln.weight"])
    assert [t.name for t in out.graph.initializer][-1] == "block0.ln.weight.1"


def _copied(external: Path | None = None) -> onnx.ModelProto:
    """The TorchScript exporter's form of a tied head: `embed.weight` [16, 4] gathered, and its transpose written as a
    weight of its own, `onnx::MatMul_7` [4, 16], read by the head; beside them a square weight and its transpose,
    which are never taken for a copy. With `external`, the weights are written to disk there (only references kept)."""
    rng = np.random.default_rng(1)
    wte, square = rng.normal(size=(16, 4)).astype(np.float32), rng.normal(size=(4, 4)).astype(np.float32)
    inits = [numpy_helper.from_array(wte, "embed.weight"), numpy_helper.from_array(square, "mix.weight"),
             numpy_helper.from_array(np.ascontiguousarray(square.T), "onnx::MatMul_5"), numpy_helper.from_array(np.ascontiguousarray(wte.T), "onnx::MatMul_7")]
    nodes = [helper.make_node("Gather", ["embed.weight", "ids"], ["h0"], name="/embed/Gather"),
             helper.make_node("MatMul", ["h0", "mix.weight"], ["h1"], name="/mix/MatMul"),
             helper.make_node("MatMul", ["h1", "onnx::MatMul_5"], ["h2"], name="/unmix/MatMul"),
             helper.make_node("MatMul", ["h2", "onnx::MatMul_7"], ["logits"], name="/head/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, [2, 3])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [2, 3, 16])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)
    if external is not None:
        onnx.save(model, str(external), save_as_external_data=True, all_tensors_to_one_file=True, location="weights.bin", size_threshold=0)
        return onnx.load(str(external), load_external_data=False)
    return model


@pytest.mark.parametrize("on_disk", [False, True])
def test_a_transposed_copy_is_tied_back_and_computes_the_same(on_disk: bool, tmp_path: Path) -> None:
    model = _copied(tmp_path / "m.onnx" if on_disk else None)
    shared = shared_initializers(model, base_dir=tmp_path if on_disk else None)
    assert [(s.name, s.kind, s.of, s.untied) for s in shared] == [("onnx::MatMul_7", "copy", "embed.weight", False)]
    assert "tied back 1 transposed copy (onnx::MatMul_7 = embed.weight transposed)" in describe(shared)
    graph = load(tmp_path / "m.onnx" if on_disk else model)
    assert "onnx::MatMul_7" not in {t.name for t in graph.model.graph.initializer}
    made = [n for n in graph.model.graph.node if "onnx::MatMul_7" in n.output]
    assert [(n.op_type, list(n.input)) for n in made] == [("Transpose", ["embed.weight"])]
    ids = np.array([[0, 5, 15], [3, 3, 9]], np.int64)
    reference = _copied()
    assert np.array_equal(_run(graph.model if not on_disk else _with_weights(graph.model, tmp_path), ids), _run(reference, ids))


def _with_weights(model: onnx.ModelProto, base: Path) -> onnx.ModelProto:
    from onnxpipe.protostream import load_weights

    out = onnx.ModelProto()
    out.CopyFrom(model)
    load_weights(out, base)
    return out


def test_untie_keeps_a_copy_apart() -> None:
    shared = shared_initializers(_copied(), TieChoice.of(untie=["onnx::MatMul_7"]))
    assert [(s.name, s.untied) for s in shared] == [("onnx::MatMul_7", True)]
    assert "kept apart 1 transposed copy" in describe(shared)
    assert "onnx::MatMul_7" in {t.name for t in load(_copied(), ties=TieChoice.of(untie=["onnx::MatMul_7"])).model.graph.initializer}


def test_fills_are_never_copies() -> None:
    """Zeros equal any zeros' transpose (a model written sparse, weights not yet drawn): no evidence of a tie."""
    model = _copied()
    for tensor in model.graph.initializer:
        if tensor.name in ("embed.weight", "onnx::MatMul_7"):
            tensor.CopyFrom(numpy_helper.from_array(np.zeros(tuple(tensor.dims), np.float32), tensor.name))
    assert [s for s in shared_initializers(model) if s.kind == "copy"] == []


def test_a_row_and_its_column_are_not_compared() -> None:
    """A [1, n] weight and an [n, 1] one (a bias and a projection) pair up by shape; neither is taken for a copy."""
    row = np.arange(1, 17, dtype=np.float32).reshape(1, 16)
    inits = [numpy_helper.from_array(row, "bias"), numpy_helper.from_array(np.ascontiguousarray(row.T), "onnx::MatMul_3")]
    nodes = [helper.make_node("Add", ["x", "bias"], ["h"], name="/a/Add"), helper.make_node("MatMul", ["h", "onnx::MatMul_3"], ["y"], name="/b/MatMul")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 1])], inits)
    assert shared_initializers(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)) == ()
