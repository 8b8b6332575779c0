"""For a given stage count the planner's plan is never predicted slower per iteration than any baseline
of that many stages priced the same way (what the user pays is the iteration, not the bottleneck):
over the small zoo on a homogeneous and a heterogeneous target, and over random DAGs, for every K."""

from __future__ import annotations

import pytest
from hypothesis import given, settings

from onnxpipe.cost import annotate
from onnxpipe.graph import load
from onnxpipe.models import build, specs
from onnxpipe.plan import compare, fits, plan
from onnxpipe.target import load_target
from test_properties import RandomModel, random_models

TARGETS = ("fpga4", "hetero")


def _slower_than(graph, costs, target, k: int) -> list[str]:
    ours = plan(graph, costs, target, stages=k, time_limit=2)
    return [f"{name} at k={k}: {other.iteration_seconds:.6g} s < ours {ours.iteration_seconds:.6g} s"
            for name, other in compare(graph, costs, target, ours).items()
            if len(other.stages) == k and fits(other) and other.iteration_seconds < ours.iteration_seconds * (1 - 1e-9)]


@pytest.mark.parametrize("name", [s.name for s in specs() if not s.full_size])
def test_no_baseline_is_faster_at_any_stage_count_on_the_zoo(name: str) -> None:
    graph = load(build(name))
    costs = annotate(graph)
    for target_name in TARGETS:
        target = load_target(target_name)
        for k in range(1, min(len(target.devices), len(graph.compute_nodes)) + 1):
            assert not _slower_than(graph, costs, target, k), f"{name} on {target_name}"


@settings(max_examples=15, deadline=None)
@given(random_models())
def test_no_baseline_is_faster_at_any_stage_count_on_random_dags(case: RandomModel) -> None:
    graph = load(case.model)
    costs = annotate(graph)
    target = load_target("hetero")
    for k in range(1, min(len(target.devices), len(graph.compute_nodes)) + 1):
        assert not _slower_than(graph, costs, target, k)
