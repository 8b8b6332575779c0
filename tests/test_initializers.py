"""Weights read by several nodes: a real tie and a reuse inside one module stay shared, an exporter's merge of
constant-valued tensors across modules is untied into one copy per module, and the user can override both."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.initializers import TieChoice, module_of, shared_initializers, untie


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
