"""One worker process per stage replica (spawn), tensors through shared memory, the driver feeding
micro-batches and collecting losses and measurements. Workers are numbered stage-major (`Layout`);
measurements come per worker, states per stage (replicas hold identical weights).

Reading order: `StepStats` -> `ProcessPipeline` (start, train_step, evaluate, state, close)
-> `_wait` (results, dead workers, errors) -> `_root_cause` -> `_fail`.

One failure brings down its neighbours (a worker reading from a sender that cleaned up fails too),
so the driver does not report the first error it hears: it listens a little longer and names the
earliest failure that was not a consequence of another (`_Failure.secondary`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import secrets
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.simulate import Event
from onnxpipe.train.stage import StageSpec, mean_loss, post_inputs
from onnxpipe.train.timeline import step_events
from onnxpipe.train.transport import ShmTransport, make_inboxes, sweep_segments
from onnxpipe.train.worker import OPS, worker_main

__all__ = ["StepStats", "ProcessPipeline", "PHASES"]

#: How a worker's op reads in an error message.
PHASES = {"F": "forward", "B": "backward", "W": "weight gradients", "STEP": "optimizer step", "RECV_F": "receiving activations", "SEND_F": "sending activations",
          "RECV_B": "receiving gradients", "SEND_B": "sending gradients", "setup": "setup", "evaluate": "evaluate", "idle": "idle"}
#: Seconds a worker gets to build its sessions.
_START_TIMEOUT = 300.0
#: Seconds the driver keeps listening after a failure for earlier ones (reports cross in the queue).
_GRACE = 0.3
#: Longest it waits for a root cause when only consequences of one have arrived.
_ROOT_WAIT = 3.0


@dataclass(frozen=True)
class _Failure:
    #: Worker id (the stage's index where no stage is replicated).
    worker: int
    #: (op, micro-batch) when the worker said where; None: read the shared `current` marks.
    where: tuple[str, int] | None
    error: str
    #: time.monotonic() of the failure (of its detection for a dead worker).
    at: float
    #: Caused by another worker's failure (its shared memory vanished).
    secondary: bool = False


@dataclass(frozen=True)
class StepStats:
    """Measurements of one training step, per worker (worker w runs stage `places[w][0]`, replica `places[w][1]`)."""

    loss: float
    seconds: float
    #: Per worker: seconds computing (forward, backward, optimizer), copying through shared memory.
    busy_seconds: tuple[float, ...]
    copy_seconds: tuple[float, ...]
    #: Per worker: peak bytes of stashed activations, peak RSS of the worker.
    peak_stash_bytes: tuple[int, ...]
    peak_rss_bytes: tuple[int, ...]
    #: What every worker did when, in seconds from the step's start (see `timeline.step_events`).
    events: tuple[Event, ...] = ()
    #: Per worker: CPU seconds of the transport calls (`copy_seconds` less preemption).
    copy_cpu_seconds: tuple[float, ...] = ()
    #: Per worker: (stage, replica).
    places: tuple[tuple[int, int], ...] = ()


class ProcessPipeline:
    """Context manager: workers start on entry (or construction) and are always shut down on exit."""

    def __init__(self, specs: Sequence[StageSpec]) -> None:
        self.specs = tuple(specs)
        if [s.worker for s in self.specs] != list(range(len(self.specs))):
            raise OnnxpipeError("stage specs must come one per worker in worker order (stage-major); build them with prepare_stages")
        self.places = tuple((s.index, s.replica) for s in self.specs)
        self._ctx = mp.get_context("spawn")
        self._prefix = f"onnxpipe_{os.getpid()}_{secrets.token_hex(3)}_"
        k = len(self.specs)
        self._inboxes = make_inboxes(self._ctx, k)
        self._commands = [self._ctx.Queue() for _ in range(k)]
        self._results = self._ctx.Queue()
        self._current = self._ctx.Array("i", 2 * k, lock=False)
        self._driver = ShmTransport(self._prefix + "d", self._inboxes, -1)
        self._procs: list[Any] = []
        self.last: StepStats | None = None
        try:
            for spec in self.specs:
                proc = self._ctx.Process(target=worker_main, name=f"onnxpipe-stage-{spec.index}-{spec.replica}", daemon=True,
                                         args=(spec, self._inboxes, self._commands[spec.worker], self._results, self._prefix, self._current))
                proc.start()
                self._procs.append(proc)
            self._wait("ready", _START_TIMEOUT)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> ProcessPipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs]

    @property
    def segment_prefix(self) -> str:
        """Name prefix of every shared-memory segment of this pipeline."""
        return self._prefix

    def train_step(self, microbatches: Sequence[dict[str, np.ndarray]]) -> float:
        start = time.perf_counter()
        for q in self._commands:  # workers first, so they drain their inboxes while the inputs arrive
            q.put(("step",))
        post_inputs(self._driver, self.specs, microbatches)
        replies = self._wait("done")
        loss = mean_loss(r[2] for r in replies)
        seconds = time.perf_counter() - start
        self.last = StepStats(loss, seconds, tuple(r[3] for r in replies), tuple(r[4] for r in replies),
                              tuple(r[5] for r in replies), tuple(r[6] for r in replies),
                              step_events(start, [r[7] for r in replies], [s for s, _ in self.places]),
                              tuple(r[8] for r in replies), self.places)
        return self.last.loss

    def evaluate(self, microbatches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        for q in self._commands:
            q.put(("evaluate", len(microbatches)))
        post_inputs(self._driver, self.specs, microbatches)
        replies = self._wait("outputs")
        merged: list[dict[str, np.ndarray]] = [dict() for _ in microbatches]
        for r in replies:
            for i, out in r[2]:
                merged[i].update(out)
        return merged

    def state(self) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
        """Per stage: (parameters, optimizer state), from its first replica (replicas hold identical ones)."""
        first = [s.worker for s in self.specs if s.replica == 0]
        for w in first:
            self._commands[w].put(("get",))
        return [(r[2], r[3]) for r in self._wait("state", workers=first)]

    def load_state(self, states: Sequence[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]) -> None:
        """Every replica of a stage gets that stage's state."""
        for spec, q in zip(self.specs, self._commands):
            params, opt = states[spec.index]
            q.put(("set", params, opt))
        self._wait("state")

    def parameters(self) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for params, _ in self.state():
            for k, v in params.items():
                out.setdefault(k, v)
        return out

    def close(self, force: bool = False) -> None:
        """Stop every worker (politely unless `force`, then by signal), and unlink all shared memory."""
        for q in [] if force else self._commands:
            try:
                q.put(("stop",))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0.0 if force else 2.0)
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.terminate()
        for p in self._procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join()
        self._driver.close()
        sweep_segments(self._prefix)
        for q in [*self._commands, self._results]:
            q.close()
            q.cancel_join_thread()
        for ends in self._inboxes:
            for end in ends:
                end.close()
        self._procs = []

    def _wait(self, kind: str, timeout: float | None = None, workers: Sequence[int] | None = None) -> list[tuple]:
        """One `kind` reply per worker (of `workers`, default all), in worker order; a dead or failing worker fails the run within a second."""
        want = list(range(len(self.specs))) if workers is None else list(workers)
        got: dict[int, tuple] = {}
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while len(got) < len(want):
                try:
                    msg = self._results.get(timeout=0.2)
                except queue_mod.Empty:
                    dead = self._dead(set(got))
                    if dead:
                        self._fail(self._root_cause(dead))
                    if deadline is not None and time.monotonic() > deadline:
                        late = min(set(want) - set(got))
                        self._fail(_Failure(late, None, f"no answer within {timeout:.0f} s", time.monotonic()))
                    continue
                if msg[0] == "error":
                    self._fail(self._root_cause([_reported(msg)]))
                if msg[0] == kind:
                    got[msg[1]] = msg
        except KeyboardInterrupt:
            self.close(force=True)
            raise
        return [got[w] for w in want]

    def _dead(self, skip: set[int]) -> list[_Failure]:
        """Workers that exited abnormally (a worker that reported an error exits with 0)."""
        now = time.monotonic()
        return [_Failure(w, None, f"worker exited with code {proc.exitcode}", now)
                for w, proc in enumerate(self._procs)
                if w not in skip and not proc.is_alive() and proc.exitcode != 0]

    def _root_cause(self, failures: list[_Failure]) -> _Failure:
        """Listen `_GRACE` s more (up to `_ROOT_WAIT` s while only consequences arrived); the earliest primary failure wins."""
        start = time.monotonic()
        found = {f.worker: f for f in failures}
        while True:
            waited = time.monotonic() - start
            primary = any(not f.secondary for f in found.values())
            if waited >= (_GRACE if primary else _ROOT_WAIT):
                break
            try:
                msg = self._results.get(timeout=0.05)
            except queue_mod.Empty:
                for f in self._dead(set(found)):
                    found[f.worker] = f
                continue
            if msg[0] == "error":
                found[msg[1]] = _reported(msg)  # a worker's own report beats its exit code
        return min(found.values(), key=lambda f: (f.secondary, f.at, f.worker))

    def _fail(self, failure: _Failure) -> None:
        where = failure.where
        if where is None:
            code = self._current[2 * failure.worker]
            where = (OPS[code] if 0 <= code < len(OPS) else "?", self._current[2 * failure.worker + 1])
        op, mb = where
        self.close(force=True)
        at = f" at micro-batch {mb}" if op not in ("setup", "idle", "STEP", "?") and mb >= 0 else ""
        spec = self.specs[failure.worker]
        who = f"stage {spec.index}" + (f" (replica {spec.replica} of {spec.layout.count(spec.index)})" if spec.layout.count(spec.index) > 1 else "")
        raise OnnxpipeError(f"{who} failed{at} ({PHASES.get(op, op)}): {failure.error}")


def _reported(msg: tuple) -> _Failure:
    """A worker's ("error", worker, op, micro-batch, detail, traceback, monotonic time, secondary) report."""
    return _Failure(msg[1], (msg[2], msg[3]), msg[4], msg[6], msg[7])
