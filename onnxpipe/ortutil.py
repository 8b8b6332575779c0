"""Keeping onnxruntime quiet: its gradient builder and graph rewrites log every pass at info level to
native stderr, whatever the Python-side settings say."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

__all__ = ["quiet_stderr", "quiet_logger"]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence native stderr (file descriptor 2) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@functools.cache
def quiet_logger() -> None:
    """onnxruntime's default logger at warning level and above, once per process."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)
