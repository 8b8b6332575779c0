"""Tensors between Ray actors (and from the driver) through Ray's shared-memory channels
(`ray.experimental.channel.Channel`, what Ray's compiled graphs are built on): one channel per
(sender, receiver) pair, written only by the sender, read by one thread of the receiver that copies each
message into the receiver's inbox. Within a host a hop is a copy through shared memory; between hosts
Ray pushes the buffer to the reader's node.

Why channels (tools/measure_ray.py, docs/benchmarks.md): a 256 KiB hop took 0.26 ms through a channel
against 2.4 ms through the object store (a reference or a method argument). A channel holds one message:
the writer waits until the reader took the previous one, which its reader thread does at once, so a
sender never waits on the receiver's schedule. Messages carry their (key, micro-batch), so the order
in which a pair's messages arrive does not matter: replicas, tied weights' gradient sums and skip
connections (one tensor to several stages) are messages like any other.

Reading order: `open_channel` -> `_Writer` -> `ChannelTransport` (send, recv, ready, close) -> `_Reader`.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from ray.exceptions import RayChannelError
from ray.experimental.channel import Channel  # at import: actors import it on two threads at once otherwise

__all__ = ["ChannelTransport", "open_channel", "CHANNEL_BYTES"]

#: First buffer size of a channel; Ray grows it when a larger message is written.
CHANNEL_BYTES = 1 << 20


def open_channel(writer: Any, reader: Any, reader_node: str) -> Any:
    """A channel that `writer` (an actor handle, or None for the driver) writes, read by the actor
    `reader` on node `reader_node`. Must be called in the writer's process."""
    return Channel(writer, [(reader, reader_node)], CHANNEL_BYTES)


class _Reader(threading.Thread):
    """Reads one incoming channel until it closes, copying each tensor out of the channel's buffer
    (the sender reuses it for its next message) into the inbox."""

    def __init__(self, channel: Any, transport: ChannelTransport) -> None:
        super().__init__(name="onnxpipe-channel-reader", daemon=True)
        self.channel = channel
        self.transport = transport

    def run(self) -> None:
        while True:
            try:
                key, microbatch, array = self.channel.read()
            except RayChannelError:  # closed: the run is over, or its writer is gone
                return
            start, cpu = time.perf_counter(), time.thread_time()
            copy = np.array(array, copy=True)
            del array
            self.transport._arrive(key, microbatch, copy, time.perf_counter() - start, time.thread_time() - cpu)


class _Writer(threading.Thread):
    """Writes one channel's messages in order, so that its owner never waits on the reader (a dead
    reader never takes a message: `close` ends the wait)."""

    def __init__(self, channel: Any) -> None:
        super().__init__(name="onnxpipe-channel-writer", daemon=True)
        self.channel = channel
        self.outbox: queue.SimpleQueue[tuple[str, int, np.ndarray] | None] = queue.SimpleQueue()

    def run(self) -> None:
        while (message := self.outbox.get()) is not None:
            try:
                self.channel.write(message)
            except RayChannelError:
                return


class ChannelTransport:
    """One worker's end (`me`; -1: the driver): `outgoing[dst]` is the channel it writes to worker `dst`,
    `incoming` the channels other workers (and the driver) write to it. With `background`, a thread per
    channel writes (the driver's end: it must never block on a worker); the arrays sent must then stay
    unchanged until read."""

    def __init__(self, me: int, outgoing: Mapping[int, Any], incoming: Sequence[Any] = (), background: bool = False) -> None:
        self.me = me
        self.outgoing = dict(outgoing)
        self.incoming = tuple(incoming)
        self._writers = {dst: _Writer(channel) for dst, channel in self.outgoing.items()} if background else {}
        for writer in self._writers.values():
            writer.start()
        self._inbox: dict[tuple[str, int], np.ndarray] = {}
        self._arrived = threading.Condition()
        #: Seconds spent in send and recv: wall clock, and this thread's CPU time.
        self.copy_seconds = 0.0
        self.copy_cpu_seconds = 0.0
        self._readers = [_Reader(channel, self) for channel in self.incoming]
        for reader in self._readers:
            reader.start()

    def send(self, dst: int, key: str, microbatch: int, array: np.ndarray) -> None:
        start, cpu = time.perf_counter(), time.thread_time()
        message = (key, microbatch, np.ascontiguousarray(array))
        if self._writers:
            self._writers[dst].outbox.put(message)
        else:
            self.outgoing[dst].write(message)
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

    def _arrive(self, key: str, microbatch: int, array: np.ndarray, seconds: float, cpu_seconds: float) -> None:
        """A reader thread's delivery, with what its copy cost (counted as the receiver's transport time)."""
        with self._arrived:
            self._inbox[(key, microbatch)] = array
            self.copy_seconds += seconds
            self.copy_cpu_seconds += cpu_seconds
            self._arrived.notify_all()

    def close(self) -> None:
        """Close every channel of this end: its reader threads and those of the workers it writes to end."""
        for channel in (*self.outgoing.values(), *self.incoming):
            try:
                channel.close()
            except Exception:  # the peer's node is gone: nothing left to close
                pass
        for writer in self._writers.values():
            writer.outbox.put(None)
