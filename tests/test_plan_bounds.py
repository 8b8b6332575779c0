"""The chain lower bound: its clean gaps, never above brute force (heterogeneous and replicated), and
tighter than the work and node bounds where stages must be contiguous on one group or pay all-reduce."""

from __future__ import annotations

import gc
import itertools
import weakref

import numpy as np
import onnx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper
from test_plan import chain_model
from test_properties import RandomModel, random_models

from onnxpipe.cost import Costs, NodeCost, annotate
from onnxpipe.graph import load
from onnxpipe.models import build
from onnxpipe.plan import Assignment, build_problem, evaluate, fits, lower_bound, plan
from onnxpipe.plan import bounds as bounds_module
from onnxpipe.plan import chainbound
from onnxpipe.plan.bounds import Bounds
from onnxpipe.plan.chainbound import chain_bound, segments
from onnxpipe.plan.deadline import Deadline
from onnxpipe.plan.solve import solve
from onnxpipe.target import Device, Link, Target, load_target


def two_branch_model() -> onnx.ModelProto:
    """a -> (b | c) -> d -> e, and a late label node l (reads only input y) joined at the end by z."""
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="a"),
        helper.make_node("Relu", ["a"], ["b"], name="b"),
        helper.make_node("Relu", ["a"], ["c"], name="c"),
        helper.make_node("Add", ["b", "c"], ["d"], name="d"),
        helper.make_node("Relu", ["d"], ["e"], name="e"),
        helper.make_node("Relu", ["y"], ["l"], name="l"),
        helper.make_node("Add", ["e", "l"], ["z"], name="z"),
    ]
    io = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [2, 4]) for t in ("x", "y", "z")]
    graph = helper.make_graph(nodes, "branches", io[:2], io[2:])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_clean_gaps_of_a_hand_made_graph() -> None:
    graph = load(two_branch_model())
    problem = build_problem(graph, mixed_costs(graph, [1e6] * 7), mixed_target(2), batch=2, microbatches=1)
    of = dict(zip(problem.nodes, segments(problem).of.tolist()))
    # l reads only a model input: kept, it would leave one clean gap (before z); dropped, five segments.
    assert of == {"a": 0, "b": 1, "c": 1, "d": 2, "e": 3, "l": -1, "z": 4}
    assert segments(problem).count == 5


def mixed_costs(graph, flops: list[float], params: list[float] | None = None,  # type: ignore[no-untyped-def]
                activations: list[float] | None = None) -> Costs:
    """Matmuls where flops are large, cheap elementwise ops elsewhere."""
    params = params or [0.0] * len(flops)
    activations = activations or [1e3] * len(flops)
    return Costs(
        nodes={
            n: NodeCost(op_type="MatMul" if f > 1e7 else "Relu", op_class="matmul" if f > 1e7 else "default", flops=f,
                        bytes_read=0.0, bytes_written=0.0, param_bytes=p, activation_bytes=a, backward_flops=2 * f,
                        backward_bytes=0.0)
            for n, f, p, a in zip(graph.compute_nodes, flops, params, activations)
        },
        unknown_ops=(),
        profiled=False,
    )


#: Per group: peak FLOP/s and per-op overhead.
FAST_SLOW = {"gpu": (1e13, 2e-4), "fpga": (1e12, 1e-6)}
NEAR_TWINS = {"gpu": (1e12, 1e-6), "fpga": (7e11, 1e-6)}


def mixed_target(count: int, latency: float = 1e-5, bandwidth: float = 1e9, spec: dict[str, tuple[float, float]] = FAST_SLOW,
                 memory: dict[str, float] | None = None) -> Target:
    """Default: a fast device with a large per-op overhead ("gpu") and a slow one with a small one ("fpga"), each
    holding `memory[group]` bytes (default 1e12)."""
    devices = tuple(
        Device(name=f"{g}{i}", group=g, kind="gpu", peak_flops={"float32": peak}, memory_bytes=(memory or {}).get(g, 1e12),
               memory_bandwidth=1e12, efficiency={"default": 1.0}, op_overhead=overhead)
        for g, (peak, overhead) in spec.items() for i in range(count)
    )
    links = tuple(Link(between=(a, b), bandwidth=bandwidth, latency=latency, topology="switch")
                  for a, b in itertools.combinations_with_replacement(spec, 2))
    return Target(name="mixed", description="", devices=devices, links=links, profile=False, source="<test>")


def one_group_target(count: int, latency: float, bandwidth: float) -> Target:
    devices = tuple(
        Device(name=f"a{i}", group="a", kind="gpu", peak_flops={"float32": 1e12}, memory_bytes=1e12, memory_bandwidth=1e12,
               efficiency={"default": 1.0}, op_overhead=1e-6)
        for i in range(count)
    )
    link = Link(between=("a", "a"), bandwidth=bandwidth, latency=latency, topology="switch")
    return Target(name="one", description="", devices=devices, links=(link,), profile=False, source="<test>")


def optimum(problem, stages: int, mixed: bool = False, fitting: bool = False) -> float:  # type: ignore[no-untyped-def]
    """Least bottleneck over every forward-flowing assignment and every device count per group and stage
    (one group per stage unless `mixed`): devices of one group are interchangeable, so taking each
    group's first free ones loses nothing. `fitting`: over the plans that fit in memory, each stage with or
    without recompute (inf when none does)."""
    n = problem.n
    edges = [(int(p), int(c)) for p, cs in zip(problem.tensor_producer, problem.tensor_consumers) if p >= 0 for c in cs]
    counts = [len(devs) for devs in problem.group_devices]
    options = [mix for mix in itertools.product(*(range(c + 1) for c in counts)) if any(mix) and (mixed or sum(1 for c in mix if c) == 1)]
    best = np.inf
    for stage_of in itertools.product(range(stages), repeat=n):
        if len(set(stage_of)) < stages or any(stage_of[p] > stage_of[c] for p, c in edges):
            continue
        nodes = tuple(tuple(problem.nodes[i] for i in range(n) if stage_of[i] == s) for s in range(stages))
        for picks in itertools.product(options, repeat=stages):
            if any(sum(mix[g] for mix in picks) > c for g, c in enumerate(counts)):
                continue
            taken = [0] * len(counts)
            devices = []
            for mix in picks:
                devices.append(tuple(d for g, r in enumerate(mix) for d in problem.group_devices[g][taken[g]:taken[g] + r]))
                taken = [t + r for t, r in zip(taken, mix)]
            flags = itertools.product((False, True), repeat=stages) if fitting and problem.training else [(False,) * stages]
            for recompute in flags:
                p = evaluate(problem, Assignment(nodes, tuple(devices), recompute))
                if fits(p) or not fitting:
                    best = min(best, p.bottleneck_seconds)
    return best


def random_dag(data: st.DataObject) -> tuple[int, dict[int, int], list[float], list[float]]:
    n = data.draw(st.integers(3, 5))
    skips = {i: data.draw(st.integers(0, i - 2)) for i in range(2, n) if data.draw(st.booleans())}
    flops = data.draw(st.lists(st.sampled_from([1e5, 1e6, 1e9, 3e9]), min_size=n, max_size=n))
    params = data.draw(st.lists(st.sampled_from([0.0, 1e5, 1e7]), min_size=n, max_size=n))
    return n, skips, flops, params


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.integers(2, 3))
def test_never_above_brute_force_on_heterogeneous_targets(data: st.DataObject, latency: float, stages: int) -> None:
    n, skips, flops, params = random_dag(data)
    graph = load(chain_model(n, skips))
    problem = build_problem(graph, mixed_costs(graph, flops, params), mixed_target(1 if stages == 3 else 2, latency), batch=graph.batch * 2, microbatches=2)
    best = optimum(problem, stages)
    assert chain_bound(problem, stages) <= best * (1 + 1e-9)
    assert lower_bound(problem, stages).seconds <= best * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.integers(1, 2))
def test_never_above_brute_force_with_replicas_over_several_device_types(data: st.DataObject, latency: float, stages: int) -> None:
    """Data parallelism over the whole target, or a baseline's replicas across a group boundary."""
    n, skips, flops, params = random_dag(data)
    graph = load(chain_model(n, skips))
    problem = build_problem(graph, mixed_costs(graph, flops, params), mixed_target(2, latency, spec=NEAR_TWINS), batch=graph.batch * 4, microbatches=4)
    best = optimum(problem, stages, mixed=True)
    assert lower_bound(problem, stages).seconds <= best * (1 + 1e-9)


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.sampled_from([1e7, 1e9]))
def test_never_above_brute_force_with_replicated_stages(data: st.DataObject, latency: float, bandwidth: float) -> None:
    n, skips, flops, params = random_dag(data)
    graph = load(chain_model(n, skips))
    problem = build_problem(graph, mixed_costs(graph, flops, params), one_group_target(4, latency, bandwidth), batch=graph.batch * 2, microbatches=2)
    best = optimum(problem, 2)
    assert chain_bound(problem, 2) <= best * (1 + 1e-9)
    assert chain_bound(problem, 2, replicas=False) <= optimum_unreplicated(problem) * (1 + 1e-9)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.integers(2, 3), st.sampled_from(["training", "inference"]), st.sampled_from([3e7, 6e7, 2e8]))
def test_the_memory_it_charges_never_lifts_it_above_brute_force(data: st.DataObject, stages: int, mode: str, memory: float) -> None:
    """The fast devices hold a node's parameter state or a few (training with Adam: 4 bytes per parameter byte) and
    activations of up to 1e7 bytes; the plans that fit, with or without recompute, are never faster than the bound."""
    n, skips, flops, params = random_dag(data)
    activations = data.draw(st.lists(st.sampled_from([1e3, 1e7]), min_size=n, max_size=n))
    graph = load(chain_model(n, skips))
    target = mixed_target(1 if stages == 3 else 2, memory={"gpu": memory, "fpga": 1e12})
    problem = build_problem(graph, mixed_costs(graph, flops, params, activations), target, batch=graph.batch * 2, microbatches=2, mode=mode)
    best = optimum(problem, stages, fitting=True)
    assert chain_bound(problem, stages) <= best * (1 + 1e-9)
    bound = lower_bound(problem, stages)
    assert bound.seconds <= best * (1 + 1e-9)
    assert bound.fits or best == np.inf  # it says no plan fits only where none does


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_it_charges_what_a_stage_must_hold_where_the_fast_device_is_small(mode: str) -> None:
    # Four equal layers on one fast GPU that holds two layers' parameter state and one slow FPGA that holds them all:
    # without memory the GPU would take three; every plan that fits gives it at most two.
    graph = load(chain_model(4, {}))
    costs = mixed_costs(graph, [3e9] * 4, [1e7] * 4)
    state = 4e7 if mode == "training" else 1e7  # Adam: the parameters, their gradients and two moments
    problem = build_problem(graph, costs, mixed_target(1, memory={"gpu": 2.5 * state, "fpga": 1e12}), batch=graph.batch * 2,
                            microbatches=2, mode=mode)
    best = optimum(problem, 2, fitting=True)
    assert best > optimum(problem, 2) * 1.2
    assert chain_bound(problem, 2) == pytest.approx(best, rel=1e-6)


def optimum_unreplicated(problem) -> float:  # type: ignore[no-untyped-def]
    n = problem.n
    edges = [(int(p), int(c)) for p, cs in zip(problem.tensor_producer, problem.tensor_consumers) if p >= 0 for c in cs]
    best = np.inf
    for stage_of in itertools.product(range(2), repeat=n):
        if len(set(stage_of)) == 2 and all(stage_of[p] <= stage_of[c] for p, c in edges):
            nodes = tuple(tuple(problem.nodes[i] for i in range(n) if stage_of[i] == s) for s in range(2))
            devices = tuple((d,) for d in problem.group_devices[0][:2])
            best = min(best, evaluate(problem, Assignment(nodes, devices, (False, False)), replicas=False).bottleneck_seconds)
    return best


def test_strictly_tighter_where_a_stage_cannot_mix_devices() -> None:
    # The fractional bound gives each matmul to the GPUs and every cheap op to the FPGAs; a contiguous
    # stage on one group cannot: 20 alternating layers on one GPU + one FPGA.
    graph = load(chain_model(40, {}))
    costs = mixed_costs(graph, [3e9 if i % 2 else 1e5 for i in range(40)])
    problem = build_problem(graph, costs, mixed_target(1), batch=graph.batch * 2, microbatches=2)
    bound = lower_bound(problem, 2)
    # the least bottleneck (plan() may trade some for a shorter iteration); bounds without a deadline, as `lower_bound`'s
    p = solve(problem, 2, time_limit=5, bounds=Bounds(problem))
    assert max(bound.work_seconds, bound.node_seconds) * 1.15 < bound.chain_seconds <= p.bottleneck_seconds * (1 + 1e-9)
    assert p.lower_bound_seconds == bound.seconds == bound.chain_seconds
    assert bound.chain_seconds == pytest.approx(p.bottleneck_seconds, rel=0.05)


def test_strictly_tighter_where_replicas_pay_the_all_reduce() -> None:
    graph = load(build("gpt2-tiny"))
    costs, target = annotate(graph), load_target("fpga4")
    p = plan(graph, costs, target, stages=2, time_limit=10)
    problem = build_problem(graph, costs, target, batch=p.batch, microbatches=p.microbatches)
    bound = lower_bound(problem, 2)
    assert any(s.allreduce_seconds > 0 for s in p.stages)
    assert max(bound.work_seconds, bound.node_seconds) * 1.03 < bound.chain_seconds <= p.bottleneck_seconds * (1 + 1e-9)
    # Planning gives the chain bound a share of its time limit: on a loaded machine it may stop there, weaker but valid.
    assert max(bound.work_seconds, bound.node_seconds) <= p.lower_bound_seconds <= bound.seconds


def test_strictly_tighter_where_a_node_cannot_be_split() -> None:
    # Three nodes of 1, 2 and 1 units on two identical devices: the fractional bounds give each stage 2 units,
    # but the middle node goes whole to one stage, so every plan has a stage of 3 units.
    graph = load(chain_model(3, {}))
    costs = mixed_costs(graph, [1e9, 2e9, 1e9])
    problem = build_problem(graph, costs, one_group_target(2, 1e-6, 1e12), batch=graph.batch * 2, microbatches=2)
    bound = lower_bound(problem, 2)
    p = solve(problem, 2, time_limit=5)
    assert max(bound.work_seconds, bound.node_seconds) * 1.4 < bound.chain_seconds <= p.bottleneck_seconds * (1 + 1e-9)
    assert bound.chain_seconds == pytest.approx(p.bottleneck_seconds, rel=0.01)


def test_plans_priced_without_bounds_carry_the_bound_found_once_per_problem(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """`evaluate` given no `Bounds` (a brute force, hand-given cuts, the baselines) bisects each stage count's chain bound
    once per problem, not once per plan, and carries the same bound as `lower_bound`; a deadline's bounds are its own."""
    graph = load(chain_model(6, {}))
    problem = build_problem(graph, mixed_costs(graph, [1e9, 3e9, 1e5, 2e9, 1e9, 3e9]), mixed_target(2), batch=graph.batch * 2, microbatches=2)
    expected = lower_bound(problem, 2).seconds
    asked: list[int] = []
    bisect = bounds_module.chain_bound
    monkeypatch.setattr(bounds_module, "chain_bound", lambda p, k, *a: asked.append(k) or bisect(p, k, *a))
    devices = ((problem.group_devices[0][0],), (problem.group_devices[1][0],))
    for cut in range(1, 6):
        stages = (problem.nodes[:cut], problem.nodes[cut:])
        assert evaluate(problem, Assignment(stages, devices, (False, False))).lower_bound_seconds == expected
    assert asked == [2]
    assert Bounds(problem)(2).seconds == expected and asked == [2]
    other = build_problem(graph, problem.costs, problem.target, batch=graph.batch * 2, microbatches=2)
    Bounds(other)(2)
    Bounds(problem, Deadline(30))(2)
    assert asked == [2, 2, 2]


def test_the_bounds_and_chains_kept_per_problem_go_with_it() -> None:
    """The caches a problem's bounds and chain are kept in hold it weakly: planning many problems (exploring micro-batch
    counts and schedules) does not keep them all alive."""
    graph = load(chain_model(6, {}))
    problem = build_problem(graph, mixed_costs(graph, [1e9, 3e9, 1e5, 2e9, 1e9, 3e9]), mixed_target(2), batch=graph.batch * 2, microbatches=2)
    Bounds(problem)(2)
    kept = weakref.ref(problem)
    assert problem in bounds_module._UNTIMED and problem in chainbound._CHAINS and problem in chainbound._CUTS
    del problem
    gc.collect()
    assert kept() is None


def _proven_least(problem, stages: int) -> float | None:  # type: ignore[no-untyped-def]
    """The least bottleneck of any plan when CP-SAT proves it node by node (nothing coarsened), else None."""
    p = solve(problem, stages, time_limit=20, max_blocks=problem.n)
    return p.bottleneck_seconds if p.solver.status == "OPTIMAL" and p.solver.blocks == problem.n else None


@pytest.mark.parametrize("name", ["resnet-tiny", "inception-tiny", "gpt2-tiny"])
@pytest.mark.parametrize("mode", ["training", "inference"])
def test_never_above_the_proven_optimum_on_the_zoo(name: str, mode: str) -> None:
    graph = load(build(name))
    costs = annotate(graph)
    proven = 0
    for target_name in ("hetero", "fpga4"):
        for k in (2, 3, 4):
            problem = build_problem(graph, costs, load_target(target_name), batch=graph.batch * 2 * k, microbatches=2 * k, mode=mode)
            least = _proven_least(problem, k)
            if least is not None:
                proven += 1
                assert lower_bound(problem, k).seconds <= least * (1 + 1e-9), f"{target_name} k={k}"
    assert proven >= 4  # the check ran on most of them


@settings(max_examples=12, deadline=None)
@given(random_models())
def test_never_above_the_proven_optimum_on_random_dags(case: RandomModel) -> None:
    graph = load(case.model)
    costs = annotate(graph)
    for mode in ("training", "inference"):
        problem = build_problem(graph, costs, load_target("hetero"), batch=graph.batch * 4, microbatches=4, mode=mode)
        least = _proven_least(problem, case.stages)
        if least is not None:
            assert lower_bound(problem, case.stages).seconds <= least * (1 + 1e-9)


def parallel_model(count: int) -> onnx.ModelProto:
    """`count` independent nodes: one segment, no clean gap inside."""
    nodes = [helper.make_node("Relu", [f"x{i}"], [f"y{i}"], name=f"n{i}") for i in range(count)]
    graph = helper.make_graph(nodes, "parallel", [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [2, 4]) for i in range(count)],
                              [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [2, 4]) for i in range(count)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("flops", [[1e9] * 3, [1e10, 1e5, 1e5], [3e9, 1e9, 1e6]])
def test_one_segment_split_across_device_types_keeps_at_least_the_fractional_work_bound(flops: list[float]) -> None:
    # A stage on the other device type starts where the nodes taken so far can have reached at most in its own work (a
    # knapsack, not the whole segment dropped, which let the bound fall to 0 here), and each stage ends where some set of
    # the parallel nodes does (a downset of the segment), not at any fraction of it: the work LP or above, never above
    # the optimum. The bisection ends all the same.
    loaded = load(parallel_model(len(flops)))
    problem = build_problem(loaded, mixed_costs(loaded, flops), mixed_target(1), batch=loaded.batch * 2, microbatches=2)
    assert segments(problem).count == 1
    bound = lower_bound(problem, 2)
    assert bound.work_seconds * (1 - 1e-5) <= bound.chain_seconds <= optimum(problem, 2) * (1 + 1e-9)
    assert 0 < chain_bound(problem, 2)


def branching_model(data: st.DataObject) -> onnx.ModelProto:
    """3 to 5 nodes, each reading one or two of the last three tensors: parallel branches make segments of several nodes."""
    nodes, tensors = [], ["x"]
    for i in range(data.draw(st.integers(3, 5))):
        recent = tensors[-3:]
        reads = data.draw(st.lists(st.sampled_from(recent), min_size=1, max_size=min(2, len(recent)), unique=True))
        nodes.append(helper.make_node("Relu" if len(reads) == 1 else "Add", reads, [f"t{i}"], name=f"n{i}"))
        tensors.append(f"t{i}")
    read = {t for n in nodes for t in n.input}
    ends = [t for t in tensors[1:] if t not in read]
    for j, t in enumerate(ends[1:]):  # one output: the ends summed
        nodes.append(helper.make_node("Add", [ends[0] if j == 0 else f"z{j - 1}", t], [f"z{j}"], name=f"z{j}"))
    out = nodes[-1].output[0]
    graph = helper.make_graph(nodes, "branches", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def branching_case(data: st.DataObject):  # type: ignore[no-untyped-def]
    """A loaded `branching_model` and the flops of each of its compute nodes."""
    graph = load(branching_model(data))
    flops = data.draw(st.lists(st.sampled_from([1e5, 1e6, 1e9, 3e9, 1e10]), min_size=len(graph.compute_nodes), max_size=len(graph.compute_nodes)))
    return graph, flops


@settings(max_examples=40, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.integers(2, 3), st.sampled_from(["fast-slow", "near-twins"]))
def test_never_above_brute_force_on_branching_graphs(data: st.DataObject, latency: float, stages: int, spec: str) -> None:
    """Stages that change device type inside a segment of several nodes (`_Chain.switch`)."""
    graph, flops = branching_case(data)
    params = data.draw(st.lists(st.sampled_from([0.0, 1e5, 1e7]), min_size=len(flops), max_size=len(flops)))
    target = mixed_target(1 if stages == 3 else 2, latency, spec=FAST_SLOW if spec == "fast-slow" else NEAR_TWINS)
    problem = build_problem(graph, mixed_costs(graph, flops, params), target, batch=graph.batch * 2, microbatches=2)
    assert chain_bound(problem, stages) <= optimum(problem, stages) * (1 + 1e-9)


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.integers(1, 2))
def test_never_above_brute_force_on_branching_graphs_with_replicas_over_several_device_types(data: st.DataObject, latency: float,
                                                                                             stages: int) -> None:
    graph, flops = branching_case(data)
    problem = build_problem(graph, mixed_costs(graph, flops), mixed_target(2, latency, spec=NEAR_TWINS), batch=graph.batch * 4, microbatches=4)
    assert chain_bound(problem, stages) <= optimum(problem, stages, mixed=True) * (1 + 1e-9)


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_it_charges_what_a_cut_must_carry_where_the_link_is_slow(mode: str) -> None:
    # Four equal nodes in a row on two devices behind a slow link: every plan's slower stage holds two nodes and sends or
    # receives one tensor of 1.3 ms, a sixth of its time or more, which the walk charges (it charged the link's latency).
    graph = load(chain_model(4, {}))
    problem = build_problem(graph, mixed_costs(graph, [1e9] * 4), one_group_target(2, 1e-6, 1e5), batch=graph.batch * 2, microbatches=2,
                            mode=mode)
    message = problem.tensor_bytes[1] / 1e5
    assert message > optimum(problem, 2) / 6
    assert chain_bound(problem, 2) == pytest.approx(optimum(problem, 2), rel=1e-5)


def small_model(name: str, nodes: list[tuple[str, list[str]]], output: str) -> onnx.ModelProto:
    """A model of the named nodes, each a Relu of one tensor or an Add of two, over an input x of [2, 4]."""
    made = [helper.make_node("Relu" if len(reads) == 1 else "Add", reads, [n], name=n) for n, reads in nodes]
    io = [helper.make_tensor_value_info(t, TensorProto.FLOAT, [2, 4]) for t in ("x", output)]
    return helper.make_model(helper.make_graph(made, name, io[:1], io[1:]), opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def fork_model() -> onnx.ModelProto:
    """a -> (b | c) -> d: b and c side by side, one segment."""
    return small_model("fork", [("a", ["x"]), ("b", ["a"]), ("c", ["a"]), ("d", ["b", "c"])], "d")


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_stage_ends_where_a_downset_of_its_segment_ends(mode: str) -> None:
    # Three stages over a light a, two heavy branches b and c side by side (30 units each) and a light d: a stage
    # ending inside the segment {b, c} holds neither, one or both, so some stage holds a heavy node and a light one. The
    # walk's fractional positions split the 62 units evenly (the work bound, a third below the optimum).
    graph = load(fork_model())
    problem = build_problem(graph, mixed_costs(graph, [1e8, 3e9, 3e9, 1e8]), one_group_target(3, 1e-6, 1e12), batch=graph.batch * 3,
                            microbatches=3, mode=mode)
    assert segments(problem).count == 3
    bound = lower_bound(problem, 3)
    assert bound.chain_seconds == pytest.approx(optimum(problem, 3), rel=1e-3)
    assert bound.work_seconds * 1.4 < bound.chain_seconds and bound.node_seconds * 1.02 < bound.chain_seconds


def skip_model() -> onnx.ModelProto:
    """p -> a -> n -> m -> z, and z also reads a: a residual around n and m, as around a transformer's sublayer."""
    return small_model("skip", [("p", ["x"]), ("a", ["p"]), ("n", ["a"]), ("m", ["n"]), ("z", ["m", "a"])], "z")


def on_a_slow_link(graph, flops: list[float], node: int, messages: float, mode: str):  # type: ignore[no-untyped-def]
    """The graph's problem on two devices whose link sends each tensor (all of one size) in `messages` times the work
    of `node` (forward and backward), and that work."""
    costs = mixed_costs(graph, flops)
    unit = build_problem(graph, costs, one_group_target(2, 1e-6, 1e12), batch=graph.batch * 2, microbatches=2, mode=mode)
    work = unit.forward[0][node] + unit.backward[0][node]
    target = one_group_target(2, 1e-6, unit.tensor_bytes[1] / (messages * work))
    return build_problem(graph, costs, target, batch=graph.batch * 2, microbatches=2, mode=mode), work


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_stage_holding_a_one_node_segment_pays_what_that_node_sends(mode: str) -> None:
    # Five one-node segments of 1, 1, 2, 2 and 1 units on two devices, a message a quarter of 2 units: the best plan cuts
    # after n, its first stage sending both n and the residual a. Charged as ending inside n's segment, that stage sent a
    # alone and the bound was 5.6% below the optimum.
    problem, _ = on_a_slow_link(load(skip_model()), [5e8, 5e8, 1e9, 1e9, 5e8], 2, 0.25, mode)
    assert segments(problem).count == 5
    assert chain_bound(problem, 2) == pytest.approx(optimum(problem, 2), rel=1e-5)


def sends_model() -> onnx.ModelProto:
    """p -> (b | c), z1 reads b, z2 reads z1 and c: b, c and z1 one segment, whose downset {b, c} sends two tensors."""
    return small_model("sends", [("p", ["x"]), ("b", ["p"]), ("c", ["p"]), ("z1", ["b"]), ("z2", ["z1", "c"])], "z2")


@pytest.mark.parametrize("mode", ["training", "inference"])
def test_a_stage_ending_inside_a_segment_pays_what_its_own_end_sends(mode: str) -> None:
    # Work 1, 2, 2, 0.5 and 4.5 units on two devices, a message one unit: the best plan ends its first stage after b and c,
    # sending both (7 units), or after z1, sending z1 and c (7.5). Charged the least any end of the segment sends (p's
    # output alone), either stage was one unit cheaper and the bound 6 units, a seventh below the optimum.
    problem, work = on_a_slow_link(load(sends_model()), [1e9, 2e9, 2e9, 5e8, 4.5e9], 0, 1.0, mode)
    assert segments(problem).count == 3
    assert optimum(problem, 2) == pytest.approx(7 * work, rel=1e-3)
    assert chain_bound(problem, 2) == pytest.approx(optimum(problem, 2), rel=1e-5)


def varied_model(data: st.DataObject) -> onnx.ModelProto:
    """3 to 5 nodes, each a MatMul to a narrow or wide tensor, or a Concat of two of the last three tensors: cuts carry
    tensors of several sizes, parallel branches make segments of several nodes."""
    nodes, inits, tensors = [], [], [("x", 8)]
    for i in range(data.draw(st.integers(3, 5))):
        reads = data.draw(st.lists(st.sampled_from(tensors[-3:]), min_size=1, max_size=min(2, len(tensors)), unique=True))
        if len(reads) == 1:
            (name, width), out = reads[0], data.draw(st.sampled_from([2, 32]))
            inits.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, [width, out], [0.1] * (width * out)))
            nodes.append(helper.make_node("MatMul", [name, f"w{i}"], [f"t{i}"], name=f"n{i}"))
        else:
            out = sum(w for _, w in reads)
            nodes.append(helper.make_node("Concat", [n for n, _ in reads], [f"t{i}"], name=f"n{i}", axis=1))
        tensors.append((f"t{i}", out))
    read = {t for n in nodes for t in n.input}
    ends = [t for t in tensors[1:] if t[0] not in read]
    if len(ends) > 1:
        nodes.append(helper.make_node("Concat", [n for n, _ in ends], ["z"], name="z", axis=1))
        ends = [("z", sum(w for _, w in ends))]
    graph = helper.make_graph(nodes, "varied", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
                              [helper.make_tensor_value_info(ends[0][0], TensorProto.FLOAT, [2, ends[0][1]])], initializer=inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@settings(max_examples=60, deadline=None)
@given(st.data(), st.sampled_from([1e3, 1e5, 1e9]), st.integers(2, 3), st.sampled_from(["fast-slow", "near-twins", "one"]))
def test_the_messages_it_charges_never_lift_it_above_brute_force(data: st.DataObject, bandwidth: float, stages: int, spec: str) -> None:
    """Slow links, so that what each stage must receive and send (`_Cuts`) weighs as much as its work."""
    graph = load(varied_model(data))
    flops = data.draw(st.lists(st.sampled_from([1e5, 1e7, 1e9]), min_size=len(graph.compute_nodes), max_size=len(graph.compute_nodes)))
    params = data.draw(st.lists(st.sampled_from([0.0, 1e5, 1e7]), min_size=len(flops), max_size=len(flops)))
    if spec == "one":
        target = one_group_target(3 if stages == 3 else 4, 1e-6, bandwidth)
    else:
        target = mixed_target(1 if stages == 3 else 2, 1e-6, bandwidth, spec=FAST_SLOW if spec == "fast-slow" else NEAR_TWINS)
    mode = data.draw(st.sampled_from(["training", "inference"]))
    problem = build_problem(graph, mixed_costs(graph, flops, params), target, batch=graph.batch * 2, microbatches=2, mode=mode)
    assert chain_bound(problem, stages) <= optimum(problem, stages) * (1 + 1e-9)


def chains_model(parts: int, length: int) -> onnx.ModelProto:
    """`parts` independent chains of `length` nodes each: that many connected parts."""
    nodes = [helper.make_node("Relu", [f"x{c}" if i == 0 else f"t{c}_{i - 1}"], [f"t{c}_{i}"], name=f"n{c}_{i}")
             for c in range(parts) for i in range(length)]
    graph = helper.make_graph(nodes, "chains", [helper.make_tensor_value_info(f"x{c}", TensorProto.FLOAT, [2, 4]) for c in range(parts)],
                              [helper.make_tensor_value_info(f"t{c}_{length - 1}", TensorProto.FLOAT, [2, 4]) for c in range(parts)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("mode", ["training", "inference"])
@pytest.mark.parametrize("parts, length, stages, latencies", [(1, 4, 2, 1), (1, 4, 3, 2), (2, 2, 2, 0), (2, 2, 3, 1), (2, 2, 4, 1),
                                                              (2, 3, 5, 2), (3, 1, 3, 0)])
def test_stages_beyond_the_graphs_parts_pay_link_latencies(parts: int, length: int, stages: int, latencies: int, mode: str) -> None:
    """Where a link's latency dwarfs the work, the bound counts the latencies some stage must pay: none while each part
    can have stages of its own, one once two stages share a part, two once three do; never above brute force, and within
    the work of the optimum where latencies are all it pays."""
    graph = load(chains_model(parts, length))
    problem = build_problem(graph, mixed_costs(graph, [1e3] * (parts * length)), one_group_target(stages, 1e-3, 1e12),
                            batch=graph.batch * 2, microbatches=2, mode=mode)
    assert problem.parts == parts
    bound = lower_bound(problem, stages)
    assert bound.message_seconds == pytest.approx(latencies * 1e-3)
    best = optimum(problem, stages)
    assert bound.seconds <= best * (1 + 1e-9)
    assert best - bound.seconds <= 1e-4  # the work and bytes, not a latency more: the bound is tight


def _exact_rungs(most: int) -> list[tuple[int, int]]:
    return [(r, r) for r in range(1, most + 1)]


@settings(max_examples=25, deadline=None)
@given(st.data(), st.sampled_from([1e-6, 1e-4]), st.sampled_from([1e7, 1e9]))
def test_never_above_brute_force_with_replica_counts_in_rungs(data: st.DataObject, latency: float, bandwidth: float) -> None:
    """A group larger than `EXACT_REPLICAS` knows a stage's replica count only within a rung (chainbound docstring, 7): here
    every count above 1 is in a rung of two or more ((2, 3), (4, 6)), against every plan on 6 devices."""
    n, skips, flops, params = random_dag(data)
    graph = load(chain_model(n, skips))
    problem = build_problem(graph, mixed_costs(graph, flops, params), one_group_target(6, latency, bandwidth), batch=graph.batch * 2, microbatches=2)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(chainbound, "EXACT_REPLICAS", 1)
        patch.setattr(chainbound, "_RUNG", 1)
        assert chainbound._rungs(6) == [(1, 1), (2, 3), (4, 6)]
        assert chain_bound(problem, 2) <= optimum(problem, 2) * (1 + 1e-9)


def test_a_large_groups_replica_counts_in_rungs_take_far_fewer_steps(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """300 devices of one group: in rungs, the bound stays within 1% under the one taking every replica count, whose walk
    takes a step (a stage's reach) many times more often."""
    graph = load(chain_model(12, {3: 1, 9: 6}))
    problem = build_problem(graph, mixed_costs(graph, [2e9] * 12, [4e6] * 12), one_group_target(300, 1e-5, 1e9),
                            batch=graph.batch * 8, microbatches=8)
    reach = chainbound._Chain.reach

    def walked(rungs) -> tuple[float, int]:  # type: ignore[no-untyped-def]
        steps = [0]

        def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
            steps[0] += 1
            return reach(*args, **kwargs)

        monkeypatch.setattr(chainbound._Chain, "reach", counted)
        monkeypatch.setattr(chainbound, "_rungs", rungs)
        monkeypatch.setattr(chainbound, "_CHAINS", weakref.WeakKeyDictionary())  # a chain of these rungs
        return chain_bound(problem, 3), steps[0]

    in_rungs, few = walked(chainbound._rungs)
    every, many = walked(_exact_rungs)
    assert 0.99 * every <= in_rungs <= every and every > 0
    assert many > 4 * few
