"""The measured timeline of a training step in the simulator's event format, and the report that sets
it beside the simulated one (`onnxpipe train --report`)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from onnxpipe.simulate import Event

if TYPE_CHECKING:
    from onnxpipe.train.pipeline import Pipeline

__all__ = ["step_events", "write_report"]

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


def write_report(pipeline: Pipeline, path: str | os.PathLike, target: str) -> tuple[Path, ...]:
    """The plan's report with the simulated step (the run's schedule and micro-batches) and the last measured step."""
    from onnxpipe import report
    from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan

    plan = read_plan(pipeline.directory)
    sim = simulate_plan(plan, plan_target(plan, target), schedule=pipeline.config.schedule, microbatches=pipeline.config.microbatches)
    return report.write(path, plan, sim, measured=pipeline.last_events)
