"""Transformers: the GPT-2-style decoder (transformer-tiny, gpt2-tiny, gpt2) and the BERT-style
encoder (bert-tiny, bert), both with the output projection tied to the token embedding.

Reading order: `decoder` / `encoder` (public) -> `_Dims` -> `_embed` -> `_attention`, `_mlp`
-> `_tied_logits` -> `_finish`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["decoder", "encoder", "gpt2", "bert"]

#: Weight std of full-size models (GPT-2 and BERT both initialise with 0.02).
_FULL_SIZE_INIT = 0.02
#: Added to masked attention scores: exp() of it is exactly 0 in float32.
_MASKED = -1e9


@dataclass(frozen=True)
class _Dims:
    """The static sizes one transformer is built with."""

    batch: int
    seq: int
    d_model: int
    heads: int
    vocab: int
    layers: int
    #: Rows of the position table (>= seq): real models keep their full table whatever seq is.
    positions: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.heads


def _dims(layers: int, d_model: int, heads: int, seq: int, vocab: int, batch: int, positions: int) -> _Dims:
    for key, value in {"layers": layers, "d_model": d_model, "heads": heads, "seq": seq, "vocab": vocab, "batch": batch}.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")
    if d_model % heads:
        raise OnnxpipeError(f"knob d_model={d_model} must be a multiple of heads={heads}")
    return _Dims(batch, seq, d_model, heads, vocab, layers, max(positions, seq))


def _embed(b: GraphBuilder, d: _Dims) -> tuple[str, str]:
    """Token Gather plus learned position Gather (constant indices); returns (sum, embedding table)."""
    ids = b.input("input_ids", (d.batch, d.seq), TensorProto.INT64)
    with b.scope("embed"):
        table = b.weight("wte", (d.vocab, d.d_model), fan_in=d.d_model)
        tokens = b.op("Gather", [table, ids], name="tokens")
        pos_table = b.weight("wpe", (d.positions, d.d_model), fan_in=d.d_model)
        pos = b.op("Gather", [pos_table, b.const(np.arange(d.seq), "position_ids")], name="positions")
        return b.op("Add", [tokens, pos]), table


def _causal_mask(b: GraphBuilder, seq: int) -> str:
    """[seq, seq] with _MASKED above the diagonal, computed from constants only (ConstantOfShape,
    Trilu) so it is neither a graph input nor a weight."""
    with b.scope("causal_mask"):
        fill = helper.make_tensor("value", TensorProto.FLOAT, [1], [_MASKED])
        full = b.op("ConstantOfShape", [b.const([seq, seq])], value=fill)
        return b.op("Trilu", [full, b.const(np.int64(1))], upper=1)


def _heads(b: GraphBuilder, x: str, d: _Dims, perm: list[int], name: str) -> str:
    """[B, S, D] -> [B, S, H, Dh] -> permuted per `perm` (heads before sequence)."""
    split = b.op("Reshape", [x, b.const([d.batch, d.seq, d.heads, d.head_dim])], name=f"{name}_split")
    return b.op("Transpose", [split], name=f"{name}_heads", perm=perm)


def _attention(b: GraphBuilder, x: str, d: _Dims, mask: str | None) -> str:
    """Multi-head self-attention with MatMul/Softmax; `mask` (if any) is added to the scores."""
    with b.scope("attn"):
        q = _heads(b, b.linear(x, d.d_model, d.d_model, "q"), d, [0, 2, 1, 3], "q")
        k = _heads(b, b.linear(x, d.d_model, d.d_model, "k"), d, [0, 2, 3, 1], "k")
        v = _heads(b, b.linear(x, d.d_model, d.d_model, "v"), d, [0, 2, 1, 3], "v")
        scores = b.op("Mul", [b.op("MatMul", [q, k], name="scores"), b.const(np.float32(1.0 / math.sqrt(d.head_dim)))])
        if mask is not None:
            scores = b.op("Add", [scores, mask], name="mask")
        probs = b.op("Softmax", [scores], axis=-1)
        context = b.op("Transpose", [b.op("MatMul", [probs, v], name="context")], perm=[0, 2, 1, 3])
        merged = b.op("Reshape", [context, b.const([d.batch, d.seq, d.d_model])], name="merge")
        return b.linear(merged, d.d_model, d.d_model, "proj")


def _mlp(b: GraphBuilder, x: str, d: _Dims) -> str:
    """Linear(4D) -> GELU -> Linear(D)."""
    with b.scope("mlp"):
        hidden = b.gelu(b.linear(x, d.d_model, 4 * d.d_model, "fc"))
        return b.linear(hidden, 4 * d.d_model, d.d_model, "proj")


def _tied_logits(b: GraphBuilder, h: str, table: str, d: _Dims) -> str:
    """logits = h @ wte^T, reading the same initializer as the token Gather."""
    with b.scope("lm_head"):
        return b.op("MatMul", [h, b.op("Transpose", [table], name="wte_T", perm=[1, 0])], name="logits")


def _finish(b: GraphBuilder, logits: str, d: _Dims, train: bool) -> onnx.ModelProto:
    """Outputs: logits [B, S, V]; with `train` a mean token cross-entropy against labels [B, S] first."""
    class_second = b.op("Transpose", [logits], name="loss/logits_BVS", perm=[0, 2, 1]) if train else None
    b.classifier_outputs(logits, (d.batch, d.seq, d.vocab), train, (d.batch, d.seq), loss_logits=class_second)
    return b.model()


def _decoder(d: _Dims, name: str, train: bool, seed: int, init_scale: float | None) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, init_scale)
    h, table = _embed(b, d)
    mask = _causal_mask(b, d.seq)
    for i in range(d.layers):
        with b.scope(f"h{i}"):
            h = b.op("Add", [h, _attention(b, b.layer_norm(h, d.d_model, "ln_1"), d, mask)], name="residual_attn")
            h = b.op("Add", [h, _mlp(b, b.layer_norm(h, d.d_model, "ln_2"), d)], name="residual_mlp")
    h = b.layer_norm(h, d.d_model, "ln_f")
    return _finish(b, _tied_logits(b, h, table, d), d, train)


def _padding_mask(b: GraphBuilder, d: _Dims) -> str:
    """[B, 1, 1, S] additive mask from an `attention_mask` input [B, S] of ones (attend) and zeros (padding), as
    transformers' encoders build it: Cast, 1 - m, times the masked score, Reshape. It depends on the input alone."""
    keep = b.input("attention_mask", (d.batch, d.seq), TensorProto.INT64)
    with b.scope("padding_mask"):
        dropped = b.op("Sub", [b.const(np.float32(1.0)), b.op("Cast", [keep], to=TensorProto.FLOAT)])
        scaled = b.op("Mul", [dropped, b.const(np.float32(_MASKED))])
        return b.op("Reshape", [scaled, b.const([d.batch, 1, 1, d.seq])])


def _encoder(d: _Dims, name: str, train: bool, seed: int, init_scale: float | None, padding_mask: bool = False) -> onnx.ModelProto:
    b = GraphBuilder(name, seed, init_scale)
    h, table = _embed(b, d)
    mask = _padding_mask(b, d) if padding_mask else None
    h = b.layer_norm(h, d.d_model, "embed_ln")
    for i in range(d.layers):
        with b.scope(f"layer{i}"):
            h = b.layer_norm(b.op("Add", [h, _attention(b, h, d, mask)], name="residual_attn"), d.d_model, "ln_attn")
            h = b.layer_norm(b.op("Add", [h, _mlp(b, h, d)], name="residual_mlp"), d.d_model, "ln_mlp")
    with b.scope("mlm"):
        h = b.layer_norm(b.gelu(b.linear(h, d.d_model, d.d_model, "transform")), d.d_model, "ln")
    logits = b.op("Add", [_tied_logits(b, h, table, d), b.fill("mlm/bias", (d.vocab,), 0.0)], name="mlm/bias_add")
    return _finish(b, logits, d, train)


def decoder(*, layers: int, d_model: int, heads: int, seq: int, vocab: int, batch: int, train: bool, seed: int) -> onnx.ModelProto:
    """A GPT-2-style pre-LayerNorm decoder with a constant causal mask and a tied output embedding."""
    return _decoder(_dims(layers, d_model, heads, seq, vocab, batch, seq), "decoder", train, seed, None)


def encoder(*, layers: int, d_model: int, heads: int, seq: int, vocab: int, batch: int, padding_mask: bool, train: bool, seed: int
            ) -> onnx.ModelProto:
    """A BERT-style post-LayerNorm encoder with a tied masked-LM head over every position; with `padding_mask`, an
    `attention_mask` input masks the padded positions in every layer."""
    return _encoder(_dims(layers, d_model, heads, seq, vocab, batch, seq), "encoder", train, seed, None, padding_mask)


def gpt2(*, layers: int, d_model: int, heads: int, seq: int, vocab: int, batch: int, train: bool, seed: int) -> onnx.ModelProto:
    """GPT-2 small sizes by default (124 M parameters, 1024-row position table), weights N(0, 0.02)."""
    return _decoder(_dims(layers, d_model, heads, seq, vocab, batch, 1024), "gpt2", train, seed, _FULL_SIZE_INIT)


def bert(*, layers: int, d_model: int, heads: int, seq: int, vocab: int, batch: int, train: bool, seed: int) -> onnx.ModelProto:
    """BERT-base sizes by default (~110 M parameters, 512-row position table), weights N(0, 0.02)."""
    return _encoder(_dims(layers, d_model, heads, seq, vocab, batch, 512), "bert", train, seed, _FULL_SIZE_INIT)
