"""Every stage in this process, running the same lowered schedule rows and `StageServer`s as worker
processes: the backend of the tests and of the unpartitioned reference.

Hosts (`host.hosts`: a stage replica, or a device's stages) take turns: each runs its row's actions in
order until one would wait for data another has not sent yet. Errors raise here, with their own traceback.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.schedule import Action
from onnxpipe.train.executor import Executor, Failure
from onnxpipe.train.host import Host, hosts
from onnxpipe.train.messages import Command, Infer, Ready, Reply, Train
from onnxpipe.train.stage import StageProgram, StageRunner, StageServer, StageSpec
from onnxpipe.train.transport import LocalTransport

__all__ = ["LocalBackend", "LocalPipeline"]


class LocalBackend:
    """Commands run when the driver asks for replies: every host's row, taking turns."""

    def __init__(self, specs: Sequence[StageSpec]) -> None:
        inboxes: dict[int, dict[tuple[str, int], np.ndarray]] = {}
        self.servers = [StageServer(s, LocalTransport(inboxes, s.worker)) for s in specs]
        self.hosts = [Host([self.servers[w] for w in ws]) for ws in hosts(specs)]
        self.driver = LocalTransport(inboxes, -1)
        self._pending: dict[int, Command] = {}
        self._ready: list[Reply] = [Ready(s.worker) for s in specs]
        self._done = 0

    def command(self, worker: int, command: Command) -> None:
        self._pending[worker] = command

    def replies(self, timeout: float) -> list[Reply]:
        out, self._ready = self._ready, []
        pending, self._pending = self._pending, {}
        runs = {h: pending[h.workers[0]] for h in self.hosts if isinstance(pending.get(h.workers[0]), (Train, Infer))}
        self._take_turns({h: h.row(c) for h, c in runs.items()})
        return out + [self.servers[w].reply(c) for w, c in pending.items()]

    def _take_turns(self, rows: dict[Host, tuple[tuple[StageServer, Action], ...]]) -> None:
        cursors = dict.fromkeys(rows, 0)
        while any(cursors[h] < len(row) for h, row in rows.items()):
            progress = False
            for h, row in rows.items():
                while cursors[h] < len(row) and h.ready(*row[cursors[h]]):
                    h.perform(*row[cursors[h]])
                    cursors[h] += 1
                    self._done += 1
                    progress = True
            if not progress:
                stuck = next(h for h, row in rows.items() if cursors[h] < len(row))
                server, action = rows[stuck][cursors[stuck]]
                spec = server.runner.spec
                raise OnnxpipeError(f"pipeline stalled: stage {spec.index} replica {spec.replica} waits at {action}")

    def health(self) -> list[Failure]:
        return []

    def progress(self) -> int:
        return self._done

    def where(self, worker: int) -> tuple[str, int]:
        return ("?", -1)

    def close(self, force: bool) -> None:
        """Nothing runs between commands: nothing to stop."""


class LocalPipeline(Executor):
    """The executor in this process; its runners and programs are open to inspection."""

    backend: LocalBackend

    def __init__(self, specs: Sequence[StageSpec]) -> None:
        super().__init__(specs, LocalBackend)
        self.programs: list[StageProgram] = [s.program for s in self.backend.servers]
        self.runners: list[StageRunner] = [p.runner for p in self.programs]
        #: One runner per stage (its first replica): replicas hold identical weights.
        self.stage_runners = [r for r in self.runners if r.spec.replica == 0]

    def traces(self) -> list[list[Action]]:
        return [p.trace for p in self.programs]
