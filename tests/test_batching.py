"""One batch convention for every command: a symbolic leading dim is bound to --batch / --microbatches (or by
--dim), a fixed one must match them, and split, plan, train (with --check, from a model or a stage directory)
say how they bound it."""

from __future__ import annotations

import json
import re
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


@pytest.fixture(scope="module")
def split_dynamic(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The symbolic-batch model split at batch 8 = 4 micro-batches of 2, beside its model."""
    root = tmp_path_factory.mktemp("dynamic")
    shutil.copy(DYNAMIC, root / "m.onnx")
    run = onnxpipe("split", "m.onnx", "--target", "cpu2", "--stages", "2", "--batch", "8", "--microbatches", "4", "-o", "stages", cwd=root)
    assert run.returncode == 0, run.stderr
    return root


def test_verify_binds_the_stage_files_batch_and_checks_dim(split_dynamic: Path) -> None:
    run = onnxpipe("verify", "stages", "m.onnx", "--samples", "1", cwd=split_dynamic)
    assert run.returncode == 0, run.stderr
    assert "batch 8 per iteration = 4 micro-batches of 2 (the stage files' batch)" in run.stdout
    error = float(re.search(r"loss\s*│\s*([0-9.e+-]+)", run.stdout).group(1))  # chained stages vs the unsplit model at batch 2
    assert error <= 1e-5
    assert onnxpipe("verify", "stages", "m.onnx", "--samples", "1", "--dim", "batch=2", cwd=split_dynamic).returncode == 0
    bad = onnxpipe("verify", "stages", "m.onnx", "--dim", "batch=3", cwd=split_dynamic)
    assert bad.returncode == 2 and "--dim batch=3: the stages were split with batch=2; pass --dim batch=2, or split again with --dim batch=3" in bad.stderr


def test_run_cuts_the_global_batch_into_the_stage_files_micro_batches(split_dynamic: Path) -> None:
    import numpy as np
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    ids, labels = (rng.integers(0, 256, size=(8, 16)).astype(np.int64) for _ in range(2))
    np.savez(split_dynamic / "in.npz", input_ids=ids, labels=labels)
    run = onnxpipe("run", "stages", "--inputs", "in.npz", "-o", "out.npz", cwd=split_dynamic)  # no --microbatches: 8 rows / 2
    assert run.returncode == 0, run.stderr
    assert "batch 8 per iteration = 4 micro-batches of 2 (the stage files' batch)" in run.stdout
    session = ort.InferenceSession(str(split_dynamic / "m.onnx"), providers=["CPUExecutionProvider"])
    want = [session.run(["loss"], {"input_ids": ids[i:i + 2], "labels": labels[i:i + 2]})[0] for i in range(0, 8, 2)]
    with np.load(split_dynamic / "out.npz") as got:
        np.testing.assert_allclose(got["loss"], np.stack(want), rtol=1e-5)
    bad = onnxpipe("run", "stages", "--inputs", "in.npz", "-o", "bad.npz", "--dim", "batch=4", cwd=split_dynamic)
    assert bad.returncode == 2 and "--dim batch=4: the stages were split with batch=2" in bad.stderr and not (split_dynamic / "bad.npz").exists()


def test_simulate_rebinds_the_plans_batch_like_train(split_dynamic: Path) -> None:
    def simulate(*args: str) -> tuple[str, dict]:
        name = f"sim{len(list(split_dynamic.glob('sim*.json')))}.json"
        run = onnxpipe("simulate", "stages", *args, "--json", name, cwd=split_dynamic)
        assert run.returncode == 0, run.stderr
        return run.stdout.splitlines()[0], json.loads((split_dynamic / name).read_text())

    line, plan = simulate()
    assert line == "batch 8 per iteration = 4 micro-batches of 2 (the plan's batch)"
    line, by_dim = simulate("--dim", "batch=4")
    assert line == "batch 16 per iteration = 4 micro-batches of 4 (symbolic dim 'batch' bound to 4 by --dim batch)"
    line, by_batch = simulate("--batch", "16")
    assert line.startswith("batch 16 per iteration = 4 micro-batches of 4 (symbolic dim 'batch' bound to 4 by --batch / --microbatches")
    assert by_dim == by_batch  # one binding, whichever flag made it
    # twice the micro-batch: every stage's busy time doubles (compute and messages scale with it), the iteration is longer
    for doubled, base in zip(by_dim["stages"], plan["stages"]):
        assert doubled["busy_seconds"] > 1.5 * base["busy_seconds"]
    assert (by_dim["batch"], by_dim["microbatches"], plan["batch"]) == (16, 4, 8)
    bad = onnxpipe("simulate", "stages", "--dim", "batch=3", "--batch", "8", cwd=split_dynamic)
    assert bad.returncode == 2 and "--batch 8 is not 4 micro-batches of --dim batch=3; pass --batch 12" in bad.stderr
    other = onnxpipe("simulate", "stages", "--dim", "seq=4", cwd=split_dynamic)
    assert other.returncode == 2 and "re-plan the model with --dim seq=4" in other.stderr


def test_train_from_a_directory_checks_dim_before_any_worker(split_dynamic: Path) -> None:
    bad = onnxpipe("train", "stages", "--microbatches", "4", "--steps", "1", "--dim", "batch=4", cwd=split_dynamic)
    assert bad.returncode == 2 and "--dim batch=4: the stages were split with batch=2" in bad.stderr
