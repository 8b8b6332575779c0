"""Where a stage's onnxruntime sessions run: on the CPU, or on a GPU through onnxruntime's CUDA
execution provider. A stage on a device of kind "gpu" runs on CUDA (the device id comes from the
placement: the GPU Ray gave its actor, or the device's instance number on this host); every other
stage, and every stage under `--device cpu`, runs on the CPU.

Reading order: `ExecutionDevice` -> `stage_device` -> `execution_devices` -> `session_provider` -> `ensure_usable` -> `cuda_device_id`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from onnxpipe.errors import OnnxpipeError
from onnxpipe.ortutil import cuda_works
from onnxpipe.target import Device

__all__ = ["ExecutionDevice", "CPU", "CUDA_PROVIDER", "stage_device", "execution_devices", "session_provider", "ensure_usable",
           "cuda_device_id", "DEVICE_CHOICES"]

CUDA_PROVIDER = "CUDAExecutionProvider"
_CPU_PROVIDER = "CPUExecutionProvider"
#: What `--device` accepts: "auto" follows the target's device kinds, "cpu" runs every stage on the CPU.
DEVICE_CHOICES = ("auto", "cpu")


@dataclass(frozen=True)
class ExecutionDevice:
    """The device a stage's sessions run on."""

    #: "cpu" or "cuda".
    kind: str = "cpu"
    #: CUDA device ordinal as the stage's process sees it (0 for the CPU).
    device_id: int = 0


CPU = ExecutionDevice()


def stage_device(device_kind: str, instance: int, device: str = "auto") -> ExecutionDevice:
    """The execution device of a stage placed on a target device of `device_kind` ("gpu", "fpga",
    "cpu"), the `instance`-th of its group; `device="cpu"` keeps every stage on the CPU."""
    if device not in DEVICE_CHOICES:
        raise OnnxpipeError(f"--device {device!r} is not one of {', '.join(DEVICE_CHOICES)}")
    if device == "cpu" or device_kind != "gpu":
        return CPU
    return ExecutionDevice("cuda", instance)


def execution_devices(worker_devices: Sequence[str], devices: Mapping[str, Device], device: str = "auto") -> tuple[ExecutionDevice, ...]:
    """Per worker, the execution device of the target device it runs on (`worker_devices`: instance names,
    in worker order; the CPU for a name the target lacks, or "")."""
    out = []
    for name in worker_devices:
        d = devices.get(name)
        out.append(stage_device(d.kind, _instance(d.name), device) if d is not None else stage_device("cpu", 0, device))
    return tuple(out)


def _instance(name: str) -> int:
    """The instance number of a device in its group ("v100_3" -> 3)."""
    suffix = name.rsplit("_", 1)[-1]
    return int(suffix) if suffix.isdigit() else 0


def session_provider(device: ExecutionDevice) -> tuple[str, dict[str, Any]]:
    """(provider, its options) of a session on `device` (`ortutil.session`: the CPU takes the nodes CUDA lacks)."""
    if device.kind == "cuda":
        return CUDA_PROVIDER, {"device_id": device.device_id}
    return _CPU_PROVIDER, {}


def ensure_usable(device: ExecutionDevice, works: Callable[[int], bool] = cuda_works, where: str = "") -> None:
    """One line naming the fix when `device` is a CUDA device onnxruntime cannot run a session on here
    (`works`: device id -> whether it can, `ortutil.cuda_works`)."""
    if device.kind == "cuda" and not works(device.device_id):
        on = f" on {where}" if where else ""
        raise OnnxpipeError(f"a stage runs on a gpu device but onnxruntime{on} has no usable CUDA provider for device "
                            f"{device.device_id} (it needs a GPU, CUDA 11.8 and cuDNN 8 for onnxruntime-training 1.19); install them "
                            f"there, or pass --device cpu to run every stage on the CPU")


def cuda_device_id(gpu_ids: Sequence[Any], visible_devices: str | None) -> int:
    """The CUDA ordinal of the first GPU Ray assigned (`ray.get_gpu_ids()`) as this process sees it: its
    position in CUDA_VISIBLE_DEVICES when that is set (Ray sets it to the assigned GPUs), else its id."""
    if not gpu_ids:
        raise OnnxpipeError("a gpu stage's Ray actor was given no GPU; start the Ray node with --num-gpus, or pass --device cpu")
    first = str(gpu_ids[0])
    if visible_devices:
        visible = [v.strip() for v in visible_devices.split(",")]
        if first in visible:
            return visible.index(first)
    return int(first)
