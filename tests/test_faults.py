"""Fault injection: a full disk or an interruption while writing stages or checkpoints leaves the
previous state exactly as it was and no temporary files; a corrupted checkpoint is refused on
`--resume` from the command line.

Covered elsewhere, not repeated here: a worker killed mid-step fails training within 5 s and leaves
no process or shared-memory segment behind (tests/test_train.py::test_killed_worker_fails_fast_naming_the_stage);
a corrupted stage file is caught by `load_checkpoint` (tests/test_train.py::test_resume_gives_the_losses_of_an_uninterrupted_run);
a split that fails on a fresh directory leaves nothing (tests/test_split.py::test_failed_split_leaves_nothing_and_existing_dirs_need_force).
"""

from __future__ import annotations

import errno
import hashlib
import importlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.plan import Plan, plan_model

split_module = importlib.import_module("onnxpipe.split")  # the package attribute `split` is the function
checkpoint_module = importlib.import_module("onnxpipe.train.checkpoint")


def snapshot(directory: Path) -> dict[str, str]:
    """Every file under a directory by relative path, with its content digest."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def planned(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Graph, Plan]:
    root = tmp_path_factory.mktemp("faults")
    onnx.save(models.build("mlp", train=True), str(root / "mlp.onnx"))
    graph, _, _, plan = plan_model(root / "mlp.onnx", "fpga4", stages=3, time_limit=5)
    return root, graph, plan


def _fail_at_stage(monkeypatch: pytest.MonkeyPatch, index: int, error: BaseException) -> None:
    real = split_module.write_model

    def failing(model, path, *args, **kwargs):  # type: ignore[no-untyped-def]
        if Path(path).name == f"stage_{index}.onnx":
            with open(path, "wb") as f:  # half a file, then the fault
                f.write(b"\x08\x07")
            raise error
        return real(model, path, *args, **kwargs)

    monkeypatch.setattr(split_module, "write_model", failing)


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()], ids=["disk-full", "interrupted"])
def test_failed_split_over_a_previous_directory_leaves_it_intact(planned: tuple[Path, Graph, Plan], tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch, error: BaseException) -> None:
    _, graph, plan = planned
    out = tmp_path / "stages"
    split_module.split(graph, plan, out)
    before = snapshot(out)
    _fail_at_stage(monkeypatch, 1, error)
    with pytest.raises(OnnxpipeError if isinstance(error, OSError) else KeyboardInterrupt) as info:
        split_module.split(graph, plan, out, force=True)
    if isinstance(error, OSError):
        assert f"{tmp_path}: cannot write stage 1 (No space left on device); free space" in str(info.value)
    assert snapshot(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stages"], "temporary directories left behind"


def test_disk_full_during_split_is_one_line_from_the_cli(planned: tuple[Path, Graph, Plan], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from typer.testing import CliRunner

    from onnxpipe.cli import app

    root, graph, plan = planned
    plan.save(tmp_path / "plan.json")
    _fail_at_stage(monkeypatch, 2, OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(tmp_path / "out" / "stage_2.onnx")))
    result = CliRunner().invoke(app, ["split", str(root / "mlp.onnx"), "--plan", str(tmp_path / "plan.json"), "-o", str(tmp_path / "out")])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and "No space left on device" in lines[0] and "Traceback" not in result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


# --- checkpoints ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def stage_dir(planned: tuple[Path, Graph, Plan]) -> Path:
    root, graph, plan = planned
    out = root / "stages"
    if not out.exists():
        split_module.split(graph, plan, out)
    return out


def _trained(stage_dir: Path, steps: int, checkpoint: Path | None = None):  # type: ignore[no-untyped-def]
    from onnxpipe.train.fit import data_source, fit
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.pipeline import Pipeline

    pipe = Pipeline(stage_dir, microbatches=2, optimizer=OptimizerConfig("adamw", lr=0.01), processes=False)
    fit(pipe, data_source(pipe, "synthetic", seed=1), steps, checkpoint_dir=str(checkpoint) if checkpoint else None, every=1)
    return pipe


@pytest.mark.parametrize("error", [OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), KeyboardInterrupt()], ids=["disk-full", "interrupted"])
def test_failed_checkpoint_leaves_the_previous_one_intact(stage_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                          error: BaseException) -> None:
    from onnxpipe.train.fit import data_source

    ck = tmp_path / "ck"
    with _trained(stage_dir, 2, ck) as pipe:
        before = snapshot(ck)
        weights = {k: v.copy() for k, v in pipe.parameters().items()}
        pipe.train_step(data_source(pipe, "synthetic", seed=1).batch(2))  # the weights move on; the checkpoint must not
        real = np.savez
        calls = []

        def savez(f, **arrays):  # type: ignore[no-untyped-def]
            calls.append(1)
            if len(calls) == 2:  # the second stage's file: the first is already written
                f.write(b"PK\x03\x04partial")
                raise error
            return real(f, **arrays)

        monkeypatch.setattr(checkpoint_module.np, "savez", savez)
        with pytest.raises(OnnxpipeError if isinstance(error, OSError) else KeyboardInterrupt) as info:
            pipe.save(ck)
        monkeypatch.setattr(checkpoint_module.np, "savez", real)
    if isinstance(error, OSError):
        assert "No space left on device" in str(info.value) and "--checkpoint-dir" in str(info.value)
    assert snapshot(ck) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "temporary directories left behind"
    step, states, _ = checkpoint_module.load_checkpoint(ck)
    restored = {k: v for params, _ in states for k, v in params.items()}
    assert step == 2 and set(restored) == set(weights)
    for name, value in weights.items():
        np.testing.assert_array_equal(restored[name], value)


def test_checkpoint_refuses_a_directory_with_other_files(stage_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("mine")
    with _trained(stage_dir, 0) as pipe, pytest.raises(OnnxpipeError, match="holds files other than a checkpoint"):
        pipe.save(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]


def test_corrupted_checkpoint_is_refused_on_resume(stage_dir: Path, tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    with _trained(stage_dir, 2, ck):
        pass
    npz = ck / "stage_2.npz"
    data = bytearray(npz.read_bytes())
    data[len(data) // 2] ^= 0xFF
    npz.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, "-m", "onnxpipe", "train", str(stage_dir), "--microbatches", "2", "--steps", "3",
                             "--checkpoint-dir", str(ck), "--checkpoint-every", "1", "--resume"],
                            capture_output=True, text=True, timeout=120, env={**os.environ, "COLUMNS": "80"})
    assert result.returncode == 2, result.stderr
    err = result.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in result.stderr
    assert "stage_2.npz: checkpoint file is missing or corrupted (sha256 mismatch)" in err
    assert npz.read_bytes() == bytes(data), "the corrupted checkpoint was overwritten"
