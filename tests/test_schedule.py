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


# Schedules with a split backward (W) or several stages per device: `schedule.table`.

NEW = ("interleaved", "zb-h1", "zb-v")


def _needs(a: Action, stages: int) -> list[tuple[int, str, int]]:
    if a.op == "F":
        return [(a.stage - 1, "F", a.microbatch)] if a.stage > 0 else []
    if a.op == "B":
        return [(a.stage, "F", a.microbatch)] + ([(a.stage + 1, "B", a.microbatch)] if a.stage < stages - 1 else [])
    if a.op == "W":
        return [(a.stage, "B", a.microbatch)]
    return []


def _makespan(table: sched.Table, seconds: dict[str, float]) -> float:
    """Run each row in its order, every action as soon as its row is free and what it needs has finished."""
    stages = max(a.stage for row in table for a in row) + 1
    finish: dict[tuple[int, str, int], float] = {}
    cursor, free = [0] * len(table), [0.0] * len(table)
    progress = True
    while progress:
        progress = False
        for r, row in enumerate(table):
            while cursor[r] < len(row):
                a = row[cursor[r]]
                needs = _needs(a, stages)
                if not all(n in finish for n in needs):
                    break
                free[r] = finish[(a.stage, a.op, a.microbatch)] = max([free[r]] + [finish[n] for n in needs]) + seconds.get(a.op, 0.0)
                cursor[r] += 1
                progress = True
    assert all(c == len(row) for c, row in zip(cursor, table))
    return max(free)


@pytest.mark.parametrize("name", NEW)
@pytest.mark.parametrize(("k", "m"), [(1, 1), (2, 2), (2, 3), (4, 4), (4, 8), (3, 9), (8, 16), (5, 2)])
def test_every_stage_runs_f_b_and_w_once_per_micro_batch(name: str, k: int, m: int) -> None:
    v = sched.virtual(name)
    if name == "interleaved" and m % k:
        with pytest.raises(OnnxpipeError, match=f"pass a multiple of {k} micro-batches"):
            sched.table(name, k * v, m)
        return
    table = sched.table(name, k * v, m)
    assert len(table) == k
    split = name.startswith("zb")
    for s in range(k * v):
        row = table[sched.stage_rows(table)[s]]
        for op in ("F", "B", "W") if split else ("F", "B"):
            assert sorted(a.microbatch for a in row if a.stage == s and a.op == op) == list(range(m)), (s, op)
        assert split or not any(a.op == "W" for a in row)
        assert sum(a == Action(s, "STEP") for a in row) == 1
        # Each row ends with its stages' optimizer steps, after all their work.
        assert all(a.op == "STEP" for a in row[-v:])
    # The order is a real run: every action after what it needs (the same rules as ensure_valid).
    assert _makespan(table, {"F": 1.0, "B": 1.0, "W": 1.0}) > 0


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 4), (4, 8), (4, 12), (8, 16), (3, 7)])
def test_zb_h1_bubble_is_a_third_of_1f1b_at_the_same_peak(k: int, m: int) -> None:
    # Equal F, B and W times (the paper's setting): 1F1B's fused backward takes B + W.
    one = _makespan(sched.build("1f1b", k, m), {"F": 1.0, "B": 2.0})
    zb = _makespan(sched.table("zb-h1", k, m), {"F": 1.0, "B": 1.0, "W": 1.0})
    assert one == 3 * (m + k - 1)
    assert zb == 3 * m + k - 1  # bubble (k - 1) time units per device against 1F1B's 3 (k - 1)
    flight = [sched.in_flight(row) for row in sched.table("zb-h1", k, m)]
    until_b = [sched.in_flight(tuple(a for a in row if a.op != "W")) for row in sched.table("zb-h1", k, m)]
    assert until_b == [min(k - s, m) for s in range(k)]  # as 1F1B between F and B
    assert flight == [min(k, m)] * k  # held until W: 1F1B's stage-0 peak on every stage
    assert max(flight) == max(sched.in_flight(row) for row in sched.build("1f1b", k, m))


@pytest.mark.parametrize(("k", "v", "m"), [(2, 2, 4), (4, 2, 4), (4, 2, 8), (4, 3, 8), (3, 2, 9)])
def test_interleaved_bubble_and_in_flight_follow_the_closed_forms(k: int, v: int, m: int) -> None:
    table = sched.interleaved_1f1b(k * v, m, v)
    sched.ensure_valid(table)
    # A stage of the interleaved pipeline holds 1/v of a 1F1B stage's layers: F = 1, B = 2 per chunk.
    assert _makespan(table, {"F": 1.0, "B": 2.0}) == 3 * v * m + 3 * (k - 1)
    assert _makespan(sched.build("1f1b", k, m), {"F": v, "B": 2.0 * v}) == 3 * v * (m + k - 1)
    assert sched.stage_rows(table) == tuple(s % k for s in range(k * v))
    assert [sched.in_flight(row) for row in table] == [min(2 * (k - d - 1) + (v - 1) * k + 1, m * v) for d in range(k)]


@pytest.mark.parametrize(("k", "m"), [(2, 4), (4, 8), (4, 12), (8, 16)])
def test_zb_v_beats_zb_h1_within_1f1b_memory(k: int, m: int) -> None:
    table = sched.table("zb-v", 2 * k, m)
    assert sched.stage_rows(table) == tuple(range(k)) + tuple(reversed(range(k)))
    # Half a stage per chunk: F = B = W = 1/2 against ZB-H1's 1.
    zbv = _makespan(table, {"F": 0.5, "B": 0.5, "W": 0.5})
    assert zbv < _makespan(sched.table("zb-h1", k, m), {"F": 1.0, "B": 1.0, "W": 1.0})
    assert zbv <= 3 * m + (k - 1) / 2
    # 2k half-stage micro-batches held at most: the activations of 1F1B's stage 0 (k whole ones).
    assert [sched.in_flight(row) for row in table] == [min(2 * k, 2 * m)] * k


def test_peak_held_weighs_each_stage_by_its_stash() -> None:
    row = sched.table("interleaved", 4, 2)[0]  # 0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1
    assert sched.peak_held(row, {0: 10.0, 2: 1.0}) == 22.0
    zb = sched.table("zb-h1", 2, 3)[1]  # 1F0 1B0 1F1 1B1 1W0 ...: the stash stays until W
    assert sched.peak_held(zb, {1: 5.0}) == 10.0


@pytest.mark.parametrize("name", NEW)
def test_new_tables_lower_replicate_and_render(name: str) -> None:
    k, v = 3, sched.virtual(name)
    table = sched.table(name, k * v, 6)
    lowered = sched.add_communication(table)
    sends = {(a.stage + (1 if a.op == "SEND_F" else -1), a.op[-1], a.microbatch) for row in lowered for a in row if a.op.startswith("SEND")}
    recvs = {(a.stage, a.op[-1], a.microbatch) for row in lowered for a in row if a.op.startswith("RECV")}
    assert sends == recvs and len(sends) == 2 * (k * v - 1) * 6
    sched.ensure_valid(sched.replicate(table, (2,) * k))
    assert sched.render(table).count("\n") == k - 1


def test_new_tables_in_text() -> None:
    assert sched.render(sched.table("zb-h1", 2, 3)) == (
        "0F0 0F1 0B0 0W0 0F2 0B1 0W1 0B2 0W2 0STEP\n1F0 1B0 1F1 1B1 1W0 1F2 1B2 1W1 1W2 1STEP"
    )
    assert sched.render(sched.table("interleaved", 4, 2)) == (
        "0F0 0F1 2F0 2F1 2B0 2B1 0B0 0B1 0STEP 2STEP\n1F0 1F1 3F0 3B0 3F1 3B1 1B0 1B1 1STEP 3STEP"
    )


def test_a_w_before_its_b_or_a_missing_w_is_refused() -> None:
    early = (Action(0, "F", 0), Action(0, "W", 0), Action(0, "B", 0), Action(0, "STEP"))
    with pytest.raises(OnnxpipeError, match="deadlocks: stage 0 waits forever at 0W0"):
        sched.ensure_valid((early,))
    partial = (Action(0, "F", 0), Action(0, "F", 1), Action(0, "B", 0), Action(0, "W", 0), Action(0, "B", 1), Action(0, "STEP"))
    with pytest.raises(OnnxpipeError, match="exactly one W per micro-batch"):
        sched.ensure_valid((partial,))


@pytest.mark.parametrize(("name", "stages", "m", "message"), [
    ("zb-v", 3, 4, "multiple of 2 stages"),
    ("interleaved", 4, 3, "pass a multiple of 2 micro-batches"),
    ("looped", 4, 4, "unknown schedule 'looped'"),
    ("zb-h1", 2, 0, "at least 1 micro-batch"),
])
def test_bad_table_requests_are_clear_errors(name: str, stages: int, m: int, message: str) -> None:
    with pytest.raises(OnnxpipeError, match=message):
        sched.table(name, stages, m)


def test_unknown_schedules_are_named_with_the_choices() -> None:
    sched.ensure_known("auto", ("auto",))
    sched.ensure_known("zb-v")
    with pytest.raises(OnnxpipeError, match="unknown schedule 'warp'; choose one of: gpipe, 1f1b, interleaved, zb-h1, zb-v, auto"):
        sched.ensure_known("warp", ("auto",))
