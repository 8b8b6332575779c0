"""LSTM sequence-to-sequence models in the shape of GNMT: gnmt-tiny (tests) and gnmt8 (planning).

GNMT's structure kept here: stacked encoder LSTMs with residual connections from the third layer
on, a decoder whose bottom layer starts from the encoder's final states and whose output attends
over the encoder outputs, the attention context fed to every upper decoder layer, and a vocabulary
projection. Teacher forcing: the decoder reads the target tokens, so the graph is static.
Inside, tensors are time-major ([seq, batch, ...]: onnxruntime runs only layout-0 LSTMs); the graph
inputs and the logits are batch-major.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["gnmt"]

#: Weight std of the full-size model.
_FULL_SIZE_INIT = 0.02


def _layer(b: GraphBuilder, x: str, n_in: int, hidden: int, index: int, state: tuple[str, str] | None = None,
           context: str | None = None) -> tuple[str, tuple[str, str]]:
    """LSTM layer `index` of a stack: `context` concatenated to its input, a residual add from layer 2
    on (GNMT's choice); returns its output and final (h, c)."""
    with b.scope(f"lstm{index}"):
        layer_in, width = x, n_in
        if context is not None:
            layer_in, width = b.op("Concat", [x, context], name="with_context", axis=-1), n_in + hidden
        y, y_h, y_c = b.lstm(layer_in, width, hidden, initial=state)
        return (b.op("Add", [x, y], name="residual") if index >= 2 else y), (y_h, y_c)


def _attend(b: GraphBuilder, query: str, memory: str) -> str:
    """Dot-product attention of decoder outputs [T, B, H] over encoder outputs [S, B, H] (time-major
    in and out, batch-major inside)."""
    with b.scope("attention"):
        q = b.op("Transpose", [query], name="query", perm=[1, 0, 2])
        keys = b.op("Transpose", [memory], name="keys", perm=[1, 2, 0])
        values = b.op("Transpose", [memory], name="values", perm=[1, 0, 2])
        probs = b.op("Softmax", [b.op("MatMul", [q, keys], name="scores")], axis=-1)
        return b.op("Transpose", [b.op("MatMul", [probs, values], name="context")], perm=[1, 0, 2])


def gnmt(*, layers: int, hidden: int, seq: int, vocab: int, batch: int, train: bool, seed: int, full_size: bool = False) -> onnx.ModelProto:
    """GNMT-like seq2seq: src/tgt token inputs [batch, seq] -> logits [batch, seq, vocab].

    onnxruntime-training's gradient builder knows LSTM only after its pre-training rewrite (LSTM ->
    LSTMTraining); the executor applies that rewrite to stages holding LSTMs, so the training variant trains.
    """
    for key, value in {"layers": layers, "hidden": hidden, "seq": seq, "vocab": vocab, "batch": batch}.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")
    b = GraphBuilder("gnmt", seed, _FULL_SIZE_INIT if full_size else None)
    src = b.input("src", (batch, seq), TensorProto.INT64)
    tgt = b.input("tgt", (batch, seq), TensorProto.INT64)
    with b.scope("encoder"):
        table = b.weight("embedding", (vocab, hidden), fan_in=hidden)
        memory, finals = b.op("Gather", [table, b.op("Transpose", [src], name="time_major", perm=[1, 0])], name="embed"), []
        for i in range(layers):
            memory, final = _layer(b, memory, hidden, hidden, i)
            finals.append(final)
    with b.scope("decoder"):
        table = b.weight("embedding", (vocab, hidden), fan_in=hidden)
        top, _ = _layer(b, b.op("Gather", [table, b.op("Transpose", [tgt], name="time_major", perm=[1, 0])], name="embed"), hidden, hidden, 0, finals[0])
        context = _attend(b, top, memory)
        for i in range(1, layers):
            top, _ = _layer(b, top, hidden, hidden, i, finals[i], context)
    time_major = b.linear(b.op("Concat", [top, context], name="output_with_context", axis=-1), 2 * hidden, vocab, "projection")
    logits = b.op("Transpose", [time_major], name="logits", perm=[1, 0, 2])
    class_second = b.op("Transpose", [time_major], name="loss/logits_BVS", perm=[1, 2, 0]) if train else None
    b.classifier_outputs(logits, (batch, seq, vocab), train, (batch, seq), loss_logits=class_second)
    return b.model()
