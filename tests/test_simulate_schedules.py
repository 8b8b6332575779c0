"""The simulator on the schedules with a split backward or several stages per device, against their
closed forms at uniform stages (no transfers, no overheads)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from test_simulate import make_plan, make_target

from onnxpipe import schedule as sched
from onnxpipe.plan.predict import simulate_plan as simulate
from onnxpipe.plan.result import Plan


def _with_weight(plan: Plan, weight: float) -> Plan:
    return replace(plan, stages=tuple(replace(s, weight_seconds=weight) for s in plan.stages))


def _virtual(k: int, m: int, schedule: str, weight: float = 0.0) -> Plan:
    """2k stages of half a 1F1B stage's work (F 0.5, B 1), each stashing 100 bytes, on the devices of the
    schedule's placement."""
    devices = tuple((f"acc_{d}",) for d in sched.placement(schedule, 2 * k))
    plan = make_plan(2 * k, m, forward=0.5, backward=1.0, devices=devices)
    return replace(plan, schedule=schedule, stages=tuple(replace(s, stash_bytes=100.0, weight_seconds=weight) for s in plan.stages))


@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_zb_h1_bubble_is_a_third_of_1f1b(k: int, m: int) -> None:
    # F = B = W = 1: 1F1B runs B and W together (2), ZB-H1 fills the bubble with W.
    plan = _with_weight(make_plan(k, m, schedule="zb-h1", forward=1.0, backward=2.0), 1.0)
    one = simulate(plan, make_target(k), schedule="1f1b")
    zb = simulate(plan, make_target(k))
    assert one.iteration_seconds == pytest.approx(3 * (m + k - 1))
    assert zb.iteration_seconds == pytest.approx(3 * m + k - 1)
    assert zb.bubble_fraction == pytest.approx((k - 1) / (3 * m + k - 1))
    assert zb.busy_seconds == pytest.approx([3.0 * m] * k)
    assert sum(e.kind == "W" for e in zb.events) == k * m
    # Every stage holds up to min(k, m) stashes until W; 1F1B holds k - s until B.
    assert [p - s for p, s in zip(zb.peak_memory_bytes, zb.static_memory_bytes)] == pytest.approx([100.0 * min(k, m)] * k)
    assert [p - s for p, s in zip(one.peak_memory_bytes, one.static_memory_bytes)] == pytest.approx([100.0 * min(k - s, m) for s in range(k)])


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 8), (3, 6)])
def test_interleaved_bubble_shrinks_by_the_virtual_stages(k: int, m: int) -> None:
    # 2k stages, each half of a 1F1B stage's work, stage s on the device of stage s % k.
    sim = simulate(_virtual(k, m, "interleaved"), make_target(k))
    assert sim.iteration_seconds == pytest.approx(3 * m + 1.5 * (k - 1))
    assert sim.bubble_fraction == pytest.approx((k - 1) / (2 * m + k - 1))
    assert sim.busy_seconds == pytest.approx([1.5 * m] * (2 * k))  # each stage's own compute
    table = sched.table("interleaved", 2 * k, m)
    # A device holds both its stages' stashes: the peak of its row's in-flight count.
    assert [sim.peak_memory_bytes[d] - 2 * sim.static_memory_bytes[d] for d in range(k)] == pytest.approx(
        [100.0 * sched.in_flight(row) for row in table])


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 8)])
def test_zb_v_beats_zb_h1(k: int, m: int) -> None:
    zbv = simulate(_virtual(k, m, "zb-v", weight=0.5), make_target(k))
    zbh1 = simulate(_with_weight(make_plan(k, m, schedule="zb-h1", forward=1.0, backward=2.0), 1.0), make_target(k))
    assert zbv.iteration_seconds < zbh1.iteration_seconds
    assert zbv.iteration_seconds <= 3 * m + (k - 1) / 2


def test_planner_prices_w_and_zb_h1_memory() -> None:
    from onnxpipe import models
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load
    from onnxpipe.plan import plan
    from onnxpipe.pricing.problem import FUSED_GRADIENT_OPS, build_problem
    from onnxpipe.target import load_target

    graph = load(models.build("gpt2-tiny", train=True))
    costs, target = annotate(graph), load_target("fpga4")
    problem = build_problem(graph, costs, target, batch=8, microbatches=8, schedule="zb-h1")
    kinds = set()
    for i, name in enumerate(problem.nodes):
        op, weighted = graph.node(name).op_type, costs.nodes[name].param_bytes > 0
        share = 0.0 if op in FUSED_GRADIENT_OPS or not weighted else 0.5
        assert problem.weight[:, i] == pytest.approx(problem.backward[:, i] * share), name
        kinds.add((op, share))
    # Products with a weight defer half their backward to W; layer norms and weightless ops none.
    assert {("MatMul", 0.5), ("LayerNormalization", 0.0), ("Softmax", 0.0)} <= kinds
    zb = plan(graph, costs, target, stages=4, batch=8, microbatches=8, schedule="zb-h1", recompute="never", time_limit=5)
    one = plan(graph, costs, target, stages=4, batch=8, microbatches=8, schedule="1f1b", recompute="never", time_limit=5)
    # The first stage receives nothing its backward must return a gradient for: its B makes nothing, all is W.
    assert zb.stages[0].weight_seconds == pytest.approx(zb.stages[0].backward_seconds)
    assert all(0 < s.weight_seconds < s.backward_seconds for s in zb.stages[1:])
    # ZB-H1 holds k micro-batches' stash on every stage until W; 1F1B k - s until B.
    for s in zb.stages:
        assert s.memory.activations == pytest.approx(4 * s.stash_bytes)
    for s in one.stages:
        assert s.memory.activations == pytest.approx((4 - s.index) * s.stash_bytes)
    sim = simulate(zb, target)
    for s, peak in zip(zb.stages, sim.peak_memory_bytes):
        assert peak == pytest.approx(s.memory.total)


def test_tied_stages_on_one_device_step_together() -> None:
    # ZB-V puts the first and the last stage on device 0: with tied weights (an embedding and the head),
    # their STEPs exchange gradients on one worker.
    plan = _virtual(2, 4, "zb-v", weight=0.5)
    stages = list(plan.stages)
    stages[0], stages[3] = replace(stages[0], tied=(3,), tied_bytes=1e6), replace(stages[3], tied=(0,), tied_bytes=1e6)
    sim = simulate(replace(plan, stages=tuple(stages)), make_target(2))
    steps = [e for e in sim.events if e.kind == "STEP"]
    assert sorted(e.stage for e in steps) == [0, 1, 2, 3]
    assert sim.iteration_seconds == pytest.approx(max(e.end for e in steps))
