"""The body of one worker process (a stage, one replica of it, or a device's stages: `host`): receive its
specs, build the stages, then serve the driver's commands (`messages`, each addressed to one of its
workers) with a `Host` of `StageServer`s.

It starts with SIGINT ignored (set by the driver before the spawn and inherited through exec, so even
a Ctrl-C during its imports cannot print a traceback): the driver owns Ctrl-C and stops the workers.
`current` (shared ints per worker: op code, micro-batch, actions done) tells the driver where a worker
was if it dies, and that workers make progress.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from typing import Any

from onnxpipe.train.affinity import bind
from onnxpipe.train.host import Host
from onnxpipe.train.messages import Failed, Infer, Ready, Stop, Train
from onnxpipe.train.stage import StageServer, StageSpec
from onnxpipe.train.transport import PeerGone, ShmTransport

__all__ = ["worker_main", "OPS", "peak_rss_bytes", "keep_freed_memory"]

#: prctl option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1

#: mallopt parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4
#: Free heap bytes glibc may keep before returning any to the OS: all of them (2**31 - 1, its largest).
_NEVER_TRIM = 2**31 - 1

#: Op codes written to the shared `current` array; index 0 means idle.
OPS = ("idle", "RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "STEP", "setup", "W")
#: Shared ints per worker in `current`.
SLOTS = 3


def peak_rss_bytes() -> int:
    """Peak resident set size of this process (VmHWM), 0 where /proc is missing."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _die_with_parent() -> None:
    """On Linux the kernel kills this worker when the driver dies, however it dies (SIGKILL included),
    so no worker outlives its run."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: the transport's parent check still ends the worker
        pass


def keep_freed_memory() -> None:
    """Make glibc's malloc keep freed memory for reuse instead of handing it back to the OS.

    A worker allocates the same tensors every micro-batch (the session's outputs, the gradient sums, the
    optimizer's temporaries: megabytes each). By default glibc serves such blocks with fresh mmaps or trims
    them off the heap when freed, so each action touches new pages and pays a page fault per 4 KiB. Measured
    here (a 2-vCPU VM): 2-3.5 us per fault; 10 ms instead of 2.5 ms for a 17 MiB stage's optimizer step,
    +3 ms on its 25 ms backward. The profile that prices the actions runs in onnxruntime's arena and never pays
    it, so a worker whose allocations fault runs slower than its plan by the host's page-fault cost. Kept
    memory never exceeds the peak the worker reached (its peak RSS). No-op without glibc."""
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_MAX, 0)  # every block from the heap: no mmap per large tensor
        libc.mallopt(_M_TRIM_THRESHOLD, _NEVER_TRIM)
    except (OSError, AttributeError):  # not glibc
        pass


def worker_main(commands: Any, replies: Any, inboxes: Any, prefix: str, current: Any, cpus: tuple[int, ...] = ()) -> None:
    """Serve until `Stop`, the driver's end of `commands` closing, or a failure (reported as `Failed`).
    A Train or Infer runs once every hosted worker got it (the driver sends it to all), in the host's order.
    `cpus`: the CPUs this process is bound to before its sessions start their threads (none: the OS places it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    keep_freed_memory()
    parent = os.getppid()
    try:
        specs: tuple[StageSpec, ...] = commands.recv()
    except (EOFError, OSError):  # the driver is gone before it sent the specs
        return
    transports = [ShmTransport(prefix, inboxes, s.worker, alive=lambda: os.getppid() == parent) for s in specs]
    worker = specs[0].worker  # the worker whose action (or setup) runs: a failure is reported as its own
    try:
        if cpus:
            bind(cpus)
        servers = []
        for spec, transport in zip(specs, transports):
            worker = spec.worker
            current[worker * SLOTS] = OPS.index("setup")
            servers.append(StageServer(spec, transport, rss=peak_rss_bytes))
            current[worker * SLOTS] = 0
        host = Host(servers)
        for w in host.workers:
            replies.send(Ready(w))
        waiting: set[int] = set()
        while not isinstance(item := commands.recv(), Stop):
            to, command = item
            if not isinstance(command, (Train, Infer)):
                replies.send(host.server(to).reply(command))
                continue
            waiting.add(to)
            if len(waiting) < len(host.workers):
                continue
            waiting.clear()
            for server, action in host.row(command):
                worker = server.runner.spec.worker
                base = worker * SLOTS
                current[base], current[base + 1] = OPS.index(action.op), action.microbatch
                host.perform(server, action)
                current[base] = 0
                current[base + 2] += 1
            for w in host.workers:
                replies.send(host.server(w).reply(command))
    except (SystemExit, EOFError, BrokenPipeError):  # the driver is gone: nobody to tell
        pass
    except BaseException as exc:  # report anything, then exit: the driver turns it into one line
        failed_at = time.monotonic()
        op, mb = current[worker * SLOTS], current[worker * SLOTS + 1]
        message = str(exc).strip()
        detail = f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}"
        try:
            replies.send(Failed(worker, OPS[op] if 0 <= op < len(OPS) else "?", mb, detail, traceback.format_exc(),
                                failed_at, isinstance(exc, PeerGone)))
        except OSError:
            pass
    finally:
        for transport in transports:
            transport.close()
