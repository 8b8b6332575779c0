"""A stage's backward split into B (input gradients) and W (weight gradients): on every trainable zoo
model, B then W gives the fused backward's gradients, and B alone the input gradients the previous
stage waits for."""

from __future__ import annotations

import numpy as np
import pytest
from test_train import M, REWRITTEN, SGD, TRAINABLE, batches, stage_dir

from onnxpipe.ortutil import cpu_session
from onnxpipe.train.graphs import grad_input_name, grad_name
from onnxpipe.train.prepare import TrainConfig, prepare_stages
from onnxpipe.train.splitgrad import left_bytes, split_backward

CASES = [(name, "never") for name in TRAINABLE + REWRITTEN] + [("gpt2-tiny", "always"), ("resnet-bn", "always")]


def _run(model: bytes, feeds: dict[str, np.ndarray], optimize: bool) -> dict[str, np.ndarray]:
    session = cpu_session(model, threads=1, optimize=optimize)
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {i.name: feeds[i.name] for i in session.get_inputs()})))


@pytest.mark.parametrize(("name", "recompute"), CASES, ids=["-".join(c) for c in CASES])
def test_b_then_w_gives_the_fused_backward(name: str, recompute: str) -> None:
    directory, manifest = stage_dir(name, 3)
    config = TrainConfig(microbatches=M, optimizer=SGD, recompute=recompute)
    values = dict(batches(name, manifest, config, steps=1)[0][0])
    rng = np.random.default_rng(0)
    deferred = 0
    for spec in prepare_stages(directory, manifest, config):
        g = spec.graphs
        values.update(_run(g.forward, {**values, **g.initial}, optimize=True))
        if g.backward is None:
            continue
        feeds = {**values, **g.initial}
        for o in g.grad_outputs:  # any output gradient will do: the same one goes to both
            feeds[grad_input_name(o)] = rng.standard_normal(values[o].shape).astype(values[o].dtype)
        split = split_backward(g)
        assert set(split.b_trained) | set(split.w_trained) == set(g.trained) and not set(split.b_trained) & set(split.w_trained)
        assert set(split.b_inputs) <= set(g.backward_inputs) | {grad_input_name(o) for o in g.grad_outputs}
        wanted = [grad_name(x) for x in g.grad_inputs + g.trained]
        for optimize in (False, True):
            fused = _run(g.backward, feeds, optimize)
            got = _run(split.b, feeds, optimize) if split.b else {}
            assert (split.b is None) == (not g.grad_inputs)
            if split.w:
                got.update(_run(split.w, {**feeds, **{x: got[x] for x in split.left}}, optimize))
            for x in wanted:
                if optimize:  # onnxruntime fuses nodes across the cut differently: equal to float rounding
                    np.testing.assert_allclose(got[x], fused[x], rtol=1e-5, atol=1e-7, err_msg=x)
                else:  # the same nodes on the same inputs: bit for bit
                    np.testing.assert_array_equal(got[x], fused[x], err_msg=x)
        deferred += len(split.w_trained)
        held = left_bytes(split, {**feeds, **got})
        assert held >= sum(got[x].nbytes for x in split.left)
    # Every model defers some weight gradients to W (the first stage's, at least).
    assert deferred > 0


@pytest.mark.parametrize("name", ["mlp", "resnet-tiny", "inception-tiny"])
def test_conv_and_matmul_weight_gradients_all_wait_for_w(name: str) -> None:
    # ConvGrad makes dX, dW and dB in one node: it is cut in two, so B makes no weight gradient.
    directory, manifest = stage_dir(name, 3)
    specs = prepare_stages(directory, manifest, TrainConfig(microbatches=M, optimizer=SGD))
    splits = [split_backward(s.graphs) for s in specs if s.graphs.backward]
    assert all(sp.b_trained == () for sp in splits)
    assert sum(len(sp.w_trained) for sp in splits) == sum(len(s.graphs.trained) for s in specs)


@pytest.mark.parametrize("name", ["mlp", "gpt2-tiny", "two-io"])
def test_priced_w_is_what_the_split_leaves_to_w(name: str) -> None:
    """The pricing's W (`pricing.stage`) follows the trainer's split: a stage whose B makes no input gradient is priced
    with its whole backward in W, one whose B runs nodes with part of it in B."""
    from test_train import even_plan, graph_of

    from onnxpipe.cost import annotate
    from onnxpipe.plan import evaluate
    from onnxpipe.pricing.problem import build_problem
    from onnxpipe.pricing.stage import Assignment
    from onnxpipe.target import load_target

    directory, manifest = stage_dir(name, 3)
    graph = graph_of(name)
    problem = build_problem(graph, annotate(graph), load_target("gpu4"), batch=graph.batch * M, microbatches=M, schedule="zb-h1")
    assignment = Assignment(tuple(s.nodes for s in even_plan(graph, 3).stages), tuple((f"v100_{i}",) for i in range(3)), (False,) * 3)
    priced = evaluate(problem, assignment)
    specs = [s for s in prepare_stages(directory, manifest, TrainConfig(microbatches=M, optimizer=SGD)) if s.replica == 0]
    for spec, stage in zip(specs, priced.stages):
        if spec.graphs.backward is None:
            continue
        split = split_backward(spec.graphs)
        if split.b is None:
            assert stage.weight_seconds == pytest.approx(stage.backward_seconds), stage.index
        else:
            assert 0 < stage.weight_seconds < stage.backward_seconds, stage.index
    assert split_backward(specs[0].graphs).b is None


@pytest.mark.parametrize("name", ["mlp", "resnet-tiny"])
def test_no_gradient_of_a_model_input_is_made_or_priced(name: str) -> None:
    """Training makes no gradient of a model input: no stage's backward returns one, the profile's gradient graph asks
    none, and the FLOP rule gives a first Gemm or Conv its weight gradient alone (one GEMM; two for those after it)."""
    from test_train import graph_of

    from onnxpipe.cost import annotate
    from onnxpipe.cost_profile import _training_model

    directory, manifest = stage_dir(name, 3)
    graph = graph_of(name)
    specs = prepare_stages(directory, manifest, TrainConfig(microbatches=M, optimizer=SGD))
    assert not {g for s in specs for g in s.graphs.grad_inputs} & set(graph.inputs)
    profiled = _training_model(graph, graph.model)
    assert profiled is not None
    made = {o.name for o in profiled[0].graph.output}
    assert any(o.endswith("_grad") for o in made) and not {f"{i}_grad" for i in graph.inputs} & made
    costs = annotate(graph)
    fed, computed = [], []
    for node in graph.compute_nodes:
        reads = set(graph.node_inputs(node))
        if graph.node(node).op_type in ("Gemm", "Conv") and reads & set(graph.trained):
            (fed if reads & set(graph.inputs) else computed).append(costs.nodes[node])
    assert len(fed) == 1 and computed
    assert fed[0].backward_flops == pytest.approx(fed[0].flops) and fed[0].flops > 0
    assert all(c.backward_flops == pytest.approx(2 * c.flops) for c in computed)
