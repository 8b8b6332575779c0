"""The default backend: one spawned worker process per host (`host.hosts`: a stage replica, or a device
holding several stages; `worker.worker_main`), tensors through shared memory (`ShmTransport`, one inbox
per stage replica), commands (addressed to a worker) and replies over a pair of pipes per process.

Nothing here can block the driver on a worker: each process's commands (its specs first, ~the stages'
size) are written by a sender thread of its own, its replies read by a reader thread into one queue,
and the driver's end of every pipe a process reads is its only other end, so a dead process breaks it.
Workers start with SIGINT ignored (inherited through exec): Ctrl-C goes to the driver alone. Each process
is bound to CPUs of its own when asked (`affinity`).

Reading order: `ProcessBackend` (start, command, replies, health, close) -> `ProcessPipeline`.
"""

from __future__ import annotations

import functools
import multiprocessing as mp
import queue
import signal
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from onnxpipe.train.affinity import worker_cpus
from onnxpipe.train.executor import Executor, Failure
from onnxpipe.train.host import hosts
from onnxpipe.train.leftovers import segment_prefix
from onnxpipe.train.messages import Command, Reply, Stop
from onnxpipe.train.stage import StageSpec
from onnxpipe.train.transport import ShmTransport, make_inboxes, sweep_segments
from onnxpipe.train.worker import OPS, SLOTS, worker_main

__all__ = ["ProcessBackend", "ProcessPipeline"]

#: Seconds a worker may stay stopped (SIGSTOP, a debugger) before the run fails.
STOPPED_SECONDS = 5.0
#: Seconds `close` waits for workers to stop by themselves, then after a signal.
_STOP_WAIT = 2.0


@contextmanager
def _sigint_ignored() -> Iterator[None]:
    """Processes spawned in this block start with SIGINT ignored (an ignored signal stays ignored
    through exec, so Python's own handler is never installed in them). A Ctrl-C meanwhile is held
    (blocked, not lost) and reaches the driver when the block ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _Sender(threading.Thread):
    """Writes one worker's commands in order; a dead worker's broken pipe ends it quietly."""

    def __init__(self, conn: Any, name: str) -> None:
        super().__init__(name=name, daemon=True)
        self.conn = conn
        self.outbox: queue.SimpleQueue[object] = queue.SimpleQueue()

    def run(self) -> None:
        while (item := self.outbox.get()) is not None:
            try:
                self.conn.send(item)
            except Exception:  # the worker is gone (a broken pipe) or the driver closed the pipe under it
                return


def _read_replies(conn: Any, into: queue.SimpleQueue[Reply]) -> None:
    """Forward one worker's replies into the driver's queue until the worker's end closes."""
    while True:
        try:
            into.put(conn.recv())
        except Exception:  # the worker's end closed (EOFError), or the driver closed this end
            return


def _process_state(pid: int | None) -> str:
    """The kernel's one-letter state of a process ("R", "S", "T" stopped, ...), "" when unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


class ProcessBackend:
    """Spawned workers on this host (see the module docstring)."""

    def __init__(self, specs: Sequence[StageSpec], bind_cores: bool = False) -> None:
        self._hosts = hosts(specs)
        #: The CPUs each process is bound to (`affinity.worker_cpus`), None where the OS places them.
        self.cpus = worker_cpus([max(specs[w].threads for w in ws) for ws in self._hosts]) if bind_cores else None
        ctx = mp.get_context("spawn")
        k = len(specs)
        self.prefix = segment_prefix()
        self._inboxes = make_inboxes(ctx, k)
        self._current = ctx.Array("i", SLOTS * k, lock=False)
        for w in range(k):  # a worker that dies before it says anything died in setup
            self._current[w * SLOTS] = OPS.index("setup")
        self.driver = ShmTransport(self.prefix + "d", self._inboxes, -1)
        self._replies: queue.SimpleQueue[Reply] = queue.SimpleQueue()
        #: The process (index into `_procs`) of each worker.
        self._host_of = {w: h for h, ws in enumerate(self._hosts) for w in ws}
        self._procs: list[Any] = []
        self._senders: list[_Sender] = []
        self._readers: list[Any] = []
        self._stopped: dict[int, float] = {}
        self._closed = False
        try:
            for h, ws in enumerate(self._hosts):
                self._start(ctx, tuple(specs[w] for w in ws), self.cpus[h] if self.cpus else ())
        except BaseException:
            self.close(force=True)
            raise

    def _start(self, ctx: Any, specs: tuple[StageSpec, ...], cpus: tuple[int, ...]) -> None:
        h = len(self._procs)
        their_commands, commands = ctx.Pipe(duplex=False)
        replies, their_replies = ctx.Pipe(duplex=False)
        name = "+".join(str(s.index) for s in specs)
        proc = ctx.Process(target=worker_main, name=f"onnxpipe-stage-{name}-{specs[0].replica}", daemon=True,
                           args=(their_commands, their_replies, self._inboxes, self.prefix, self._current, cpus))
        with _sigint_ignored():  # a Ctrl-C held meanwhile lands once the process is recorded, so `close` stops it too
            proc.start()
            self._procs.append(proc)
        their_commands.close()  # the process's ends live in the process only: its death breaks the pipes
        their_replies.close()
        sender = _Sender(commands, f"onnxpipe-send-{h}")
        sender.start()
        self._senders.append(sender)
        self._readers.append(replies)
        threading.Thread(target=_read_replies, args=(replies, self._replies), name=f"onnxpipe-read-{h}", daemon=True).start()
        sender.outbox.put(specs)

    @property
    def pids(self) -> list[int]:
        """One per process: per stage replica, or per device holding several stages."""
        return [p.pid for p in self._procs]

    def cpus_by_worker(self) -> tuple[tuple[int, ...], ...]:
        """Per worker: the CPUs its process is bound to (empty where the OS places it)."""
        return tuple(self.cpus[self._host_of[w]] if self.cpus else () for w in range(len(self._host_of)))

    def command(self, worker: int, command: Command) -> None:
        self._senders[self._host_of[worker]].outbox.put((worker, command))

    def replies(self, timeout: float) -> list[Reply]:
        try:
            out = [self._replies.get(timeout=timeout)]
        except queue.Empty:
            return []
        while True:
            try:
                out.append(self._replies.get_nowait())
            except queue.Empty:
                return out

    def health(self) -> list[Failure]:
        now = time.monotonic()
        bad = []
        for h, proc in enumerate(self._procs):
            w = self._busiest(h)
            if proc.exitcode is not None:
                bad.append(Failure(w, None, f"worker exited with code {proc.exitcode}", now))
            elif _process_state(proc.pid) in ("T", "t"):
                since = self._stopped.setdefault(h, now)
                if now - since >= STOPPED_SECONDS:
                    bad.append(Failure(w, None, f"worker process {proc.pid} is stopped (SIGSTOP, or a debugger holds it) "
                                                f"for {now - since:.0f} s; continue it with `kill -CONT {proc.pid}` and rerun", now))
            else:
                self._stopped.pop(h, None)
        return bad

    def _busiest(self, host: int) -> int:
        """The process's worker that was in an action (or in setup), else its first."""
        ws = self._hosts[host]
        return next((w for w in ws if self._current[w * SLOTS]), ws[0])

    def progress(self) -> int:
        return sum(self._current[w * SLOTS + 2] for w in self._host_of)

    def where(self, worker: int) -> tuple[str, int]:
        code = self._current[worker * SLOTS]
        return (OPS[code] if 0 <= code < len(OPS) else "?", self._current[worker * SLOTS + 1])

    def close(self, force: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if not force:
            for sender in self._senders:
                sender.outbox.put(Stop())
            deadline = time.monotonic() + _STOP_WAIT
            for p in self._procs:
                p.join(max(0.0, deadline - time.monotonic()))
        for p in self._procs:
            if p.is_alive():
                p.kill()  # SIGKILL: ends a stopped worker too
        for p in self._procs:
            p.join()
        for sender in self._senders:  # every worker is gone: a send in progress ends with a broken pipe
            sender.outbox.put(None)
            sender.join(_STOP_WAIT)
            sender.conn.close()
        for conn in self._readers:
            conn.close()
        self.driver.close()
        sweep_segments(self.prefix)
        for ends in self._inboxes:
            for end in ends:
                end.close()


class ProcessPipeline(Executor):
    """The executor on spawned worker processes."""

    def __init__(self, specs: Sequence[StageSpec], bind_cores: bool = False, **deadlines: float) -> None:
        super().__init__(specs, functools.partial(ProcessBackend, bind_cores=bind_cores), **deadlines)

    @property
    def pids(self) -> list[int]:
        return self.backend.pids  # type: ignore[attr-defined, no-any-return]

    @property
    def segment_prefix(self) -> str:
        """Name prefix of every shared-memory segment of this pipeline."""
        return self.backend.prefix  # type: ignore[attr-defined, no-any-return]

    @property
    def cpus(self) -> tuple[tuple[int, ...], ...]:
        """Per worker: the CPUs its process is bound to (empty where the OS places it)."""
        return self.backend.cpus_by_worker()  # type: ignore[attr-defined, no-any-return]
