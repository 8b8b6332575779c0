"""The Ray backend: every stage replica is a Ray actor (`StageActor`) placed by one placement group as
the plan says (`ray_placement`), tensors move through Ray's shared-memory channels (`ray_transport`),
and, when every actor shares the driver's node, so do the driver's commands (`messages`) and the
workers' replies: once started, each actor runs one long call (`StageActor.serve`) that answers the
commands posted on the driver's channel, on a channel of its own to the driver (whose reader end a small
actor on the driver's node stands for: `DriverEnd`); a command's actor call and its reply cost the
driver and the actor 1.5-3 ms of Ray's own work a step. With an actor on another node each command is
an actor call whose return value is the reply (a reader of a channel from another node spins in Ray's
read: the driver would burn a core waiting for replies). The executor core (`executor.Executor`) drives
it exactly as it drives the local backends: the same schedule rows, the same `StageServer` in every worker.
A device holding several stages (interleaved 1F1B, ZB-V) is one actor per stage here, its stages
ordered by their data alone, not by the device's row as the process backend's hosts (`host`) run them.

Faults: an actor whose process or node dies fails its pending call (`serve`, or the command's) with
Ray's `RayActorError`; `health` turns that into one line naming the stage (the executor adds it) and the
host, and `close` kills every actor and removes the placement group, so nothing is left behind (an instance
this process started is stopped, and the semaphores its raylet leaves in /dev/shm removed).

Reading order: `RaySession` -> `StageActor` -> `DriverEnd` -> `RayBackend` (start, command, replies,
health, progress, where, close) -> `RayPipeline`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # Ray reports nothing anywhere from onnxpipe's runs

import ray
from ray.exceptions import GetTimeoutError, RayActorError
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from onnxpipe.errors import OnnxpipeError
from onnxpipe.train.executor import Executor, Failure
from onnxpipe.train.messages import Command, Failed, Ready, Reply
from onnxpipe.train.providers import ExecutionDevice, cuda_device_id, ensure_usable
from onnxpipe.train.ray_placement import Placement, ensure_fits, local_resources
from onnxpipe.train.ray_transport import ChannelTransport, open_channel
from onnxpipe.train.stage import StageServer, StageSpec
from onnxpipe.train.worker import keep_freed_memory, peak_rss_bytes

__all__ = ["RaySession", "StageActor", "RayBackend", "RayPipeline", "link_messages", "local_raylets", "remove_raylet_semaphores"]

#: Seconds the placement group may take to be placed before the run fails.
PLACE_SECONDS = 60.0
#: Seconds between two status polls of the actors (the stall deadline and `where` read them; a poll is
#: one small call per actor, answered on its status thread).
_STATUS_EVERY = 0.25
#: Seconds `close` gives the actors to close their channels before they are killed (and twice that to end).
_STOP_WAIT = 2.0
#: Buffers of a worker's reply channel to the driver (a reply is copied out as soon as it arrives).
_REPLY_BUFFERS = 2


class RaySession:
    """The driver's connection to Ray: the instance this process already joined, the cluster at `address`
    ("auto": the one `ray start` runs on this machine), or with neither a new instance on this machine
    alone (loopback), sized for `placement`, stopped again on `close`."""

    def __init__(self, address: str | None, placement: Placement) -> None:
        self.owned = False
        if ray.is_initialized():
            self.where = "this process is connected to"
            return
        options: dict[str, Any] = {"include_dashboard": False, "logging_level": "ERROR", "log_to_driver": False}
        try:
            if address is None:
                num_cpus, resources = local_resources(placement, os.cpu_count() or 1)
                # "local": a new instance even where RAY_ADDRESS names a cluster (Ray sets it in a driver's environment)
                ray.init(address="local", num_cpus=num_cpus, resources=resources, _node_ip_address="127.0.0.1", **options)
                self.where = "started on this machine"
            else:
                ray.init(address=address, **options)
                self.where = f"at {address}"
        except (ConnectionError, RuntimeError, ValueError) as exc:
            why = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            if address is None:
                raise OnnxpipeError(f"Ray could not start on this machine ({why}); run `ray start --head` and pass --address auto, "
                                    f"or train with --backend local") from exc
            raise OnnxpipeError(f"no Ray cluster at {address} ({why}); start one with "
                                f"`ray start --head` and pass --address auto, or leave --address out to start one here") from exc
        self.owned = True

    def close(self) -> None:
        """Disconnect (stopping the instance when this session started it, and removing what its raylet leaves)."""
        if self.owned and ray.is_initialized():
            raylets = local_raylets()
            ray.shutdown()
            remove_raylet_semaphores(raylets)
        self.owned = False


#: The named semaphores a raylet makes for the buffers of the channels on its node (`/dev/shm/sem.hdr<pid>-<n>` and
#: `sem.obj<pid>-<n>`). Ray leaves those of buffers still open when the raylet stops: 4 pairs for a run of two stages,
#: 50-90 pairs per raylet of this project's test cluster, never removed by anyone.
_RAYLET_SEMAPHORES = ("sem.hdr{pid}-", "sem.obj{pid}-")


def local_raylets() -> tuple[int, ...]:
    """The raylets (Ray's node managers) this process started: its children running Ray's raylet program."""
    me, found = os.getpid(), []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        try:
            if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == me:
                if Path((entry / "cmdline").read_bytes().split(b"\0")[0].decode(errors="replace")).name == "raylet":
                    found.append(int(entry.name))
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return tuple(found)


def remove_raylet_semaphores(raylets: Sequence[int]) -> None:
    """Unlink the named semaphores of the stopped raylets `raylets` (this process's, from `local_raylets`)."""
    for pid in raylets:
        for prefix in _RAYLET_SEMAPHORES:
            for path in Path("/dev/shm").glob(prefix.format(pid=pid) + "*"):
                with contextlib.suppress(OSError):  # gone meanwhile
                    path.unlink()


@ray.remote(max_concurrency=2, concurrency_groups={"status": 1}, max_restarts=0, max_task_retries=0)
class StageActor:
    """One worker: its channels, its `StageServer`, and where it is in its row (answered on a thread of its
    own while the row runs). Once started it serves the driver's commands (`serve`); the second slot of
    its default group serves Ray's own calls meanwhile: a channel to a reader on another node makes (and,
    for a larger message, remakes) its buffer there through the reader actor."""

    def __init__(self, worker: int) -> None:
        keep_freed_memory()  # an actor's process is its worker's, as a local worker process is
        self.worker = worker
        self._status: tuple[str, int, int] = ("setup", -1, 0)
        self._outgoing: dict[int, Any] = {}
        self.transport: ChannelTransport | None = None
        self.server: StageServer | None = None

    def node(self) -> tuple[str, str, int]:
        """(Ray node id, node address, process id)."""
        ctx = ray.get_runtime_context()
        return ctx.get_node_id(), ray.util.get_node_ip_address(), os.getpid()

    def open_channels(self, readers: dict[int, tuple[Any, str, int]]) -> dict[int, Any]:
        """Create the channels this worker writes, one per reader worker (-1: the driver): (actor, node id, buffers)."""
        me = ray.get_runtime_context().current_actor
        self._outgoing = {dst: open_channel(me, actor, node, buffers) for dst, (actor, node, buffers) in readers.items()}
        return self._outgoing

    def start(self, spec: StageSpec, incoming: list[Any], device: ExecutionDevice) -> Reply:
        """Build the stage on its device (a gpu stage on the GPU Ray gave this actor)."""
        try:
            if device.kind == "cuda":
                device = dataclasses.replace(device, device_id=cuda_device_id(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES")))
                ensure_usable(device, where=f"host {ray.util.get_node_ip_address()}")
            self.transport = ChannelTransport(self.worker, self._outgoing, incoming)
            self.server = StageServer(dataclasses.replace(spec, device=device), self.transport, rss=peak_rss_bytes)
            self._status = ("idle", -1, 0)
            return Ready(self.worker)
        except BaseException as exc:
            return self._failed(exc)

    def serve(self) -> None:
        """Answer the commands the driver posts, one at a time, until `stop` closes the transport."""
        assert self.transport is not None
        try:
            while True:
                for command in self.transport.messages(None):
                    self.transport.post(-1, self.handle(command))
        except EOFError:
            return

    def handle(self, command: Command) -> Reply:
        """Run the command's row, then answer it (a failure answers `Failed`)."""
        assert self.server is not None
        done = self._status[2]
        try:
            for action in self.server.row(command):
                self._status = (action.op, action.microbatch, done)
                self.server.program.perform(action)
                done += 1
            self._status = ("idle", -1, done)
            return self.server.reply(command)
        except BaseException as exc:
            return self._failed(exc)

    @ray.method(concurrency_group="status")
    def status(self) -> tuple[str, int, int]:
        """(op, micro-batch, actions done so far)."""
        return self._status

    def stop(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _failed(self, exc: BaseException) -> Failed:
        op, mb, _ = self._status
        message = str(exc).strip()
        return Failed(self.worker, op, mb, f"{type(exc).__name__}: {message.splitlines()[0] if message else ''}",
                      traceback.format_exc(), time.monotonic(), False)


@ray.remote(num_cpus=0, max_restarts=0)
class DriverEnd:
    """Stands for the driver as the reader of the workers' reply channels: Ray makes a channel's buffer on
    its reader's node through an actor there (the driver itself takes no calls). It does nothing else."""


class RayBackend:
    """Workers as Ray actors (see the module docstring); `specs` in worker order, `placement` from `ray_placement.place`."""

    def __init__(self, specs: Sequence[StageSpec], placement: Placement, address: str | None = None) -> None:
        self.session = RaySession(address, placement)
        self._closed = False
        self.actors: list[Any] = []
        self._pending: dict[Any, int] = {}
        #: Each started actor's `serve` call, by reference: it ends only when the actor stops or dies.
        self._serving: dict[Any, int] = {}
        self._dead: dict[int, Failure] = {}
        #: The driver's stand-in reader when commands travel on the channels (None: they are actor calls).
        self.end: Any = None
        self._status: list[tuple[str, int, int]] = [("setup", -1, 0) for _ in specs]
        self._polls: dict[Any, int] = {}
        self._polled = 0.0
        self.group = None
        self.driver: ChannelTransport | None = None
        try:
            ensure_fits(placement, ray.cluster_resources(), self.session.where)
            self.group = placement_group([dict(b.resources) for b in placement.bundles], strategy="PACK")
            try:
                ray.get(self.group.ready(), timeout=PLACE_SECONDS)
            except GetTimeoutError as exc:
                raise OnnxpipeError(f"the Ray cluster {self.session.where} could not place the stages' {len(placement.bundles)} "
                                    f"devices within {PLACE_SECONDS:.0f} s (resources busy or missing: {placement.needs()}); "
                                    f"free them or add nodes") from exc
            self._start(specs, placement)
        except BaseException:
            self.close(force=True)
            raise

    def _start(self, specs: Sequence[StageSpec], placement: Placement) -> None:
        for spec in specs:
            w = spec.worker
            resources = placement.actor_resources(w)
            strategy = PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=placement.worker_bundle[w])
            self.actors.append(StageActor.options(  # type: ignore[attr-defined]
                num_cpus=resources.pop("CPU", 0.0), num_gpus=resources.pop("GPU", 0.0), resources=resources,
                scheduling_strategy=strategy, name=None).remote(w))
        #: Per worker: (Ray node id, node address, actor process id).
        self.nodes: list[tuple[str, str, int]] = ray.get([a.node.remote() for a in self.actors])
        here = ray.get_runtime_context().get_node_id()
        to_driver = {}
        if all(node == here for node, _, _ in self.nodes):
            self.end = DriverEnd.options(scheduling_strategy=NodeAffinitySchedulingStrategy(here, soft=False)).remote()  # type: ignore[attr-defined]
            to_driver = {-1: (self.end, here, _REPLY_BUFFERS)}
        k = len(self.actors)
        held = link_messages(specs)
        outgoing = ray.get([a.open_channels.remote({d: (self.actors[d], self.nodes[d][0], held[w, d]) for d in range(k) if d != w} | to_driver)
                            for w, a in enumerate(self.actors)])
        from_driver = {w: open_channel(None, a, self.nodes[w][0], held[-1, w]) for w, a in enumerate(self.actors)}
        self.driver = ChannelTransport(-1, from_driver, [outgoing[w][-1] for w in range(k) if -1 in outgoing[w]], background=True)
        for w, actor in enumerate(self.actors):
            incoming = [outgoing[s][w] for s in range(k) if s != w] + [from_driver[w]]
            self._pending[actor.start.remote(specs[w], incoming, placement.devices[w])] = w

    @property
    def pids(self) -> list[int]:
        return [n[2] for n in self.nodes]

    def command(self, worker: int, command: Command) -> None:
        if self.end is not None:
            assert self.driver is not None
            self.driver.post(worker, command)
        else:
            self._pending[self.actors[worker].handle.remote(command)] = worker

    def replies(self, timeout: float) -> list[Reply]:
        """The answers of pending calls (`start`, and commands sent as calls; an actor that is ready starts
        serving when commands travel on the channels); once every actor serves, what they post to the driver."""
        refs = list(self._pending)
        if not refs and self._serving:
            assert self.driver is not None
            return self.driver.messages(timeout)
        if not refs:
            time.sleep(timeout)
            return []
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if not ready:
            return []
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        out = []
        for ref in ready:
            w = self._pending.pop(ref)
            try:
                reply = ray.get(ref)
                if isinstance(reply, Ready):
                    self._status[w] = ("idle", -1, 0)
                    if self.end is not None:
                        self._serving[self.actors[w].serve.remote()] = w
                out.append(reply)
            except RayActorError as exc:
                self._dead.setdefault(w, Failure(w, None, self._died(w, exc), time.monotonic()))
        return out

    def _died(self, worker: int, exc: BaseException) -> str:
        _, address, pid = self.nodes[worker]
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return f"its Ray actor (process {pid} on host {address}) died: {reason[:200]}"

    def health(self) -> list[Failure]:
        """Workers whose process died (their `serve` call failed) or that stopped serving."""
        if self._serving:
            ended, _ = ray.wait(list(self._serving), num_returns=len(self._serving), timeout=0)
            for ref in ended:
                w = self._serving.pop(ref)
                try:
                    ray.get(ref)
                    why = "its Ray actor stopped serving the driver's commands"
                except RayActorError as exc:
                    why = self._died(w, exc)
                except Exception as exc:  # serve itself failed: its channels broke
                    why = f"its Ray actor (on host {self.nodes[w][1]}) failed: {str(exc).strip().splitlines()[-1][:200]}"
                self._dead.setdefault(w, Failure(w, None, why, time.monotonic()))
        return list(self._dead.values())

    def progress(self) -> int:
        """Actions done, from the last status poll (polls go out at most once a second and never block)."""
        done, _ = ray.wait(list(self._polls), num_returns=len(self._polls), timeout=0) if self._polls else ([], [])
        for ref in done:
            w = self._polls.pop(ref)
            try:
                self._status[w] = ray.get(ref)
            except RayActorError:
                pass
        if not self._polls and time.monotonic() - self._polled >= _STATUS_EVERY:
            self._polled = time.monotonic()
            self._polls = {a.status.remote(): w for w, a in enumerate(self.actors) if w not in self._dead}
        return sum(s[2] for s in self._status)

    def where(self, worker: int) -> tuple[str, int]:
        op, mb, _ = self._status[worker]
        return op, mb

    def close(self, force: bool) -> None:
        if self._closed:
            return
        self._closed = True
        if not force and self.actors:
            try:
                ray.get([a.stop.remote() for a in self.actors], timeout=_STOP_WAIT)
            except Exception:  # a dead or stuck actor: killed below
                pass
        if self.driver is not None:
            self.driver.close()
        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        if self.end is not None:
            ray.kill(self.end, no_restart=True)
        if self.actors:  # a call to a killed actor fails once Ray saw its process end: wait for that
            ray.wait([a.status.remote() for a in self.actors], num_returns=len(self.actors), timeout=_STOP_WAIT * 2)
            _end_local_leftovers(getattr(self, "nodes", []))
        if self.group is not None:
            remove_placement_group(self.group)
        self.session.close()


def link_messages(specs: Sequence[StageSpec]) -> Counter[tuple[int, int]]:
    """Per (sender, receiver) worker pair (sender -1: the driver: the command and its model inputs), the
    most messages one command sends on it (training or forward-only row): what its receiver may hold at once."""
    most: Counter[tuple[int, int]] = Counter()
    for spec in specs:
        most[-1, spec.worker] = 1 + len(spec.inputs(spec.microbatches))
        for row in (spec.actions, spec.forward_actions):
            sent = Counter(dst for action in row for dst, _, _ in spec.sends(action))
            for dst, n in sent.items():
                most[spec.worker, dst] = max(most[spec.worker, dst], n)
    return most


def _end_local_leftovers(nodes: Sequence[tuple[str, str, int]]) -> None:
    """SIGKILL actor processes on this host that outlived `ray.kill`: on a two-node cluster an actor
    blocked reading a channel from a killed peer was seen to stay alive after it."""
    here = ray.util.get_node_ip_address()
    for _, address, pid in nodes:
        if address == here:
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().startswith(b"ray::StageActor"):
                        os.kill(pid, 9)
            except OSError:  # gone already
                pass


class RayPipeline(Executor):
    """The executor on Ray actors."""

    def __init__(self, specs: Sequence[StageSpec], placement: Placement, address: str | None = None, **deadlines: float) -> None:
        super().__init__(specs, lambda s: RayBackend(s, placement, address), **deadlines)

    @property
    def pids(self) -> list[int]:
        return self.backend.pids  # type: ignore[attr-defined, no-any-return]

    @property
    def nodes(self) -> list[tuple[str, str, int]]:
        """Per worker: (Ray node id, node address, actor process id)."""
        return self.backend.nodes  # type: ignore[attr-defined, no-any-return]


