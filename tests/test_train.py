"""Pipelined training against unpartitioned training: same per-step losses and weights for every
trainable zoo model, k = 2..4 stages, both schedules and both activation policies; then worker
processes, faults, checkpoints and the public API."""

from __future__ import annotations

import atexit
import dataclasses
import functools
import shutil
import tempfile
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.manifest import Manifest
from onnxpipe.plan.result import Memory, Plan, SolveInfo, StagePlan
from onnxpipe.schedule import add_communication, build
from onnxpipe.split import split
from onnxpipe.train.data import SyntheticData, split_microbatches
from onnxpipe.train.graphs import build_stage_graphs
from onnxpipe.train.local import LocalPipeline
from onnxpipe.train.loss import LossSpec
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.prepare import TrainConfig, model_inputs, prepare_single, prepare_stages

STEPS = 5
M = 4
RTOL = 1e-5
TRAINABLE = ["mlp", "resnet-tiny", "inception-tiny", "transformer-tiny", "two-io", "bert-tiny", "gpt2-tiny"]
#: Models whose ops (LSTM, BatchNormalization) get gradients only after onnxruntime's pre-training rewrites.
REWRITTEN = ["gnmt-tiny", "resnet-bn"]
#: Test names for zoo models built with knobs.
VARIANTS = {"resnet-bn": ("resnet-tiny", {"batchnorm": True}), "bert-mask": ("bert-tiny", {"padding_mask": True})}
SGD = OptimizerConfig("sgd", lr=0.05, momentum=0.9)
ADAMW = OptimizerConfig("adamw", lr=0.01)
_TMP = Path(tempfile.mkdtemp(prefix="onnxpipe-test-train-"))
atexit.register(shutil.rmtree, _TMP, ignore_errors=True)  # the stage directories the tests share go with the test run


def even_plan(graph: Graph, k: int, replicas: tuple[int, ...] | None = None) -> Plan:
    """k stages of consecutive compute nodes, equal node counts; stage i on `replicas[i]` devices (default 1)."""
    nodes = graph.compute_nodes
    memory = Memory(0, 0, 0, 0, 0)
    reps = replicas or (1,) * k
    stages = tuple(StagePlan(i, tuple(f"d{i}.{j}" for j in range(reps[i])), tuple(nodes[len(nodes) * i // k: len(nodes) * (i + 1) // k]),
                             0, 0, 0, 0, 0, 0, 0, False, memory)
                   for i in range(k))
    return Plan(graph.source, graph.fingerprint, "test", dict(graph.dims), graph.batch, 1, "gpipe", "sgd", stages, 0, 0, 0,
                SolveInfo("manual", 0, 0, 0, 0, 0))


@functools.cache
def graph_of(name: str, train: bool = True) -> Graph:
    base, knobs = VARIANTS.get(name, (name, {}))
    return load(models.build(base, train=train, **knobs))


@functools.cache
def stage_dir(name: str, k: int, train: bool = True, replicas: tuple[int, ...] | None = None) -> tuple[Path, Manifest]:
    out = _TMP / f"{name}-{k}-{train}-{'x'.join(map(str, replicas or ()))}"
    manifest = split(graph_of(name, train), even_plan(graph_of(name, train), k, replicas), out, force=True)
    return out, manifest


def int_ranges(graph: Graph) -> dict[str, int]:
    """Index inputs stay inside the table they index (vocabulary, classes)."""
    ranges = {}
    for name in graph.inputs:
        sizes = []
        for node in graph.consumers(name):
            n = graph.node(node)
            if n.op_type == "Gather":
                sizes.append(graph.tensors[n.input[0]].shape[0])
            elif n.op_type == "SoftmaxCrossEntropyLoss":
                sizes.append(graph.tensors[n.input[0]].shape[1])
        ranges[name] = min(sizes) if sizes else 2
    return ranges


def batches(name: str, manifest: Manifest, config: TrainConfig, steps: int = STEPS, ranges: dict[str, int] | None = None) -> list[list[dict[str, np.ndarray]]]:
    inputs = model_inputs(manifest, config)
    source = SyntheticData(inputs, config.microbatches, ranges or int_ranges(graph_of(name)), seed=7)
    return [split_microbatches(source.batch(s), inputs, config.microbatches) for s in range(steps)]


@functools.cache
def reference(name: str, optimizer: OptimizerConfig) -> tuple[list[float], dict[str, np.ndarray]]:
    """Unpartitioned training: the original model's gradient graph, same micro-batches, same optimizer."""
    config = TrainConfig(microbatches=M, optimizer=optimizer)
    _, manifest = stage_dir(name, 2)
    ref = LocalPipeline([prepare_single(graph_of(name).model, config, manifest.loss)])
    losses = [ref.train_step(mb) for mb in batches(name, manifest, config)]
    return losses, ref.parameters()


def assert_same_training(name: str, k: int, schedule: str, recompute: str, optimizer: OptimizerConfig, weights: bool = True,
                         replicas: tuple[int, ...] | None = None) -> LocalPipeline:
    directory, manifest = stage_dir(name, k, replicas=replicas)
    config = TrainConfig(schedule=schedule, microbatches=M, optimizer=optimizer, recompute=recompute)
    pipe = LocalPipeline(prepare_stages(directory, manifest, config))
    losses = [pipe.train_step(mb) for mb in batches(name, manifest, config)]
    ref_losses, ref_weights = reference(name, optimizer)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    assert losses[-1] != losses[0], "training did not change the loss"
    if weights:
        got = pipe.parameters()
        assert set(got) == set(ref_weights)
        for key, value in ref_weights.items():
            scale = max(1.0, float(np.max(np.abs(value))))
            assert float(np.max(np.abs(got[key] - value))) <= RTOL * scale * 10, key
    for runner in pipe.runners:  # tied copies and replicas got the same updates
        for p, _ in runner.spec.wiring.shared:
            for other in pipe.runners:
                if p in other.params:
                    np.testing.assert_array_equal(other.params[p], runner.params[p])
        first = pipe.stage_runners[runner.spec.index]
        for p, value in runner.params.items():
            np.testing.assert_array_equal(value, first.params[p])
    return pipe


MATRIX = [(name, k, schedule, recompute) for name in TRAINABLE for k in (2, 3, 4) for schedule in ("gpipe", "1f1b")
          for recompute in ("never", "always")]


MATRIX += [(name, k, schedule, recompute) for name in REWRITTEN for k in (2, 3, 4) for schedule in ("gpipe", "1f1b")
           for recompute in ("never", "always")]
# derived nodes (the padding mask) made again in each stage reading them, recomputed with the stage's forward too
MATRIX += [("bert-mask", k, "1f1b", recompute) for k in (2, 3) for recompute in ("never", "always")]


@pytest.mark.parametrize(("name", "k", "schedule", "recompute"), MATRIX, ids=["-".join(map(str, c)) for c in MATRIX])
def test_pipelined_sgd_matches_unpartitioned(name: str, k: int, schedule: str, recompute: str) -> None:
    assert_same_training(name, k, schedule, recompute, SGD)


@pytest.mark.parametrize("name", TRAINABLE)
def test_pipelined_adamw_matches_unpartitioned(name: str) -> None:
    # AdamW divides by sqrt(v): gradients that are zero in exact arithmetic (attention key biases)
    # turn rounding noise into full-size steps, so weights are compared on the other models only.
    assert_same_training(name, 3, "1f1b", "never", ADAMW, weights=name not in ("bert-tiny", "gpt2-tiny", "transformer-tiny"))


def test_stages_run_exactly_their_schedule_rows() -> None:
    directory, manifest = stage_dir("two-io", 3)
    for schedule in ("gpipe", "1f1b"):
        config = TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD)
        pipe = LocalPipeline(prepare_stages(directory, manifest, config))
        pipe.train_step(batches("two-io", manifest, config, steps=1)[0])
        assert [tuple(t) for t in pipe.traces()] == list(add_communication(build(schedule, 3, M)))


def test_stash_skips_recomputation_and_recompute_keeps_only_inputs() -> None:
    directory, manifest = stage_dir("gpt2-tiny", 2)
    stash = prepare_stages(directory, manifest, TrainConfig(recompute="never"))
    again = prepare_stages(directory, manifest, TrainConfig(recompute="always"))
    assert all(s.graphs.stash for s in stash) and not any(s.graphs.stash for s in again)
    forward_ops = len(onnx.load_from_string(stash[0].graphs.forward).graph.node)
    assert len(onnx.load_from_string(again[0].graphs.backward).graph.node) > len(onnx.load_from_string(stash[0].graphs.backward).graph.node) + forward_ops // 2


def test_appended_losses_match_unpartitioned() -> None:
    for kind, output, ranges in (("cross_entropy", "out/Gemm", {"y": 10}), ("mse", "out/Gemm", {})):
        directory, manifest = stage_dir("mlp", 3, train=False)
        config = TrainConfig(microbatches=M, optimizer=SGD, loss=LossSpec(kind, output, "y"))
        pipe = LocalPipeline(prepare_stages(directory, manifest, config))
        ref = LocalPipeline([prepare_single(graph_of("mlp", False).model, config)])
        data = batches("mlp", manifest, config, ranges=ranges)
        np.testing.assert_allclose([pipe.train_step(b) for b in data], [ref.train_step(b) for b in data], rtol=RTOL)


def _float16_mlp() -> onnx.ModelProto:
    """Three float16 MatMul + Add layers: every stage boundary carries float16, the output is float16."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(3)
    nodes, inits, x = [], [], "x"
    for i, (a, b) in enumerate([(8, 16), (16, 16), (16, 4)]):
        inits += [numpy_helper.from_array((rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float16), f"w{i}"),
                  numpy_helper.from_array(np.zeros(b, np.float16), f"b{i}")]
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"mm{i}"], name=f"mm{i}"),
                  helper.make_node("Add", [f"mm{i}", f"b{i}"], [f"h{i}"], name=f"add{i}")]
        if i < 2:
            nodes.append(helper.make_node("Relu", [f"h{i}"], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}" if i < 2 else f"h{i}"
    graph = helper.make_graph(nodes, "fp16", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [8, 8])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT16, [8, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)


def test_float16_model_trains_with_a_float32_loss() -> None:
    # the appended loss reads a float16 output and the stages hand float16 gradients back: the loss and each
    # stage's sum of terms are float32 (before, the loss's Sub mixed float16 and float32 labels and was
    # reported as an op without a gradient)
    graph = load(_float16_mlp())
    config = TrainConfig(microbatches=2, optimizer=OptimizerConfig("sgd", lr=0.1), loss=LossSpec("mse", "h2"))
    ref = LocalPipeline([prepare_single(graph.model, config)])
    for k in (2, 3):
        manifest = split(graph, even_plan(graph, k), _TMP / f"fp16-{k}", force=True)
        pipe = LocalPipeline(prepare_stages(_TMP / f"fp16-{k}", manifest, config))
        source = SyntheticData(model_inputs(manifest, config), 2, {}, seed=5)
        data = [split_microbatches(source.batch(0), model_inputs(manifest, config), 2)] * 4  # one batch, learnt
        losses = [pipe.train_step(b) for b in data]
        if k == 2:
            ref_losses = [ref.train_step(b) for b in data]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-3)  # float16 weights: sums in another order round apart
        assert losses[-1] < losses[0] * 0.9
        assert {v.dtype for v in pipe.parameters().values()} == {np.dtype(np.float16)}


def test_missing_loss_names_the_way_out() -> None:
    directory, manifest = stage_dir("mlp", 2, train=False)
    with pytest.raises(OnnxpipeError, match="--loss cross_entropy"):
        prepare_stages(directory, manifest, TrainConfig())


def test_rewritten_ops_train_with_state_left_alone() -> None:
    # BatchNormalization trains on batch statistics: its running mean and variance are state, not weights.
    directory, manifest = stage_dir("resnet-bn", 2)
    specs = prepare_stages(directory, manifest, TrainConfig(microbatches=M, optimizer=SGD))
    params = {p for s in specs for p in s.graphs.params}
    trained = {p for s in specs for p in s.graphs.trained}
    assert any(p.endswith("bn/scale") for p in trained) and any(p.endswith("bn/bias") for p in trained)
    assert not any(p.endswith(("bn/mean", "bn/var")) for p in params)
    ops = {n.op_type for s in specs for n in onnx.load_from_string(s.graphs.forward).graph.node}
    assert "BatchNormInternal" in ops and "BatchNormalization" not in ops


def test_untrainable_ops_are_named_before_training() -> None:
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((1, 3, 4, 4)).astype(np.float32), "w")
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["a"], name="scale"),
         helper.make_node("LRN", ["a"], ["y"], name="encoder/lrn", size=3),
         helper.make_node("ReduceMean", ["y"], ["loss"], name="mean", keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4, 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(OnnxpipeError, match=r"no gradient for LRN \(1 node: encoder/lrn\)") as info:
        build_stage_graphs(model, params=["w"], grad_inputs=(), grad_outputs=(), loss="loss", recompute=False)
    assert "re-export" in str(info.value)


def test_bad_batch_shape_names_the_batch_flag() -> None:
    _, manifest = stage_dir("mlp", 2)
    inputs = model_inputs(manifest, TrainConfig())
    with pytest.raises(OnnxpipeError, match="--batch 32"):
        split_microbatches({"x": np.zeros((5, 16), np.float32), "labels": np.zeros(5, np.int64)}, inputs, 4)


# --- replicated stages (hybrid data + pipeline parallelism) -----------------------------------

#: (stages, replicas per stage): pure data parallelism, and a replicated first stage feeding one worker.
REPLICATED = [(1, (2,)), (2, (2, 1))]
REPLICATED_MATRIX = [(name, k, reps, schedule) for name in ("mlp", "two-io", "gpt2-tiny") for k, reps in REPLICATED
                     for schedule in ("gpipe", "1f1b")]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("replicas", [(2,), (3,), (2, 1), (1, 2), (2, 3, 1), (1, 1, 2, 2)])
def test_replica_rows_cover_every_microbatch_and_cannot_deadlock(schedule: str, replicas: tuple[int, ...]) -> None:
    from onnxpipe.schedule import ensure_valid, replicate

    table = build(schedule, len(replicas), 6)
    rows = replicate(table, replicas)
    ensure_valid(rows)
    assert len(rows) == sum(replicas)
    w = 0
    for s, r in enumerate(replicas):
        for j in range(r):
            assert {a.microbatch for a in rows[w] if a.op == "F"} == set(range(j, 6, r))
            assert [a for a in rows[w] if a.op != "STEP"] == [a for a in table[s] if a.op != "STEP" and a.microbatch % r == j]
            w += 1
    broken = list(rows)
    broken[0] = tuple(reversed(broken[0][:-1])) + (broken[0][-1],)  # backwards before forwards
    with pytest.raises(OnnxpipeError, match="deadlocks"):
        ensure_valid(tuple(broken))


@pytest.mark.parametrize(("name", "k", "replicas", "schedule"), REPLICATED_MATRIX, ids=["-".join(map(str, c)) for c in REPLICATED_MATRIX])
def test_replicated_stages_match_unpartitioned(name: str, k: int, replicas: tuple[int, ...], schedule: str) -> None:
    pipe = assert_same_training(name, k, schedule, "never", SGD, replicas=replicas)
    assert [(s.index, s.replica) for s in pipe.specs] == [(s, j) for s, r in enumerate(replicas) for j in range(r)]
    for runner, trace in zip(pipe.runners, pipe.traces()):  # each replica ran only its own micro-batches
        r = replicas[runner.spec.index]
        assert {a.microbatch % r for a in trace if a.op == "F"} == {runner.spec.replica}


def test_replica_without_microbatches_adds_nothing() -> None:
    config = TrainConfig(microbatches=1, optimizer=SGD)
    runs = []
    for replicas in ((3,), None):
        directory, manifest = stage_dir("mlp", 1, replicas=replicas)
        pipe = LocalPipeline(prepare_stages(directory, manifest, config))
        runs.append(([pipe.train_step(b) for b in batches("mlp", manifest, config, steps=3)], pipe))
    (idle_losses, idle), (losses, single) = runs
    assert idle_losses == losses and len(idle.runners) == 3
    for runner in idle.runners:
        for key, value in single.parameters().items():
            np.testing.assert_array_equal(runner.params[key], value)


@pytest.mark.parametrize(("name", "k", "replicas", "schedule"), [("gpt2-tiny", 2, (2, 1), "1f1b"), ("two-io", 1, (2,), "gpipe")])
def test_replicated_worker_processes_match_unpartitioned(name: str, k: int, replicas: tuple[int, ...], schedule: str) -> None:
    from onnxpipe.train.pipeline import Pipeline

    directory, manifest = stage_dir(name, k, replicas=replicas)
    config = TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD, recompute="never")
    with Pipeline(directory, microbatches=M, schedule=schedule, optimizer=SGD, recompute="never") as pipe:
        losses = [pipe.train_step(b) for b in _global_batches(name, manifest, config)]
        weights = pipe.parameters()
        metrics = pipe.metrics()
        states = pipe.engine.state()
        pids = pipe.engine.pids
    assert len(pids) == sum(replicas) and not _alive(pids)
    ref_losses, ref_weights = reference(name, SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for key, value in ref_weights.items():
        assert float(np.max(np.abs(weights[key] - value))) <= RTOL * 10 * max(1.0, float(np.max(np.abs(value)))), key
    assert len(states) == k and len(metrics["stages"]) == k
    for stage, r in zip(metrics["stages"], replicas):
        assert [x["replica"] for x in stage["replicas"]] == list(range(r))
        assert all(x["busy_seconds"] > 0 and x["peak_memory_bytes"] > 0 for x in stage["replicas"])
        assert stage["busy_seconds"] == max(x["busy_seconds"] for x in stage["replicas"])


def _global_batches(name: str, manifest: Manifest, config: TrainConfig) -> list[dict[str, np.ndarray]]:
    """The micro-batches of `batches` joined back into global batches (what Pipeline.train_step takes)."""
    return [{key: np.concatenate([mb[key] for mb in step]) for key in step[0]} for step in batches(name, manifest, config)]


# --- worker processes ------------------------------------------------------------------------

def _segments(prefix: str) -> list[str]:
    root = Path("/dev/shm")
    return sorted(p.name for p in root.glob(f"{prefix}*")) if root.is_dir() else []


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()]


@pytest.mark.parametrize(("name", "k", "schedule", "recompute"), [("gpt2-tiny", 3, "1f1b", "never"), ("two-io", 4, "gpipe", "always")])
def test_worker_processes_match_unpartitioned(name: str, k: int, schedule: str, recompute: str) -> None:
    from onnxpipe.train.processes import ProcessPipeline

    directory, manifest = stage_dir(name, k)
    config = TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD, recompute=recompute)
    with ProcessPipeline(prepare_stages(directory, manifest, config)) as pipe:
        data = batches(name, manifest, config)
        losses = [pipe.train_step(data[0])]
        segments = _segments(pipe.segment_prefix)
        losses += [pipe.train_step(mb) for mb in data[1:]]
        assert _segments(pipe.segment_prefix) == segments  # one segment per (edge, key, micro-batch), made in the first step
        weights = pipe.parameters()
        stats = pipe.last
        pids, prefix = pipe.pids, pipe.segment_prefix
    ref_losses, ref_weights = reference(name, SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for key, value in ref_weights.items():
        assert float(np.max(np.abs(weights[key] - value))) <= RTOL * 10 * max(1.0, float(np.max(np.abs(value)))), key
    assert stats is not None and len(stats.busy_seconds) == k and all(b > 0 for b in stats.busy_seconds)
    assert all(m > 0 for m in stats.peak_rss_bytes)
    assert not _alive(pids) and not _segments(prefix)


def assert_killed_process_fails_fast(stages: int, schedule: str, named: str) -> None:
    """SIGKILL worker process 1 mid-run: the step fails within 5 s with one line naming a stage it ran (`named`, a
    pattern) and nothing of the run is left behind."""
    import os
    import signal
    import threading
    import time

    from onnxpipe.train.processes import ProcessPipeline

    directory, manifest = stage_dir("gpt2-tiny", stages)
    config = TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD)
    data = batches("gpt2-tiny", manifest, config, steps=1)[0]
    pipe = ProcessPipeline(prepare_stages(directory, manifest, config))
    pids, prefix = pipe.pids, pipe.segment_prefix
    killed: list[float] = []

    def kill() -> None:
        killed.append(time.monotonic())
        os.kill(pids[1], signal.SIGKILL)

    timer = threading.Timer(0.3, kill)
    timer.start()
    with pytest.raises(OnnxpipeError, match=rf"stage {named} \(stage_{named}\.onnx\) failed.*exited with code -9"):
        for _ in range(100000):
            pipe.train_step(data)
    assert killed and time.monotonic() - killed[0] < 5.0
    assert not _alive(pids) and not _segments(prefix)


def test_killed_worker_fails_fast_naming_the_stage() -> None:
    assert_killed_process_fails_fast(3, "1f1b", "1")


def test_worker_error_names_stage_microbatch_and_phase() -> None:
    from onnxpipe.train.processes import ProcessPipeline

    directory, manifest = stage_dir("gpt2-tiny", 2)
    config = TrainConfig(schedule="gpipe", microbatches=M, optimizer=SGD)
    data = batches("gpt2-tiny", manifest, config, steps=1)[0]
    data[2]["input_ids"] = data[2]["input_ids"] + 10_000  # out of the vocabulary: Gather fails in stage 0
    with ProcessPipeline(prepare_stages(directory, manifest, config)) as pipe:
        pids, prefix = pipe.pids, pipe.segment_prefix
        with pytest.raises(OnnxpipeError, match=r"stage 0 \(stage_0\.onnx\) failed at micro-batch 2 \(forward\): .*"):
            pipe.train_step(data)
    assert not _alive(pids) and not _segments(prefix)


def test_root_cause_beats_its_consequences_that_arrive_first() -> None:
    import time
    from types import SimpleNamespace

    from onnxpipe.train.executor import Executor, Failure
    from onnxpipe.train.messages import Failed

    class Backend:
        """Replies that arrive at given times after the first call."""

        def __init__(self, replies: list[tuple[float, Failed]]) -> None:
            self.due, self.start = sorted(replies, key=lambda r: r[0]), None

        def replies(self, timeout: float) -> list[Failed]:
            self.start = self.start or time.monotonic()
            time.sleep(timeout)
            now = time.monotonic() - self.start
            out = [r for t, r in self.due if t <= now]
            self.due = [(t, r) for t, r in self.due if t > now]
            return out

        def health(self) -> list[Failure]:
            return []

    t = time.monotonic()
    consequence = Failure(1, ("RECV_F", 1), "PeerGone: the sender of 'h' (micro-batch 1) is gone", t + 0.01, True)
    # The root cause failed first but its report is late: it still wins.
    late = Failed(0, "F", 2, "InvalidArgument: bad index", "tb", t, False)
    root = Executor._root_cause(SimpleNamespace(backend=Backend([(0.1, late)])), [consequence])  # type: ignore[arg-type]
    assert (root.worker, root.where, root.secondary) == (0, ("F", 2), False)
    # Among primary failures, the earliest wins whatever the arrival order.
    earlier = Failed(2, "B", 0, "later", "tb", t + 0.5, False)
    fake = SimpleNamespace(backend=Backend([(0.0, earlier)]))
    assert Executor._root_cause(fake, [Failure(3, None, "exited with code -9", t + 1.0)]).worker == 2  # type: ignore[arg-type]


# --- checkpoints, the Pipeline API and the command line ---------------------------------------

def test_resume_gives_the_losses_of_an_uninterrupted_run(tmp_path: Path) -> None:
    from onnxpipe.train.fit import data_source, fit
    from onnxpipe.train.pipeline import Pipeline

    directory, _ = stage_dir("transformer-tiny", 3)
    opt = OptimizerConfig("adamw", lr=0.01)

    def pipeline() -> Pipeline:
        return Pipeline(directory, microbatches=M, optimizer=opt, processes=False)

    with pipeline() as whole:
        full = fit(whole, data_source(whole, "synthetic", seed=3), 6)
    with pipeline() as first:
        fit(first, data_source(first, "synthetic", seed=3), 4, checkpoint_dir=str(tmp_path / "ck"), every=2)
    with pipeline() as second:
        resumed = fit(second, data_source(second, "synthetic", seed=3), 6, checkpoint_dir=str(tmp_path / "ck"), every=2, resume=True)
    assert resumed == full and len(full) == 6

    npz = tmp_path / "ck" / "stage_1.npz"
    npz.write_bytes(npz.read_bytes()[:-7] + b"garbage")
    from onnxpipe.train.checkpoint import load_checkpoint

    with pytest.raises(OnnxpipeError, match=r"stage_1\.npz: checkpoint file is missing or corrupted"):
        load_checkpoint(tmp_path / "ck")


def test_pipeline_api_trains_evaluates_and_exports(tmp_path: Path) -> None:
    import onnxruntime as ort

    from onnxpipe import Pipeline

    model = models.build("mlp", train=True)
    with Pipeline(model, "cpu2", microbatches=2, optimizer=SGD) as pipe:
        from onnxpipe.train.fit import data_source

        source = data_source(pipe, "synthetic")
        losses = [pipe.train_step(source.batch(s)) for s in range(3)]
        batch = source.batch(9)
        result = pipe.evaluate(batch)
        pipe.export(tmp_path / "trained.onnx")
        metrics = pipe.metrics()
    assert losses[0] != losses[-1] and len(metrics["stages"]) == pipe.stages
    assert {"losses", "step_seconds", "samples_per_s", "bubble_fraction"} <= set(metrics)
    sess = ort.InferenceSession(str(tmp_path / "trained.onnx"), providers=["CPUExecutionProvider"])
    outs = [sess.run(None, {k: v[i * 8:(i + 1) * 8] for k, v in batch.items()}) for i in range(2)]
    assert result["loss"] == pytest.approx(float(np.mean([o[0] for o in outs])), rel=1e-5)
    np.testing.assert_allclose(result["out/Gemm"], np.concatenate([o[1] for o in outs]), rtol=1e-5, atol=1e-6)


def test_train_command_checks_against_unpartitioned(tmp_path: Path) -> None:
    import json

    from typer.testing import CliRunner

    from onnxpipe.cli import app

    onnx.save(models.build("two-io", train=True), str(tmp_path / "m.onnx"))
    out = tmp_path / "m.json"
    result = CliRunner().invoke(app, ["train", str(tmp_path / "m.onnx"), "--target", "cpu2", "--stages", "2", "--microbatches", "2",
                                      "--steps", "3", "--check", "--json", str(out), "--lr", "0.1"])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert len(data["losses"]) == 3 and data["check"]["max_loss_rel_diff"] < RTOL
    assert len(data["stages"]) == 2 and all(s["peak_memory_bytes"] > 0 for s in data["stages"])
    bad = CliRunner().invoke(app, ["train", str(tmp_path / "m.onnx"), "--batch", "7", "--steps", "1"])
    assert bad.exit_code == 2 and "--batch" in bad.output


def test_pipeline_plans_the_optimizer_it_runs_and_a_directory_runs_on_its_target(tmp_path: Path) -> None:
    """SGD with momentum keeps one state per weight, and the plan counts it; a stage directory trains on its manifest's target."""
    from onnxpipe import Pipeline
    from onnxpipe.plan.predict import read_plan

    model = models.build("mlp", train=True)
    with Pipeline(model, "fpga4", stages=2, microbatches=2, optimizer=SGD, processes=False) as pipe:
        plan = read_plan(pipe.directory / "plan.json")
        directory = pipe.directory
        assert plan.optimizer == "momentum"
        assert all(s.memory.optimizer == s.memory.parameters > 0 for s in plan.stages)
        stages = tmp_path / "stages"
        split(load(model), plan, stages)
    with Pipeline(stages, microbatches=2, optimizer=SGD, processes=False) as pipe:
        assert pipe.target == "fpga4" == pipe.manifest.target
    assert not directory.exists()



_FREED = """
import sys
import numpy as np
from onnxpipe.train.worker import keep_freed_memory
if sys.argv[1] == "keep":
    keep_freed_memory()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
block = np.ones(10 * 2**20, np.float32)  # 40 MiB, touched
held = rss()
del block
print(held - rss())
"""


@pytest.mark.skipif(__import__("platform").libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_workers_keep_freed_memory_for_the_next_micro_batch():
    """By default glibc unmaps a freed 40 MiB tensor (the next one faults in fresh zeroed pages); a worker keeps it."""
    import subprocess
    import sys

    released = {how: int(subprocess.run([sys.executable, "-c", _FREED, how], check=True, capture_output=True, text=True).stdout)
                for how in ("default", "keep")}
    assert released["default"] >= 39 * 2**20
    assert released["keep"] < 2**20


def test_a_diverging_run_stops_naming_the_step_and_the_way_out() -> None:
    from onnxpipe.train.fit import data_source, fit
    from onnxpipe.train.pipeline import Pipeline

    with Pipeline(models.build("mlp", train=True), "cpu2", stages=2, microbatches=2, optimizer=OptimizerConfig("sgd", lr=1e30),
                  processes=False) as pipe:
        with pytest.raises(OnnxpipeError, match=r"^step [2-4]: the loss is (nan|inf), training diverged; lower --lr$"):
            fit(pipe, data_source(pipe, "synthetic"), 4)


def test_float16_weights_diverging_under_adamw_are_told_why() -> None:
    """AdamW keeps its state in the weights' type, as torch.optim does: in float16 its eps (1e-8) is 0, and a weight
    whose gradient is 0 (a dead ReLU's) gets 0/0."""
    from onnxpipe.train.fit import data_source, fit
    from onnxpipe.train.pipeline import Pipeline

    with Pipeline(_float16_mlp(), "cpu2", stages=2, microbatches=2, optimizer=OptimizerConfig("adamw", lr=0.01), processes=False,
                  loss=LossSpec("mse", "h2")) as pipe:
        with pytest.raises(OnnxpipeError, match=r"^step 2: the loss is nan, training diverged; lower --lr, or add --master-weights \(float32 "
                                                r"copies of the float16 weights, AdamW's state in float32: without them its state is float16, as in "
                                                r"torch, where its eps 1e-8 is 0\)$"):
            fit(pipe, data_source(pipe, "synthetic"), 3)


@pytest.mark.parametrize("name", ["adamw", "sgd"])
def test_master_weights_update_a_float32_copy_and_round_it_into_the_float16_weight(name: str) -> None:
    """Mixed precision as DeepSpeed and Megatron train float16 models: the step is the float32 optimizer's on a float32
    copy, the float16 weight its rounding, however many steps; without the copy, updates below half a float16 step
    are lost (the weight never moves)."""
    from onnxpipe.train.optimizer import Optimizer

    rng = np.random.default_rng(0)
    weight = (1 + rng.standard_normal((4, 8)) * 0.1).astype(np.float16)
    grads = [rng.uniform(0.5e-2, 2e-2, (4, 8)).astype(np.float16) for _ in range(20)]
    config = OptimizerConfig(name, lr=1e-2 if name == "sgd" else 1e-4)  # each update below half a float16 step at 1
    mixed, plain, reference = Optimizer(dataclasses.replace(config, master_weights=True)), Optimizer(config), Optimizer(config)
    params, params16, ref = {"w": weight.copy()}, {"w": weight.copy()}, {"w": weight.astype(np.float32)}
    for g in grads:
        mixed.step(params, {"w": g})
        plain.step(params16, {"w": g})
        reference.step(ref, {"w": g.astype(np.float32)})
        assert params["w"].dtype == np.float16
        np.testing.assert_array_equal(params["w"], ref["w"].astype(np.float16))
    np.testing.assert_array_equal(mixed.state()["slot:w/master"], ref["w"])
    assert np.any(params["w"] != weight)
    if name == "sgd":  # each update below half a float16 step: lost without the copy
        np.testing.assert_array_equal(params16["w"], weight)


def test_float16_weights_train_under_adamw_with_master_weights_as_unpartitioned() -> None:
    """The run that diverges without master weights (above) trains with them, the pipeline as the unpartitioned model."""
    from onnxpipe.train.fit import check, data_source, fit
    from onnxpipe.train.pipeline import Pipeline

    with Pipeline(_float16_mlp(), "cpu2", stages=2, microbatches=2, processes=False, loss=LossSpec("mse", "h2"),
                  optimizer=OptimizerConfig("adamw", lr=0.01, master_weights=True)) as pipe:
        source = data_source(pipe, "synthetic")
        losses = fit(pipe, source, 6)
        assert all(np.isfinite(losses))
        assert {v.dtype for v in pipe.parameters().values()} == {np.dtype(np.float16)}
        diffs = check(pipe, source, 6)
    assert diffs["max_loss_rel_diff"] < 1e-3 and diffs["max_weight_abs_diff"] < 2e-3  # float16: sums in another order round apart


def test_master_weights_are_planned_with_their_float32_copies() -> None:
    """12 bytes of optimizer memory per 2-byte weight under Adam (a float32 copy, two float32 moments), as DeepSpeed
    counts mixed precision; a float32 model keeps no copy."""
    from onnxpipe.cost import annotate
    from onnxpipe.plan import Assignment, build_problem, evaluate
    from onnxpipe.pricing.problem import optimizer_states
    from onnxpipe.target import load_target

    assert [optimizer_states(o, "float16") for o in ("adam", "adam-master", "momentum-master", "sgd-master")] == [2.0, 6.0, 4.0, 2.0]
    assert optimizer_states("adam-master", "float32") == 2.0
    graph = load(_float16_mlp())
    costs, target = annotate(graph), load_target("cpu2")
    trained = sum(graph.tensors[w].nbytes for w in graph.trained)
    for optimizer, per_byte in (("adam", 2.0), ("adam-master", 6.0)):
        priced = evaluate(build_problem(graph, costs, target, batch=16, microbatches=2, optimizer=optimizer),
                          Assignment((graph.compute_nodes,), ((target.devices[0].name,),), (False,)))
        assert priced.stages[0].memory.optimizer == pytest.approx(per_byte * trained)


def _dropout_mlp(training: bool | None) -> onnx.ModelProto:
    """x -> MatMul -> Dropout(0.5; training_mode constant `training`, absent for None) -> MatMul -> y."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    inits = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32), "w0"),
             numpy_helper.from_array(rng.standard_normal((8, 4)).astype(np.float32), "w1"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ratio")]
    drop_inputs = ["h", "ratio"]
    if training is not None:
        inits.append(numpy_helper.from_array(np.array(training), "training"))
        drop_inputs.append("training")
    nodes = [helper.make_node("MatMul", ["x", "w0"], ["h"], name="mm0"), helper.make_node("Dropout", drop_inputs, ["d"], name="drop"),
             helper.make_node("MatMul", ["d", "w1"], ["y"], name="mm1")]
    graph = helper.make_graph(nodes, "dropout", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_dropout_in_training_mode_is_found_to_draw_random_numbers() -> None:
    from onnxpipe.nodes import draws_random

    assert [draws_random(_dropout_mlp(t).graph) for t in (True, False, None)] == [("drop",), (), ()]


def test_a_stage_that_draws_random_numbers_is_never_recomputed() -> None:
    """Recomputing its forward in the backward would draw other masks than the ones its loss came from: with
    --recompute auto such a stage keeps its stash whatever the plan said, with always it is refused."""
    import dataclasses

    graph = load(_dropout_mlp(True))
    plan = even_plan(graph, 2)
    plan = dataclasses.replace(plan, stages=tuple(dataclasses.replace(s, recompute=True) for s in plan.stages))
    manifest = split(graph, plan, _TMP / "dropout-2", force=True)
    config = TrainConfig(microbatches=2, loss=LossSpec("mse", "y"))
    specs = prepare_stages(_TMP / "dropout-2", manifest, config)
    drops = [s for s in specs if "Dropout" in {n.op_type for n in onnx.load_from_string(s.graphs.forward).graph.node}]
    assert len(drops) == 1 and not drops[0].graphs.recompute
    assert "Dropout" not in {n.op_type for n in onnx.load_from_string(drops[0].graphs.backward).graph.node}
    assert [s.graphs.recompute for s in specs if s not in drops] == [True]  # the other stage recomputes as planned
    with pytest.raises(OnnxpipeError, match=r"^stage \d draws random numbers \(drop: .*use --recompute auto or never$"):
        prepare_stages(_TMP / "dropout-2", manifest, dataclasses.replace(config, recompute="always"))


def _bound_by_a_float() -> onnx.ModelProto:
    """h = x @ w; m = ReduceMean(h), a float; y = Clip(h, max=m) -> Relu x 3. Cut after m (three stages of two nodes),
    the second stage receives m, which it reads only as Clip's bound, where the spec says no gradient flows."""
    from onnx import TensorProto, helper, numpy_helper

    inits = [numpy_helper.from_array(np.random.default_rng(4).standard_normal((4, 4)).astype(np.float32), "w")]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"), helper.make_node("ReduceMean", ["h"], ["m"], name="mean", keepdims=0),
             helper.make_node("Clip", ["h", "", "m"], ["c"], name="clip"), helper.make_node("Relu", ["c"], ["y"], name="act"),
             helper.make_node("Relu", ["y"], ["y2"], name="act2"), helper.make_node("Relu", ["y2"], ["y3"], name="act3")]
    graph = helper.make_graph(nodes, "bound", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info("y3", TensorProto.FLOAT, [2, 4])], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_a_stage_input_no_gradient_flows_back_through_gets_none() -> None:
    """Only inputs a gradient flows back through are asked for (before, every float one was: the bound got a gradient of
    zeros, computed and sent back each micro-batch, and an input read by nothing that reaches the loss made
    onnxruntime-training refuse the stage); the stage that sent it waits for none either. Losses as unpartitioned."""
    graph = load(_bound_by_a_float())
    manifest = split(graph, even_plan(graph, 3), _TMP / "bound-3", force=True)
    assert {i.name for i in manifest.stages[1].inputs} == {"h", "m"}
    config = TrainConfig(microbatches=2, loss=LossSpec("mse", "y3"), optimizer=OptimizerConfig("sgd", lr=0.1))
    specs = prepare_stages(_TMP / "bound-3", manifest, config)
    assert specs[1].graphs.grad_inputs == ("h",)
    source = SyntheticData(model_inputs(manifest, config), 2, {}, seed=1)
    batch = split_microbatches(source.batch(0), model_inputs(manifest, config), 2)
    ref = LocalPipeline([prepare_single(graph.model, config)])
    assert LocalPipeline(specs).train_step(batch) == pytest.approx(ref.train_step(batch), rel=1e-6)
