"""Without Ray and without a GPU: which provider and device a stage's sessions get, the one-line error
where CUDA is missing, and the placement-group bundles the Ray backend asks for."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from onnxpipe.errors import OnnxpipeError
from onnxpipe.ortutil import cuda_works
from onnxpipe.target import load_target
from onnxpipe.train.providers import CPU, CUDA_PROVIDER, ExecutionDevice, cuda_device_id, ensure_usable, execution_devices, session_provider, stage_device
from onnxpipe.train.ray_placement import ensure_fits, local_resources, place

ROOT = Path(__file__).resolve().parent.parent


def _devices(target: str) -> dict:
    return {d.name: d for d in load_target(target).devices}


def test_gpu_stages_run_on_cuda_with_their_instance_and_every_other_on_the_cpu() -> None:
    hetero = _devices("hetero")
    kinds = {d.kind: name for name, d in sorted(hetero.items(), reverse=True)}
    gpu = kinds["gpu"]
    got = execution_devices([gpu, kinds["fpga"], "not-a-device"], hetero)
    assert got == (ExecutionDevice("cuda", int(gpu.rsplit("_", 1)[1])), CPU, CPU)
    assert execution_devices([gpu], hetero, "cpu") == (CPU,)
    assert session_provider(got[0]) == (CUDA_PROVIDER, {"device_id": got[0].device_id})
    assert session_provider(CPU) == ("CPUExecutionProvider", {})
    assert stage_device("gpu", 3) == ExecutionDevice("cuda", 3)
    with pytest.raises(OnnxpipeError, match="--device 'tpu' is not one of auto, cpu"):
        stage_device("gpu", 0, "tpu")


def test_cuda_ordinal_is_the_assigned_gpu_as_the_actor_sees_it() -> None:
    assert cuda_device_id([3], "3") == 0  # Ray set CUDA_VISIBLE_DEVICES to the actor's GPU
    assert cuda_device_id(["2"], "1,2") == 1
    assert cuda_device_id([2], None) == 2  # visible devices left alone: the id itself
    with pytest.raises(OnnxpipeError, match="given no GPU"):
        cuda_device_id([], "0")


def test_missing_cuda_provider_is_one_line_naming_the_fix() -> None:
    asked: list[int] = []

    def works(device_id: int) -> bool:
        asked.append(device_id)
        return device_id == 1

    ensure_usable(CPU, works)
    ensure_usable(ExecutionDevice("cuda", 1), works)
    with pytest.raises(OnnxpipeError) as error:
        ensure_usable(ExecutionDevice("cuda", 2), works, "host 10.0.0.7")
    assert asked == [1, 2]  # the CPU needs no probe
    message = str(error.value)
    assert "\n" not in message and "no usable CUDA provider for device 2" in message and "on host 10.0.0.7" in message
    assert "--device cpu" in message


def test_train_on_a_gpu_target_without_cuda_fails_at_once_and_device_cpu_runs(tmp_path: Path) -> None:
    if cuda_works(0):
        pytest.skip("a GPU is usable here: gpu stages run on it")
    model = tmp_path / "mlp.onnx"
    cli = [sys.executable, "-m", "onnxpipe"]
    subprocess.run([*cli, "models", "build", "mlp", "--train", "-o", str(model)], check=True, capture_output=True)
    args = [*cli, "train", str(model), "--target", "gpu4", "--stages", "2", "--steps", "1", "--microbatches", "2"]
    failed = subprocess.run(args, capture_output=True, text=True)
    assert failed.returncode == 2, failed.stderr
    lines = failed.stderr.strip().splitlines()
    assert len(lines) == 1 and "no usable CUDA provider" in lines[0] and "--device cpu" in lines[0], failed.stderr
    ran = subprocess.run([*args, "--device", "cpu"], capture_output=True, text=True)
    assert ran.returncode == 0, ran.stderr
    assert "losses:" in ran.stdout


def test_every_device_gets_a_bundle_with_its_group_resource_gpu_and_host(tmp_path: Path) -> None:
    hetero = _devices("hetero")
    gpus = sorted(n for n, d in hetero.items() if d.kind == "gpu")[:2]
    fpga = sorted(n for n, d in hetero.items() if d.kind == "fpga")[0]
    p = place([gpus[0], gpus[1], gpus[1], fpga], hetero)
    g = hetero[gpus[0]].group
    assert [b.device for b in p.bundles] == [gpus[0], gpus[1], fpga]
    assert p.bundles[0].resources == {"CPU": 1.0, g: 1.0, "GPU": 1.0}
    assert p.bundles[2].resources == {"CPU": 1.0, hetero[fpga].group: 1.0}
    assert p.worker_bundle == (0, 1, 1, 2)
    assert p.actor_resources(1) == {"CPU": 0.5, g: 0.5, "GPU": 0.5}  # two stages share one GPU's bundle
    assert p.needs() == {"CPU": 3.0, g: 2.0, "GPU": 2.0, hetero[fpga].group: 1.0}
    assert "GPU" not in place([gpus[0]], hetero, "cpu").needs()

    text = (ROOT / "targets" / "cpu2.toml").read_text().replace("threads = 1", 'threads = 1\nhost = "127.0.0.5"', 1)
    (tmp_path / "t.toml").write_text(text)
    cpus = {d.name: d for d in load_target(str(tmp_path / "t.toml")).devices}
    assert place(["cpu_0"], cpus).bundles[0].resources == {"CPU": 1.0, "cpu": 1.0, "node:127.0.0.5": 0.001}
    assert local_resources(place(["cpu_0", "cpu_1"], cpus), cpus=1) == (2, {"cpu": 2.0})


@pytest.mark.parametrize(("cluster", "says"), [
    ({"CPU": 8.0}, "device group 'cpu'.*ray start .*--resources '\\{\"cpu\": 2\\}'"),
    ({"CPU": 1.0, "cpu": 2.0}, "need 2 CPUs"),
])
def test_a_cluster_short_of_a_resource_is_one_line_naming_the_ray_start_fix(cluster: dict, says: str) -> None:
    cpus = _devices("cpu2")
    ensure_fits(place(["cpu_0", "cpu_1"], cpus), {"CPU": 2.0, "cpu": 2.0}, "at x:1")
    with pytest.raises(OnnxpipeError, match=says):
        ensure_fits(place(["cpu_0", "cpu_1"], cpus), cluster, "at x:1")
    with pytest.raises(OnnxpipeError, match="need 1 GPUs .* --device cpu"):
        ensure_fits(place(["v100_0"], _devices("gpu4")), {"CPU": 4.0, "v100": 4.0}, "at x:1")
