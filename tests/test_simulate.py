"""The simulator against closed-form pipeline figures on constructed plans, and the report and CLI around it."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from types import MappingProxyType

import pytest

from onnxpipe import schedule as sched
from onnxpipe.errors import OnnxpipeError
from onnxpipe.pricing.timemodel import allreduce_seconds
from onnxpipe.plan.result import Memory, Plan, SolveInfo, StagePlan
from onnxpipe.plan.predict import plan_target
from onnxpipe.plan.predict import simulate_plan as simulate
from onnxpipe.target import Device, HostModel, Link, MessageCpu, Target
from onnxpipe.train.timeline import step_events

GIB = 2.0**30


def make_target(n: int, bandwidth: float = 1e12, latency: float = 0.0) -> Target:
    devices = tuple(
        Device(
            name=f"acc_{i}",
            group="acc",
            kind="gpu",
            peak_flops=MappingProxyType({"float32": 1e12}),
            memory_bytes=16 * GIB,
            memory_bandwidth=1e20,
            efficiency=MappingProxyType({"default": 1.0}),
            op_overhead=0.0,
        )
        for i in range(n)
    )
    return Target("toy", "toy cluster", devices, (Link(("acc", "acc"), bandwidth, latency, "switch"),), False, "<test>")


def host(target: Target, **fields: object) -> Target:
    """The target with its host model's fields changed."""
    return replace(target, host=replace(target.host or HostModel(), **fields))  # type: ignore[arg-type]


def on_cpus(target: Target, **fields: object) -> Target:
    """The target with cpu devices (sharing its `cores`), and other fields of the target or its host model changed."""
    own = {k: v for k, v in fields.items() if k in ("links",)}
    cpus = replace(target, devices=tuple(replace(d, kind="cpu") for d in target.devices), **own)  # type: ignore[arg-type]
    return host(cpus, **{k: v for k, v in fields.items() if k not in own})


def forwards(plan: Plan, target: Target) -> list[tuple[int, float, float]]:
    """(replica, start, end) of every forward, in order."""
    return sorted((e.replica, round(e.start, 9), round(e.end, 9)) for e in simulate(plan, target).events if e.kind == "F")


def make_plan(
    k: int,
    m: int,
    *,
    schedule: str = "1f1b",
    forward: float = 1.0,
    backward: float = 2.0,
    comm_bytes: float = 0.0,
    stash: float = 100.0,
    params: float = 0.0,
    recompute: bool = False,
    devices: tuple[tuple[str, ...], ...] | None = None,
) -> Plan:
    """A balanced plan whose peak activations follow the schedule's in-flight counts."""
    table = sched.build(schedule, k, m)
    devices = devices or tuple((f"acc_{i}",) for i in range(k))
    stages = tuple(
        StagePlan(
            index=i,
            devices=devices[i],
            nodes=(f"n{i}",),
            forward_seconds=forward,
            backward_seconds=backward,
            comm_in_seconds=0.0,
            comm_out_seconds=0.0,
            comm_in_bytes=comm_bytes if i > 0 else 0.0,
            comm_out_bytes=comm_bytes if i < k - 1 else 0.0,
            allreduce_seconds=0.0,
            recompute=recompute,
            memory=Memory(params, params, 2 * params, sched.in_flight(table[i]) * stash, 16 * GIB),
        )
        for i in range(k)
    )
    return Plan(
        model="toy.onnx",
        fingerprint="x",
        target="toy",
        dims={},
        batch=8 * m,
        microbatches=m,
        schedule=schedule,
        optimizer="sgd",
        stages=stages,
        bottleneck_seconds=forward + backward,
        lower_bound_seconds=forward + backward,
        iteration_seconds=0.0,
        solver=SolveInfo("uniform", 0.0, 0.0, 0.0, 0.0, k),
    )


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 4), (4, 4), (4, 8), (3, 7)])
def test_balanced_pipeline_matches_closed_form(schedule: str, k: int, m: int) -> None:
    sim = simulate(make_plan(k, m, schedule=schedule), make_target(k))
    assert sim.iteration_seconds == pytest.approx((m + k - 1) * 3.0)
    assert sim.bubble_fraction == pytest.approx((k - 1) / (m + k - 1))
    assert sim.busy_seconds == pytest.approx([m * 3.0] * k)
    assert sim.samples_per_s == pytest.approx(8 * m / ((m + k - 1) * 3.0))
    assert sum(1 for e in sim.events if e.kind == "F") == k * m


def test_overrides_rescale_micro_batches() -> None:
    plan = make_plan(4, 4, schedule="gpipe")
    sim = simulate(plan, make_target(4), schedule="1f1b", microbatches=8)
    # Same global batch in 8 micro-batches: each takes half the time.
    assert sim.iteration_seconds == pytest.approx((8 + 3) * 1.5)
    assert (sim.schedule, sim.microbatches) == ("1f1b", 8)


def test_link_sharing_slows_concurrent_transfers() -> None:
    # Stage 0 finishes forwards every 1 s but each transfer alone needs 10 s: two run at once on one link.
    target = make_target(2, bandwidth=1e9)
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0, comm_bytes=10e9)
    sim = simulate(plan, target)
    sends = sorted((e for e in sim.events if e.kind == "SEND" and e.stage == 0), key=lambda e: e.microbatch)
    # mb0 alone from 1 s to 2 s (1 GB), then both at 0.5 GB/s: mb0's other 9 GB end at 20 s; mb1's last GB alone.
    assert [(e.start, e.end) for e in sends] == [(1.0, pytest.approx(20.0)), (2.0, pytest.approx(21.0))]
    unshared = simulate(make_plan(2, 1, schedule="gpipe", forward=1.0, backward=0.0, comm_bytes=10e9), target)
    assert next(e for e in unshared.events if e.kind == "SEND").end == pytest.approx(11.0)


def test_latency_and_bandwidth_add_to_each_hop() -> None:
    target = make_target(2, bandwidth=1e9, latency=0.5)
    plan = make_plan(2, 1, forward=1.0, backward=1.0, comm_bytes=1e9)
    # F0 1 s, hop 1.5 s, F1 1 s, B1 1 s, gradient hop 1.5 s, B0 1 s.
    assert simulate(plan, target).iteration_seconds == pytest.approx(7.0)


def test_replicated_stage_adds_allreduce_before_step() -> None:
    target = make_target(3, bandwidth=1e9)
    devices = (("acc_0", "acc_2"), ("acc_1",))
    a, b = simulate(make_plan(2, 2, devices=devices), target), simulate(make_plan(2, 2, params=1e9, devices=devices), target)
    allreduce = allreduce_seconds(target, ("acc_0", "acc_2"), 1e9)
    assert allreduce > 0
    assert b.iteration_seconds == pytest.approx(a.iteration_seconds + allreduce)
    # Both replicas all-reduce together, once the later one reaches its STEP.
    events = sorted((e for e in b.events if e.kind == "ALLREDUCE"), key=lambda e: e.replica)
    steps = sorted((e for e in b.events if e.kind == "STEP" and e.stage == 0), key=lambda e: e.replica)
    last_backward = max(e.end for e in b.events if e.kind == "B" and e.stage == 0)
    assert [(e.stage, e.replica) for e in events] == [(0, 0), (0, 1)]
    assert all(e.start == pytest.approx(last_backward) and e.end == pytest.approx(st.start) for e, st in zip(events, steps))


def test_replicas_run_whole_microbatches_round_robin() -> None:
    # A replicated stage's plan times are per-micro-batch shares (busy / r): 0.5 s + 1 s on 2 replicas
    # is 1 s + 2 s per whole micro-batch on one replica, as the executor runs them.
    target = make_target(3)
    sim = simulate(make_plan(1, 4, forward=0.5, backward=1.0, devices=(("acc_0", "acc_1"),)), target)
    forwards = sorted((e.replica, e.microbatch, e.end - e.start) for e in sim.events if e.kind == "F")
    assert forwards == [(0, 0, 1.0), (0, 2, 1.0), (1, 1, 1.0), (1, 3, 1.0)]
    # Throughput is what divides: the steady state per micro-batch is the plan's busy time.
    assert sim.iteration_seconds == pytest.approx(4 * 1.5)
    assert sim.replica_busy_seconds == ((6.0, 6.0),) and sim.bubble_fraction == pytest.approx(0.0)
    assert [r["replica"] for r in sim.to_json()["stages"][0]["replicas"]] == [0, 1]
    # Micro-batches that do not divide evenly: replica 0 runs two whole ones, replica 1 one.
    odd = simulate(make_plan(1, 3, forward=0.5, backward=1.0, devices=(("acc_0", "acc_1"),)), target)
    assert odd.iteration_seconds == pytest.approx(2 * 3.0) and odd.replica_busy_seconds == ((6.0, 3.0),)
    # Hybrid: a replicated first stage sends each micro-batch from the replica that ran it.
    sim = simulate(make_plan(2, 4, comm_bytes=1e6, devices=(("acc_0", "acc_2"), ("acc_1",))), target)
    sends = {(e.microbatch, e.replica) for e in sim.events if e.kind == "SEND" and e.stage == 0}
    assert sends == {(i, i % 2) for i in range(4)}
    assert len(sim.replica_peak_memory_bytes[0]) == 2 and sim.peak_memory_bytes[0] == max(sim.replica_peak_memory_bytes[0])


def test_one_f_one_b_holds_less_activation_memory_than_gpipe() -> None:
    k, m = 4, 8
    target = make_target(k)
    # Stash per micro-batch is the same; each plan's peak follows its own schedule.
    gpipe, one = simulate(make_plan(k, m, schedule="gpipe"), target), simulate(make_plan(k, m, schedule="1f1b"), target)
    assert gpipe.peak_memory_bytes == pytest.approx([m * 100.0] * k)
    assert one.peak_memory_bytes == pytest.approx([(k - s) * 100.0 for s in range(k)])
    # The override re-derives in-flight memory from the new table.
    switched = simulate(make_plan(k, m, schedule="gpipe"), target, schedule="1f1b")
    assert switched.peak_memory_bytes == pytest.approx(one.peak_memory_bytes)


def test_recompute_lowers_memory_and_costs_time() -> None:
    k, m = 2, 4
    target = make_target(k)
    base = make_plan(k, m, schedule="gpipe", stash=1000.0, comm_bytes=10.0)
    table = sched.build("gpipe", k, m)
    stages = tuple(
        replace(
            s,
            recompute=True,
            backward_seconds=s.backward_seconds + s.forward_seconds,
            memory=replace(s.memory, activations=sched.in_flight(table[s.index]) * 10.0 + 1000.0),
        )
        for s in base.stages
    )
    recomputed = replace(base, stages=stages)
    a, b = simulate(base, target), simulate(recomputed, target)
    assert all(x < y for x, y in zip(b.peak_memory_bytes, a.peak_memory_bytes))
    assert b.iteration_seconds == pytest.approx(a.iteration_seconds + (m + k - 1) * 1.0)


def test_memory_timeline_returns_to_static_bytes() -> None:
    sim = simulate(make_plan(3, 4, params=50.0), make_target(3))
    for s, samples in enumerate(sim.memory):
        assert samples[0][0] == 0.0 and min(b for _, b in samples) == pytest.approx(200.0)
        assert samples[-1][1] == pytest.approx(200.0)
        assert sim.peak_memory_bytes[s] == pytest.approx(200.0 + (3 - s) * 100.0)


def test_json_has_the_figures_train_reports() -> None:
    data = json.loads(json.dumps(simulate(make_plan(2, 2), make_target(2)).to_json()))
    for key in ("iteration_seconds", "samples_per_s", "bubble_fraction", "schedule", "microbatches", "batch"):
        assert key in data
    assert [(s["stage"], s["busy_seconds"], s["peak_memory_bytes"]) for s in data["stages"]] == [(0, 6.0, 200.0), (1, 6.0, 100.0)]
    assert ["F", "B", "SEND", "RECV", "STEP"] == sorted({e[1] for e in data["events"]}, key=["F", "B", "SEND", "RECV", "STEP"].index)


def test_unknown_device_is_a_clear_error() -> None:
    with pytest.raises(OnnxpipeError, match="does not have"):
        simulate(make_plan(3, 2), make_target(2))


def test_shm_sender_waits_for_its_copy() -> None:
    target = make_target(2, bandwidth=1e9)
    target = replace(target, links=(replace(target.links[0], topology="shm"),))
    sim = simulate(make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0, comm_bytes=2e9), target)
    forwards = [e for e in sim.events if e.stage == 0 and e.kind == "F"]
    # Stage 0 copies mb0 for 2 s before it may start mb1.
    assert forwards[1].start == pytest.approx(3.0)


def fpga_plan(k: int = 2, m: int = 4) -> Plan:
    plan = make_plan(k, m, params=1e6, devices=tuple((f"u280_{i}",) for i in range(k)))
    return replace(plan, target="fpga4")


def test_report_embeds_figures(tmp_path) -> None:
    from onnx import TensorProto, helper

    from onnxpipe import report
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])
    w = helper.make_tensor("w", TensorProto.FLOAT, [8, 8], [0.1] * 64)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm0"), helper.make_node("Relu", ["h"], ["y"], name="relu")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [y], [w]), opset_imports=[helper.make_opsetid("", 17)])
    graph = load(model)
    plan = fpga_plan()
    plan = replace(plan, stages=(replace(plan.stages[0], nodes=("mm0",)), replace(plan.stages[1], nodes=("relu",))))
    sim = simulate(plan, plan_target(plan))
    written = report.write(tmp_path / "r.html", plan, sim, graph=graph, costs=annotate(graph), measured=sim.events)
    assert sorted(p.name for p in written) == ["r.html", "r_gantt.png", "r_memory.png", "r_model.png"]
    page = (tmp_path / "r.html").read_text()
    assert page.count("data:image/png;base64,") == 3
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in written if p.suffix == ".png")
    assert not list(tmp_path.glob("*.tmp"))


def _cli(*args: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "onnxpipe", *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_cli_simulate_and_report(tmp_path) -> None:
    plan = fpga_plan(2, 4)
    (tmp_path / "stages").mkdir()
    plan.save(tmp_path / "stages" / "plan.json")
    run = _cli("simulate", "stages", "--schedule", "gpipe", "--json", "sim.json", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "0F0 0F1 0F2 0F3 0B0 0B1 0B2 0B3 0STEP" in run.stdout
    data = json.loads((tmp_path / "sim.json").read_text())
    expected = simulate(plan, plan_target(plan), schedule="gpipe")
    assert data["iteration_seconds"] == pytest.approx(expected.iteration_seconds)
    run = _cli("report", "stages/plan.json", "-o", "out.html", cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    assert "data:image/png;base64," in (tmp_path / "out.html").read_text()
    assert (tmp_path / "out_gantt.png").is_file() and (tmp_path / "out_memory.png").is_file()
    bad = _cli("simulate", "missing.json", cwd=tmp_path)
    assert bad.returncode == 2 and "no such plan file" in bad.stderr


def test_action_overhead_per_forward_and_backward_and_step_overhead_per_iteration() -> None:
    # 2 stages, 1 micro-batch, 1 GB hops of 1.5 s: F0, hop, F1, B1, hop, B0, each compute action 0.25 s longer.
    target = make_target(2, bandwidth=1e9, latency=0.5)
    target = replace(target, devices=tuple(replace(d, action_overhead=0.25) for d in target.devices))
    sim = simulate(make_plan(2, 1, forward=1.0, backward=1.0, comm_bytes=1e9), target)
    assert sim.iteration_seconds == pytest.approx(7.0 + 4 * 0.25)
    assert sorted(e.end - e.start for e in sim.events if e.kind in ("F", "B")) == pytest.approx([1.25] * 4)
    # Per action, not per second of work: halving the micro-batch size halves the compute, not the overhead.
    sim = simulate(make_plan(2, 2, schedule="gpipe", forward=1.0, backward=1.0), target, microbatches=4)
    assert {round(e.end - e.start, 9) for e in sim.events if e.kind in ("F", "B")} == {0.75}
    # The step overhead comes once per iteration, after the last STEP.
    target = replace(target, devices=tuple(replace(d, step_overhead=0.5) for d in target.devices))
    sim = simulate(make_plan(2, 1, forward=1.0, backward=1.0, comm_bytes=1e9), target)
    assert sim.iteration_seconds == pytest.approx(7.0 + 4 * 0.25 + 0.5)
    assert max(e.end for e in sim.events) == pytest.approx(7.0 + 4 * 0.25)


def test_cpu_stages_share_the_targets_cores() -> None:
    # GPipe, 2 stages, 2 micro-batches, F 1 s, no backward, one core: at 1 s stage 0's F1 takes the core
    # and stage 1, woken by F0's arrival, waits for it until 2 s (a core is assigned, not time-shared).
    base = make_target(2)
    cpus = on_cpus(base, cores=1)
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0)
    sim = simulate(plan, cpus)
    assert sim.iteration_seconds == pytest.approx(4.0)
    forwards = sorted((e.stage, e.microbatch, e.start, e.end) for e in sim.events if e.kind == "F")
    assert forwards == [(0, 0, 0.0, 1.0), (0, 1, 1.0, 2.0), (1, 0, 2.0, 3.0), (1, 1, 3.0, 4.0)]
    # Two cores for two workers, or devices that do not share: no slowdown.
    assert simulate(plan, host(cpus, cores=2)).iteration_seconds == pytest.approx(3.0)
    assert simulate(plan, host(base, cores=1)).iteration_seconds == pytest.approx(3.0)
    # One background process on two cores leaves one: a lone worker runs at full speed, two at half.
    sim = simulate(plan, host(cpus, cores=2), background=1.0)
    assert sim.iteration_seconds == pytest.approx(1.0 + 2.0 + 1.0)
    # Three on two cores leave the workers half a core together: every forward at half speed or less.
    sim = simulate(plan, host(cpus, cores=2), background=3.0)
    assert sim.iteration_seconds == pytest.approx(2.0 + 4.0 + 2.0)


def test_measured_events_name_their_replica() -> None:
    # Workers are stage-major: stage 0 on two replicas, then stage 1.
    timings = [[("F", 0, 1.0, 2.0)], [("F", 1, 1.0, 2.0)], [("B", 0, 3.0, 4.0)]]
    events = step_events(1.0, timings, [0, 0, 1])
    assert [(e.stage, e.replica, e.kind, e.start) for e in events] == [(0, 0, "F", 0.0), (0, 1, "F", 0.0), (1, 0, "B", 2.0)]


def test_gantt_draws_one_lane_per_replica() -> None:
    from matplotlib.colors import to_rgb

    from onnxpipe.report import COLORS, gantt_figure

    plan = make_plan(2, 4, devices=(("acc_0", "acc_2"), ("acc_1",)))
    fig = gantt_figure(simulate(plan, make_target(3)), plan)
    ax = fig.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["stage 1\nacc_1", "stage 0 replica 1\nacc_2", "stage 0 replica 0\nacc_0"]
    # Compute bars (not the idle background, not the thin transfer lanes) never overlap within a lane.
    bars: dict[float, list[tuple[float, float]]] = {}
    for c in ax.collections:
        (x0, y0), (x1, y1) = c.get_paths()[0].get_extents().get_points()
        if y1 - y0 > 0.5 and tuple(c.get_facecolor()[0][:3]) != to_rgb(COLORS["idle"]):
            bars.setdefault(round(y0, 3), []).append((x0, x1))
    assert len(bars) == 3
    for spans in bars.values():
        spans.sort()
        assert all(a[1] <= b[0] + 1e-9 for a, b in zip(spans, spans[1:]))


def test_tied_weights_make_their_holders_wait_for_each_other_at_step() -> None:
    # Stage 0 and stage 1 hold copies of one weight: stage 1's STEP waits for stage 0's last backward,
    # then both exchange its gradient.
    target = make_target(2, bandwidth=1e9)
    plan = make_plan(2, 2)
    tied = replace(plan, stages=(replace(plan.stages[0], tied=(1,), tied_bytes=1e9), replace(plan.stages[1], tied=(0,), tied_bytes=1e9)))
    a, b = simulate(plan, target), simulate(tied, target)
    exchange = allreduce_seconds(target, ("acc_0", "acc_1"), 1e9)
    last_backward = max(e.end for e in b.events if e.kind == "B" and e.stage == 0)
    steps = {e.stage: e for e in b.events if e.kind == "STEP"}
    assert steps[0].start == steps[1].start == pytest.approx(last_backward + exchange)
    assert b.iteration_seconds == pytest.approx(a.iteration_seconds + exchange)
    assert min(e.start for e in a.events if e.kind == "STEP") < last_backward  # untied, stage 1 steps early


def test_a_worker_keeps_its_core_until_it_blocks() -> None:
    # One core, shm link copying 1 GB at 1 GB/s: stage 0 holds the core through F0, its copy, F1 and
    # its copy (the copies are its own work), and releases it at 4 s when it waits for a gradient; only
    # then can stage 1, woken at 2 s by mb 0's arrival, run its forward.
    base = make_target(2, bandwidth=1e9)
    cpus = on_cpus(base, cores=1,
                   links=(replace(base.links[0], topology="shm"),))
    sim = simulate(make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0, comm_bytes=1e9), cpus)
    forwards = sorted((e.stage, e.microbatch, e.start) for e in sim.events if e.kind == "F")
    assert forwards == [(0, 0, 0.0), (0, 1, 2.0), (1, 0, 4.0), (1, 1, 5.0)]


def test_workers_waiting_for_a_core_take_turns_each_time_slice() -> None:
    # One stage on three replicas (one micro-batch each, F 3 s of work, no backward), slice 1 s. One core:
    # round robin 0, 1, 2, 0, 1, 2, 0; a replica blocks at STEP once its F ends, passing the core on.
    # Each F event spans its wall time from when it first ran, the waits between its slices included.
    base = make_target(3)
    cpus = on_cpus(base, cores=1, time_slice=1.0)
    plan = make_plan(1, 3, schedule="gpipe", forward=1.0, backward=0.0, devices=(("acc_0", "acc_1", "acc_2"),))

    assert forwards(plan, cpus) == [(0, 0.0, 7.0), (1, 1.0, 8.0), (2, 2.0, 9.0)]
    sim = simulate(plan, cpus)
    assert sim.iteration_seconds == pytest.approx(9.0)
    assert sim.replica_busy_seconds == (pytest.approx((7.0, 7.0, 7.0)),)
    # Two cores: 0 and 1 run; at 1 s replica 0 (first to get its core) yields to 2; at 2 s 1 yields to 0,
    # at 3 s 2 yields to 1; 0 and 1 finish at 4 s and 2 ends its last second alone: 5 s instead of 6 s.
    assert forwards(plan, host(cpus, cores=2)) == [(0, 0.0, 4.0), (1, 0.0, 4.0), (2, 1.0, 5.0)]
    assert simulate(plan, host(cpus, cores=2)).iteration_seconds == pytest.approx(5.0)
    # No slice (a target without the field), or one longer than the actions: each holds its core until it blocks.
    for target in (host(cpus, time_slice=0.0), host(cpus, time_slice=10.0)):
        assert forwards(plan, target) == [(0, 0.0, 3.0), (1, 3.0, 6.0), (2, 6.0, 9.0)]
        assert forwards(plan, host(target, cores=2)) == [(0, 0.0, 3.0), (1, 0.0, 3.0), (2, 3.0, 6.0)]


def test_a_slice_ending_with_nobody_waiting_starts_the_next() -> None:
    # One core, slice 1 s: stage 0's F0 and F1 (1.5 s each) run alone; stage 1, woken by F0's arrival at
    # 1.5 s, waits for the end of stage 0's second slice (2 s), then they alternate: F1 of stage 0 ends
    # at 4 s (0.5 s done before 2 s, 1 s in 3-4 s), stage 1's F0 at 4.5 s (1 s in 2-3 s, 0.5 s after 4 s).
    base = make_target(2)
    cpus = on_cpus(base, cores=1, time_slice=1.0)
    sim = simulate(make_plan(2, 2, schedule="gpipe", forward=1.5, backward=0.0), cpus)
    forwards = sorted((e.stage, e.microbatch, round(e.start, 9), round(e.end, 9)) for e in sim.events if e.kind == "F")
    assert forwards == [(0, 0, 0.0, 1.5), (0, 1, 1.5, 4.0), (1, 0, 2.0, 4.5), (1, 1, 4.5, 6.0)]


def test_workers_computing_together_slow_by_their_stages_corun_slowdown() -> None:
    # GPipe, 2 stages, 2 micro-batches, F 1 s, two cores: stage 0's F1 and stage 1's F0 overlap from 1 s.
    base = make_target(2)
    cpus = on_cpus(base, cores=2)
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0)

    def slowed(first: float, second: float) -> Plan:
        return replace(plan, stages=(replace(plan.stages[0], corun_slowdown=first), replace(plan.stages[1], corun_slowdown=second)))

    assert simulate(plan, cpus).iteration_seconds == pytest.approx(3.0)
    # Both 50% slower while both compute: the overlapped pair ends at 1 + 1.5 s, then stage 1's F1 alone.
    sim = simulate(slowed(0.5, 0.5), cpus)
    forwards = sorted((e.stage, e.microbatch, round(e.start, 9), round(e.end, 9)) for e in sim.events if e.kind == "F")
    assert forwards == [(0, 0, 0.0, 1.0), (0, 1, 1.0, 2.5), (1, 0, 1.0, 2.5), (1, 1, 2.5, 3.5)]
    assert sim.iteration_seconds == pytest.approx(3.5)
    # Only stage 1 slowed: by 2 s it has done 2/3 of F0; the last third runs alone at full speed.
    assert simulate(slowed(0.0, 0.5), cpus).iteration_seconds == pytest.approx(2.0 + 1 / 3 + 1.0)
    # Working sets (100 bytes of stash each) that fit the shared cache together: no slowdown.
    assert simulate(slowed(0.5, 0.5), host(cpus, shared_cache=200.0)).iteration_seconds == pytest.approx(3.0)
    assert simulate(slowed(0.5, 0.5), host(cpus, shared_cache=199.0)).iteration_seconds == pytest.approx(3.5)
    # Devices that do not share cores, or a lone worker: nothing to compete with.
    assert simulate(slowed(0.5, 0.5), base).iteration_seconds == pytest.approx(3.0)
    one = make_plan(1, 4, forward=1.0, backward=2.0)
    one = replace(one, stages=(replace(one.stages[0], corun_slowdown=0.5),))
    assert simulate(one, replace(cpus, devices=cpus.devices[:1])).iteration_seconds == pytest.approx(12.0)


def test_backward_hands_its_gradients_over_at_the_gradient_bandwidth() -> None:
    # One stage, 1 GB of weights, 1 GB/s: each backward takes 2 s + 1 s; the forward is unchanged.
    base = make_target(1)
    plan = make_plan(1, 2, forward=1.0, backward=2.0, params=1e9)
    slow = replace(base, devices=(replace(base.devices[0], gradient_bandwidth=1e9),))
    assert simulate(plan, base).iteration_seconds == pytest.approx(6.0)
    sim = simulate(plan, slow)
    assert sim.iteration_seconds == pytest.approx(8.0)
    assert sorted(round(e.end - e.start, 9) for e in sim.events if e.kind in ("F", "B")) == [1.0, 1.0, 3.0, 3.0]


def test_a_worker_taking_a_core_another_held_last_pays_the_switch_cost() -> None:
    # One stage on three replicas (one micro-batch each, F 3 s), switch cost 0.5 s, one core: replica 0
    # takes the fresh core (no cost), 1 and 2 each take it after another held it: 3 + 3.5 + 3.5 s.
    base = make_target(3)
    cpus = on_cpus(base, cores=1, switch_cost=0.5)
    plan = make_plan(1, 3, schedule="gpipe", forward=1.0, backward=0.0, devices=(("acc_0", "acc_1", "acc_2"),))

    assert forwards(plan, cpus) == [(0, 0.0, 3.0), (1, 3.0, 6.5), (2, 6.5, 10.0)]
    assert simulate(plan, cpus).iteration_seconds == pytest.approx(10.0)
    # Two cores: 0 and 1 take one fresh core each; 2 takes replica 0's at 3 s and pays once.
    assert forwards(plan, host(cpus, cores=2)) == [(0, 0.0, 3.0), (1, 0.0, 3.0), (2, 3.0, 6.5)]
    # Without the field: today's timeline.
    assert forwards(plan, host(cpus, switch_cost=0.0)) == [(0, 0.0, 3.0), (1, 3.0, 6.0), (2, 6.0, 9.0)]
    # Slices of 1 s on one core: every turn after the very first is a switch (0.5 s more work), so each later
    # turn advances its action by 0.5 s net. Replica 0: 1 s, then turns at 3, 6, 9, 12 s leave 1.5, 1, 0.5, 0 s:
    # done at 13 s; 1 and 2 (3.5 s from their first turns) finish alternating alone at 16 and 17 s.
    sliced = simulate(plan, host(cpus, time_slice=1.0)).events
    assert sorted((e.replica, round(e.start, 9), round(e.end, 9)) for e in sliced if e.kind == "F") == [(0, 0.0, 13.0), (1, 1.0, 16.0), (2, 2.0, 17.0)]


def test_workers_that_keep_their_own_cores_pay_no_switch_cost() -> None:
    # GPipe, 2 stages on 2 cores: each worker gets back the core it held last, so the timeline is unchanged.
    base = make_target(2)
    cpus = on_cpus(base, cores=2)
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=1.0)
    same = simulate(plan, cpus)
    switching = simulate(plan, host(cpus, switch_cost=0.5))
    assert switching.iteration_seconds == pytest.approx(same.iteration_seconds)
    assert [t for e in switching.events for t in (e.start, e.end)] == pytest.approx([t for e in same.events for t in (e.start, e.end)])
    # On one core they swap it twice: stage 1 takes it at 2 s (F0 1.5 s), keeps it through its last backward,
    # then stage 0 takes it back (B0 1.5 s): 8 s + 2 x 0.5 s.
    one = simulate(plan, host(cpus, cores=1, switch_cost=0.5))
    timeline = sorted((e.stage, e.kind, e.microbatch, e.start, e.end) for e in one.events if e.kind in ("F", "B"))
    assert timeline == [(0, "B", 0, 6.5, 8.0), (0, "B", 1, 8.0, 9.0), (0, "F", 0, 0.0, 1.0), (0, "F", 1, 1.0, 2.0),
                        (1, "B", 0, 4.5, 5.5), (1, "B", 1, 5.5, 6.5), (1, "F", 0, 2.0, 3.5), (1, "F", 1, 3.5, 4.5)]
    assert one.iteration_seconds == pytest.approx(9.0)


def test_a_worker_woken_while_every_core_is_busy_takes_its_wakers_core() -> None:
    # One core, gpipe, 2 stages, 2 micro-batches, F 1 s: stage 0 holds the core through F0 and F1 (1-2 s).
    # With wake_affine, stage 1, woken by mb 0 at 1 s, takes the core at once: its F0 runs 1-2 s and stage 0's
    # F1, put back first in the core's queue, resumes when stage 1 blocks (2-3 s; its event spans 1-3 s).
    base = make_target(2)
    cpus = on_cpus(base, cores=1)
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0)

    def timeline(target: Target) -> list[tuple[int, int, float, float]]:
        return sorted((e.stage, e.microbatch, round(e.start, 9), round(e.end, 9)) for e in simulate(plan, target).events if e.kind == "F")

    assert timeline(cpus) == [(0, 0, 0.0, 1.0), (0, 1, 1.0, 2.0), (1, 0, 2.0, 3.0), (1, 1, 3.0, 4.0)]
    assert timeline(host(cpus, wake_affine=True)) == [(0, 0, 0.0, 1.0), (0, 1, 1.0, 3.0), (1, 0, 1.0, 2.0), (1, 1, 3.0, 4.0)]
    # A core for each worker: nobody waits, so the placement changes nothing.
    assert timeline(host(cpus, cores=2, wake_affine=True)) == timeline(host(cpus, cores=2))


def test_an_idle_core_pulls_a_worker_waiting_on_another() -> None:
    # Two cores, gpipe, 3 stages, 3 micro-batches, F 1 s on stage 0, 1.5 s on stage 1, 1 s on stage 2. Stage 0
    # holds core 0 from 0 s; stage 1 takes core 1 at 1 s. At 2.5 s stage 1 sends mb 0 and starts F1; stage 2,
    # woken, takes its waker's core 1 (wake_affine) and stage 1 waits in that core's queue. At 3 s stage 0 has
    # sent its three forwards and blocks: idle core 0 pulls stage 1, whose F1 ends at 3 + 1.5 s. Without
    # wake_affine stage 2 waits for the first core released instead (core 0 at 3 s).
    base = make_target(3)
    cpus = on_cpus(base, cores=2)
    plan = make_plan(3, 3, schedule="gpipe", forward=1.0, backward=0.0)
    plan = replace(plan, stages=tuple(replace(s, forward_seconds=f) for s, f in zip(plan.stages, (1.0, 1.5, 1.0))))

    def firsts(target: Target) -> list[tuple[int, int, float, float]]:
        return sorted((e.stage, e.microbatch, round(e.start, 9), round(e.end, 9)) for e in simulate(plan, target).events
                      if e.kind == "F" and (e.stage, e.microbatch) in ((1, 1), (2, 0)))

    assert firsts(host(cpus, wake_affine=True)) == [(1, 1, 2.5, 4.5), (2, 0, 2.5, 3.5)]
    assert firsts(cpus) == [(1, 1, 2.5, 4.0), (2, 0, 3.0, 4.0)]


def test_a_switch_refills_the_working_set_when_the_working_sets_overflow_the_shared_cache() -> None:
    # One stage on three replicas (one micro-batch each, F 3 s, 100 bytes of stash: the stage's 3 in flight
    # hold 100 bytes, one on each replica), one core, switch_cost 0.5 s: each later replica takes the core
    # another held last. Working sets of 3 x 100 bytes overflow a 250-byte shared cache: each switch-in reads
    # its 100 bytes back at 100 B/s (1 s, spread over its 3 s action) in place of switch_cost.
    base = make_target(3)
    cpus = on_cpus(base, cores=1, switch_cost=0.5, switch_bandwidth=100.0)
    plan = make_plan(1, 3, schedule="gpipe", forward=1.0, backward=0.0, stash=100.0 / 3, devices=(("acc_0", "acc_1", "acc_2"),))

    assert forwards(plan, host(cpus, shared_cache=250.0)) == [(0, 0.0, 3.0), (1, 3.0, 7.0), (2, 7.0, 11.0)]
    # Fitting the shared cache together: the measured switch_cost alone.
    assert forwards(plan, host(cpus, shared_cache=300.0)) == [(0, 0.0, 3.0), (1, 3.0, 6.5), (2, 6.5, 10.0)]
    # A larger working set takes longer to read back: 200 bytes of stash, 2 s per switch-in.
    bigger = make_plan(1, 3, schedule="gpipe", forward=1.0, backward=0.0, stash=200.0 / 3, devices=(("acc_0", "acc_1", "acc_2"),))
    assert forwards(bigger, host(cpus, shared_cache=250.0)) == [(0, 0.0, 3.0), (1, 3.0, 8.0), (2, 8.0, 13.0)]
    # As many cores as workers: each keeps its own, nothing to refill.
    assert forwards(plan, host(cpus, cores=3, shared_cache=250.0)) == [(0, 0.0, 3.0), (1, 0.0, 3.0), (2, 0.0, 3.0)]


def test_a_worker_switched_in_mid_action_reads_back_what_the_rest_of_it_touches() -> None:
    # One stage on two replicas (F 2 s, 100 bytes of working set each), one core, 1 s slices: working sets of
    # 2 x 100 bytes overflow a 150-byte shared cache, and refilling one takes 1 s at 100 B/s. A worker switched
    # in runs the rest of its action 1 + 1 s / 2 s times slower (the refill spread over the action), however
    # often it is switched in: replica 0 runs 0-1 s warm (1 s left), replica 1 1-2 s (4/3 s left), replica 0
    # 2-3 s (1/3 s left), replica 1 3-4 s (2/3 s left), replica 0 ends at 4.5 s, replica 1 at 5.5 s.
    base = make_target(2)
    cpus = on_cpus(base, cores=1, switch_cost=0.5, switch_bandwidth=100.0, time_slice=1.0)
    plan = make_plan(1, 2, schedule="gpipe", forward=1.0, backward=0.0, stash=100.0 / 2, devices=(("acc_0", "acc_1"),))

    assert forwards(plan, host(cpus, shared_cache=150.0)) == [(0, 0.0, 4.5), (1, 1.0, 5.5)]
    # Fitting together: each of the 4 switch-ins pays switch_cost, ends at 5 s and 6.5 s.
    assert forwards(plan, host(cpus, shared_cache=200.0)) == [(0, 0.0, 5.0), (1, 1.0, 6.5)]


def test_shm_workers_spend_their_measured_cpu_per_message() -> None:
    # Two cpu stages, gpipe, F 1 s, no backward, 1 GB per hop over an shm link (1 GB/s, latency 0.25 s).
    # Sender CPU 0.5 s + 1 GB / 1 GB/s = 1.5 s, receiver CPU 0.5 s. Two cores: stage 0 runs F0 0-1, sends
    # 1-2.5 (it does not wait for the arrival), F1 2.5-3.5, sends 3.5-5; mb 0 arrives at 2.75, stage 1
    # receives it 2.75-3.25 and only then runs F 3.25-4.25; mb 1 arrives at 5.25, received 5.25-5.75.
    base = make_target(2, bandwidth=1e9, latency=0.25)
    shm = replace(base.links[0], topology="shm")
    cpus = on_cpus(base, cores=2, links=(shm,))
    priced = host(cpus, messages={shm.between: MessageCpu(send_overhead=0.5, send_bandwidth=1e9, recv_overhead=0.5)})
    plan = make_plan(2, 2, schedule="gpipe", forward=1.0, backward=0.0, comm_bytes=1e9)

    def timeline(target: Target, kind: str) -> list[tuple[int, int, float, float]]:
        return sorted((e.stage, e.microbatch, round(e.start, 9), round(e.end, 9)) for e in simulate(plan, target).events if e.kind == kind)

    assert timeline(priced, "F") == [(0, 0, 0.0, 1.0), (0, 1, 2.5, 3.5), (1, 0, 3.25, 4.25), (1, 1, 5.75, 6.75)]
    # The RECV event spans from its SEND's start to the end of the receiver's CPU.
    assert [r for r in timeline(priced, "RECV") if r[0] == 1] == [(1, 0, 1.0, 3.25), (1, 1, 3.5, 5.75)]
    # One core: stage 0 keeps it through both forwards and sends (0-5), stage 1 then receives mb 0 5-5.5,
    # runs F 5.5-6.5, receives mb 1 (arrived at 5.25) 6.5-7 and runs F 7-8.
    assert timeline(host(priced, cores=1), "F") == [(0, 0, 0.0, 1.0), (0, 1, 2.5, 3.5), (1, 0, 5.5, 6.5), (1, 1, 7.0, 8.0)]
    # Without the fields: the sender waits for its copy at the bandwidth plus the latency, the receiver goes on at once.
    assert timeline(cpus, "F") == [(0, 0, 0.0, 1.0), (0, 1, 2.25, 3.25), (1, 0, 2.25, 3.25), (1, 1, 4.5, 5.5)]
