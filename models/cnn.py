"""Convolutional networks: resnet-tiny, inception-tiny (tests) and vgg16, resnet50 (planning studies).

Reading order: shared pieces (`_conv_act`, `_residual`, `_classifier`) -> `resnet_tiny`,
`resnet50` (basic and bottleneck blocks) -> `inception_tiny` -> `vgg16`.
"""

from __future__ import annotations

import onnx

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models.layers import GraphBuilder

__all__ = ["resnet_tiny", "resnet50", "inception_tiny", "vgg16", "FULL_SIZE_INIT"]

#: Weight std of full-size models: a fixed scale keeps building them fast (one vectorised draw per tensor).
FULL_SIZE_INIT = 0.02


def _image_input(b: GraphBuilder, batch: int, image: int) -> str:
    return b.input("image", (batch, 3, image, image))


def _conv_act(b: GraphBuilder, x: str, c_in: int, c_out: int, kernel: int, stride: int, bn: bool, name: str, relu: bool = True) -> str:
    """Conv (+ BatchNormalization) (+ Relu): the unit every CNN here is made of."""
    with b.scope(name):
        y = b.conv(x, c_in, c_out, kernel, stride, bias=not bn)
        if bn:
            y = b.batch_norm(y, c_out)
        return b.op("Relu", [y]) if relu else y


def _residual(b: GraphBuilder, body: str, shortcut: str) -> str:
    """The skip connection: Relu(body + shortcut)."""
    return b.op("Relu", [b.op("Add", [body, shortcut], name="skip")])


def _max_pool(b: GraphBuilder, x: str, kernel: int, stride: int) -> str:
    pad = kernel // 2 if kernel % 2 else 0
    return b.op("MaxPool", [x], kernel_shape=[kernel, kernel], strides=[stride, stride], pads=[pad] * 4)


def _classifier(b: GraphBuilder, x: str, channels: int, classes: int, batch: int, train: bool) -> onnx.ModelProto:
    """GlobalAveragePool -> Flatten -> Gemm, then the logits (and loss) outputs."""
    with b.scope("head"):
        pooled = b.op("Flatten", [b.op("GlobalAveragePool", [x])], axis=1)
        logits = b.gemm(pooled, channels, classes)
    b.classifier_outputs(logits, (batch, classes), train, (batch,))
    return b.model()


def _ensure_positive(**values: int) -> None:
    for key, value in values.items():
        if value < 1:
            raise OnnxpipeError(f"knob {key}={value} must be at least 1")


def _basic_block(b: GraphBuilder, x: str, c_in: int, c_out: int, stride: int, bn: bool) -> str:
    """Two 3x3 convs with a skip; a strided 1x1 projection when the shape changes."""
    body = _conv_act(b, x, c_in, c_out, 3, stride, bn, "conv1")
    body = _conv_act(b, body, c_out, c_out, 3, 1, bn, "conv2", relu=False)
    shortcut = x if stride == 1 and c_in == c_out else _conv_act(b, x, c_in, c_out, 1, stride, bn, "downsample", relu=False)
    return _residual(b, body, shortcut)


def _bottleneck(b: GraphBuilder, x: str, c_in: int, width: int, stride: int, bn: bool) -> str:
    """ResNet v1.5 bottleneck: 1x1 reduce, strided 3x3, 1x1 expand (x4), projection on shape change."""
    c_out = 4 * width
    body = _conv_act(b, x, c_in, width, 1, 1, bn, "conv1")
    body = _conv_act(b, body, width, width, 3, stride, bn, "conv2")
    body = _conv_act(b, body, width, c_out, 1, 1, bn, "conv3", relu=False)
    shortcut = x if stride == 1 and c_in == c_out else _conv_act(b, x, c_in, c_out, 1, stride, bn, "downsample", relu=False)
    return _residual(b, body, shortcut)


def resnet_tiny(*, blocks: int, channels: int, batch: int, image: int, classes: int, batchnorm: bool, train: bool, seed: int) -> onnx.ModelProto:
    """A small ResNet: 3x3 stem, `blocks` basic blocks (the middle one halves the image and doubles the
    channels), global pooling and a Gemm classifier.

    BatchNormalization is off by default: its gradient exists only after onnxruntime's pre-training
    rewrite (the executor applies it), and training then uses per-micro-batch statistics.
    """
    _ensure_positive(blocks=blocks, channels=channels, batch=batch, image=image, classes=classes)
    b = GraphBuilder("resnet-tiny", seed)
    x = _conv_act(b, _image_input(b, batch, image), 3, channels, 3, 1, batchnorm, "stem")
    c = channels
    for i in range(blocks):
        down = i == blocks // 2
        with b.scope(f"block{i}"):
            x = _basic_block(b, x, c, 2 * c if down else c, 2 if down else 1, batchnorm)
        c = 2 * c if down else c
    return _classifier(b, x, c, classes, batch, train)


def resnet50(*, batch: int, image: int, classes: int, train: bool, seed: int) -> onnx.ModelProto:
    """ResNet-50 v1.5 (stages 3-4-6-3, bottleneck width 64..512, stride on the 3x3): ~4.1 G MACs at 224x224."""
    _ensure_positive(batch=batch, image=image, classes=classes)
    b = GraphBuilder("resnet50", seed, init_scale=FULL_SIZE_INIT)
    x = _conv_act(b, _image_input(b, batch, image), 3, 64, 7, 2, True, "stem")
    x = _max_pool(b, x, 3, 2)
    c = 64
    for stage, (depth, width) in enumerate(zip((3, 4, 6, 3), (64, 128, 256, 512))):
        for i in range(depth):
            stride = 2 if i == 0 and stage > 0 else 1
            with b.scope(f"layer{stage + 1}.{i}"):
                x = _bottleneck(b, x, c, width, stride, True)
            c = 4 * width
    return _classifier(b, x, c, classes, batch, train)


def _inception_block(b: GraphBuilder, x: str, c_in: int, c: int) -> str:
    """Four parallel branches concatenated on channels: 1x1; 1x1->3x3; 1x1->3x3->3x3; maxpool->1x1."""
    reduce = max(1, c // 2)
    with b.scope("branch1x1"):
        b1 = _conv_act(b, x, c_in, c, 1, 1, False, "conv")
    with b.scope("branch3x3"):
        b2 = _conv_act(b, _conv_act(b, x, c_in, reduce, 1, 1, False, "reduce"), reduce, c, 3, 1, False, "conv")
    with b.scope("branch5x5"):
        b3 = _conv_act(b, x, c_in, reduce, 1, 1, False, "reduce")
        b3 = _conv_act(b, _conv_act(b, b3, reduce, c, 3, 1, False, "conv_a"), c, c, 3, 1, False, "conv_b")
    with b.scope("branch_pool"):
        b4 = _conv_act(b, _max_pool(b, x, 3, 1), c_in, c, 1, 1, False, "proj")
    return b.op("Concat", [b1, b2, b3, b4], name="concat", axis=1)


def inception_tiny(*, blocks: int, channels: int, batch: int, image: int, classes: int, train: bool, seed: int) -> onnx.ModelProto:
    """A small Inception net: 3x3 stem, `blocks` four-branch blocks (max-pool downsampling between
    them), global pooling and a Gemm classifier. Exercises fan-out/fan-in for the splitter."""
    _ensure_positive(blocks=blocks, channels=channels, batch=batch, image=image, classes=classes)
    b = GraphBuilder("inception-tiny", seed)
    x = _conv_act(b, _image_input(b, batch, image), 3, channels, 3, 1, False, "stem")
    c = channels
    for i in range(blocks):
        with b.scope(f"block{i}"):
            x = _inception_block(b, x, c, channels)
            c = 4 * channels
            if i < blocks - 1 and image >> i >= 2:
                x = _max_pool(b, x, 2, 2)
    return _classifier(b, x, c, classes, batch, train)


#: VGG configuration D: conv widths, "M" = 2x2 max-pool.
_VGG16 = (64, 64, "M", 128, 128, "M", 256, 256, 256, "M", 512, 512, 512, "M", 512, 512, 512, "M")


def vgg16(*, batch: int, image: int, classes: int, train: bool, seed: int) -> onnx.ModelProto:
    """VGG-16 (configuration D: 13 3x3 convs, 5 max-pools, 3 fully connected): ~15.5 G MACs at 224x224."""
    _ensure_positive(batch=batch, image=image, classes=classes)
    if image % 32:
        raise OnnxpipeError(f"knob image={image} must be a multiple of 32 for vgg16 (five 2x2 max-pools)")
    b = GraphBuilder("vgg16", seed, init_scale=FULL_SIZE_INIT)
    x, c, conv = _image_input(b, batch, image), 3, 0
    for item in _VGG16:
        if item == "M":
            x = _max_pool(b, x, 2, 2)
        else:
            conv += 1
            x = _conv_act(b, x, c, int(item), 3, 1, False, f"conv{conv}")
            c = int(item)
    x = b.op("Flatten", [x], axis=1)
    width = c * (image // 32) ** 2
    for i, n_out in enumerate((4096, 4096)):
        x = b.op("Relu", [b.gemm(x, width, n_out, name=f"fc{i + 1}")])
        width = n_out
    logits = b.gemm(x, width, classes, name="fc3")
    b.classifier_outputs(logits, (batch, classes), train, (batch,))
    return b.model()
