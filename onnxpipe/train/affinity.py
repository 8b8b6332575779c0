"""Which CPUs each worker process may run on (`--bind-cores`).

Left to the OS, two workers may share a physical core's hardware threads, and a worker woken by a message
may be queued beside its waker (wake-affine) until the balancer moves it. Bound, each worker process
keeps CPUs of its own: one thread of every physical core first (siblings share a core's units), the
first CPU in that order left to the driver and the OS when there is one to spare. It also makes runs
comparable: `metrics()` names each worker's CPUs. On a 16-vCPU virtual machine (16 cores of one thread
as the guest sees them) it changed no measured step (docs/benchmarks.md). Asked for, never by default:
two runs side by side would each bind to the same CPUs, where the OS spreads them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from onnxpipe.errors import OnnxpipeError
from onnxpipe.units import plural

__all__ = ["topology", "spread", "worker_cpus", "bind"]

_SYS_CPU = Path("/sys/devices/system/cpu")


def topology(cpus: Sequence[int], root: Path = _SYS_CPU) -> dict[int, tuple[int, int]]:
    """(package, core) of each CPU as the kernel reports it; a CPU it says nothing of is a core of its own."""
    out = {}
    for cpu in cpus:
        try:
            base = root / f"cpu{cpu}" / "topology"
            out[cpu] = (int((base / "physical_package_id").read_text()), int((base / "core_id").read_text()))
        except (OSError, ValueError):
            out[cpu] = (-1, cpu)
    return out


def spread(cpus: Sequence[int], where: Mapping[int, tuple[int, int]]) -> tuple[int, ...]:
    """The CPUs in the order workers take them: the first thread of every physical core, then the second of each, ..."""
    rank: dict[int, int] = {}
    seen: dict[tuple[int, int], int] = {}
    for cpu in sorted(cpus):
        core = where.get(cpu, (-1, cpu))
        rank[cpu] = seen.get(core, 0)
        seen[core] = rank[cpu] + 1
    return tuple(sorted(cpus, key=lambda c: (rank[c], where.get(c, (-1, c)), c)))


def worker_cpus(threads: Sequence[int], allowed: Sequence[int] | None = None,
                where: Mapping[int, tuple[int, int]] | None = None) -> tuple[tuple[int, ...], ...]:
    """CPUs per worker process (`threads[h]` each), or an error naming the way out where the CPUs this
    process may use (`allowed`, default: its affinity) cannot hold every worker's threads."""
    if allowed is None:
        if not hasattr(os, "sched_getaffinity"):
            raise OnnxpipeError("--bind-cores needs Linux (CPU affinity); run without it")
        allowed = sorted(os.sched_getaffinity(0))
    need = sum(max(1, t) for t in threads)
    if need > len(allowed):
        raise OnnxpipeError(
            f"--bind-cores needs {plural(need, 'CPU')} for {plural(len(threads), 'worker process')} "
            f"and this process may use {len(allowed)}; run without --bind-cores, or on fewer stages or threads per device"
        )
    order = spread(allowed, topology(allowed) if where is None else where)
    spare = 1 if len(order) > need else 0
    out, at = [], spare
    for t in threads:
        out.append(tuple(sorted(order[at:at + max(1, t)])))
        at += max(1, t)
    return tuple(out)


def bind(cpus: Sequence[int]) -> None:
    """Bind this process (and the threads it starts later: onnxruntime's pools) to `cpus`."""
    os.sched_setaffinity(0, cpus)
