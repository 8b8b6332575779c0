"""Fault injection: a full disk or an interruption while writing stages or checkpoints leaves the
previous state exactly as it was and no temporary files; a corrupted checkpoint is refused on
`--resume` from the command line. Process faults: a worker that dies at start-up, mid-run or stops,
a driver terminated or killed, and two runs on one checkpoint directory end in one line each, leave
nothing behind, and the next run sweeps what a killed one could not.

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
import re
import signal
import stat
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph
from onnxpipe.plan import Plan, plan_model
from procs import PARENT, live_processes

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
    errors = [line for line in result.output.strip().splitlines() if line.startswith("error:")]  # stdout's batch line beside it
    assert len(errors) == 1 and "No space left on device" in errors[0] and "Traceback" not in result.output
    assert result.output.strip().endswith(errors[0])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["plan.json"]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_an_interruption_between_the_renames_of_a_swap_waits_for_its_end(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                         sig: signal.Signals) -> None:
    from onnxpipe.cli import Terminated, _terminate_as_interrupt
    from onnxpipe.fileio import swap_in

    target, new = tmp_path / "out", tmp_path / ".out.tmp"
    for directory, text in ((target, "old"), (new, "new")):
        directory.mkdir()
        (directory / "stage_0.onnx").write_text(text)
    real, renames = os.replace, []

    def replace(src, dst):  # type: ignore[no-untyped-def]
        real(src, dst)
        renames.append(Path(dst).name)
        if len(renames) == 1:  # the old directory just moved aside: the signal comes now
            signal.raise_signal(sig)

    monkeypatch.setattr(os, "replace", replace)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from a terminal, not as a background job
    try:
        with _terminate_as_interrupt(), pytest.raises(KeyboardInterrupt) as info:
            swap_in(new, target)
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert (info.type is Terminated) == (sig == signal.SIGTERM)
    assert renames == [f".out.old{os.getpid()}", "out"]
    assert (target / "stage_0.onnx").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"], "the swap was cut short"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_an_interruption_while_the_temp_directory_is_made_leaves_none(planned: tuple[Path, Graph, Plan], tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch, sig: signal.Signals) -> None:
    """The signal lands right after mkdtemp made the directory, before split knows its path (checkpoints make theirs
    with the same `fileio.fresh_dir_beside`)."""
    from onnxpipe.cli import Terminated, _terminate_as_interrupt

    _, graph, plan = planned
    real = tempfile.mkdtemp

    def mkdtemp(*args, **kwargs):  # type: ignore[no-untyped-def]
        made = real(*args, **kwargs)
        signal.raise_signal(sig)
        return made

    monkeypatch.setattr(tempfile, "mkdtemp", mkdtemp)
    interrupt = signal.signal(signal.SIGINT, signal.default_int_handler)  # as started from a terminal, not as a background job
    try:
        with _terminate_as_interrupt(), pytest.raises(KeyboardInterrupt) as info:
            split_module.split(graph, plan, tmp_path / "out")
    finally:
        signal.signal(signal.SIGINT, interrupt)
    assert (info.type is Terminated) == (sig == signal.SIGTERM)
    assert list(tmp_path.iterdir()) == []


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


def test_resume_recovers_an_interrupted_directory_swap(stage_dir: Path, tmp_path: Path) -> None:
    from onnxpipe.train.fit import data_source, fit

    ck = tmp_path / "ck"
    with _trained(stage_dir, 3) as whole:
        full = list(whole.losses)
    with _trained(stage_dir, 2, ck):
        pass
    os.replace(ck, tmp_path / ".ck.old4194999")  # killed between the swap's two renames: the checkpoint sits beside
    (tmp_path / ".ck.x1y2.tmp").mkdir()  # and a write that never finished
    (tmp_path / ".ck.x1y2.tmp" / "stage_0.npz").write_bytes(b"PK\x03\x04partial")
    with _trained(stage_dir, 0) as pipe:
        losses = fit(pipe, data_source(pipe, "synthetic", seed=1), 3, checkpoint_dir=str(ck), every=1, resume=True)
    assert losses == full, "resume did not continue from the checkpoint beside the directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"], "leftovers of the swap were not removed"


def test_an_interrupted_run_sweeps_what_its_own_writes_left_on_release(tmp_path: Path) -> None:
    ck = tmp_path / "ck"
    with pytest.raises(KeyboardInterrupt), checkpoint_module.hold_checkpoint_dir(ck):
        (tmp_path / ".ck.x1y2.tmp").mkdir()  # a write's temp directory its clean-up could not remove
        raise KeyboardInterrupt
    assert sorted(p.name for p in tmp_path.iterdir()) == [], "the write's temp directory or the lock was left"


# --- dying processes and signals ------------------------------------------------------------

CLI = [sys.executable, "-m", "onnxpipe"]


def _workers(pid: int) -> list[int]:
    """The worker processes among `pid`'s children (not multiprocessing's resource tracker)."""
    found = []
    for child in live_processes(PARENT, pid):
        try:
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return found


def _alive(pids: list[int]) -> list[int]:
    return [p for p in pids if Path(f"/proc/{p}").exists() and "zombie" not in Path(f"/proc/{p}/status").read_text().lower()]


def _segments(pid: int) -> list[Path]:
    return list(Path("/dev/shm").glob(f"onnxpipe_{pid}_*"))


def _until(condition: Callable[[], object], what: str, seconds: float = 120.0) -> None:
    """Wait for an event of another process (a start-up on a loaded machine takes what it takes)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """gpt2-tiny and its 2 stages: a stage spec of some 600 KB, more than a pipe holds."""
    root = tmp_path_factory.mktemp("gpt2")
    onnx.save(models.build("gpt2-tiny", train=True), str(root / "gpt2.onnx"))
    graph, _, _, plan = plan_model(root / "gpt2.onnx", "cpu2", stages=2, time_limit=5)
    split_module.split(graph, plan, root / "stages")
    return root / "gpt2.onnx", root / "stages"


def test_worker_dying_at_start_up_fails_the_start(gpt2: tuple[Path, Path]) -> None:
    from onnxpipe.train.pipeline import Pipeline

    outcome: list[BaseException] = []

    def start() -> None:
        try:
            Pipeline(gpt2[1], microbatches=2).close()
        except BaseException as exc:  # noqa: BLE001 - the outcome is asserted below
            outcome.append(exc)

    driver = threading.Thread(target=start, daemon=True)
    driver.start()
    _until(lambda: _workers(os.getpid()), "a worker started", 120)
    victim = _workers(os.getpid())[0]
    os.kill(victim, signal.SIGKILL)  # in its first second: still reading its setup
    driver.join(120)
    assert not driver.is_alive(), "the driver hung on a worker that died at start-up"
    assert outcome and isinstance(outcome[0], OnnxpipeError), outcome
    assert re.fullmatch(r"stage \d \(stage_\d\.onnx\) failed \(setup\): worker exited with code -9", str(outcome[0]))
    _until(lambda: not _workers(os.getpid()), "every worker stopped", 10)
    assert not _segments(os.getpid())


def test_stopped_worker_fails_the_run_naming_it(gpt2: tuple[Path, Path]) -> None:
    from onnxpipe.train.fit import data_source
    from onnxpipe.train.pipeline import Pipeline

    with Pipeline(gpt2[1], microbatches=2) as pipe:
        batch = data_source(pipe, "synthetic").batch(0)
        pipe.train_step(batch)
        pids = pipe.engine.pids  # type: ignore[union-attr]
        os.kill(pids[1], signal.SIGSTOP)
        with pytest.raises(OnnxpipeError, match=rf"stage 1 \(stage_1\.onnx\) failed .*worker process {pids[1]} is stopped"):
            for _ in range(10000):
                pipe.train_step(batch)
    assert not _alive(pids) and not _segments(os.getpid())


def _start_training(model: Path, tmp_path: Path, *extra: str) -> subprocess.Popen[str]:
    (tmp_path / "tmp").mkdir(exist_ok=True)
    return subprocess.Popen([*CLI, "train", str(model), "--stages", "2", "--batch", "16", "--microbatches", "2", "--steps", "100000", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path,
                            env={**os.environ, "TMPDIR": str(tmp_path / "tmp")})


def _temp_dirs(tmp_path: Path, pid: int) -> list[Path]:
    return list((tmp_path / "tmp").glob(f"onnxpipe-train-{pid}-*"))


def test_second_run_on_a_checkpoint_directory_is_refused_and_sigterm_cleans_up(gpt2: tuple[Path, Path], tmp_path: Path) -> None:
    first = _start_training(gpt2[0], tmp_path, "--checkpoint-dir", "ck", "--checkpoint-every", "1")
    _until(lambda: (tmp_path / "ck" / "checkpoint.json").is_file() or first.poll() is not None, "a first checkpoint")
    assert first.poll() is None, first.communicate()[1]
    workers = _workers(first.pid)
    second = subprocess.run([*CLI, "train", str(gpt2[1]), "--microbatches", "2", "--steps", "3", "--checkpoint-dir", "ck", "--checkpoint-every", "1"],
                            capture_output=True, text=True, cwd=tmp_path, timeout=300)
    assert second.returncode == 2 and len(second.stderr.strip().splitlines()) == 1, second.stderr
    assert f"ck: another run (pid {first.pid}) is using this checkpoint directory" in second.stderr
    first.send_signal(signal.SIGTERM)
    _, err = first.communicate(timeout=60)
    assert first.returncode == 143 and "terminated" in err and "Traceback" not in err, err
    _until(lambda: not _alive(workers), "the workers of a terminated driver stopped", 10)
    assert not _segments(first.pid) and not _temp_dirs(tmp_path, first.pid)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "tmp"]


def test_wake_up_fifos_of_dead_writers_are_swept_and_a_live_ones_kept() -> None:
    """The Ray transport's wake-up FIFOs carry their writer's PID: a writer killed before its reader opened one
    (a start cut short) leaves it, and the next run removes it once that process is gone."""
    from onnxpipe.train.leftovers import sweep_dead_runs, wake_path

    made = subprocess.run([sys.executable, "-c", "import os; from onnxpipe.train.leftovers import wake_path; "
                                                 "p = wake_path(); os.mkfifo(p); print(p)"],
                          capture_output=True, text=True, timeout=120, check=True)
    dead, mine = Path(made.stdout.strip()), wake_path()
    os.mkfifo(mine)
    try:
        assert stat.S_ISFIFO(dead.stat().st_mode)
        swept = sweep_dead_runs()
        assert dead in swept and not dead.exists()
        assert mine.exists() and mine not in swept
    finally:
        mine.unlink(missing_ok=True)
        dead.unlink(missing_ok=True)


def test_leftovers_of_a_killed_driver_are_swept_by_the_next_run(gpt2: tuple[Path, Path], tmp_path: Path) -> None:
    killed = _start_training(gpt2[0], tmp_path)
    _until(lambda: _segments(killed.pid) or killed.poll() is not None, "a first step")
    assert killed.poll() is None, killed.communicate()[1]
    workers = _workers(killed.pid)
    killed.kill()
    killed.communicate(timeout=60)
    _until(lambda: not _alive(workers), "the workers of a killed driver died with it", 10)
    assert _segments(killed.pid) and _temp_dirs(tmp_path, killed.pid), "nothing left to sweep: the test proves nothing"
    after = subprocess.run([*CLI, "train", str(gpt2[1]), "--microbatches", "2", "--steps", "1"], capture_output=True, text=True,
                           cwd=tmp_path, env={**os.environ, "TMPDIR": str(tmp_path / "tmp")}, timeout=300)
    assert after.returncode == 0, after.stderr
    assert not _segments(killed.pid) and not _temp_dirs(tmp_path, killed.pid)
