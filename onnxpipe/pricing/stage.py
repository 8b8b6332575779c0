"""What one pipeline stage costs, in one place: the pricing rule, and one `StageCost` record per stage.

The rule, per micro-batch of the problem's size, for a stage of r replicas (they take whole micro-batches
round-robin, so the stage delivers r times one replica's rate and its times are those shares):
- compute: forward and backward seconds / r; a recomputing stage's backward runs its forward again
  (`recomputed_backward`); a stage's forward also takes what its cut tensors cost it (`Problem.crossing_sent`
  once per tensor it sends, `Problem.crossing_received` per tensor it receives: reordering between onnxruntime's
  blocked layout and the plain one in inference on cpu devices, int8 readers of a dequantized tensor run as
  float kernels), / r as well;
- messages: each tensor crossing to another stage is one message per receiving stage, priced on the link
  between the two stages' device groups at both ends, `message_seconds` = latency + bytes / (r x bandwidth);
- all-reduce: the ring all-reduce of its parameter gradients over its replicas, once per iteration, so its
  share per micro-batch is / microbatches (`seconds_per_microbatch` adds the terms);
- memory on one replica: parameters, and of the trained ones their gradients and optimizer state (`state_bytes`;
  frozen weights are only held, and have no all-reduce) all the time, plus the
  activations of the micro-batches one replica holds at once (`held`): all its activations for each
  (`activation_bytes`), or with recompute only what it received (its stash) for each plus one micro-batch's
  activations rebuilt during a backward;
- a split backward (zero-bubble schedules): W runs the weight-gradient part of the nodes B runs (`Problem.weight`),
  and the whole backward of the nodes no float tensor the stage receives reaches (`_reached_by_b`: B computes
  only what the received tensors' gradients need), so a first stage's backward is all W. The solvers price
  the fused backward; the simulator's B and W durations (so the predicted iteration) read this.
Every function of the rule is linear in its byte and second arguments, so the solvers apply it term by term
over their variables (the DP over prefix sums, CP-SAT per block and per tensor); the property tests hold them
to `price` on random graphs and targets.

Reading order: the rule (`held`, `state_bytes`, `activation_bytes`, `recomputed_backward`, `message_seconds`,
`seconds_per_microbatch`) -> `Assignment`, `Memory`, `StageCost` -> `price` -> `_communication` -> `_reached_by_b` -> `_tied`
-> `stage_cost` (adds what the target charges around a stage's figures: all-reduces and fixed costs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TypeVar

import numpy as np

from onnxpipe.nodes import FLOAT_DTYPES
from onnxpipe.pricing.problem import Problem
from onnxpipe.pricing.timemodel import allreduce_seconds
from onnxpipe.target import Target

__all__ = [
    "held",
    "state_bytes",
    "activation_bytes",
    "recomputed_backward",
    "message_seconds",
    "seconds_per_microbatch",
    "Assignment",
    "Memory",
    "StageCost",
    "price",
    "stage_cost",
]

#: A float, or a numpy array of them (the DP prices every interval at once).
Num = TypeVar("Num", float, np.ndarray)


def held(flight: int, replicas: int) -> int:
    """Whole micro-batches one replica holds at once when its stage keeps `flight` in flight: replicas
    take micro-batches round-robin, and one owns ceil(flight / replicas) of any `flight` consecutive ones."""
    return -(-flight // replicas)


def state_bytes(params: Num, trained: Num, optimizer_states: float, training: bool = True) -> Num:
    """Bytes held all the time for `params` bytes of parameters of which `trained` are trained: the
    parameters, and in training the trained ones' gradients and optimizer state (`optimizer_states` bytes
    per parameter byte)."""
    return params + trained * (1.0 + optimizer_states) if training else params * 1.0


def activation_bytes(holds: int, activations: Num, stash: Num, recompute: bool) -> Num:
    """Peak activation bytes on one replica holding `holds` micro-batches: all their activations, or with
    recompute only each one's stash (what the stage received) plus one micro-batch's activations."""
    return holds * stash + activations if recompute else holds * activations


def recomputed_backward(forward: Num, backward: Num, recompute: bool) -> Num:
    """Backward seconds, with the forward run again first when the stage recomputes."""
    return backward + forward if recompute else backward


def message_seconds(latency: Num, nbytes: Num, replicas: int, bandwidth: Num) -> Num:
    """Seconds one end spends on one message: the link's latency plus its share of the bytes."""
    return latency + nbytes / (replicas * bandwidth)


def seconds_per_microbatch(forward: Num, backward: Num, comm: Num, allreduce: Num, microbatches: int) -> Num:
    """What the planner balances: compute, messages, and the share of the per-iteration all-reduce."""
    return forward + backward + comm + allreduce / microbatches


@dataclass(frozen=True)
class Assignment:
    """Where everything goes, before any number is attached."""

    #: Node names of each stage.
    stages: tuple[tuple[str, ...], ...]
    #: Device instance names of each stage (several: the stage is replicated).
    devices: tuple[tuple[str, ...], ...]
    #: Per stage: True recomputes activations in backward instead of stashing them.
    recompute: tuple[bool, ...]


@dataclass(frozen=True)
class Memory:
    """Bytes one device of a stage holds at its peak, by kind."""

    parameters: float
    gradients: float
    optimizer: float
    activations: float
    capacity: float

    @property
    def total(self) -> float:
        return self.parameters + self.gradients + self.optimizer + self.activations

    @property
    def static(self) -> float:
        """Parameters, gradients and optimizer state: held all the time."""
        return self.parameters + self.gradients + self.optimizer


@dataclass(frozen=True)
class StageCost:
    """What one stage costs per micro-batch (at one micro-batch size): the record the planner's evaluation
    and the simulator read. Seconds per micro-batch are the stage's shares (busy / replicas, see the rule)."""

    index: int
    #: Device instance names; several: the stage is replicated.
    devices: tuple[str, ...]
    recompute: bool
    forward: float
    #: Backward seconds, the recomputed forward included.
    backward: float
    #: The part of `backward` a split backward runs in W (weight gradients); B runs the rest.
    weight: float
    #: Bytes received from and sent to other stages per micro-batch, and the seconds spent on those messages.
    in_bytes: float
    out_bytes: float
    in_seconds: float
    out_seconds: float
    #: Seconds of the ring all-reduce of its gradients over its replicas, per iteration.
    allreduce: float
    memory: Memory
    #: Bytes one micro-batch leaves stashed on a replica from its forward to its backward, and the extra bytes
    #: held while its backward runs (the recomputed activations).
    stash: float
    during_backward: float
    #: Other stages holding a copy of some of its trained weights (tied weights), those weights' bytes, and the
    #: seconds of exchanging their gradients among every device of the holders at the optimizer step.
    tied: tuple[int, ...]
    tied_bytes: float
    tied_allreduce: float
    #: How much longer its forward and backward take while other cpu workers compute beside it overflowing
    #: the host's shared cache (0.1: 10% longer).
    corun_slowdown: float
    #: Fixed seconds per forward or backward action (the slowest of its devices).
    action_overhead: float
    #: Seconds a backward takes to hand its weight gradients to the executor, which sums them.
    handing: float
    #: Seconds of the optimizer step: one pass over the trained parameters, their gradients and optimizer state.
    step: float
    #: Seconds per training step outside the schedule's actions (the driver's share), on its devices.
    step_overhead: float

    @property
    def replicas(self) -> int:
        return len(self.devices)

    def seconds_per_microbatch(self, microbatches: int) -> float:
        return seconds_per_microbatch(self.forward, self.backward, self.in_seconds + self.out_seconds, self.allreduce, microbatches)


def price(problem: Problem, assignment: Assignment, stage_of: np.ndarray) -> tuple[StageCost, ...]:
    """Every stage's cost under the problem's micro-batches, schedule and optimizer; `stage_of` gives each
    compute node's stage (the assignment, checked, by node position)."""
    k = len(assignment.stages)
    groups = [np.array([problem.group_of(d) for d in devs]) for devs in assignment.devices]
    comm = _communication(problem, stage_of, groups, k)
    flights = problem.flights(k)
    tied = _tied(problem, stage_of, k) if problem.training else [((), 0.0)] * k
    in_b = _reached_by_b(problem, stage_of) if problem.training else np.zeros(problem.n, dtype=bool)
    costs = []
    for s in range(k):
        mask = stage_of == s
        r = len(groups[s])
        # Inference stashes nothing for a backward; a stage drawing random numbers keeps its stash, as the trainer does.
        recompute = assignment.recompute[s] and problem.training and not problem.random[mask].any()
        forward = float(max(problem.forward[g, mask].sum() for g in groups[s]) + comm.crossing[s]) / r
        backward = recomputed_backward(forward, float(max(problem.backward[g, mask].sum() for g in groups[s])) / r, recompute)
        # A split backward's W: the weight-gradient part of what B reaches, the whole backward of the rest (all of it
        # where the stage receives no float tensor: the first stage's B makes nothing).
        reached = mask & in_b
        weight = (float(max(problem.weight[g, reached].sum() + problem.backward[g, mask & ~in_b].sum() for g in groups[s])) / r
                  if reached.any() else backward)
        corun = float(max(problem.corun_forward[g, mask].sum() * (2 if recompute else 1) + problem.corun_backward[g, mask].sum()
                          for g in groups[s])) / r
        params = float(problem.params[mask].sum())
        trained = float(problem.trained[mask].sum()) if problem.training else 0.0
        activations = float(problem.activations[mask].sum())
        stash = float(comm.stash_bytes[s]) if recompute else activations
        others = tied[s][0]
        costs.append(stage_cost(
            problem.target,
            index=s,
            devices=tuple(assignment.devices[s]),
            recompute=recompute,
            forward=forward,
            backward=backward,
            weight=weight,
            in_bytes=float(comm.in_bytes[s]),
            out_bytes=float(comm.out_bytes[s]),
            in_seconds=float(comm.in_seconds[s]),
            out_seconds=float(comm.out_seconds[s]),
            memory=Memory(
                parameters=params,
                gradients=trained,
                optimizer=trained * problem.optimizer_states,
                activations=activation_bytes(held(flights[s], r), activations, stash, recompute),
                capacity=float(min(problem.capacity[g] for g in groups[s])),
            ),
            stash=stash,
            during_backward=activations if recompute else 0.0,
            tied=others,
            tied_bytes=tied[s][1],
            tied_devices=tuple(d for t in sorted({s, *others}) for d in assignment.devices[t]),
            corun_slowdown=corun / (forward + backward) if forward + backward > 0 else 0.0,
        ))
    return tuple(costs)


def stage_cost(
    target: Target,
    *,
    index: int,
    devices: tuple[str, ...],
    recompute: bool,
    forward: float,
    backward: float,
    weight: float,
    in_bytes: float,
    out_bytes: float,
    in_seconds: float,
    out_seconds: float,
    memory: Memory,
    stash: float,
    during_backward: float,
    tied: tuple[int, ...],
    tied_bytes: float,
    tied_devices: tuple[str, ...],
    corun_slowdown: float,
) -> StageCost:
    """A stage's record from its per-micro-batch figures, adding what the target charges around them: the
    all-reduce over its replicas, the exchange of tied weights' gradients over `tied_devices` (every device
    of every holder), the fixed seconds per action, the gradient hand-off per backward, the optimizer step
    and the step overhead."""
    on = [target.device(d) for d in devices]
    rates = [d.gradient_bandwidth for d in on if d.gradient_bandwidth]
    return StageCost(
        index=index,
        devices=devices,
        recompute=recompute,
        forward=forward,
        backward=backward,
        weight=weight,
        in_bytes=in_bytes,
        out_bytes=out_bytes,
        in_seconds=in_seconds,
        out_seconds=out_seconds,
        allreduce=allreduce_seconds(target, devices, memory.gradients),
        memory=memory,
        stash=stash,
        during_backward=during_backward,
        tied=tied,
        tied_bytes=tied_bytes,
        tied_allreduce=allreduce_seconds(target, tied_devices, tied_bytes),
        corun_slowdown=corun_slowdown,
        action_overhead=max(d.action_overhead for d in on),
        handing=max((memory.gradients / rate for rate in rates), default=0.0),
        # the optimizer reads and writes the trained parameters (as many bytes as their gradients), reads the gradients, updates its state
        step=(3 * memory.gradients + 2 * memory.optimizer) / min(d.memory_bandwidth for d in on),
        step_overhead=max(d.step_overhead for d in on),
    )


@dataclass(frozen=True)
class _Comm:
    in_bytes: np.ndarray
    out_bytes: np.ndarray
    in_seconds: np.ndarray
    out_seconds: np.ndarray
    #: Bytes a recomputing stage stashes per micro-batch: everything it receives, model inputs included.
    stash_bytes: np.ndarray
    #: Forward seconds per micro-batch (one replica's whole, before / r) its cut tensors cost each stage.
    crossing: np.ndarray


def _communication(problem: Problem, stage_of: np.ndarray, groups: list[np.ndarray], k: int) -> _Comm:
    """One message per tensor per consumer stage, from the producer's stage; a replicated stage sends
    and receives its share of the micro-batch on each replica. A crossing tensor's forward seconds
    (`Problem.crossing_sent`, `crossing_received`) go to the producer's stage once and to each consumer stage (every
    stage reading a model input or derived tensor)."""
    in_b, out_b, in_s, out_s, stash, crossing = (np.zeros(k) for _ in range(6))
    replicas = [len(g) for g in groups]
    for t, p in enumerate(problem.tensor_producer):
        nbytes = problem.tensor_bytes[t]
        targets = np.unique(stage_of[problem.tensor_consumers[t]])
        if p < 0:  # a model input, or a derived tensor each reading stage makes (`Problem.crossing_received`)
            stash[targets] += nbytes
            for dst in targets:
                crossing[dst] += problem.crossing_received[groups[dst][0], t]
            continue
        src = stage_of[p]
        if (targets != src).any():
            crossing[src] += problem.crossing_sent[groups[src][0], t]
        for dst in targets[targets != src]:
            ga, gb = groups[src][0], groups[dst][0]
            latency, bandwidth = problem.latency[ga, gb], problem.bandwidth[ga, gb]
            in_b[dst] += nbytes
            out_b[src] += nbytes
            stash[dst] += nbytes
            in_s[dst] += message_seconds(latency, nbytes, replicas[dst], bandwidth)
            out_s[src] += message_seconds(latency, nbytes, replicas[src], bandwidth)
            crossing[dst] += problem.crossing_received[gb, t]
    return _Comm(in_b, out_b, in_s, out_s, stash, crossing)


def _reached_by_b(problem: Problem, stage_of: np.ndarray) -> np.ndarray:
    """Per node: a split backward's B runs its input-gradient part. B makes the gradients of the float tensors its stage
    receives from other stages (`FLOAT_DTYPES`, as the trainer's `train.splitgrad` does), so it runs the nodes those
    tensors reach within the stage; W runs the others' whole backward."""
    reached = np.zeros(problem.n, dtype=bool)
    tensors = problem.graph.tensors
    for t in problem.tensors_by_producer:  # each node final before its tensors
        p = int(problem.tensor_producer[t])
        if p < 0:
            continue
        consumers = problem.tensor_consumers[t]
        here = stage_of[consumers] == stage_of[p]
        if reached[p]:
            reached[consumers[here]] = True
        if not here.all() and tensors[problem.tensor_names[t]].dtype in FLOAT_DTYPES:
            reached[consumers[~here]] = True
    return reached


def _tied(problem: Problem, stage_of: np.ndarray, k: int) -> list[tuple[tuple[int, ...], float]]:
    """Per stage: the other stages reading one of its trained weights (each holds a copy; through
    constant chains too, e.g. the transpose of a tied embedding), and the bytes of those weights. A frozen
    weight read by several stages is only copied: it has no gradient to exchange."""
    graph = problem.graph
    position = {n: i for i, n in enumerate(problem.nodes)}
    others: list[set[int]] = [set() for _ in range(k)]
    nbytes = [0.0] * k
    for weight in graph.trained:
        stages: set[int] = set()
        frontier, seen = [weight], set()
        while frontier:
            for node in graph.consumers(frontier.pop()):
                if node in position:
                    stages.add(int(stage_of[position[node]]))
                elif node not in seen:
                    seen.add(node)
                    frontier.extend(o for o in graph.node(node).output if o)
        if len(stages) > 1:
            for s in stages:
                others[s] |= stages - {s}
                nbytes[s] += graph.tensors[weight].nbytes
    return [(tuple(sorted(o)), b) for o, b in zip(others, nbytes)]
