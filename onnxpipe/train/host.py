"""The stages one worker process runs: a device holding several stages (interleaved 1F1B, ZB-V) runs its
row of the schedule table in the table's order, each action on its stage's `StageServer`.

Which workers share a host is `hosts(specs)`: the workers of one device's row (`StageSpec.device_row`,
per replica) together, every other worker alone. The process backend runs one `Host` per worker process,
blocking on the transport action by action; the local backend takes turns between hosts, each still in
its row's order. Every stage keeps its own transport address (inbox), so messages between two stages of
one device travel as between any two stages.
"""

from __future__ import annotations

from collections.abc import Sequence

from onnxpipe.schedule import Action
from onnxpipe.train.messages import Command, Train
from onnxpipe.train.stage import StageServer, StageSpec

__all__ = ["hosts", "Host"]

#: The ops of a forward-only row (`schedule.forward_only`, lowered).
_FORWARD_OPS = ("RECV_F", "F", "SEND_F")


def hosts(specs: Sequence[StageSpec]) -> tuple[tuple[int, ...], ...]:
    """Worker ids per host, hosts in the order of their first worker: workers whose specs carry the same
    device row (and replica) share one."""
    groups: dict[object, list[int]] = {}
    for s in specs:
        groups.setdefault((s.device_row, s.replica) if s.device_row else s.worker, []).append(s.worker)
    return tuple(tuple(g) for g in groups.values())


class Host:
    """The servers of one host and the order they run a command's actions in."""

    def __init__(self, servers: Sequence[StageServer]) -> None:
        self.servers = tuple(servers)
        self.workers = tuple(s.runner.spec.worker for s in self.servers)
        self._by_stage = {s.runner.spec.index: s for s in self.servers}
        self._by_worker = dict(zip(self.workers, self.servers))
        #: The device's training row (empty for a stage alone on its device).
        self.device_row = self.servers[0].runner.spec.device_row
        self._forward_row = tuple(a for a in self.device_row if a.op in _FORWARD_OPS)
        #: Whether this row's STEPs have had every hosted stage's shared gradients sent.
        self._shared = False

    def server(self, worker: int) -> StageServer:
        return self._by_worker[worker]

    def row(self, command: Command) -> tuple[tuple[StageServer, Action], ...]:
        """The actions a Train or Infer sent to every hosted worker runs, in order, each with its server:
        a lone stage's own row, or the device's row (its forward actions only, for Infer)."""
        rows = [server.row(command) for server in self.servers]
        self._shared = False
        if not self.device_row:
            return tuple((self.servers[0], a) for a in rows[0])
        order = self.device_row if isinstance(command, Train) else self._forward_row
        return tuple((self._by_stage[a.stage], a) for a in order)

    def ready(self, server: StageServer, action: Action) -> bool:
        """Whether `action` would run without waiting (see `perform` for STEP)."""
        self._share(action)
        return server.program.ready(action)

    def perform(self, server: StageServer, action: Action) -> None:
        """Run one action. Before the first STEP every hosted stage sends the gradients of the weights it
        holds in common with others (tied weights, replicas), whose STEPs wait for them: a stage would
        otherwise wait for a STEP later in its own host's row."""
        self._share(action)
        server.program.perform(action)

    def _share(self, action: Action) -> None:
        if action.op == "STEP" and not self._shared:  # once per row: a stage that stepped starts its next step's sums
            for server in self.servers:
                server.program.send_shared()
            self._shared = True
