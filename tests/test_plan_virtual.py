"""Plans that give a device several stages (interleaved 1F1B, ZB-V): stages placed by the schedule, priced
and simulated on the real devices, memory summed per device, and chosen by --schedule auto when faster."""

from __future__ import annotations

import functools
import re
from dataclasses import replace

import pytest

from onnxpipe import models
from onnxpipe import schedule as sched
from onnxpipe.cost import annotate
from onnxpipe.errors import OnnxpipeError
from onnxpipe.graph import Graph, load
from onnxpipe.plan import plan
from onnxpipe.plan.evaluate import fits, overflow
from onnxpipe.plan.predict import simulate_plan
from onnxpipe.plan.result import Plan
from onnxpipe.target import load_target


@functools.cache
def gpt2() -> Graph:
    return load(models.build("gpt2-tiny", train=True))


@functools.cache
def planned(schedule: str, stages: int, target: str = "fpga4") -> Plan:
    return plan(gpt2(), annotate(gpt2()), load_target(target), stages=stages, microbatches=4, schedule=schedule, time_limit=5)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_stages_go_where_the_schedule_places_them(schedule: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = planned(schedule, 8)
    devices = [d.name for d in load_target("fpga4").devices]
    assert [s.devices for s in p.stages] == [(devices[d],) for d in sched.placement(schedule, 8)]
    assert p.solver.status == "OPTIMAL" and p.lower_bound_seconds <= p.bottleneck_seconds * (1 + 1e-9)
    assert fits(p)
    # The plan's prediction is the simulation of its table on the real devices, also from its JSON.
    p.save(tmp_path / "plan.json")
    again = simulate_plan(Plan.read(tmp_path / "plan.json"), load_target("fpga4"))
    assert again.iteration_seconds == pytest.approx(p.iteration_seconds)
    assert again.schedule == schedule and len(again.devices) == 8
    # Memory as the planner assumes it: a device's simulated peak within the sum of its stages' planned peaks.
    for s in p.stages:
        planned_device = sum(t.memory.total for t in p.stages if t.devices == s.devices)
        assert again.peak_memory_bytes[s.index] <= planned_device * (1 + 1e-9)
        assert again.peak_memory_bytes[s.index] >= max(t.memory.static for t in p.stages if t.devices == s.devices)


def test_interleaving_beats_1f1b_at_m_equal_k_on_fpga4() -> None:
    # gpt2-tiny on four U280s, 4 micro-batches: half the fill and drain (predicted 3.10 ms against 3.74 ms when written).
    one = planned("1f1b", 4)
    assert planned("interleaved", 8).iteration_seconds < 0.9 * one.iteration_seconds
    assert planned("zb-v", 8).iteration_seconds < planned("zb-h1", 4).iteration_seconds < one.iteration_seconds


def test_auto_chooses_among_every_schedule() -> None:
    p = plan(gpt2(), annotate(gpt2()), load_target("fpga4"), stages=4, microbatches=4, schedule="auto", time_limit=5)
    tried = {(c.schedule, c.stages): c.iteration_seconds for c in p.explored}
    assert set(tried) == {("gpipe", 4), ("1f1b", 4), ("zb-h1", 4), ("interleaved", 8), ("zb-v", 8)}
    assert p.iteration_seconds == pytest.approx(min(tried.values()))
    assert (p.schedule, len(p.stages)) == min(tried, key=tried.get)


@pytest.mark.parametrize("schedule", ["interleaved", "zb-v"])
def test_on_several_device_types_a_device_runs_all_its_stages(schedule: str, tmp_path) -> None:  # type: ignore[no-untyped-def]
    p = planned(schedule, 8, "hetero")
    devices = {d.name for d in load_target("hetero").devices}
    held: dict[int, set] = {}
    for s, d in zip(p.stages, sched.placement(schedule, 8)):
        held.setdefault(d, set()).add(s.devices)
    # The stages the table puts on one device index run on one real device (so on one type), every device used once.
    assert all(len(h) == 1 for h in held.values()) and {d for h in held.values() for (d,) in h} == devices
    assert fits(p) and p.lower_bound_seconds <= p.bottleneck_seconds * (1 + 1e-9)
    # Its bound holds over every pattern of types (the least of the 6 patterns' bounds, or the first-principles one where
    # time ran out before all were searched): at most the least bottleneck found.
    assert p.solver.bound_seconds <= p.solver.least_bottleneck_seconds * (1 + 1e-9)
    p.save(tmp_path / "plan.json")
    assert simulate_plan(Plan.read(tmp_path / "plan.json"), load_target("hetero")).iteration_seconds == pytest.approx(p.iteration_seconds)


def test_every_pattern_of_device_types_is_searched_where_few() -> None:
    from onnxpipe.plan.virtual import _patterns

    every, complete = _patterns((2, 2), 4)
    assert complete and len(every) == len(set(every)) == 6 and all(sorted(p) == [0, 0, 1, 1] for p in every)
    assert _patterns((2, 2), 2) == ([(0, 0), (0, 1), (1, 0), (1, 1)], True)
    # 4 + 4 devices have 70 patterns: only the two that keep each type side by side, and the bound says so.
    assert _patterns((4, 4), 8) == ([(0, 0, 0, 0, 1, 1, 1, 1), (1, 1, 1, 1, 0, 0, 0, 0)], False)
    # Thousands of devices: one type is one pattern; two are side by side, without enumerating the rest.
    assert _patterns((3000,), 3000) == ([(0,) * 3000], True)
    assert _patterns((1500, 1500), 3000) == ([(0,) * 1500 + (1,) * 1500, (1,) * 1500 + (0,) * 1500], False)


def test_auto_explores_several_stages_per_device_on_several_device_types() -> None:
    p = plan(gpt2(), annotate(gpt2()), load_target("hetero"), stages=4, microbatches=4, schedule="auto", time_limit=10)
    tried = {(c.schedule, c.stages): c.iteration_seconds for c in p.explored}
    assert {("interleaved", 8), ("zb-v", 8)} <= set(tried)
    assert p.iteration_seconds == pytest.approx(min(tried.values()))


def test_a_device_must_hold_all_its_stages() -> None:
    p = planned("interleaved", 8)
    both = p.stages[0].memory.total + p.stages[4].memory.total
    tight = replace(p, stages=tuple(replace(s, memory=replace(s.memory, capacity=both * 0.99)) for s in p.stages))
    assert all(s.memory.total <= s.memory.capacity for s in tight.stages)  # each stage alone would fit
    assert not fits(tight)
    first, second = map(int, re.match(r"stages (\d), (\d) on one device needs", overflow(tight)).groups())  # type: ignore[union-attr]
    assert second == first + 4


@pytest.mark.parametrize(("target", "stages", "microbatches", "message"), [
    ("fpga4", 7, 4, "pass --stages a multiple of 2 up to 8"),
    ("fpga4", 10, 4, "--stages 10 is more than the target's 4 devices; use at most 8"),
    ("fpga4", 8, "auto", "--microbatches auto explores the schedules of one stage per device"),
])
def test_what_cannot_be_planned_says_why(target: str, stages: int, microbatches: int | str, message: str) -> None:
    with pytest.raises(OnnxpipeError, match=message):
        plan(gpt2(), annotate(gpt2()), load_target(target), stages=stages, microbatches=microbatches, schedule="interleaved", time_limit=5)
