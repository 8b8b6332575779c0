"""What the driver and its workers say to each other, whatever carries it (pipes, Ray calls, direct calls).

The driver sends one command at a time to a worker and waits for one reply from each worker it
asked; a worker that fails answers `Failed` instead (and exits). Tensors between stages do not travel
here: they go through the backend's `Transport`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

__all__ = ["Command", "Train", "Infer", "GetState", "SetState", "Stop", "Reply", "Ready", "StepDone", "Outputs", "State",
           "Failed", "Timing", "StageState"]

#: (op, micro-batch, start, end): one action a worker ran, in `time.perf_counter()` seconds.
Timing = tuple[str, int, float, float]
#: (parameters, optimizer state) of one stage.
StageState = tuple[dict[str, np.ndarray], dict[str, np.ndarray]]


@dataclass(frozen=True)
class Train:
    """Run the worker's training row (`StageSpec.actions`): one optimizer step over the posted micro-batches."""


@dataclass(frozen=True)
class Infer:
    """Run the worker's forward-only row (`StageSpec.forward_actions`) over the posted micro-batches."""


@dataclass(frozen=True)
class GetState:
    """Send back the stage's weights and optimizer state."""


@dataclass(frozen=True)
class SetState:
    """Replace the stage's weights and optimizer state."""

    params: dict[str, np.ndarray] = field(repr=False)
    optimizer: dict[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class Stop:
    """Close the transport and exit."""


Command = Train | Infer | GetState | SetState | Stop


@dataclass(frozen=True)
class Ready:
    """Sessions built: the worker takes commands."""

    worker: int


@dataclass(frozen=True)
class StepDone:
    """Measurements of one training step on one worker."""

    worker: int
    #: Loss per micro-batch this worker computed (empty unless it holds the loss).
    losses: dict[int, float]
    #: Seconds computing (forward, backward, optimizer); in the transport (wall clock and CPU).
    busy_seconds: float
    copy_seconds: float
    copy_cpu_seconds: float
    peak_stash_bytes: int
    peak_rss_bytes: int
    timings: tuple[Timing, ...]


@dataclass(frozen=True)
class Outputs:
    """Per micro-batch this worker ran forward: the outputs the driver collects (model outputs, the loss)."""

    worker: int
    outputs: dict[int, dict[str, np.ndarray]] = field(repr=False)
    #: Seconds computing, peak RSS of the worker (0: not measured), and what it ran when.
    busy_seconds: float = 0.0
    peak_rss_bytes: int = 0
    timings: tuple[Timing, ...] = ()


@dataclass(frozen=True)
class State:
    """Answer to `GetState` (and, empty, the acknowledgement of `SetState`)."""

    worker: int
    params: dict[str, np.ndarray] = field(repr=False)
    optimizer: dict[str, np.ndarray] = field(repr=False)


@dataclass(frozen=True)
class Failed:
    """The worker failed (it exits after sending this)."""

    worker: int
    #: The op it was in (a schedule op, "setup" or "idle") and the micro-batch (-1: none).
    op: str
    microbatch: int
    #: `ExceptionType: first line of its message`.
    detail: str
    traceback: str = field(repr=False)
    #: time.monotonic() of the failure (one clock for every process of a host).
    at: float
    #: A consequence of another worker's failure (the data it waited for vanished), not a root cause.
    secondary: bool


Reply = Ready | StepDone | Outputs | State | Failed
