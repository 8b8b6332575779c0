"""The measured timeline of a training step in the simulator's event format (`report.write_report`
sets it beside the simulated one)."""

from __future__ import annotations

from collections.abc import Sequence

from onnxpipe.simulate import Event

__all__ = ["step_events"]

#: Executor ops as timeline kinds: a RECV bar spans waiting for the data and copying it out.
_KINDS = {"F": "F", "B": "B", "W": "W", "RECV_F": "RECV", "RECV_B": "RECV", "SEND_F": "SEND", "SEND_B": "SEND", "STEP": "STEP"}


def step_events(start: float, timings: Sequence[Sequence[tuple[str, int, float, float]]], stages: Sequence[int] | None = None) -> tuple[Event, ...]:
    """Events from each worker's (op, micro-batch, start, end) perf_counter timings, in seconds from `start`;
    `stages[w]` is worker w's stage (default: worker w runs stage w). Workers are numbered stage-major
    (`Layout`), so a worker's replica is the number of workers before it on the same stage."""
    stages = list(stages) if stages is not None else list(range(len(timings)))
    return tuple(
        Event(stages[w], _KINDS[op], mb, t0 - start, t1 - start, stages[:w].count(stages[w]))
        for w, rows in enumerate(timings)
        for op, mb, t0, t1 in rows
    )
