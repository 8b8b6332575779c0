"""Bad input, as a user meets it: every case runs `python -m onnxpipe ...` and must end with exit code 2,
one line on stderr naming the problem and the way out, no traceback, and no output left behind.

Each case lists the files it creates in its own directory (from a few models built once per module),
the command line (paths relative to that directory), a regex the message must match, and the paths
that must not exist afterwards.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxpipe import models

ENV = {**os.environ, "COLUMNS": "80", "NO_COLOR": "1"}


def onnxpipe(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "onnxpipe", *argv], cwd=cwd, env=ENV, capture_output=True, text=True, timeout=120)


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           initializers: list[onnx.TensorProto] = ()) -> onnx.ModelProto:  # type: ignore[assignment]
    model = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs, list(initializers)), opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _fails_checker() -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    return _model([helper.make_node("Relu", ["x"], ["y"], name="act", bogus=3)], [vi("x", TensorProto.FLOAT, [2, 4])],
                  [vi("y", TensorProto.FLOAT, [2, 4])])


def _symbolic() -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    return _model([helper.make_node("Relu", ["x"], ["y"], name="act")], [vi("x", TensorProto.FLOAT, ["batch", 4])],
                  [vi("y", TensorProto.FLOAT, ["batch", 4])])


def _atan_with_loss() -> onnx.ModelProto:
    """An arc tangent on the gradient path: onnxruntime-training 1.19.2 has no Atan gradient."""
    vi = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.full((4, 4), 0.1, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Atan", ["h"], ["y"], name="mix"),
             helper.make_node("Relu", ["y"], ["z"], name="act"),
             helper.make_node("ReduceMean", ["z"], ["loss"], name="mean", keepdims=0)]
    return _model(nodes, [vi("x", TensorProto.FLOAT, [2, 4])], [vi("loss", TensorProto.FLOAT, [])], [w])


def _embedding() -> onnx.ModelProto:
    """Token ids into a 10-row table: the ids must lie in [0, 10)."""
    vi = helper.make_tensor_value_info
    table = numpy_helper.from_array(np.arange(40, dtype=np.float32).reshape(10, 4), "table")
    nodes = [helper.make_node("Gather", ["table", "ids"], ["h"], name="embed"), helper.make_node("Relu", ["h"], ["y"], name="act")]
    return _model(nodes, [vi("ids", TensorProto.INT64, [2, 3])], [vi("y", TensorProto.FLOAT, [2, 3, 4])], [table])


def _bfloat16() -> onnx.ModelProto:
    """A bfloat16 layer (a model exported after `.to(torch.bfloat16)`): onnxruntime hands no bfloat16 arrays to numpy."""
    vi = helper.make_tensor_value_info
    w = helper.make_tensor("w", TensorProto.BFLOAT16, [16, 4], np.full(64, 0.5, np.float32).tolist())
    nodes = [helper.make_node("Gemm", ["x", "w"], ["h"], name="fc"), helper.make_node("Relu", ["h"], ["y"], name="act")]
    return _model(nodes, [vi("x", TensorProto.BFLOAT16, [8, 16])], [vi("y", TensorProto.BFLOAT16, [8, 4])], [w])


def _dilated_same() -> onnx.ModelProto:
    """Conv(auto_pad=SAME_UPPER, dilations=2), as the TorchScript exporter writes Conv2d(padding="same", dilation=2):
    onnxruntime's CPU Conv refuses to run it; loading writes its pads out, so the stages run."""
    vi = helper.make_tensor_value_info
    w = numpy_helper.from_array(np.full((2, 2, 3, 3), 0.1, np.float32), "w")
    nodes = [helper.make_node("Conv", ["x", "w"], ["h"], name="conv", auto_pad="SAME_UPPER", dilations=[2, 2]),
             helper.make_node("Relu", ["h"], ["y"], name="act")]
    return _model(nodes, [vi("x", TensorProto.FLOAT, [1, 2, 6, 6])], [vi("y", TensorProto.FLOAT, [1, 2, 6, 6])], [w])


#: What `run`, `verify` and `train` say of a bfloat16 model or its stages, before any worker starts.
_BF16 = (r"^error: bf16\.onnx: bfloat16 tensors \('x', 'y'.*\): onnxruntime's Python API hands no bfloat16 arrays to numpy, so onnxpipe "
         r"cannot {doing} it; export the model in float32, or in float16 \(`train --master-weights` for mixed precision\); `plan` and "
         r"`split` take it as it is$")


def _target(memory: str, extra: str = "") -> str:
    return f"""name = "tiny"
description = "two small accelerators"
{extra}
[[devices]]
name = "dev"
kind = "fpga"
count = 2
memory = "{memory}"
memory_bandwidth = "460 GB/s"
op_overhead = "5 us"
[devices.peak_flops]
float32 = "1 TFLOP/s"
[devices.efficiency]
default = 0.3
[[links]]
between = ["dev", "dev"]
bandwidth = "12 GB/s"
latency = "10 us"
topology = "pcie"
"""


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Models and a stage directory every case copies from."""
    from onnxpipe.graph import load
    from onnxpipe.plan import plan_model
    from onnxpipe.split import split

    root = tmp_path_factory.mktemp("bad-input-base")
    onnx.save(models.build("mlp"), str(root / "mlp.onnx"))
    onnx.save(models.build("two-io"), str(root / "other.onnx"))
    onnx.save(_fails_checker(), str(root / "fails_checker.onnx"))
    onnx.save(_symbolic(), str(root / "symbolic.onnx"))
    onnx.save(_atan_with_loss(), str(root / "atan.onnx"))
    onnx.save(_embedding(), str(root / "embedding.onnx"))
    graph, _, _, plan = plan_model(root / "mlp.onnx", "fpga4", stages=2, time_limit=5)
    split(graph, plan, root / "stages")
    graph, _, _, plan = plan_model(root / "embedding.onnx", "fpga4", stages=1, time_limit=5)
    split(graph, plan, root / "embedding-stages")
    onnx.save(_dilated_same(), str(root / "dilated.onnx"))
    graph, _, _, plan = plan_model(root / "dilated.onnx", "fpga4", stages=2, time_limit=5)
    split(graph, plan, root / "dilated-stages")
    onnx.save(_bfloat16(), str(root / "bf16.onnx"))
    graph, _, _, plan = plan_model(root / "bf16.onnx", "fpga4", stages=2, time_limit=5)  # plan and split take it
    split(graph, plan, root / "bf16-stages")
    load(root / "mlp.onnx")  # the base must itself be good input
    np.savez(root / "good.npz", x=np.zeros((8, 16), np.float32))
    return root


def copy(*names: str) -> Callable[[Path, Path], None]:
    def make(tmp: Path, base: Path) -> None:
        for name in names:
            (shutil.copytree if (base / name).is_dir() else shutil.copy)(base / name, tmp / name)
    return make


def write(name: str, content: str | bytes) -> Callable[[Path, Path], None]:
    def make(tmp: Path, base: Path) -> None:
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(content if isinstance(content, bytes) else content.encode())
    return make


def both(*makers: Callable[[Path, Path], None]) -> Callable[[Path, Path], None]:
    def make(tmp: Path, base: Path) -> None:
        for maker in makers:
            maker(tmp, base)
    return make


def truncated(tmp: Path, base: Path) -> None:
    (tmp / "cut.onnx").write_bytes((base / "mlp.onnx").read_bytes()[:3000])


def npz(**arrays: np.ndarray) -> Callable[[Path, Path], None]:
    def make(tmp: Path, base: Path) -> None:
        np.savez(tmp / "in.npz", **arrays)
    return make


def edited_stages(edit: Callable[[dict, Path], None]) -> Callable[[Path, Path], None]:
    """The stage directory with its manifest (or files) edited into inconsistency."""
    def make(tmp: Path, base: Path) -> None:
        shutil.copytree(base / "stages", tmp / "stages")
        shutil.copy(base / "mlp.onnx", tmp / "mlp.onnx")
        shutil.copy(base / "good.npz", tmp / "good.npz")
        path = tmp / "stages" / "manifest.json"
        data = json.loads(path.read_text())
        edit(data, tmp / "stages")
        path.write_text(json.dumps(data))
    return make


def _unsent(data: dict, _: Path) -> None:
    for out in data["stages"][0]["outputs"]:
        out["consumers"] = [c for c in out["consumers"] if c != 1]


def _missing_file(_: dict, directory: Path) -> None:
    (directory / "stage_1.onnx").unlink()


def _out_of_order(data: dict, _: Path) -> None:
    data["stages"][0]["index"], data["stages"][1]["index"] = 1, 0


def _wrong_shape(data: dict, _: Path) -> None:
    data["stages"][1]["inputs"][0]["shape"] = [8, 999]


#: A file outside every directory under test: no command may read it.
SECRET = b"secret bytes that no output may ever contain " * 4


def _secret(directory: Path) -> Path:
    """`secret.bin` beside the stage directory, and its absolute path."""
    path = directory.parent / "secret.bin"
    path.write_bytes(SECRET)
    return path


def _file_absolute(data: dict, directory: Path) -> None:
    shutil.copy(directory / "stage_1.onnx", directory.parent / "elsewhere.onnx")
    data["stages"][1]["file"] = str(directory.parent / "elsewhere.onnx")


def _file_climbs_out(data: dict, directory: Path) -> None:
    (directory.parent / "x").mkdir()
    shutil.copy(directory / "stage_1.onnx", directory.parent / "x" / "stage_1.onnx")
    data["stages"][1]["file"] = "../x/stage_1.onnx"


def _file_symlink_out(data: dict, directory: Path) -> None:
    shutil.move(directory / "stage_1.onnx", directory.parent / "stage_1.onnx")
    (directory / "stage_1.onnx").symlink_to(directory.parent / "stage_1.onnx")


def _data_file_out(data: dict, directory: Path) -> None:
    data["stages"][0]["data_file"] = str(_secret(directory))


def _external(model_path: Path, location: str) -> None:
    """Point the first float initializer of a model at `location` as its external data."""
    model = onnx.load(str(model_path))
    tensor = next(t for t in model.graph.initializer if t.data_type == TensorProto.FLOAT and len(t.raw_data) >= 16)
    length = len(tensor.raw_data)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", str(length))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    model_path.write_bytes(model.SerializeToString())


def _stage_weights_absolute(_: dict, directory: Path) -> None:
    _external(directory / "stage_0.onnx", str(_secret(directory)))


def _stage_weights_climb_out(_: dict, directory: Path) -> None:
    _secret(directory)
    _external(directory / "stage_0.onnx", "../secret.bin")


def _stage_weights_symlink_out(_: dict, directory: Path) -> None:
    (directory / "w.bin").symlink_to(_secret(directory))
    _external(directory / "stage_0.onnx", "w.bin")


def _broken_gemm(_: dict, directory: Path) -> None:
    """A stage whose Gemm reads its weight untransposed: loads, then fails when run (onnxruntime logs such failures in colour)."""
    model = onnx.load(str(directory / "stage_1.onnx"))
    gemm = [n for n in model.graph.node if n.op_type == "Gemm"][-1]  # out/Gemm: a 10 x 32 weight
    del gemm.attribute[:]
    (directory / "stage_1.onnx").write_bytes(model.SerializeToString())


def edited_plan(edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    """The model and its plan (from the stage directory), the plan edited."""
    def make(tmp: Path, base: Path) -> None:
        shutil.copy(base / "mlp.onnx", tmp / "mlp.onnx")
        data = json.loads((base / "stages" / "plan.json").read_text())
        edit(data)
        (tmp / "p.json").write_text(json.dumps(data))
    return make


def _set(path: str, value: object) -> Callable[[dict], None]:
    """An edit setting one field, its path dotted with list indices as numbers (e.g. stages.0.memory)."""
    def edit(data: dict) -> None:
        *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
        for key in parents:
            data = data[key]
        data[last] = value
    return edit


def _checkpoint_of(optimizer: str, master_weights: bool = False) -> Callable[[Path, Path], None]:
    """A complete checkpoint of the 2-stage mlp (empty states) trained with `optimizer`."""
    def make(tmp: Path, base: Path) -> None:
        (tmp / "ck").mkdir()
        entries = []
        for i in range(2):
            np.savez(tmp / "ck" / f"stage_{i}.npz")
            entries.append({"file": f"stage_{i}.npz", "sha256": hashlib.sha256((tmp / "ck" / f"stage_{i}.npz").read_bytes()).hexdigest(), "step": 1})
        index = {"format": "onnxpipe.checkpoint/1", "step": 1, "meta": {"optimizer": optimizer, "master_weights": master_weights}, "stages": entries}
        (tmp / "ck" / "checkpoint.json").write_text(json.dumps(index))
    return make


def _forged_npz(tmp: Path, base: Path) -> None:
    """An .npz whose one array declares 10^12 floats and holds none."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (10**12,)})
    with zipfile.ZipFile(tmp / "in.npz", "w") as archive:
        archive.writestr("x.npy", header.getvalue())  # magic and header, no data


def _checkpoint_out(tmp: Path, base: Path) -> None:
    (tmp / "ck").mkdir()
    _secret(tmp / "ck")
    index = {"format": "onnxpipe.checkpoint/1", "step": 1, "meta": {},
             "stages": [{"file": "../secret.bin", "sha256": hashlib.sha256(SECRET).hexdigest(), "step": 1}]}
    (tmp / "ck" / "checkpoint.json").write_text(json.dumps(index))


def _model_weights_out(tmp: Path, base: Path) -> None:
    shutil.copytree(base / "stages", tmp / "stages")
    (tmp / "m").mkdir()
    shutil.copy(base / "mlp.onnx", tmp / "m" / "mlp.onnx")
    _secret(tmp / "m")
    _external(tmp / "m" / "mlp.onnx", "../secret.bin")


def _newer_opset(name: str, opset: int = 22) -> Callable[[Path, Path], None]:
    """mlp.onnx claiming a default-domain opset onnxruntime 1.19 has no kernels for."""
    def make(tmp: Path, base: Path) -> None:
        model = onnx.load(str(base / "mlp.onnx"))
        next(o for o in model.opset_import if o.domain in ("", "ai.onnx")).version = opset
        onnx.save(model, str(tmp / name))
    return make


def _float4_ir11(tmp: Path, base: Path) -> None:
    """An IR-11 model holding a FLOAT4E2M1 tensor: lowering it to IR 10 would write a type onnxruntime 1.19 cannot read."""
    model = onnx.load(str(base / "mlp.onnx"))
    model.ir_version = 11
    model.graph.initializer.append(helper.make_tensor("scale4", TensorProto.FLOAT4E2M1, [2], [0.5, 1.0]))
    onnx.save(model, str(tmp / "float4.onnx"))


def _stage_newer_opset(_: dict, directory: Path) -> None:
    model = onnx.load(str(directory / "stage_1.onnx"))
    next(o for o in model.opset_import if o.domain in ("", "ai.onnx")).version = 22
    onnx.save(model, str(directory / "stage_1.onnx"))


@dataclass(frozen=True)
class Case:
    id: str
    files: Callable[[Path, Path], None]
    argv: tuple[str, ...]
    message: str
    absent: tuple[str, ...] = ()
    #: Files that must still be there afterwards.
    kept: tuple[str, ...] = ()


_OPSET_22 = r"opset 22 is above what onnxruntime 1\.19 loads \(21\); convert it with onnx\.version_converter\.convert_version\(model, 21\)"

CASES = [
    Case("opset-above-runtime-split", _newer_opset("new.onnx"), ("split", "new.onnx", "-t", "fpga4", "-o", "out"), r"new\.onnx: " + _OPSET_22, ("out",)),
    Case("opset-above-runtime-plan", _newer_opset("new.onnx"), ("plan", "new.onnx", "-t", "fpga4", "-o", "p.json"), _OPSET_22, ("p.json",)),
    Case("opset-above-runtime-annotate", _newer_opset("new.onnx"), ("annotate", "new.onnx", "-o", "a.onnx"), _OPSET_22, ("a.onnx",)),
    Case("opset-above-runtime-train", _newer_opset("new.onnx"), ("train", "new.onnx", "--steps", "1", "--json", "t.json"), _OPSET_22, ("t.json",)),
    Case("opset-above-runtime-verify", both(copy("stages"), _newer_opset("new.onnx")), ("verify", "stages", "new.onnx"), _OPSET_22),
    Case("verify-arguments-swapped", both(copy("stages"), copy("mlp.onnx")), ("verify", "mlp.onnx", "stages"),
         r"verify takes the stage directory first, then the model: onnxpipe verify stages mlp\.onnx"),
    Case("opset-above-runtime-stage", edited_stages(_stage_newer_opset), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"stage_1\.onnx: " + _OPSET_22, ("o.npz",)),
    Case("ir-11-type-ir-10-lacks", _float4_ir11, ("split", "float4.onnx", "-t", "fpga4", "-o", "out"),
         r"float4\.onnx: IR version 11 with tensor 'scale4' of type FLOAT4E2M1, which IR 10 .* lacks; cast it", ("out",)),
    Case("profile-needs-more-memory-than-the-host", copy("symbolic.onnx"),
         ("split", "symbolic.onnx", "-t", "cpu2", "--dim", "batch=1000000000000", "-o", "out"),
         r"profiling symbolic\.onnx on this machine needs [\d.]+ TiB .* but [\d.]+ [GMT]iB are available: dim 'batch' = 1000000000000 .*--dim batch=.*--batch",
         ("out",)),
    Case("not-a-file", write("dir/placeholder", ""), ("plan", "dir", "-t", "fpga4"), r"dir: not a file; pass the path of an \.onnx model"),
    Case("missing-file", lambda t, b: None, ("annotate", "nowhere.onnx"), r"nowhere\.onnx: no such file"),
    Case("not-onnx", write("text.onnx", "hello, not a model\n"), ("split", "text.onnx", "-t", "fpga4", "-o", "out"),
         r"text\.onnx: not a readable ONNX model .*re-export", ("out",)),
    Case("truncated-protobuf", truncated, ("split", "cut.onnx", "-t", "fpga4", "-o", "out"), r"cut\.onnx: not a readable ONNX model \(EOFError\); .*complete",
         ("out",)),
    Case("fails-onnx-checker", copy("fails_checker.onnx"), ("split", "fails_checker.onnx", "-t", "fpga4", "-o", "out"),
         r"fails_checker\.onnx: fails onnx\.checker \(Unrecognized attribute: bogus for operator Relu\); .*re-export", ("out",)),
    Case("unbound-symbolic-dim", copy("symbolic.onnx"), ("plan", "symbolic.onnx", "-t", "fpga4", "-o", "p.json"),
         r"dim 'batch' of input 'x' is unbound; .*--dim batch=VALUE", ("p.json",)),
    Case("dim-names-nothing", copy("mlp.onnx"), ("annotate", "mlp.onnx", "--dim", "seq=4", "-o", "a.onnx"),
         r"--dim seq names no symbolic dim of the model", ("a.onnx",)),
    Case("op-without-gradient", copy("atan.onnx"), ("train", "atan.onnx", "--steps", "1", "--microbatches", "1", "--json", "t.json"),
         r"no gradient for Atan \(1 node: mix\); re-export", ("t.json",)),
    Case("no-loss-output", copy("mlp.onnx"), ("train", "mlp.onnx", "--steps", "1", "--json", "t.json"),
         r"model 'mlp\.onnx' has no loss output .*, so it cannot be trained as it is; `onnxpipe train` appends one with --loss", ("t.json",)),
    Case("target-unknown-key", both(copy("mlp.onnx"), write("t.toml", _target("8 GiB", "colour = 'red'"))),
         ("plan", "mlp.onnx", "-t", "t.toml", "-o", "p.json"), r"t\.toml: colour: unknown key; use name, description", ("p.json",)),
    Case("target-missing-field", both(copy("mlp.onnx"), write("t.toml", _target("8 GiB").replace('op_overhead = "5 us"\n', ""))),
         ("split", "mlp.onnx", "-t", "t.toml", "-o", "out"), r"t\.toml: devices\[0\]\.op_overhead: missing; add e\.g\. op_overhead =", ("out",)),
    Case("target-negative-number", both(copy("mlp.onnx"), write("t.toml", _target("-4 GiB"))), ("plan", "mlp.onnx", "-t", "t.toml"),
         r"t\.toml: devices\[0\]\.memory: must be positive, got '-4 GiB'"),
    Case("target-unknown-name", copy("mlp.onnx"), ("plan", "mlp.onnx", "-t", "fpga9"), r"unknown target 'fpga9'; bundled targets: .*\.toml"),
    Case("more-stages-than-devices", copy("mlp.onnx"), ("split", "mlp.onnx", "-t", "fpga4", "--stages", "5", "-o", "out"),
         r"--stages 5 is more than the target's 4 devices; use at most 4", ("out",)),
    Case("infeasible-memory", both(copy("mlp.onnx"), write("t.toml", _target("1 KiB"))), ("split", "mlp.onnx", "-t", "t.toml", "-o", "out"),
         r"no plan fits: the smallest stage needs .* of memory but the largest device holds .*; try --recompute always", ("out",)),
    Case("plan-for-another-model", both(copy("other.onnx"), copy("stages")), ("split", "other.onnx", "--plan", "stages/plan.json", "-o", "out"),
         r"the plan was made for another model \(fingerprint \w+, this model's is \w+\); re-plan", ("out",)),
    Case("plan-not-json", both(copy("mlp.onnx"), write("p.json", "{")), ("split", "mlp.onnx", "--plan", "p.json", "-o", "out"),
         r"p\.json: not valid JSON .*regenerate it", ("out",)),
    Case("manifest-input-not-sent", edited_stages(_unsent), ("verify", "stages", "mlp.onnx"),
         r"manifest\.json: stage 1 input '[^']+' is not sent to it by stage 0; .*onnxpipe split"),
    Case("manifest-stage-file-missing", edited_stages(_missing_file), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"manifest\.json: stage 1 file stage_1\.onnx is missing; .*onnxpipe split", ("o.npz",)),
    Case("manifest-stage-out-of-order", edited_stages(_out_of_order), ("train", "stages", "--steps", "1", "--json", "t.json"),
         r"manifest\.json: stage 0 is listed with index 1; stages must be numbered 0\.\.1 in order", ("t.json",)),
    Case("manifest-shape-disagrees", edited_stages(_wrong_shape), ("verify", "stages", "mlp.onnx"),
         r"manifest\.json: stage 1 input '[^']+' is float32 \(8, 999\) in the manifest but float32 \(8, \d+\) in stage_1\.onnx"),
    Case("manifest-file-absolute", edited_stages(_file_absolute), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"manifest\.json: stage 1 file '/.*elsewhere\.onnx' is an absolute path; only files inside stages are read", ("o.npz",)),
    Case("manifest-file-climbs-out", edited_stages(_file_climbs_out), ("verify", "stages", "mlp.onnx"),
         r"manifest\.json: stage 1 file '\.\./x/stage_1\.onnx' climbs out of stages with '\.\.'"),
    Case("manifest-file-symlink-out", edited_stages(_file_symlink_out), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"stage 1 file 'stage_1\.onnx' leads out of stages through a symlink", ("o.npz",)),
    Case("manifest-data-file-out", edited_stages(_data_file_out), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"stage 0 weights file '/.*secret\.bin' is an absolute path", ("o.npz",)),
    Case("stage-external-data-absolute", edited_stages(_stage_weights_absolute), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"stage_0\.onnx: the external data of tensor '[^']+' '/.*secret\.bin' is an absolute path", ("o.npz",)),
    Case("stage-external-data-climbs-out", edited_stages(_stage_weights_climb_out), ("verify", "stages", "mlp.onnx"),
         r"stage_0\.onnx: the external data of tensor '[^']+' '\.\./secret\.bin' climbs out of stages"),
    Case("stage-external-data-symlink", edited_stages(_stage_weights_symlink_out), ("train", "stages", "--steps", "1", "--json", "t.json"),
         r"stage_0\.onnx: the external data of tensor '[^']+' 'w\.bin' leads out of stages through a symlink", ("t.json",)),
    Case("model-external-data-out", _model_weights_out, ("verify", "stages", "m/mlp.onnx"),
         r"m/mlp\.onnx: the external data of tensor '[^']+' '\.\./secret\.bin' climbs out of m"),
    Case("model-external-data-out-split", _model_weights_out, ("split", "m/mlp.onnx", "-t", "fpga4", "-o", "out"),
         r"m/mlp\.onnx: the external data of tensor '[^']+' '\.\./secret\.bin' climbs out of m", ("out",)),
    Case("checkpoint-file-climbs-out", both(copy("stages"), _checkpoint_out),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "2", "--checkpoint-dir", "ck", "--resume", "--json", "t.json"),
         r"ck/checkpoint\.json: stage file '\.\./secret\.bin' climbs out of ck", ("t.json",)),
    Case("force-over-the-model", both(write("m/notes.txt", "mine"), lambda t, b: shutil.copy(b / "mlp.onnx", t / "m" / "mlp.onnx")),
         ("split", "m/mlp.onnx", "-t", "fpga4", "-o", "m", "--force"),
         r"m: holds 'mlp\.onnx', which onnxpipe did not write; --force replaces only a stage directory written by `onnxpipe split`",
         kept=("m/mlp.onnx", "m/notes.txt")),
    Case("force-over-a-directory-with-more", both(copy("stages", "mlp.onnx"), write("stages/notes.txt", "mine")),
         ("split", "mlp.onnx", "-t", "fpga4", "-o", "stages", "--force"), r"stages: holds 'notes\.txt', which onnxpipe did not write",
         kept=("stages/notes.txt", "stages/stage_1.onnx")),
    Case("force-over-a-fake-manifest", both(copy("mlp.onnx"), write("d/manifest.json", "{}")), ("split", "mlp.onnx", "-t", "fpga4", "-o", "d", "--force"),
         r"d: its manifest\.json is not an onnxpipe manifest; --force replaces only a stage directory"),
    Case("stage-fails-in-onnxruntime", edited_stages(_broken_gemm), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"stage 1 \(stage_1\.onnx\) failed at micro-batch 0 \(forward\): .*Gemm.*re-split", ("o.npz",)),
    Case("batch-zero", copy("mlp.onnx"), ("plan", "mlp.onnx", "-t", "fpga4", "--batch", "0", "-o", "p.json"), r"--batch 0: must be 1 or more",
         ("p.json",)),
    Case("stages-zero", copy("mlp.onnx"), ("split", "mlp.onnx", "-t", "fpga4", "--stages", "0", "-o", "out"), r"--stages 0: must be 1 or more", ("out",)),
    Case("steps-negative", copy("stages"), ("train", "stages", "--steps", "-5", "--json", "t.json"), r"--steps -5: must be 1 or more", ("t.json",)),
    Case("checkpoint-every-negative", copy("stages"), ("train", "stages", "--checkpoint-dir", "ck", "--checkpoint-every", "-1"),
         r"--checkpoint-every -1: must be 0 or more", ("ck",)),
    Case("train-microbatches-zero", copy("stages"), ("train", "stages", "--microbatches", "0"), r"--microbatches 0: must be 1 or more$"),
    Case("plan-microbatches-zero", copy("mlp.onnx"), ("plan", "mlp.onnx", "-t", "fpga4", "--microbatches", "0"),
         r"--microbatches '0': expected a positive integer or 'auto'"),
    Case("simulate-microbatches-zero", copy("stages"), ("simulate", "stages", "--microbatches", "0"), r"--microbatches 0: must be 1 or more"),
    Case("run-microbatches-zero", both(copy("stages"), copy("good.npz")), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz", "--microbatches", "0"),
         r"--microbatches 0: must be 1 or more", ("o.npz",)),
    Case("time-limit-nan", copy("mlp.onnx"), ("plan", "mlp.onnx", "-t", "fpga4", "--time-limit", "nan"), r"--time-limit nan: must be a finite number above 0"),
    Case("lr-infinite", copy("stages"), ("train", "stages", "--lr", "inf"), r"--lr inf: must be a finite number above 0"),
    Case("dim-zero", copy("symbolic.onnx"), ("annotate", "symbolic.onnx", "--dim", "batch=0"), r"--dim 'batch=0': expected NAME=VALUE with a positive integer"),
    Case("resume-without-checkpoint", copy("stages"),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "1", "--checkpoint-dir", "ck", "--resume", "--json", "t.json"),
         r"ck: no checkpoint\.json, nothing to resume; .*or start without --resume", ("t.json", "ck")),
    Case("resume-with-another-optimizer", both(copy("stages"), _checkpoint_of("adamw")),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "2", "--checkpoint-dir", "ck", "--resume", "--json", "t.json"),
         r"ck: the checkpoint was trained with adamw, this run uses sgd; resume with --optimizer adamw or start without --resume", ("t.json",)),
    Case("bfloat16-run", both(copy("bf16-stages"), copy("good.npz")), ("run", "bf16-stages", "--inputs", "good.npz", "-o", "o.npz"),
         _BF16.format(doing="run"), ("o.npz",)),
    Case("bfloat16-verify", copy("bf16-stages", "bf16.onnx"), ("verify", "bf16-stages", "bf16.onnx"), _BF16.format(doing="verify")),
    Case("bfloat16-train-stages", copy("bf16-stages"), ("train", "bf16-stages", "--loss", "mse", "--labels", "y=labels", "--steps", "1"),
         _BF16.format(doing="train")),
    Case("bfloat16-train-model", copy("bf16.onnx"), ("train", "bf16.onnx", "--loss", "mse", "--labels", "y=labels", "--steps", "1"),
         _BF16.format(doing="train")),
    Case("verify-against-a-model-onnxruntime-cannot-run", copy("dilated-stages", "dilated.onnx"), ("verify", "dilated-stages", "dilated.onnx"),
         r"dilated\.onnx: onnxruntime cannot run the model itself \(.*Dilation not supported for AutoPadType.*\), so there is nothing to "
         r"compare the stages with; `run` the stages, or verify against a model onnxruntime runs$"),
    Case("bfloat16-profiled", copy("bf16.onnx"), ("plan", "bf16.onnx", "-t", "cpu2"),
         r"profiling failed in onnxruntime \(Could not find an implementation for Gemm\(13\) node with name 'fc'\); price the model "
         r"without measuring it: `plan --no-profile`, `annotate` without --profile$"),
    Case("resume-without-master-weights", both(copy("stages"), _checkpoint_of("sgd", master_weights=True)),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "2", "--checkpoint-dir", "ck", "--resume", "--json", "t.json"),
         r"ck: the checkpoint was trained with --master-weights, this run without; resume with it or start without --resume", ("t.json",)),
    Case("plan-schedule-bogus", edited_plan(_set("schedule", "bogus")), ("split", "mlp.onnx", "--plan", "p.json", "-o", "out"),
         r"p\.json: schedule: 'bogus' is not one of gpipe, 1f1b, .*; regenerate it", ("out",)),
    Case("plan-microbatches-zero-in-file", edited_plan(_set("microbatches", 0)), ("split", "mlp.onnx", "--plan", "p.json", "-o", "out"),
         r"p\.json: batch \d+, microbatches 0: need at least 1 micro-batch", ("out",)),
    Case("plan-null-number", edited_plan(_set("stages.0.forward_seconds", None)), ("simulate", "p.json"),
         r"p\.json: stages\[0\]\.forward_seconds: expected a finite number, got null"),
    Case("plan-string-list", edited_plan(_set("stages.1.nodes", "fc0/Gemm")), ("split", "mlp.onnx", "--plan", "p.json", "-o", "out"),
         r"p\.json: stages\[1\]\.nodes: expected a list, got 'fc0/Gemm'", ("out",)),
    Case("plan-a-list", both(copy("mlp.onnx"), write("p.json", "[1, 2]")), ("split", "mlp.onnx", "--plan", "p.json", "-o", "out"),
         r"p\.json: not an onnxpipe plan \(format None", ("out",)),
    Case("manifest-string-shape", edited_stages(lambda d, _: _set("inputs.0.shape", "8,16")(d)), ("verify", "stages", "mlp.onnx"),
         r"manifest\.json: inputs\[0\]\.shape: expected a list, got '8,16'"),
    Case("manifest-null-stages", edited_stages(lambda d, _: _set("stages", None)(d)), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"manifest\.json: stages: expected a list, got null", ("o.npz",)),
    Case("manifest-bad-dtype", edited_stages(lambda d, _: _set("inputs.0.dtype", "float99")(d)), ("verify", "stages", "mlp.onnx"),
         r"manifest\.json: inputs\[0\]\.dtype: 'float99' is no ONNX tensor type"),
    Case("token-id-out-of-range", both(copy("embedding-stages"), npz(ids=np.array([[0, 10, 2], [3, 4, 5]]))),
         ("run", "embedding-stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"input 'ids' holds 10 at \[0, 1\]; it indexes the 10 rows of the table Gather 'embed' reads: give values in \[0, 10\)", ("o.npz",)),
    Case("token-id-negative", both(copy("embedding-stages"), npz(ids=np.array([[0, 1, 2], [3, -1, 5]]))),
         ("run", "embedding-stages", "--inputs", "in.npz", "-o", "o.npz"), r"input 'ids' holds -1 at \[1, 1\]; .*give values in \[0, 10\)", ("o.npz",)),
    Case("token-id-float", both(copy("embedding-stages"), npz(ids=np.full((2, 3), 1.5))),
         ("run", "embedding-stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"input 'ids' holds float64 values; the model takes int64: give integers \(ids, labels, counts\)", ("o.npz",)),
    Case("npz-strings", both(copy("stages"), npz(x=np.array(["a", "b"]))), ("run", "stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"in\.npz: array 'x' holds <U1 values; give numbers or booleans", ("o.npz",)),
    Case("npz-forged-shape", both(copy("stages"), _forged_npz), ("run", "stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"in\.npz: array 'x' declares shape \(1000000000000,\), more than the file holds", ("o.npz",)),
    Case("npz-0-d-training-data", both(copy("stages"), npz(x=np.float32(1), y=np.zeros((16, 10), np.float32))),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "1", "--data", "in.npz", "--json", "t.json"),
         r"in\.npz: array 'x' is a single value \(0-d\); give one row per sample", ("t.json",)),
    Case("verify-another-model", copy("stages", "other.onnx"), ("verify", "stages", "other.onnx"),
         r"other\.onnx: its inputs \[.*\] differ from the stages' \['x'\]; pass the model the stages were split from"),
    Case("verify-rtol-negative", copy("stages", "mlp.onnx"), ("verify", "stages", "mlp.onnx", "--rtol", "-1"), r"--rtol -1\.0: must be a finite number 0 or more"),
    Case("manifest-not-json", both(copy("stages", "good.npz"), write("stages/manifest.json", "[")), ("run", "stages", "--inputs", "good.npz", "-o", "o.npz"),
         r"manifest\.json: not valid JSON", ("o.npz",)),
    Case("npz-missing-array", both(copy("stages"), npz(y=np.zeros(3))), ("run", "stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"input 'x' is missing; give an array of shape \(8, 16\) \(float32\)", ("o.npz",)),
    Case("npz-wrong-shape", both(copy("stages"), npz(x=np.zeros((3, 3), np.float32))), ("run", "stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"input 'x' has shape \(3, 3\); the stages expect \(8, 16\)", ("o.npz",)),
    Case("npz-not-npz", both(copy("stages"), write("in.npz", "junk")), ("run", "stages", "--inputs", "in.npz", "-o", "o.npz"),
         r"in\.npz: not a readable \.npz .*np\.savez", ("o.npz",)),
    Case("split-output-unwritable", both(copy("mlp.onnx"), write("file", "")), ("split", "mlp.onnx", "-t", "fpga4", "-o", "file/out"),
         r"cannot write there .*choose a writable -o"),
    Case("split-annotated-unwritable", both(copy("mlp.onnx"), write("file", "")),
         ("split", "mlp.onnx", "-t", "fpga4", "-o", "out", "--annotated", "file/a.onnx"), r"file/a\.onnx: cannot write the annotated model", ("out",)),
    Case("run-output-unwritable", both(copy("stages"), copy("good.npz"), write("file", "")),
         ("run", "stages", "--inputs", "good.npz", "-o", "file/o.npz"), r"file/o\.npz: cannot write \(Not a directory\); choose another -o"),
    Case("annotate-output-unwritable", both(copy("mlp.onnx"), write("file", "")), ("annotate", "mlp.onnx", "-o", "file/a.onnx"),
         r"file/a\.onnx: cannot write the annotated model .*-o"),
    Case("plan-output-unwritable", both(copy("mlp.onnx"), write("file", "")), ("plan", "mlp.onnx", "-t", "fpga4", "-o", "file/p.json"),
         r"file/p\.json: cannot write the plan \(Not a directory\)"),
    Case("report-output-unwritable", both(copy("stages"), write("file", "")), ("report", "stages", "-o", "file/r.html"),
         r"file/r\.html: cannot write the report"),
    Case("checkpoint-dir-unwritable", both(copy("stages"), write("file", "")),
         ("train", "stages", "--loss", "mse", "--labels", "out/Gemm=y", "--steps", "1", "--checkpoint-dir", "file/ck", "--checkpoint-every", "1"),
         r"file/ck: cannot write a checkpoint there .*--checkpoint-dir"),
    Case("bad-dim-syntax", copy("mlp.onnx"), ("annotate", "mlp.onnx", "--dim", "batch"), r"--dim 'batch': expected NAME=VALUE"),
    Case("resume-without-dir", copy("stages"), ("train", "stages", "--resume"), r"--resume needs --checkpoint-dir DIR"),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_one_line_and_exit_2(case: Case, base: Path, tmp_path: Path) -> None:
    case.files(tmp_path, base)
    before = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")}
    result = onnxpipe(*case.argv, cwd=tmp_path)
    err = result.stderr.strip()
    assert result.returncode == 2, f"exit {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert "Traceback" not in result.stderr + result.stdout
    assert err and len(err.splitlines()) == 1, f"stderr is not one line:\n{result.stderr}"
    assert err.startswith("error: ")
    assert re.search(case.message, err), err
    for path in case.absent:
        assert not (tmp_path / path).exists(), f"{path} was left behind"
    for path in case.kept:
        assert (tmp_path / path).is_file(), f"{path} was deleted"
    left = {p.relative_to(tmp_path) for p in tmp_path.rglob("*")} - before
    assert not [p for p in left if p.name.startswith(".")], f"temporary files left behind: {left}"


def test_long_messages_stay_on_one_line(base: Path, tmp_path: Path) -> None:
    """A message far wider than the terminal is not wrapped (a narrow COLUMNS must not split it)."""
    deep = tmp_path / ("a-rather-long-directory-name-" * 4)
    deep.mkdir()
    result = subprocess.run([sys.executable, "-m", "onnxpipe", "plan", str(deep / "missing.onnx"), "-t", "fpga4"], cwd=tmp_path,
                            env={**ENV, "COLUMNS": "40"}, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr
    assert str(deep / "missing.onnx") in result.stderr


def test_debug_shows_the_traceback(base: Path, tmp_path: Path) -> None:
    shutil.copy(base / "symbolic.onnx", tmp_path / "symbolic.onnx")
    result = onnxpipe("--debug", "plan", "symbolic.onnx", "-t", "fpga4", cwd=tmp_path)
    assert result.returncode != 0
    assert "Traceback" in result.stderr and "OnnxpipeError" in result.stderr and "is unbound" in result.stderr
