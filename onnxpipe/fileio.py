"""Writes that a reader never sees half done: a temp file or directory beside the destination, then a rename.

One place for it so every command keeps the promise "no half-written output" the same way.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["atomic_path", "write_bytes", "write_json", "fresh_dir_beside", "swap_in"]


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temp path beside `path` to write to; it replaces `path` when the block ends without an
    error and is removed otherwise. The rename stays on one file system, so it is atomic."""
    target = Path(path)
    tmp = target.with_name(f".{target.name}.tmp{os.getpid()}")
    try:
        yield tmp
        os.replace(tmp, target)
    finally:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> Path:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)
    return Path(path)


def write_json(path: str | os.PathLike, data: Any) -> Path:
    return write_bytes(path, json.dumps(data, indent=2).encode())


@contextlib.contextmanager
def _interrupts_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM that arrive in the block are delivered when it ends. Python runs signal
    handlers in the main thread only, so a block elsewhere cannot be interrupted and needs nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    # A handler set outside Python (getsignal: None) could not be put back: such a signal is left as it is.
    previous = {sig: signal.signal(sig, lambda signum, frame: caught.append(signum))
                for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) is not None}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(caught):
            signal.raise_signal(sig)


def fresh_dir_beside(target: str | os.PathLike) -> Path:
    """A new empty directory `.NAME.<random>.tmp` beside `target` (its parents made as needed), an ordinary directory
    once renamed into place. Made with interruptions held: one that arrives meanwhile removes it again, so no such
    directory exists that its caller does not know of. Raises OSError where the parent cannot be written."""
    parent = Path(target).absolute().parent
    parent.mkdir(parents=True, exist_ok=True)
    made: Path | None = None
    try:
        with _interrupts_deferred():
            made = Path(tempfile.mkdtemp(prefix=f".{Path(target).name}.", suffix=".tmp", dir=parent))
            umask = os.umask(0)
            os.umask(umask)
            made.chmod(0o777 & ~umask)  # mkdtemp makes it private
    except BaseException:
        if made is not None:
            shutil.rmtree(made, ignore_errors=True)
        raise
    return made


def swap_in(tmp: str | os.PathLike, target: str | os.PathLike) -> None:
    """Put a finished directory in place of `target`: an old one is renamed away first and deleted
    only once the new one is in, and put back if the rename fails. An interruption waits for the
    swap to end, so it never leaves the old directory beside the new one, or neither in place."""
    tmp, target = Path(tmp), Path(target)
    with _interrupts_deferred():
        if not target.exists():
            os.replace(tmp, target)
            return
        old = target.with_name(f".{target.name}.old{os.getpid()}")
        os.replace(target, old)
        try:
            os.replace(tmp, target)
        except OSError:
            os.replace(old, target)
            raise
        shutil.rmtree(old, ignore_errors=True)
