"""onnxruntime in one place: CPU sessions, gradient graphs and quiet logs (its gradient builder and
graph rewrites log every pass at info level to native stderr, whatever the Python-side settings say)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Iterator

__all__ = ["quiet_stderr", "quiet_logger", "cpu_session", "gradient_model", "ort_reason"]


@contextlib.contextmanager
def quiet_stderr() -> Iterator[None]:
    """Silence native stderr (file descriptor 2) for the duration."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@functools.cache
def quiet_logger() -> None:
    """onnxruntime's default logger at warning level and above, once per process."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(3)


def cpu_session(model: bytes | str | os.PathLike, *, threads: int = 0, optimize: bool = True, profile_prefix: str | None = None):  # -> InferenceSession
    """An onnxruntime session on the CPU with quiet logs. `threads` > 0 pins the intra-op threads (one
    inter-op thread); `optimize=False` keeps the model's own nodes, as profiling and shape probing need."""
    import onnxruntime as ort

    quiet_logger()
    options = ort.SessionOptions()
    options.log_severity_level = 3
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    source = model if isinstance(model, bytes) else str(model)
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])


def gradient_model(model: bytes, loss: str, trained: set[str]):  # -> onnx.ModelProto
    """onnxruntime-training's gradient graph of `loss` with respect to `trained` (initializers or graph
    inputs, each giving a `<name>_grad` output); onnxruntime's own exception when it cannot build one."""
    import onnx
    from onnxruntime.capi._pybind_state import GradientGraphBuilder

    quiet_logger()
    with quiet_stderr():  # the builder logs every pass at info level whatever the severity
        builder = GradientGraphBuilder(model, {loss}, trained, loss)
        builder.build()
    return onnx.load_from_string(builder.get_model())


def ort_reason(exc: BaseException) -> str:
    """The reason in an onnxruntime error: its first line, after the source location and status code (separated by " : ")."""
    lines = str(exc).strip().splitlines()
    return lines[0].split(" : ")[-1][:300] if lines else type(exc).__name__
