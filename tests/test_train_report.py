"""`onnxpipe train --report`: the measured timeline of the last step, beside the simulated one."""

from __future__ import annotations

import struct
from pathlib import Path

import onnx
from typer.testing import CliRunner

from onnxpipe import models, report
from onnxpipe.cli import app
from onnxpipe.schedule import add_communication, build
from onnxpipe.plan.predict import read_plan
from onnxpipe.plan.predict import simulate_plan as simulate
from onnxpipe.target import load_target
from onnxpipe.train.optimizer import OptimizerConfig
from onnxpipe.train.pipeline import Pipeline

_KIND = {"RECV_F": "RECV", "RECV_B": "RECV", "SEND_F": "SEND", "SEND_B": "SEND"}


def _png_height(path: Path) -> int:
    return struct.unpack(">I", path.read_bytes()[20:24])[0]


def test_measured_timeline_follows_each_stages_schedule_row() -> None:
    model = models.build("mlp", train=True)
    with Pipeline(model, "cpu2", stages=2, microbatches=2, schedule="1f1b", optimizer=OptimizerConfig("sgd", lr=0.01)) as pipe:
        from onnxpipe.train.fit import data_source

        source = data_source(pipe, "synthetic")
        for s in range(2):
            pipe.train_step(source.batch(s))
        events = pipe.last_events
    rows = add_communication(build("1f1b", 2, 2))
    for s, row in enumerate(rows):
        mine = sorted((e for e in events if e.stage == s), key=lambda e: e.start)
        assert [(e.kind, e.microbatch) for e in mine] == [(_KIND.get(a.op, a.op), a.microbatch) for a in row]
        assert all(0 <= e.start <= e.end for e in mine)
        assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
    # Stage 1 cannot start micro-batch 0 before stage 0 has sent it.
    send0 = next(e for e in events if e.stage == 0 and e.kind == "SEND" and e.microbatch == 0)
    f1 = next(e for e in events if e.stage == 1 and e.kind == "F" and e.microbatch == 0)
    assert f1.start >= send0.start


def test_train_report_holds_simulated_and_measured_schedules(tmp_path: Path) -> None:
    onnx.save(models.build("mlp", train=True), str(tmp_path / "m.onnx"))
    stages = tmp_path / "stages"
    assert CliRunner().invoke(app, ["split", str(tmp_path / "m.onnx"), "--target", "cpu2", "--stages", "2", "--microbatches", "2",
                                    "-o", str(stages)]).exit_code == 0
    out = tmp_path / "run" / "train.html"
    result = CliRunner().invoke(app, ["train", str(stages), "--target", "cpu2", "--microbatches", "2", "--schedule", "gpipe",
                                      "--steps", "2", "--report", str(out)])
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert "Schedule (simulated and measured)" in page and page.count("data:image/png;base64,") >= 2
    # The same plan simulated alone draws one timeline: the measured report's chart has a second one below it.
    plan = read_plan(stages)
    alone = tmp_path / "alone" / "sim.html"
    report.write(alone, plan, simulate(plan, load_target("cpu2"), schedule="gpipe", microbatches=2))
    assert _png_height(out.with_name("train_gantt.png")) > 1.4 * _png_height(alone.with_name("sim_gantt.png"))
