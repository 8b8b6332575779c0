"""Moving tensors between stages: `send(dst, key, microbatch, array)` and `recv(key, microbatch)`.

Keys name what travels: a tensor name for activations and model inputs, `grad_key(...)` for
gradients. `LocalTransport` keeps arrays in dicts (one process); `ShmTransport` copies them
through one reusable shared-memory slot per (destination, key, micro-batch) and signals on the
destination's queue. A multi-host backend only has to offer the same three methods.
"""

from __future__ import annotations

import queue as queue_mod
import time
from collections.abc import Callable, Sequence
from multiprocessing import resource_tracker, shared_memory
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["Transport", "LocalTransport", "ShmTransport", "PeerGone", "grad_key", "shared_key", "sweep_segments"]


def grad_key(tensor: str, sender: int) -> str:
    """Key of the gradient of `tensor` sent by stage `sender` (a tensor read by several stages gets one per reader)."""
    return f"grad:{sender}:{tensor}"


def shared_key(param: str, sender: int) -> str:
    """Key of a tied parameter's accumulated gradient sent by stage `sender`."""
    return f"shared:{sender}:{param}"


class PeerGone(RuntimeError):
    """A message's shared memory vanished: its sender failed and cleaned up. A consequence of another
    stage's failure, never the root cause."""


class Transport(Protocol):
    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None: ...

    def recv(self, key: str, microbatch: int) -> np.ndarray: ...

    def ready(self, key: str, microbatch: int) -> bool: ...


class LocalTransport:
    """All stages in one process: stage `me` reads its own inbox of a shared dict of inboxes."""

    def __init__(self, inboxes: dict[int, dict[tuple[str, int], np.ndarray]], me: int) -> None:
        self.inboxes = inboxes
        self.me = me

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        self.inboxes.setdefault(dst, {})[(key, microbatch)] = array

    def recv(self, key: str, microbatch: int) -> np.ndarray:
        return self.inboxes[self.me].pop((key, microbatch))

    def ready(self, key: str, microbatch: int) -> bool:
        return (key, microbatch) in self.inboxes.get(self.me, {})


class ShmTransport:
    """Shared-memory slots named `<prefix><dst>_<n>` (created by the sender, reused every step) plus a queue per stage."""

    def __init__(self, prefix: str, inboxes: Sequence[Any], me: int, alive: Callable[[], bool] = lambda: True) -> None:
        self.prefix = prefix
        self.inboxes = inboxes
        self.me = me
        self.alive = alive
        self._slots: dict[tuple[int, str, int], shared_memory.SharedMemory] = {}
        self._attached: dict[str, shared_memory.SharedMemory] = {}
        self._arrived: dict[tuple[str, int], tuple[str, tuple[int, ...], str]] = {}
        #: Seconds spent copying in and out of shared memory (the transfer share of a step).
        self.copy_seconds = 0.0

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        start = time.perf_counter()
        array = np.ascontiguousarray(array)
        slot = self._slots.get((dst, key, microbatch))
        if slot is None or slot.size < max(array.nbytes, 1):
            slot = _untracked(shared_memory.SharedMemory(name=f"{self.prefix}{self.me}_{dst}_{len(self._slots)}", create=True, size=max(array.nbytes, 1)))
            self._slots[(dst, key, microbatch)] = slot
        np.ndarray(array.shape, array.dtype, buffer=slot.buf)[...] = array
        self.inboxes[dst].put((key, microbatch, slot.name, array.shape, array.dtype.str))
        self.copy_seconds += time.perf_counter() - start

    def recv(self, key: str, microbatch: int) -> np.ndarray:
        while (key, microbatch) not in self._arrived:
            self._drain(block=True)
        start = time.perf_counter()
        name, shape, dtype = self._arrived.pop((key, microbatch))
        seg = self._attached.get(name)
        if seg is None:
            try:
                seg = self._attached[name] = _untracked(shared_memory.SharedMemory(name=name))
            except FileNotFoundError as exc:
                raise PeerGone(f"the sender of {key!r} (micro-batch {microbatch}) is gone") from exc
        out = np.ndarray(shape, np.dtype(dtype), buffer=seg.buf).copy()
        self.copy_seconds += time.perf_counter() - start
        return out

    def ready(self, key: str, microbatch: int) -> bool:
        self._drain(block=False)
        return (key, microbatch) in self._arrived

    def _drain(self, block: bool) -> None:
        inbox = self.inboxes[self.me]
        try:
            msg = inbox.get(timeout=0.5) if block else inbox.get_nowait()
        except queue_mod.Empty:
            if block and not self.alive():
                raise SystemExit(3)
            return
        key, mb, name, shape, dtype = msg
        self._arrived[(key, mb)] = (name, tuple(shape), dtype)

    def close(self) -> None:
        for seg in self._attached.values():
            seg.close()
        for seg in self._slots.values():
            seg.close()
            _unlink(seg.name)
        self._attached.clear()
        self._slots.clear()


def _untracked(seg: shared_memory.SharedMemory) -> shared_memory.SharedMemory:
    """Segments are unlinked by their owner or swept by the driver: keep Python's resource tracker out
    (it would warn about, or unlink under us, segments other processes own)."""
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


def _unlink(name: str) -> None:
    try:
        from _posixshmem import shm_unlink  # type: ignore[import-not-found]

        shm_unlink("/" + name.lstrip("/"))
    except (ImportError, FileNotFoundError, OSError):
        pass


def sweep_segments(prefix: str) -> int:
    """Unlink every segment whose name starts with `prefix` (left by a worker that died); returns how many."""
    root = Path("/dev/shm")
    names = [p.name for p in root.glob(f"{prefix}*")] if root.is_dir() else []
    for name in names:
        _unlink(name)
    return len(names)
