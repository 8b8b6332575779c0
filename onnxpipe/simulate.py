"""Event-driven simulation of a plan's schedule on its target: the timeline, the bubble, memory over time.

Reading order: `Event`, `Simulation` (the frozen result) -> `simulate` (public entry) ->
`_stage_costs` (what one stage costs per micro-batch under the chosen micro-batch count) ->
`_run` (the event loop over the lowered action table, with `_Links` sharing link bandwidth and
`_Cores` assigning a host's cores).

Model, in one paragraph. Each stage runs the actions of `schedule.add_communication(table)` in
order on its device(s). F and B take the plan's per-micro-batch seconds (a recomputing stage's
backward seconds already include its second forward) plus the device's fixed `action_overhead`;
B also hands the stage's weight gradients to the executor, which sums them over the micro-batches
(gradient bytes / the device's `gradient_bandwidth`, measured: the profile's node times miss it).
SEND starts a transfer and does not block the sender; RECV blocks until the matching transfer has
arrived. Every directed device pair is one physical link channel: transfers in flight on it share
its bandwidth equally (processor sharing), then pay its latency. On "shm" links (worker processes
on one host) the sending process does the copying, so it is blocked until its transfer has arrived;
other links move data in the background (DMA). An "shm" link with the workers' CPU per message
(`send_overhead`, `send_bandwidth`, `recv_overhead`: measured, tools/measure_cpu.py messages) prices
the copy as the sender's CPU instead: a SEND takes send_overhead + bytes / send_bandwidth on a core
and the message arrives its latency (the wake-up) later; a RECV whose message has arrived takes
recv_overhead on a core before the worker's next action. On a target with `cores`, the F and B of its cpu
devices run on that many cores (less what `background` work takes): a worker that becomes
runnable takes a free core or waits for one, as the OS assigns them (`_Cores`); with the target's
`time_slice` (measured), a worker that computes through a slice while others wait goes to the back
of the queue and the first waiting takes its core (round robin), else it keeps the core until it
blocks. An action's event spans its wall time, waits between its slices included. With the target's
`switch_cost` (measured), a worker that gets a core another worker held last does that much more work
(its caches refill). While two or more
workers compute at once and their working sets (static memory plus one micro-batch's stash each)
together overflow the target's `shared_cache`, each action runs slower by its stage's
`corun_slowdown` (the plan's, from the target's `corun_bandwidth`: its weights and their gradients
come from memory, fought over; measured, tools/measure_cpu.py). `cores` is measured with workers
whose working sets fit the shared cache together, so the two do not count the same contention twice.
A replicated stage runs one worker per device, as the executor does: replica j of stage s runs
the micro-batches i with i % r == j (`schedule.replicate`) at the full per-micro-batch time (a
plan's per-micro-batch seconds of a replicated stage are throughput figures, busy / r), and
receives each from, and sends each to, the replica of the neighbouring stage that owns it. STEP
waits for every other holder of its weights (its replicas, and for tied weights every worker of
the stages holding a copy: `StagePlan.tied`) to reach its STEP, then exchanges gradients with them
(ring all-reduces) and runs the optimizer step (one pass over
parameters, gradients and optimizer state at the device's memory bandwidth). The iteration ends the
devices' `step_overhead` after the last STEP (the driver's share of a step: posting, starting, collecting).

Definitions shared with the executor's measurements:
- `iteration_seconds`: from the first action to the end of the last STEP, plus the step overhead.
- `busy_seconds[s]`: seconds stage s spends computing: F, B and the optimizer step (not
  transfers, not all-reduce); for a replicated stage the largest over its replicas, each
  replica's own in `replica_busy_seconds[s]` (JSON: the stage entry's `replicas` list).
- `peak_memory_bytes[s]`: likewise the largest over the stage's replicas.
- `bubble_fraction = 1 - sum of every worker's busy seconds / (workers * iteration_seconds)`,
  one worker per (stage, replica).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from onnxpipe import schedule as sched
from onnxpipe.errors import OnnxpipeError
from onnxpipe.plan.result import Plan, StagePlan
from onnxpipe.pricing.timemodel import allreduce_seconds, message_cpu
from onnxpipe.target import HostModel, Target, load_target

__all__ = ["EVENT_KINDS", "Event", "Simulation", "simulate", "read_plan", "plan_target", "stash_bytes"]

#: Kinds of timeline events. SEND/RECV span a transfer from its start to its arrival.
EVENT_KINDS = ("F", "B", "SEND", "RECV", "ALLREDUCE", "STEP")
#: Kinds that count as busy.
_COMPUTE = ("F", "B", "STEP")


@dataclass(frozen=True)
class Event:
    """One bar of the Gantt chart: what a stage did and when (seconds from the start of the iteration)."""

    stage: int
    #: One of EVENT_KINDS.
    kind: str
    #: Micro-batch index; -1 for ALLREDUCE and STEP.
    microbatch: int
    start: float
    end: float
    #: Which replica of the stage (0 when it is not replicated).
    replica: int = 0


@dataclass(frozen=True)
class Simulation:
    """The predicted timeline of one training iteration, and its figures."""

    schedule: str
    microbatches: int
    #: Global batch per iteration (samples).
    batch: int
    iteration_seconds: float
    #: batch / iteration_seconds.
    samples_per_s: float
    #: 1 - sum(busy) / (workers * iteration_seconds) over every (stage, replica): the share of worker time without compute.
    bubble_fraction: float
    #: Per stage: seconds of compute (F, B, optimizer step) in the iteration (the most over its replicas).
    busy_seconds: tuple[float, ...]
    #: Per stage: peak bytes on one of its devices (parameters + gradients + optimizer + live activations).
    peak_memory_bytes: tuple[float, ...]
    #: Per stage: bytes of parameters, gradients and optimizer state (held all the time).
    static_memory_bytes: tuple[float, ...]
    #: Per stage: memory capacity of its device.
    capacity_bytes: tuple[float, ...]
    #: Per stage: its device instance names.
    devices: tuple[tuple[str, ...], ...]
    events: tuple[Event, ...]
    #: Per stage: (time, bytes) samples of a step function, starting at (0, static memory), of its fullest replica.
    memory: tuple[tuple[tuple[float, float], ...], ...]
    #: Per stage, per replica: busy seconds and peak bytes.
    replica_busy_seconds: tuple[tuple[float, ...], ...] = ()
    replica_peak_memory_bytes: tuple[tuple[float, ...], ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The figures `onnxpipe train --json` reports, under the same names and layout, plus the timeline."""
        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "batch": self.batch,
            "iteration_seconds": self.iteration_seconds,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": self.bubble_fraction,
            "stages": [
                {
                    "stage": s,
                    "devices": list(self.devices[s]),
                    "busy_seconds": self.busy_seconds[s],
                    "peak_memory_bytes": self.peak_memory_bytes[s],
                    "capacity_bytes": self.capacity_bytes[s],
                    "replicas": [
                        {"replica": j, "busy_seconds": b, "peak_memory_bytes": m}
                        for j, (b, m) in enumerate(zip(self.replica_busy_seconds[s], self.replica_peak_memory_bytes[s]))
                    ],
                }
                for s in range(len(self.devices))
            ],
            "events": [[e.stage, e.kind, e.microbatch, e.start, e.end, e.replica] for e in self.events],
        }


@dataclass(frozen=True)
class _StageCost:
    """What one stage costs per micro-batch, at the simulated micro-batch size."""

    forward: float
    #: Backward seconds (including the recomputed forward when the stage recomputes).
    backward: float
    #: Bytes of activations sent per micro-batch (gradients of the same size come back).
    out_bytes: float
    #: Bytes stashed per micro-batch from its F until its B.
    stash: float
    #: Extra bytes held while its backward runs (the recomputed activations).
    during_backward: float
    #: Gradient exchange at STEP: the all-reduce over its replicas, and over every holder of its tied weights.
    allreduce: float
    step: float


def simulate(
    plan: Plan, target: Target, *, schedule: str | None = None, microbatches: int | None = None, background: float = 0.0
) -> Simulation:
    """Simulate one training iteration of `plan` on `target`.

    `schedule` and `microbatches` override the plan's; the global batch stays the same, so
    per-micro-batch times, transfers and stashes scale linearly with the micro-batch size, and
    the number of micro-batches in flight is re-derived from the new table. `background`: runnable
    processes of other work competing for a target's shared `cores` (a measured run queue), 0 on a
    quiet machine.
    """
    name = schedule or plan.schedule
    m = microbatches or plan.microbatches
    if m > plan.batch:
        raise OnnxpipeError(f"{m} micro-batches exceed the batch of {plan.batch}; pass --microbatches at most {plan.batch}")
    _ensure_devices(plan, target)
    table = sched.build(name, len(plan.stages), m)
    costs = tuple(_stage_cost(plan, stage, target, m) for stage in plan.stages)
    events, memory, end = _run(plan, target, table, costs, background)
    places = _places(plan)
    busy_w = [sum(e.end - e.start for e in events if (e.stage, e.replica) == place and e.kind in _COMPUTE) for place in places]
    peak_w = [max(b for _, b in samples) for samples in memory]
    mine = [[w for w, (s, _) in enumerate(places) if s == i] for i in range(len(plan.stages))]
    fullest = [max(ws, key=lambda w: peak_w[w]) for ws in mine]
    iteration = end + max(target.device(d).step_overhead for stage in plan.stages for d in stage.devices)
    bubble = 1.0 - sum(busy_w) / (len(places) * iteration) if iteration > 0 else 0.0
    return Simulation(
        schedule=name,
        microbatches=m,
        batch=plan.batch,
        iteration_seconds=iteration,
        samples_per_s=plan.batch / iteration if iteration > 0 else math.inf,
        bubble_fraction=bubble,
        busy_seconds=tuple(max(busy_w[w] for w in ws) for ws in mine),
        peak_memory_bytes=tuple(peak_w[w] for w in fullest),
        static_memory_bytes=tuple(_static_bytes(s) for s in plan.stages),
        capacity_bytes=tuple(s.memory.capacity for s in plan.stages),
        devices=tuple(s.devices for s in plan.stages),
        events=events,
        memory=tuple(memory[w] for w in fullest),
        replica_busy_seconds=tuple(tuple(busy_w[w] for w in ws) for ws in mine),
        replica_peak_memory_bytes=tuple(tuple(peak_w[w] for w in ws) for ws in mine),
    )


def _places(plan: Plan) -> list[tuple[int, int]]:
    """(stage, replica) of every worker, stage-major (the executor's worker order)."""
    return [(s, j) for s, stage in enumerate(plan.stages) for j in range(len(stage.devices))]


def read_plan(path: str | os.PathLike) -> Plan:
    """A plan from its JSON file or from a stage directory (which holds plan.json)."""
    path = Path(path)
    if path.is_dir():
        if not (path / "plan.json").is_file():
            raise OnnxpipeError(f"{path}: no plan.json in this directory; pass a plan JSON or a directory written by `onnxpipe split`")
        path = path / "plan.json"
    return Plan.read(path)


def plan_target(plan: Plan, target: str | None = None) -> Target:
    """The target named by `target`, else the one the plan was made for."""
    return load_target(target or plan.target)


def stash_bytes(plan: Plan, stage: StagePlan) -> tuple[float, float]:
    """(bytes stashed per micro-batch, extra bytes held during a backward) on the replica that runs it,
    at the plan's own micro-batch size.

    The peak activations of a plan are held x stash without recompute, and held x inputs + one
    micro-batch's full activations (rebuilt during its backward) with recompute; held = ceil(in flight
    / replicas), the whole micro-batches one replica holds at once. The stash is the
    plan's `stash_bytes` when given, else derived from the peak (inputs = the bytes it receives).
    """
    table = sched.build(plan.schedule, len(plan.stages), plan.microbatches)
    # A replica holds whole micro-batches: the most of any `in flight` consecutive ones it owns.
    live = math.ceil(max(sched.in_flight(table[stage.index]), 1) / len(stage.devices))
    if not stage.recompute:
        return stage.stash_bytes or stage.memory.activations / live, 0.0
    inputs = min(stage.stash_bytes or stage.comm_in_bytes, stage.memory.activations / live)
    return inputs, stage.memory.activations - live * inputs


def _static_bytes(stage: StagePlan) -> float:
    return stage.memory.parameters + stage.memory.gradients + stage.memory.optimizer


def _stage_cost(plan: Plan, stage: StagePlan, target: Target, m: int) -> _StageCost:
    """Per micro-batch on one replica. A replicated stage's plan times are per-micro-batch shares
    (busy / r); a replica runs whole micro-batches, so it takes r times as long per micro-batch. Its
    stash is already per whole micro-batch (`stash_bytes`)."""
    scale = plan.microbatches / m
    whole = scale * len(stage.devices)
    stash, during = stash_bytes(plan, stage)
    bandwidth = min(target.device(d).memory_bandwidth for d in stage.devices)
    step_bytes = 2 * stage.memory.parameters + stage.memory.gradients + 2 * stage.memory.optimizer
    overhead = max(target.device(d).action_overhead for d in stage.devices)
    rates = (target.device(d).gradient_bandwidth for d in stage.devices)
    handing = max((stage.memory.gradients / rate for rate in rates if rate), default=0.0)
    return _StageCost(
        forward=stage.forward_seconds * whole + overhead,
        backward=stage.backward_seconds * whole + overhead + handing,
        out_bytes=stage.comm_out_bytes * scale,
        stash=stash * scale,
        during_backward=during * scale,
        allreduce=allreduce_seconds(target, stage.devices, stage.memory.gradients)
        + allreduce_seconds(target, tuple(d for s in sorted({stage.index, *stage.tied}) for d in plan.stages[s].devices), stage.tied_bytes),
        step=step_bytes / bandwidth,
    )


def _ensure_devices(plan: Plan, target: Target) -> None:
    names = {d.name for d in target.devices}
    for stage in plan.stages:
        if not stage.devices:
            raise OnnxpipeError(f"plan stage {stage.index} has no device; regenerate the plan with `onnxpipe plan`")
        for d in stage.devices:
            if d not in names:
                raise OnnxpipeError(
                    f"plan stage {stage.index} runs on {d!r}, which target {target.name!r} does not have; pass the plan's own target with --target"
                )


class _Links:
    """Transfers in flight per directed device pair; bandwidth is split equally among those on one pair."""

    def __init__(self, target: Target) -> None:
        self._target = target
        #: (src, dst) -> [remaining bytes, transfer key] per shard in flight.
        self.active: dict[tuple[str, str], list[list[Any]]] = {}
        #: (arrival time, key) of transfers whose bytes are through and that wait out the latency.
        self.landing: list[tuple[float, Any]] = []

    def start(self, now: float, src: str, dst: str, nbytes: float, key: Any) -> None:
        if src == dst or nbytes <= 0:
            self.landing.append((now, key))
        else:
            self.active.setdefault((src, dst), []).append([nbytes, key])

    def land(self, at: float, key: Any) -> None:
        """A message copied by its sender's CPU (already priced) arrives at `at`."""
        self.landing.append((at, key))

    def next_time(self, now: float) -> float:
        times = [t for t, _ in self.landing]
        for pair, flows in self.active.items():
            if flows:
                rate = self._target.link(*pair).bandwidth / len(flows)
                times.append(now + min(f[0] for f in flows) / rate)
        return min(times, default=math.inf)

    def advance(self, now: float, later: float) -> list[Any]:
        """Move bytes from now to later; return the keys that have arrived by `later`."""
        for pair, flows in self.active.items():
            if not flows:
                continue
            link = self._target.link(*pair)
            rate = link.bandwidth / len(flows)
            # Same expression as next_time, so the flow that set `later` finishes exactly then.
            done = [f for f in flows if now + f[0] / rate <= later]
            for f in flows:
                f[0] -= (later - now) * rate
            for f in done:
                flows.remove(f)
                self.landing.append((later + link.latency, f[1]))
        arrived = [key for t, key in self.landing if t <= later]
        self.landing = [(t, key) for t, key in self.landing if t > later]
        return arrived


class _Cores:
    """cpu workers on the target's cores, assigned as the OS scheduler does: a worker holds a core from
    when it becomes runnable until it blocks (waits for a transfer that has not arrived, or for the other
    holders at STEP, or has finished its row), not only while it computes (sends, receives and their
    bookkeeping take the processor too). A worker that needs a core to compute while ceil(available) are
    held waits, first come first served, until one is released; the holders share the available cores
    (min(1, available / holders) each). With the target's `time_slice` (measured: the scheduler preempts
    a busy process after it while others are runnable), holding runs in slices from when the worker got
    its core: at the end of a slice during which workers wait, a computing holder goes to the back of
    the queue with the rest of its action and the first waiting worker takes the core (round robin; the
    action's event spans it all, waits included, as the executor times it). Without it, a holder keeps its
    core until it blocks (the OS for actions shorter than its slices). Cores have identities: a worker
    takes the free core it held last, else one nobody has held, else the first free one; when another
    worker held that core last, its action gets the target's `switch_cost` of extra work (caches and TLB
    refill). While other workers compute too
    and the computing workers' working sets (static memory plus one micro-batch's stash each) overflow
    the target's `shared_cache`, a worker's action runs 1 + its stage's `corun_slowdown` times slower
    (their weights come from memory, fought over).

    Other work (`background` runnable processes) takes whole cores while it leaves some, as measured:
    with one busy process beside two workers on two cores, the workers take turns on the other core.
    Beyond that, the workers together keep a 1 / (1 + background) share:
    available = max(cores - background, cores / (1 + background))."""

    def __init__(self, plan: Plan, target: Target, costs: tuple[_StageCost, ...], background: float) -> None:
        host = target.host or HostModel()
        self.cores = max(host.cores - background, host.cores / (1 + background))
        self._cache = host.shared_cache
        self._slice = host.time_slice
        self._switch = host.switch_cost
        self._slots = max(1, math.ceil(self.cores - 1e-9))
        #: Per core: the worker that held it last (None: nobody yet); per holder: its core.
        self._last: list[int | None] = [None] * self._slots
        self._core: dict[int, int] = {}
        #: Per worker (stage-major): whether it computes on the shared cores.
        self.shared = tuple(host.cores > 0 and target.device(d).kind == "cpu" for st in plan.stages for d in st.devices)
        #: Per worker: its stage's slowdown beside others, and the bytes it keeps touching.
        self._corun = tuple(st.corun_slowdown for st in plan.stages for _ in st.devices)
        self._working = tuple(_static_bytes(st) + costs[s].stash for s, st in enumerate(plan.stages) for _ in st.devices)
        #: worker -> [seconds of work left at full speed, op, micro-batch, start of the action].
        self.active: dict[int, list[Any]] = {}
        #: Workers holding a core (computing or not) -> when they got it.
        self._holding: dict[int, float] = {}
        #: Runnable workers waiting for a core, in arrival order, with their action (start None until it first runs).
        self._waiting: list[tuple[int, list[Any]]] = []

    def start(self, now: float, worker: int, work: float, op: str, microbatch: int) -> None:
        if worker in self._holding:
            self.active[worker] = [work, op, microbatch, now]
        else:
            self._waiting.append((worker, [work, op, microbatch, None]))
            self._assign(now)

    def release(self, now: float, worker: int) -> None:
        """The worker blocks: its core goes to the next one waiting."""
        if worker in self._holding and worker not in self.active:
            self._drop(worker)
            self._assign(now)

    def _drop(self, worker: int) -> None:
        del self._holding[worker]
        del self._core[worker]

    def _assign(self, now: float) -> None:
        while self._waiting and len(self._holding) < self._slots:
            worker, job = self._waiting.pop(0)
            free = [c for c in range(self._slots) if c not in self._core.values()]
            core = next((c for c in free if self._last[c] == worker), next((c for c in free if self._last[c] is None), free[0]))
            cold = self._last[core] not in (None, worker)
            self._core[worker], self._last[core] = core, worker
            self._holding[worker] = now
            self.active[worker] = [job[0] + (self._switch if cold else 0.0), job[1], job[2], now if job[3] is None else job[3]]

    def _slice_end(self, worker: int, now: float) -> float:
        """The end of the holder's slice running at `now` (the next one when one ends exactly then)."""
        got = self._holding[worker]
        return got + self._slice * (math.floor((now - got) / self._slice + 1e-9) + 1)

    def _preempting(self) -> bool:
        return bool(self._slice and self._waiting)

    def _rates(self) -> dict[int, float]:
        share = min(1.0, self.cores / len(self._holding))
        crowded = len(self.active) > 1 and sum(self._working[w] for w in self.active) > self._cache
        # A message's CPU was measured beside a worker reading through memory: no slowdown on top.
        return {w: share / (1 + self._corun[w]) if crowded and job[1] in ("F", "B") else share for w, job in self.active.items()}

    def next_time(self, now: float) -> float:
        if not self.active:
            return math.inf
        rates = self._rates()
        ends = [self._slice_end(w, now) for w in self.active] if self._preempting() else []
        return min([now + job[0] / rates[w] for w, job in self.active.items()] + ends)

    def advance(self, now: float, later: float) -> list[tuple[int, str, int, float]]:
        """Do the work from now to later; return (worker, op, micro-batch, start) of the actions
        finished by `later` (their workers keep their cores until they block). Computing holders whose
        slice ends by `later` give their cores to as many waiting workers."""
        if not self.active:
            return []
        rates = self._rates()
        # Same expressions as next_time, so the action or slice that set `later` ends exactly then.
        done = [w for w, job in self.active.items() if now + job[0] / rates[w] <= later]
        due = sorted((self._holding[w], w) for w in self.active if w not in done and self._preempting() and self._slice_end(w, now) <= later)
        for w, job in self.active.items():
            job[0] -= (later - now) * rates[w]
        finished = [(w, *self.active.pop(w)[1:]) for w in done]
        waiting = len(self._waiting)
        for _, w in due[:waiting]:
            self._drop(w)
            self._waiting.append((w, self.active.pop(w)))
        self._assign(later)
        return finished


def _run(
    plan: Plan, target: Target, table: sched.Table, costs: tuple[_StageCost, ...], background: float
) -> tuple[tuple[Event, ...], tuple[tuple[tuple[float, float], ...], ...], float]:
    """The event loop over one row per worker (stage, replica): advance every worker as far as it can at
    `now`, then jump to the next event. Returns the events, memory samples per worker and the end time."""
    places = _places(plan)
    rows = sched.replicate(sched.add_communication(table), tuple(len(st.devices) for st in plan.stages))
    first = {s: places.index((s, 0)) for s in range(len(plan.stages))}

    def owner(stage: int, mb: int) -> int:
        return first[stage] + mb % len(plan.stages[stage].devices)

    n = len(rows)
    cursor = [0] * n
    free_at = [0.0] * n
    #: A sender on a copying ("shm") link waits for its transfer's arrival before its next action.
    blocked_on: list[tuple[str, int, int] | None] = [None] * n
    #: Per worker: the transfer key of the SEND or RECV whose CPU it is spending (links that charge it).
    message: list[tuple[str, int, int] | None] = [None] * n
    #: Transfer key ("F"|"B", receiving stage, micro-batch) -> start, arrival.
    started: dict[tuple[str, int, int], float] = {}
    arrived: dict[tuple[str, int, int], float] = {}
    #: Workers that reached their STEP: it starts once every replica of the stage is there (the all-reduce).
    at_step: set[int] = set()
    #: Per stage: the workers whose STEP exchanges gradients with its own (its replicas, the tied stages').
    holders = [[owner(t, i) for t in sorted({s, *st.tied}) for i in range(len(plan.stages[t].devices))] for s, st in enumerate(plan.stages)]
    events: list[Event] = []
    live = [_static_bytes(plan.stages[s]) for s, _ in places]
    memory: list[list[tuple[float, float]]] = [[(0.0, b)] for b in live]
    links = _Links(target)
    cores = _Cores(plan, target, costs, background)
    now = 0.0

    def mem(w: int, t: float, delta: float) -> None:
        live[w] += delta
        memory[w].append((t, live[w]))

    def finish(w: int, op: str, mb: int, start: float, end: float) -> None:
        s, j = places[w]
        free_at[w] = end
        if op.startswith("SEND"):  # its event spans until arrival, added then
            key, message[w] = message[w], None
            links.land(end + target.link(*link_of(key)).latency, key)
            return
        if op.startswith("RECV"):
            key, message[w] = message[w], None
            events.append(Event(s, "RECV", mb, started[key], end, j))
            return
        events.append(Event(s, op, mb, start, end, j))
        if op == "B":
            mem(w, end, -costs[s].stash - costs[s].during_backward)

    def link_of(key: tuple[str, int, int]) -> tuple[str, str]:
        """(sender's device, receiver's device) of a transfer."""
        kind, receiver, mb = key
        src, dst = places[owner(receiver - 1 if kind == "F" else receiver + 1, mb)], places[owner(receiver, mb)]
        return plan.stages[src[0]].devices[src[1]], plan.stages[dst[0]].devices[dst[1]]

    def compute(w: int, work: float, op: str, mb: int) -> None:
        """Run `work` seconds of the worker's CPU: on the shared cores, or on its own device."""
        if cores.shared[w]:
            cores.start(now, w, work, op, mb)
            free_at[w] = math.inf
        else:
            finish(w, op, mb, now, now + work)

    while True:
        progressed = True
        while progressed:
            progressed = False
            for w in range(n):
                s, j = places[w]
                device = plan.stages[s].devices[j]
                waits = False
                while cursor[w] < len(rows[w]) and free_at[w] <= now:
                    if blocked_on[w] is not None:
                        if blocked_on[w] not in arrived:
                            break
                        blocked_on[w] = None
                    a, c = rows[w][cursor[w]], costs[s]
                    if a.op in ("RECV_F", "RECV_B"):
                        key = (a.op[-1], s, a.microbatch)
                        if key not in arrived:
                            waits = True
                            break
                        src, dst = link_of(key)
                        cpu = message_cpu(target, src, dst)
                        if cpu is not None:
                            message[w] = key
                            compute(w, cpu.recv_overhead, a.op, a.microbatch)
                        else:
                            events.append(Event(s, "RECV", a.microbatch, started[key], arrived[key], j))
                    elif a.op in ("SEND_F", "SEND_B"):
                        kind, peer = ("F", s + 1) if a.op == "SEND_F" else ("B", s - 1)
                        key = (kind, peer, a.microbatch)
                        nbytes = c.out_bytes if kind == "F" else costs[peer].out_bytes
                        dst = plan.stages[peer].devices[places[owner(peer, a.microbatch)][1]]
                        started[key] = now
                        cpu = message_cpu(target, device, dst)
                        if cpu is not None:
                            message[w] = key
                            compute(w, cpu.send_seconds(nbytes), a.op, a.microbatch)
                        else:
                            links.start(now, device, dst, nbytes, key)
                            if device != dst and target.link(device, dst).topology == "shm":
                                blocked_on[w] = key
                    elif a.op in ("F", "B"):
                        mem(w, now, c.stash if a.op == "F" else c.during_backward)
                        compute(w, c.forward if a.op == "F" else c.backward, a.op, a.microbatch)
                    else:  # STEP
                        at_step.add(w)
                        if any(h not in at_step for h in holders[s]):
                            waits = True
                            break
                        if c.allreduce > 0:
                            events.append(Event(s, "ALLREDUCE", -1, now, now + c.allreduce, j))
                        free_at[w] = now + c.allreduce + c.step
                        events.append(Event(s, "STEP", -1, now + c.allreduce, free_at[w], j))
                    cursor[w] += 1
                    progressed = True
                if cores.shared[w] and (waits or cursor[w] == len(rows[w]) and free_at[w] <= now):
                    cores.release(now, w)
        if all(cursor[w] == len(rows[w]) for w in range(n)):
            break
        later = min([t for t in free_at if t > now] + [links.next_time(now), cores.next_time(now)])
        if math.isinf(later):
            stuck = next(w for w in range(n) if cursor[w] < len(rows[w]))
            raise OnnxpipeError(f"simulation stalled: stage {places[stuck][0]} waits forever at {rows[stuck][cursor[stuck]]}")
        for w, op, mb, start in cores.advance(now, later):
            finish(w, op, mb, start, later)
        for key in links.advance(now, later):
            arrived[key] = later
            kind, receiver, mb = key
            sender = owner(receiver - 1 if kind == "F" else receiver + 1, mb)
            events.append(Event(places[sender][0], "SEND", mb, started[key], later, places[sender][1]))
        now = later
    end = max(free_at)
    # Changes at one instant (a backward freeing, the next forward stashing) become one sample.
    memory = [[p for i, p in enumerate(samples) if i + 1 == len(samples) or samples[i + 1][0] != p[0]] for samples in memory]
    events.sort(key=lambda e: (e.stage, e.replica, e.start, e.kind))
    return tuple(events), tuple(tuple(m) for m in memory), end
