"""Measure this machine for the cpu targets (targets/cpu2.toml, cpu4.toml): one-thread GEMM rate,
one-thread memory read bandwidth, shared-memory hand-off time between two processes, and
onnxruntime's per-node dispatch cost.

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
import onnxruntime as ort
from onnx import TensorProto, helper

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

        def handoff() -> None:
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

    def session(nodes: int) -> ort.InferenceSession:
        chain = [helper.make_node("Relu", ["x" if i == 0 else f"t{i - 1}"], [f"t{i}"]) for i in range(nodes)]
        graph = helper.make_graph(
            chain, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8])], [helper.make_tensor_value_info(f"t{nodes - 1}", TensorProto.FLOAT, [8])]
        )
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
        model.ir_version = 9
        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        return ort.InferenceSession(model.SerializeToString(), options, providers=["CPUExecutionProvider"])

    x = {"x": np.ones(8, np.float32)}
    one, many = session(1), session(k + 1)
    return (_median_seconds(lambda: many.run(None, x), 200) - _median_seconds(lambda: one.run(None, x), 200)) / k


def main() -> None:
    print(f"float32 GEMM, 1 thread: {gemm_flops() / 1e9:.1f} GFLOP/s")
    print(f"memory read, 1 thread: {read_bandwidth() / 1e9:.1f} GB/s")
    for n, seconds in shm_handoff_seconds().items():
        print(f"shared-memory hand-off {n / 1024:.0f} KiB: {seconds * 1e6:.1f} us")
    print(f"onnxruntime dispatch per node: {ort_node_seconds() * 1e6:.2f} us")


if __name__ == "__main__":
    main()
