"""Measure what one hop of a tensor between two Ray actors costs on this machine, by transport, to
choose the Ray backend's transport (docs/benchmarks.md, "Ray transports").

Transports, each a ping-pong between two actors on one local Ray instance (a hop = half a round trip):
- `ref`: the sender `ray.put`s the array and passes its reference inside a list (so Ray does not
  resolve it) to the receiver's method; the receiver `ray.get`s it.
- `arg`: the array itself as an actor method argument (Ray puts arguments over 100 KB in the object
  store and resolves them before the method runs).
- `channel`: one shared-memory channel per direction (`ray.experimental.channel.Channel`, what
  compiled graphs are built on), written by one actor, read by the other.
- `cgraph`: a compiled graph (`experimental_compile`) whose nodes alternate between the two actors;
  the per-hop figure is the slope between a chain of 2 hops and one of 2 + `HOPS` hops (the driver's
  own cost of one execution cancels out).

Rounds are interleaved (every transport once per round, in rotating order); the figures are medians over
rounds. The load average before and after is printed and written with the table.

`--costs` measures instead what the Ray backend costs where the simulator prices the local one, and prints
the target's [backends.ray] table (`target.BackendCosts`, `simulate --backend ray`):
- per message, through the backend's own transport (`ray_transport.ChannelTransport`, two actors ping-pong):
  the sender's thread CPU per send, and the receiver's process CPU per message beyond its sends (its reader
  thread's wake-up, channel read and copy, and Ray's own threads), fitted as fixed + bytes / rate;
- per action and per step, and the hop's latency, inside the executor (`measure_cpu.pipeline_overheads`
  on `--backend ray`: a perceptron of 1-2 us kernels); the latency is the hop less the message CPU above.

Run: .venv/bin/python tools/measure_ray.py [--rounds N] [--no-doc] [--costs]
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from pathlib import Path

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")  # nothing leaves this machine

import numpy as np
import ray
from ray.dag import InputNode
from ray.experimental.channel import Channel

sys.path.insert(0, str(Path(__file__).resolve().parent))
from benchdoc import write_section  # noqa: E402
from measure_cpu import fit_per_byte, pipeline_overheads  # noqa: E402

from onnxpipe.train.ray_transport import ChannelTransport, open_channel  # noqa: E402

SIZES = (256 * 1024, 4 * 2**20)
#: Round trips per ping-pong measurement, hops added to the compiled chain.
TRIPS = 40
HOPS = 40
TRANSPORTS = ("ref", "arg", "channel", "cgraph")


@ray.remote(max_concurrency=2)
class Peer:
    """One end of a ping-pong: `deliver*` run on a second thread while `bounce` waits for them."""

    def __init__(self, nbytes: int) -> None:
        self.array = np.ones(nbytes // 4, np.float32)
        self._got = threading.Semaphore(0)
        self.peer = None
        self.out: Channel | None = None
        self.inp: Channel | None = None

    def set_peer(self, peer) -> None:
        self.peer = peer

    def deliver(self, array: np.ndarray) -> None:
        self.last = array
        self._got.release()

    def deliver_ref(self, refs: list) -> None:
        self.last = ray.get(refs[0])
        self._got.release()

    def bounce(self, trips: int, start: bool, how: str) -> float:
        """`trips` round trips (the starter sends first); seconds per hop, timed by the starter."""
        send = {"arg": lambda: self.peer.deliver.remote(self.array),
                "ref": lambda: self.peer.deliver_ref.remote([ray.put(self.array)])}[how]
        t0 = time.perf_counter()
        for _ in range(trips):
            if start:
                send()
                self._got.acquire()
            else:
                self._got.acquire()
                send()
        return (time.perf_counter() - t0) / (2 * trips)

    # Shared-memory channels: each actor writes its own and reads its peer's.
    def make_channel(self, reader, node: str) -> Channel:
        self.out = Channel(ray.get_runtime_context().current_actor, [(reader, node)], 2 * self.array.nbytes + 4096)
        return self.out

    def set_input(self, channel: Channel) -> None:
        self.inp = channel

    def channel_bounce(self, trips: int, start: bool) -> float:
        assert self.out is not None and self.inp is not None
        t0 = time.perf_counter()
        for _ in range(trips):
            if start:
                self.out.write(self.array)
                x = self.inp.read()
            else:
                x = self.inp.read()
                self.out.write(self.array)
            del x
        return (time.perf_counter() - t0) / (2 * trips)

    # Compiled graph nodes.
    def produce(self, _: int) -> np.ndarray:
        return self.array

    def echo(self, x: np.ndarray) -> np.ndarray:
        return x

    def sink(self, x: np.ndarray) -> int:
        return int(x.size)


def _pingpong(a, b, how: str) -> float:
    if how == "channel":
        refs = [a.channel_bounce.remote(TRIPS, True), b.channel_bounce.remote(TRIPS, False)]
    else:
        refs = [a.bounce.remote(TRIPS, True, how), b.bounce.remote(TRIPS, False, how)]
    return ray.get(refs, timeout=120)[0]


def _chain(a, b, hops: int):
    with InputNode() as inp:
        x = a.produce.bind(inp)
        for h in range(hops):
            x = (b if h % 2 == 0 else a).echo.bind(x)
        out = a.sink.bind(x)
    return out.experimental_compile()


def _time_dag(dag, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        ray.get(dag.execute(0))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(rounds: int) -> dict[tuple[str, int], list[float]]:
    node = ray.get_runtime_context().get_node_id()
    found: dict[tuple[str, int], list[float]] = {}
    for size in SIZES:
        a, b = Peer.remote(size), Peer.remote(size)
        ray.get([a.set_peer.remote(b), b.set_peer.remote(a)])
        ab = ray.get(a.make_channel.remote(b, node))
        ba = ray.get(b.make_channel.remote(a, node))
        ray.get([a.set_input.remote(ba), b.set_input.remote(ab)])
        # A compiled graph keeps a loop running on its actors: each chain gets a pair of its own.
        short, long = _chain(Peer.remote(size), Peer.remote(size), 2), _chain(Peer.remote(size), Peer.remote(size), 2 + HOPS)
        for how in TRANSPORTS:  # warm up: first puts, channel registration, dag start
            if how != "cgraph":
                _pingpong(a, b, how)
        _time_dag(short), _time_dag(long)
        for r in range(rounds):
            order = TRANSPORTS[r % len(TRANSPORTS):] + TRANSPORTS[: r % len(TRANSPORTS)]
            for how in order:
                if how == "cgraph":
                    hop = (_time_dag(long) - _time_dag(short)) / HOPS
                else:
                    hop = _pingpong(a, b, how)
                found.setdefault((how, size), []).append(hop)
    return found


# --- the Ray backend's costs (`--costs`) ------------------------------------------------------------

#: Message sizes of the per-message fit (the activations of the bench's models are 64 KiB - 4 MiB).
COST_SIZES = (4 * 1024, 256 * 1024, 2**20, 4 * 2**20)


@ray.remote(max_concurrency=2)
class TransportPeer:
    """One end of a ping-pong through `ChannelTransport`, as a stage actor uses it."""

    def node(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def open(self, reader, node: str):
        self.out = open_channel(ray.get_runtime_context().current_actor, reader, node, buffers=4)
        return self.out

    def start(self, incoming) -> None:
        self.transport = ChannelTransport(0, {1: self.out}, [incoming])

    def pingpong(self, nbytes: int, trips: int, first: bool, tag: int) -> tuple[float, float]:
        """(thread CPU per send, process CPU per message received beyond the sends) over `trips` round trips."""
        array = np.ones(nbytes // 4, np.float32)
        sends = 0.0
        cpu0 = time.process_time()
        for i in range(trips):
            if not first:
                self.transport.recv(f"m{tag}", i)
            t = time.thread_time()
            self.transport.send(1, f"m{tag}", i, array)
            sends += time.thread_time() - t
            if first:
                self.transport.recv(f"m{tag}", i)
        total = time.process_time() - cpu0
        return sends / trips, (total - sends) / trips

    def stop(self) -> None:
        self.transport.close()


def message_costs(rounds: int, trips: int = 30) -> dict[int, tuple[float, float]]:
    """Median over rounds of (send CPU, receive CPU) per message, by size."""
    a, b = TransportPeer.remote(), TransportPeer.remote()
    node = ray.get(a.node.remote())
    ab, ba = ray.get([a.open.remote(b, node), b.open.remote(a, node)])
    ray.get([a.start.remote(ba), b.start.remote(ab)])
    found: dict[int, list[tuple[float, float]]] = {n: [] for n in COST_SIZES}
    tag = 0
    for r in range(rounds + 1):
        for n in COST_SIZES:
            tag += 1
            got = ray.get([a.pingpong.remote(n, trips, True, tag), b.pingpong.remote(n, trips, False, tag)], timeout=120)
            if r:  # round 0 warms up (channel growth to the size)
                found[n] += got
    ray.get([a.stop.remote(), b.stop.remote()])
    return {n: (statistics.median(s for s, _ in v), statistics.median(c for _, c in v)) for n, v in found.items()}


def report_costs(rounds: int) -> None:
    load0 = os.getloadavg()[0]
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        points = message_costs(rounds)
    finally:
        ray.shutdown()
    for n, (send, recv) in points.items():
        print(f"ChannelTransport {n / 1024:.0f} KiB: send CPU {send * 1e6:.1f} us, receive CPU {recv * 1e6:.1f} us")
    send_fixed, send_rate = fit_per_byte({n: v[0] for n, v in points.items()})
    recv_fixed, recv_rate = fit_per_byte({n: v[1] for n, v in points.items()})
    action, step, hop = pipeline_overheads(2, backend="ray")
    small = min(points)
    latency = max(0.0, hop - points[small][0] - points[small][1])
    print(f"executor on Ray, 2 workers, width-8 perceptron: F/B action {action * 1e6:.1f} us, step outside the actions {step * 1e6:.1f} us, "
          f"hop to a waiting receiver {hop * 1e6:.1f} us")
    print(f"load average {load0:.2f} before, {os.getloadavg()[0]:.2f} after")
    print("[backends.ray]")
    print(f'action_overhead = "{action * 1e6:.0f} us"\nstep_overhead = "{step * 1e6:.0f} us"\nlatency = "{latency * 1e6:.0f} us"')
    print(f'send_overhead = "{max(send_fixed, 0.0) * 1e6:.0f} us"\nsend_bandwidth = "{send_rate / 1e9:.1f} GB/s"\n'
          f'recv_overhead = "{max(recv_fixed, 0.0) * 1e6:.0f} us"\nrecv_bandwidth = "{recv_rate / 1e9:.2f} GB/s"')


def main(argv: list[str]) -> None:
    rounds = int(argv[argv.index("--rounds") + 1]) if "--rounds" in argv else 7
    if "--costs" in argv:
        report_costs(rounds)
        return
    load0 = os.getloadavg()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR", log_to_driver=False, _node_ip_address="127.0.0.1")
    try:
        found = measure(rounds)
    finally:
        ray.shutdown()  # also ends the compiled graphs (their own teardown hung at 4 MiB here)
    load1 = os.getloadavg()
    names = {"ref": "object-store reference (`ray.put` + `ray.get`)", "arg": "actor method argument (by value)",
             "channel": "shared-memory channel (`ray.experimental.channel`)", "cgraph": "compiled graph (`experimental_compile`)"}
    lines = [
        "## Ray transports: one hop between two actors (measured)",
        "",
        f"`tools/measure_ray.py`, Ray {ray.__version__}, one local instance on this 2-core machine; median over {rounds} interleaved "
        f"rounds of {TRIPS} round trips (compiled graph: slope over {HOPS} extra hops); load average {load0[0]:.2f} before, "
        f"{load1[0]:.2f} after{' (loaded: other work was running)' if max(load0[0], load1[0]) > 1.0 else ''}.",
        "",
        "| transport | " + " | ".join(f"{s // 1024} KiB hop (ms)" for s in SIZES) + " |",
        "|---|" + "---:|" * len(SIZES),
    ]
    for how in TRANSPORTS:
        cells = [f"{statistics.median(found[(how, s)]) * 1e3:.3f}" for s in SIZES]
        lines.append(f"| {names[how]} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print(text)
    if "--no-doc" not in argv:
        write_section("ray_transports", text)


if __name__ == "__main__":
    main(sys.argv[1:])
