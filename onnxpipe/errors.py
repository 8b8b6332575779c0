"""The one exception type users see: its message is a single line naming the problem and the way out."""

from __future__ import annotations

__all__ = ["OnnxpipeError"]


class OnnxpipeError(Exception):
    """A user-facing failure; the CLI prints its message alone and exits with code 2."""
