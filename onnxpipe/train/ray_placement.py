"""Where the Ray backend puts each worker: one placement-group bundle per target device that runs a
stage, asking for what that device is on a Ray cluster. Every bundle takes one unit of the custom
resource named after its device group (so a node started with `ray start --resources '{"u280": 2}'`
hosts two u280 devices' stages), a GPU when the stage runs on CUDA, the CPUs its worker computes with,
and with a `host` in the target file a sliver of Ray's own `node:<host>` resource (that node only).
Workers sharing a device (several stages on one device) share its bundle in equal parts.

Pure functions over plain data; `ray_backend` turns them into Ray calls.
Reading order: `Bundle` -> `Placement` -> `place` -> `ensure_fits` -> `local_resources`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from onnxpipe.errors import OnnxpipeError
from onnxpipe.target import Device
from onnxpipe.train.providers import ExecutionDevice, execution_devices

__all__ = ["Bundle", "Placement", "place", "ensure_fits", "local_resources"]

#: Share of a node's `node:<address>` resource a bundle asks for (Ray gives every node 1.0 of its own).
_NODE_SHARE = 0.001


@dataclass(frozen=True)
class Bundle:
    """One device's bundle."""

    #: Target device instance ("u280_0").
    device: str
    #: Ray resources it reserves (CPU, GPU, the device group's custom resource, node:<host>).
    resources: Mapping[str, float]
    #: The Ray node address from the target file ("" where Ray chooses).
    host: str = ""


@dataclass(frozen=True)
class Placement:
    """Bundles, and per worker (in worker order) its bundle and execution device."""

    bundles: tuple[Bundle, ...]
    #: Per worker: index into `bundles`.
    worker_bundle: tuple[int, ...]
    #: Per worker: CPU or CUDA (the CUDA ordinal is the actor's to find: Ray picks its GPU).
    devices: tuple[ExecutionDevice, ...]

    def actor_resources(self, worker: int) -> dict[str, float]:
        """What the worker's actor takes from its bundle: the bundle divided among the workers sharing it."""
        b = self.worker_bundle[worker]
        sharers = self.worker_bundle.count(b)
        return {k: v / sharers for k, v in self.bundles[b].resources.items()}

    def needs(self) -> dict[str, float]:
        """Every resource the placement group reserves, summed."""
        total: dict[str, float] = {}
        for bundle in self.bundles:
            for k, v in bundle.resources.items():
                total[k] = total.get(k, 0.0) + v
        return total


def place(worker_devices: Sequence[str], devices: Mapping[str, Device], device: str = "auto") -> Placement:
    """The placement of workers whose target devices are `worker_devices` (one per worker, in worker
    order), `devices` the target's by instance name, `device` the `--device` choice ("cpu": no GPU anywhere)."""
    order: list[str] = []
    keys: list[str] = []
    for w, name in enumerate(worker_devices):
        key = name or f"worker {w}"
        if key not in keys:
            keys.append(key)
            order.append(name)
    bundles = []
    for name in order:
        d = devices.get(name)
        if d is None:  # a device the target lacks (or none named): a worker needing one CPU, anywhere
            bundles.append(Bundle(name, {"CPU": 1.0}))
            continue
        resources = {"CPU": float(max(1, d.threads)), d.group: 1.0}
        if execution_devices([name], devices, device)[0].kind == "cuda":
            resources["GPU"] = 1.0
        if d.host:
            resources[f"node:{d.host}"] = _NODE_SHARE
        bundles.append(Bundle(name, resources, d.host))
    worker_bundle = tuple(keys.index(name or f"worker {w}") for w, name in enumerate(worker_devices))
    return Placement(tuple(bundles), worker_bundle, execution_devices(worker_devices, devices, device))


def ensure_fits(placement: Placement, cluster: Mapping[str, float], where: str) -> None:
    """One line naming the first resource the Ray cluster (`ray.cluster_resources()`) has too little of,
    and how to start a node that has it."""
    for resource, need in placement.needs().items():
        have = cluster.get(resource, 0.0)
        if have + 1e-9 >= need:
            continue
        if resource == "GPU":
            raise OnnxpipeError(f"the stages need {need:g} GPUs and the Ray cluster {where} has {have:g}; start nodes with "
                                f"`ray start --num-gpus N`, or pass --device cpu to run every stage on the CPU")
        if resource == "CPU":
            raise OnnxpipeError(f"the stages need {need:g} CPUs and the Ray cluster {where} has {have:g}; add nodes "
                                f"(`ray start --address ...`) or start them with --num-cpus")
        if resource.startswith("node:"):
            raise OnnxpipeError(f"the target places stages on host {resource[5:]}, and the Ray cluster {where} has no node there; "
                                f"start one there with `ray start --address ... --node-ip-address {resource[5:]}`")
        raise OnnxpipeError(f"the stages need {need:g} of device group {resource!r} and the Ray cluster {where} has {have:g}; "
                            f"start the nodes holding those devices with `ray start ... --resources '{{\"{resource}\": {int(need)}}}'`")


def local_resources(placement: Placement, cpus: int) -> tuple[int, dict[str, float]]:
    """(num_cpus, custom resources) for a Ray instance started on this machine alone: every CPU the
    stages ask for (at least `cpus`, this machine's), and every device group's resource they use."""
    needs = placement.needs()
    num_cpus = max(cpus, int(-(-needs.get("CPU", 0.0) // 1)))
    custom = {k: v for k, v in needs.items() if k not in ("CPU", "GPU") and not k.startswith("node:")}
    return num_cpus, custom
