"""Per-node rewrites: one op onnxruntime-training 1.19.2 cannot differentiate on the CPU, written as ops it can.

`onnxpipe.rewrites` runs them (`PER_NODE`, in order) on a copy of a stage model before its gradient graph is built;
stage files keep the user's ops. The normalizations compute the same formula with other kernels (equal within float
rounding); the others move or sum the same elements. Nodes they write are named `<node>/onnxpipe_<rewrite>/...`
(`REWRITE_MARK`), which the profiler maps back to `<node>`.

- InstanceNormalization (torch's GroupNorm and InstanceNorm export as it, by either exporter) -> ReduceMean, Sub,
  Mul, Add, Sqrt, Div and the per-channel scale and bias: onnxruntime-training 1.19.2 has no gradient for it.
- Resize (nearest, linear, cubic; the last two axes) -> MatMul by constant interpolation matrices (nearest at an integer
  scale, each element repeated: Reshape, Expand, Reshape), and ConvTranspose
  (one or two spatial axes) -> MatMul by constant matrices that space and pad the input, then Conv with the weight
  transposed and flipped: onnxruntime-training 1.19.2 builds gradients for both but has CPU kernels for neither
  (ResizeGrad and ConvTransposeGrad exist for CUDA only), so a UNet's upsampling could not train. A Resize is linear
  in its input and acts on each axis alone, so its matrix per axis is onnxruntime's own Resize of an identity
  matrix, with the node's attributes: every mode and rounding rule as onnxruntime computes it. Static shapes only
  (stage files have them).
- A grouped Conv (group > 1) over one spatial axis -> the same Conv over [N, C, 1, L]; over three -> a Conv per group,
  concatenated: onnxruntime-training 1.19.2's CPU ConvGrad writes such a conv's input gradient past its buffer (the 2-D
  path is right), which silently corrupted the neighbouring gradient (wav2vec2's and Conformer's grouped Conv1d).
- Slice with a negative step (torch.flip) -> Gather of the positions it takes: onnxruntime-training 1.19.2's SliceGrad
  fails at run time on it. Pad in reflect, edge or wrap mode (F.pad's reflect, replicate, circular) -> Concat of Gathers
  of the positions it copies: only constant mode has a gradient.
- Einsum of one or two operands -> Transpose, ReduceSum, Reshape and MatMul (`onnxpipe.einsum`): onnxruntime-training
  1.19.2 has no Einsum gradient, and both torch exporters keep `torch.einsum` as Einsum.
- DepthToSpace and SpaceToDepth (PixelShuffle) -> Reshape, Transpose, Reshape, as the spec defines them; ReduceMax,
  ReduceMin and GlobalMaxPool -> TopK(k=1) over the reduced axes: onnxruntime-training 1.19.2 has no gradient for
  any of them (static shapes). Sum and Mean of several tensors -> Adds; CumSum -> MatMul by a
  triangular matrix along its axis; ReduceProd -> Muls of halves (none has a gradient there either).
- GRU and RNN (static sequence length) -> their steps unrolled (`onnxpipe.recurrent`): onnxruntime-training 1.19.2
  has no gradient for either; so are reverse and bidirectional LSTMs, whose LSTMGrad it refuses.
- LayerNormalization of float16 or bfloat16 at opset >= 18 -> Cast to float32, LayerNormalization, Cast back:
  onnxruntime's CPU gradient kernel is float32-only, and the function body it falls back to for other types reads
  ReduceMean's axes as an attribute, which opset 18 removed, so the session fails to load. The output differs from
  the float16 kernel's by float16 rounding (a unit in the last place).

Reading order: `PER_NODE` (at the end) -> `_instance_norm` -> `_resize` -> `_conv_transpose` -> `_grouped_conv` -> `_negative_slice`
-> `_padded_by_copies` -> `_einsum` -> `_depth_to_space`
-> `_reduce_extreme` -> `_reduce_prod` -> `_sum_mean` -> `_cumsum` -> `_recurrent` -> `_float32_layer_norm`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxpipe.einsum import lowered
from onnxpipe.gradprobe import FLOAT_TYPES
from onnxpipe.nodebuilder import NodeBuilder
from onnxpipe.ortutil import cpu_session
from onnxpipe.recurrent import UNROLLED_OPS, unrolled

__all__ = ["REWRITE_MARK", "NodeRewrite", "PER_NODE", "node_base", "tensor_dims"]


#: What the nodes a rewrite writes in place of a node are named under: `<node>/onnxpipe_<rewrite>/...`, which the
#: profiler maps back to `<node>` (`cost_profile.own_names`).
REWRITE_MARK = "/onnxpipe_"


#: A rewrite of one node: (node, the model's types, its opset, the graph its constants go into, the graph's small
#: constants' values) -> (pattern, the nodes computing the node's outputs), or None where the node is left as it is.
NodeRewrite = Callable[[onnx.NodeProto, Mapping[str, onnx.TypeProto], int, onnx.GraphProto, Mapping[str, np.ndarray]],
                       "tuple[str, list[onnx.NodeProto]] | None"]


def tensor_dims(types: Mapping[str, onnx.TypeProto], tensor: str) -> tuple | None:
    """A tensor's dims (int, or the dim's name), None where its rank or any dim is unknown."""
    found = types.get(tensor)
    if found is None or not found.tensor_type.HasField("shape"):
        return None
    dims = tuple(d.dim_value if d.HasField("dim_value") else d.dim_param or None for d in found.tensor_type.shape.dim)
    return None if None in dims else dims


def _float_input(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto]) -> np.dtype | None:
    """The numpy dtype of the node's first input where it is a float type gradients flow through."""
    found = types.get(node.input[0])
    if found is None or found.tensor_type.elem_type not in FLOAT_TYPES:
        return None
    return helper.tensor_dtype_to_np_dtype(found.tensor_type.elem_type)


def _static_shape(types: Mapping[str, onnx.TypeProto], tensor: str) -> tuple[int, ...] | None:
    dims = tensor_dims(types, tensor)
    return dims if dims is not None and all(isinstance(d, int) for d in dims) else None


def _attributes(node: onnx.NodeProto) -> dict[str, object]:
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def _read(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], *tensors: str) -> tuple[dict[str, object], np.dtype | None, list]:
    """What a rewrite of the node reads first: its attributes, its first input's float dtype, the tensors' static shapes."""
    return _attributes(node), _float_input(node, types), [_static_shape(types, t) for t in tensors]


def node_base(node: onnx.NodeProto, rewrite: str) -> str:
    return f"{node.name or node.output[0]}{REWRITE_MARK}{rewrite}"


def _reduce_mean(opset: int, graph: onnx.GraphProto, x: str, axes: list[int], out: str) -> onnx.NodeProto:
    """ReduceMean over `axes`, keeping them: axes as an input from opset 18, as an attribute before."""
    if opset < 18:
        return helper.make_node("ReduceMean", [x], [out], name=out, axes=axes, keepdims=1)
    graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), f"{out}/axes"))
    return helper.make_node("ReduceMean", [x, f"{out}/axes"], [out], name=out, keepdims=1)


def _instance_norm(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                   consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    dtype, shape = _float_input(node, types), tensor_dims(types, node.input[0])
    if dtype is None or shape is None:
        return None
    rank = len(shape)
    eps = _attributes(node).get("epsilon", 1e-5)
    x, scale, bias = node.input[:3]
    b = node_base(node, "norm")
    graph.initializer.extend([numpy_helper.from_array(np.array(eps, dtype), f"{b}/eps"),
                              numpy_helper.from_array(np.array([-1] + [1] * (rank - 2), np.int64), f"{b}/channels")])
    axes = list(range(2, rank))
    return "InstanceNormalization -> ReduceMean, Sub, Mul, Sqrt, Div", [
        _reduce_mean(opset, graph, x, axes, f"{b}/mean"),
        helper.make_node("Sub", [x, f"{b}/mean"], [f"{b}/centred"], name=f"{b}/centred"),
        helper.make_node("Mul", [f"{b}/centred", f"{b}/centred"], [f"{b}/square"], name=f"{b}/square"),
        _reduce_mean(opset, graph, f"{b}/square", axes, f"{b}/var"),
        helper.make_node("Add", [f"{b}/var", f"{b}/eps"], [f"{b}/var_eps"], name=f"{b}/var_eps"),
        helper.make_node("Sqrt", [f"{b}/var_eps"], [f"{b}/std"], name=f"{b}/std"),
        helper.make_node("Div", [f"{b}/centred", f"{b}/std"], [f"{b}/normed"], name=f"{b}/normed"),
        helper.make_node("Reshape", [scale, f"{b}/channels"], [f"{b}/scale"], name=f"{b}/scale"),
        helper.make_node("Reshape", [bias, f"{b}/channels"], [f"{b}/bias"], name=f"{b}/bias"),
        helper.make_node("Mul", [f"{b}/normed", f"{b}/scale"], [f"{b}/scaled"], name=f"{b}/scaled"),
        helper.make_node("Add", [f"{b}/scaled", f"{b}/bias"], [node.output[0]], name=node.name or f"{b}/out"),
    ]


def _axis_matmuls(graph: onnx.GraphProto, x: str, matrices: Mapping[int, np.ndarray], rank: int, base: str, out: str, dtype: np.dtype) -> list[onnx.NodeProto]:
    """x times `matrices[axis]` ([new length, old length]) along the last axis and the one before it: the last axis
    as x @ M.T, the one before as M @ x (MatMul broadcasts M over the leading axes)."""
    nodes, current = [], x
    steps = sorted(matrices.items(), reverse=True)
    for k, (axis, m) in enumerate(steps):
        name = out if k == len(steps) - 1 else f"{base}/along{axis}"
        if axis == rank - 1:
            graph.initializer.append(numpy_helper.from_array(np.ascontiguousarray(m.T).astype(dtype), f"{base}/matrix{axis}"))
            nodes.append(helper.make_node("MatMul", [current, f"{base}/matrix{axis}"], [name], name=name))
        else:
            graph.initializer.append(numpy_helper.from_array(m.astype(dtype), f"{base}/matrix{axis}"))
            nodes.append(helper.make_node("MatMul", [f"{base}/matrix{axis}", current], [name], name=name))
        current = name
    return nodes


def _resize_matrix(node: onnx.NodeProto, opset: int, length: int, scale: float | None, new: int) -> np.ndarray | None:
    """The [new, length] matrix one axis of the Resize applies (read-only, shared between calls)."""
    attrs = tuple(a.SerializeToString() for a in node.attribute if a.name not in ("axes", "keep_aspect_ratio_policy"))
    return _basis_resized(attrs, opset, length, scale, new)


@functools.lru_cache(maxsize=256)
def _basis_resized(attrs: tuple[bytes, ...], opset: int, length: int, scale: float | None, new: int) -> np.ndarray | None:
    """onnxruntime's Resize of the identity (axis 0 holds the basis vectors at scale 1, axis 1 is resized), transposed.
    Cached: the trainer, the gradient check and the profiler rewrite the same stages, each asking once per axis."""
    scales = np.array([1.0, scale], np.float32) if scale is not None else np.zeros(0, np.float32)
    inits = [numpy_helper.from_array(scales, "scales")]
    if scale is None:
        inits.append(numpy_helper.from_array(np.array([length, new], np.int64), "sizes"))
    resize = helper.make_node("Resize", ["x", "", "scales" if scale is not None else "", "sizes" if scale is None else ""], ["y"])
    for raw in attrs:
        resize.attribute.add().ParseFromString(raw)
    graph = helper.make_graph([resize], "basis", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [length, length])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    try:
        y = cpu_session(model.SerializeToString(), optimize=False).run(["y"], {"x": np.eye(length, dtype=np.float32)})[0]
    except Exception:  # an attribute this shape of input cannot take: the node is left alone
        return None
    if y.shape != (length, new):
        return None
    matrix = np.ascontiguousarray(y.T)
    matrix.flags.writeable = False
    return matrix


def _resize(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
            consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    attrs, dtype, (x_shape, y_shape) = _read(node, types, node.input[0], node.output[0])
    if (dtype is None or x_shape is None or y_shape is None or opset < 11 or len(x_shape) < 2
            or attrs.get("coordinate_transformation_mode") == b"tf_crop_and_resize" or "axes" in attrs):
        return None
    scales_name = node.input[2] if len(node.input) > 2 else ""
    scales = consts.get(scales_name) if scales_name else None
    if scales_name and (scales is None or scales.size not in (0, len(x_shape))):
        return None
    if scales is not None and not scales.size:
        scales = None
    rank = len(x_shape)
    changed = [a for a in range(rank) if x_shape[a] != y_shape[a] or (scales is not None and scales[a] != 1)]
    if any(a < rank - 2 for a in changed):
        return None
    if not changed:  # every scale 1: each mode reads each element where it is
        return "Resize at scale 1 -> Identity", [helper.make_node("Identity", [node.input[0]], [node.output[0]], name=node.name or node_base(node, "identity"))]
    matrices = {a: _resize_matrix(node, opset, x_shape[a], None if scales is None else float(scales[a]), y_shape[a]) for a in changed}
    if any(m is None for m in matrices.values()):
        return None
    if all(_repeats(m) for m in matrices.values()):  # nearest at an integer scale: each element repeated, no MatMul needed
        return "Resize -> Expand of each element", _repeated(graph, node, x_shape, y_shape, node_base(node, "resize"))
    return "Resize -> MatMul by interpolation matrices", _axis_matmuls(graph, node.input[0], matrices, rank, node_base(node, "resize"), node.output[0], dtype)  # type: ignore[arg-type]


def _repeats(matrix: np.ndarray) -> bool:
    """Whether the [new, old] matrix repeats each element `new / old` times in place (nearest upsampling by an integer)."""
    new, old = matrix.shape
    return new % old == 0 and np.array_equal(matrix, np.kron(np.eye(old, dtype=matrix.dtype), np.ones((new // old, 1), matrix.dtype)))


def _repeated(graph: onnx.GraphProto, node: onnx.NodeProto, x_shape: tuple[int, ...], y_shape: tuple[int, ...], b: str) -> list[onnx.NodeProto]:
    """Each element repeated along the last two axes: x [..., H, W] -> [..., H, 1, W, 1] -> Expand -> Reshape (Expand's
    gradient sums the repeats back)."""
    lead, (h, w), (nh, nw) = list(x_shape[:-2]), x_shape[-2:], y_shape[-2:]
    graph.initializer.extend([numpy_helper.from_array(np.array([*lead, h, 1, w, 1], np.int64), f"{b}/split"),
                              numpy_helper.from_array(np.array([*lead, h, nh // h, w, nw // w], np.int64), f"{b}/repeated"),
                              numpy_helper.from_array(np.array(y_shape, np.int64), f"{b}/out")])
    return [helper.make_node("Reshape", [node.input[0], f"{b}/split"], [f"{b}/cells"], name=f"{b}/cells"),
            helper.make_node("Expand", [f"{b}/cells", f"{b}/repeated"], [f"{b}/filled"], name=f"{b}/filled"),
            helper.make_node("Reshape", [f"{b}/filled", f"{b}/out"], [node.output[0]], name=node.name or f"{b}/joined")]


def _spacing(length: int, stride: int, dilation: int, kernel: int, pad_begin: int, pad_end: int, extra: int) -> np.ndarray:
    """[padded, length]: puts input element j at `before + j * stride` of a zero line that a stride-1 Conv of the
    flipped kernel turns into ConvTranspose's output (a negative `before` or `after` crops: those positions feed
    no output)."""
    before, after = dilation * (kernel - 1) - pad_begin, dilation * (kernel - 1) - pad_end + extra
    padded = (length - 1) * stride + 1 + before + after
    spread = np.zeros((padded, length), np.float32)
    for j in range(length):
        if 0 <= before + j * stride < padded:
            spread[before + j * stride, j] = 1
    return spread


def _conv_transpose(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                    consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    attrs, dtype, (x_shape, w_shape) = _read(node, types, node.input[0], node.input[1])
    if (dtype is None or x_shape is None or w_shape is None or len(x_shape) not in (3, 4) or "output_shape" in attrs
            or attrs.get("auto_pad", b"NOTSET") not in (b"NOTSET", b"VALID")):
        return None
    spatial = len(x_shape) - 2
    kernel = list(w_shape[2:])
    strides, dilations = list(attrs.get("strides", [1] * spatial)), list(attrs.get("dilations", [1] * spatial))  # type: ignore[call-overload]
    pads, extra = list(attrs.get("pads", [0] * 2 * spatial)), list(attrs.get("output_padding", [0] * spatial))  # type: ignore[call-overload]
    group = int(attrs.get("group", 1))  # type: ignore[call-overload]
    matrices = {2 + i: _spacing(x_shape[2 + i], strides[i], dilations[i], kernel[i], pads[i], pads[spatial + i], extra[i]) for i in range(spatial)}
    base = node_base(node, "convt")
    cin, cout_g = w_shape[0], w_shape[1]
    graph.initializer.extend([
        numpy_helper.from_array(np.array([group, cin // group, cout_g, *kernel], np.int64), f"{base}/grouped"),
        numpy_helper.from_array(np.array([cout_g * group, cin // group, *kernel], np.int64), f"{base}/conv_shape"),
        *(numpy_helper.from_array(np.arange(k - 1, -1, -1, dtype=np.int64), f"{base}/reversed{i}") for i, k in enumerate(kernel)),
    ])
    new = _axis_matmuls(graph, node.input[0], matrices, len(x_shape), base, f"{base}/spread", dtype)
    new += [helper.make_node("Reshape", [node.input[1], f"{base}/grouped"], [f"{base}/w_grouped"], name=f"{base}/w_grouped"),
            helper.make_node("Transpose", [f"{base}/w_grouped"], [f"{base}/w_swapped"], name=f"{base}/w_swapped", perm=[0, 2, 1, *range(3, 3 + spatial)]),
            helper.make_node("Reshape", [f"{base}/w_swapped", f"{base}/conv_shape"], [f"{base}/w_flip0"], name=f"{base}/w_flip0")]
    for i in range(spatial):  # flip each kernel axis (Gather has a CPU gradient)
        new.append(helper.make_node("Gather", [f"{base}/w_flip{i}", f"{base}/reversed{i}"], [f"{base}/w_flip{i + 1}"], name=f"{base}/w_flip{i + 1}", axis=2 + i))
    conv_inputs = [f"{base}/spread", f"{base}/w_flip{spatial}"] + ([node.input[2]] if len(node.input) > 2 and node.input[2] else [])
    new.append(helper.make_node("Conv", conv_inputs, [node.output[0]], name=node.name or f"{base}/conv",
                                kernel_shape=kernel, dilations=dilations, group=group, strides=[1] * spatial, pads=[0] * 2 * spatial))
    return "ConvTranspose -> MatMul by spacing matrices, Conv", new


def _grouped_conv(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                  consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """A grouped Conv over one spatial axis as the same Conv over [N, C, 1, L]; over three, one Conv per group,
    concatenated: onnxruntime-training 1.19.2's CPU ConvGrad, for a group > 1 and a kernel rank other than 2, writes
    the input gradient of each group over all C channels' room (C / group in the 2-D path), past its buffer, into
    whatever the memory plan put after it (a weight gradient came out zeros)."""
    attrs, dtype, (w_shape,) = _read(node, types, node.input[1])
    group = int(attrs.get("group", 1))  # type: ignore[call-overload]
    if group <= 1 or dtype is None or w_shape is None or len(w_shape) not in (3, 5):
        return None
    b = NodeBuilder(graph, node_base(node, "conv"), opset)
    if len(w_shape) == 3:
        wide = {**attrs, **{k: [1, *attrs[k]] for k in ("kernel_shape", "strides", "dilations") if k in attrs}}  # type: ignore[list-item]
        if "pads" in attrs:
            begin, end = attrs["pads"]  # type: ignore[misc]
            wide["pads"] = [0, begin, 0, end]
        inputs = [b.unsqueeze(node.input[0], 2), b.unsqueeze(node.input[1], 2), *node.input[2:]]
        b.squeeze(b.op("Conv", inputs, **wide), 2, node.output[0])
        return "grouped Conv over one axis -> Conv over two", b.nodes
    channels = _static_shape(types, node.input[0])
    if channels is None:
        return None
    xs = b.split(node.input[0], [channels[1] // group] * group, 1)
    ws = b.split(node.input[1], [w_shape[0] // group] * group, 0)
    biases = b.split(node.input[2], [w_shape[0] // group] * group, 0) if len(node.input) > 2 and node.input[2] else [None] * group
    one = {**attrs, "group": 1}
    b.op("Concat", [b.op("Conv", [x, w, *([bias] if bias else [])], **one) for x, w, bias in zip(xs, ws, biases)], node.output[0], axis=1)
    return "grouped Conv over three axes -> a Conv per group", b.nodes


def _slice_indices(dim: int, start: int, end: int, step: int) -> list[int]:
    """The positions ONNX's Slice takes along an axis of length `dim` (negatives counted from the end, then clamped)."""
    start, end = start + dim if start < 0 else start, end + dim if end < 0 else end
    if step > 0:
        return list(range(min(max(start, 0), dim), min(max(end, 0), dim), step))
    return list(range(min(max(start, 0), dim - 1), min(max(end, -1), dim - 1), step))


def _negative_slice(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                    consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """A Slice with a negative step (torch.flip) as a Gather of the positions it takes along each sliced axis:
    onnxruntime-training 1.19.2's SliceGrad, built and loaded, fails at run time ("narrowing_error"; seen with the
    negative step on the last axis, the rest not mapped out, so every negative step is written so)."""
    _, dtype, (shape,) = _read(node, types, node.input[0])
    if opset < 10 or dtype is None or shape is None or len(node.input) < 5 or not node.input[4]:
        return None
    found = [consts.get(name) if name else None for name in node.input[1:5]]
    if any(v is None for v in found) or not (found[3] < 0).any():  # type: ignore[operator]
        return None
    starts, ends, axes, steps = (np.atleast_1d(v).astype(np.int64).tolist() for v in found)  # type: ignore[union-attr]
    b = NodeBuilder(graph, node_base(node, "gather"), opset)
    current = node.input[0]
    for k, (axis, start, end, step) in enumerate(zip(axes, starts, ends, steps)):
        axis %= len(shape)
        out = node.output[0] if k == len(axes) - 1 else None
        current = b.op("Gather", [current, b.ints(_slice_indices(shape[axis], start, end, step))], out, axis=axis)
    return "Slice with a negative step -> Gather", b.nodes


#: Pad's modes other than constant -> the positions (of an axis of length n) the p elements before and after it repeat.
_PAD_SOURCES: dict[bytes, Callable[[int, int, int], tuple[list[int], list[int]]]] = {
    b"reflect": lambda n, before, after: (list(range(before, 0, -1)), list(range(n - 2, n - 2 - after, -1))),
    b"edge": lambda n, before, after: ([0] * before, [n - 1] * after),
    b"wrap": lambda n, before, after: (list(range(n - before, n)), list(range(after))),
}


def _padded_by_copies(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                      consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """Pad in reflect, edge or wrap mode as a Concat, along each padded axis, of Gathers of the elements it repeats and
    the input: onnxruntime-training 1.19.2 differentiates Pad in constant mode only (F.pad(mode="reflect"), and
    "replicate", which exports as edge)."""
    attrs, dtype, (shape,) = _read(node, types, node.input[0])
    mode = attrs.get("mode", b"constant")
    pads = consts.get(node.input[1]) if opset >= 11 and len(node.input) > 1 else np.array(attrs.get("pads", []))
    if dtype is None or shape is None or mode not in _PAD_SOURCES or pads is None or (pads < 0).any():
        return None
    rank = len(shape)
    axes = list(range(rank))
    if len(node.input) > 3 and node.input[3]:
        given = consts.get(node.input[3])
        if given is None:
            return None
        axes = [int(a) % rank for a in np.atleast_1d(given)]
    if len(pads) != 2 * len(axes):
        return None
    b = NodeBuilder(graph, node_base(node, "pad"), opset)
    current, lengths = node.input[0], list(shape)
    padded = [(axis, int(pads[i]), int(pads[len(axes) + i])) for i, axis in enumerate(axes) if pads[i] or pads[len(axes) + i]]
    if any(mode == b"reflect" and max(before, after) >= lengths[axis] for axis, before, after in padded):
        return None  # reflecting needs more elements than the axis has
    for k, (axis, before, after) in enumerate(padded):
        left, right = _PAD_SOURCES[mode](lengths[axis], before, after)
        parts = [b.op("Gather", [current, b.ints(left)], axis=axis)] if left else []
        parts += [current] + ([b.op("Gather", [current, b.ints(right)], axis=axis)] if right else [])
        current = b.op("Concat", parts, node.output[0] if k == len(padded) - 1 else None, axis=axis)
        lengths[axis] += before + after
    if not padded:
        b.op("Identity", [current], node.output[0])
    return f"Pad in {mode.decode()} mode -> Concat of Gathers", b.nodes  # type: ignore[union-attr]


def _einsum(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
            consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    if _float_input(node, types) is None:
        return None
    new = lowered(node, graph, [_static_shape(types, name) for name in node.input], opset, node_base(node, "einsum"))
    return None if new is None else ("Einsum -> Transpose, ReduceSum, Reshape, MatMul", new)


def _depth_to_space(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                    consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """DepthToSpace and SpaceToDepth as the spec defines them: Reshape, Transpose, Reshape (PixelShuffle's export)."""
    shape, out = _static_shape(types, node.input[0]), _static_shape(types, node.output[0])
    if _float_input(node, types) is None or shape is None or out is None or len(shape) != 4:
        return None
    attrs = _attributes(node)
    k = int(attrs["blocksize"])  # type: ignore[call-overload]
    n, c, h, w = shape
    if node.op_type == "DepthToSpace":
        crd = attrs.get("mode", b"DCR") == b"CRD"
        split, perm = ([n, c // (k * k), k, k, h, w], [0, 1, 4, 2, 5, 3]) if crd else ([n, k, k, c // (k * k), h, w], [0, 3, 4, 1, 5, 2])
    else:
        split, perm = [n, c, h // k, k, w // k, k], [0, 3, 5, 1, 2, 4]
    b = node_base(node, "space")
    graph.initializer.extend([numpy_helper.from_array(np.array(split, np.int64), f"{b}/split"), numpy_helper.from_array(np.array(out, np.int64), f"{b}/out")])
    return f"{node.op_type} -> Reshape, Transpose, Reshape", [
        helper.make_node("Reshape", [node.input[0], f"{b}/split"], [f"{b}/blocks"], name=f"{b}/blocks"),
        helper.make_node("Transpose", [f"{b}/blocks"], [f"{b}/moved"], name=f"{b}/moved", perm=perm),
        helper.make_node("Reshape", [f"{b}/moved", f"{b}/out"], [node.output[0]], name=node.name or f"{b}/joined")]


def _reduced_axes(node: onnx.NodeProto, attrs: Mapping[str, object], opset: int, consts: Mapping[str, np.ndarray], rank: int) -> list[int] | None:
    """The axes a ReduceMax, ReduceMin or ReduceProd reduces, sorted (an attribute before opset 18, an input from it; all
    where none are given); None where they are not constant or none are given and `noop_with_empty_axes` is set."""
    given = attrs.get("axes") if opset < 18 else None
    if given is None and len(node.input) > 1 and node.input[1]:
        found = consts.get(node.input[1])
        if found is None:
            return None
        given = [int(a) for a in np.atleast_1d(found)]
    if not given and attrs.get("noop_with_empty_axes", 0):
        return None
    return sorted({int(a) % rank for a in given} if given else set(range(rank)))  # type: ignore[union-attr]


def _reduce_extreme(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                    consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """ReduceMax, ReduceMin and GlobalMaxPool as TopK(k=1) over the reduced axes moved last and flattened: the same
    values, and TopK has a gradient (to the first of tied elements, as a max pool's)."""
    shape, out = _static_shape(types, node.input[0]), _static_shape(types, node.output[0])
    if _float_input(node, types) is None or shape is None or out is None:
        return None
    attrs = _attributes(node)
    rank = len(shape)
    if node.op_type == "GlobalMaxPool":
        axes = list(range(2, rank))
    else:
        found = _reduced_axes(node, attrs, opset, consts, rank)
        if found is None:
            return None
        axes = found
    kept = [a for a in range(rank) if a not in axes]
    b = node_base(node, "topk")
    graph.initializer.extend([numpy_helper.from_array(np.array([*(shape[a] for a in kept), -1], np.int64), f"{b}/flat"),
                              numpy_helper.from_array(np.array([1], np.int64), f"{b}/k"),
                              numpy_helper.from_array(np.array(out, np.int64), f"{b}/out")])
    return f"{node.op_type} -> TopK over the reduced axes", [
        helper.make_node("Transpose", [node.input[0]], [f"{b}/moved"], name=f"{b}/moved", perm=kept + axes),
        helper.make_node("Reshape", [f"{b}/moved", f"{b}/flat"], [f"{b}/flattened"], name=f"{b}/flattened"),
        helper.make_node("TopK", [f"{b}/flattened", f"{b}/k"], [f"{b}/values", f"{b}/indices"], name=f"{b}/values", axis=-1,
                         largest=int(node.op_type != "ReduceMin")),
        helper.make_node("Reshape", [f"{b}/values", f"{b}/out"], [node.output[0]], name=node.name or f"{b}/shaped")]


def _reduce_prod(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                 consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """ReduceProd (torch.prod) as Muls of halves along each reduced axis (an odd element carried by a Concat), then a
    Reshape to the output: onnxruntime-training 1.19.2 has no ReduceProd gradient; Mul's is the product rule."""
    attrs, dtype, (shape, out) = _read(node, types, node.input[0], node.output[0])
    if dtype is None or shape is None or out is None:
        return None
    axes = _reduced_axes(node, attrs, opset, consts, len(shape))
    if axes is None:
        return None
    b = NodeBuilder(graph, node_base(node, "prod"), opset)
    current, lengths = node.input[0], list(shape)
    for axis in axes:
        while lengths[axis] > 1:
            n, half, source = lengths[axis], lengths[axis] // 2, current
            current = b.op("Mul", [b.op("Slice", [source, b.ints([lo]), b.ints([hi]), b.ints([axis])]) for lo, hi in ((0, half), (half, 2 * half))])
            if n % 2:
                current = b.op("Concat", [current, b.op("Slice", [source, b.ints([n - 1]), b.ints([n]), b.ints([axis])])], axis=axis)
            lengths[axis] = half + n % 2
    b.op("Reshape", [current, b.ints(out)], node.output[0])
    return "ReduceProd -> Muls of halves", b.nodes


def _sum_mean(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
              consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """Sum and Mean of several tensors as a chain of Adds (and a Div for Mean): Add broadcasts as they do."""
    dtype = _float_input(node, types)
    inputs = [name for name in node.input if name]
    if dtype is None or len(inputs) < 2:
        return None
    b = node_base(node, "adds")
    new, total = [], inputs[0]
    for k, name in enumerate(inputs[1:]):
        last = k == len(inputs) - 2 and node.op_type == "Sum"
        out = node.output[0] if last else f"{b}/{k}"
        new.append(helper.make_node("Add", [total, name], [out], name=node.name if last and node.name else f"{b}/add{k}"))
        total = out
    if node.op_type == "Mean":
        graph.initializer.append(numpy_helper.from_array(np.array(len(inputs), dtype), f"{b}/count"))
        new.append(helper.make_node("Div", [total, f"{b}/count"], [node.output[0]], name=node.name or f"{b}/mean"))
    return f"{node.op_type} -> Add", new


def _cumsum(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
            consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    """CumSum as a MatMul by a triangular matrix of ones along its axis (exclusive: strictly triangular; reverse: the
    other triangle), the axis swapped last and back where it is not."""
    dtype, shape = _float_input(node, types), _static_shape(types, node.input[0])
    axis = consts.get(node.input[1])
    if dtype is None or shape is None or axis is None or axis.size != 1:
        return None
    rank = len(shape)
    at = int(axis.reshape(-1)[0]) % rank
    attrs = _attributes(node)
    exclusive, reverse = int(attrs.get("exclusive", 0)), int(attrs.get("reverse", 0))  # type: ignore[call-overload]
    rows, cols = np.indices((shape[at], shape[at]))  # matrix[i, j] = 1 where output i sums input j
    matrix = ((cols >= rows + exclusive) if reverse else (cols <= rows - exclusive)).astype(np.float32)
    b = node_base(node, "cumsum")
    if at >= rank - 2:
        return "CumSum -> MatMul by a triangular matrix", _axis_matmuls(graph, node.input[0], {at: matrix}, rank, b, node.output[0], dtype)
    swap = list(range(rank))
    swap[at], swap[-1] = swap[-1], swap[at]
    return "CumSum -> MatMul by a triangular matrix", [
        helper.make_node("Transpose", [node.input[0]], [f"{b}/last"], name=f"{b}/last", perm=swap),
        *_axis_matmuls(graph, f"{b}/last", {rank - 1: matrix}, rank, b, f"{b}/summed", dtype),
        helper.make_node("Transpose", [f"{b}/summed"], [node.output[0]], name=node.name or f"{b}/back", perm=swap)]


def _recurrent(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
               consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    dtype = _float_input(node, types)
    new = None if dtype is None else unrolled(node, graph, _static_shape(types, node.input[0]), dtype, opset, node_base(node, "unrolled"))
    return None if new is None else (f"{node.op_type} -> its steps unrolled", new)


def _float32_layer_norm(node: onnx.NodeProto, types: Mapping[str, onnx.TypeProto], opset: int, graph: onnx.GraphProto,
                        consts: Mapping[str, np.ndarray]) -> tuple[str, list[onnx.NodeProto]] | None:
    found = types.get(node.input[0])
    if opset < 18 or found is None or found.tensor_type.elem_type not in (onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16):
        return None
    b = node_base(node, "float")
    casts = [helper.make_node("Cast", [name], [f"{b}/in{k}"], name=f"{b}/in{k}", to=onnx.TensorProto.FLOAT) for k, name in enumerate(node.input) if name]
    norm = onnx.NodeProto()
    norm.CopyFrom(node)
    norm.input[:] = [f"{b}/in{k}" if name else "" for k, name in enumerate(node.input)]
    norm.output[0] = f"{b}/out"
    back = helper.make_node("Cast", [f"{b}/out"], [node.output[0]], name=f"{b}/back", to=found.tensor_type.elem_type)
    return "float16 LayerNormalization -> Cast, LayerNormalization in float32, Cast", [*casts, norm, back]


#: The per-node rewrites, in the order they run, with the ops each reads.
PER_NODE: tuple[tuple[frozenset[str], NodeRewrite], ...] = (
    (frozenset({"InstanceNormalization"}), _instance_norm),
    (frozenset({"Resize"}), _resize),
    (frozenset({"ConvTranspose"}), _conv_transpose),
    (frozenset({"Conv"}), _grouped_conv),
    (frozenset({"Slice"}), _negative_slice),
    (frozenset({"Pad"}), _padded_by_copies),
    (frozenset({"Einsum"}), _einsum),
    (frozenset({"DepthToSpace", "SpaceToDepth"}), _depth_to_space),
    (frozenset({"ReduceMax", "ReduceMin", "GlobalMaxPool"}), _reduce_extreme),
    (frozenset({"ReduceProd"}), _reduce_prod),
    (frozenset({"Sum", "Mean"}), _sum_mean),
    (frozenset({"CumSum"}), _cumsum),
    (UNROLLED_OPS, _recurrent),
    (frozenset({"LayerNormalization"}), _float32_layer_norm),
)
