"""`onnxpipe train` as a user drives it: data from an .npz cut into consecutive batches (cycling), and
Ctrl-C stopping every worker cleanly, however early it lands (workers start with SIGINT ignored)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from procs import SESSION, as_in_a_terminal, live_processes, wait_until_loaded

CLI = [sys.executable, "-m", "onnxpipe"]


def test_npz_data_is_cut_into_consecutive_batches_that_cycle(tmp_path: Path) -> None:
    onnx.save(models.build("mlp", train=True), tmp_path / "mlp.onnx")  # batch 8 per micro-batch
    rng = np.random.default_rng(1)
    rows = 32  # two global batches of 16
    np.savez(tmp_path / "data.npz", x=rng.standard_normal((rows, 16)).astype(np.float32), labels=rng.integers(0, 10, rows))
    out = tmp_path / "run.json"
    run = subprocess.run(
        [*CLI, "train", str(tmp_path / "mlp.onnx"), "--target", "cpu2", "--stages", "2", "--batch", "16", "--microbatches", "2",
         "--steps", "4", "--lr", "1e-20", "--data", str(tmp_path / "data.npz"), "--json", str(out)],
        capture_output=True, text=True, timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    losses = json.loads(out.read_text())["losses"]
    # a learning rate of 1e-20 leaves float32 weights as they are, so a step's loss depends on its batch alone: batches 0, 1, 0, 1.
    assert losses[0] == losses[2] and losses[1] == losses[3] and losses[0] != losses[1]


@pytest.mark.parametrize("importing", ["numpy", "onnx"])
@pytest.mark.parametrize("program", [CLI, [str(Path(sys.executable).with_name("onnxpipe"))]], ids=["python -m", "console script"])
def test_ctrl_c_while_the_program_still_imports_exits_quietly(tmp_path: Path, importing: str, program: list[str]) -> None:
    """Ctrl-C before any command runs (onnxpipe's dependencies still importing: the first of them, numpy, or a later one,
    onnx) is exit 130 and one line, not the traceback of an interrupted import. Sent once that dependency's native
    extension is mapped, not after a fixed delay: on a loaded machine a delay can end while the interpreter itself
    still starts (its site module, which runs no code of ours), where no program can catch it."""
    proc = subprocess.Popen([*program, "train", "missing.onnx"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            start_new_session=True, preexec_fn=as_in_a_terminal)
    loaded = wait_until_loaded(proc.pid, importing, 60)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert loaded, f"{importing} was never imported: {err}"
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
    assert proc.returncode == 130 and err.strip() == "interrupted", (proc.returncode, err)


@pytest.mark.parametrize("delay", [0.0, 1.0], ids=["while-workers-import", "while-training"])
def test_ctrl_c_stops_training_and_every_worker(tmp_path: Path, delay: float) -> None:
    onnx.save(models.build("gpt2-tiny", train=True), tmp_path / "gpt2.onnx")
    proc = subprocess.Popen(
        [*CLI, "train", str(tmp_path / "gpt2.onnx"), "--target", "cpu2", "--stages", "2", "--batch", "16", "--microbatches", "2",
         "--steps", "100000"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, preexec_fn=as_in_a_terminal,
    )
    deadline = time.monotonic() + 120
    while len(live_processes(SESSION, proc.pid)) < 3 and time.monotonic() < deadline:  # the driver and its two workers
        time.sleep(0.2)
    assert len(live_processes(SESSION, proc.pid)) >= 3, "workers never started"
    time.sleep(delay)
    os.killpg(proc.pid, signal.SIGINT)  # what a terminal sends on Ctrl-C: the whole foreground group
    stopped = time.monotonic()
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # never leave a driver training on behind a failed test
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise
    assert time.monotonic() - stopped < 10
    assert proc.returncode == 130 and "interrupted" in err and "Traceback" not in err
    # The driver joined its workers before it exited; multiprocessing's resource tracker leaves once it reads the
    # driver's end close, whenever a loaded machine schedules it: wait for that, not a fixed time.
    left = time.monotonic() + 30
    while live_processes(SESSION, proc.pid) and time.monotonic() < left:
        time.sleep(0.1)
    assert live_processes(SESSION, proc.pid) == []
    assert not [p for p in Path("/dev/shm").glob("onnxpipe_*") if str(proc.pid) in p.name]


def test_output_writes_the_trained_model(tmp_path: Path) -> None:
    """`-o FILE.onnx`: the model as the user gave it with its trained weights; the exporter's constants it holds
    (the GroupNorm export's ones and zeros) stay as they were, and the file runs in onnxruntime."""
    from onnx import numpy_helper

    from onnxpipe.ortutil import cpu_session

    source = Path(__file__).parent / "data" / "torch_unet.onnx"
    out = tmp_path / "trained.onnx"
    run = subprocess.run([*CLI, "train", str(source), "--dim", "batch=4", "--stages", "2", "--steps", "2", "-o", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert f"wrote {out}" in " ".join(run.stdout.split())
    before = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(source)).graph.initializer}
    after = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    assert set(after) == set(before)
    moved = {n for n in before if not np.array_equal(before[n], after[n])}
    assert {"down1.0.weight", "transposed.weight", "head.bias", "val_21"} <= moved and not moved & {"val_8", "val_11", "val_32", "val_35", "val_48"}
    feeds = {"x": np.ones((4, 3, 16, 16), np.float32), "target": np.zeros((4, 4, 16, 16), np.float32)}
    assert np.isfinite(cpu_session(str(out)).run(["loss"], feeds)[0])


def test_output_to_a_missing_folder_is_refused_before_training(tmp_path: Path) -> None:
    run = subprocess.run([*CLI, "train", str(Path(__file__).parent / "data" / "torch_unet.onnx"), "--dim", "batch=4", "-o", str(tmp_path / "no" / "m.onnx")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and run.stderr.strip().endswith("its folder does not exist; pass the path of the .onnx file to write")
    assert "training" not in run.stdout


@pytest.mark.parametrize("flag", [["-o", "trained.onnx"], ["--check"]])
def test_a_stage_directory_without_its_model_is_refused_before_training(tmp_path: Path, flag: list[str]) -> None:
    """-o and --check need the model the stages were cut from: missing, the run stops before the first step (it
    stopped after the last, the training lost)."""
    import shutil

    shutil.copy(Path(__file__).parent / "data" / "torch_gru.onnx", tmp_path / "m.onnx")
    split = subprocess.run([*CLI, "split", "m.onnx", "--target", "cpu2", "--stages", "2", "--dim", "batch=4", "-o", "sd"],
                           capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert split.returncode == 0, split.stderr
    (tmp_path / "m.onnx").unlink()
    run = subprocess.run([*CLI, "train", "sd", "--steps", "1", *flag], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip() == f"error: sd: {flag[0]} needs the original model 'm.onnx' beside the stages; pass the model instead of the directory"
    assert "losses" not in run.stdout and not (tmp_path / "trained.onnx").exists()


def test_without_output_nothing_is_written(tmp_path: Path) -> None:
    """--labels OUTPUT=LABELS names a model output: no file of that name (or any) is written where the run is."""
    model = tmp_path / "m.onnx"
    onnx.save(models.build("mlp", train=False), str(model))
    out = onnx.load(str(model)).graph.output[0].name
    before = set(os.listdir(tmp_path))
    run = subprocess.run([*CLI, "train", "m.onnx", "--stages", "2", "--steps", "1", "--loss", "mse", "--labels", f"{out}=y"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert set(os.listdir(tmp_path)) == before and "wrote" not in run.stdout


def test_check_of_a_model_that_draws_random_numbers_is_refused_before_training(tmp_path: Path) -> None:
    from test_train import _dropout_mlp

    onnx.save(_dropout_mlp(True), str(tmp_path / "m.onnx"))
    run = subprocess.run([*CLI, "train", "m.onnx", "--stages", "2", "--steps", "1", "--loss", "mse", "--labels", "y=labels", "--check"],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert run.returncode == 2 and "losses" not in run.stdout
    assert run.stderr.strip() == ("error: --check: the model draws random numbers (drop: Dropout in training mode or a random op), so the "
                                  "pipelined and the unpartitioned runs cannot agree; export it in eval mode to check it, or train without --check")
