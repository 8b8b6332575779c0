"""Forward FLOP formulas per ONNX op, and the op class each op belongs to.

Reading order: `op_class` -> `forward_flops` (dispatch) -> one function per op family
(`_conv`, `_conv_transpose`, `_matmul`, `_gemm`, `_einsum`, `_rnn`, `_pool`, per-element tables).

Convention: 2 FLOPs per multiply-add; a bias add is 1 FLOP per output element; scaling
factors (Gemm alpha/beta) are free. Per-element costs of the elementwise, norm and reduce
tables are nominal: 1 for arithmetic, 4 for a transcendental function, and the count of
such steps for composite ops (LayerNormalization: mean, subtract, square, variance sum,
rsqrt-multiply, scale, shift = 8; SoftmaxCrossEntropyLoss: log-softmax 5 + pick and mean 1).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import onnx
from onnx import helper

__all__ = ["MissingShape", "ShapeOf", "op_class", "forward_flops", "gemm_shape", "CONTROL_FLOW_OPS", "TWO_PASS_NORMS", "OPERANDS", "INTEGER_OPS"]

#: Looks up the concrete shape of a tensor; raises MissingShape when it is not known.
ShapeOf = Callable[[str], tuple[int, ...]]

CONTROL_FLOW_OPS = frozenset({"If", "Loop", "Scan"})
#: Normalizations whose training forward reads the input twice (statistics over the batch or a spatial
#: extent too large to keep in registers, then the normalization itself).
TWO_PASS_NORMS = frozenset({"BatchNormalization", "InstanceNormalization", "GroupNormalization"})

#: Input positions of (data, weight, bias) of each matmul and convolution op; None where it takes no bias
#: (ConvInteger's third input is a zero point, QLinearConv's operands sit between scales and zero points).
OPERANDS: dict[str, tuple[int, int, int | None]] = {
    "Conv": (0, 1, 2), "ConvTranspose": (0, 1, 2), "ConvInteger": (0, 1, None), "QLinearConv": (0, 3, 8),
    "MatMul": (0, 1, None), "MatMulInteger": (0, 1, None), "QLinearMatMul": (0, 3, None), "Gemm": (0, 1, 2),
}
#: Ops that compute on integer operands themselves (the operator form of a quantized model).
INTEGER_OPS = frozenset({"QLinearConv", "QLinearMatMul", "ConvInteger", "MatMulInteger"})

#: Domains whose op types the tables below describe.
_KNOWN_DOMAINS = frozenset({"", "ai.onnx", "com.microsoft"})


class MissingShape(Exception):
    """A formula needed the shape of a tensor that shape inference could not find."""


_TRANSCENDENTAL = 4

#: FLOPs per output element.
_ELEMENTWISE = {
    **dict.fromkeys(
        ("Add", "Sub", "Mul", "Div", "Neg", "Abs", "Relu", "Where", "Equal", "Greater", "GreaterOrEqual", "Less",
         "LessOrEqual", "Not", "And", "Or", "Xor", "Sign", "Floor", "Ceil", "Round", "Reciprocal", "Sqrt", "Mod",
         "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "BitwiseNot", "IsNaN", "IsInf", "ThresholdedRelu",
         "Dropout"),
        1,
    ),
    **dict.fromkeys(("Clip", "LeakyRelu", "PRelu", "HardSigmoid", "Shrink", "QuantizeLinear", "DequantizeLinear"), 2),
    "DynamicQuantizeLinear": 4,  # min and max for the scale, then scale, round, shift, saturate
    "HardSwish": 3,
    **dict.fromkeys(
        ("Exp", "Log", "Erf", "Tanh", "Sigmoid", "Pow", "Sin", "Cos", "Tan", "Asin", "Acos", "Atan", "Sinh", "Cosh",
         "Asinh", "Acosh", "Atanh", "Softplus", "Softsign", "Elu", "Selu", "Celu", "Mish", "Resize", "Upsample"),
        _TRANSCENDENTAL,
    ),
    "Gelu": 2 * _TRANSCENDENTAL,
    "FastGelu": 2 * _TRANSCENDENTAL,
    "BiasGelu": 2 * _TRANSCENDENTAL + 1,
}
#: Variadic elementwise ops: FLOPs per output element per input beyond the first (Mean adds a divide).
_VARIADIC = frozenset({"Sum", "Max", "Min", "Mean"})

#: FLOPs per element of the first input.
_NORM = {
    "BatchNormalization": 4,
    "InstanceNormalization": 8,
    "LayerNormalization": 8,
    "GroupNormalization": 8,
    "MeanVarianceNormalization": 8,
    "SimplifiedLayerNormalization": 6,
    "SkipLayerNormalization": 9,
    "LpNormalization": 3,
    "Softmax": 5,
    "LogSoftmax": 5,
    "SoftmaxCrossEntropyLoss": 6,
}
#: FLOPs per element of the first input.
_REDUCE = {
    **dict.fromkeys(("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceLogSum",
                     "ArgMax", "ArgMin", "CumSum", "TopK", "NegativeLogLikelihoodLoss"), 1),
    **dict.fromkeys(("ReduceL2", "ReduceSumSquare", "ReduceLogSumExp"), 2),
}
_DATA = frozenset({
    "Reshape", "Transpose", "Concat", "Split", "Slice", "Gather", "GatherElements", "GatherND", "Expand", "Squeeze",
    "Unsqueeze", "Flatten", "Identity", "Cast", "CastLike", "Shape", "Size", "Tile", "Pad", "DepthToSpace",
    "SpaceToDepth", "ConstantOfShape", "Range", "OneHot", "ScatterND", "ScatterElements", "Scatter", "Trilu",
    "ReverseSequence", "EyeLike", "Compress", "NonZero", "MaxUnpool", "Constant",
})
_POOL = frozenset({"MaxPool", "AveragePool", "LpPool", "GlobalAveragePool", "GlobalMaxPool", "GlobalLpPool"})
_RNN_GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
#: Elementwise FLOPs per hidden unit per step: gate activations plus the state update
#: (LSTM: 4 activations + f*c + i*g + add + tanh(c) + o*; GRU: 3 activations + r*(Rh) + 3 for the blend).
_RNN_CELL = {"LSTM": 9, "GRU": 7, "RNN": 1}


def op_class(op_type: str) -> str:
    """The op class (one of cost.OP_CLASSES) of an op type; "other" when none fits."""
    if op_type in ("MatMul", "Gemm", "Einsum", "MatMulInteger", "QLinearMatMul"):
        return "matmul"
    if op_type in ("Conv", "ConvTranspose", "ConvInteger", "QLinearConv"):
        return "conv"
    if op_type in _RNN_GATES:
        return "rnn"
    if op_type in _NORM or op_type == "LRN":
        return "norm"
    if op_type in _POOL:
        return "pool"
    if op_type in _REDUCE:
        return "reduce"
    if op_type in _ELEMENTWISE or op_type in _VARIADIC:
        return "elementwise"
    if op_type in _DATA:
        return "data"
    return "other"


def forward_flops(node: onnx.NodeProto, shape: ShapeOf) -> float | None:
    """Forward FLOPs of a node (control flow excluded), None when no formula covers the op."""
    if node.domain not in _KNOWN_DOMAINS:
        return None
    op = node.op_type
    family = _FAMILIES.get(op)
    if family is not None:
        return float(family(node, shape))
    if op in _ELEMENTWISE:
        return float(_ELEMENTWISE[op] * math.prod(shape(node.output[0])))
    if op in _VARIADIC:
        steps = max(1, len([i for i in node.input if i]) - 1) + (op == "Mean")
        return float(steps * math.prod(shape(node.output[0])))
    if op in _NORM:
        return float(_NORM[op] * math.prod(shape(node.input[0])))
    if op in _REDUCE:
        return float(_REDUCE[op] * math.prod(shape(node.input[0])))
    if op in _DATA:
        return 0.0
    return None


def _attrs(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _has_input(node: onnx.NodeProto, i: int | None) -> bool:
    return i is not None and len(node.input) > i and bool(node.input[i])


def _operand(node: onnx.NodeProto, which: int) -> str:
    """The data (0) or weight (1) input of a matmul or convolution."""
    return node.input[OPERANDS[node.op_type][which]]


def _conv(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """Each output element sums C_in/groups x kernel products; the output shape carries strides, pads, dilations."""
    out, weight = shape(node.output[0]), shape(_operand(node, 1))
    macs = math.prod(out) * math.prod(weight[1:])
    return 2 * macs + (math.prod(out) if _has_input(node, OPERANDS[node.op_type][2]) else 0)


def _conv_transpose(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """Each input element scatters onto C_out/groups x kernel outputs (weight: C_in x C_out/groups x kernel)."""
    x, weight, out = shape(node.input[0]), shape(node.input[1]), shape(node.output[0])
    macs = math.prod(x) * math.prod(weight[1:])
    return 2 * macs + (math.prod(out) if _has_input(node, 2) else 0)


def _matmul(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """Every output element (batch dims broadcast) is a K-long dot product."""
    return 2 * math.prod(shape(node.output[0])) * shape(_operand(node, 0))[-1]


def _gemm(node: onnx.NodeProto, shape: ShapeOf) -> float:
    a, out = shape(node.input[0]), shape(node.output[0])
    k = a[0] if _attrs(node).get("transA", 0) else a[1]
    return 2 * math.prod(out) * k + (math.prod(out) if _has_input(node, 2) else 0)


def _einsum(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """Product of every index size (ellipsis dims broadcast); 2(n-1) FLOPs per index tuple for n operands, 1 for one."""
    raw = _attrs(node)["equation"]
    equation = (raw.decode() if isinstance(raw, bytes) else str(raw)).replace(" ", "")
    terms = equation.split("->")[0].split(",")
    operands = [i for i in node.input if i]
    sizes: dict[str, int] = {}
    ellipsis: list[int] = []
    for term, name in zip(terms, operands):
        dims = list(shape(name))
        if "..." in term:
            head, tail = term.split("...")
            rank = len(dims) - len(head) - len(tail)
            _broadcast_into(ellipsis, dims[len(head):len(head) + rank])
            dims = dims[:len(head)] + dims[len(head) + rank:]
            term = head + tail
        for letter, size in zip(term, dims):
            sizes[letter] = max(sizes.get(letter, 1), size)
    tuples = math.prod(sizes.values()) * math.prod(ellipsis)
    return tuples * (2 * (len(operands) - 1) if len(operands) > 1 else 1)


def _broadcast_into(acc: list[int], dims: list[int]) -> None:
    """Numpy-broadcast `dims` into `acc` in place (right-aligned)."""
    while len(acc) < len(dims):
        acc.insert(0, 1)
    offset = len(acc) - len(dims)
    for i, d in enumerate(dims):
        acc[offset + i] = max(acc[offset + i], d)


def _rnn(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """Per step and direction: gate matmuls over [x, h], biases, and the cell's elementwise update."""
    x, w = shape(node.input[0]), shape(node.input[1])
    attrs = _attrs(node)
    seq, batch = (x[1], x[0]) if attrs.get("layout", 0) else (x[0], x[1])
    gates = _RNN_GATES[node.op_type]
    directions = w[0]
    hidden = int(attrs.get("hidden_size") or w[1] // gates)
    inputs = x[2]
    step = 2 * gates * hidden * (inputs + hidden) + _RNN_CELL[node.op_type] * hidden
    if _has_input(node, 3):
        step += 2 * gates * hidden
    return directions * seq * batch * step


def _pool(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """One compare/add per window element per output (LpPool: 2); global pools touch each input element once."""
    per = 2 if "Lp" in node.op_type else 1
    if node.op_type.startswith("Global"):
        return per * math.prod(shape(node.input[0]))
    kernel = _attrs(node)["kernel_shape"]
    return per * math.prod(shape(node.output[0])) * math.prod(kernel)  # type: ignore[arg-type]


def _lrn(node: onnx.NodeProto, shape: ShapeOf) -> float:
    """A window sum of squares (size) plus scale, power and divide per element."""
    return (int(_attrs(node)["size"]) + 3) * math.prod(shape(node.input[0]))  # type: ignore[call-overload]


_FAMILIES: dict[str, Callable[[onnx.NodeProto, ShapeOf], float]] = {
    "Conv": _conv,
    "ConvInteger": _conv,
    "QLinearConv": _conv,
    "ConvTranspose": _conv_transpose,
    "MatMul": _matmul,
    "MatMulInteger": _matmul,
    "QLinearMatMul": _matmul,
    "Gemm": _gemm,
    "Einsum": _einsum,
    "LSTM": _rnn,
    "GRU": _rnn,
    "RNN": _rnn,
    "LRN": _lrn,
    **dict.fromkeys(_POOL, _pool),
}


def gemm_shape(node: onnx.NodeProto, shape: ShapeOf) -> tuple[int, int, bool] | None:
    """(K, N, winograd) of the implicit GEMM a matmul or convolution runs as: the reduction length, the
    output columns, and whether it is a 3x3 stride-1 undilated ungrouped convolution. None for other ops
    and for depthwise convolutions (one input channel per group: memory-bound, no GEMM to speak of)."""
    if node.domain not in _KNOWN_DOMAINS:
        return None
    op = node.op_type
    if op in ("Conv", "ConvInteger", "QLinearConv", "ConvTranspose"):
        weight, attrs = shape(_operand(node, 1)), _attrs(node)
        groups = int(attrs.get("group", 1))  # type: ignore[call-overload]
        kernel = list(weight[2:])
        if op == "ConvTranspose":  # weight: C_in x C_out/groups x kernel
            per_group, n = weight[0] // groups, weight[1] * groups
        else:  # weight: C_out x C_in/groups x kernel; the groups run side by side
            per_group, n = weight[1], weight[0]
        if groups > 1 and per_group == 1:
            return None
        k = per_group * math.prod(kernel)
        unit = all(int(v) == 1 for v in list(attrs.get("strides", [])) + list(attrs.get("dilations", [])))  # type: ignore[call-overload]
        return k, n, op == "Conv" and groups == 1 and kernel == [3, 3] and unit
    if op in ("MatMul", "MatMulInteger", "QLinearMatMul"):
        out = shape(node.output[0])
        return shape(_operand(node, 0))[-1], (out[-1] if out else 1), False
    if op == "Gemm":
        a, out = shape(node.input[0]), shape(node.output[0])
        return (a[0] if _attrs(node).get("transA", 0) else a[1]), out[1], False
    return None
