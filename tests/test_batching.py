"""One batch convention for every command: a symbolic leading dim is bound to --batch / --microbatches (or by
--dim), a fixed one must match them, and split, plan, train (with --check, from a model or a stage directory)
say how they bound it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.batching import bind_batch, stage_dims
from onnxpipe.errors import OnnxpipeError

DATA = Path(__file__).parent / "data"
DYNAMIC = DATA / "torch_gpt2_dynamo.onnx"  # input_ids, labels: ["batch", 16]; ends in its loss
FIXED = DATA / "torch_cnn_dynamo.onnx"  # x: [2, 3, 16, 16]


def onnxpipe(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "onnxpipe", *args], capture_output=True, text=True, timeout=600, cwd=cwd)


def test_symbolic_batch_is_one_micro_batch() -> None:
    binding = bind_batch(DYNAMIC, None, 8, 4)
    assert binding.dims == {"batch": 2} and binding.symbol == "batch" and not binding.from_dim
    assert binding.describe(8, 4) == "batch 8 per iteration = 4 micro-batches of 2 (symbolic dim 'batch' bound to 2 by --batch / --microbatches (--dim overrides))"
    assert bind_batch(DYNAMIC, {"batch": 3}, None, 4).dims == {"batch": 3}
    assert stage_dims(DYNAMIC, {"input_ids": (5, 16)}) == {"batch": 5}


@pytest.mark.parametrize("dims,batch,microbatches,message", [
    (None, None, 4, r"dim 'batch' of input 'input_ids' is unbound; pass --batch B .* or --dim batch=VALUE"),
    (None, 8, None, r"pass --microbatches M too, or --dim batch=V"),
    (None, 8, 3, r"--batch 8 does not split into 3 micro-batches"),
    ({"batch": 3}, 8, 4, r"--batch 8 is not 4 micro-batches of --dim batch=3; pass --batch 12"),
])
def test_symbolic_batch_errors_name_the_flags(dims: dict[str, int] | None, batch: int | None, microbatches: int | None, message: str) -> None:
    with pytest.raises(OnnxpipeError, match=message):
        bind_batch(DYNAMIC, dims, batch, microbatches)


def test_fixed_batch_must_match() -> None:
    assert bind_batch(FIXED, None, 8, 4).microbatch == 2
    with pytest.raises(OnnxpipeError, match=r"--batch 16 with 4 micro-batches needs micro-batches of 4, but the model's batch is fixed at 2: pass --batch 8"):
        bind_batch(FIXED, None, 16, 4)


def test_split_binds_a_symbolic_batch_and_refuses_an_inconsistent_fixed_one(tmp_path: Path) -> None:
    run = onnxpipe("split", str(DYNAMIC), "--target", "cpu2", "--stages", "2", "--batch", "8", "--microbatches", "4", "-o", "stages", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "batch 8 per iteration = 4 micro-batches of 2 (symbolic dim 'batch' bound to 2" in run.stdout
    manifest = json.loads((tmp_path / "stages" / "manifest.json").read_text())
    assert [i["shape"] for i in manifest["inputs"]] == [[2, 16], [2, 16]]
    plan = json.loads((tmp_path / "stages" / "plan.json").read_text())
    assert (plan["batch"], plan["microbatches"]) == (8, 4)
    for extra in (("--microbatches", "4"), ()):  # bound up front, or caught when the plan's micro-batch differs from the files'
        run = onnxpipe("split", str(FIXED), "--target", "cpu2", "--stages", "2", "--batch", "16", *extra, "-o", "bad", cwd=tmp_path)
        assert run.returncode == 2 and "model's batch" in run.stderr and "pass --batch" in run.stderr, run.stderr
        assert not (tmp_path / "bad").exists()


def test_train_check_binds_the_reference_too_from_a_model_and_from_a_directory(tmp_path: Path) -> None:
    shutil.copy(DYNAMIC, tmp_path / "m.onnx")
    common = ("--target", "cpu2", "--stages", "2", "--microbatches", "2", "--steps", "2", "--check")
    run = onnxpipe("train", "m.onnx", "--batch", "8", *common, "--json", "a.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "batch 8 per iteration = 2 micro-batches of 4" in run.stdout
    assert json.loads((tmp_path / "a.json").read_text())["check"]["max_loss_rel_diff"] <= 1e-5
    run = onnxpipe("split", "m.onnx", "--target", "cpu2", "--stages", "2", "--batch", "8", "--microbatches", "2", "-o", "stages", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    run = onnxpipe("train", "../stages", *common, "--json", "b.json", cwd=elsewhere)  # the model is found beside the directory
    assert run.returncode == 0, run.stderr
    assert "batch 8 per iteration = 2 micro-batches of 4 (the stage files' batch)" in run.stdout
    assert json.loads((elsewhere / "b.json").read_text())["check"]["max_loss_rel_diff"] <= 1e-5
