"""Which worker runs what: one worker per (stage, replica), numbered stage-major, and the replica of a
stage that owns a micro-batch (replicas take whole micro-batches round-robin: i % replicas)."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    """Replica counts per stage; a stage beyond the tuple (or every stage of `Layout()`) has one."""

    replicas: tuple[int, ...] = ()

    def count(self, stage: int) -> int:
        return self.replicas[stage] if stage < len(self.replicas) else 1

    def worker(self, stage: int, replica: int) -> int:
        """Worker id of a (stage, replica): its transport address and its position in the worker list."""
        return sum(self.count(s) for s in range(stage)) + replica

    def owner(self, stage: int, microbatch: int) -> int:
        """Worker id of the replica of `stage` that runs `microbatch`."""
        return self.worker(stage, microbatch % self.count(stage))

    def workers(self, stage: int) -> tuple[int, ...]:
        """Worker ids of every replica of `stage`."""
        first = self.worker(stage, 0)
        return tuple(range(first, first + self.count(stage)))

    def place(self, worker: int) -> tuple[int, int]:
        """(stage, replica) of a worker id."""
        for stage, r in enumerate(self.replicas):
            if worker < r:
                return stage, worker
            worker -= r
        return len(self.replicas) + worker, 0
