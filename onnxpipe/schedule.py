"""Pipeline schedules as data: per-device lists of actions that the simulator, the executor and the pictures all read.

Reading order: `Action` -> `gpipe` / `one_f_one_b` -> `build` (`forward_only` for inference) -> `add_communication`
-> `replicate` (rows of a replicated stage's workers) -> checks (`in_flight`, `ensure_valid`)
-> the schedules with a split backward or several stages per device (`interleaved_1f1b`, `zb_h1`,
`zb_v`, built by `table`; `_unit_time_order` lists the zero-bubble ones).

A table has one row per device. In GPipe and 1F1B a device holds one stage, so row s is stage s.
Interleaved 1F1B and ZB-V give each device v > 1 stages (`virtual`, `placement`): a row holds the
actions of all its stages, in the order the device runs them. A split backward is two actions:
B (gradients of the stage inputs, which the previous stage waits for) and W (gradients of the
weights, which only the optimizer step needs); a table without W runs each backward whole as B.
"""

from __future__ import annotations

from dataclasses import dataclass

from onnxpipe.errors import OnnxpipeError
from onnxpipe.units import plural

__all__ = [
    "Action",
    "COMPUTE_OPS",
    "SCHEDULES",
    "Table",
    "gpipe",
    "one_f_one_b",
    "build",
    "forward_only",
    "add_communication",
    "replicate",
    "in_flight",
    "ensure_valid",
    "render",
    "TABLES",
    "table",
    "virtual",
    "placement",
    "stage_rows",
    "interleaved_1f1b",
    "zb_h1",
    "zb_v",
    "peak_held",
    "ensure_known",
]

#: Compute ops: F forward, B backward (whole, or of the stage inputs only when the table has W), W weight
#: gradients, STEP optimizer step. Communication ops (added by `add_communication`): RECV_F/SEND_F carry
#: activations, RECV_B/SEND_B carry gradients.
COMPUTE_OPS = ("F", "B", "W", "STEP")


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


def build(schedule: str, stages: int, microbatches: int) -> Table:
    """The compute table of a named schedule."""
    if schedule not in SCHEDULES:
        raise OnnxpipeError(f"unknown schedule '{schedule}'; choose one of: {', '.join(SCHEDULES)}")
    if stages < 1 or microbatches < 1:
        raise OnnxpipeError(f"a schedule needs at least 1 stage and 1 micro-batch (got {plural(stages, 'stage')}, {plural(microbatches, 'micro-batch')})")
    table = SCHEDULES[schedule](stages, microbatches)
    ensure_valid(table)
    return table


def forward_only(stages: int, microbatches: int) -> Table:
    """Inference: every stage runs each micro-batch's forward as it arrives; no backward, no optimizer step."""
    return tuple(tuple(Action(s, "F", i) for i in range(microbatches)) for s in range(stages))


def add_communication(table: Table) -> Table:
    """Lower a compute table: receive before each F/B that needs a neighbour's data, send right after.
    Neighbours are stages s - 1 and s + 1, wherever they run (on another row, or on the same one)."""
    last = max((a.stage for row in table for a in row), default=0)
    lowered = []
    for actions in table:
        out: list[Action] = []
        for a in actions:
            s = a.stage
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
        raise OnnxpipeError(f"replicas {tuple(replicas)}: need one count of at least 1 for each of the {plural(len(table), 'stage')}")
    return tuple(worker for row, r in zip(table, replicas) for worker in _dealt(row, r))


def _dealt(row: tuple[Action, ...], replicas: int) -> tuple[tuple[Action, ...], ...]:
    """A row dealt out to its replicas in one pass (not one pass per replica: 1,000 replicas of a row of
    4,000 actions), every action without a micro-batch (STEP) to each."""
    out: list[list[Action]] = [[] for _ in range(replicas)]
    for a in row:
        if a.microbatch < 0:
            for worker in out:
                worker.append(a)
        else:
            out[a.microbatch % replicas].append(a)
    return tuple(tuple(worker) for worker in out)


def in_flight(actions: tuple[Action, ...]) -> int:
    """Most micro-batches (of any of the row's stages) whose forward ran and whose backward has not
    finished, over one row: finished is B, or W where the row splits that stage's backward (W needs
    what the forward left, so the planner holds a micro-batch's stash until its W)."""
    return round(peak_held(actions, {}))


def peak_held(actions: tuple[Action, ...], stash: dict[int, float]) -> float:
    """Peak over one row of the bytes held by micro-batches in flight: `stash[stage]` each (1 for a
    stage not listed), from its F to its B, or to its W where the row has one for that stage."""
    split = {a.stage for a in actions if a.op == "W"}
    live = peak = 0.0
    for a in actions:
        if a.op == "F":
            live += stash.get(a.stage, 1.0)
            peak = max(peak, live)
        elif a.op == ("W" if a.stage in split else "B"):
            live -= stash.get(a.stage, 1.0)
    return peak


def ensure_valid(table: Table) -> None:
    """Every micro-batch is run forward and backward once per stage (and, where a stage splits its
    backward, W once), and the table cannot deadlock.

    Runs the table with the pipeline's data dependencies: F(s, i) needs F(s-1, i); B(s, i) needs
    F(s, i) and B(s+1, i); W(s, i) needs B(s, i). Raises if some stage can never make progress. Rows
    are one per device (holding one stage or several), or one per worker (`replicate`): an action's
    stage is its own `stage`.
    """
    stages = max((a.stage for row in table for a in row), default=-1) + 1
    for s in range(stages):
        actions = [a for row in table for a in row if a.stage == s]
        fs = sorted(a.microbatch for a in actions if a.op == "F")
        bs = sorted(a.microbatch for a in actions if a.op == "B")
        if fs != bs or fs != list(range(len(fs))):
            raise OnnxpipeError(f"schedule stage {s}: each micro-batch needs exactly one forward and one backward")
        ws = sorted(a.microbatch for a in actions if a.op == "W")
        if ws and ws != fs:
            raise OnnxpipeError(f"schedule stage {s}: a split backward needs exactly one W per micro-batch")
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
                if a.op == "W":
                    needs.append((s, "B", a.microbatch))
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


def interleaved_1f1b(stages: int, microbatches: int, chunks: int = 2) -> Table:
    """Interleaved 1F1B (Megatron-LM's virtual pipeline): `stages` = devices x chunks, stage s on device
    s % devices, so each device holds `chunks` non-adjacent stages. The fill and drain take 1/chunks of
    1F1B's (bubble (k - 1) / (chunks * m + k - 1) at uniform stages), at the price of more micro-batches
    in flight and `chunks` times the messages. Each device runs its forwards in groups of `devices`
    micro-batches per stage (so micro-batches must be a multiple of the devices), backwards likewise from
    its last stage down, with 2 (k - d - 1) + (chunks - 1) k forwards of warm-up on device d."""
    devices = stages // chunks
    if microbatches % devices:
        raise OnnxpipeError(
            f"interleaved 1F1B runs micro-batches in groups of its {devices} devices; pass a multiple of {devices} micro-batches (got {microbatches})"
        )
    total = microbatches * chunks

    def unit(d: int, j: int, op: str) -> Action:
        chunk = (j // devices) % chunks
        microbatch = (j // (devices * chunks)) * devices + j % devices
        return Action((chunk if op == "F" else chunks - 1 - chunk) * devices + d, op, microbatch)

    rows = []
    for d in range(devices):
        warmup = min(2 * (devices - d - 1) + (chunks - 1) * devices, total)
        actions = [unit(d, j, "F") for j in range(warmup)]
        for j in range(total - warmup):
            actions += [unit(d, warmup + j, "F"), unit(d, j, "B")]
        actions += [unit(d, j, "B") for j in range(total - warmup, total)]
        actions += [Action(c * devices + d, "STEP") for c in range(chunks)]
        rows.append(tuple(actions))
    return tuple(rows)


def zb_h1(stages: int, microbatches: int) -> Table:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism, 2024): 1F1B with each backward split into B
    and W, and W deferred into what would be the bubble. At equal F, B and W times the step takes
    3m + k - 1 time units instead of 1F1B's 3(m + k - 1): the bubble is a third of 1F1B's. Stage s
    still keeps at most k - s micro-batches between F and B, as 1F1B; counting until W (what W needs
    stays), every stage holds up to k, the most 1F1B holds on stage 0."""
    return _unit_time_order(tuple((s,) for s in range(stages)), microbatches,
                            until_b=tuple(stages - s for s in range(stages)), until_w=(stages,) * stages)


def zb_v(stages: int, microbatches: int) -> Table:
    """ZB-V (Qi et al., Pipeline Parallelism with Controllable Memory, 2024): `stages` = 2 x devices in a
    V: device d holds stages d and 2k - 1 - d (so the first and last stage share device 0, and the
    loss's gradient starts back without a transfer), with split backwards listed to fill the bubble.
    Each device holds at most 2k stage micro-batches until their W: with the model cut into 2k equal
    stages, the activations of k whole micro-batches, as 1F1B's stage 0."""
    if stages % 2:
        raise OnnxpipeError(f"ZB-V puts two stages on each device; pass an even number of stages (got {stages})")
    devices = stages // 2
    return _unit_time_order(tuple((d, stages - 1 - d) for d in range(devices)), microbatches,
                            until_b=(stages,) * devices, until_w=(stages,) * devices)


def _unit_time_order(rows: tuple[tuple[int, ...], ...], microbatches: int, *, until_b: tuple[int, ...], until_w: tuple[int, ...]) -> Table:
    """Each device's order when F, B and W each take one time unit and a free device starts the first
    ready action among: F of its deepest stage that has one ready, while the device holds fewer than
    until_b[d] stage micro-batches without their B and until_w[d] without their W; B, deepest stage
    first; W, oldest first. (The zero-bubble papers' heuristic: forwards while memory allows, the
    critical B next, W to fill what is left.) The result is a run that happened, so it cannot deadlock."""
    stages = sum(len(r) for r in rows)
    finish: dict[tuple[int, str, int], int] = {}
    count = {op: [0] * stages for op in "FBW"}
    free = [0] * len(rows)
    out: list[list[Action]] = [[] for _ in rows]

    def ready(d: int, t: int) -> Action | None:
        held_b = sum(count["F"][s] - count["B"][s] for s in rows[d])
        held_w = sum(count["F"][s] - count["W"][s] for s in rows[d])
        for s in sorted(rows[d], reverse=True):
            i = count["F"][s]
            if i < microbatches and held_b < until_b[d] and held_w < until_w[d] and (s == 0 or finish.get((s - 1, "F", i), t + 1) <= t):
                return Action(s, "F", i)
        for s in sorted(rows[d], reverse=True):
            i = count["B"][s]
            if i < count["F"][s] and (s == stages - 1 or finish.get((s + 1, "B", i), t + 1) <= t) and finish[(s, "F", i)] <= t:
                return Action(s, "B", i)
        pending = [Action(s, "W", count["W"][s]) for s in rows[d] if count["W"][s] < count["B"][s]]
        return min(pending, key=lambda a: (finish[(a.stage, "B", a.microbatch)], a.stage), default=None)

    t = 0
    while any(c < microbatches for c in count["W"]):
        started = False
        for d in range(len(rows)):
            if free[d] <= t and (a := ready(d, t)) is not None:
                out[d].append(a)
                count[a.op][a.stage] += 1
                finish[(a.stage, a.op, a.microbatch)] = free[d] = t + 1
                started = True
        if not started and all(f <= t for f in free):
            raise OnnxpipeError(f"internal: no zero-bubble order for {stages} stages and {microbatches} micro-batches within the memory limits; report it")
        t += 1
    return tuple(tuple(row) + tuple(Action(s, "STEP") for s in sorted(rows[d])) for d, row in enumerate(out))


#: Every schedule table by name, and how many stages each device holds in it.
TABLES = {
    "gpipe": (gpipe, 1),
    "1f1b": (one_f_one_b, 1),
    "interleaved": (interleaved_1f1b, 2),
    "zb-h1": (zb_h1, 1),
    "zb-v": (zb_v, 2),
}


#: The schedules with one stage per device, which the planner explores (`--schedule auto`) and `build` makes;
#: it plans the others (several stages per device) when asked by name (`plan.virtual`).
SCHEDULES = {name: TABLES[name][0] for name in ("gpipe", "1f1b", "zb-h1")}


def ensure_known(schedule: str, also: tuple[str, ...] = ()) -> None:
    """A schedule of `TABLES`, or one of `also` (the planner's "auto")."""
    if schedule not in TABLES and schedule not in also:
        raise OnnxpipeError(f"unknown schedule '{schedule}'; choose one of: {', '.join((*TABLES, *also))}")


def virtual(schedule: str) -> int:
    """Stages each device holds under a schedule (1 for GPipe, 1F1B and ZB-H1)."""
    if schedule not in TABLES:
        raise OnnxpipeError(f"unknown schedule '{schedule}'; choose one of: {', '.join(TABLES)}")
    return TABLES[schedule][1]


def table(schedule: str, stages: int, microbatches: int) -> Table:
    """The compute table of any schedule in `TABLES`, one row per device, checked by `ensure_valid`
    (`build` gives those of `SCHEDULES`, one stage per device)."""
    v = virtual(schedule)
    if stages < v or stages % v or microbatches < 1:
        raise OnnxpipeError(
            f"schedule {schedule} needs a multiple of {v} stages and at least 1 micro-batch (got {plural(stages, 'stage')}, {plural(microbatches, 'micro-batch')})"
        )
    result = TABLES[schedule][0](stages, microbatches)
    ensure_valid(result)
    return result


def stage_rows(table: Table) -> tuple[int, ...]:
    """The row (device) that runs each stage, by stage index, of a table with one row per device."""
    rows: dict[int, int] = {}
    for r, actions in enumerate(table):
        for a in actions:
            if rows.setdefault(a.stage, r) != r:
                raise OnnxpipeError(f"stage {a.stage} has actions on rows {rows[a.stage]} and {r}; a replicated table has no one row per stage")
    return tuple(rows[s] for s in range(len(rows)))


def placement(schedule: str, stages: int) -> tuple[int, ...]:
    """The device (row) of each stage under a schedule: s, s % devices (interleaved) or the V of ZB-V."""
    return stage_rows(table(schedule, stages, max(1, stages // virtual(schedule))))
