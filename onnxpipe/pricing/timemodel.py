"""The time model: a node's roofline time on a device, a transfer over a link, a ring all-reduce, and the
host effects of cpu workers (co-run slowdown, CPU per message). Pure functions of a `Target`'s description."""

from __future__ import annotations

import math

from onnxpipe.cost import NodeCost
from onnxpipe.target import Device, KernelModel, MessageCpu, Target

__all__ = ["node_seconds", "rate_dtype", "shape_factor", "transfer_seconds", "allreduce_seconds", "ring_seconds", "rings", "corun_seconds", "message_cpu"]


def node_seconds(device: Device, cost: NodeCost, dtype: str = "float32", backward: bool = False) -> float:
    """Seconds of one node's forward (or backward) pass on `device`: measured where it was measured on that kind
    of device, else a roofline whose compute side follows the kernel's shape and whose memory side the bandwidth
    kernels reach, plus a launch overhead per kernel:

        max(flops / (peak x efficiency[op class] x shape_factor), bytes / (bandwidth x memory_efficiency))
        + op_overhead x kernels    (1 forward, the node's backward_kernels backward)

    A 3x3 stride-1 convolution takes the faster of that and a Winograd-class algorithm (as cuDNN's autotuner
    does): winograd_speedup times less arithmetic, plus its transforms' winograd_traffic x bytes through memory.
    The peak is the device's rate for the node's own dtype where it has one (an int8 kernel of a quantized
    model: `NodeCost.dtype`), else for `dtype` (the model's float type), else its float32 rate (`rate_dtype`).
    With `KernelModel()`'s neutral values (cpu and fpga devices by default) this is the plain roofline."""
    measured = cost.measured_backward_seconds if backward else cost.measured_seconds
    if measured is not None and device.kind == (cost.measured_on or "cpu"):
        return measured
    model = device.kernels
    flops = cost.backward_flops if backward else cost.flops
    nbytes = cost.backward_bytes if backward else cost.bytes_read + cost.bytes_written
    peak = device.peak_flops[rate_dtype(device, cost.dtype or dtype)]
    rate = peak * device.efficiency.get(cost.op_class, device.efficiency.get("default", 1.0)) * shape_factor(model, cost)
    kernels = cost.backward_kernels if backward else 1.0
    bandwidth = device.memory_bandwidth * model.memory_efficiency
    memory = nbytes / bandwidth
    seconds = max(flops / rate, memory)
    if cost.winograd and model.winograd_speedup > 1:
        seconds = min(seconds, max(flops / (rate * model.winograd_speedup), memory) + model.winograd_traffic * nbytes / bandwidth)
    return seconds + device.op_overhead * kernels


def rate_dtype(device: Device, dtype: str) -> str:
    """The dtype whose peak rate prices a `dtype` kernel on `device`: its own where the device lists one, else float32."""
    return dtype if dtype in device.peak_flops else "float32"


def shape_factor(model: KernelModel, cost: NodeCost) -> float:
    """How far a matmul's or convolution's kernel gets from its op class's efficiency because of its implicit
    GEMM's shape (`NodeCost.gemm_k`, `gemm_n`; M = flops / 2KN rows): K/(K+reduction_half) x N/(N+columns_half)
    for short reductions and few columns, times tiles/(tiles + multiprocessors/2) for a kernel of few output
    tiles (tiles = ceil(M/tile) x ceil(N/tile); its last wave over the multiprocessors is half empty on average,
    NVIDIA "Matrix Multiplication Background User's Guide": wave quantization); 1 for other ops."""
    if not cost.gemm_k or not cost.gemm_n:
        return 1.0
    factor = cost.gemm_k / (cost.gemm_k + model.reduction_half) * cost.gemm_n / (cost.gemm_n + model.columns_half)
    if model.multiprocessors:
        rows = cost.flops / (2 * cost.gemm_k * cost.gemm_n)
        tiles = max(1, math.ceil(rows / model.tile)) * math.ceil(cost.gemm_n / model.tile)
        factor *= tiles / (tiles + model.multiprocessors / 2)
    return factor


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
    return ring_seconds(n, max(link.latency for link in links), min(link.bandwidth for link in links), nbytes)


def ring_seconds(n: int, latency: float, bandwidth: float, nbytes: float) -> float:
    """Ring all-reduce of nbytes over n devices whose ring's largest latency and least bandwidth are these."""
    return 2 * (n - 1) * (latency + nbytes / n / bandwidth)


def rings(target: Target, devices: tuple[str, ...]) -> list[tuple[float, float]]:
    """(largest latency, least bandwidth) of the ring over the first n of `devices`, for n = 2, 3, ...: in one pass, as the
    solvers ask every replica count of a group (ring by ring, 1,000 devices took a million link look-ups, 3 s)."""
    out, latency, bandwidth = [], 0.0, math.inf
    for i in range(1, len(devices)):
        step, back = target.link(devices[i - 1], devices[i]), target.link(devices[i], devices[0])
        latency, bandwidth = max(latency, step.latency), min(bandwidth, step.bandwidth)
        out.append((max(latency, back.latency), min(bandwidth, back.bandwidth)))
    return out


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
