"""All stages in one process, running the same lowered schedule tables as the workers: the engine of
the tests and of the unpartitioned reference.

Each step the driver posts the micro-batches' model inputs, then workers (one per stage replica)
take turns: a worker runs actions until one would wait for data another has not sent yet.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxpipe.errors import OnnxpipeError
from onnxpipe.schedule import Action
from onnxpipe.train.stage import StageProgram, StageRunner, StageSpec, mean_loss, post_inputs
from onnxpipe.train.transport import LocalTransport

__all__ = ["LocalPipeline"]


class LocalPipeline:
    def __init__(self, specs: Sequence[StageSpec]) -> None:
        self.specs = tuple(specs)
        self.runners = [StageRunner(s) for s in self.specs]
        self._inboxes: dict[int, dict[tuple[str, int], np.ndarray]] = {}
        self.programs = [StageProgram(r, LocalTransport(self._inboxes, s.worker)) for r, s in zip(self.runners, self.specs)]
        #: One runner per stage (its first replica): replicas hold identical weights.
        self.stage_runners = [r for r in self.runners if r.spec.replica == 0]
        self._driver = LocalTransport(self._inboxes, -1)

    def train_step(self, microbatches: Sequence[dict[str, np.ndarray]]) -> float:
        """One step over the micro-batches; returns the mean loss."""
        post_inputs(self._driver, self.specs, microbatches)
        cursors = [0] * len(self.programs)
        while True:
            progress = False
            for p, prog in enumerate(self.programs):
                actions = prog.runner.spec.actions
                while cursors[p] < len(actions) and prog.ready(actions[cursor := cursors[p]]):
                    prog.perform(actions[cursor])
                    cursors[p] += 1
                    progress = True
            if all(c == len(prog.runner.spec.actions) for c, prog in zip(cursors, self.programs)):
                break
            if not progress:
                stuck = next(p for p, prog in enumerate(self.programs) if cursors[p] < len(prog.runner.spec.actions))
                spec = self.specs[stuck]
                raise OnnxpipeError(f"pipeline stalled: stage {spec.index} replica {spec.replica} waits at {spec.actions[cursors[stuck]]}")
        return mean_loss(r.take_losses() for r in self.runners)

    def evaluate(self, microbatches: Sequence[dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
        """Forward only; per micro-batch, every stage output (loss included)."""
        results: list[dict[str, np.ndarray]] = []
        for mb in microbatches:
            values = dict(mb)
            for r in self.stage_runners:
                feeds = {x: values[x] for x in r.spec.graphs.inputs}
                out = r.forward(0, feeds, train=False)
                values.update(out)
            results.append(values)
        return results

    def traces(self) -> list[list[Action]]:
        return [p.trace for p in self.programs]

    def parameters(self) -> dict[str, np.ndarray]:
        """Every stage's weights (a tied weight once: its copies are equal)."""
        out: dict[str, np.ndarray] = {}
        for r in self.runners:
            for k, v in r.params.items():
                out.setdefault(k, v)
        return out

    def state(self) -> list[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]:
        """Per stage: (parameters, optimizer state)."""
        return [({k: v.copy() for k, v in r.params.items()}, r.optimizer.state()) for r in self.stage_runners]

    def load_state(self, states: Sequence[tuple[dict[str, np.ndarray], dict[str, np.ndarray]]]) -> None:
        """Every replica of a stage gets that stage's state."""
        for r in self.runners:
            params, opt = states[r.spec.index]
            r.params = {k: np.array(v) for k, v in params.items()}
            r.optimizer.load_state(opt)

    def close(self) -> None:
        """Nothing to stop: here for the same interface as the process runner."""
