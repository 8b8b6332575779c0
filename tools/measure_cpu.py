"""Measure this machine for the cpu targets (targets/cpu2.toml, cpu4.toml): one-thread GEMM rate,
one-thread memory read bandwidth, shared-memory hand-off time between two processes (raw, and
through the executor's own `ShmTransport`), onnxruntime's per-node dispatch cost, the cores' worth of
throughput worker processes side by side really get (`cores`: the 2 vCPUs need not be 2 cores), and the fixed cost
of one forward and one backward action of the executor's `StageRunner` alone and inside two worker
processes (`action_overhead`), and the driver's share of a step (`step_overhead`).

Run: .venv/bin/python tools/measure_cpu.py
"""

from __future__ import annotations

import os

os.environ["OPENBLAS_NUM_THREADS"] = "1"  # one worker process = one thread; set before numpy loads BLAS

import statistics
import time
from collections.abc import Callable
from multiprocessing import Pipe, Process, shared_memory
from multiprocessing.connection import Connection

import numpy as np
from onnx import TensorProto, helper

from onnxpipe.ortutil import cpu_session
from onnxpipe.train.prepare import TrainConfig, prepare_single
from onnxpipe.train.stage import StageRunner
from onnxpipe.train.transport import ShmTransport, make_inboxes, sweep_segments

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


def pipeline_overheads(stages: int, steps: int = 40) -> tuple[float, float, float]:
    """(action, step, hop) costs inside the executor: `stages` worker processes train a perceptron of
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
    with Pipeline(model, f"cpu{stages}", stages=stages, microbatches=2 * stages, schedule="gpipe", optimizer=OptimizerConfig("sgd", lr=0.01)) as pipe:
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


def _ort_chain(conn: Connection, runs: int) -> None:
    """Time `runs` runs of a one-thread session of 8 chained 256x256 MatMul+Relu (the executor's kind of work)."""
    nodes, x = [], "x"
    weights = []
    for i in range(8):
        nodes += [helper.make_node("MatMul", [x, f"w{i}"], [f"m{i}"]), helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        weights.append(helper.make_tensor(f"w{i}", TensorProto.FLOAT, [256, 256], np.random.rand(256 * 256).astype(np.float32) / 256))
        x = f"r{i}"
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 256])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [64, 256])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    session = cpu_session(model.SerializeToString(), threads=1)
    feed = {"x": np.random.rand(64, 256).astype(np.float32)}
    conn.recv()
    start = time.perf_counter()
    for _ in range(runs):
        session.run(None, feed)
    conn.send(time.perf_counter() - start)


def effective_cores(processes: int = 2, runs: int = 300, repeat: int = 3) -> float:
    """Cores' worth of throughput that `processes` one-thread onnxruntime workers get together:
    processes x (time alone) / (time side by side), median of `repeat` trials."""
    import multiprocessing as mp

    ctx = mp.get_context("spawn")

    def trial(n: int) -> float:
        pipes = [ctx.Pipe() for _ in range(n)]
        procs = [ctx.Process(target=_ort_chain, args=(theirs, runs)) for _, theirs in pipes]
        for p in procs:
            p.start()
        for ours, _ in pipes:
            ours.send("go")
        seconds = max(ours.recv() for ours, _ in pipes)
        for p in procs:
            p.join()
        return seconds

    return statistics.median(processes * trial(1) / trial(processes) for _ in range(repeat))


def main() -> None:
    print(f"float32 GEMM, 1 thread: {gemm_flops() / 1e9:.1f} GFLOP/s")
    print(f"memory read, 1 thread: {read_bandwidth() / 1e9:.1f} GB/s")
    for n, seconds in shm_handoff_seconds().items():
        print(f"shared-memory hand-off {n / 1024:.0f} KiB: {seconds * 1e6:.1f} us")
    print(f"onnxruntime dispatch per node: {ort_node_seconds() * 1e6:.2f} us")
    for n, seconds in transport_handoff_seconds().items():
        print(f"ShmTransport hand-off {n / 1024:.0f} KiB: {seconds * 1e6:.1f} us")
    forward, backward = action_seconds()
    print(f"StageRunner action of a one-node stage: forward {forward * 1e6:.1f} us, backward {backward * 1e6:.1f} us (action_overhead)")
    print(f"effective cores of 2 one-thread onnxruntime workers side by side: {effective_cores(2):.2f}")
    print(f"effective cores of 4 one-thread onnxruntime workers side by side: {effective_cores(4):.2f}")
    for k in (2, 4):
        action, step, hop = pipeline_overheads(k)
        print(f"executor, {k} workers, width-8 perceptron: F/B action {action * 1e6:.1f} us, step outside the actions "
              f"{step * 1e6:.1f} us (step_overhead), hop to a waiting receiver {hop * 1e6:.1f} us (link latency)")
    print(f"load average at the end: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
