"""Piecewise model I/O: what it reads and writes equals onnx.load / onnx.save, byte for byte in content."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import load
from onnxpipe.protostream import ON_DISK_BYTES, all_equal, inline_external_data, is_external, load_weights, raw_nbytes, read_model, skeleton, weights_dir, write_model
from onnxpipe.plan import plan_model


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.parametrize("external", [False, True])
def test_read_model_leaves_weights_on_disk_and_equals_onnx_load_once_read(tmp_path: Path, external: bool) -> None:
    model = models.build("gpt2-tiny", train=True)
    models.save(model, tmp_path / "m.onnx", external=external)
    read = read_model(tmp_path / "m.onnx")
    on_disk = [t for t in read.graph.initializer if is_external(t)]
    assert {t.name for t in on_disk} == {t.name for t in model.graph.initializer if raw_nbytes(t) > ON_DISK_BYTES}
    assert all(not t.raw_data for t in on_disk)
    assert {t.external_data[0].value for t in on_disk} == {"m.onnx.data" if external else "m.onnx"}
    load_weights(read, tmp_path)
    want = onnx.load(str(tmp_path / "m.onnx"))
    assert skeleton(read.graph, "initializer") == skeleton(want.graph, "initializer")
    assert [t.name for t in read.graph.initializer] == [t.name for t in want.graph.initializer]
    assert all(np.array_equal(a, b) for a, b in zip(initializers(read).values(), initializers(want).values()))


@pytest.mark.parametrize("external", [False, True])
def test_a_model_reached_through_a_symlink_is_read_and_profiled(tmp_path: Path, external: bool) -> None:
    """onnx refuses weights read through a link ("... but it is a symbolic link"): they are read beside the
    real file, so profiling (which runs the model with every weight) works on a linked model."""
    (tmp_path / "real").mkdir()
    (tmp_path / "links").mkdir()
    models.save(models.build("gpt2-tiny", train=True), tmp_path / "real" / "m.onnx", external=external)
    link = tmp_path / "links" / "l.onnx"
    link.symlink_to(tmp_path / "real" / "m.onnx")
    assert weights_dir(link) == (tmp_path / "real").resolve()
    read = read_model(link)
    load_weights(read, weights_dir(link))
    want = onnx.load(str(tmp_path / "real" / "m.onnx"))
    assert all(np.array_equal(a, b) for a, b in zip(initializers(read).values(), initializers(want).values()))
    graph, _, _, plan = plan_model(link, "cpu2", time_limit=5)
    assert graph.weights_dir == str((tmp_path / "real").resolve()) and plan.bottleneck_seconds > 0


def test_on_disk_weights_stream_into_a_new_file(tmp_path: Path) -> None:
    model = models.build("resnet-tiny")
    onnx.save(model, str(tmp_path / "src.onnx"))
    read = read_model(tmp_path / "src.onnx")
    large = [t for t in read.graph.initializer if is_external(t)]
    rest = skeleton(read, "graph")
    rest.graph.CopyFrom(skeleton(read.graph, "initializer"))
    rest.graph.initializer.extend(t for t in read.graph.initializer if not is_external(t))
    (tmp_path / "out").mkdir()
    write_model(rest, tmp_path / "out" / "copy.onnx", large, base_dir=tmp_path)
    want, got = initializers(model), initializers(onnx.load(str(tmp_path / "out" / "copy.onnx")))
    assert large and want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def test_a_truncated_file_is_a_one_line_error(tmp_path: Path) -> None:
    data = models.build("mlp").SerializeToString()
    (tmp_path / "cut.onnx").write_bytes(data[: len(data) // 2])
    with pytest.raises(EOFError):
        read_model(tmp_path / "cut.onnx")
    with pytest.raises(OnnxpipeError, match="not a readable ONNX model"):
        load(tmp_path / "cut.onnx")


@pytest.mark.parametrize("external", [False, True])
def test_streamed_weights_round_trip(tmp_path: Path, external: bool) -> None:
    model = models.build("resnet-tiny")
    large = [t for t in model.graph.initializer if raw_nbytes(t) > 256]
    assert large and all(raw_nbytes(t) == len(t.raw_data) for t in large)
    names = {t.name for t in large}
    rest = skeleton(model, "graph")
    rest.graph.CopyFrom(skeleton(model.graph, "initializer"))
    rest.graph.initializer.extend(t for t in model.graph.initializer if t.name not in names)
    path = tmp_path / "w.onnx"
    write_model(rest, path, large, external_data="w.onnx.data" if external else None)
    assert (tmp_path / "w.onnx.data").exists() == external
    if external:
        inline_external_data(path)
        assert not (tmp_path / "w.onnx.data").exists()
    back = onnx.load(str(path))
    onnx.checker.check_model(str(path), full_check=True)
    assert list(back.graph.node) == list(model.graph.node)
    want, got = initializers(model), initializers(back)
    assert want.keys() == got.keys() and all(np.array_equal(want[k], got[k]) for k in want)


def test_all_equal_reads_an_on_disk_tensor_in_chunks(tmp_path: Path) -> None:
    fill = np.full((300, 7), 0.25, np.float32)
    mixed = fill.copy()
    mixed[-1, -1] = 0.5  # differs only in the last chunk
    model = onnx.helper.make_model(onnx.helper.make_graph(
        [], "g", [], [], [onnx.numpy_helper.from_array(fill, "fill"), onnx.numpy_helper.from_array(mixed, "mixed")]),
        opset_imports=[onnx.helper.make_opsetid("", 17)])  # onnx's default opset is above what onnxruntime 1.19 loads
    onnx.save(model, str(tmp_path / "m.onnx"))
    read = {t.name: t for t in read_model(tmp_path / "m.onnx").graph.initializer}
    assert all(is_external(t) for t in read.values())
    assert all_equal(read["fill"], tmp_path, chunk=64) and not all_equal(read["mixed"], tmp_path, chunk=64)
