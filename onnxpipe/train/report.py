"""`onnxpipe train --report`: the plan's report with the simulated step beside the last measured one."""

from __future__ import annotations

import os
from pathlib import Path

from onnxpipe import report
from onnxpipe.plan.predict import plan_target, read_plan, simulate_plan
from onnxpipe.train.pipeline import Pipeline

__all__ = ["write_report"]


def write_report(pipeline: Pipeline, path: str | os.PathLike) -> tuple[Path, ...]:
    """The simulation uses the run's target, schedule and micro-batches; the measured step is the pipeline's last."""
    plan = read_plan(pipeline.directory)
    sim = simulate_plan(plan, plan_target(plan, pipeline.target), schedule=pipeline.config.schedule, microbatches=pipeline.config.microbatches)
    return report.write(path, plan, sim, measured=pipeline.last_events)
