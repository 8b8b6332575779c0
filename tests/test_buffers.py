"""What the dynamo exporter stores beside the parameters is held, not trained: buffers, lifted constants, and
tensors it folded from constants alone (its value_info metadata says which). Tensors folded from a parameter
stay trained. The mark travels into the stage files, where the trainer reads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.buffers import exporter_constants
from onnxpipe.graph import load
from onnxpipe.nodes import is_held, trained_initializers
from onnxpipe.split import split

KIND = "pkg.torch.export.graph_signature.InputSpec.kind"
FOLDED = "pkg.onnxscript.optimizer.folded_from"


def _exported() -> onnx.ModelProto:
    """x [2, 4] -> MatMul w (a parameter) -> Mul freq (a buffer) -> Add fill (folded from constants) -> MatMul
    folded (the exporter's transpose of a parameter) -> Add lifted (a lifted constant)."""
    rng = np.random.default_rng(1)
    names = ["w", "freq", "fill", "folded", "lifted"]
    inits = [numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), name)
             for name, shape in zip(names, [(4, 4), (4,), (4,), (4, 4), (4,)])]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["a"], name="mm"),
             helper.make_node("Mul", ["a", "freq"], ["b"], name="rotate"),
             helper.make_node("Add", ["b", "fill"], ["c"], name="shift"),
             helper.make_node("MatMul", ["c", "folded"], ["d"], name="mm2"),
             helper.make_node("Add", ["d", "lifted"], ["y"], name="bias")]
    graph = helper.make_graph(nodes, "exported", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    meta = {"w": {KIND: "PARAMETER"}, "freq": {KIND: "BUFFER"}, "fill": {FOLDED: "['val_0', 'attn.lifted_tensor_0', 'conv2d']"},
            "folded": {FOLDED: "['layer.weight', 'val_3']"}, "lifted": {KIND: "CONSTANT_TENSOR"}}
    for t in inits:
        vi = helper.make_tensor_value_info(t.name, TensorProto.FLOAT, list(t.dims))
        for key, value in meta[t.name].items():
            vi.metadata_props.add(key=key, value=value)
        graph.value_info.append(vi)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_buffers_constants_and_constant_folds_are_held() -> None:
    assert exporter_constants(_exported()) == {"freq": "the exporter's buffer", "fill": "folded by the exporter from constants",
                                               "lifted": "the exporter's lifted constant"}
    assert load(_exported()).trained == ("folded", "w")


def test_the_mark_travels_into_stage_files(tmp_path: Path) -> None:
    from test_train import even_plan

    graph = load(_exported())
    split(graph, even_plan(graph, 2), tmp_path / "stages")
    held, trained = set(), set()
    for stage in sorted((tmp_path / "stages").glob("stage_*.onnx")):
        model = onnx.load(str(stage))
        held |= {t.name for t in model.graph.initializer if is_held(t)}
        trained |= trained_initializers(model.graph)
    assert held == {"freq", "fill", "lifted"} and trained == {"w", "folded"}


SIGNATURE = "pkg.torch.export.ExportedProgram.graph_signature"


def test_with_the_graph_signature_a_fold_of_buffers_is_held() -> None:
    """The signature says which dotted names are parameters: nn.MultiheadAttention's causal-mask buffer folded into
    its additive mask is held (trained, the mask itself moved: 1.1e-5 off torch's losses after 3 steps, 8e-8 held),
    and a transposed parameter stays trained."""
    model = _exported()
    next(vi for vi in model.graph.value_info if vi.name == "fill").metadata_props[0].value = "['attn.mask', 'val_2']"
    assert "fill" not in exporter_constants(model)  # without the signature a dotted name may be a parameter
    signature = ("\n# inputs\np_w: PARAMETER target='w'\np_layer_weight: PARAMETER target='layer.weight'\n"
                 "b_attn_mask: BUFFER target='attn.mask' persistent=True\nx: USER_INPUT\n\n# outputs\ny: USER_OUTPUT\n")
    model.graph.metadata_props.add(key=SIGNATURE, value=signature)
    assert exporter_constants(model)["fill"] == "folded by the exporter from constants"
    assert load(model).trained == ("folded", "w")


def _norms(signature: bool) -> onnx.ModelProto:
    """x -> MatMul w (module m.l) -> Mul scale (module m.rms) -> Mul scale (module m.ln): the dynamo exporter merges an
    RMSNorm's weight and a LayerNorm-without-affine's ones into one tensor named after the parameter, and the
    LayerNorm reads it first."""
    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 4)).astype(np.float32), "m.l.weight"),
             numpy_helper.from_array(np.ones(4, np.float32), "m.rms.weight")]
    nodes = [helper.make_node("MatMul", ["x", "m.l.weight"], ["a"], name="node_linear"),
             helper.make_node("Mul", ["a", "m.rms.weight"], ["b"], name="node_ln"),
             helper.make_node("Mul", ["b", "m.rms.weight"], ["y"], name="node_rms")]
    for node, module in zip(nodes, ("m.l", "m.ln", "m.rms")):
        node.metadata_props.add(key="pkg.torch.onnx.name_scopes", value=repr(["", module, node.name]))
    graph = helper.make_graph(nodes, "norms", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])], inits)
    if signature:
        graph.metadata_props.add(key=SIGNATURE, value="\n# inputs\np_m_l_weight: PARAMETER target='m.l.weight'\n"
                                                      "p_m_rms_weight: PARAMETER target='m.rms.weight'\nx: USER_INPUT\n")
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)], ir_version=10)


def test_a_constant_merged_with_a_parameter_is_held_once_untied() -> None:
    """Untied, the parameter's own module keeps its name (though the LayerNorm reads it first) and the LayerNorm's copy,
    for a module the signature gives no parameter, is held: trained, nn.LayerNorm(elementwise_affine=False) gained a
    scale torch's has not (1.6e-2 off PyTorch's SGD losses after 3 steps, 1.5e-7 held). Without a signature the copy
    stays trained, as a module's weight may be."""
    graph = load(_norms(signature=True))
    assert graph.trained == ("m.l.weight", "m.rms.weight")
    assert [n.input[1] for n in graph.model.graph.node if n.name in ("node_ln", "node_rms")] == ["m.ln.weight", "m.rms.weight"]
    assert load(_norms(signature=False)).trained == ("m.l.weight", "m.ln.weight", "m.rms.weight")
