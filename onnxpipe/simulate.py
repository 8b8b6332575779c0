"""Event-driven simulation of a schedule table over priced stages on a target: the timeline, the bubble,
memory over time. It reads one `StageCost` per stage (`onnxpipe.pricing.stage`), never a plan.

Reading order: `Event`, `Simulation` (the frozen result) -> `simulate` (public entry) -> `_Run` (the
event loop over the lowered action table: `step` advances every worker as far as it can, one small
method per action kind), with `_Links` sharing link bandwidth and `_Cores` assigning a host's cores.

Model, in one paragraph. Each stage runs the actions of `schedule.add_communication(table)` in
order on its device(s). F and B take the stage's per-micro-batch seconds (a recomputing stage's
backward seconds already include its second forward) plus the device's fixed `action_overhead`;
B also hands the stage's weight gradients to the executor, which sums them over the micro-batches
(gradient bytes / the device's `gradient_bandwidth`, measured: the profile's node times miss it).
Where the table splits a stage's backward (ZB-H1, ZB-V), B takes its backward less its `weight`
seconds and W the weight seconds and the hand-off; the stash stays from F until W (what W reads).
A device that holds several stages (interleaved 1F1B, ZB-V: `schedule.stage_rows`) is one worker
running all their actions in its row's order, on the devices of the row's first stage.
SEND starts a transfer and does not block the sender; RECV blocks until the matching transfer has
arrived. Every directed device pair is one physical link channel: transfers in flight on it share
its bandwidth equally (processor sharing), then pay its latency. On "shm" links (worker processes
on one host) the sending process does the copying, so it is blocked until its transfer has arrived;
other links move data in the background (DMA). An "shm" link with the workers' CPU per message
(`send_overhead`, `send_bandwidth`, `recv_overhead`, `recv_bandwidth`: measured, tools/measure_cpu.py messages) prices
the copy as the sender's CPU instead: a SEND takes send_overhead + bytes / send_bandwidth on a core
and the message arrives its latency (the wake-up) later; a RECV whose message has arrived takes
recv_overhead + bytes / recv_bandwidth on a core before the worker's next action. On a target whose host model has `cores`, the F and B of its cpu
devices run on that many cores (less what `background` work takes): a worker that becomes
runnable takes a free core or waits for one, as the OS assigns them (`_Cores`); with the host's
`wake_affine` (measured), a worker woken by a message while every core is busy queues on its waker's core
and takes it first, and a core that falls idle pulls a waiting worker from the others; with the host's
`time_slice` (measured), a worker that computes through a slice while others wait for its core goes to the
back of the queue and the first waiting takes its core (round robin), else it keeps the core until it
blocks. An action's event spans its wall time, waits between its slices included. With the host's
`switch_cost` (measured), a worker that gets a core another worker held last does that much more work
(its caches refill); where the workers' working sets (static memory, one micro-batch's stash and the
messages in and out of it, each) together overflow the host's `shared_cache`, the others have evicted its
working set: the rest of its action runs slower by its whole working set's read-back at the host's
`switch_bandwidth` (measured) spread over the whole action (it reads back what the rest touches), instead. While two or more
workers compute at once and their working sets
together overflow the host's `shared_cache`, each action runs slower by its stage's
`corun_slowdown` (the stage cost's, from the host's `corun_bandwidth`: its weights and their gradients
come from memory, fought over; measured, tools/measure_cpu.py). `cores` is measured with workers
whose working sets fit the shared cache together, so the two do not count the same contention twice.
A replicated stage runs one worker per device, as the executor does: replica j of stage s runs
the micro-batches i with i % r == j (`schedule.replicate`) at the full per-micro-batch time (a
stage cost's per-micro-batch seconds of a replicated stage are throughput figures, busy / r), and
receives each from, and sends each to, the replica of the neighbouring stage that owns it. STEP
waits for every other holder of its weights (its replicas, and for tied weights every worker of
the stages holding a copy: `StageCost.tied`) to reach its STEP, then exchanges gradients with them
(ring all-reduces) and runs the optimizer step (one pass over
parameters, gradients and optimizer state at the device's memory bandwidth). The iteration ends the
devices' `step_overhead` after the last STEP (the driver's share of a step: posting, starting, collecting).

Definitions shared with the executor's measurements:
- `iteration_seconds`: from the first action to the end of the last STEP, plus the step overhead.
- `busy_seconds[s]`: seconds stage s spends computing: F, B, W and the optimizer step (not
  transfers, not all-reduce); for a replicated stage the largest over its replicas, each
  replica's own in `replica_busy_seconds[s]` (JSON: the stage entry's `replicas` list).
- `peak_memory_bytes[s]`: likewise the largest over the stage's replicas (of its device, which
  holds every stage on it).
- `bubble_fraction = 1 - sum of every worker's busy seconds / (workers * iteration_seconds)`,
  one worker per (stage, replica), or per (device, replica) when a device holds several stages.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from onnxpipe import schedule as sched
from onnxpipe.errors import OnnxpipeError
from onnxpipe.pricing.stage import StageCost
from onnxpipe.pricing.timemodel import message_cpu
from onnxpipe.target import HostModel, Target

__all__ = ["EVENT_KINDS", "Event", "Simulation", "simulate", "pipeline_latency"]

#: Kinds of timeline events. SEND/RECV span a transfer from its start to its arrival.
EVENT_KINDS = ("F", "B", "W", "SEND", "RECV", "ALLREDUCE", "STEP")


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
    #: An inference pipeline's latency: the span of micro-batch 0 from the start of the first stage's forward
    #: to the end of the last stage's, which enters an empty pipeline, so it is the sum along the pipeline of
    #: forward and transfer times (later micro-batches may also queue behind the bottleneck).
    latency_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """The figures `onnxpipe train --json` reports, under the same names and layout, plus the timeline."""
        return {
            "schedule": self.schedule,
            "microbatches": self.microbatches,
            "batch": self.batch,
            "iteration_seconds": self.iteration_seconds,
            "samples_per_s": self.samples_per_s,
            "bubble_fraction": self.bubble_fraction,
            "latency_seconds": self.latency_seconds,
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


def simulate(table: sched.Table, stages: tuple[StageCost, ...], target: Target, *, schedule: str, batch: int, background: float = 0.0) -> Simulation:
    """Simulate one training iteration of the schedule `table` (named `schedule`, for the record) over
    `stages`, priced at the table's micro-batch size, on `target`, for a global batch of `batch` samples.
    `background`: runnable processes of other work competing for the host's shared `cores` (a measured
    run queue), 0 on a quiet machine."""
    run = _Run(table, stages, target, background)
    events, memory, end = run.run()
    places = run.places
    busy_w = [0.0] * len(places)
    #: Per stage, per replica: its own compute (a device holding several stages splits its busy time among them).
    busy_s = [[0.0] * c.replicas for c in stages]
    for e in events:
        if e.kind in sched.COMPUTE_OPS:  # the kinds that count as busy
            busy_w[run.worker(e.stage, e.replica)] += e.end - e.start
            busy_s[e.stage][e.replica] += e.end - e.start
    peak_w = [max(b for _, b in samples) for samples in memory]
    mine = [[run.worker(i, j) for j in range(c.replicas)] for i, c in enumerate(stages)]
    fullest = [max(ws, key=lambda w: peak_w[w]) for ws in mine]
    iteration = end + max(c.step_overhead for c in stages)
    bubble = 1.0 - sum(busy_w) / (len(places) * iteration) if iteration > 0 else 0.0
    return Simulation(
        schedule=schedule,
        microbatches=len({a.microbatch for a in table[0] if a.op == "F"}),
        batch=batch,
        iteration_seconds=iteration,
        samples_per_s=batch / iteration if iteration > 0 else math.inf,
        bubble_fraction=bubble,
        busy_seconds=tuple(max(b) for b in busy_s),
        peak_memory_bytes=tuple(peak_w[w] for w in fullest),
        static_memory_bytes=tuple(c.memory.static for c in stages),
        capacity_bytes=tuple(c.memory.capacity for c in stages),
        devices=tuple(c.devices for c in stages),
        events=events,
        memory=tuple(memory[w] for w in fullest),
        replica_busy_seconds=tuple(tuple(b) for b in busy_s),
        replica_peak_memory_bytes=tuple(tuple(peak_w[w] for w in ws) for ws in mine),
        latency_seconds=pipeline_latency(events, len(stages)),
    )


def pipeline_latency(events: Sequence[Event], stages: int) -> float:
    """Micro-batch 0's span from its first forward start (stage 0) to its last forward end."""
    start = [e.start for e in events if e.kind == "F" and e.stage == 0 and e.microbatch == 0]
    end = [e.end for e in events if e.kind == "F" and e.stage == stages - 1 and e.microbatch == 0]
    return max(end) - min(start) if start and end else 0.0


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


@dataclass(slots=True)
class _Job:
    """One action on the shared cores (mutable: its work left shrinks as it runs)."""

    #: Seconds of work left at full speed.
    left: float
    op: str
    microbatch: int
    #: When it first got a core (None until then).
    start: float | None
    #: Seconds of the whole action's work: a switch-in's read-back is spread over it.
    whole: float
    #: How many times slower the rest of it runs (a switch-in's read-back; 1: none).
    slowdown: float = 1.0


def _job(work: float, op: str, microbatch: int, start: float | None) -> _Job:
    return _Job(work, op, microbatch, start, work)


class _Cores:
    """cpu workers on the host's cores, assigned as the OS scheduler does: a worker holds a core from
    when it becomes runnable until it blocks (waits for a transfer that has not arrived, or for the other
    holders at STEP, or has finished its row), not only while it computes (sends, receives and their
    bookkeeping take the processor too). A worker that needs a core to compute while ceil(available) are
    held waits until one is released: in the host's queue, first come first served, or, with the host's
    `wake_affine` (measured: the OS puts a worker woken while every core is busy on its waker's core, where
    it runs first), in the queue of its waker's core, taking that core at once and putting its holder first
    in that queue. A released core goes to the first in its own queue, else the first in the host's queue,
    else the first in the longest other core's queue (an idle core pulls work). The holders share the
    available cores (min(1, available / holders) each). With the host's `time_slice` (measured: the scheduler
    preempts a busy process after it while others are runnable), holding runs in slices from when the worker
    got its core: at the end of a slice during which workers wait for that core (in its queue, else in the
    host's), a computing holder goes to the back of that queue with the rest of its action and the first
    waiting takes the core (round robin; the action's event spans it all, waits included, as the executor
    times it). Without it, a holder keeps its core until it blocks (the OS for actions shorter than its
    slices). Cores have identities: a worker takes the free core it held last, else one nobody has held, else
    the first free one; when another worker held that core last, its action (or its next, when it got the
    core between two) gets the host's `switch_cost` of extra work (caches and TLB refill), or, where the
    workers' working sets (static memory, one micro-batch's stash, its messages in and out) together overflow
    the host's `shared_cache`, the rest of the action runs 1 + (working set / the host's `switch_bandwidth`) /
    (the whole action's work) times slower (the others evicted it; what the rest touches comes back from
    memory). While other workers compute too
    and the computing workers' working sets overflow the host's `shared_cache`, a worker's action runs
    1 + its stage's `corun_slowdown` times slower (their weights come from memory, fought over).

    Other work (`background` runnable processes) takes whole cores while it leaves some, as measured:
    with one busy process beside two workers on two cores, the workers take turns on the other core.
    Beyond that, the workers together keep a 1 / (1 + background) share:
    available = max(cores - background, cores / (1 + background))."""

    def __init__(self, workers: list[tuple[StageCost, str]], target: Target, host: HostModel, background: float) -> None:
        self.cores = max(host.cores - background, host.cores / (1 + background))
        self._cache = host.shared_cache
        self._slice = host.time_slice
        self._affine = host.wake_affine
        self._slots = max(1, math.ceil(self.cores - 1e-9))
        #: Per core: the worker that held it last (None: nobody yet); per holder: its core.
        self._last: list[int | None] = [None] * self._slots
        self._core: dict[int, int] = {}
        #: Per worker (stage-major): whether it computes on the shared cores.
        self.shared = tuple(target.device(d).kind == "cpu" for _, d in workers)
        #: Per worker: its stage's slowdown beside others, and the bytes it keeps touching (its working set).
        self._corun = tuple(c.corun_slowdown for c, _ in workers)
        self._working = tuple(c.memory.static + c.stash + c.in_bytes + c.out_bytes for c, _ in workers)
        #: Whether the workers' working sets together overflow the shared cache: a worker switched in then reads
        #: back, at `switch_bandwidth`, what its action has yet to touch (the others evicted it); else it pays
        #: `switch_cost`. Per worker: seconds to read back its whole working set.
        self._spill = host.switch_bandwidth > 0 and sum(b for b, cpu in zip(self._working, self.shared) if cpu) > self._cache
        self._refill = tuple(b / host.switch_bandwidth for b in self._working) if self._spill else ()
        self._switch = host.switch_cost
        #: worker -> the action a holder runs.
        self.active: dict[int, _Job] = {}
        #: Holders that got their core cold between two actions: their next action pays the switch-in.
        self._cold: set[int] = set()
        #: Workers holding a core (computing or not) -> when they got it.
        self._holding: dict[int, float] = {}
        #: Runnable workers waiting for a core, in arrival order, with their action (None for a holder put back by
        #: a woken worker between two of its actions): the host's queue, and each core's own (`wake_affine`).
        self._waiting: list[tuple[int, _Job | None]] = []
        self._queues: list[list[tuple[int, _Job | None]]] = [[] for _ in range(self._slots)]

    def start(self, now: float, worker: int, work: float, op: str, microbatch: int, waker: int | None = None) -> None:
        """The worker runs an action of `work` seconds; `waker`: the worker whose message woke it, if one did."""
        if worker in self._holding:
            self.active[worker] = _job(work, op, microbatch, now)
            if worker in self._cold:
                self._cold.discard(worker)
                self._switch_in(worker, self.active[worker])
            return
        for queue in (self._waiting, *self._queues):
            at = next((i for i, (w, _) in enumerate(queue) if w == worker), None)
            if at is not None:  # put back between two of its actions: this one starts when it gets a core again
                queue[at] = (worker, _job(work, op, microbatch, None))
                return
        host = self._core.get(waker) if waker is not None else None
        if self._affine and host is not None and len(self._holding) == self._slots:
            holder = next(w for w, c in self._core.items() if c == host)
            self._queues[host].insert(0, (holder, self.active.pop(holder, None)))
            self._drop(holder)
            self._take(now, worker, host, _job(work, op, microbatch, None))
        else:
            self._waiting.append((worker, _job(work, op, microbatch, None)))
            self._assign(now)

    def release(self, now: float, worker: int) -> None:
        """The worker blocks: its core goes to the next one waiting."""
        if worker in self._holding and worker not in self.active:
            self._drop(worker)
            self._cold.discard(worker)
            self._assign(now)
        for queue in (self._waiting, *self._queues):
            queue[:] = [(w, job) for w, job in queue if w != worker or job is not None]

    def _drop(self, worker: int) -> None:
        del self._holding[worker]
        del self._core[worker]

    def _take(self, now: float, worker: int, core: int, job: _Job | None) -> None:
        """The worker gets `core` at `now`, with the rest of its action (None: between actions)."""
        cold = self._last[core] not in (None, worker)
        self._core[worker], self._last[core] = core, worker
        self._holding[worker] = now
        self._cold.discard(worker)
        if job is None:
            if cold:
                self._cold.add(worker)
            return
        if job.start is None:
            job.start = now
        self.active[worker] = job
        if cold:
            self._switch_in(worker, job)

    def _switch_in(self, worker: int, job: _Job) -> None:
        """The worker's action continues on a core another worker held last: `switch_cost` more work, or, where the
        working sets overflow the shared cache, the rest of the action runs slower by the share of the working set it
        reads back (its whole working set's refill seconds spread over the whole action: progress in any slice)."""
        if self._spill:
            job.slowdown = 1.0 + self._refill[worker] / job.whole if job.whole > 0 else 1.0
        else:
            job.left += self._switch

    def _assign(self, now: float) -> None:
        """Free cores go to their own queue's first, else the host queue's first, else the longest queue's first."""
        while len(self._holding) < self._slots:
            free = [c for c in range(self._slots) if c not in self._core.values()]
            own = next((c for c in free if self._queues[c]), None)
            if own is not None:
                worker, job = self._queues[own].pop(0)
                self._take(now, worker, own, job)
            elif self._waiting:
                worker, job = self._waiting.pop(0)
                core = next((c for c in free if self._last[c] == worker), next((c for c in free if self._last[c] is None), free[0]))
                self._take(now, worker, core, job)
            elif any(self._queues):
                longest = max(range(self._slots), key=lambda c: len(self._queues[c]))
                worker, job = self._queues[longest].pop(0)
                self._take(now, worker, free[0], job)
            else:
                return

    def _slice_end(self, worker: int, now: float) -> float:
        """The end of the holder's slice running at `now` (the next one when one ends exactly then)."""
        got = self._holding[worker]
        return got + self._slice * (math.floor((now - got) / self._slice + 1e-9) + 1)

    def _sliced(self) -> list[int]:
        """Computing holders whose slice can end with someone waiting for their core."""
        if not self._slice:
            return []
        return [w for w in self.active if w in self._holding and (self._queues[self._core[w]] or self._waiting)]

    def _rates(self) -> dict[int, float]:
        share = min(1.0, self.cores / len(self._holding)) if self._holding else 0.0
        computing = [w for w in self.active if w in self._holding]
        crowded = len(computing) > 1 and sum(self._working[w] for w in computing) > self._cache
        # A message's CPU was measured beside a worker reading through memory: no slowdown on top.
        return {w: (share / (1 + self._corun[w]) if crowded and self.active[w].op in ("F", "B", "W") else share) / self.active[w].slowdown
                for w in computing}

    def next_time(self, now: float) -> float:
        rates = self._rates()
        if not rates:
            return math.inf
        ends = [self._slice_end(w, now) for w in self._sliced()]
        return min([now + self.active[w].left / rate for w, rate in rates.items()] + ends)

    def advance(self, now: float, later: float) -> list[tuple[int, str, int, float]]:
        """Do the work from now to later; return (worker, op, micro-batch, start) of the actions
        finished by `later` (their workers keep their cores until they block). Computing holders whose
        slice ends by `later` give their cores to the first waiting: of their core's queue, else of the
        host's (as many as wait there)."""
        rates = self._rates()
        if not rates:
            return []
        # Same expressions as next_time, so the action or slice that set `later` ends exactly then.
        done = [w for w, rate in rates.items() if now + self.active[w].left / rate <= later]
        due = sorted((self._holding[w], w) for w in self._sliced() if w not in done and self._slice_end(w, now) <= later)
        for w, rate in rates.items():
            self.active[w].left -= (later - now) * rate
        jobs = [(w, self.active.pop(w)) for w in done]
        finished = [(w, job.op, job.microbatch, job.start) for w, job in jobs]
        host_waiting = len(self._waiting)
        for _, w in due:
            core = self._core[w]
            if self._queues[core]:
                self._queues[core].append((w, self.active.pop(w)))
                self._drop(w)
                worker, job = self._queues[core].pop(0)
                self._take(later, worker, core, job)
            elif host_waiting:
                host_waiting -= 1
                self._drop(w)
                self._waiting.append((w, self.active.pop(w)))
        self._assign(later)
        return finished


#: A transfer: ("F" | "B", receiving stage, micro-batch).
_Key = tuple[str, int, int]


class _Run:
    """The event loop over one row per worker (stage, replica), stage-major as the executor orders them:
    `step` advances every worker as far as it can at `now`, then `run` jumps to the next event."""

    def __init__(self, table: sched.Table, stages: tuple[StageCost, ...], target: Target, background: float) -> None:
        self.stages, self.target = stages, target
        #: The row (device) of each stage; the first stage of each row, whose devices and replicas the row's others share.
        self.row_of = sched.stage_rows(table)
        self._lead = [self.row_of.index(r) for r in range(len(table))]
        #: (row, replica) of every worker: one per stage replica, or per device replica when a device holds several stages.
        self.places = [(r, j) for r, s in enumerate(self._lead) for j in range(stages[s].replicas)]
        self.rows = sched.replicate(sched.add_communication(table), tuple(stages[s].replicas for s in self._lead))
        self._first = {r: self.places.index((r, 0)) for r in range(len(table))}
        #: Stages whose backward the table splits into B and W (W frees the stash and hands the gradients over).
        self.split = {a.stage for row in table for a in row if a.op == "W"}
        #: Per worker: the stage of the action it is running.
        self.acting = [self._lead[r] for r, _ in self.places]
        #: Workers without a backward (inference): a forward's activations are freed when it ends.
        self.forward_only = [not any(a.op == "B" for a in row) for row in self.rows]
        n = len(self.rows)
        self.cursor = [0] * n
        self.free_at = [0.0] * n
        #: A sender on a copying ("shm") link waits for its transfer's arrival before its next action.
        self.blocked_on: list[_Key | None] = [None] * n
        #: Per worker: the transfer key of the SEND or RECV whose CPU it is spending (links that charge it).
        self.message: list[_Key | None] = [None] * n
        #: Per worker: the sender whose message it has just received, until its next CPU work (the waker).
        self.woken_by: list[int | None] = [None] * n
        #: Transfer key -> start, arrival.
        self.started: dict[_Key, float] = {}
        #: Bytes of each message sent.
        self.sent_bytes: dict[_Key, float] = {}
        self.arrived: dict[_Key, float] = {}
        #: Workers that reached their STEP: it starts once every replica of the stage is there (the all-reduce).
        self.at_step: set[tuple[int, int]] = set()
        #: Per stage: how many of the (worker, stage) STEPs that exchange gradients with its own (its replicas, the tied
        #: stages') are not reached yet; and per such STEP, the stages waiting on it. Counted, not checked one by one
        #: each time a worker at its STEP is polled: over 1,000 replicas that check was most of a simulation.
        self.awaited = [0] * len(stages)
        self.awaiting: dict[tuple[int, int], list[int]] = {}
        for s, c in enumerate(stages):
            for t in sorted({s, *c.tied}):
                for i in range(stages[t].replicas):
                    self.awaiting.setdefault((self.owner(t, i), t), []).append(s)
                    self.awaited[s] += 1
        self.events: list[Event] = []
        self.live = [sum(c.memory.static for t, c in enumerate(stages) if self.row_of[t] == r) for r, _ in self.places]
        self.memory: list[list[tuple[float, float]]] = [[(0.0, b)] for b in self.live]
        self.links = _Links(target)
        #: The host's shared cores, on a target whose host model has them (cpu workers); None elsewhere.
        host = target.host
        workers = [(stages[self._lead[r]], self.device(w)) for w, (r, _) in enumerate(self.places)]
        self.cores = _Cores(workers, target, host, background) if host is not None and host.cores > 0 else None
        self.now = 0.0

    def shared(self, w: int) -> _Cores | None:
        """The host's shared cores when the worker computes on them, else None."""
        return self.cores if self.cores is not None and self.cores.shared[w] else None

    def owner(self, stage: int, mb: int) -> int:
        """The worker (replica of `stage`) that runs micro-batch `mb`."""
        return self.worker(stage, mb % self.stages[stage].replicas)

    def worker(self, stage: int, replica: int) -> int:
        """The worker that runs replica `replica` of `stage`."""
        return self._first[self.row_of[stage]] + replica

    def device(self, w: int) -> str:
        r, j = self.places[w]
        return self.stages[self._lead[r]].devices[j]

    def link_of(self, key: _Key) -> tuple[str, str]:
        """(sender's device, receiver's device) of a transfer."""
        kind, receiver, mb = key
        return self.device(self.owner(receiver - 1 if kind == "F" else receiver + 1, mb)), self.device(self.owner(receiver, mb))

    def run(self) -> tuple[tuple[Event, ...], tuple[tuple[tuple[float, float], ...], ...], float]:
        """The events, memory samples per worker and the end time."""
        n = len(self.rows)
        while True:
            self.step()
            # Done once every row is through and no action still runs on the shared cores (an inference row ends in an F).
            if all(self.cursor[w] == len(self.rows[w]) for w in range(n)) and all(math.isfinite(t) for t in self.free_at):
                break
            later = min([t for t in self.free_at if t > self.now] + [self.links.next_time(self.now), self.cores.next_time(self.now) if self.cores else math.inf])
            if math.isinf(later):
                stuck = next(w for w in range(n) if self.cursor[w] < len(self.rows[w]))
                raise OnnxpipeError(f"simulation stalled: stage {self._lead[self.places[stuck][0]]} waits forever at {self.rows[stuck][self.cursor[stuck]]}")
            self.advance(later)
        # Changes at one instant (a backward freeing, the next forward stashing) become one sample.
        memory = [[p for i, p in enumerate(samples) if i + 1 == len(samples) or samples[i + 1][0] != p[0]] for samples in self.memory]
        self.events.sort(key=lambda e: (e.stage, e.replica, e.start, e.kind))
        return tuple(self.events), tuple(tuple(m) for m in memory), max(self.free_at)

    def step(self) -> None:
        """Advance every worker as far as it can at `now`, until none moves."""
        progressed = True
        while progressed:
            progressed = False
            for w in range(len(self.rows)):
                waits = False
                while self.cursor[w] < len(self.rows[w]) and self.free_at[w] <= self.now:
                    if self.blocked_on[w] is not None:
                        if self.blocked_on[w] not in self.arrived:
                            break
                        self.blocked_on[w] = None
                    if not self.act(w, self.rows[w][self.cursor[w]]):
                        waits = True
                        break
                    self.cursor[w] += 1
                    progressed = True
                cores = self.shared(w)
                if cores and (waits or self.cursor[w] == len(self.rows[w]) and self.free_at[w] <= self.now):
                    cores.release(self.now, w)

    def act(self, w: int, a: sched.Action) -> bool:
        """Start the worker's next action; False when it must wait (its message has not arrived, or other holders are not at STEP)."""
        self.acting[w] = a.stage
        if a.op in ("RECV_F", "RECV_B"):
            return self.receive(w, a)
        if a.op in ("SEND_F", "SEND_B"):
            self.send(w, a)
        elif a.op in ("F", "B", "W"):
            self.compute_action(w, a)
        else:
            return self.optimizer_step(w, a.stage)
        return True

    def receive(self, w: int, a: sched.Action) -> bool:
        s, j = a.stage, self.places[w][1]
        key = (a.op[-1], s, a.microbatch)
        if key not in self.arrived:
            return False
        self.woken_by[w] = self.owner(s - 1 if key[0] == "F" else s + 1, a.microbatch)
        cpu = message_cpu(self.target, *self.link_of(key))
        if cpu is not None:
            self.message[w] = key
            self.compute(w, cpu.recv_seconds(self.sent_bytes.get(key, 0.0)), a.op, a.microbatch)
        else:
            self.events.append(Event(s, "RECV", a.microbatch, self.started[key], self.arrived[key], j))
        return True

    def send(self, w: int, a: sched.Action) -> None:
        s = a.stage
        kind, peer = ("F", s + 1) if a.op == "SEND_F" else ("B", s - 1)
        key = (kind, peer, a.microbatch)
        nbytes = self.stages[s].out_bytes if kind == "F" else self.stages[peer].out_bytes
        src, dst = self.device(w), self.device(self.owner(peer, a.microbatch))
        self.started[key] = self.now
        self.sent_bytes[key] = nbytes
        cpu = message_cpu(self.target, src, dst)
        if cpu is not None:
            self.message[w] = key
            self.compute(w, cpu.send_seconds(nbytes), a.op, a.microbatch)
            return
        self.links.start(self.now, src, dst, nbytes, key)
        if src != dst and self.target.link(src, dst).topology == "shm":
            self.blocked_on[w] = key

    def compute_action(self, w: int, a: sched.Action) -> None:
        """F, B or W on one replica: a whole micro-batch (r x the stage's share), plus the fixed costs. Where
        the table splits the stage's backward, B takes backward - weight seconds and W the weight seconds
        and the gradient hand-off."""
        c = self.stages[a.stage]
        split = a.stage in self.split
        if a.op == "F":
            self.mem(w, self.now, c.stash)
            self.compute(w, c.forward * c.replicas + c.action_overhead, a.op, a.microbatch)
        elif a.op == "B":
            self.mem(w, self.now, c.during_backward)
            seconds = (c.backward - c.weight if split else c.backward) * c.replicas
            self.compute(w, seconds + c.action_overhead + (0.0 if split else c.handing), a.op, a.microbatch)
        else:
            self.compute(w, c.weight * c.replicas + c.action_overhead + c.handing, a.op, a.microbatch)

    def optimizer_step(self, w: int, s: int) -> bool:
        j = self.places[w][1]
        c = self.stages[s]
        # A row's STEPs close it: reaching one, the worker is at the step of every stage it holds (ZB-V's
        # device 0 holds the first and the last stage, whose tied embeddings would wait on each other).
        for t, r in enumerate(self.row_of):
            if r == self.places[w][0] and (w, t) not in self.at_step:
                self.at_step.add((w, t))
                for waiting in self.awaiting.get((w, t), ()):
                    self.awaited[waiting] -= 1
        if self.awaited[s]:
            return False
        allreduce = c.allreduce + c.tied_allreduce
        if allreduce > 0:
            self.events.append(Event(s, "ALLREDUCE", -1, self.now, self.now + allreduce, j))
        self.free_at[w] = self.now + allreduce + c.step
        self.events.append(Event(s, "STEP", -1, self.now + allreduce, self.free_at[w], j))
        return True

    def compute(self, w: int, work: float, op: str, mb: int) -> None:
        """Run `work` seconds of the worker's CPU: on the shared cores, or on its own device."""
        cores = self.shared(w)
        waker, self.woken_by[w] = self.woken_by[w], None
        if cores:
            cores.start(self.now, w, work, op, mb, waker)
            self.free_at[w] = math.inf
        else:
            self.finish(w, op, mb, self.now, self.now + work)

    def finish(self, w: int, op: str, mb: int, start: float, end: float) -> None:
        s, j = self.acting[w], self.places[w][1]
        self.free_at[w] = end
        if op.startswith("SEND"):  # its event spans until arrival, added then
            key, self.message[w] = self.message[w], None
            assert key is not None
            self.links.land(end + self.target.link(*self.link_of(key)).latency, key)
            return
        if op.startswith("RECV"):
            key, self.message[w] = self.message[w], None
            assert key is not None
            self.events.append(Event(s, "RECV", mb, self.started[key], end, j))
            return
        self.events.append(Event(s, op, mb, start, end, j))
        c = self.stages[s]
        if op == "B":  # a split stage keeps the stash for W (what W reads), as the planner's in-flight count does
            self.mem(w, end, -c.during_backward if s in self.split else -c.stash - c.during_backward)
        elif op == "W":
            self.mem(w, end, -c.stash)
        elif op == "F" and self.forward_only[w]:
            self.mem(w, end, -c.stash)

    def mem(self, w: int, t: float, delta: float) -> None:
        self.live[w] += delta
        self.memory[w].append((t, self.live[w]))

    def advance(self, later: float) -> None:
        """Move time to `later`: finish the actions and transfers done by then."""
        for w, op, mb, start in self.cores.advance(self.now, later) if self.cores else []:
            self.finish(w, op, mb, start, later)
        for key in self.links.advance(self.now, later):
            self.arrived[key] = later
            kind, receiver, mb = key
            stage = receiver - 1 if kind == "F" else receiver + 1
            self.events.append(Event(stage, "SEND", mb, self.started[key], later, self.places[self.owner(stage, mb)][1]))
        self.now = later
