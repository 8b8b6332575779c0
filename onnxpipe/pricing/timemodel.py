"""The time model: a node's roofline time on a device, a transfer over a link, a ring all-reduce, and the
host effects of cpu workers (co-run slowdown, CPU per message). Pure functions of a `Target`'s description."""

from __future__ import annotations

from onnxpipe.cost import NodeCost
from onnxpipe.target import Device, MessageCpu, Target

__all__ = ["node_seconds", "transfer_seconds", "allreduce_seconds", "corun_seconds", "message_cpu"]


def node_seconds(device: Device, cost: NodeCost, dtype: str = "float32", backward: bool = False) -> float:
    """Roofline time of one node on a device; measured times win where present on cpu devices."""
    measured = cost.measured_backward_seconds if backward else cost.measured_seconds
    if measured is not None and device.kind == "cpu":
        return measured
    flops = cost.backward_flops if backward else cost.flops
    nbytes = cost.backward_bytes if backward else cost.bytes_read + cost.bytes_written
    peak = device.peak_flops.get(dtype) or device.peak_flops["float32"]
    efficiency = device.efficiency.get(cost.op_class, device.efficiency.get("default", 1.0))
    return max(flops / (peak * efficiency), nbytes / device.memory_bandwidth) + device.op_overhead


def transfer_seconds(target: Target, a: str, b: str, nbytes: float) -> float:
    """Time to move nbytes from device a to device b; zero on the same device."""
    if a == b or nbytes <= 0:
        return 0.0
    link = target.link(a, b)
    return link.latency + nbytes / link.bandwidth


def allreduce_seconds(target: Target, devices: tuple[str, ...], nbytes: float) -> float:
    """Ring all-reduce of nbytes over the given devices, on their slowest link."""
    n = len(devices)
    if n < 2 or nbytes <= 0:
        return 0.0
    links = [target.link(devices[i], devices[(i + 1) % n]) for i in range(n)]
    bandwidth = min(link.bandwidth for link in links)
    latency = max(link.latency for link in links)
    return 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def corun_seconds(target: Target, device: str, weight_bytes: float) -> float:
    """Extra seconds a node reading and writing `weight_bytes` of weights (and their gradients) takes on a cpu
    `device` while other workers compute beside it with more than the host's `shared_cache` bytes between them."""
    host = target.host
    if host is None or not host.corun_bandwidth or target.device(device).kind != "cpu":
        return 0.0
    return weight_bytes / host.corun_bandwidth


def message_cpu(target: Target, a: str, b: str) -> MessageCpu | None:
    """The workers' CPU per message from device a to device b; None where it is not priced (same device, no
    host model, or a link without it: the copy then runs at the link's bandwidth)."""
    if a == b or target.host is None:
        return None
    return target.host.message_cpu(target.link(a, b))
