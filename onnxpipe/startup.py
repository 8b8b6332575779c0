"""Ctrl-C while the command line is still starting: a quiet exit (130), not an interrupted import's traceback.

Importing onnxpipe and its dependencies takes a while; a KeyboardInterrupt raised inside an import cannot be
caught by the command it precedes. So when the process is the `onnxpipe` program (never when a program
imports onnxpipe as a library), SIGINT exits at once until a command starts, which then takes Ctrl-C back
as a KeyboardInterrupt for its own clean-up (`cli.friendly`).

Reading order: `quiet_until_command` -> `interrupts_raise`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["quiet_until_command", "interrupts_raise"]


def _exit_interrupted(signum: int, frame: FrameType | None) -> None:
    os.write(2, b"interrupted\n")
    os._exit(130)


def quiet_until_command() -> None:
    """As the `onnxpipe` program starts (its console script, or `python -m onnxpipe`, during whose import
    argv[0] is "-m"), Ctrl-C exits quietly; a SIGINT the shell ignores (a background job) stays ignored."""
    program = os.path.basename(sys.argv[0]) == "onnxpipe" or sys.argv[:1] == ["-m"]
    if program and threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, _exit_interrupted)


def interrupts_raise() -> None:
    """A command is running: Ctrl-C raises KeyboardInterrupt again, for the command to clean up."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGINT) is _exit_interrupted:
        signal.signal(signal.SIGINT, signal.default_int_handler)
