"""The body of one worker process (a stage, or one replica of it): build the runner, then serve the driver's commands.

Commands (driver -> worker queue): ("step",), ("evaluate", n), ("get",), ("set", params, state), ("stop",).
Replies (one shared results queue): ("ready"|"done"|"outputs"|"state"|"error", worker, ...). An error
carries `time.monotonic()` of the failure (system-wide on Linux) and whether it is a consequence of
another stage's failure (`PeerGone`), so the driver can name the root cause.
`current` (shared ints: op code, micro-batch) tells the driver where a worker was if it dies.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
import traceback
from typing import Any

from onnxpipe.train.stage import StageProgram, StageRunner, StageSpec
from onnxpipe.train.transport import PeerGone, ShmTransport

__all__ = ["worker_main", "OPS", "peak_rss_bytes"]

#: prctl option: the signal a process gets when its parent dies.
_PR_SET_PDEATHSIG = 1

#: Op codes written to the shared `current` array; index 0 means idle.
OPS = ("idle", "RECV_F", "F", "SEND_F", "RECV_B", "B", "SEND_B", "STEP", "setup", "evaluate", "W")


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


def worker_main(spec: StageSpec, inboxes: Any, commands: Any, results: Any, prefix: str, current: Any) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the driver owns Ctrl-C and shuts workers down
    _die_with_parent()
    parent = os.getppid()
    me = spec.worker
    transport = ShmTransport(prefix, inboxes, me, alive=lambda: os.getppid() == parent)
    mark = (me * 2, me * 2 + 1)
    try:
        current[mark[0]] = OPS.index("setup")
        runner = StageRunner(spec)
        program = StageProgram(runner, transport)
        current[mark[0]] = 0
        results.put(("ready", me))
        while True:
            cmd = commands.get()
            if cmd[0] == "stop":
                break
            if cmd[0] == "step":
                busy0, copy0, cpu0 = runner.busy_seconds, transport.copy_seconds, transport.copy_cpu_seconds
                for action in spec.actions:
                    current[mark[0]], current[mark[1]] = OPS.index(action.op), action.microbatch
                    program.perform(action)
                current[mark[0]] = 0
                results.put(("done", me, runner.take_losses(), runner.busy_seconds - busy0, transport.copy_seconds - copy0,
                             runner.peak_stash_bytes, peak_rss_bytes(), program.take_timings(), transport.copy_cpu_seconds - cpu0))
            elif cmd[0] == "evaluate":
                outputs = []
                for i in range(cmd[1]):
                    if spec.layout.owner(spec.index, i) != me:
                        continue
                    current[mark[0]], current[mark[1]] = OPS.index("evaluate"), i
                    feeds = {t: transport.recv(t, i) for t, _ in spec.wiring.recv_f}
                    feeds.update({t: transport.recv(t, i) for t in spec.wiring.model_inputs})
                    out = runner.forward(i, feeds, train=False)
                    for t, dsts in spec.wiring.send_f:
                        for dst in dsts:
                            transport.send(spec.layout.owner(dst, i), t, i, out[t])
                    outputs.append((i, out))
                current[mark[0]] = 0
                results.put(("outputs", me, outputs))
            elif cmd[0] == "get":
                results.put(("state", me, runner.params, runner.optimizer.state()))
            elif cmd[0] == "set":
                runner.params = {k: v.copy() for k, v in cmd[1].items()}
                runner.optimizer.load_state(cmd[2])
                results.put(("state", me, {}, {}))
    except SystemExit:
        pass
    except BaseException as exc:  # report anything, then exit: the driver turns it into one line
        failed_at = time.monotonic()
        op, mb = current[mark[0]], current[mark[1]]
        detail = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        results.put(("error", me, OPS[op] if 0 <= op < len(OPS) else "?", mb, detail, traceback.format_exc(),
                     failed_at, isinstance(exc, PeerGone)))
    finally:
        transport.close()
