"""One stage at run time: its sessions, weights, gradient sums and stash (`StageRunner`), and the
interpreter of its lowered schedule rows (`StageProgram`), and a worker's side of the driver protocol
(`StageServer`): identical in-process, in a worker process and in any other backend.

A replicated stage runs one worker per replica (`StageSpec.replica`, `Layout`): each runs its own
micro-batches, sends to and receives from the replica of the neighbouring stage that owns the same
micro-batch, and at STEP sums its gradients with every other holder of the same weights (its
replicas and, for tied weights, every replica of the other stages holding a copy).

Training runs the row `StageSpec.actions`; inference (and evaluation) runs `StageSpec.forward_actions`
through the same program, forward only, keeping the outputs the driver collects.

Reading order: `Wiring` -> `StageSpec` -> `StageRunner` (forward, backward, step) -> `StageProgram`
-> `StageServer`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np

from onnxpipe.ortutil import session
from onnxpipe.schedule import Action
from onnxpipe.train.graphs import StageGraphs, grad_input_name, grad_name
from onnxpipe.train.layout import Layout
from onnxpipe.train.messages import Command, GetState, Infer, Outputs, Reply, SetState, State, StepDone, Timing, Train
from onnxpipe.train.optimizer import Optimizer, OptimizerConfig
from onnxpipe.train.providers import CPU, ExecutionDevice, session_provider
from onnxpipe.train.splitgrad import SplitBackward
from onnxpipe.train.transport import Transport, grad_key, shared_key

__all__ = ["Wiring", "StageSpec", "StageRunner", "StageProgram", "StageServer", "make_session", "mean_loss", "post_inputs"]


@dataclass(frozen=True)
class Wiring:
    """Where a stage's tensors come from and go to."""

    #: Data inputs fed by the driver (model inputs, labels).
    model_inputs: tuple[str, ...]
    #: Activation inputs and their producing stage.
    recv_f: tuple[tuple[str, int], ...]
    #: Outputs and the stages that read them.
    send_f: tuple[tuple[str, tuple[int, ...]], ...]
    #: Gradient-taking outputs and the stages that send their gradients.
    recv_b: tuple[tuple[str, tuple[int, ...]], ...]
    #: Inputs whose gradient goes back, and to which stage.
    send_b: tuple[tuple[str, int], ...]
    #: Tied parameters and the other stages holding a copy.
    shared: tuple[tuple[str, tuple[int, ...]], ...] = ()
    #: Outputs the driver collects from a forward-only row: model outputs made here, and the loss.
    model_outputs: tuple[str, ...] = ()


@dataclass(frozen=True)
class StageSpec:
    """All a worker needs to run one stage (picklable)."""

    index: int
    graphs: StageGraphs
    wiring: Wiring
    #: This stage's row of the lowered training schedule table (empty for an inference-only stage).
    actions: tuple[Action, ...]
    #: Micro-batches per step over all replicas (gradients are means over all of them).
    microbatches: int
    optimizer: OptimizerConfig
    threads: int = 1
    #: Which replica of the stage this worker is, and every stage's replica count.
    replica: int = 0
    layout: Layout = Layout()
    #: The backward as B and W (`splitgrad`) when the schedule has W actions; None: B runs it whole.
    split: SplitBackward | None = None
    #: This stage's row of the lowered forward-only table over the same micro-batches (`schedule.forward_only`).
    forward_actions: tuple[Action, ...] = ()
    #: The stage file it was built from (for messages); empty for the whole model.
    file: str = ""
    #: Where its sessions run (`providers`): the CPU, or a CUDA device for a stage on a gpu.
    device: ExecutionDevice = CPU
    #: A device holding several stages (interleaved 1F1B, ZB-V): its lowered training row for this replica, every
    #: stage's actions in the device's order, run by one worker process (`host`). Empty: the stage is alone on its device.
    device_row: tuple[Action, ...] = ()

    @property
    def worker(self) -> int:
        """This worker's transport address."""
        return self.layout.worker(self.index, self.replica)

    def holders(self, param: str) -> tuple[int, ...]:
        """Workers holding a copy of a trained weight, in worker order: the gradient of each is summed at STEP."""
        tied = dict(self.wiring.shared).get(param, ())
        return tuple(w for s in sorted({self.index, *tied}) for w in self.layout.workers(s))

    def shared(self) -> dict[str, tuple[int, ...]]:
        """Trained weights whose gradient is summed with other workers' copies, and all their holders."""
        return self._shared

    @cached_property
    def _shared(self) -> dict[str, tuple[int, ...]]:
        # Read at every STEP (`sends`): worked out once per spec.
        return {p: h for p in self.graphs.trained if len(h := self.holders(p)) > 1}

    def sends(self, action: Action) -> tuple[tuple[int, str, str], ...]:
        """The messages an action sends: (destination worker, transport key, tensor) each; STEP sends this
        worker's mean gradient of every weight held in common to the other holders."""
        w, i = self.wiring, action.microbatch
        if action.op == "SEND_F":
            return tuple((self.layout.owner(dst, i), t, t) for t, dsts in w.send_f for dst in dsts)
        if action.op == "SEND_B":
            return tuple((self.layout.owner(src, i), grad_key(t, self.index), t) for t, src in w.send_b)
        if action.op == "STEP":
            me = self.worker
            return tuple((h, shared_key(p, me), p) for p, holders in self.shared().items() for h in holders if h != me)
        return ()

    def inputs(self, count: int) -> tuple[tuple[str, int], ...]:
        """(model input, micro-batch) the driver posts to this worker over `count` micro-batches: those of
        the micro-batches this replica owns."""
        return tuple((name, i) for i in range(count) if self.layout.owner(self.index, i) == self.worker for name in self.wiring.model_inputs)


def make_session(model: bytes, threads: int, device: ExecutionDevice = CPU):  # -> onnxruntime.InferenceSession
    provider, options = session_provider(device)
    return session(model, provider, threads=max(1, threads), provider_options=options)


@dataclass
class StageRunner:
    """Forward/backward of one stage over micro-batches, gradient sums, and the optimizer step."""

    spec: StageSpec
    params: dict[str, np.ndarray] = field(init=False)
    busy_seconds: float = 0.0
    peak_stash_bytes: int = 0

    def __post_init__(self) -> None:
        g = self.spec.graphs
        self.params = {k: v.copy() for k, v in g.initial.items()}
        self.optimizer = Optimizer(self.spec.optimizer)
        self._forward = make_session(g.forward, self.spec.threads, self.spec.device)
        self._backward = make_session(g.backward, self.spec.threads, self.spec.device) if g.backward else None
        split = self.spec.split
        self._b = make_session(split.b, self.spec.threads, self.spec.device) if split and split.b else None
        self._w = make_session(split.w, self.spec.threads, self.spec.device) if split and split.w else None
        #: Per micro-batch, what W reads between B and W (a split backward).
        self._w_stash: dict[int, dict[str, np.ndarray]] = {}
        self._fwd_names = list(dict.fromkeys(g.outputs + ((g.loss,) if g.loss else ()) + g.stash))
        self._bwd_grads = [grad_name(x) for x in g.grad_inputs + g.trained]
        self._stash: dict[int, dict[str, np.ndarray]] = {}
        self._stash_bytes = 0
        self.grads: dict[str, np.ndarray] = {}
        self.losses: dict[int, float] = {}

    def forward(self, microbatch: int, feeds: dict[str, np.ndarray], train: bool = True) -> dict[str, np.ndarray]:
        g = self.spec.graphs
        start = time.perf_counter()
        names = self._fwd_names if train else list(g.outputs) + ([g.loss] if g.loss else [])
        values = self._forward.run(names, {**feeds, **self.params})
        self.busy_seconds += time.perf_counter() - start
        result = dict(zip(names, values))
        if g.loss and train:
            self.losses[microbatch] = float(result[g.loss])
        if train and self._backward is not None:
            keep = {x: result[x] if x in result else feeds[x] for x in g.backward_inputs if x not in self.params}
            self._stash[microbatch] = keep
            self._stash_bytes += sum(v.nbytes for v in keep.values())
            self.peak_stash_bytes = max(self.peak_stash_bytes, self._stash_bytes)
        return {x: result[x] for x in g.outputs + ((g.loss,) if g.loss else ())}

    def backward(self, microbatch: int, output_grads: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """The gradients of the stage inputs; the weight gradients are summed here too, or with a split
        backward (`spec.split`) only those B makes, the rest kept for `weight`."""
        g = self.spec.graphs
        if self._backward is None:
            return {}
        keep = self._stash.pop(microbatch)
        self._stash_bytes -= sum(v.nbytes for v in keep.values())
        feeds = {**keep, **{x: self.params[x] for x in g.backward_inputs if x in self.params}}
        feeds.update({grad_input_name(o): output_grads[o] for o in g.grad_outputs})
        if self.spec.split is not None:
            return self._input_backward(microbatch, feeds)
        start = time.perf_counter()
        values = self._backward.run(self._bwd_grads, feeds)
        n = len(g.grad_inputs)
        self._add_grads(g.trained, values[n:])
        self.busy_seconds += time.perf_counter() - start
        return dict(zip(g.grad_inputs, values[:n]))

    def _input_backward(self, microbatch: int, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """B of a split backward: input gradients now; what W reads is held until `weight`."""
        g, split = self.spec.graphs, self.spec.split
        assert split is not None
        made: dict[str, np.ndarray] = {}
        if self._b is not None:
            start = time.perf_counter()
            names = [grad_name(x) for x in g.grad_inputs + split.b_trained] + list(split.left)
            made = dict(zip(names, self._b.run(names, {x: feeds[x] for x in split.b_inputs})))
            self._add_grads(split.b_trained, [made[grad_name(p)] for p in split.b_trained])
            self.busy_seconds += time.perf_counter() - start
        if self._w is not None:
            held = {x: made[x] if x in made else feeds[x] for x in split.w_inputs if x not in self.params}
            self._w_stash[microbatch] = held
            self._stash_bytes += sum(v.nbytes for v in held.values())
            self.peak_stash_bytes = max(self.peak_stash_bytes, self._stash_bytes)
        return {x: made[grad_name(x)] for x in g.grad_inputs}

    def weight(self, microbatch: int) -> None:
        """W of a split backward: the weight gradients B left, summed over the step's micro-batches."""
        split = self.spec.split
        if self._w is None or split is None:
            return
        held = self._w_stash.pop(microbatch)
        self._stash_bytes -= sum(v.nbytes for v in held.values())
        start = time.perf_counter()
        names = [grad_name(p) for p in split.w_trained]
        values = self._w.run(names, {**held, **{x: self.params[x] for x in split.w_inputs if x in self.params}})
        self._add_grads(split.w_trained, values)
        self.busy_seconds += time.perf_counter() - start

    def _add_grads(self, params: Sequence[str], values: Sequence[np.ndarray]) -> None:
        for name, value in zip(params, values):
            acc = self.grads.get(name)
            self.grads[name] = value if acc is None else acc + value

    def mean_grads(self) -> dict[str, np.ndarray]:
        """Gradients of the mean loss over the step's micro-batches (zero for a replica that ran none)."""
        scale = np.float32(1.0 / self.spec.microbatches)
        if not self.grads and self.spec.layout.count(self.spec.index) > 1:
            return {k: np.zeros_like(self.params[k]) for k in self.spec.graphs.trained}
        return {k: v * scale for k, v in self.grads.items()}

    def step(self, grads: dict[str, np.ndarray]) -> None:
        start = time.perf_counter()
        self.optimizer.step(self.params, grads)
        self.grads = {}
        self.busy_seconds += time.perf_counter() - start

    def take_losses(self) -> dict[int, float]:
        """Loss per micro-batch since the last call."""
        out, self.losses = self.losses, {}
        return out


def mean_loss(parts: Iterable[Mapping[int, float]]) -> float:
    """Mean over micro-batches of the losses every worker computed, in micro-batch order (as one process would add them)."""
    merged = {i: x for part in parts for i, x in part.items()}
    return float(np.mean([merged[i] for i in sorted(merged)]))


class StageProgram:
    """Runs a stage's lowered actions against a transport; `trace` records what ran, in order, and
    `timings` when: (op, micro-batch, start, end) in `time.perf_counter()` seconds, which on Linux is one
    clock for all processes, so the driver can place every worker's actions on one timeline."""

    def __init__(self, runner: StageRunner, transport: Transport) -> None:
        self.runner = runner
        self.transport = transport
        self.trace: list[Action] = []
        self.timings: list[Timing] = []
        #: Whether F runs the training forward (stash kept, loss recorded) or inference; see `begin`.
        self.training = True
        #: Inference: per micro-batch, the `Wiring.model_outputs` of its forward (see `take_outputs`).
        self.outputs: dict[int, dict[str, np.ndarray]] = {}
        self._inbox: dict[int, dict[str, np.ndarray]] = {}
        self._outbox: dict[int, dict[str, np.ndarray]] = {}
        self._grads_in: dict[int, dict[str, np.ndarray]] = {}
        #: This step's mean gradients once sent to the other holders (None until then).
        self._sent: dict[str, np.ndarray] | None = None
        spec = runner.spec
        #: Trained weights whose gradient is summed with other workers' copies, and those workers.
        self._holders = spec.shared()

    def needs(self, action: Action) -> list[tuple[str, int]]:
        """Transport keys an action waits for (so a cooperative runner can tell whether it would block)."""
        w = self.runner.spec.wiring
        i = action.microbatch
        if action.op == "RECV_F":
            return [(t, i) for t, _ in w.recv_f]
        if action.op == "F":
            return [(t, i) for t in w.model_inputs]
        if action.op == "RECV_B":
            return [(grad_key(t, src), i) for t, srcs in w.recv_b for src in srcs]
        if action.op == "STEP":
            me = self.runner.spec.worker
            return [(shared_key(p, h), -1) for p, holders in self._holders.items() for h in holders if h != me]
        return []

    def ready(self, action: Action) -> bool:
        if action.op == "STEP":
            self.send_shared()
        return all(self.transport.ready(k, i) for k, i in self.needs(action))

    def begin(self, training: bool) -> tuple[Action, ...]:
        """The row to run next: the training row, or the forward-only row (inference)."""
        self.training = training
        spec = self.runner.spec
        return spec.actions if training else spec.forward_actions

    def take_timings(self) -> list[Timing]:
        """The timings recorded since the last call (one step's worth when called after each step)."""
        out, self.timings = self.timings, []
        return out

    def take_outputs(self) -> dict[int, dict[str, np.ndarray]]:
        """The collected outputs since the last call, by micro-batch."""
        out, self.outputs = self.outputs, {}
        return out

    def perform(self, action: Action) -> None:
        start = time.perf_counter()
        self._perform(action)
        self.timings.append((action.op, action.microbatch, start, time.perf_counter()))
        self.trace.append(action)

    def _perform(self, action: Action) -> None:
        w, r, i = self.runner.spec.wiring, self.runner, action.microbatch
        if action.op == "RECV_F":
            self._inbox.setdefault(i, {}).update({t: self.transport.recv(t, i) for t, _ in w.recv_f})
        elif action.op == "F":
            feeds = self._inbox.pop(i, {})
            feeds.update({t: self.transport.recv(t, i) for t in w.model_inputs})
            self._outbox[i] = out = r.forward(i, feeds, train=self.training)
            if not self.training:
                self.outputs[i] = {t: out[t] for t in w.model_outputs if t in out}
            if not w.send_f:
                self._outbox.pop(i)
        elif action.op in ("SEND_F", "SEND_B"):
            out = self._outbox.pop(i)
            for dst, key, t in r.spec.sends(action):
                self.transport.send(dst, key, i, out[t])
        elif action.op == "RECV_B":
            got: dict[str, np.ndarray] = {}
            for t, srcs in w.recv_b:
                parts = [self.transport.recv(grad_key(t, src), i) for src in srcs]
                got[t] = parts[0] if len(parts) == 1 else sum(parts[1:], parts[0])
            self._grads_in[i] = got
        elif action.op == "B":
            self._outbox[i] = r.backward(i, self._grads_in.pop(i, {}))
        elif action.op == "W":
            r.weight(i)
        elif action.op == "STEP":
            grads = self.send_shared()
            mine = r.spec.worker
            for p, holders in self._holders.items():
                # Every holder adds the same parts in the same (worker) order: the copies stay bit-identical.
                parts = [grads[p] if h == mine else self.transport.recv(shared_key(p, h), -1) for h in holders]
                total = parts[0]
                for part in parts[1:]:
                    total = total + part
                grads[p] = total
            self._sent = None
            r.step(grads)

    def send_shared(self) -> dict[str, np.ndarray]:
        """Send this worker's mean gradients of held-in-common weights to the other holders (once per
        step); returns all its mean gradients."""
        if self._sent is None:
            spec = self.runner.spec
            self._sent = self.runner.mean_grads()
            for dst, key, p in spec.sends(Action(spec.index, "STEP")):
                self.transport.send(dst, key, -1, self._sent[p])
        return self._sent


class StageServer:
    """A worker's side of the driver protocol (`messages`): builds the stage, says which actions a command
    runs, and answers it. Every backend drives it the same way: `row(command)`, perform each action
    (blocking on the transport, or cooperatively with `program.ready`), then send `reply(command)`."""

    def __init__(self, spec: StageSpec, transport: Transport, rss: Callable[[], int] = lambda: 0) -> None:
        self.runner = StageRunner(spec)
        self.program = StageProgram(self.runner, transport)
        self.transport = transport
        self._rss = rss
        self._before = (0.0, 0.0, 0.0)

    def row(self, command: Command) -> tuple[Action, ...]:
        """The actions `command` runs, in order (none for state commands)."""
        if isinstance(command, (Train, Infer)):
            t = self.transport
            self._before = (self.runner.busy_seconds, t.copy_seconds, t.copy_cpu_seconds)
            return self.program.begin(isinstance(command, Train))
        return ()

    def reply(self, command: Command) -> Reply:
        """The answer to `command` once its row ran."""
        me, r, t = self.runner.spec.worker, self.runner, self.transport
        if isinstance(command, Train):
            busy, copy, cpu = self._before
            return StepDone(me, r.take_losses(), r.busy_seconds - busy, t.copy_seconds - copy, t.copy_cpu_seconds - cpu,
                            r.peak_stash_bytes, self._rss(), tuple(self.program.take_timings()))
        if isinstance(command, Infer):
            return Outputs(me, self.program.take_outputs(), r.busy_seconds - self._before[0], self._rss(), tuple(self.program.take_timings()))
        if isinstance(command, GetState):
            return State(me, {k: v.copy() for k, v in r.params.items()}, {k: np.array(v) for k, v in r.optimizer.state().items()})
        if isinstance(command, SetState):
            r.params = {k: np.array(v) for k, v in command.params.items()}
            r.optimizer.load_state(command.optimizer)
            return State(me, {}, {})
        raise TypeError(f"no reply to {command!r}")


def post_inputs(driver: Transport, specs: Sequence[StageSpec], microbatches: Sequence[Mapping[str, np.ndarray]]) -> None:
    """Send each micro-batch's model inputs to the replica of every stage that owns that micro-batch."""
    for spec in specs:
        for name, i in spec.inputs(len(microbatches)):
            driver.send(spec.worker, name, i, microbatches[i][name])
