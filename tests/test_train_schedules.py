"""The schedules with a split backward or several stages per device, executed: pipelined training gives
the losses and weights of unpartitioned training on every trainable zoo model, and each worker runs
exactly its row of the table."""

from __future__ import annotations

import numpy as np
import pytest
from test_train import (ADAMW, M, REWRITTEN, RTOL, SGD, TRAINABLE, assert_killed_process_fails_fast, assert_same_training, batches,
                        reference, stage_dir)

from onnxpipe import schedule as sched
from onnxpipe.train.prepare import TrainConfig, prepare_stages

#: (schedule, stages): ZB-H1 on 3 devices; interleaved 1F1B and ZB-V with 4 stages on 2 devices.
SETUPS = [("zb-h1", 3), ("interleaved", 4), ("zb-v", 4)]
CASES = [(name, schedule, k, "never") for name in TRAINABLE + REWRITTEN for schedule, k in SETUPS]
CASES += [("gpt2-tiny", "zb-h1", 3, "always"), ("resnet-bn", "zb-v", 4, "always"), ("two-io", "interleaved", 4, "always")]


@pytest.mark.parametrize(("name", "schedule", "k", "recompute"), CASES, ids=["-".join(map(str, c)) for c in CASES])
def test_new_schedules_match_unpartitioned(name: str, schedule: str, k: int, recompute: str) -> None:
    pipe = assert_same_training(name, k, schedule, recompute, SGD)
    table = sched.add_communication(sched.table(schedule, k, M))
    for runner, program in zip(pipe.runners, pipe.programs):
        s = runner.spec.index
        row = table[sched.stage_rows(table)[s]]
        # Each stage ran its actions of its device's row, in the device's order, every step.
        assert program.trace == [a for a in row if a.stage == s] * 5
        assert any(a.op == "W" for a in program.trace) == schedule.startswith("zb")


@pytest.mark.parametrize(("name", "schedule", "k"), [("gpt2-tiny", "zb-h1", 4), ("resnet-tiny", "zb-v", 4), ("mlp", "interleaved", 4)])
def test_new_schedules_with_adamw_match_unpartitioned(name: str, schedule: str, k: int) -> None:
    # As in test_train: AdamW turns the rounding noise of attention key biases' zero gradients into full
    # steps, so gpt2-tiny's weights are not compared (its losses are).
    assert_same_training(name, k, schedule, "never", ADAMW, weights=name != "gpt2-tiny")


@pytest.mark.parametrize(("name", "schedule", "k"), [("gpt2-tiny", "zb-h1", 3), ("resnet-tiny", "zb-v", 4), ("gpt2-tiny", "interleaved", 4)])
def test_worker_processes_run_the_new_schedules(name: str, schedule: str, k: int) -> None:
    from onnxpipe.train.processes import ProcessPipeline

    directory, manifest = stage_dir(name, k)
    config = TrainConfig(schedule=schedule, microbatches=M, optimizer=SGD)
    table = sched.add_communication(sched.table(schedule, k, M))
    losses = []
    with ProcessPipeline(prepare_stages(directory, manifest, config)) as pipe:
        assert len(set(pipe.pids)) == len(table)  # one process per device, however many stages it holds
        for mb in batches(name, manifest, config):
            losses.append(pipe.train_step(mb))
            assert pipe.last is not None
            for row in table:
                mine = sorted((e for e in pipe.last.events if e.stage in {a.stage for a in row}), key=lambda e: e.start)
                # The device ran its row's actions one at a time, in the table's order.
                assert [(e.stage, e.kind, e.microbatch) for e in mine] == [(a.stage, _kind(a.op), a.microbatch) for a in row]
                assert all(a.end <= b.start for a, b in zip(mine, mine[1:]))
        weights = pipe.parameters()
    ref_losses, ref_weights = reference(name, SGD)
    np.testing.assert_allclose(losses, ref_losses, rtol=RTOL)
    for key, value in ref_weights.items():
        assert float(np.max(np.abs(weights[key] - value))) <= RTOL * 10 * max(1.0, float(np.max(np.abs(value)))), key


def _kind(op: str) -> str:
    """An executor op as the measured timeline names it (a RECV or SEND of either direction)."""
    return op.split("_")[0]


def test_metrics_count_a_device_of_several_stages_once() -> None:
    from onnxpipe import Pipeline
    from onnxpipe.train.fit import data_source

    directory, manifest = stage_dir("mlp", 4)
    with Pipeline(directory, microbatches=M, schedule="interleaved", optimizer=SGD, processes=False) as pipe:
        source = data_source(pipe, "synthetic")
        for s in range(3):
            pipe.train_step(source.batch(s))
        metrics = pipe.metrics()
    busy = sum(st["busy_seconds"] for st in metrics["stages"])
    # 4 stages on 2 devices: the bubble is the devices' idle share, as the simulator counts it.
    assert pipe.devices == 2 and len(metrics["stages"]) == 4
    assert metrics["bubble_fraction"] == pytest.approx(max(0.0, 1 - busy / (2 * metrics["step_seconds"])))


def test_killed_device_process_fails_fast_naming_one_of_its_stages() -> None:
    # interleaved 1F1B, 4 stages on 2 devices: process 1 is device 1, holding stages 1 and 3.
    assert_killed_process_fails_fast(4, "interleaved", "[13]")
