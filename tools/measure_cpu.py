"""Measure this machine for the cpu targets (targets/cpu2.toml, cpu4.toml): one-thread GEMM rate,
one-thread memory read bandwidth, shared-memory hand-off time between two processes (raw, and
through the executor's own `ShmTransport`), onnxruntime's per-node dispatch cost, the cores' worth of
throughput worker processes side by side really get (`cores`: the 2 vCPUs need not be 2 cores), and the fixed cost
of one forward and one backward action of the executor's `StageRunner` alone and inside two worker
processes (`action_overhead`), the driver's share of a step (`step_overhead`), what a backward action costs beyond its profile per byte of
gradients it returns and sums (`gradient_bandwidth`), and how much slower a node
runs while another worker computes beside it (`corun_bandwidth`: when two working sets overflow the shared
cache, nodes lose time in proportion to the weight bytes they read), the time slice the scheduler gives a
busy process while more are runnable than cores (`time_slice`), the CPU a worker loses each time it gets a core
back after other workers ran (`switch_cost`: its caches and TLB refill), and the CPU a worker spends per message it
sends and receives through `ShmTransport` by message bytes (the shm link's `send_overhead`, `send_bandwidth`,
`recv_overhead`), the rate at which a worker refills its working set after a switch when the workers' working sets
overflow the shared cache together (`switch_bandwidth`; one switched in mid-action reads back only what the rest of
the action touches: runs of several slices), and where the OS runs a worker woken by a message while
every vCPU is busy (`wake_affine`).

Run: .venv/bin/python tools/measure_cpu.py [all|gradients|corun|slice|switch|messages|wake]   (a part alone: `gradient_bandwidth`;
the co-run slowdowns and `cores`; `time_slice`; `switch_cost` and `switch_bandwidth`; the CPU per message; `wake_affine`)
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # one worker process = one thread; set before numpy loads BLAS

import math
import statistics
import sys
import time
from collections.abc import Callable
from multiprocessing import Pipe, Process, shared_memory
from multiprocessing.connection import Connection
from pathlib import Path

import numpy as np
from onnx import TensorProto, helper

from onnxpipe.ortutil import cpu_session
from onnxpipe.train.prepare import TrainConfig, prepare_single
from onnxpipe.train.stage import StageRunner
from onnxpipe.train.transport import ShmTransport, make_inboxes, sweep_segments
from onnxpipe.train.worker import keep_freed_memory

SHM_SIZES = (4096, 256 * 1024, 2**20, 4 * 2**20, 16 * 2**20)


def _median_seconds(fn: Callable[[], object], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def gemm_flops(n: int = 1024) -> float:
    a = np.random.rand(n, n).astype(np.float32)
    b = np.random.rand(n, n).astype(np.float32)
    return 2 * n**3 / _median_seconds(lambda: a @ b, 9)


def read_bandwidth() -> float:
    x = np.ones(2**24, np.float32)
    return x.nbytes / _median_seconds(x.sum, 9)


def _shm_echo(conn: Connection, name: str, capacity: int) -> None:
    shm = shared_memory.SharedMemory(name=name)
    buf = np.ndarray((capacity,), np.uint8, shm.buf)
    while (n := conn.recv()) >= 0:
        buf[:n].copy()
        conn.send(1)
    del buf
    shm.close()


def shm_handoff_seconds() -> dict[int, float]:
    """Writer copies in, signals over a pipe, reader copies out and acknowledges."""
    capacity = max(SHM_SIZES)
    shm = shared_memory.SharedMemory(create=True, size=capacity)
    buf = np.ndarray((capacity,), np.uint8, shm.buf)
    ours, theirs = Pipe()
    reader = Process(target=_shm_echo, args=(theirs, shm.name, capacity))
    reader.start()
    out = {}
    for n in SHM_SIZES:
        src = np.ones(n, np.uint8)

        def handoff(buf: np.ndarray = buf, n: int = n, src: np.ndarray = src) -> None:
            buf[:n] = src
            ours.send(n)
            ours.recv()

        out[n] = _median_seconds(handoff, 300)
    ours.send(-1)
    reader.join()
    del buf
    shm.close()
    shm.unlink()
    return out


def ort_node_seconds(k: int = 200) -> float:
    """Extra seconds per tiny node in a one-thread onnxruntime session."""

    def session(nodes: int) -> object:
        chain = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(nodes)]
        graph = helper.make_graph(
            chain, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])], [helper.make_tensor_value_info(f"t{nodes - 1}", TensorProto.FLOAT, [8])]
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        return cpu_session(model.SerializeToString(), threads=1, optimize=False)

    x = {"x": np.ones(8, np.float32)}
    one, many = session(1), session(k + 1)
    return (_median_seconds(lambda: many.run(None, x), 200) - _median_seconds(lambda: one.run(None, x), 200)) / k


def action_seconds(repeat: int = 400) -> tuple[float, float]:
    """Median wall seconds of a forward and of a backward action of a one-node stage (a 4x4 MatMul and
    its loss): its kernels take about a microsecond, so this is the fixed cost every action pays."""
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm"), helper.make_node("ReduceSum", ["y"], ["loss"], name="sum", keepdims=0)]
    weight = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.ones(16, np.float32))
    graph = helper.make_graph(nodes, "one", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    runner = StageRunner(prepare_single(model, TrainConfig(microbatches=1), "loss"))
    feeds = {"x": np.ones((1, 4), np.float32)}
    forward, backward = [], []
    for _ in range(repeat):
        start = time.perf_counter()
        runner.forward(0, feeds)
        middle = time.perf_counter()
        runner.backward(0, {})
        forward.append(middle - start)
        backward.append(time.perf_counter() - middle)
    return statistics.median(forward), statistics.median(backward)


def gradient_seconds(width: int = 1024, layers: int = 4, rows: int = 32, steps: int = 12) -> tuple[float, float, float]:
    """(parameter bytes, median backward action of a `StageRunner` training a `layers` x `width`
    perceptron on micro-batches of `rows`, the profile's backward of the same model): a backward
    action returns every weight's gradient to the executor and adds it to the step's sum, which the
    profile (kernels and the session's time between them) does not see (`gradient_bandwidth`)."""
    from onnxpipe import models
    from onnxpipe.cost import annotate
    from onnxpipe.graph import load

    model = models.build("mlp", train=True, layers=layers, width=width, in_features=512, batch=rows)
    profiled = sum(c.measured_backward_seconds or 0.0 for c in annotate(load(model), profile=True, runs=9).nodes.values())
    runner = StageRunner(prepare_single(model, TrainConfig(microbatches=4), "loss"))
    feeds = {"x": np.random.rand(rows, 512).astype(np.float32), "labels": np.zeros(rows, np.int64)}
    backward = []
    for step in range(steps):
        for mb in range(4):
            runner.forward(mb, dict(feeds))
            start = time.perf_counter()
            runner.backward(mb, {})
            if step >= 2:
                backward.append(time.perf_counter() - start)
        runner.grads = {}
    return float(sum(v.nbytes for v in runner.params.values())), statistics.median(backward), profiled


def _transport_echo(prefix: str, inboxes: list, sizes: tuple[int, ...], repeat: int) -> None:
    transport = ShmTransport(prefix, inboxes, 1)
    for n in sizes:
        for i in range(repeat):
            transport.send(0, f"back{n}", 0, transport.recv(f"there{n}", 0))
    transport.recv("stop", 0)
    transport.close()


def transport_handoff_seconds(repeat: int = 200) -> dict[int, float]:
    """One hand-off through the executor's ShmTransport (copy in, queue message, copy out): half a round trip."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    prefix = f"onnxpipe_measure_{os.getpid()}_"
    inboxes = make_inboxes(ctx, 2)
    echo = ctx.Process(target=_transport_echo, args=(prefix, inboxes, SHM_SIZES, repeat))
    echo.start()
    transport = ShmTransport(prefix, inboxes, 0)
    out = {}
    try:
        for n in SHM_SIZES:
            data = np.ones(n, np.uint8)
            times = []
            for _ in range(repeat):
                start = time.perf_counter()
                transport.send(1, f"there{n}", 0, data)
                transport.recv(f"back{n}", 0)
                times.append((time.perf_counter() - start) / 2)
            out[n] = statistics.median(times[repeat // 10:])
        transport.send(1, "stop", 0, np.zeros(1, np.uint8))
        echo.join()
    finally:
        transport.close()
        sweep_segments(prefix)
    return out


MESSAGE_SIZES = (64 * 1024, 256 * 1024, 2**20, 4 * 2**20, 8 * 2**20)


def _scrub(buffer: np.ndarray, data: np.ndarray) -> None:
    """What a worker does between hand-offs, untimed: an F or B reading its weights evicts the caches
    (buffer: twice the shared cache), then writes the output it sends next."""
    buffer.sum()
    data.fill(1)


def _message_peer(prefix: str, inboxes: list, me: int, sizes: tuple[int, ...], repeat: int, conn: Connection) -> None:
    """Ping-pong of `repeat` messages per size through ShmTransport, each side timing its own thread CPU in send
    and in recv (the recv waits for a peer still scrubbing, as a worker's RECV usually does); sends back the times."""
    transport = ShmTransport(prefix, inboxes, me)
    buffer = np.ones(2**24, np.float32)
    out: dict[int, tuple[list[float], list[float]]] = {}
    try:
        for n in sizes:
            data = np.ones(n, np.uint8)
            sends: list[float] = []
            recvs: list[float] = []
            for i in range(repeat):
                for turn in (0, 1):
                    mb = i % 8  # one slot per micro-batch, reused every step as in the executor
                    if turn == me:
                        _scrub(buffer, data)
                        cpu = time.thread_time()
                        transport.send(1 - me, f"m{n}", mb, data)
                        sends.append(time.thread_time() - cpu)
                    else:
                        cpu = time.thread_time()
                        transport.recv(f"m{n}", mb)
                        recvs.append(time.thread_time() - cpu)
            out[n] = (sends, recvs)
        conn.send(out)
    finally:
        transport.close()


def _read_loop(conn: Connection) -> None:
    """A worker computing on the other core: read through memory until told to stop."""
    buffer = np.ones(2**24, np.float32)
    while not conn.poll():
        buffer.sum()


def message_cpu_seconds(beside: int, repeat: int = 200) -> dict[int, tuple[float, float]]:
    """Median thread CPU per SEND and per RECV (the worker's side of a hop) by message bytes, through the
    executor's ShmTransport between two processes that evict the caches between messages as F/B do,
    with `beside` other processes reading through memory meanwhile (workers computing on the other core)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    prefix = f"onnxpipe_measure_{os.getpid()}_"
    inboxes = make_inboxes(ctx, 2)
    pipes = [ctx.Pipe() for _ in range(2)]
    peers = [ctx.Process(target=_message_peer, args=(prefix, inboxes, me, MESSAGE_SIZES, repeat, pipes[me][1])) for me in range(2)]
    stops = [ctx.Pipe() for _ in range(beside)]
    readers = [ctx.Process(target=_read_loop, args=(stop[0],)) for stop in stops]
    try:
        for p in readers + peers:
            p.start()
        results = [pipes[me][0].recv() for me in range(2)]
        for p in peers:
            p.join()
    finally:
        for stop in stops:
            stop[1].send(None)
        for p in readers:
            p.join()
        sweep_segments(prefix)
    skip = repeat // 10
    return {
        n: (statistics.median(x for r in results for x in r[n][0][skip:]), statistics.median(x for r in results for x in r[n][1][skip:]))
        for n in MESSAGE_SIZES
    }


def fit_per_byte(points: dict[int, float]) -> tuple[float, float]:
    """Least-squares fixed seconds + bytes / rate through (bytes, seconds); rate inf when the cost does not grow."""
    xs, ys = np.array(list(points), float), np.array(list(points.values()))
    slope, fixed = np.polyfit(xs, ys, 1)
    return float(fixed), float(1 / slope) if slope > 0 else math.inf


def report_messages() -> None:
    for beside in (0, 1):
        points = message_cpu_seconds(beside)
        print(f"ShmTransport messages, caches evicted between, {beside} process reading memory beside:")
        for n, (send, recv) in points.items():
            print(f"  {n / 1024:.0f} KiB: thread CPU per send {send * 1e6:.1f} us, per recv {recv * 1e6:.1f} us")
        for side, k in (("send", 0), ("recv", 1)):
            fixed, rate = fit_per_byte({n: v[k] for n, v in points.items()})
            print(f"  {side} CPU = {fixed * 1e6:.1f} us + bytes / {rate / 1e9:.1f} GB/s (shm link {side}_overhead, {side}_bandwidth)")


def pipeline_overheads(stages: int, steps: int = 40, backend: str = "local") -> tuple[float, float, float]:
    """(action, step, hop) costs inside the executor on `backend`: `stages` workers train a perceptron of
    `stages` width-8 layers (kernels of a microsecond or two) on 2 x stages micro-batches, GPipe.
    Action: median F/B duration. Step: median of the step's wall time (driver) minus the span of its
    actions (workers). Hop: median time from a SEND's start to the end of the RECV that was waiting
    for it (the receiver blocked: copy in, queue message, wake-up, copy out)."""
    from onnxpipe import models
    from onnxpipe.train.fit import data_source
    from onnxpipe.train.optimizer import OptimizerConfig
    from onnxpipe.train.pipeline import Pipeline

    model = models.build("mlp", train=True, layers=stages, width=8, in_features=8, classes=4)
    actions, outside, hops = [], [], []
    with Pipeline(model, f"cpu{stages}", stages=stages, microbatches=2 * stages, schedule="gpipe", optimizer=OptimizerConfig("sgd", lr=0.01),
                  backend=backend) as pipe:
        source = data_source(pipe, "synthetic")
        for step in range(steps):
            start = time.perf_counter()
            pipe.train_step(source.batch(step))
            wall = time.perf_counter() - start
            if step < 2:
                continue
            events = pipe.last_events
            actions += [e.end - e.start for e in events if e.kind in ("F", "B")]
            outside.append(wall - (max(e.end for e in events) - min(e.start for e in events)))
            sends = [e for e in events if e.kind == "SEND"]
            hops += [r.end - s.start for r in events if r.kind == "RECV" for s in sends
                     if s.microbatch == r.microbatch and abs(s.stage - r.stage) == 1 and r.start < s.start < r.end]
    return statistics.median(actions), statistics.median(outside), statistics.median(hops)


#: Chains timed alone and beside a copy of themselves (`corun_slowdowns`): (op, rows, width, nodes). MatMul
#: chains multiply [rows, width] by `nodes` distinct [width, width] weights; Add chains add `nodes` distinct
#: [rows, width] constants. Working sets from 1 to 18 MiB: two of them inside or beyond the shared 32 MiB L3,
#: at weight traffic rates (weight bytes / seconds) from a few to tens of GB/s.
CORUN_CHAINS = (
    ("MatMul", 32, 256, 8), ("Add", 32, 1024, 4), ("MatMul", 32, 512, 8), ("MatMul", 32, 1024, 3),
    ("MatMul", 32, 1024, 4), ("MatMul", 64, 1024, 4), ("MatMul", 128, 1024, 4), ("Add", 512, 1024, 4),
)
#: Last-level cache the two vCPUs share: lscpu, L3 32 MiB (one instance).
SHARED_CACHE = 32 * 2**20
#: The chain `effective_cores` runs: 8 chained 256x256 MatMul+Relu on 64 rows (the executor's kind of work).
CORES_CHAIN = ("MatMul+Relu", 64, 256, 8)


def _chain_model(op: str, rows: int, width: int, nodes: int) -> bytes:
    """A one-input chain of `nodes` nodes, each with its own constant operand (see CORUN_CHAINS)."""
    graph_nodes, weights, x = [], [], "x"
    shape = [width, width] if op.startswith("MatMul") else [rows, width]
    for i in range(nodes):
        weights.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, shape, np.random.rand(*shape).astype(np.float32).ravel() / width))
        graph_nodes.append(helper.make_node(op.split("+")[0], [x, f"w{i}"], [f"m{i}"]))
        x = f"m{i}"
        if op.endswith("+Relu"):
            graph_nodes.append(helper.make_node("Relu", [x], [f"r{i}"]))
            x = f"r{i}"
    graph = helper.make_graph(graph_nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [rows, width])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [rows, width])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    return model.SerializeToString()


def weight_bytes(op: str, rows: int, width: int, nodes: int) -> float:
    """Bytes of one node's constant operand (its weight: `NodeCost.param_bytes`)."""
    return 4.0 * (width * width if op.startswith("MatMul") else rows * width)


def working_set(op: str, rows: int, width: int, nodes: int) -> float:
    """Bytes one run of the chain keeps touching: its weights, its input and its nodes' outputs (a stage's
    analogue: its parameters, gradients and optimizer state plus one micro-batch's stash)."""
    outputs = 2 if op.endswith("+Relu") else 1
    return nodes * (weight_bytes(op, rows, width, nodes) + 4.0 * rows * width * outputs) + 4.0 * rows * width


def _ort_chain(conn: Connection, chain: tuple[str, int, int, int]) -> None:
    """Serve timings of a one-thread session of `chain`: each message is the seconds to run it for
    (0 stops); the answer is the mean seconds per run."""
    session = cpu_session(_chain_model(*chain), threads=1)
    feed = {"x": np.random.rand(chain[1], chain[2]).astype(np.float32)}
    one = _median_seconds(lambda: session.run(None, feed), 5)
    conn.send("ready")
    while seconds := conn.recv():
        runs = max(3, int(seconds / one))
        start = time.perf_counter()
        for _ in range(runs):
            session.run(None, feed)
        conn.send((time.perf_counter() - start) / runs)


def _start_workers(chain: tuple[str, int, int, int], processes: int) -> list[tuple[Connection, Process]]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    workers = []
    for _ in range(processes):
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_ort_chain, args=(theirs, chain))
        proc.start()
        workers.append((ours, proc))
    for ours, _ in workers:
        ours.recv()
    return workers


def _stop_workers(workers: list[tuple[Connection, Process]]) -> None:
    for ours, _ in workers:
        ours.send(0)
    for _, proc in workers:
        proc.join()


def _alone_and_together(workers: list[tuple[Connection, Process]], seconds: float = 0.25) -> tuple[float, float]:
    """(seconds per run of the first worker alone, ratio of the mean seconds per run with all of them
    running at once to that): alone and together back to back in the same processes, so the host's
    drifting share of the vCPUs hits both sides of the ratio alike."""
    first = workers[0][0]
    first.send(seconds)
    alone = first.recv()
    for ours, _ in workers:
        ours.send(seconds)
    return alone, statistics.mean(ours.recv() for ours, _ in workers) / alone


def effective_cores(processes: int = 2, repeat: int = 9) -> float:
    """Cores' worth of throughput that `processes` one-thread onnxruntime workers get together:
    processes x (time alone) / (time side by side), median of `repeat` trials. The chain's working set is
    2 MiB: side by side it stays in the shared cache, so it carries no co-run slowdown (`corun_bandwidth`)
    and the two figures do not count the same contention twice."""
    workers = _start_workers(CORES_CHAIN, processes)
    ratios = [_alone_and_together(workers)[1] for _ in range(repeat)]
    _stop_workers(workers)
    return statistics.median(processes / r for r in ratios)


def corun_slowdowns(repeat: int = 9) -> list[tuple[tuple[str, int, int, int], float, float]]:
    """(chain, weight traffic alone in bytes/s, slowdown) per CORUN_CHAINS entry: the time per run with a
    second worker running the same chain on the other vCPU over the time alone, minus 1 (medians of
    `repeat` trials; the chains take turns, round after round, so a drift of the host hits them all)."""
    pairs = [_start_workers(chain, 2) for chain in CORUN_CHAINS]
    trials: list[list[tuple[float, float]]] = [[] for _ in CORUN_CHAINS]
    for _ in range(repeat):
        for mine, workers in zip(trials, pairs):
            mine.append(_alone_and_together(workers))
    for workers in pairs:
        _stop_workers(workers)
    return [(chain, chain[3] * weight_bytes(*chain) / statistics.median(a for a, _ in mine), statistics.median(r for _, r in mine) - 1)
            for chain, mine in zip(CORUN_CHAINS, trials)]


def _spills(chain: tuple[str, int, int, int]) -> bool:
    """Two copies of the chain overflow the shared cache that one alone fits in."""
    return working_set(*chain) <= SHARED_CACHE < 2 * working_set(*chain)


def corun_bandwidth(points: list[tuple[tuple[str, int, int, int], float, float]]) -> float:
    """The model's one figure: while two workers' working sets overflow the shared cache together, a node
    takes (its weight bytes / corun_bandwidth) longer, i.e. slows by (weight traffic rate alone) /
    corun_bandwidth. Least-squares slope through the origin of slowdown against that rate over the
    chains that overflow it in pairs, inverted."""
    spilled = [(rate, slowdown) for chain, rate, slowdown in points if _spills(chain)]
    return sum(r * r for r, _ in spilled) / sum(r * s for r, s in spilled)


def report_corun() -> float:
    """Print each chain's co-run slowdown and the fitted `corun_bandwidth`; return it."""
    points = corun_slowdowns()
    fitted = corun_bandwidth(points)
    for chain, rate, slowdown in points:
        op, rows, width, nodes = chain
        model = rate / fitted if _spills(chain) else 0.0
        print(f"co-run {op} chain, {nodes} x [{rows},{width}]: working set {working_set(*chain) / 2**20:.1f} MiB, weights at {rate / 1e9:.1f} "
              f"GB/s alone, slowdown beside a copy {slowdown:+.1%} (model: {model:+.1%})")
    print(f"corun_bandwidth (pairs overflowing the {SHARED_CACHE / 2**20:.0f} MiB shared cache): {fitted / 1e9:.0f} GB/s")
    return fitted


def _spin(conn: Connection, seconds: float, gap: float) -> None:
    """Spin on the clock for `seconds`; send (run lengths, gaps): a jump of more than `gap` between two
    readings is time the process did not run, and the time between two jumps is one run on a core."""
    conn.recv()
    runs, gaps = [], []
    begin = last = time.perf_counter()
    end = begin + seconds
    while last < end:
        now = time.perf_counter()
        if now - last > gap:
            runs.append(last - begin)
            gaps.append(now - last)
            begin = now
        last = now
    conn.send((runs[1:], gaps))  # the first run started before the others were busy


def time_slices(processes: int, seconds: float = 3.0, gap: float = 50e-6) -> tuple[list[float], list[float]]:
    """(run lengths, gaps) of `processes` one-thread busy processes started together on this machine's
    cores: with more of them than cores, the scheduler preempts each after a time slice and it waits
    while the others run theirs."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(processes)]
    procs = [ctx.Process(target=_spin, args=(theirs, seconds, gap)) for _, theirs in pipes]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # all started and waiting
    for ours, _ in pipes:
        ours.send(1)
    results = [ours.recv() for ours, _ in pipes]
    for proc in procs:
        proc.join()
    return [r for runs, _ in results for r in runs], [g for _, gaps in results for g in gaps]


def _scheduler_settings() -> str:
    """The kernel's slice settings where they can be read (the measurement is what counts)."""
    paths = ("/sys/kernel/debug/sched/base_slice_ns", "/proc/sys/kernel/sched_base_slice_ns", "/proc/sys/kernel/sched_min_granularity_ns")
    found = []
    for path in paths:
        try:
            found.append(f"{path} = {Path(path).read_text().strip()}")
        except OSError:
            continue
    return "; ".join(found) or "no slice setting readable"


def report_slices() -> None:
    """Print the median run between preemptions and the median wait for 2, 3 and 4 busy processes."""
    print(f"kernel {os.uname().release}: {_scheduler_settings()}")
    for processes in (2, 3, 4):
        runs, gaps = time_slices(processes)
        if len(runs) < 2:
            print(f"{processes} busy one-thread processes on {os.cpu_count()} vCPUs: not preempted")
            continue
        low, _, high = statistics.quantiles(runs, n=4)
        print(f"{processes} busy one-thread processes on {os.cpu_count()} vCPUs: {len(runs)} runs, median run between preemptions "
              f"{statistics.median(runs) * 1e3:.2f} ms (quartiles {low * 1e3:.2f}-{high * 1e3:.2f} ms), median wait "
              f"{statistics.median(gaps) * 1e3:.2f} ms (time_slice)")


#: Chains the `switch` part passes turns between: working sets of 2.3, 4.3 and 8.5 MiB (four of the first two fit
#: the shared cache together; four of the last do not, two do).
SWITCH_CHAINS = (("MatMul", 32, 256, 8), ("MatMul", 32, 512, 4), ("MatMul", 32, 512, 8))


def _turns(conn: Connection, chain: tuple[str, int, int, int], seconds: float) -> None:
    """Run the chain for about `seconds` per turn each time a token comes (None stops); answer the turn's
    thread CPU seconds."""
    session = cpu_session(_chain_model(*chain), threads=1)
    feed = {"x": np.random.rand(chain[1], chain[2]).astype(np.float32)}
    runs = max(1, round(seconds / _median_seconds(lambda: session.run(None, feed), 9)))
    conn.send("ready")
    while conn.recv() is not None:
        start = time.thread_time()
        for _ in range(runs):
            session.run(None, feed)
        conn.send(time.thread_time() - start)


def _pass_turns(conns: list[Connection], order: list[int], tokens: int) -> list[float]:
    """Give turns to the workers in `order`, `tokens` of them computing at once (each next turn goes out
    as one ends); the CPU seconds of worker 0's turns."""
    from multiprocessing.connection import wait

    mine: list[float] = []
    pending = list(order)
    busy = {}
    while pending or busy:
        while pending and len(busy) < tokens and pending[0] not in busy:
            w = pending.pop(0)
            conns[w].send(1)
            busy[w] = conns[w]
        for conn in wait(list(busy.values())):
            w = conns.index(conn)
            seconds = conn.recv()
            del busy[w]
            if w == 0:
                mine.append(seconds)
    return mine


def switch_seconds(chain: tuple[str, int, int, int], processes: int, tokens: int, turns: int = 60, rounds: int = 9,
                   seconds: float = 2e-3) -> tuple[float, float]:
    """(thread CPU of worker 0's turn when it runs back to back, the excess per turn when `processes` workers
    take turns round robin, `tokens` at once, on this machine's cores): between two of its turns the others
    ran, on its core too, so it starts with their data in its private caches and TLB. Medians; the two ways
    alternate `rounds` times in the same processes, so a drift of the host hits both alike."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(processes)]
    procs = [ctx.Process(target=_turns, args=(theirs, chain, seconds)) for _, theirs in pipes]
    for proc in procs:
        proc.start()
    conns = [ours for ours, _ in pipes]
    for conn in conns:
        conn.recv()
    alone: list[float] = []
    shared: list[float] = []
    for _ in range(rounds):
        alone += _pass_turns(conns, [0] * turns, 1)[2:]
        shared += _pass_turns(conns, list(range(processes)) * turns, tokens)[2:]
    for conn in conns:
        conn.send(None)
    for proc in procs:
        proc.join()
    return statistics.median(alone), statistics.median(shared) - statistics.median(alone)


def report_switches() -> None:
    """Print the switch-in cost for cpu4's case (4 workers, 2 computing at once), for one at a time, and for
    cpu2's (2 workers taking turns); then `switch_bandwidth`: a worker of the chain whose 4 working sets overflow
    the shared cache together reads its whole working set back from memory at each switch-in."""
    excess = {}
    for chain in SWITCH_CHAINS:
        op, rows, width, nodes = chain
        for processes, tokens in ((4, 2), (2, 2), (4, 1), (2, 1)):
            alone, excess[chain, processes, tokens] = switch_seconds(chain, processes, tokens)
            print(f"switch-in, {op} chain {nodes} x [{rows},{width}] ({working_set(*chain) / 2**20:.1f} MiB), {processes} workers, "
                  f"{tokens} at once: turn {alone * 1e3:.2f} ms CPU back to back, {excess[chain, processes, tokens] * 1e6:+.0f} us when taking turns (switch_cost)")
    for chain in (c for c in SWITCH_CHAINS if 4 * working_set(*c) > SHARED_CACHE):
        for tokens in (2, 1):
            refill = excess[chain, 4, tokens]
            rate = f"{working_set(*chain) / refill / 1e9:.1f} GB/s" if refill > 0 else "no refill"
            print(f"4 workers x {working_set(*chain) / 2**20:.1f} MiB overflowing the {SHARED_CACHE / 2**20:.0f} MiB shared cache, {tokens} at once: "
                  f"{refill * 1e6:+.0f} us per switch-in: its working set read back at {rate} (switch_bandwidth)")


#: A chain whose runs span 2-3 of the OS's 4 ms slices (about 10 ms here) with a 12.5 MiB working set: four overflow
#: the shared cache together, two fit it.
LONG_CHAIN = ("MatMul", 256, 512, 8)


def _long_runs(conn: Connection, chain: tuple[str, int, int, int], seconds: float) -> None:
    """Each time a token comes (None stops), run the chain back to back for `seconds`; answer the median thread CPU per run."""
    session = cpu_session(_chain_model(*chain), threads=1)
    feed = {"x": np.random.rand(chain[1], chain[2]).astype(np.float32)}
    for _ in range(3):
        session.run(None, feed)
    conn.send("ready")
    while conn.recv() is not None:
        runs = []
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            start = time.thread_time()
            session.run(None, feed)
            runs.append(time.thread_time() - start)
        conn.send(statistics.median(runs))


def midaction_refill(chain: tuple[str, int, int, int] = LONG_CHAIN, rounds: int = 5, seconds: float = 1.5) -> tuple[float, float]:
    """(thread CPU per run with 2 processes running the chain on this machine's 2 vCPUs, the excess per run with 4):
    with 4 the OS switches each run out and in 2-3 times, and the 4 working sets overflow the shared cache. A switch-in
    that read the whole working set back would cost 2-3 read-backs per run; one that reads back only what the rest of
    the run touches costs one at most. Medians over `rounds` alternating rounds in the same processes."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    pipes = [ctx.Pipe() for _ in range(4)]
    procs = [ctx.Process(target=_long_runs, args=(theirs, chain, seconds)) for _, theirs in pipes]
    for proc in procs:
        proc.start()
    for ours, _ in pipes:
        ours.recv()
    per_run: dict[int, list[float]] = {2: [], 4: []}
    for _ in range(rounds):
        for n in per_run:
            for ours, _ in pipes[:n]:
                ours.send(1)
            per_run[n].append(statistics.median(ours.recv() for ours, _ in pipes[:n]))
    for ours, _ in pipes:
        ours.send(None)
    for proc in procs:
        proc.join()
    two, four = statistics.median(per_run[2]), statistics.median(per_run[4])
    return two, four - two


def report_midaction() -> None:
    """Print the read-back a switch-in mid-action costs (`switch_bandwidth`'s semantics)."""
    ws = working_set(*LONG_CHAIN)
    two, excess = midaction_refill()
    once = (f"the working set read back once per run at {ws / excess / 1e9:.1f} GB/s (at or above switch_bandwidth: at most one "
            "read-back per run, not one per switch-in)") if excess > 0 else "no read-back"
    print(f"{LONG_CHAIN[0]} chain {LONG_CHAIN[3]} x [{LONG_CHAIN[1]},{LONG_CHAIN[2]}] ({ws / 2**20:.1f} MiB), runs of {two * 1e3:.2f} ms CPU "
          f"with 2 processes on the vCPUs: {excess * 1e6:+.0f} us per run with 4 (switched out and in mid-run, working sets "
          f"overflowing the {SHARED_CACHE / 2**20:.0f} MiB shared cache): {once}")


def _vcpu() -> int:
    """The vCPU this thread runs on (/proc: os.sched_getcpu needs Python 3.12)."""
    return int(Path("/proc/thread-self/stat").read_text().rsplit(")", 1)[1].split()[36])


def _waker(out: Connection, conn: Connection, seconds: float, every: float, gap: float) -> None:
    """Spin on the clock for `seconds`; every `every` seconds write a byte to `out` (waking its reader, as a
    ShmTransport send does). Send back per wake-up (vCPU at the write, seconds from the write until this
    process next lost its vCPU, or inf when it did not within `every` / 2)."""
    conn.recv()
    wakes = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        next_write = time.perf_counter() + every
        while time.perf_counter() < next_write:
            pass
        cpu, sent = _vcpu(), time.perf_counter()
        out.send_bytes(b"x")
        last = sent
        lost = math.inf
        while (now := time.perf_counter()) < sent + every / 2:
            if now - last > gap:
                lost = last - sent
                break
            last = now
        wakes.append((cpu, lost))
    out.send_bytes(b"stop")
    conn.send(wakes)


def _wakee(inbox: Connection, conn: Connection, work: float) -> None:
    """Block on `inbox`; at each byte, note the vCPU this process woke on, then compute for `work` seconds."""
    cpus = []
    while inbox.recv_bytes() != b"stop":
        cpus.append(_vcpu())
        end = time.perf_counter() + work
        while time.perf_counter() < end:
            pass
    conn.send(cpus)


def wake_placement(seconds: float = 3.0, every: float = 5e-3, work: float = 1e-3, gap: float = 50e-6) -> tuple[float, float, int]:
    """Where the OS runs a worker woken by a message while every vCPU is busy: one busy process per vCPU, one of
    them writing to a pipe that a third process blocks on (the executor's wake-up: ShmTransport signals over a
    pipe). (share of wake-ups on the writer's vCPU, share of writes after which the writer lost its vCPU within
    200 us: the woken reader ran first there, wake-ups)."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, out = ctx.Pipe(duplex=False)
    pipes = [ctx.Pipe() for _ in range(3)]
    procs = [ctx.Process(target=_waker, args=(out, pipes[0][1], seconds, every, gap)),
             ctx.Process(target=_spin, args=(pipes[1][1], seconds, gap)),
             ctx.Process(target=_wakee, args=(inbox, pipes[2][1], work))]
    for proc in procs:
        proc.start()
    time.sleep(1.0)  # all started and waiting
    pipes[0][0].send(1)
    pipes[1][0].send(1)
    wakes, _, cpus = (ours.recv() for ours, _ in pipes)
    for proc in procs:
        proc.join()
    pairs = list(zip(wakes, cpus))
    same = sum(cpu == woke for (cpu, _), woke in pairs) / len(pairs)
    preempted = sum(lost < 200e-6 for (_, lost), _ in pairs) / len(pairs)
    return same, preempted, len(pairs)


def report_wakes() -> None:
    """Print where woken workers run while every vCPU is busy (`wake_affine`)."""
    for _ in range(3):
        same, preempted, count = wake_placement()
        print(f"wake-ups while {os.cpu_count()} busy processes hold the {os.cpu_count()} vCPUs: {count}, {same:.0%} on the writer's vCPU, "
              f"the writer preempted within 200 us after {preempted:.0%} of its writes (wake_affine)")


PARTS = ("all", "gradients", "corun", "slice", "switch", "messages", "wake")


def main() -> None:
    part = sys.argv[1] if len(sys.argv) > 1 else "all"
    if part not in PARTS or len(sys.argv) > 2:
        raise SystemExit(f"usage: measure_cpu.py [{'|'.join(PARTS)}]")
    keep_freed_memory()  # the StageRunners measured here allocate as the executor's workers do
    if part == "all":
        print(f"float32 GEMM, 1 thread: {gemm_flops() / 1e9:.1f} GFLOP/s")
        print(f"memory read, 1 thread: {read_bandwidth() / 1e9:.1f} GB/s")
        for n, seconds in shm_handoff_seconds().items():
            print(f"shared-memory hand-off {n / 1024:.0f} KiB: {seconds * 1e6:.1f} us")
        print(f"onnxruntime dispatch per node: {ort_node_seconds() * 1e6:.2f} us")
        for n, seconds in transport_handoff_seconds().items():
            print(f"ShmTransport hand-off {n / 1024:.0f} KiB: {seconds * 1e6:.1f} us")
        forward, backward = action_seconds()
        print(f"StageRunner action of a one-node stage: forward {forward * 1e6:.1f} us, backward {backward * 1e6:.1f} us (action_overhead)")
    if part in ("all", "gradients"):
        for width in (1024, 256):
            nbytes, measured, profiled = gradient_seconds(width)
            rate = f"{nbytes / 1e9 / (measured - profiled):.1f} GB/s of gradients" if measured > profiled else "no gap"
            print(f"StageRunner backward of a 4 x {width} perceptron ({nbytes / 2**20:.1f} MiB of weights), 32 rows: {measured * 1e3:.2f} ms, "
                  f"its profile {profiled * 1e3:.2f} ms: {rate} (gradient_bandwidth)")
    if part in ("all", "corun"):
        report_corun()
        print(f"effective cores of 2 one-thread onnxruntime workers side by side: {effective_cores(2):.2f}")
        print(f"effective cores of 4 one-thread onnxruntime workers side by side: {effective_cores(4):.2f}")
    if part in ("all", "slice"):
        report_slices()
    if part in ("all", "switch"):
        report_switches()
        report_midaction()
    if part in ("all", "messages"):
        report_messages()
    if part in ("all", "wake"):
        report_wakes()
    if part == "all":
        for k in (2, 4):
            action, step, hop = pipeline_overheads(k)
            print(f"executor, {k} workers, width-8 perceptron: F/B action {action * 1e6:.1f} us, step outside the actions "
                  f"{step * 1e6:.1f} us (step_overhead), hop to a waiting receiver {hop * 1e6:.1f} us (link latency)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
