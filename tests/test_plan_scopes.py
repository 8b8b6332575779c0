"""Coarsening follows module boundaries where the graph names them (the dynamo exporter's metadata,
TorchScript-style node names), never at the cost of live bytes, and refinement still reaches the
node-level optimum."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from test_plan import hand_costs, make_target

from onnxpipe.graph import load
from onnxpipe.plan import build_problem, evaluate
from onnxpipe.plan.coarsen import coarsen, live_bytes
from onnxpipe.plan.dp import solve_dp
from onnxpipe.plan.layout import to_assignment
from onnxpipe.plan.scopes import boundary_depths, module_path
from onnxpipe.plan.solve import solve

#: Two layers of two sublayers of two nodes each: the layer boundary falls after node 4 (of 8).
PATHS = [("layer0", "layer0.attn"), ("layer0", "layer0.attn"), ("layer0", "layer0.mlp"), ("layer0", "layer0.mlp"),
         ("layer1", "layer1.attn"), ("layer1", "layer1.attn"), ("layer1", "layer1.mlp"), ("layer1", "layer1.mlp")]


def _named_chain(style: str, widen: int | None = None) -> onnx.ModelProto:
    """8 nodes in a row under `PATHS`, named in `style`: "scopes" (dynamo's name_scopes metadata),
    "namespace" (dynamo's namespace metadata), "slashes" (TorchScript-style names), "none" (plain names).
    Relu nodes of width 16; node `widen` concatenates 4 copies (width 64 from there on)."""
    nodes, prev, width = [], "x", 16
    for i, path in enumerate(PATHS):
        name = f"/{'/'.join(path)}/Op_{i}" if style == "slashes" else f"node_op_{i}"
        if i == widen:
            node = helper.make_node("Concat", [prev] * 4, [f"t{i}"], name=name, axis=1)
            width *= 4
        else:
            node = helper.make_node("Relu", [prev], [f"t{i}"], name=name)
        if style == "scopes":
            helper.set_metadata_props(node, {"pkg.torch.onnx.name_scopes": repr(["", *path, f"op_{i}"])})
        elif style == "namespace":
            helper.set_metadata_props(node, {"namespace": "/".join([": Model", *(f"{p}: Block" for p in path), f"op_{i}: aten.op.default"])})
        nodes.append(node)
        prev = f"t{i}"
    graph = helper.make_graph(
        nodes, "named", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
        [helper.make_tensor_value_info(prev, TensorProto.FLOAT, [2, width])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _problem(model: onnx.ModelProto):  # type: ignore[no-untyped-def]
    graph = load(model)
    costs = hand_costs(graph, [1e9] * len(graph.compute_nodes))
    return build_problem(graph, costs, make_target([("a", 2, 1e12, 1e9)]), batch=graph.batch * 4, microbatches=4)


@pytest.mark.parametrize("style", ["scopes", "namespace", "slashes"])
def test_module_paths_are_read_from_metadata_or_names(style: str) -> None:
    model = _named_chain(style)
    assert [module_path(n) for n in model.graph.node] == PATHS


def test_a_node_without_a_path_sits_in_what_its_neighbours_share() -> None:
    model = _named_chain("scopes")
    del model.graph.node[2].metadata_props[:]  # as an optimiser's fused node comes out of the exporter
    graph = load(model)
    depths = boundary_depths(graph, graph.compute_nodes)
    # node 2 falls between layer0.attn and layer0.mlp: inside layer0, so no boundary of its own
    assert depths.tolist() == [0, 2, 1, 1, 0, 2, 1, 2, 0]


def test_boundary_depths_without_names_are_all_zero() -> None:
    graph = load(_named_chain("none"))
    assert not boundary_depths(graph, graph.compute_nodes).any()


@pytest.mark.parametrize("style", ["scopes", "namespace", "slashes"])
def test_blocks_end_at_the_layer_boundary_among_gaps_of_equal_live_bytes(style: str) -> None:
    named, plain = _problem(_named_chain(style)), _problem(_named_chain("none"))
    live = live_bytes(named)
    assert np.all(live[1:-1] == live[1])  # every gap of the chain carries one tensor of one size
    assert coarsen(plain, 2).starts.tolist() == [0, 2, 8]  # without names: the first gap of the window
    assert coarsen(named, 2).starts.tolist() == [0, 4, 8]  # with them: the layer boundary


def test_a_module_boundary_never_costs_live_bytes() -> None:
    problem = _problem(_named_chain("scopes", widen=3))  # the tensors from the layer boundary on are 4x wider
    blocks = coarsen(problem, 2)
    live = live_bytes(problem)
    assert blocks.starts.tolist() == [0, 2, 8]
    assert live[2] < live[4]


def test_refinement_reaches_the_node_level_optimum_from_module_blocks() -> None:
    graph = load(_named_chain("scopes"))
    flops = [1e9, 4e9, 1e9, 1e9, 3e9, 1e9, 2e9, 1e9]
    problem = build_problem(graph, hand_costs(graph, flops), make_target([("a", 3, 1e12, 1e9)]), batch=graph.batch * 4, microbatches=4)
    nodes = coarsen(problem, problem.n)
    optimum = evaluate(problem, to_assignment(problem, nodes, solve_dp(problem, nodes, 3))).bottleneck_seconds  # a chain: the DP is exact
    p = solve(problem, 3, max_blocks=3, time_limit=5)
    assert p.solver.blocks < problem.n
    assert p.bottleneck_seconds == pytest.approx(optimum, rel=1e-9)


def _encoder_decoder() -> onnx.ModelProto:
    """An encoder chain e0..e5 on x, then a decoder: d0..d11 on y alone, kv projects e5 (made long before, read by no node
    since), q and k read d11 side by side; in this order."""
    relu = lambda i, o: helper.make_node("Relu", [i], [o], name=o)  # noqa: E731
    nodes = [relu("x" if i == 0 else f"e{i - 1}", f"e{i}") for i in range(6)]
    nodes += [relu("y" if i == 0 else f"d{i - 1}", f"d{i}") for i in range(12)]
    nodes += [relu("e5", "kv"), relu("d11", "q"), relu("d11", "k"), helper.make_node("Sum", ["q", "k", "kv"], ["out"], name="out")]
    graph = helper.make_graph(nodes, "encdec", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [2, 16]) for n in ("x", "y")],
                              [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 16])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_node_starting_a_branch_of_its_own_starts_a_block() -> None:
    problem = _problem(_encoder_decoder())
    at = {name: i for i, name in enumerate(problem.nodes)}
    assert [at[n] for n in ("e5", "d0", "kv", "q", "k")] == [5, 6, 18, 19, 20]  # the order as written
    starts = coarsen(problem, 4).starts.tolist()
    # the decoder's first node, on its own input, and the projection of the encoder's output each start a block, wherever
    # the gaps of least live bytes fall; k, reading what q beside it reads, does not
    assert {at["d0"], at["kv"]} <= set(starts)
    assert at["k"] not in starts
    assert len(starts) < problem.n + 1  # still blocks, not nodes
