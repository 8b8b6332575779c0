"""Tensors between Ray actors (and from the driver) through Ray's shared-memory channels
(`ray.experimental.channel.Channel`, what Ray's compiled graphs are built on): one channel per
(sender, receiver) pair, written only by the sender, read by one thread of the receiver that puts each
message into the receiver's inbox. Within a host a hop is one copy, into shared memory, and the receiver
reads the tensor in place; between hosts Ray pushes the buffer to the reader's node and the reader copies
it out (that channel has a single buffer, which the next message needs).

Why in place within a host: Ray releases a channel buffer for its writer's next message only once the
reader dropped every view of the value it read, so a view stays valid for as long as the stage keeps it
(stashed for its backward, say), and the writer of a buffer still viewed waits. A channel within a node
therefore gets one buffer per message a command sends on it (`open_channel`'s `buffers`): a stage holds
at most that many (its row consumes them all before it answers), so no sender ever waits on a view.
Copying each message out instead cost the receiver about 1.2 ms per 3.5 MB message on this machine.

Why channels (tools/measure_ray.py, docs/benchmarks.md): a 256 KiB hop took 0.26 ms through a channel
against 2.4 ms through the object store (a reference or a method argument). Messages carry their (key, micro-batch), so the order
in which a pair's messages arrive does not matter: replicas, tied weights' gradient sums and skip
connections (one tensor to several stages) are messages like any other.

Why a wake-up pipe beside each channel within a node: a reader waiting in `Channel.read` spins (Ray's
read acquire loops on `sched_yield`), so every idle reader thread ate CPU the stages' sessions needed:
on 2 cores resnet-tiny's step took 2x the local backend's while the idle actors burnt a third of a core
each. Where writer and reader share a node, the writer writes the channel and then posts a byte on a
FIFO there; the reader sleeps in the kernel on the FIFO and reads the channel only once a message is
complete, so it never spins. (Posting before the write, as a single buffer needed, let the reader spin
while the writer copied the message in: with in-place reads an actor of resnet-tiny at batch 256 spent
11 ms of CPU a step more than a local worker.) Between nodes the reader reads as before.

Why a tensor over 1 MiB travels as 1 MiB parts: Ray copies every buffer over 1 MiB into a channel with 6
threads it creates and joins for that one copy (`parallel_memcopy`, a build-time constant). On 2 cores the
writer then waits for them behind the other stage's work: a 4 MiB write took 0.6-0.7 ms of wall time for
0.27-0.35 ms of the writer's own CPU, the helpers' CPU beside it (resnet-tiny at batch 256: 10 ms a step of
stage 0's sends off its CPU). Parts of at most 1 MiB are copied with one `memcpy` each (0.37-0.40 ms wall
and CPU for the same 4 MiB), and as whole multiples of 64 bytes Ray lays them end to end in the buffer, so
the reader still views the tensor in place (`_Parts.join`).

Messages that are not tensors (the driver's commands, the workers' replies) travel on the same channels
(`post`, `messages`): a command reaches a waiting worker as one channel write and a wake-up, where an
actor method call cost the driver and the actor 1.5-3 ms of Ray's own work a step. They arrive as
copies of their own (the driver keeps what replies carry: weights, outputs).

Reading order: `Link` -> `open_channel` -> `_Parts` -> `_Wake` -> `_Writer` -> `ChannelTransport` (send, recv, ready,
post, messages, close) -> `_Reader`.
"""

from __future__ import annotations

import contextlib
import copy
import os
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import ray
from ray.exceptions import RayChannelError
from ray.experimental.channel import Channel  # at import: actors import it on two threads at once otherwise
from ray.experimental.channel.shared_memory_channel import BufferedSharedMemoryChannel

from onnxpipe.train.leftovers import wake_path

__all__ = ["ChannelTransport", "Link", "open_channel", "CHANNEL_BYTES"]

#: First buffer size of a channel; Ray grows it when a larger message is written.
CHANNEL_BYTES = 1 << 20


#: Largest buffer Ray copies with a single memcpy (its kMemcopyDefaultThreshold); larger ones it copies
#: with threads of their own. A multiple of 64 bytes, Ray's alignment of large buffers.
PART_BYTES = 1 << 20


#: Wake-up bytes: a message follows on the channel; the transport closes.
_MESSAGE, _CLOSE = b"m", b"c"
#: The writer's end of each wake-up FIFO this process made, by path (file descriptors do not travel
#: with a pickled `Link`); `ChannelTransport` takes its own out.
_WRITER_FDS: dict[str, int] = {}


@dataclass(frozen=True)
class Link:
    """One (sender, receiver) channel, and the path of its wake-up FIFO on the reader's node (None:
    writer and reader on different nodes, the reader waits in `Channel.read`)."""

    channel: Any
    wake: str | None


def open_channel(writer: Any, reader: Any, reader_node: str, buffers: int = 1) -> Link:
    """A channel that `writer` (an actor handle, or None for the driver) writes, read by the actor
    `reader` on node `reader_node`, with `buffers` buffers within a node (Ray buffers channels within a
    node only): as many as the messages its reader may hold at once. Must be called in the writer's process."""
    if reader_node != ray.get_runtime_context().get_node_id():
        return Link(Channel(writer, [(reader, reader_node)], CHANNEL_BYTES), None)
    channel = BufferedSharedMemoryChannel(writer, [(reader, reader_node)], max(1, buffers), CHANNEL_BYTES)
    path = str(wake_path())
    os.mkfifo(path, 0o600)
    _WRITER_FDS[path] = os.open(path, os.O_RDWR)  # read-write: never blocks, and the FIFO lives until the reader opens it
    return Link(channel, path)


@dataclass(frozen=True)
class _Parts:
    """A tensor over `PART_BYTES` as consecutive byte views of at most that size (see the module docstring)."""

    dtype: str
    shape: tuple[int, ...]
    parts: tuple[np.ndarray, ...]

    @staticmethod
    def split(array: np.ndarray) -> np.ndarray | _Parts:
        """`array` (C-contiguous) as parts when it is larger than one part, else itself."""
        if array.nbytes <= PART_BYTES:
            return array
        flat = array.reshape(-1).view(np.uint8)
        return _Parts(array.dtype.str, array.shape, tuple(flat[i:i + PART_BYTES] for i in range(0, flat.nbytes, PART_BYTES)))

    def join(self, in_place: bool) -> np.ndarray:
        """The tensor: `in_place`, a view over the parts where they lie end to end in memory (as Ray lays
        them in a channel's buffer; the view keeps the first part, and with it the buffer, alive), else a copy."""
        starts = [p.__array_interface__["data"][0] for p in self.parts]
        total = sum(p.nbytes for p in self.parts)
        if in_place and all(a + p.nbytes == b for a, p, b in zip(starts, self.parts, starts[1:])):
            flat = np.lib.stride_tricks.as_strided(self.parts[0], shape=(total,), strides=(1,), writeable=False)
        else:
            flat = np.concatenate(self.parts)
        return flat.view(np.dtype(self.dtype)).reshape(self.shape)


def _tensor(value: np.ndarray | _Parts, in_place: bool) -> np.ndarray:
    """A tensor read from a channel: the buffer's own memory `in_place`, else a copy the reader owns."""
    if isinstance(value, _Parts):
        return value.join(in_place)
    return value if in_place else np.array(value, copy=True)


class _Wake:
    """One end of a wake-up FIFO: `post` from any thread, `wait` from the reader thread alone."""

    def __init__(self, fd: int) -> None:
        self._fd: int | None = fd
        self._lock = threading.Lock()

    def post(self, what: bytes) -> None:
        with self._lock:
            if self._fd is not None:
                try:
                    os.write(self._fd, what)
                except OSError:  # the reader's node side is gone: its channel says so
                    pass

    def wait(self) -> bytes:
        assert self._fd is not None
        return os.read(self._fd, 1)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None


def _reader_wake(link: Link) -> _Wake | None:
    """Open the reader's end of `link`'s FIFO and remove its name (both ends hold it open now)."""
    if link.wake is None:
        return None
    fd = os.open(link.wake, os.O_RDWR)
    try:
        os.unlink(link.wake)
    except OSError:
        pass
    return _Wake(fd)


def _writer_wake(link: Link) -> _Wake | None:
    fd = _WRITER_FDS.pop(link.wake, None) if link.wake is not None else None
    return _Wake(fd) if fd is not None else None


class _Reader(threading.Thread):
    """Reads one incoming channel until it closes, putting each tensor into the inbox: in place within
    a node, copied out of a channel from another node (whose one buffer the next message needs); with a
    wake-up FIFO (within a node) it reads the channel only when the writer said a message comes."""

    def __init__(self, link: Link, transport: ChannelTransport) -> None:
        super().__init__(name="onnxpipe-channel-reader", daemon=True)
        self.channel = link.channel
        self.wake = _reader_wake(link)
        self.transport = transport

    def run(self) -> None:
        try:
            while self.wake is None or self.wake.wait() == _MESSAGE:
                try:
                    key, microbatch, array = self.channel.read()
                except RayChannelError:  # closed: the run is over, or its writer is gone
                    return
                if key is None:
                    self.transport._deliver(copy.deepcopy(array))
                    continue
                if self.wake is not None:
                    self.transport._arrive(key, microbatch, _tensor(array, in_place=True), 0.0, 0.0)
                    continue
                start, cpu = time.perf_counter(), time.thread_time()
                owned = _tensor(array, in_place=False)
                del array
                self.transport._arrive(key, microbatch, owned, time.perf_counter() - start, time.thread_time() - cpu)
        finally:
            if self.wake is not None:
                self.wake.close()

    def stop(self) -> None:
        if self.wake is not None:
            self.wake.post(_CLOSE)


class _Writer(threading.Thread):
    """Writes one channel's messages in order, so that its owner never waits on the reader (a dead
    reader never takes a message: `close` ends the wait)."""

    def __init__(self, link: Link, wake: _Wake | None) -> None:
        super().__init__(name="onnxpipe-channel-writer", daemon=True)
        self.link = link
        self.wake = wake
        self.outbox: queue.SimpleQueue[tuple[str | None, int, Any] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                _write(self.link.channel, self.wake, message)
            except RayChannelError:
                return


def _write(channel: Any, wake: _Wake | None, message: tuple[str | None, int, Any]) -> None:
    """Wake the reader once the message is whole. A write waits only for a buffer whose value its reader
    still holds, which the reader drops on its own (it read it on an earlier wake-up)."""
    channel.write(message)
    if wake is not None:
        wake.post(_MESSAGE)


class ChannelTransport:
    """One worker's end (`me`; -1: the driver): `outgoing[dst]` is the link it writes to worker `dst`,
    `incoming` the links other workers (and the driver) write to it. With `background`, a thread per
    channel writes (the driver's end: it must never block on a worker); the arrays sent must then stay
    unchanged until read."""

    def __init__(self, me: int, outgoing: Mapping[int, Link], incoming: Sequence[Link] = (), background: bool = False) -> None:
        self.me = me
        self.outgoing = dict(outgoing)
        self.incoming = tuple(incoming)
        self._wakes = {dst: _writer_wake(link) for dst, link in self.outgoing.items()}
        self._writers = {dst: _Writer(link, self._wakes[dst]) for dst, link in self.outgoing.items()} if background else {}
        for writer in self._writers.values():
            writer.start()
        self._inbox: dict[tuple[str, int], np.ndarray] = {}
        self._posted: list[Any] = []
        self._closed = False
        self._arrived = threading.Condition()
        #: Seconds spent in send and recv: wall clock, and this thread's CPU time.
        self.copy_seconds = 0.0
        self.copy_cpu_seconds = 0.0
        self._readers = [_Reader(link, self) for link in self.incoming]
        for reader in self._readers:
            reader.start()

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        self._put(dst, (key, microbatch, _Parts.split(np.ascontiguousarray(array))))
        with self._arrived:
            self.copy_seconds += time.perf_counter() - start
            self.copy_cpu_seconds += time.thread_time() - cpu

    def recv(self, key: str, microbatch: int) -> np.ndarray:
        with self._arrived:
            self._arrived.wait_for(lambda: (key, microbatch) in self._inbox)
            return self._inbox.pop((key, microbatch))

    def ready(self, key: str, microbatch: int) -> bool:
        with self._arrived:
            return (key, microbatch) in self._inbox

    def post(self, dst: int, message: Any) -> None:
        """Send `dst` a message that is not a tensor (a command, a reply); it takes them with `messages`, in order."""
        self._put(dst, (None, -1, message))

    def messages(self, timeout: float | None) -> list[Any]:
        """The posted messages that arrived, in order, waiting up to `timeout` seconds (None: for ever)
        for the first; EOFError once this end is closed."""
        with self._arrived:
            self._arrived.wait_for(lambda: self._posted or self._closed, timeout)
            if self._closed and not self._posted:
                raise EOFError("the transport is closed")
            out, self._posted = self._posted, []
            return out

    def _put(self, dst: int, message: tuple[str | None, int, Any]) -> None:
        if self._writers:
            self._writers[dst].outbox.put(message)
        else:
            _write(self.outgoing[dst].channel, self._wakes[dst], message)

    def _deliver(self, message: Any) -> None:
        with self._arrived:
            self._posted.append(message)
            self._arrived.notify_all()

    def _arrive(self, key: str, microbatch: int, array: np.ndarray, seconds: float, cpu_seconds: float) -> None:
        """A reader thread's delivery, with what its copy cost (counted as the receiver's transport time)."""
        with self._arrived:
            self._inbox[(key, microbatch)] = array
            self.copy_seconds += seconds
            self.copy_cpu_seconds += cpu_seconds
            self._arrived.notify_all()

    def close(self) -> None:
        """Close every channel of this end: its reader threads and those of the workers it writes to end."""
        with self._arrived:
            self._closed = True
            self._arrived.notify_all()
        for link in (*self.outgoing.values(), *self.incoming):
            try:
                link.channel.close()
            except Exception:  # the peer's node is gone: nothing left to close
                pass
        for reader in self._readers:
            reader.stop()
        for writer in self._writers.values():
            writer.outbox.put(None)
        for writer in self._writers.values():
            writer.join(timeout=1.0)  # a writer ends once its channel is closed; its wake-up end closes after it
        for wake in self._wakes.values():
            if wake is not None:
                wake.post(_CLOSE)
                wake.close()
        for link in self.outgoing.values():  # a FIFO whose reader never opened it (a start cut short) still has its name
            if link.wake is not None:
                with contextlib.suppress(OSError):
                    os.unlink(link.wake)
