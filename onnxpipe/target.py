"""Cluster descriptions: devices, links, and the time model (roofline per node, latency + bytes/bandwidth per transfer)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from onnxpipe.cost import NodeCost

__all__ = ["Device", "Link", "Target"]


@dataclass(frozen=True)
class Device:
    """One accelerator (or CPU worker process) of a target."""

    #: Unique instance name, e.g. "fpga0".
    name: str
    #: The `[[devices]]` entry it was expanded from, e.g. "u280".
    group: str
    #: "gpu", "fpga" or "cpu".
    kind: str
    #: Peak FLOP/s per numpy dtype name ("float32", "float16", "bfloat16", "int8").
    peak_flops: Mapping[str, float]
    memory_bytes: float
    #: Bytes per second to device memory.
    memory_bandwidth: float
    #: Fraction of peak reached per op class; the key "default" covers classes not listed.
    efficiency: Mapping[str, float]
    #: Fixed seconds per node (kernel launch, dispatch).
    op_overhead: float
    #: Threads a cpu worker process runs with; 0 for accelerators.
    threads: int = 0


@dataclass(frozen=True)
class Link:
    """A class of connection between two device groups."""

    #: The two device group names it joins (equal for links inside one group).
    between: tuple[str, str]
    #: Bytes per second in each direction.
    bandwidth: float
    #: Seconds per message.
    latency: float
    #: "switch", "ring", "nvlink", "pcie", "ethernet" or "shm".
    topology: str


@dataclass(frozen=True)
class Target:
    """A cluster: its devices in order and the links between them."""

    name: str
    description: str
    devices: tuple[Device, ...]
    links: tuple[Link, ...]
    #: True for targets whose node times come from profiling the model on this machine.
    profile: bool
    #: The file it was read from.
    source: str

    def device(self, name: str) -> Device:
        """The device of a given instance name."""
        for d in self.devices:
            if d.name == name:
                return d
        raise KeyError(name)

    def link(self, a: str, b: str) -> Link:
        """The link joining two devices (by instance name)."""
        ga, gb = self.device(a).group, self.device(b).group
        for link in self.links:
            if {ga, gb} == set(link.between) or (ga == gb and link.between == (ga, gb)):
                return link
        raise KeyError(f"no link between {ga} and {gb}")

    def transfer_seconds(self, a: str, b: str, nbytes: float) -> float:
        """Time to move nbytes from device a to device b; zero on the same device."""
        if a == b or nbytes <= 0:
            return 0.0
        link = self.link(a, b)
        return link.latency + nbytes / link.bandwidth

    def allreduce_seconds(self, devices: tuple[str, ...], nbytes: float) -> float:
        """Ring all-reduce of nbytes over the given devices, on their slowest link."""
        n = len(devices)
        if n < 2 or nbytes <= 0:
            return 0.0
        links = [self.link(devices[i], devices[(i + 1) % n]) for i in range(n)]
        bandwidth = min(link.bandwidth for link in links)
        latency = max(link.latency for link in links)
        return 2 * (n - 1) * (latency + nbytes / n / bandwidth)

    def node_seconds(self, device: str, cost: NodeCost, dtype: str = "float32", backward: bool = False) -> float:
        """Roofline time of one node on a device; measured times win where present on cpu devices."""
        d = self.device(device)
        measured = cost.measured_backward_seconds if backward else cost.measured_seconds
        if measured is not None and d.kind == "cpu":
            return measured
        flops = cost.backward_flops if backward else cost.flops
        nbytes = cost.backward_bytes if backward else cost.bytes_read + cost.bytes_written
        peak = d.peak_flops.get(dtype) or d.peak_flops["float32"]
        efficiency = d.efficiency.get(cost.op_class, d.efficiency.get("default", 1.0))
        return max(flops / (peak * efficiency), nbytes / d.memory_bandwidth) + d.op_overhead
