"""Processes read off /proc: the live ones, for the tests that check no process outlives a run, and what one has
loaded, for the tests that Ctrl-C a program at a known point of its start."""

from __future__ import annotations

import signal
import time
from pathlib import Path

#: Fields of /proc/PID/stat after the command name: 1 is the parent PID, 3 the session id.
PARENT, SESSION = 1, 3


def live_processes(field: int, value: int) -> list[int]:
    """PIDs of the live (not zombie) processes whose stat `field` equals `value`."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[field]) == value and fields[0] != "Z":
            found.append(int(stat.parent.name))
    return found


def as_in_a_terminal() -> None:
    """`preexec_fn` for a command the test will Ctrl-C: SIGINT at its default, as in a terminal's foreground job.
    A shell starts background jobs with SIGINT ignored, and Python then installs no KeyboardInterrupt handler,
    so without this the test would depend on how the suite itself was launched."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def wait_until_loaded(pid: int, package: str, seconds: float) -> bool:
    """Waits until process `pid` has mapped a file of the installed `package` (a native extension: its import has begun);
    False when the process ends or `seconds` pass first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            if f"/site-packages/{package}/" in Path(f"/proc/{pid}/maps").read_text():
                return True
        except OSError:  # ended
            return False
        time.sleep(0.001)
    return False
