"""Names of what a run leaves on the machine while it lives, and the sweep of what dead runs left.

A run's shared-memory segments (`/dev/shm/onnxpipe_<pid>_...`) and temporary stage copies
(`<tmp>/onnxpipe-train-<pid>-...`) carry the driver's PID, the Ray transport's wake-up FIFOs
(`/dev/shm/onnxpipe-wake-<pid>-...`) their writer's. A process killed by SIGKILL cannot remove them;
the next run finds those whose PID is no longer a live process and removes them.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import tempfile
from pathlib import Path

__all__ = ["segment_prefix", "temp_dir", "wake_path", "owner_alive", "sweep_dead_runs"]

_SHM = Path("/dev/shm")
_SEGMENT = re.compile(r"^onnxpipe_(\d+)_")
_TEMP = re.compile(r"^onnxpipe-train-(\d+)-")
_WAKE = re.compile(r"^onnxpipe-wake-(\d+)-")


def segment_prefix() -> str:
    """Name prefix of this run's shared-memory segments (unique per pipeline)."""
    return f"onnxpipe_{os.getpid()}_{secrets.token_hex(3)}_"


def temp_dir() -> Path:
    """A fresh temporary directory for this run's stage files."""
    return Path(tempfile.mkdtemp(prefix=f"onnxpipe-train-{os.getpid()}-"))


def wake_path() -> Path:
    """A fresh path for a wake-up FIFO this process writes (in /dev/shm where there is one)."""
    return (_SHM if _SHM.is_dir() else Path(tempfile.gettempdir())) / f"onnxpipe-wake-{os.getpid()}-{secrets.token_hex(16)}"


def owner_alive(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def sweep_dead_runs() -> list[Path]:
    """Remove the segments, temp directories and wake-up FIFOs whose process is gone; returns what was removed."""
    removed = []
    for root, patterns in ((_SHM, (_SEGMENT, _WAKE)), (Path(tempfile.gettempdir()), (_TEMP, _WAKE))):
        try:
            entries = list(root.iterdir()) if root.is_dir() else []
        except OSError:
            continue
        for path in entries:
            match = next((m for pattern in patterns if (m := pattern.match(path.name))), None)
            if match is None or owner_alive(int(match.group(1))):
                continue
            try:
                shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
            except OSError:  # another user's, or gone meanwhile
                continue
            removed.append(path)
    return removed
