"""Quantized patterns: which matmuls and convolutions run as int8 kernels, and which float tensors are int8
data a DequantizeLinear widened.

A quantized model comes in two spellings. The operator form computes on integers itself (QLinearConv,
QLinearMatMul, ConvInteger, MatMulInteger). The QDQ form (what `onnxruntime.quantization.quantize_static`
writes by default) keeps float Conv/MatMul/Gemm nodes and feeds them from DequantizeLinear nodes of int8
or uint8 data; runtimes fuse DequantizeLinear -> op -> QuantizeLinear into one int8 kernel. Either way the
kernel reads its operands as int8 and runs at the device's int8 rate.
"""

from __future__ import annotations

import onnx

from onnxpipe.cost_formulas import INTEGER_OPS, OPERANDS
from onnxpipe.graph import Graph
from onnxpipe.nodes import QUANTIZATION_OPS

__all__ = ["INT8_TYPES", "QDQ_OPS", "QUANTIZATION_OPS", "dequantized_source", "int8_operands", "is_quantized"]

#: Numpy dtype names of the data an int8 kernel reads.
INT8_TYPES = frozenset({"int8", "uint8"})
#: Float ops that a QDQ model feeds from DequantizeLinear on both data operands (inputs 0 and 1).
QDQ_OPS = frozenset({"Conv", "MatMul", "Gemm"})

_DOMAINS = frozenset({"", "ai.onnx"})


def is_quantized(model: onnx.ModelProto) -> bool:
    """Whether a model (its top-level graph) quantizes: runtimes fuse its Q/DQ patterns into int8 kernels that round
    differently from the same nodes run one by one, so only op-by-op runs of it and of its stages agree exactly."""
    return any(n.op_type in QUANTIZATION_OPS for n in model.graph.node)


def dequantized_source(graph: Graph, tensor: str) -> str | None:
    """The int8 or uint8 tensor a DequantizeLinear turned into `tensor`; None when `tensor` is not one."""
    producer = graph.producer(tensor)
    if producer is None:
        return None
    node = graph.node(producer)
    if node.op_type != "DequantizeLinear" or node.domain not in (*_DOMAINS, "com.microsoft") or not node.input:
        return None
    return node.input[0] if _dtype(graph, node.input[0]) in INT8_TYPES else None


def int8_operands(graph: Graph, node: onnx.NodeProto) -> dict[str, str]:
    """For a node that runs as an int8 kernel: each data operand -> the int8 tensor the kernel reads for it
    (itself for the integer ops, the DequantizeLinear's input in a QDQ pattern); empty for any other node."""
    if node.domain not in _DOMAINS:
        return {}
    if node.op_type in INTEGER_OPS:
        operands = [node.input[i] for i in OPERANDS[node.op_type][:2] if len(node.input) > i and node.input[i]]
        return {t: t for t in operands} if len(operands) == 2 and all(_dtype(graph, t) in INT8_TYPES for t in operands) else {}
    if node.op_type in QDQ_OPS and len(node.input) >= 2:
        sources = {t: dequantized_source(graph, t) for t in node.input[:2]}
        return {t: s for t, s in sources.items() if s} if all(sources.values()) else {}
    return {}


def _dtype(graph: Graph, tensor: str) -> str | None:
    info = graph.tensors.get(tensor)
    return info.dtype if info is not None else None
