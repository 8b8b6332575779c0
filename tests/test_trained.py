"""One rule for what training updates (`nodes.trained_initializers`): the trainer builds gradients for exactly
the weights pricing charges gradients, optimizer state and all-reduce for. Frozen weights (int8 behind a
DequantizeLinear, a ConstantOfShape fill, BatchNorm statistics) are held, at their real bytes, and no more."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxpipe.cost import annotate
from onnxpipe.graph import load
from onnxpipe.plan import build_problem, evaluate, plan
from onnxpipe.pricing.stage import Assignment
from onnxpipe.pricing.timemodel import allreduce_seconds
from onnxpipe.target import load_target
from onnxpipe.train.graphs import build_stage_graphs

ADAM = 2.0  # optimizer states per trained byte


def _frozen_model() -> onnx.ModelProto:
    """x -> MatMul(DequantizeLinear(int8 w_q)) -> * ConstantOfShape fill -> + b -> Relu -> MatMul(w2) -> mean: the loss.
    Trained: b (32 floats) and w2 (32 x 8 floats). Frozen: w_q (16 x 32 int8) and the fill (32 floats)."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.integers(-127, 127, size=(16, 32)).astype(np.int8), "w_q"),
        numpy_helper.from_array(np.array(0.02, np.float32), "w_scale"),
        numpy_helper.from_array(np.array(0, np.int8), "w_zero"),
        numpy_helper.from_array(np.array([32], np.int64), "fill_shape"),
        numpy_helper.from_array(rng.standard_normal(32).astype(np.float32), "b"),
        numpy_helper.from_array(rng.standard_normal((32, 8)).astype(np.float32), "w2"),
    ]
    nodes = [
        helper.make_node("DequantizeLinear", ["w_q", "w_scale", "w_zero"], ["w"], name="dq"),
        helper.make_node("ConstantOfShape", ["fill_shape"], ["fill"], name="fill", value=numpy_helper.from_array(np.array([0.5], np.float32))),
        helper.make_node("MatMul", ["x", "w"], ["h"], name="mm1"),
        helper.make_node("Mul", ["h", "fill"], ["hs"], name="scale"),
        helper.make_node("Add", ["hs", "b"], ["hb"], name="bias"),
        helper.make_node("Relu", ["hb"], ["r"], name="relu"),
        helper.make_node("MatMul", ["r", "w2"], ["y"], name="mm2"),
        helper.make_node("ReduceMean", ["y"], ["loss"], name="loss", keepdims=0),
    ]
    graph = helper.make_graph(nodes, "frozen", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 16])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)


def test_the_trainer_trains_exactly_what_pricing_charges_gradients_for() -> None:
    model = _frozen_model()
    graph = load(model)
    assert set(graph.trained) == {"b", "w2"}
    stage = build_stage_graphs(model, params=[t.name for t in model.graph.initializer], grad_inputs=(), grad_outputs=(), loss="loss",
                               recompute=False)
    assert set(stage.params) == set(stage.trained) == set(graph.trained)


def test_frozen_weights_are_held_without_gradients_optimizer_state_or_all_reduce() -> None:
    graph = load(_frozen_model())
    costs = annotate(graph)
    trained = 32 * 4 + 32 * 8 * 4
    frozen = 16 * 32 * 1 + 32 * 4  # the int8 weight at its real bytes, the fill at float32
    problem = build_problem(graph, costs, load_target("fpga4"), batch=4, microbatches=1, optimizer="adam")
    assert problem.params.sum() == trained + frozen and problem.trained.sum() == trained
    # one stage replicated on every device: its all-reduce carries the trained bytes' gradients only
    fpga4 = load_target("fpga4")
    everywhere = tuple(d.name for d in fpga4.devices)
    p = evaluate(build_problem(graph, costs, fpga4, batch=16, microbatches=4, optimizer="adam"),
                 Assignment((graph.compute_nodes,), (everywhere,), (False,)))
    memory = p.stages[0].memory
    assert (memory.parameters, memory.gradients, memory.optimizer) == (trained + frozen, trained, ADAM * trained)
    assert p.stages[0].allreduce_seconds == allreduce_seconds(fpga4, everywhere, trained) > allreduce_seconds(fpga4, everywhere, 0.0)
    # two stages: each charged for its own trained bytes, the frozen ones only held
    two = plan(graph, costs, load_target("fpga4"), stages=2, batch=4, microbatches=1, optimizer="adam", time_limit=5, replicas=False)
    assert sum(s.memory.gradients for s in two.stages) == trained
    assert sum(s.memory.parameters for s in two.stages) == trained + frozen
    # inference holds every weight and trains none
    infer = build_problem(graph, costs, load_target("fpga4"), batch=4, microbatches=1, mode="inference")
    assert infer.params.sum() == trained + frozen


def test_inspect_counts_every_weight_at_its_real_bytes_and_says_which_are_trained(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import subprocess
    import sys

    onnx.save(_frozen_model(), str(tmp_path / "m.onnx"))
    run = subprocess.run([sys.executable, "-m", "onnxpipe", "inspect", "m.onnx"], capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert run.returncode == 0, run.stderr
    # w_q (512 B int8), the fill (128 B), b (128 B), w2 (1 KiB): 1,792 B held, of which b and w2 (1,152 B) trained
    assert "weights: 4 tensors, 1.75 KiB (2 trained, 1.12 KiB;" in run.stdout
