"""`--bind-cores`: worker processes on CPUs of their own, one thread of each physical core first, and the
training they do unchanged by it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest

from onnxpipe import models
from onnxpipe.errors import OnnxpipeError
from onnxpipe.train.affinity import spread, topology, worker_cpus

CLI = [sys.executable, "-m", "onnxpipe"]
#: Two packages of two cores of two hardware threads: CPUs n and n + 4 are siblings (Linux numbers them so).
SMT = {cpu: (cpu % 4 // 2, cpu % 2) for cpu in range(8)}

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux's")
#: CPUs this process may use (0 where the platform does not say).
CPUS = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 0


def test_one_thread_of_every_core_comes_before_any_sibling() -> None:
    order = spread(range(8), SMT)
    assert sorted(order[:4], key=lambda c: SMT[c]) == [0, 1, 2, 3] and sorted(order[4:]) == [4, 5, 6, 7]
    assert len({SMT[c] for c in order[:4]}) == 4


def test_workers_get_disjoint_cpus_on_distinct_cores_and_the_first_is_left_to_the_driver() -> None:
    cpus = worker_cpus([1, 1, 1], allowed=range(8), where=SMT)
    assert len(cpus) == 3 and all(len(c) == 1 for c in cpus)
    taken = [c for cs in cpus for c in cs]
    assert len(set(taken)) == 3 and len({SMT[c] for c in taken}) == 3  # no two on sibling threads
    assert spread(range(8), SMT)[0] not in taken
    # A worker of two threads takes two CPUs; with none to spare, every CPU goes to a worker.
    assert sorted(c for cs in worker_cpus([2, 1, 1], allowed=range(4), where=SMT) for c in cs) == [0, 1, 2, 3]


def test_too_few_cpus_is_one_line_naming_the_way_out() -> None:
    with pytest.raises(OnnxpipeError, match=r"^--bind-cores needs 5 CPUs for 3 worker processes and this process may use 4; run without --bind-cores"):
        worker_cpus([1, 2, 2], allowed=range(4), where=SMT)


def test_topology_reads_the_kernel_and_a_cpu_it_does_not_describe_is_a_core_of_its_own(tmp_path: Path) -> None:
    for cpu, (package, core) in ((0, (0, 0)), (1, (0, 0)), (2, (1, 3))):
        (tmp_path / f"cpu{cpu}" / "topology").mkdir(parents=True)
        (tmp_path / f"cpu{cpu}" / "topology" / "physical_package_id").write_text(f"{package}\n")
        (tmp_path / f"cpu{cpu}" / "topology" / "core_id").write_text(f"{core}\n")
    where = topology([0, 1, 2, 3], root=tmp_path)
    assert where == {0: (0, 0), 1: (0, 0), 2: (1, 3), 3: (-1, 3)}
    assert spread([0, 1, 2, 3], where)[-1] == 1  # the sibling of 0 goes last


@pytest.mark.skipif(CPUS < 2, reason="needs 2 CPUs and Linux's CPU affinity")
def test_bound_worker_processes_run_on_their_cpus_and_train_as_unbound_ones(tmp_path: Path) -> None:
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.pipeline import Pipeline

    onnx.save(models.build("mlp", train=True), tmp_path / "mlp.onnx")
    rng = np.random.default_rng(0)
    batch = {"x": rng.standard_normal((16, 16)).astype(np.float32), "labels": rng.integers(0, 10, 16)}
    losses = {}
    for bind in (False, True):
        with Pipeline(tmp_path / "mlp.onnx", "cpu2", stages=2, microbatches=2, optimizer=OptimizerConfig("sgd", lr=0.1), bind_cores=bind) as pipe:
            losses[bind] = [pipe.train_step(batch) for _ in range(3)]
            cpus = pipe.cpus
            seen = [tuple(sorted(os.sched_getaffinity(pid))) for pid in pipe.engine.pids]  # type: ignore[union-attr]
            replicas = [r["cpus"] for s in pipe.metrics()["stages"] for r in s["replicas"]]
        if bind:
            assert seen == list(cpus) and len(set(cpus)) == 2 and all(len(c) == 1 for c in cpus)
            assert replicas == [list(c) for c in cpus]
        else:
            assert cpus == ((), ()) and replicas == [[], []]
            assert all(set(s) == os.sched_getaffinity(0) for s in seen)
    assert losses[True] == losses[False]


@needs_affinity
def test_bind_cores_on_too_few_cpus_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    onnx.save(models.build("mlp", train=True), tmp_path / "mlp.onnx")
    one = min(os.sched_getaffinity(0))
    out = tmp_path / "run.json"
    run = subprocess.run([*CLI, "train", str(tmp_path / "mlp.onnx"), "--target", "cpu2", "--stages", "2", "--steps", "1", "--bind-cores",
                          "--json", str(out)],
                         capture_output=True, text=True, timeout=300, preexec_fn=lambda: os.sched_setaffinity(0, {one}))
    assert run.returncode == 2
    lines = [line for line in (run.stdout + run.stderr).splitlines() if line.strip()]
    assert lines[-1] == ("error: --bind-cores needs 2 CPUs for 2 worker processes and this process may use 1; "
                         "run without --bind-cores, or on fewer stages or threads per device")
    assert "Traceback" not in run.stdout + run.stderr and not out.exists()


def test_bind_cores_with_ray_is_refused(tmp_path: Path) -> None:
    onnx.save(models.build("mlp", train=True), tmp_path / "mlp.onnx")
    run = subprocess.run([*CLI, "train", str(tmp_path / "mlp.onnx"), "--target", "cpu2", "--stages", "2", "--steps", "1", "--bind-cores",
                          "--backend", "ray"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 2 and "Traceback" not in run.stdout + run.stderr
    assert run.stderr.strip().splitlines()[-1] == ("error: --bind-cores binds the worker processes of --backend local; Ray places its actors "
                                                  "itself, and an in-process pipeline has none: drop --bind-cores")


def test_train_json_names_the_cpus_of_each_worker(tmp_path: Path) -> None:
    onnx.save(models.build("mlp", train=True), tmp_path / "mlp.onnx")
    out = tmp_path / "run.json"
    run = subprocess.run([*CLI, "train", str(tmp_path / "mlp.onnx"), "--target", "cpu2", "--stages", "2", "--steps", "2", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:]
    assert [r["cpus"] for s in json.loads(out.read_text())["stages"] for r in s["replicas"]] == [[], []]
