"""Properties over random DAG models (hypothesis): MatMul, Add, Mul, Relu, Tanh, Sigmoid, Concat and
Slice over 1-3 inputs of varying widths and batch, with skip connections (a node may read any earlier
tensor) and every dead end an output.

- plans: every compute node in exactly one stage, no edge from a later stage to an earlier one,
  memory within capacity, lower bound and solver bound <= the bottleneck;
- split: the chained stages compute what onnxruntime computes on the original model;
- training: the stages trained as a pipeline give the losses and weights of the unpartitioned model.

Profiles live in tests/conftest.py (`ci` by default; HYPOTHESIS_PROFILE=slow for a long search).
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from hypothesis import assume, given
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.cost import annotate
from onnxpipe.graph import Graph, load
from onnxpipe.plan import plan as make_plan
from onnxpipe.split import split
from onnxpipe.target import load_target

TARGET = load_target("fpga4")
UNARY = ("Relu", "Tanh", "Sigmoid")


@dataclass(frozen=True)
class RandomModel:
    model: onnx.ModelProto
    #: Stages to ask for (2..min(4, compute nodes)).
    stages: int


@st.composite
def random_models(draw: st.DrawFn, loss: bool = False) -> RandomModel:
    """A random DAG over [batch, width] tensors; with `loss`, a scalar loss summing every dead end's mean."""
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    batch = draw(st.integers(1, 4))
    widths: dict[str, int] = {}
    inputs, nodes, inits = [], [], []
    for i in range(draw(st.integers(1, 3))):
        widths[f"x{i}"] = draw(st.integers(2, 8))
        inputs.append(helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [batch, widths[f"x{i}"]]))

    def weight(name: str, shape: tuple[int, ...]) -> str:
        inits.append(numpy_helper.from_array((rng.standard_normal(shape) / np.sqrt(shape[0])).astype(np.float32), name))
        return name

    for k in range(draw(st.integers(2, 12))):
        pool = list(widths)
        a = draw(st.sampled_from(pool[-4:] if draw(st.booleans()) else pool))  # recent tensors mostly; any one is a skip
        op = draw(st.sampled_from(("MatMul", "Add", "Mul", *UNARY, "Concat", "Slice")))
        out, name = f"t{k}", f"n{k}_{op.lower()}"
        if op == "MatMul":
            w = draw(st.integers(2, 8))
            nodes.append(helper.make_node(op, [a, weight(f"w{k}", (widths[a], w))], [out], name=name))
            widths[out] = w
        elif op in ("Add", "Mul"):
            same = [t for t in pool if widths[t] == widths[a] and t != a]
            other = draw(st.sampled_from(same)) if same and draw(st.booleans()) else weight(f"b{k}", (widths[a],))
            nodes.append(helper.make_node(op, [a, other], [out], name=name))
            widths[out] = widths[a]
        elif op in UNARY:
            nodes.append(helper.make_node(op, [a], [out], name=name))
            widths[out] = widths[a]
        elif op == "Concat":
            b = draw(st.sampled_from(pool))
            nodes.append(helper.make_node(op, [a, b], [out], name=name, axis=1))
            widths[out] = widths[a] + widths[b]
        else:
            start = draw(st.integers(0, widths[a] - 1))
            end = draw(st.integers(start + 1, widths[a]))
            consts = [numpy_helper.from_array(np.array([v], np.int64), f"{out}_{label}") for label, v in (("s", start), ("e", end), ("ax", 1))]
            inits.extend(consts)
            nodes.append(helper.make_node(op, [a, *(c.name for c in consts)], [out], name=name))
            widths[out] = end - start
    read = {i for n in nodes for i in n.input}
    sinks = [n.output[0] for n in nodes if n.output[0] not in read]
    outputs = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [batch, widths[t]]) for t in sinks]
    if loss:
        terms = []
        for t in sinks:
            nodes.append(helper.make_node("ReduceMean", [t], [f"{t}_mean"], name=f"{t}_mean", keepdims=0))
            terms.append(f"{t}_mean")
        total = terms[0]
        for j, term in enumerate(terms[1:]):
            nodes.append(helper.make_node("Add", [total, term], [f"sum{j}"], name=f"sum{j}"))
            total = f"sum{j}"
        nodes.append(helper.make_node("Identity", [total], ["loss"], name="loss"))
        outputs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])]
    model = helper.make_model(helper.make_graph(nodes, "random", inputs, outputs, inits), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    compute = len(load(model).compute_nodes)  # nodes on the inputs alone are derived, placed by no plan
    assume(compute >= 2)
    return RandomModel(model, draw(st.integers(2, min(4, compute))))


def planned(case: RandomModel, microbatches: int = 2) -> tuple[Graph, object]:
    graph = load(case.model)
    return graph, make_plan(graph, annotate(graph), TARGET, stages=case.stages, microbatches=microbatches, time_limit=2)


@given(random_models())
def test_plans_keep_their_invariants(case: RandomModel) -> None:
    graph, plan = planned(case)
    stage_of: dict[str, int] = {}
    for stage in plan.stages:
        for node in stage.nodes:
            assert node not in stage_of, f"{node} in stages {stage_of[node]} and {stage.index}"
            stage_of[node] = stage.index
        assert stage.memory.total <= stage.memory.capacity
    assert set(stage_of) == set(graph.compute_nodes)
    for node in graph.compute_nodes:
        for tensor in graph.node_inputs(node):
            producer = graph.producer(tensor)
            if producer in stage_of:
                assert stage_of[producer] <= stage_of[node], f"{tensor}: stage {stage_of[producer]} -> {stage_of[node]}"
    slack = 1 + 1e-9
    assert plan.lower_bound_seconds <= plan.bottleneck_seconds * slack
    assert plan.solver.bound_seconds <= plan.bottleneck_seconds * slack
    assert 0 <= plan.solver.gap <= 1


@given(random_models(), st.integers(0, 2**16))
def test_chained_stages_equal_the_original(case: RandomModel, seed: int) -> None:
    import onnxruntime as ort

    from onnxpipe.chain import chain
    from onnxpipe.verify import relative_error

    graph, plan = planned(case)
    rng = np.random.default_rng(seed)
    feeds = {vi.name: rng.standard_normal([d.dim_value for d in vi.type.tensor_type.shape.dim]).astype(np.float32)
             for vi in case.model.graph.input}
    session = ort.InferenceSession(case.model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in case.model.graph.output]
    want = dict(zip(names, session.run(names, feeds)))
    with tempfile.TemporaryDirectory() as tmp:
        split(graph, plan, Path(tmp) / "stages")  # type: ignore[arg-type]
        got = chain(Path(tmp) / "stages", feeds)
    assert set(got) == set(want)
    for name in names:
        assert relative_error(got[name], want[name]) <= 1e-5, name


@given(random_models(loss=True))
def test_pipelined_training_equals_unpartitioned(case: RandomModel) -> None:
    from onnxpipe.manifest import Manifest
    from onnxpipe.train.data import SyntheticData, split_microbatches
    from onnxpipe.train.local import LocalPipeline
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.prepare import TrainConfig, model_inputs, prepare_single, prepare_stages

    m = 2
    graph, plan = planned(case, microbatches=m)
    config = TrainConfig(schedule="1f1b", microbatches=m, optimizer=OptimizerConfig("sgd", lr=0.1, momentum=0.9))
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp) / "stages"
        split(graph, plan, directory)  # type: ignore[arg-type]
        manifest = Manifest.read(directory)
        assert manifest.loss == "loss"
        pipe = LocalPipeline(prepare_stages(directory, manifest, config))
        ref = LocalPipeline([prepare_single(graph.model, config, manifest.loss)])
        source = SyntheticData(model_inputs(manifest, config), m, {}, seed=5)
        inputs = model_inputs(manifest, config)
        data = [split_microbatches(source.batch(s), inputs, m) for s in range(3)]
        losses = [pipe.train_step(mbs) for mbs in data]
        ref_losses = [ref.train_step(mbs) for mbs in data]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, atol=1e-7)
    got, want = pipe.parameters(), ref.parameters()
    assert set(got) == set(want)
    for name, value in want.items():
        np.testing.assert_allclose(got[name], value, rtol=1e-4, atol=1e-6, err_msg=name)
