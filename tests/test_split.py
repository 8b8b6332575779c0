"""The splitter: chained stages reproduce the unsplit model; the manifest alone chains them; cuts,
refusals and failure safety."""

from __future__ import annotations

import ast
import importlib
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe import models
from onnxpipe.chain import chain
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.manifest import Manifest
from onnxpipe.models import legacy
from onnxpipe.plan.result import Memory, Plan, SolveInfo, StagePlan
from onnxpipe.split import STAGE_METADATA_KEY, cut_stages, split
from onnxpipe.target import load_target
from onnxpipe.train.infer import run_pipeline
from onnxpipe.verify import TOLERANCE, random_feeds, relative_error, verify

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def make_plan(graph: Graph, groups: Sequence[Sequence[str]]) -> Plan:
    """A plan placing the given node groups on devices d0, d1, ... with no predictions."""
    memory = Memory(0, 0, 0, 0, 0)
    stages = tuple(StagePlan(i, (f"d{i}",), tuple(nodes), 0, 0, 0, 0, 0, 0, 0, False, memory) for i, nodes in enumerate(groups))
    return Plan(graph.source, graph.fingerprint, "test", dict(graph.dims), graph.batch, 1, "gpipe", "sgd", stages, 0, 0, 0,
                SolveInfo("manual", 0, 0, 0, 0, 0))


def even_plan(graph: Graph, k: int) -> Plan:
    nodes = graph.compute_nodes
    return make_plan(graph, [nodes[len(nodes) * i // k: len(nodes) * (i + 1) // k] for i in range(k)])


def assert_equivalent(model: onnx.ModelProto, k: int, tmp_path: Path, graph: Graph | None = None) -> Manifest:
    """Split into k even stages; every stage passes the full checker by path; chained outputs match
    the unsplit model within TOLERANCE."""
    path = tmp_path / "model.onnx"
    onnx.save(model, str(path))
    graph = graph or load(path)
    out = tmp_path / f"stages{k}"
    manifest = split(graph, even_plan(graph, k), out, force=True)
    assert len(manifest.stages) == k
    for stage in manifest.stages:
        onnx.checker.check_model(str(out / stage.file), full_check=True)
        assert onnx.load(str(out / stage.file)).ir_version <= 10
    errors = verify(out, path, samples=1)
    assert errors and max(errors.values()) <= TOLERANCE, errors
    assert [o.name for o in manifest.outputs] == [o.name for o in model.graph.output]
    return manifest


SMALL = [(name, train) for name in models.names() if not models.spec(name).full_size
         for train in ((False, True) if models.spec(name).trainable else (False,))]


@pytest.mark.parametrize(("name", "train"), SMALL, ids=[f"{n}{'-train' if t else ''}" for n, t in SMALL])
def test_zoo_models_chain_to_the_same_outputs(name: str, train: bool, tmp_path: Path) -> None:
    model = models.build(name, train=True) if train else models.build(name)
    for k in (2, 3, 4):
        manifest = assert_equivalent(model, k, tmp_path)
        assert manifest.loss == ("loss" if train else None)


@pytest.mark.parametrize("rewrite", [legacy.initializers_as_inputs, legacy.constant_weights])
@pytest.mark.parametrize("name", ["gpt2-tiny", "resnet-tiny"])
def test_legacy_exports_chain_to_the_same_outputs(name: str, rewrite, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    manifest = assert_equivalent(rewrite(models.build(name, train=True)), 3, tmp_path)
    assert all(stage.parameters for stage in manifest.stages)


def test_control_flow_nodes_move_whole_with_their_captures(tmp_path: Path) -> None:
    model = models.build("control-flow")
    graph = load(model)
    manifest = assert_equivalent(model, 3, tmp_path, graph)
    for stage in manifest.stages:
        stage_model = onnx.load(str(tmp_path / "stages3" / stage.file))
        names = {i.name for i in stage_model.graph.input} | {t.name for t in stage_model.graph.initializer}
        names |= {o for n in stage_model.graph.node for o in n.output}
        for node in stage_model.graph.node:
            if node.op_type in ("If", "Loop", "Scan"):
                assert set(graph.node_inputs(node.name)) <= names


def skip_model() -> onnx.ModelProto:
    """x -> a -> b -> c -> d -> out = d + a: the skip `a` spans stages 1..3 when cut one node per stage;
    `x` is also an output and read by two stages; `w` is tied across stages."""
    w = numpy_helper.from_array(np.eye(6, dtype=np.float32) * 0.5, "w")
    slope = numpy_helper.from_array(np.zeros(6, dtype=np.float32), "slope")  # a weight: `a` is computed, not derived from `x`
    nodes = [
        helper.make_node("PRelu", ["x", "slope"], ["a"], name="n0"),
        helper.make_node("MatMul", ["a", "w"], ["b"], name="n1"),
        helper.make_node("Tanh", ["b"], ["c"], name="n2"),
        helper.make_node("MatMul", ["c", "w"], ["d"], name="n3"),
        helper.make_node("Add", ["d", "a"], ["e"], name="n4"),
        helper.make_node("Sub", ["e", "x"], ["out"], name="n5"),
    ]
    graph = helper.make_graph(
        nodes, "skip",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [2, 6]), helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, [2, 6])],
        [w, slope],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def test_a_model_above_ir_10_is_split_at_ir_10_and_verifies(tmp_path: Path) -> None:
    """onnx's helpers write their newest IR version; with no type IR 10 lacks, the stages are written at IR 10
    (what onnxruntime 1.19 loads) and match the model (`test_bad_input` has the refused forms)."""
    model = skip_model()
    model.ir_version = 13
    assert_equivalent(model, 2, tmp_path)


def test_skip_connection_is_routed_straight_to_every_consumer(tmp_path: Path) -> None:
    model = skip_model()
    graph = load(model)
    manifest = split(graph, make_plan(graph, [["n0"], ["n1"], ["n2"], ["n3", "n4", "n5"]]), tmp_path / "s")
    first = {o.name: o.consumers for o in manifest.stages[0].outputs}
    assert first == {"a": (1, 3)}
    last = {i.name: i.source for i in manifest.stages[3].inputs}
    assert last == {"c": 2, "a": 0, "x": "model"}
    assert {o.name: o.consumers for o in manifest.stages[1].outputs} == {"b": (2, "model")}
    assert [o.name for o in manifest.outputs] == ["out", "x", "b"]
    assert [s.name for s in manifest.shared] == ["w"] and manifest.shared[0].stages == (1, 3)
    x = np.random.default_rng(0).standard_normal((2, 6)).astype(np.float32)
    got = chain(tmp_path / "s", {"x": x})
    a = np.maximum(x, 0)
    b = a @ (np.eye(6) * 0.5)
    np.testing.assert_allclose(got["out"], np.tanh(b) @ (np.eye(6) * 0.5) + a - x, rtol=1e-6)
    np.testing.assert_array_equal(got["x"], x)
    np.testing.assert_allclose(got["b"], b, rtol=1e-6)
    assert manifest.loss is None


def test_constant_chains_and_tied_weights_are_copied_into_each_stage(tmp_path: Path) -> None:
    graph = load(models.build("gpt2-tiny"))
    manifest = split(graph, even_plan(graph, 4), tmp_path / "s")
    trilu = [n for n in graph.constant_nodes if graph.node(n).op_type == "Trilu"]
    assert trilu
    with_mask = [s for s in manifest.stages if any(n.op_type == "Trilu" for n in onnx.load(str(tmp_path / "s" / s.file)).graph.node)]
    assert len(with_mask) >= 2
    assert all(not any(i.name.startswith("causal_mask") for i in s.inputs) for s in manifest.stages)
    tied = {s.name: s.stages for s in manifest.shared}
    assert tied["embed/wte"] == (0, 3)
    assert "embed/wte" in manifest.stages[0].parameters and "embed/wte" in manifest.stages[3].parameters


def test_derived_nodes_are_made_again_in_each_stage_reading_them(tmp_path: Path) -> None:
    """The padding mask made from the attention_mask input is copied into every stage with an attention layer, which reads
    the input from the model instead of a tensor from stage 0; the stages chain to the model's outputs."""
    model = models.build("bert-tiny", padding_mask=True)
    graph = load(model)
    manifest = assert_equivalent(model, 3, tmp_path, graph)
    mask = next(iter(t for t in graph.derived if graph.node(graph.producer(t)).op_type == "Reshape"))
    readers = {s.index for s in manifest.stages if any(mask in n.input for n in onnx.load(str(tmp_path / "stages3" / s.file)).graph.node)}
    assert len(readers) >= 2
    for s in manifest.stages:
        fed = {i.name: i.source for i in s.inputs}
        assert mask not in fed and all(mask not in (o.name for o in s.outputs) for s in manifest.stages)
        if s.index in readers:
            assert fed.get("attention_mask") == "model"
            copied = {n.name for n in onnx.load(str(tmp_path / "stages3" / s.file)).graph.node}
            assert graph.derived_nodes <= copied
    with pytest.raises(OnnxpipeError, match=f"^--cuts: tensor '{mask}' is a model input, a constant or derived from the inputs alone"):
        cut_stages(graph, [mask])


def test_manifest_alone_chains_the_stages_without_onnxpipe(tmp_path: Path) -> None:
    script = ROOT / "tests" / "chain_without_onnxpipe.py"
    imported = {a.name.split(".")[0] for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.Import) for a in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(ast.parse(script.read_text())) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"json", "sys", "numpy", "onnxruntime"}, imported
    model = models.build("two-io", train=True)
    graph = load(model)
    split(graph, even_plan(graph, 3), tmp_path / "s")
    feeds = random_feeds(Manifest.read(tmp_path / "s").inputs, np.random.default_rng(1))
    np.savez(tmp_path / "in.npz", **feeds)
    blocker = (  # any import of onnxpipe inside the script fails
        "import runpy, sys; sys.modules['onnxpipe'] = None; sys.argv = sys.argv[1:]; "
        "runpy.run_path(sys.argv[0], run_name='__main__')"
    )
    subprocess.run([PYTHON, "-c", blocker, str(script), str(tmp_path / "s"), str(tmp_path / "in.npz"), str(tmp_path / "out.npz")],
                   check=True, cwd=tmp_path)
    got = np.load(tmp_path / "out.npz")
    want = session_outputs(model, feeds)
    assert list(got.keys()) == list(want)
    for name in want:
        assert relative_error(got[name], want[name]) <= TOLERANCE


def session_outputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = session_from_proto(model)
    names = [o.name for o in model.graph.output]
    return dict(zip(names, sess.run(names, feeds)))


def session_from_proto(model: onnx.ModelProto):  # type: ignore[no-untyped-def]
    import onnxruntime as ort

    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_run_pipeline_over_microbatches_equals_the_full_batch(tmp_path: Path) -> None:
    micro, m = 2, 3
    small, full = models.build("gpt2-tiny", batch=micro), models.build("gpt2-tiny", batch=micro * m)
    graph = load(small)
    split(graph, even_plan(graph, 3), tmp_path / "s")
    ids = np.random.default_rng(0).integers(0, 256, size=(micro * m, 32)).astype(np.int64)
    got = run_pipeline(tmp_path / "s", {"input_ids": ids}, microbatches=m)
    want = session_outputs(full, {"input_ids": ids})
    for name in want:
        assert got[name].shape == want[name].shape
        assert relative_error(got[name], want[name]) <= TOLERANCE
    with pytest.raises(OnnxpipeError, match=r"input 'input_ids' has shape \(5, 32\); the stages expect \(6, 32\)"):
        run_pipeline(tmp_path / "s", {"input_ids": ids[:5]}, microbatches=m)
    with pytest.raises(OnnxpipeError, match=r"input 'input_ids' is missing; give an array of shape \(2, 32\)"):
        chain(tmp_path / "s", {})


def test_cut_stages_end_each_stage_at_the_named_tensor(tmp_path: Path) -> None:
    graph = load(skip_model())
    assert cut_stages(graph, ["a", "c"]) == (("n0",), ("n1", "n2"), ("n3", "n4", "n5"))
    with pytest.raises(OnnxpipeError, match="no tensor 'nope'"):
        cut_stages(graph, ["nope"])
    with pytest.raises(OnnxpipeError, match="tensor 'a' is produced before"):
        cut_stages(graph, ["c", "a"])
    with pytest.raises(OnnxpipeError, match="tensor 'x' is a model input"):
        cut_stages(graph, ["x"])
    with pytest.raises(OnnxpipeError, match="last stage empty"):
        cut_stages(graph, ["out"])


def test_plans_that_do_not_fit_the_model_are_refused(tmp_path: Path) -> None:
    graph = load(skip_model())
    other = load(models.build("mlp"))
    with pytest.raises(OnnxpipeError, match="made for another model.*re-plan"):
        split(graph, even_plan(other, 2), tmp_path / "a")
    with pytest.raises(OnnxpipeError, match=r"leaves 1 node out \(first: 'n5'\)"):
        split(graph, make_plan(graph, [["n0", "n1"], ["n2", "n3", "n4"]]), tmp_path / "b")
    with pytest.raises(OnnxpipeError, match="places node 'n1' in stages 0 and 1"):
        split(graph, make_plan(graph, [["n0", "n1"], ["n1", "n2", "n3", "n4", "n5"]]), tmp_path / "c")
    with pytest.raises(OnnxpipeError, match="reads 'a' from a later stage"):
        split(graph, make_plan(graph, [["n1", "n2", "n3", "n4", "n5"], ["n0"]]), tmp_path / "d")
    assert not any(tmp_path.iterdir())


def test_failed_split_leaves_nothing_and_existing_dirs_need_force(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    split_module = importlib.import_module("onnxpipe.split")  # the package attribute `split` is the function

    graph = load(skip_model())
    plan = make_plan(graph, [["n0"], ["n1"], ["n2"], ["n3", "n4", "n5"]])
    real = split_module._write_stage

    def failing(graph, plan, index, *args):  # type: ignore[no-untyped-def]
        if index == 2:
            raise OSError("disk full")
        return real(graph, plan, index, *args)

    monkeypatch.setattr(split_module, "_write_stage", failing)
    with pytest.raises(OSError):
        split(graph, plan, tmp_path / "s")
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(split_module, "_write_stage", real)

    (tmp_path / "s").mkdir()
    (tmp_path / "s" / "old.txt").write_text("keep")
    with pytest.raises(OnnxpipeError, match="not empty; pass --force"):
        split(graph, plan, tmp_path / "s")
    assert (tmp_path / "s" / "old.txt").read_text() == "keep"
    with pytest.raises(OnnxpipeError, match="holds 'old.txt', which onnxpipe did not write; --force replaces only a stage directory"):
        split(graph, plan, tmp_path / "s", force=True)
    assert (tmp_path / "s" / "old.txt").read_text() == "keep"
    (tmp_path / "s" / "old.txt").unlink()
    split(graph, plan, tmp_path / "s")
    split(graph, plan, tmp_path / "s", force=True)  # a stage directory onnxpipe wrote is replaced
    assert sorted(p.name for p in (tmp_path / "s").iterdir()) == ["manifest.json", "plan.json", *(f"stage_{i}.onnx" for i in range(4))]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s"]
    assert Plan.read(tmp_path / "s" / "plan.json") == plan

    (tmp_path / "file").write_text("")
    with pytest.raises(OnnxpipeError, match="cannot write there"):
        split(graph, plan, tmp_path / "file" / "s")


def test_annotated_copy_tags_every_node_with_its_stage(tmp_path: Path) -> None:
    graph = load(models.build("transformer-tiny"))
    plan = even_plan(graph, 2)
    split(graph, plan, tmp_path / "s", annotated_path=tmp_path / "annotated.onnx")
    tags = {n.name: {p.key: p.value for p in n.metadata_props}.get(STAGE_METADATA_KEY) for n in onnx.load(str(tmp_path / "annotated.onnx")).graph.node}
    for stage in plan.stages:
        assert all(tags[n] == str(stage.index) for n in stage.nodes)
    assert all(tags[n] for n in graph.constant_nodes if graph.node(n).op_type == "Trilu")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, "-m", "onnxpipe", *args], capture_output=True, text=True, cwd=cwd)


def test_cli_split_verify_run(tmp_path: Path) -> None:
    model = models.build("two-io")
    onnx.save(model, str(tmp_path / "m.onnx"))
    graph = load(model)
    cuts = ",".join(graph.node(n).output[0] for n in (graph.compute_nodes[2], graph.compute_nodes[5]))
    done = cli("split", "m.onnx", "--target", "fpga4", "--cuts", cuts, "-o", "st", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert "stage" in done.stdout and "st" in done.stdout
    manifest = Manifest.read(tmp_path / "st")
    devices = [(d.name,) for d in load_target("fpga4").devices[:3]]
    assert len(manifest.stages) == 3 and [s.devices for s in manifest.stages] == devices

    done = cli("verify", "st", "m.onnx", "--samples", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert all(o.name in done.stdout for o in manifest.outputs)

    feeds = random_feeds(manifest.inputs, np.random.default_rng(0))
    np.savez(tmp_path / "in.npz", **feeds)
    done = cli("run", "st", "--inputs", "in.npz", "-o", "out.npz", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    got, want = np.load(tmp_path / "out.npz"), session_outputs(model, feeds)
    assert all(relative_error(got[n], want[n]) <= TOLERANCE for n in want)

    np.savez(tmp_path / "bad.npz", **{manifest.inputs[0].name: np.zeros((1, 1), np.float32)})
    done = cli("run", "st", "--inputs", "bad.npz", "-o", "out.npz", cwd=tmp_path)
    assert done.returncode == 2 and f"'{manifest.inputs[0].name}'" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_stages_of_models_over_the_size_limit_use_external_data(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    split_module = importlib.import_module("onnxpipe.split")
    monkeypatch.setattr(split_module, "_EXTERNAL_DATA_BYTES", 1 << 16)  # gpt2-tiny stands in for a model over 2 GB
    monkeypatch.setattr(split_module, "_STREAM_BYTES", 1 << 10)
    model = models.build("gpt2-tiny")
    onnx.save(model, str(tmp_path / "m.onnx"))
    graph = load(tmp_path / "m.onnx")
    manifest = split(graph, even_plan(graph, 3), tmp_path / "s")
    for stage in manifest.stages:
        assert stage.data_file == f"{stage.file}.data" and (tmp_path / "s" / stage.data_file).stat().st_size > 0
        assert stage.file_bytes == sum((tmp_path / "s" / f).stat().st_size for f in (stage.file, stage.data_file))
        onnx.checker.check_model(str(tmp_path / "s" / stage.file), full_check=True)
    errors = verify(tmp_path / "s", tmp_path / "m.onnx", samples=1)
    assert max(errors.values()) <= TOLERANCE
