"""onnxruntime in one place: CPU sessions, gradient graphs and quiet logs (its gradient builder and
graph rewrites log every pass at info level to native stderr, whatever the Python-side settings say)."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Container, Iterable, Iterator, Mapping

from onnxpipe.errors import OnnxpipeError

__all__ = [
    "quiet_stderr", "quiet_logger", "cpu_session", "session", "available_providers", "CPU_PROVIDER", "cuda_works", "gradient_model", "ort_reason",
    "REWRITTEN_OPS", "REWRITTEN_SUFFIXES", "complete_optional_outputs", "lift_initializers", "pretraining_rewrite", "state_inputs",
    "MAX_IR_VERSION", "MAX_OPSET", "ensure_runtime_loads", "NO_NUMPY_DTYPES", "ensure_numpy_types", "numpy_types",
]

CPU_PROVIDER = "CPUExecutionProvider"
#: Highest IR version onnxruntime-training 1.19.2 loads (models above it are written and run at it).
MAX_IR_VERSION = 10
#: Highest default-domain opset onnxruntime-training 1.19.2 has kernels for.
MAX_OPSET = 21
#: Element types IR 10 lacks (FLOAT4E2M1 = 23 and later, IR 11+): a model holding one cannot be lowered to IR 10.
_FIRST_TYPE_AFTER_IR10 = 23
#: Ops differentiable only after onnxruntime's pre-training rewrites (LSTM -> com.microsoft LSTMTraining,
#: BatchNormalization -> BatchNormInternal in training mode): a graph holding one goes through `pretraining_rewrite`.
REWRITTEN_OPS = frozenset({"LSTM", "BatchNormalization"})
#: What the rewrites append to a rewritten node's name (its gradient nodes are `<name><suffix>_Grad/...`).
REWRITTEN_SUFFIXES = ("_training", "_BatchNormInternal")
#: Inputs of a node that are state, not weights: BatchNormalization's running mean and variance.
_STATE_INPUTS = {"BatchNormalization": (3, 4)}
_OPTIONAL_OUTPUTS = {"LayerNormalization": 3, "SoftmaxCrossEntropyLoss": 2, "Dropout": 2}
#: Optional inputs written out (as "") up to this count: the LSTM gradient reads them by position.
_OPTIONAL_INPUTS = {"LSTM": 7}


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
    """onnxruntime's default logger at fatal level, once per process: its errors reach onnxpipe as
    exceptions (one line each), never as coloured log lines on stderr."""
    import onnxruntime

    onnxruntime.set_default_logger_severity(4)


def cpu_session(model: bytes | str | os.PathLike, *, threads: int = 0, optimize: bool = True, profile_prefix: str | None = None):  # -> InferenceSession
    """An onnxruntime session on the CPU with quiet logs. `threads` > 0 pins the intra-op threads (one
    inter-op thread); `optimize=False` keeps the model's own nodes, as profiling and shape probing need."""
    return session(model, CPU_PROVIDER, threads=threads, optimize=optimize, profile_prefix=profile_prefix)


def available_providers() -> tuple[str, ...]:
    """The execution providers this onnxruntime build has."""
    import onnxruntime as ort

    return tuple(ort.get_available_providers())


def session(model: bytes | str | os.PathLike, provider: str, *, threads: int = 0, optimize: bool = True, profile_prefix: str | None = None,
            provider_options: Mapping[str, object] | None = None):  # -> InferenceSession
    """An onnxruntime session on `provider` (nodes it lacks fall back to the CPU), options as `cpu_session`;
    `provider_options` are the provider's own (CUDA's `device_id`)."""
    import onnxruntime as ort

    quiet_logger()
    options = ort.SessionOptions()
    options.log_severity_level = 4
    if threads > 0:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    if not optimize:
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    if profile_prefix is not None:
        options.enable_profiling = True
        options.profile_file_prefix = profile_prefix
    source = model if isinstance(model, bytes) else str(model)
    providers: list[object] = [(provider, dict(provider_options)) if provider_options else provider]
    return ort.InferenceSession(source, options, providers=providers + ([CPU_PROVIDER] if provider != CPU_PROVIDER else []))


def ensure_runtime_loads(model, origin: str) -> None:  # model: onnx.ModelProto
    """Refuse, before anything is written, a model onnxruntime-training 1.19.2 cannot load: a default-domain
    opset above MAX_OPSET, or an IR version above MAX_IR_VERSION holding element types IR 10 lacks (other
    models above IR 10 are lowered to it, which changes nothing they use)."""
    from onnx import helper

    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
    if opset > MAX_OPSET:
        raise OnnxpipeError(f"{origin}: opset {opset} is above what onnxruntime 1.19 loads ({MAX_OPSET}); convert it with "
                            f"onnx.version_converter.convert_version(model, {MAX_OPSET}) or re-export at opset {MAX_OPSET}")
    if model.ir_version <= MAX_IR_VERSION:
        return
    g = model.graph
    typed = [(t.name, t.data_type) for t in g.initializer]
    typed += [(v.name, v.type.tensor_type.elem_type) for v in (*g.input, *g.output, *g.value_info) if v.type.HasField("tensor_type")]
    newer = next(((name, kind) for name, kind in typed if kind >= _FIRST_TYPE_AFTER_IR10), None)
    if newer is not None:
        raise OnnxpipeError(f"{origin}: IR version {model.ir_version} with tensor '{newer[0]}' of type "
                            f"{helper.tensor_dtype_to_string(newer[1]).removeprefix('TensorProto.')}, which IR {MAX_IR_VERSION} "
                            f"(the newest onnxruntime 1.19 loads) lacks; cast it to a type IR {MAX_IR_VERSION} has and re-export")


@functools.cache
def cuda_works(device_id: int) -> bool:
    """Whether onnxruntime runs a session on CUDA device `device_id` in this process. The CUDA build lists
    its provider even where the GPU, CUDA or cuDNN is missing (a session then falls back to the CPU), so
    this builds one tiny session and asks which providers it got."""
    import onnxruntime as ort
    from onnx import TensorProto, helper

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        return False
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])
    model = helper.make_model(helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y]),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    options = ort.SessionOptions()
    options.log_severity_level = 4
    try:
        with quiet_stderr():
            session = ort.InferenceSession(model.SerializeToString(), options,
                                           providers=[("CUDAExecutionProvider", {"device_id": device_id}), "CPUExecutionProvider"])
    except Exception:  # a bad device id, a driver error: not usable either way
        return False
    return "CUDAExecutionProvider" in session.get_providers()


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
    """The reason in an onnxruntime error: its first line after the source location and status code (separated by " : "),
    or after a failed check's source location, C++ signature and condition (which end "was false. ")."""
    lines = str(exc).strip().splitlines()
    return lines[0].split(" : ")[-1].split(" was false. ")[-1][:300] if lines else type(exc).__name__


def complete_optional_outputs(graph) -> None:  # graph: onnx.GraphProto
    """The gradient builder needs LayerNormalization's Mean/InvStdDev, SoftmaxCrossEntropyLoss's log_prob and Dropout's mask
    (and LSTM's optional inputs spelled out)."""
    for i, node in enumerate(graph.node):
        node.input.extend([""] * (_OPTIONAL_INPUTS.get(node.op_type, 0) - len(node.input)))
        want = _OPTIONAL_OUTPUTS.get(node.op_type, 0)
        for k in range(len(node.output), want):
            node.output.append(f"{node.name or node.op_type + str(i)}/onnxpipe_opt{k}")
        for k in range(want):
            if not node.output[k]:
                node.output[k] = f"{node.name or node.op_type + str(i)}/onnxpipe_opt{k}"


def state_inputs(graph) -> set[str]:  # graph: onnx.GraphProto
    """Tensors the graph's nodes read as state, not weights: never trained, never differentiated."""
    return {n.input[i] for n in graph.node for i in _STATE_INPUTS.get(n.op_type, ()) if i < len(n.input)}


def lift_initializers(graph, names) -> dict:  # graph: onnx.GraphProto, names: Iterable[str] -> {name: onnx.TensorProto}
    """The named initializers become graph inputs, in `names`' order; the tensors taken out. onnxruntime's rewrites
    fold and merge initializers (a dynamo LSTM's gate reordering of its weights folds into new ones, cutting the
    weights off the gradient); graph inputs they leave alone."""
    from onnx import helper

    names = list(dict.fromkeys(names))
    lifted = {t.name: t for t in graph.initializer if t.name in set(names)}
    keep = [t for t in graph.initializer if t.name not in lifted]
    del graph.initializer[:]
    graph.initializer.extend(keep)
    for vi in [v for v in graph.input if v.name in lifted]:
        graph.input.remove(vi)
    for name in names:
        if name in lifted:
            graph.input.append(helper.make_tensor_value_info(name, lifted[name].data_type, list(lifted[name].dims)))
    return lifted


def pretraining_rewrite(model: bytes, trained: set[str]) -> bytes:
    """onnxruntime's pre-training graph rewrites (see `REWRITTEN_OPS`); onnxruntime's own exception when they fail."""
    from onnxruntime.capi._pybind_state import SessionOptions, get_optimized_model

    quiet_logger()
    with quiet_stderr():
        return get_optimized_model(model, trained, SessionOptions())


#: Tensor types onnxruntime's Python API hands to no numpy array ("No corresponding Numpy type"): nothing that crosses a
#: stage boundary in them can be fed, received or sent.
NO_NUMPY_DTYPES = frozenset({"bfloat16", "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz"})


def ensure_numpy_types(origin: str, tensors: Iterable[tuple[str, str]], doing: str) -> None:
    """One line, before any worker starts, where a tensor the executor hands over as numpy ((name, numpy dtype name):
    a stage boundary's, a trained weight's) has a type onnxruntime gives numpy none of (a bfloat16 model)."""
    named = list(tensors)
    for dtype in sorted({d for _, d in named} & NO_NUMPY_DTYPES):
        names = list(dict.fromkeys(n for n, d in named if d == dtype))
        shown = ", ".join(f"'{n}'" for n in names[:3]) + (" ..." if len(names) > 3 else "")
        raise OnnxpipeError(f"{origin}: {dtype} tensors ({shown}): onnxruntime's Python API hands no {dtype} arrays to numpy, so "
                            f"onnxpipe cannot {doing} it; export the model in float32, or in float16 (`train --master-weights` for "
                            "mixed precision); `plan` and `split` take it as it is")


def numpy_types(model, weights: Container[str]) -> list[tuple[str, str]]:  # model: onnx.ModelProto
    """(name, numpy dtype name) of what the executor hands over as numpy: the graph's inputs and outputs, the `weights`."""
    from onnx import helper

    graph = model.graph
    found = [(v.name, helper.tensor_dtype_to_np_dtype(v.type.tensor_type.elem_type).name) for v in (*graph.input, *graph.output)
             if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type]
    return found + [(t.name, helper.tensor_dtype_to_np_dtype(t.data_type).name) for t in graph.initializer if t.name in weights]
