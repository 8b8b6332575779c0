"""Moving tensors between stages: `send(dst, key, microbatch, array)` and `recv(key, microbatch)`.

Keys name what travels: a tensor name for activations and model inputs, `grad_key(...)` for
gradients. `LocalTransport` keeps arrays in dicts (one process); `ShmTransport` copies them
through one shared-memory slot per (destination, key, micro-batch), created on first use and
reused every step, and signals with a small header on the destination's pipe (`make_inboxes`).
A backend for other hosts only has to offer the same three methods and the two counters.

Segments are mapped directly (`_Segment`), outside Python's resource tracker: no tracker process to
outlive a run or warn about segments other processes own. Their owner unlinks them; `sweep_segments`
removes what a dead worker (or a killed driver: `leftovers`) left.
"""

from __future__ import annotations

import fcntl
import marshal
import mmap
import os
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from onnxpipe.errors import OnnxpipeError

__all__ = ["Transport", "LocalTransport", "ShmTransport", "Inbox", "make_inboxes", "PeerGone", "grad_key", "shared_key", "sweep_segments"]

#: A stage's inbox: the (reader, writer) ends of one pipe; every sender writes, the stage reads.
Inbox = tuple[Connection, Connection]
#: Writes up to this size are atomic on a pipe (POSIX PIPE_BUF), so senders never interleave headers.
_ATOMIC_WRITE = 4096
#: Pipe capacity asked for: headers of thousands of unread messages fit before a sender blocks.
_PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031


def grad_key(tensor: str, sender: int) -> str:
    """Key of the gradient of `tensor` sent by stage `sender` (a tensor read by several stages gets one per reader)."""
    return f"grad:{sender}:{tensor}"


def shared_key(param: str, sender: int) -> str:
    """Key of a weight's accumulated gradient sent by worker `sender` (to the other holders: tied copies, replicas)."""
    return f"shared:{sender}:{param}"


class PeerGone(RuntimeError):
    """A message's shared memory vanished: its sender failed and cleaned up. A consequence of another
    stage's failure, never the root cause."""


class Transport(Protocol):
    """How one worker (or the driver, address -1) moves tensors. `recv` blocks until the tensor is there;
    `ready` says whether it would; the counters add up the seconds spent in send and recv."""

    copy_seconds: float
    copy_cpu_seconds: float

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None: ...

    def recv(self, key: str, microbatch: int) -> np.ndarray: ...

    def ready(self, key: str, microbatch: int) -> bool: ...


class LocalTransport:
    """All stages in one process: stage `me` reads its own inbox of a shared dict of inboxes."""

    def __init__(self, inboxes: dict[int, dict[tuple[str, int], np.ndarray]], me: int) -> None:
        self.inboxes = inboxes
        self.me = me
        self.copy_seconds = 0.0
        self.copy_cpu_seconds = 0.0

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        self.inboxes.setdefault(dst, {})[(key, microbatch)] = array

    def recv(self, key: str, microbatch: int) -> np.ndarray:
        return self.inboxes[self.me].pop((key, microbatch))

    def ready(self, key: str, microbatch: int) -> bool:
        return (key, microbatch) in self.inboxes.get(self.me, {})


def make_inboxes(ctx: Any, count: int) -> list[Inbox]:
    """One pipe per stage, from a multiprocessing context (the ends travel to spawned workers as arguments)."""
    inboxes = [ctx.Pipe(duplex=False) for _ in range(count)]
    for reader, _ in inboxes:
        try:
            fcntl.fcntl(reader.fileno(), _F_SETPIPE_SZ, _PIPE_BYTES)
        except OSError:  # above the system's pipe-max-size: keep the default capacity
            pass
    return inboxes


class _Segment:
    """A POSIX shared-memory segment mapped into this process: made by its sender (`size`), mapped
    read-only by its receiver."""

    __slots__ = ("name", "size", "_map", "buf")

    def __init__(self, name: str, size: int = 0, create: bool = False) -> None:
        from _posixshmem import shm_open  # type: ignore[import-not-found]

        fd = shm_open("/" + name, os.O_RDWR | os.O_CREAT | os.O_EXCL if create else os.O_RDONLY, mode=0o600)
        try:
            if create:
                os.ftruncate(fd, size)
            else:
                size = os.fstat(fd).st_size
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if create else 0))
        finally:
            os.close(fd)
        self.name, self.size = name, size
        self.buf = memoryview(self._map)

    def close(self) -> None:
        """Unmap (BufferError while arrays still view it)."""
        self.buf.release()
        self._map.close()


class _Slot:
    """A sender's segment for one (destination, key, micro-batch), with its header and the array view it writes through."""

    __slots__ = ("seg", "header", "shape", "dtype", "view")

    def __init__(self, seg: _Segment, header: bytes, shape: tuple[int, ...], dtype: np.dtype, view: np.ndarray) -> None:
        self.seg, self.header, self.shape, self.dtype, self.view = seg, header, shape, dtype, view


class ShmTransport:
    """Shared-memory slots named `<prefix><sender>_<dst>_<n>` (created by the sender on first use, reused
    every step; the receiver maps each once) plus a header `(key, micro-batch, slot, shape, dtype)` written
    on the destination's pipe. `recv` returns a read-only view of the slot, no copy: a slot is rewritten
    only in the next step (or command), after its reader is done with everything it received."""

    def __init__(self, prefix: str, inboxes: Sequence[Inbox], me: int, alive: Callable[[], bool] = lambda: True) -> None:
        self.prefix = prefix
        self.inboxes = inboxes
        self.me = me
        self.alive = alive
        self._slots: dict[tuple[int, str, int], _Slot] = {}
        self._made = 0
        self._attached: dict[str, _Segment] = {}
        self._arrived: dict[tuple[str, int], tuple[str, tuple[int, ...], str]] = {}
        #: Seconds spent in send and recv (copy into shared memory, signal, map): wall clock, and this
        #: thread's CPU time (the cost itself, without the preemption a loaded machine adds to the wall clock).
        self.copy_seconds = 0.0
        self.copy_cpu_seconds = 0.0

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        slot = self._slots.get((dst, key, microbatch))
        if slot is None or slot.shape != array.shape or slot.dtype != array.dtype:
            slot = self._new_slot(dst, key, microbatch, array)
        np.copyto(slot.view, array, casting="no")
        self.inboxes[dst][1].send_bytes(slot.header)
        self.copy_seconds += time.perf_counter() - start
        self.copy_cpu_seconds += time.thread_time() - cpu

    def recv(self, key: str, microbatch: int) -> np.ndarray:
        while (key, microbatch) not in self._arrived:
            self._drain(block=True)
        start, cpu = time.perf_counter(), time.thread_time()
        name, shape, dtype = self._arrived.pop((key, microbatch))
        seg = self._attached.get(name)
        if seg is None:
            try:
                seg = self._attached[name] = _Segment(name)
            except FileNotFoundError as exc:
                raise PeerGone(f"the sender of {key!r} (micro-batch {microbatch}) is gone") from exc
        out = np.ndarray(shape, np.dtype(dtype), buffer=seg.buf)  # read-only, as its mapping
        self.copy_seconds += time.perf_counter() - start
        self.copy_cpu_seconds += time.thread_time() - cpu
        return out

    def ready(self, key: str, microbatch: int) -> bool:
        while self.inboxes[self.me][0].poll():
            self._drain(block=False)
        return (key, microbatch) in self._arrived

    def _new_slot(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> _Slot:
        """The segment for this (destination, key, micro-batch), its header and a view to write into, made
        once (again only if the array outgrows the segment or changes shape)."""
        old = self._slots.get((dst, key, microbatch))
        if old is not None and old.seg.size >= max(array.nbytes, 1):
            seg = old.seg
        else:
            if old is not None:
                del old.view
                old.seg.close()
                _unlink(old.seg.name)
            seg = _Segment(f"{self.prefix}{self.me}_{dst}_{self._made}", max(array.nbytes, 1), create=True)
            self._made += 1
        header = marshal.dumps((key, microbatch, seg.name, tuple(array.shape), array.dtype.str))
        if len(header) > _ATOMIC_WRITE - 8:
            raise OnnxpipeError(f"tensor name {key[:60]!r}... is too long to travel between stages ({len(key)} characters); rename it below 3000 characters")
        slot = self._slots[(dst, key, microbatch)] = _Slot(seg, header, array.shape, array.dtype, np.ndarray(array.shape, array.dtype, buffer=seg.buf))
        return slot

    def _drain(self, block: bool) -> None:
        reader = self.inboxes[self.me][0]
        if not reader.poll(0.5 if block else 0):
            if block and not self.alive():
                raise SystemExit(3)
            return
        key, mb, name, shape, dtype = marshal.loads(reader.recv_bytes())
        self._arrived[(key, mb)] = (name, shape, dtype)

    def close(self) -> None:
        for seg in self._attached.values():
            try:
                seg.close()
            except BufferError:  # views still held (a failing stage's stash): the mapping goes with the process
                pass
        for slot in self._slots.values():
            del slot.view
            slot.seg.close()
            _unlink(slot.seg.name)
        self._attached.clear()
        self._slots.clear()


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
