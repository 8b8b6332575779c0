"""Pipeline schedules as data: per-stage lists of actions that the simulator, the executor and the pictures all read.

Reading order: `Action` -> `gpipe` / `one_f_one_b` -> `build` -> `add_communication`
-> `replicate` (rows of a replicated stage's workers) -> checks (`in_flight`, `ensure_valid`).
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxpipe.errors import OnnxpipeError

__all__ = [
    "Action",
    "SCHEDULES",
    "Table",
    "gpipe",
    "one_f_one_b",
    "build",
    "add_communication",
    "replicate",
    "in_flight",
    "ensure_valid",
    "render",
]

#: Compute ops: F forward, B backward, STEP optimizer step. Communication ops (added by
#: `add_communication`): RECV_F/SEND_F carry activations, RECV_B/SEND_B carry gradients.
COMPUTE_OPS = ("F", "B", "STEP")
COMM_OPS = ("RECV_F", "SEND_F", "RECV_B", "SEND_B")


@dataclass(frozen=True)
class Action:
    """One thing a stage does: e.g. `2F0` is stage 2's forward of micro-batch 0."""

    stage: int
    op: str
    #: Micro-batch index; -1 for STEP.
    microbatch: int = -1

    def __str__(self) -> str:
        return f"{self.stage}{self.op}" if self.microbatch < 0 else f"{self.stage}{self.op}{self.microbatch}"


#: One tuple of actions per stage, in the order that stage runs them.
Table = tuple[tuple[Action, ...], ...]


def gpipe(stages: int, microbatches: int) -> Table:
    """All forwards, then all backwards (GPipe): every micro-batch's activations are in flight at once."""
    return tuple(
        tuple(Action(s, "F", i) for i in range(microbatches))
        + tuple(Action(s, "B", i) for i in range(microbatches))
        + (Action(s, "STEP"),)
        for s in range(stages)
    )


def one_f_one_b(stages: int, microbatches: int) -> Table:
    """Early backward (PipeDream-flush / DAPPLE): stage s keeps at most stages - s micro-batches in flight."""
    table = []
    for s in range(stages):
        warmup = min(stages - s - 1, microbatches)
        actions = [Action(s, "F", i) for i in range(warmup)]
        forward, backward = warmup, 0
        while backward < microbatches:
            if forward < microbatches:
                actions.append(Action(s, "F", forward))
                forward += 1
            actions.append(Action(s, "B", backward))
            backward += 1
        actions.append(Action(s, "STEP"))
        table.append(tuple(actions))
    return tuple(table)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def build(schedule: str, stages: int, microbatches: int) -> Table:
    """The compute table of a named schedule."""
    if schedule not in SCHEDULES:
        raise OnnxpipeError(f"unknown schedule '{schedule}'; choose one of: {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise OnnxpipeError(f"a schedule needs at least 1 stage and 1 micro-batch (got {stages} stages, {microbatches} micro-batches)")
    table = SCHEDULES[schedule](stages, microbatches)
    ensure_valid(table)
    return table


def add_communication(table: Table) -> Table:
    """Lower a compute table: receive before each F/B that needs a neighbour's data, send right after."""
    last = len(table) - 1
    lowered = []
    for s, actions in enumerate(table):
        out: list[Action] = []
        for a in actions:
            if a.op == "F":
                if s > 0:
                    out.append(Action(s, "RECV_F", a.microbatch))
                out.append(a)
                if s < last:
                    out.append(Action(s, "SEND_F", a.microbatch))
            elif a.op == "B":
                if s < last:
                    out.append(Action(s, "RECV_B", a.microbatch))
                out.append(a)
                if s > 0:
                    out.append(Action(s, "SEND_B", a.microbatch))
            else:
                out.append(a)
        lowered.append(tuple(out))
    return tuple(lowered)


def replicate(table: Table, replicas: tuple[int, ...]) -> Table:
    """One row per worker, stage-major: replica j of stage s runs the micro-batches i with
    i % replicas[s] == j in the order of the stage's row (and every STEP). A subsequence of a
    deadlock-free order keeps every dependency it had, so the result cannot deadlock either."""
    if len(replicas) != len(table) or min(replicas, default=1) < 1:
        raise OnnxpipeError(f"replicas {tuple(replicas)}: need one count of at least 1 for each of the {len(table)} stages")
    return tuple(
        tuple(a for a in row if a.microbatch < 0 or a.microbatch % r == j)
        for row, r in zip(table, replicas)
        for j in range(r)
    )


def in_flight(actions: tuple[Action, ...]) -> int:
    """Most micro-batches whose forward ran and backward has not, over one stage's actions."""
    live = peak = 0
    for a in actions:
        if a.op == "F":
            live += 1
            peak = max(peak, live)
        elif a.op == "B":
            live -= 1
    return peak


def ensure_valid(table: Table) -> None:
    """Every micro-batch is run forward and backward once per stage, and the table cannot deadlock.

    Runs the table with the pipeline's data dependencies: F(s, i) needs F(s-1, i); B(s, i) needs
    F(s, i) and B(s+1, i). Raises if some stage can never make progress. Rows are one per stage,
    or one per worker (`replicate`): an action's stage is its own `stage`.
    """
    stages = max((a.stage for row in table for a in row), default=-1) + 1
    for s in range(stages):
        actions = [a for row in table for a in row if a.stage == s]
        fs = sorted(a.microbatch for a in actions if a.op == "F")
        bs = sorted(a.microbatch for a in actions if a.op == "B")
        if fs != bs or fs != list(range(len(fs))):
            raise OnnxpipeError(f"schedule stage {s}: each micro-batch needs exactly one forward and one backward")
    done: set[tuple[int, str, int]] = set()
    cursor = [0] * len(table)
    progress = True
    while progress:
        progress = False
        for w in range(len(table)):
            while cursor[w] < len(table[w]):
                a = table[w][cursor[w]]
                s = a.stage
                needs = []
                if a.op == "F" and s > 0:
                    needs.append((s - 1, "F", a.microbatch))
                if a.op == "B":
                    needs.append((s, "F", a.microbatch))
                    if s < stages - 1:
                        needs.append((s + 1, "B", a.microbatch))
                if not all(n in done for n in needs):
                    break
                done.add((s, a.op, a.microbatch))
                cursor[w] += 1
                progress = True
    stuck = [w for w in range(len(table)) if cursor[w] < len(table[w])]
    if stuck:
        a = table[stuck[0]][cursor[stuck[0]]]
        raise OnnxpipeError(f"schedule deadlocks: stage {a.stage} waits forever at {a}")


def render(table: Table) -> str:
    """One line per stage, e.g. `0F0 0F1 0B0 ...`: the schedule as people read it."""
    return "\n".join(" ".join(str(a) for a in actions) for actions in table)
