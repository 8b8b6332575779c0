"""The executor core: one driver for every backend, driven by the lowered schedule tables in the specs.

The driver sends a command (`messages`) to each worker, posts the micro-batches' model inputs through
the backend's transport, and collects one reply per worker. Every wait has a liveness check (the
backend's `health`: exited, killed or stopped workers) and a deadline (`stall_seconds` without any
worker finishing an action; `start_seconds` for start-up).

A backend is how the workers run and talk; it implements `Backend` (six members) and runs a
`stage.StageServer` per worker. Two exist: `processes.ProcessBackend` (one spawned process per stage
replica, or per device holding several stages (`host`), shared memory: the default) and `local.LocalBackend` (every stage in this process, taking
turns: tests and the unpartitioned reference). Training (`train_step`) and inference (`infer`) go
through the same servers and tables.

Reading order: `Backend` -> `Executor` (train_step, infer, state, load_state) -> `_wait` -> `_root_cause` -> `_fail`.

One failure brings down its neighbours (a worker reading from a sender that cleaned up fails too),
so the driver does not report the first error it hears: it listens a little longer and names the
earliest failure that was not a consequence of another (`Failure.secondary`).
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.simulate import Event
from onnxpipe.train.messages import Command, Failed, GetState, Infer, Outputs, Ready, Reply, SetState, StageState, State, StepDone, Train
from onnxpipe.train.stage import StageSpec, mean_loss, post_inputs
from onnxpipe.train.timeline import step_events
from onnxpipe.train.transport import Transport

__all__ = ["Backend", "Executor", "Failure", "StepStats", "InferStats", "PHASES"]

#: How a worker's op reads in an error message.
PHASES = {"F": "forward", "B": "backward", "W": "weight gradients", "STEP": "optimizer step", "RECV_F": "receiving activations",
          "SEND_F": "sending activations", "RECV_B": "receiving gradients", "SEND_B": "sending gradients", "setup": "setup", "idle": "idle"}
#: Seconds a worker gets to build its sessions.
START_SECONDS = 300.0
#: Seconds a command may go without any worker finishing an action (a worker computing one action longer fails the run).
STALL_SECONDS = 300.0
#: Seconds the driver keeps listening after a failure for earlier ones (reports cross on the way).
_GRACE = 0.3
#: Longest it waits for a root cause when only consequences of one have arrived.
_ROOT_WAIT = 3.0
#: How often a wait checks the workers' health.
_POLL = 0.2


@dataclass(frozen=True)
class Failure:
    """Why a worker can no longer answer."""

    worker: int
    #: (op, micro-batch) when the worker said where; None: ask the backend (`Backend.where`).
    where: tuple[str, int] | None
    error: str
    #: time.monotonic() of the failure (of its detection for a dead worker).
    at: float
    #: Caused by another worker's failure (its data vanished).
    secondary: bool = False


class Backend(Protocol):
    """How the executor reaches its workers: one per `StageSpec`, addressed by `StageSpec.worker`. A backend
    starts its workers when built (from the specs) and never blocks the driver on a worker."""

    #: The driver's end of the transport (address -1): model inputs reach the workers through it.
    driver: Transport

    def command(self, worker: int, command: Command) -> None:
        """Send a command (a large one in the background: a dead or stopped worker cannot block the driver)."""

    def replies(self, timeout: float) -> list[Reply]:
        """The replies that arrived, waiting up to `timeout` seconds for the first."""

    def health(self) -> list[Failure]:
        """Workers that can no longer answer (exited, killed, stopped); empty while every worker is well."""

    def progress(self) -> int:
        """A count that grows whenever a worker finishes an action (the stall deadline watches it)."""

    def where(self, worker: int) -> tuple[str, int]:
        """The op and micro-batch a worker was last in (for one that failed without saying)."""

    def close(self, force: bool) -> None:
        """Stop every worker (at once when `force`) and release everything the backend holds; idempotent."""


@dataclass(frozen=True)
class StepStats:
    """Measurements of one training step, per worker (worker w runs stage `places[w][0]`, replica `places[w][1]`)."""

    loss: float
    seconds: float
    #: Per worker: seconds computing (forward, backward, optimizer), copying through the transport.
    busy_seconds: tuple[float, ...]
    copy_seconds: tuple[float, ...]
    #: Per worker: peak bytes of stashed activations, peak RSS of the worker (0: not measured).
    peak_stash_bytes: tuple[int, ...]
    peak_rss_bytes: tuple[int, ...]
    #: What every worker did when, in seconds from the step's start (see `timeline.step_events`).
    events: tuple[Event, ...] = ()
    #: Per worker: CPU seconds of the transport calls (`copy_seconds` less preemption).
    copy_cpu_seconds: tuple[float, ...] = ()
    #: Per worker: (stage, replica).
    places: tuple[tuple[int, int], ...] = ()


@dataclass(frozen=True)
class InferStats:
    """Measurements of one forward-only pass over the micro-batches, per worker (as in `StepStats`)."""

    seconds: float
    busy_seconds: tuple[float, ...]
    peak_rss_bytes: tuple[int, ...]
    events: tuple[Event, ...]
    places: tuple[tuple[int, int], ...]


_F = TypeVar("_F", bound=Callable[..., Any])
_R = TypeVar("_R", bound=Reply)


def _closing_on_interrupt(method: _F) -> _F:
    """Ctrl-C (or SIGTERM turned into it) while the driver talks to its workers stops them all at once."""

    @functools.wraps(method)
    def wrapper(self: Executor, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except KeyboardInterrupt:
            self.close(force=True)
            raise

    return wrapper  # type: ignore[return-value]


class Executor:
    """Context manager: workers start on construction and always stop on exit (or on the first failure)."""

    def __init__(self, specs: Sequence[StageSpec], backend: Callable[[tuple[StageSpec, ...]], Backend], *,
                 start_seconds: float = START_SECONDS, stall_seconds: float = STALL_SECONDS) -> None:
        self.specs = tuple(specs)
        if [s.worker for s in self.specs] != list(range(len(self.specs))):
            raise OnnxpipeError("stage specs must come one per worker in worker order (stage-major); build them with prepare_stages")
        self.places = tuple((s.index, s.replica) for s in self.specs)
        self.stall_seconds = stall_seconds
        self.last: StepStats | None = None
        self.last_inference: InferStats | None = None
        self._closed = False
        self.backend = backend(self.specs)
        try:
            self._wait(Ready, start_seconds)
        except BaseException:
            self.close(force=True)
            raise

    def __enter__(self) -> Executor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @_closing_on_interrupt
    def train_step(self, microbatches: Sequence[dict[str, np.ndarray]]) -> float:
        """One optimizer step over the micro-batches (every schedule row once); returns the mean loss."""
        start = time.perf_counter()
        replies = self._run(Train(), microbatches, StepDone)
        self.last = StepStats(mean_loss(r.losses for r in replies), time.perf_counter() - start,
                              tuple(r.busy_seconds for r in replies), tuple(r.copy_seconds for r in replies),
                              tuple(r.peak_stash_bytes for r in replies), tuple(r.peak_rss_bytes for r in replies),
                              step_events(start, [r.timings for r in replies], [s for s, _ in self.places]),
                              tuple(r.copy_cpu_seconds for r in replies), self.places)
        return self.last.loss

    @_closing_on_interrupt
    def infer(self, microbatches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Forward only (the forward-only rows); per micro-batch, the outputs the stages collect (`Wiring.model_outputs`)."""
        merged: list[dict[str, np.ndarray]] = [{} for _ in microbatches]
        start = time.perf_counter()
        replies = self._run(Infer(), microbatches, Outputs)
        self.last_inference = InferStats(time.perf_counter() - start, tuple(r.busy_seconds for r in replies), tuple(r.peak_rss_bytes for r in replies),
                                         step_events(start, [r.timings for r in replies], [s for s, _ in self.places]), self.places)
        for reply in replies:
            for i, out in reply.outputs.items():
                merged[i].update(out)
        return merged

    @_closing_on_interrupt
    def state(self) -> list[StageState]:
        """Per stage: (parameters, optimizer state), from its first replica (replicas hold identical ones)."""
        first = [s.worker for s in self.specs if s.replica == 0]
        for w in first:
            self.backend.command(w, GetState())
        return [(r.params, r.optimizer) for r in self._wait(State, workers=first)]

    @_closing_on_interrupt
    def load_state(self, states: Sequence[StageState]) -> None:
        """Every replica of a stage gets that stage's state."""
        for spec in self.specs:
            self.backend.command(spec.worker, SetState(*states[spec.index]))
        self._wait(State)

    def parameters(self) -> dict[str, np.ndarray]:
        """Every stage's weights (a tied weight once: its copies are equal)."""
        out: dict[str, np.ndarray] = {}
        for params, _ in self.state():
            for k, v in params.items():
                out.setdefault(k, v)
        return out

    def close(self, force: bool = False) -> None:
        """Stop every worker (politely unless `force`) and release the backend's resources."""
        if not self._closed:
            self._closed = True
            self.backend.close(force)

    def _run(self, command: Command, microbatches: Sequence[dict[str, np.ndarray]], kind: type[_R]) -> list[_R]:
        """Send `command` to every worker, then the inputs (so workers drain their inboxes while they arrive)."""
        for spec in self.specs:
            self.backend.command(spec.worker, command)
        post_inputs(self.backend.driver, self.specs, microbatches)
        return self._wait(kind)

    def _wait(self, kind: type[_R], timeout: float | None = None, workers: Sequence[int] | None = None) -> list[_R]:
        """One `kind` reply per worker (of `workers`, default all), in worker order. A failing, dead or
        stopped worker fails the run within a second or so; so does `timeout` seconds (default
        `stall_seconds`) in which no worker finished an action."""
        want = list(range(len(self.specs))) if workers is None else list(workers)
        limit = self.stall_seconds if timeout is None else timeout
        got: dict[int, _R] = {}
        seen, since = self.backend.progress(), time.monotonic()
        while len(got) < len(want):
            for reply in self.backend.replies(_POLL):
                if isinstance(reply, Failed):
                    self._fail(self._root_cause([_reported(reply)]))
                if isinstance(reply, kind) and reply.worker in want:
                    got[reply.worker] = reply
            if len(got) == len(want):
                break
            bad = [f for f in self.backend.health() if f.worker not in got]
            if bad:
                self._fail(self._root_cause(bad))
            now, progress = time.monotonic(), self.backend.progress()
            if progress != seen:
                seen, since = progress, now
            elif now - since > limit:
                late = min(set(want) - set(got))
                self._fail(Failure(late, None, f"no answer within {limit:.0f} s", now))
        return [got[w] for w in want]

    def _root_cause(self, failures: list[Failure]) -> Failure:
        """Listen `_GRACE` s more (up to `_ROOT_WAIT` s while only consequences arrived); the earliest primary failure wins."""
        start = time.monotonic()
        found = {f.worker: f for f in failures}
        while True:
            primary = any(not f.secondary for f in found.values())
            if time.monotonic() - start >= (_GRACE if primary else _ROOT_WAIT):
                break
            replies = self.backend.replies(0.05)
            for reply in replies:
                if isinstance(reply, Failed):
                    found[reply.worker] = _reported(reply)  # a worker's own report beats its exit code
            if not replies:
                for f in self.backend.health():
                    found.setdefault(f.worker, f)
        return min(found.values(), key=lambda f: (f.secondary, f.at, f.worker))

    def _fail(self, failure: Failure) -> None:
        op, mb = failure.where or self.backend.where(failure.worker)
        self.close(force=True)
        at = f" at micro-batch {mb}" if op not in ("setup", "idle", "STEP", "?") and mb >= 0 else ""
        spec = self.specs[failure.worker]
        replicas = spec.layout.count(spec.index)
        who = f"stage {spec.index}" + (f" ({spec.file})" if spec.file else "") + (f" (replica {spec.replica} of {replicas})" if replicas > 1 else "")
        raise OnnxpipeError(f"{who} failed{at} ({PHASES.get(op, op)}): {failure.error}")


def _reported(reply: Failed) -> Failure:
    return Failure(reply.worker, (reply.op, reply.microbatch), reply.detail, reply.at, reply.secondary)
