"""One time budget for a whole planning command (`plan --time-limit`): exploring, the DP, CP-SAT,
refinement, the baselines and the lower bounds all read the same deadline and stop with the best they
have once it passes, so the command, not only one CP-SAT solve, ends near the limit.

The clock is injectable: tests pass one that advances per reading, so "stops at the deadline" is
checked in work done, never in wall-clock time."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["Deadline"]


class Deadline:
    """A budget of `seconds` from its start on `clock` (seconds, monotonic)."""

    def __init__(self, seconds: float, clock: Callable[[], float] = time.monotonic, *, start: float | None = None,
                 end: float | None = None) -> None:
        self.seconds = seconds
        self.clock = clock
        self.start = clock() if start is None else start
        self.end = self.start + seconds if end is None else end

    def remaining(self) -> float:
        """Seconds left, 0 once passed."""
        return max(0.0, self.end - self.clock())

    def passed(self) -> bool:
        return self.clock() >= self.end

    def until(self, share: float) -> Deadline:
        """The same budget ending at `share` of it from its start: a step that must leave time to the
        steps after it (exploring before solving the winner) stops there."""
        return Deadline(self.seconds, self.clock, start=self.start, end=min(self.end, self.start + share * self.seconds))

    def share_of_rest(self, steps: int) -> Deadline:
        """The same budget ending 1/`steps` of what is left from now: the next of `steps` steps that share the rest
        equally (the device-type patterns of a schedule, the schedules of several stages per device)."""
        return Deadline(self.seconds, self.clock, start=self.start, end=min(self.end, self.clock() + self.remaining() / steps))

    def within(self, share: float) -> Deadline:
        """The same budget ending `share` of it from now, never later: a step repeated many times (each
        stage count's lower bound) takes at most that each time."""
        return Deadline(self.seconds, self.clock, start=self.start, end=min(self.end, self.clock() + share * self.seconds))
