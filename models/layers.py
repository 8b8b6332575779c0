"""Shared op-building helpers: one small builder that names every node and initializer uniquely.

Reading order: `GraphBuilder` (inputs, weights, `op`, `model`) -> layer helpers (`linear`, `gemm`,
`conv`, `layer_norm`, `gelu`, `lstm`) -> loss heads (`cross_entropy`, `mse`).
Every model builder in this package goes through these helpers so naming, initialisation and the
opset stay the same across the zoo.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

__all__ = ["OPSET", "IR_VERSION", "GraphBuilder", "Loss", "weights_into"]

#: Default-domain opset every builder targets.
OPSET = 17
#: IR version of built models (the newest that onnxruntime 1.19 reads with opset 17).
IR_VERSION = 8


class _Sparse:
    """Where `weights_into` puts the weights: a file name, the offset of the next weight and those of the ones before."""

    def __init__(self, location: str) -> None:
        self.location = location
        self.offset = 0
        self.starts: list[int] = []


_SPARSE: ContextVar[_Sparse | None] = ContextVar("onnxpipe_sparse_weights", default=None)


@contextmanager
def weights_into(data: Path) -> Iterator[None]:
    """While it is open, every weight a builder asks for is an external-data header into `data` (a name beside the
    model), at its own offset, and no values are drawn; at the end `data` is made that long, sparsely: zeros, but for
    each weight's first element, its own number (1, 2, ...: one block written per weight). A model of billions of
    parameters is built in seconds and never held in memory: planning reads weights' sizes alone. Why not zeros
    throughout: to `onnxpipe.initializers` a weight of one value read in two modules is an exporter's merge (GPT-2's
    tied embedding and output projection were untied); why a number of its own: a weight equal to another's transpose
    is an exporter's copy (with 1 first in each, GPT-2's MLP projections were tied). Its weights are not trained ones:
    it is for planning, not for training or comparing outputs."""
    sparse = _Sparse(data.name)
    token = _SPARSE.set(sparse)
    try:
        yield
    finally:
        _SPARSE.reset(token)
    with open(data, "wb") as f:
        f.truncate(sparse.offset)
        for number, start in enumerate(sparse.starts, 1):
            f.seek(start)
            f.write(np.float32(number).tobytes())


@dataclass(frozen=True)
class Loss:
    """The names a loss head adds to a graph."""

    #: Scalar loss tensor (the first graph output of a training variant).
    loss: str
    #: Name of the labels graph input.
    labels: str


class GraphBuilder:
    """Collects inputs, initializers, nodes and outputs of one graph and hands back a ModelProto.

    Names are prefixed by the current `scope` and made unique with a counter, so helpers can be
    called repeatedly without the caller inventing names.
    """

    def __init__(self, name: str, seed: int = 0, init_scale: float | None = None) -> None:
        self.name = name
        self.rng = np.random.default_rng(seed)
        #: Fixed standard deviation for every weight (fast path for full-size models); None = 1/sqrt(fan_in).
        self.init_scale = init_scale
        self.inputs: list[onnx.ValueInfoProto] = []
        self.outputs: list[onnx.ValueInfoProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.nodes: list[onnx.NodeProto] = []
        self._used: set[str] = set()
        self._scope: list[str] = []
        self._consts: dict[tuple[str, bytes, tuple[int, ...]], str] = {}

    # -- naming ---------------------------------------------------------------------------------

    @contextmanager
    def scope(self, name: str) -> Iterator[None]:
        """Prefix every name created inside the block with `name/`."""
        self._scope.append(name)
        try:
            yield
        finally:
            self._scope.pop()

    def unique(self, base: str) -> str:
        """A name not used yet in this graph, built from the scope and `base`."""
        full = "/".join([*self._scope, base])
        name, k = full, 1
        while name in self._used:
            name, k = f"{full}_{k}", k + 1
        self._used.add(name)
        return name

    # -- graph boundary -------------------------------------------------------------------------

    def input(self, name: str, shape: Sequence[int], dtype: int = TensorProto.FLOAT) -> str:
        """Declare a graph input with a static shape."""
        self._used.add(name)
        self.inputs.append(helper.make_tensor_value_info(name, dtype, list(shape)))
        return name

    def output(self, tensor: str, shape: Sequence[int] | None = None, dtype: int = TensorProto.FLOAT) -> str:
        """Declare an existing tensor as a graph output (shape None leaves it to inference)."""
        self.outputs.append(helper.make_tensor_value_info(tensor, dtype, None if shape is None else list(shape)))
        return tensor

    # -- initializers ---------------------------------------------------------------------------

    def weight(self, base: str, shape: Sequence[int], fan_in: int | None = None) -> str:
        """A random float32 initializer: N(0, init_scale) or N(0, 1/fan_in) (fan_in defaults to shape[0])."""
        sparse = _SPARSE.get()
        if sparse is not None:
            return self._external(base, shape, sparse)
        std = self.init_scale if self.init_scale is not None else 1.0 / math.sqrt(max(1, fan_in or shape[0]))
        values = self.rng.standard_normal(tuple(shape), dtype=np.float32)
        values *= np.float32(std)
        return self.tensor(base, values)

    def _external(self, base: str, shape: Sequence[int], sparse: _Sparse) -> str:
        """A float32 initializer whose values are in `sparse`'s file, at the next offset (`weights_into`)."""
        name = self.unique(base)
        header = TensorProto(name=name, data_type=TensorProto.FLOAT, dims=list(shape), data_location=TensorProto.EXTERNAL)
        length = 4 * math.prod(int(d) for d in shape)
        for key, value in (("location", sparse.location), ("offset", str(sparse.offset)), ("length", str(length))):
            entry = header.external_data.add()
            entry.key, entry.value = key, value
        sparse.starts.append(sparse.offset)
        sparse.offset += length
        self.initializers.append(header)
        return name

    def fill(self, base: str, shape: Sequence[int], value: float) -> str:
        """A float32 initializer filled with one value (biases, norm scales)."""
        return self.tensor(base, np.full(tuple(shape), value, dtype=np.float32))

    def tensor(self, base: str, values: np.ndarray) -> str:
        """An initializer holding exactly `values`, under a fresh name."""
        name = self.unique(base)
        self.initializers.append(numpy_helper.from_array(np.asarray(values, order="C"), name))
        return name

    def const(self, values: np.ndarray | Sequence[int] | float, base: str = "const") -> str:
        """A small constant table (shapes, axes, scalars), shared when the same value is asked twice."""
        array = np.asarray(values)
        if array.dtype.kind == "i":
            array = array.astype(np.int64)
        elif array.dtype.kind == "f":
            array = array.astype(np.float32)
        key = (array.dtype.str, array.tobytes(), array.shape)
        if key not in self._consts:
            saved, self._scope = self._scope, []
            try:
                self._consts[key] = self.tensor(base, array)
            finally:
                self._scope = saved
        return self._consts[key]

    # -- nodes ----------------------------------------------------------------------------------

    def op(self, op_type: str, inputs: Sequence[str], outputs: int | Sequence[str] = 1, name: str | None = None, **attrs: object) -> str | list[str]:
        """Append one node; returns its output name (one output) or the list of output names.

        `outputs` is a count (names are generated) or explicit names ("" marks an omitted optional output).
        """
        node_name = self.unique(name or op_type)
        if isinstance(outputs, int):
            out_names = [node_name if outputs == 1 else f"{node_name}:{i}" for i in range(outputs)]
            out_names = [o if o == node_name else self._claim(o) for o in out_names]
        else:
            out_names = [self._claim(o) if o else "" for o in outputs]
        self.nodes.append(helper.make_node(op_type, list(inputs), out_names, name=node_name, **attrs))
        return out_names[0] if len(out_names) == 1 else out_names

    def _claim(self, name: str) -> str:
        if name in self._used:
            raise ValueError(f"tensor name {name!r} is already used in graph {self.name!r}")
        self._used.add(name)
        return name

    def graph(self) -> onnx.GraphProto:
        """The collected graph (also used for If/Loop bodies)."""
        return helper.make_graph(self.nodes, self.name, self.inputs, self.outputs, self.initializers)

    def model(self, doc: str = "") -> onnx.ModelProto:
        """The finished model: opset 17, IR 8, producer onnxpipe.models."""
        model = helper.make_model(
            self.graph(),
            opset_imports=[helper.make_opsetid("", OPSET)],
            producer_name="onnxpipe.models",
            doc_string=doc,
        )
        model.ir_version = IR_VERSION
        return model

    # -- layers ---------------------------------------------------------------------------------

    def linear(self, x: str, n_in: int, n_out: int, name: str = "linear", bias: bool = True) -> str:
        """x @ W (+ b) with MatMul (+ Add): works on any leading dims."""
        with self.scope(name):
            y = self.op("MatMul", [x, self.weight("weight", (n_in, n_out))])
            if bias:
                y = self.op("Add", [y, self.fill("bias", (n_out,), 0.0)])
        return y

    def gemm(self, x: str, n_in: int, n_out: int, name: str = "fc") -> str:
        """A 2-D fully connected layer as one Gemm node (weights stored [out, in], transB=1)."""
        with self.scope(name):
            w = self.weight("weight", (n_out, n_in), fan_in=n_in)
            return self.op("Gemm", [x, w, self.fill("bias", (n_out,), 0.0)], transB=1)

    def conv(self, x: str, c_in: int, c_out: int, kernel: int, stride: int = 1, name: str = "conv", bias: bool = True) -> str:
        """A square-kernel Conv with 'same'-style padding kernel//2."""
        with self.scope(name):
            w = self.weight("weight", (c_out, c_in, kernel, kernel), fan_in=c_in * kernel * kernel)
            inputs = [x, w] + ([self.fill("bias", (c_out,), 0.0)] if bias else [])
            pad = kernel // 2
            return self.op("Conv", inputs, kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4)

    def batch_norm(self, x: str, channels: int, name: str = "bn") -> str:
        """Inference-mode BatchNormalization with identity statistics."""
        with self.scope(name):
            scale, bias = self.fill("scale", (channels,), 1.0), self.fill("bias", (channels,), 0.0)
            mean, var = self.fill("mean", (channels,), 0.0), self.fill("var", (channels,), 1.0)
            return self.op("BatchNormalization", [x, scale, bias, mean, var], epsilon=1e-5)

    def layer_norm(self, x: str, width: int, name: str = "ln") -> str:
        """LayerNormalization over the last axis, with its Mean and InvStdDev outputs (gradient needs them)."""
        with self.scope(name):
            scale, bias = self.fill("scale", (width,), 1.0), self.fill("bias", (width,), 0.0)
            node = self.unique("LayerNormalization")
            outs = [node, self._claim(f"{node}:mean"), self._claim(f"{node}:inv_std_dev")]
            self.nodes.append(helper.make_node("LayerNormalization", [x, scale, bias], outs, name=node, axis=-1, epsilon=1e-5))
            return node

    def gelu(self, x: str) -> str:
        """GELU written out as x * 0.5 * (1 + Erf(x / sqrt 2)), so any opset-17 runtime runs it."""
        with self.scope("gelu"):
            erf = self.op("Erf", [self.op("Div", [x, self.const(np.float32(math.sqrt(2.0)))])])
            one_plus = self.op("Add", [erf, self.const(np.float32(1.0))])
            return self.op("Mul", [self.op("Mul", [x, self.const(np.float32(0.5))]), one_plus])

    def lstm(self, x: str, n_in: int, hidden: int, name: str = "lstm", initial: tuple[str, str] | None = None) -> tuple[str, str, str]:
        """One time-major (layout 0: onnxruntime has no batch-major LSTM) unidirectional LSTM layer.

        Returns (Y [S, B, H], Y_h [1, B, H], Y_c [1, B, H]); `initial` is (h0, c0) shaped like Y_h.
        """
        with self.scope(name):
            w = self.weight("W", (1, 4 * hidden, n_in), fan_in=n_in)
            r = self.weight("R", (1, 4 * hidden, hidden), fan_in=hidden)
            b = self.fill("B", (1, 8 * hidden), 0.0)
            inputs = [x, w, r, b] + (["", initial[0], initial[1]] if initial else [])
            y, y_h, y_c = self.op("LSTM", inputs, 3, hidden_size=hidden)
            seq = self.op("Squeeze", [y, self.const([1])])
        return seq, y_h, y_c

    # -- loss heads -----------------------------------------------------------------------------

    def cross_entropy(self, logits: str, label_shape: Sequence[int]) -> Loss:
        """Mean SoftmaxCrossEntropyLoss against a new int64 `labels` input; logits are [N, C] or [N, C, d...]."""
        labels = self.input("labels", label_shape, TensorProto.INT64)
        self.softmax_cross_entropy(logits, labels, "loss")
        return Loss(loss="loss", labels=labels)

    def softmax_cross_entropy(self, logits: str, labels: str, out: str | None = None) -> str:
        """One mean SoftmaxCrossEntropyLoss node; its optional log_prob output is kept because
        onnxruntime-training's gradient of the loss reads it."""
        with self.scope("loss"):
            node = self.unique("SoftmaxCrossEntropyLoss")
            outs = [self._claim(out or f"{node}:loss"), self._claim(f"{node}:log_prob")]
            self.nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [logits, labels], outs, name=node, reduction="mean"))
        return outs[0]

    def mse(self, prediction: str, target_shape: Sequence[int]) -> Loss:
        """Mean squared error against a float `labels` input, as Sub, Mul, ReduceMean."""
        labels = self.input("labels", target_shape)
        with self.scope("loss"):
            diff = self.op("Sub", [prediction, labels])
            square = self.op("Mul", [diff, diff])
            node = self.unique("ReduceMean")
            self.nodes.append(helper.make_node("ReduceMean", [square], [self._claim("loss")], name=node, keepdims=0))
        return Loss(loss="loss", labels=labels)

    def classifier_outputs(self, logits: str, logits_shape: Sequence[int], train: bool, label_shape: Sequence[int], mse: bool = False, loss_logits: str | None = None) -> None:
        """Declare the outputs: logits alone (inference) or the scalar loss first, then the logits (training).

        Cross-entropy reads int64 class labels; with `mse` the labels are float targets shaped like the logits.
        `loss_logits` is the class-axis-second view the loss reads when it differs from `logits`.
        """
        if train:
            loss = self.mse(logits, logits_shape) if mse else self.cross_entropy(loss_logits or logits, label_shape)
            self.output(loss.loss, [])
        self.output(logits, logits_shape)
