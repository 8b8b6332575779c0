"""onnxruntime's profile trace: the runs of a profiled session and the kernels each ran.

Per-node medians (`cost_profile.trace_medians`), kernel op types (`cost_profile.kernel_ops`), the reorder
probe's rates (`cost_layout.reorder_rates`) and imported traces (`cost_import`) all read the same two kinds of
event; one reader keeps their notion of a run and of a kernel the same.

Reading order: `is_run`, `is_kernel` -> `Kernel` -> `run_starts` -> `kernels`.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

__all__ = ["Kernel", "is_run", "is_kernel", "run_starts", "kernels"]

#: What onnxruntime appends to a kernel event's name (the node's name, or what a fusion named the kernel).
_KERNEL_SUFFIX = "_kernel_time"


def is_run(event: Mapping[str, Any]) -> bool:
    """Whether the event is one `InferenceSession.run` of the session (its span holds that run's kernels)."""
    return event.get("cat") == "Session" and event.get("name") == "model_run"


def is_kernel(event: Mapping[str, Any]) -> bool:
    """Whether the event is one kernel's execution."""
    return event.get("cat") == "Node" and str(event.get("name", "")).endswith(_KERNEL_SUFFIX)


@dataclass(frozen=True)
class Kernel:
    """One kernel execution of a trace."""

    #: Index of the run it belongs to (0: the first, warm-up runs included).
    run: int
    #: The kernel's name without the trace's suffix: its node's name, or what a fusion named it.
    name: str
    #: Its op type (`op_name`: an optimized session's fused kernel says what it became).
    op: str
    #: Its duration, whole microseconds as the trace has them.
    micros: float


def run_starts(events: Iterable[Mapping[str, Any]]) -> list[float]:
    """The start of each run, in order (microseconds)."""
    return sorted(e["ts"] for e in events if is_run(e))


def kernels(events: Iterable[Mapping[str, Any]], starts: list[float]) -> list[Kernel]:
    """The kernels that ran within the runs starting at `starts` (`run_starts`), each with its run's index."""
    if not starts:
        return []
    return [Kernel(bisect_right(starts, e["ts"]) - 1, e["name"][: -len(_KERNEL_SUFFIX)], e.get("args", {}).get("op_name", ""), e["dur"])
            for e in events if is_kernel(e) and e["ts"] >= starts[0]]
