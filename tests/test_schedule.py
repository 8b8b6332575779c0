"""Schedule tables: data dependencies hold, in-flight counts match each schedule, broken tables are refused."""

from __future__ import annotations

import pytest

from onnxpipe import schedule as sched
from onnxpipe.errors import OnnxpipeError
from onnxpipe.schedule import Action


def _finish_order(table: sched.Table) -> list[tuple[int, str, int]]:
    """A global order in which the table can run: each action after the ones it needs."""
    sched.ensure_valid(table)
    done: list[tuple[int, str, int]] = []
    cursor = [0] * len(table)
    while any(c < len(a) for c, a in zip(cursor, table)):
        for s, actions in enumerate(table):
            if cursor[s] < len(actions):
                a = actions[cursor[s]]
                needs = []
                if a.op == "F" and s > 0:
                    needs.append((s - 1, "F", a.microbatch))
                if a.op == "B":
                    needs.append((s, "F", a.microbatch))
                    if s < len(table) - 1:
                        needs.append((s + 1, "B", a.microbatch))
                if all(n in done for n in needs):
                    done.append((s, a.op, a.microbatch))
                    cursor[s] += 1
    return done


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 3), (4, 4), (4, 9), (5, 2)])
def test_every_stage_runs_each_micro_batch_once_in_dependency_order(name: str, k: int, m: int) -> None:
    table = sched.build(name, k, m)
    order = _finish_order(table)
    assert len(order) == k * (2 * m + 1)
    for s in range(k):
        for i in range(m):
            assert order.index((s, "F", i)) < order.index((s, "B", i))
            if s > 0:
                assert order.index((s - 1, "F", i)) < order.index((s, "F", i))
                assert order.index((s, "B", i)) < order.index((s - 1, "B", i))
        assert table[s][-1] == Action(s, "STEP")


@pytest.mark.parametrize(("k", "m"), [(4, 8), (3, 3), (4, 2)])
def test_in_flight_counts(k: int, m: int) -> None:
    assert [sched.in_flight(a) for a in sched.build("gpipe", k, m)] == [m] * k
    assert [sched.in_flight(a) for a in sched.build("1f1b", k, m)] == [min(k - s, m) for s in range(k)]


def test_communication_pairs_every_send_with_a_receive() -> None:
    lowered = sched.add_communication(sched.build("1f1b", 3, 4))
    sends = {(a.stage + (1 if a.op == "SEND_F" else -1), a.op[-1], a.microbatch) for st in lowered for a in st if a.op.startswith("SEND")}
    recvs = {(a.stage, a.op[-1], a.microbatch) for st in lowered for a in st if a.op.startswith("RECV")}
    assert sends == recvs and len(sends) == 2 * 2 * 4
    assert lowered[1][:3] == (Action(1, "RECV_F", 0), Action(1, "F", 0), Action(1, "SEND_F", 0))


def test_a_table_that_waits_on_itself_is_refused() -> None:
    table = sched.build("gpipe", 2, 2)
    # Stage 1 runs B0 before F0 of the same micro-batch: it can never start.
    broken = (table[0], (Action(1, "B", 0), Action(1, "F", 0), Action(1, "F", 1), Action(1, "B", 1), Action(1, "STEP")))
    with pytest.raises(OnnxpipeError, match="deadlocks: stage 0 waits forever at 0B0"):
        sched.ensure_valid(broken)


def test_a_cross_stage_cycle_is_refused() -> None:
    # Stage 0 wants B0 before F1, stage 1 wants F1 before B0: a cycle through the pipeline.
    s0 = (Action(0, "F", 0), Action(0, "B", 0), Action(0, "F", 1), Action(0, "B", 1), Action(0, "STEP"))
    s1 = (Action(1, "F", 1), Action(1, "F", 0), Action(1, "B", 0), Action(1, "B", 1), Action(1, "STEP"))
    with pytest.raises(OnnxpipeError, match="deadlocks"):
        sched.ensure_valid((s0, s1))


def test_missing_backward_is_refused() -> None:
    with pytest.raises(OnnxpipeError, match="exactly one forward and one backward"):
        sched.ensure_valid(((Action(0, "F", 0), Action(0, "STEP")),))


@pytest.mark.parametrize(("name", "k", "m"), [("warp", 2, 2), ("gpipe", 0, 2), ("1f1b", 2, 0)])
def test_bad_requests_are_clear_errors(name: str, k: int, m: int) -> None:
    with pytest.raises(OnnxpipeError, match="unknown schedule|at least 1 stage"):
        sched.build(name, k, m)


def test_render_reads_like_the_papers() -> None:
    assert sched.render(sched.build("1f1b", 2, 3)) == "0F0 0F1 0B0 0F2 0B1 0B2 0STEP\n1F0 1B0 1F1 1B1 1F2 1B2 1STEP"
    assert sched.render(sched.build("gpipe", 2, 2)) == "0F0 0F1 0B0 0B1 0STEP\n1F0 1F1 1B0 1B1 1STEP"
