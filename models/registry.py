"""The model registry: names -> specs (builder, knob defaults), knob checking, and saving.

Reading order: `ModelSpec` -> `_SPECS` (the zoo) -> `names`, `spec`, `build` -> `parse_knob`
-> `save`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType

import onnx

from onnxpipe.errors import OnnxpipeError
from onnxpipe.models import cnn, control_flow, mlp, multi_io, rnn, transformer
from onnxpipe.models.layers import weights_into

__all__ = ["ModelSpec", "Knob", "names", "spec", "specs", "build", "build_sparse", "parse_knob", "save", "EXTERNAL_DATA_THRESHOLD"]

Knob = int | float | bool

#: Models larger than this are saved with their weights in a side file (protobuf caps a file at 2 GB).
EXTERNAL_DATA_THRESHOLD = int(1.5 * 2**30)


@dataclass(frozen=True)
class ModelSpec:
    """One entry of the zoo."""

    #: Registry name, e.g. "gpt2-tiny".
    name: str
    #: One line: what the model is and what it is for.
    description: str
    #: Called with every knob (defaults overridden by the caller's) as keyword arguments.
    builder: Callable[..., onnx.ModelProto] = field(repr=False)
    #: Knob defaults; their types are the accepted types. Always holds `seed`; `train` when trainable.
    knobs: Mapping[str, Knob]
    #: Whether `train=True` builds a training variant (first output: scalar loss, extra `labels` input).
    trainable: bool
    #: Real-size model for cost and planning studies: large, built lazily, not run in tests.
    full_size: bool


def _spec(name: str, description: str, builder: Callable[..., onnx.ModelProto], knobs: Mapping[str, Knob], trainable: bool = True,
          full_size: bool = False) -> ModelSpec:
    defaults = dict(knobs)
    if trainable:
        defaults["train"] = False
    defaults["seed"] = 0
    return ModelSpec(name, description, builder, MappingProxyType(defaults), trainable, full_size)


def _with(builder: Callable[..., onnx.ModelProto], **fixed: object) -> Callable[..., onnx.ModelProto]:
    """`builder` with some keyword arguments fixed (not knobs)."""

    def bound(**knobs: object) -> onnx.ModelProto:
        return builder(**knobs, **fixed)

    bound.__doc__ = builder.__doc__
    return bound


_DECODER = {"layers": 4, "d_model": 64, "heads": 4, "seq": 32, "vocab": 256, "batch": 8}

_SPECS: dict[str, ModelSpec] = {
    s.name: s
    for s in (
        _spec("mlp", "Gemm+Relu perceptron; cross-entropy or (mse) squared-error training", mlp.mlp,
              {"layers": 3, "width": 32, "batch": 8, "in_features": 16, "classes": 10, "mse": False}),
        _spec("resnet-tiny", "small ResNet: residual skips, one downsample, global pool", cnn.resnet_tiny,
              {"blocks": 2, "channels": 8, "batch": 4, "image": 16, "classes": 10, "batchnorm": False}),
        _spec("inception-tiny", "small Inception: four-branch blocks joined by Concat", cnn.inception_tiny,
              {"blocks": 2, "channels": 8, "batch": 4, "image": 16, "classes": 10}),
        _spec("transformer-tiny", "smallest GPT-style decoder: causal mask, tied embedding", transformer.decoder,
              {"layers": 2, "d_model": 32, "heads": 2, "seq": 16, "vocab": 64, "batch": 4}),
        _spec("gpt2-tiny", "GPT-2-shaped decoder, 4 layers: the quick-start model", transformer.decoder, _DECODER),
        _spec("bert-tiny", "BERT-shaped encoder (post-LN; padding_mask: an attention_mask input) with a tied masked-LM head",
              transformer.encoder, {"layers": 2, "d_model": 64, "heads": 4, "seq": 32, "vocab": 256, "batch": 4, "padding_mask": False}),
        _spec("gnmt-tiny", "GNMT-shaped LSTM seq2seq with attention (trains through onnxruntime's LSTM rewrite)", rnn.gnmt,
              {"layers": 2, "hidden": 32, "seq": 8, "vocab": 64, "batch": 4}),
        _spec("two-io", "two inputs, two outputs (an early head), skip connections", multi_io.two_io,
              {"width": 32, "batch": 8, "in_features": 16, "classes": 10}),
        _spec("control-flow", "If and Loop whose bodies capture outer-scope tensors", control_flow.control_flow,
              {"width": 16, "batch": 4, "in_features": 8, "classes": 4, "steps": 3}, trainable=False),
        _spec("vgg16", "VGG-16 (config D), 224x224: ~15.5 G MACs, 138 M parameters", cnn.vgg16,
              {"batch": 1, "image": 224, "classes": 1000}, full_size=True),
        _spec("resnet50", "ResNet-50 v1.5 with BatchNormalization, 224x224: ~4.1 G MACs, 25.6 M parameters", cnn.resnet50,
              {"batch": 1, "image": 224, "classes": 1000}, full_size=True),
        _spec("gnmt8", "GNMT: 8+8 LSTM layers, hidden 1024, vocab 32000, attention, ~295 M parameters", _with(rnn.gnmt, full_size=True),
              {"layers": 8, "hidden": 1024, "seq": 32, "vocab": 32000, "batch": 1}, full_size=True),
        _spec("gpt2", "GPT-2 small: 12 layers, d_model 768, 12 heads, vocab 50257, tied embedding (124 M)", transformer.gpt2,
              {"layers": 12, "d_model": 768, "heads": 12, "seq": 128, "vocab": 50257, "batch": 1}, full_size=True),
        _spec("bert", "BERT-base: 12 layers, d_model 768, 12 heads, vocab 30522, masked-LM head (110 M)", transformer.bert,
              {"layers": 12, "d_model": 768, "heads": 12, "seq": 128, "vocab": 30522, "batch": 1}, full_size=True),
    )
}


def names() -> tuple[str, ...]:
    """Registered model names, small models first, in registry order."""
    return tuple(_SPECS)


def specs() -> tuple[ModelSpec, ...]:
    """Every registered spec, in `names()` order."""
    return tuple(_SPECS.values())


def spec(name: str) -> ModelSpec:
    """The spec of a model name; an unknown name is an OnnxpipeError listing the choices."""
    try:
        return _SPECS[name]
    except KeyError:
        raise OnnxpipeError(f"unknown model {name!r}; choose one of: {', '.join(_SPECS)}") from None


_KIND = {bool: "true or false", int: "an integer", float: "a number"}


def _ensure_knob(s: ModelSpec, key: str, value: object) -> Knob:
    if key not in s.knobs:
        raise OnnxpipeError(f"model {s.name!r} has no knob {key!r}; its knobs: {', '.join(s.knobs)}")
    default = s.knobs[key]
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    else:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value  # type: ignore[arg-type]
    if not ok:
        raise OnnxpipeError(f"knob {key}={value!r} of model {s.name!r} must be {_KIND[type(default)]}")
    return value  # type: ignore[return-value]


def build(name: str, **knobs: Knob) -> onnx.ModelProto:
    """Build a registered model; knobs not given take the spec's defaults."""
    s = spec(name)
    if knobs.get("train") and not s.trainable:
        raise OnnxpipeError(f"model {name!r} has no training variant; trainable models: {', '.join(x.name for x in specs() if x.trainable)}")
    values = dict(s.knobs)
    values.update({key: _ensure_knob(s, key, value) for key, value in knobs.items()})
    model = s.builder(**values)
    model.graph.name = name
    return model


def parse_knob(name: str, item: str) -> tuple[str, Knob]:
    """`KEY=VALUE` text (command line) as a typed knob of model `name`, typed like its default."""
    s = spec(name)
    key, sep, text = item.partition("=")
    key, text = key.strip(), text.strip()
    if not sep or not key or not text:
        raise OnnxpipeError(f"--set {item!r}: expected KEY=VALUE, e.g. --set layers=4")
    if key not in s.knobs:
        _ensure_knob(s, key, None)
    default = s.knobs[key]
    try:
        if isinstance(default, bool):
            if text.lower() not in ("true", "false", "1", "0", "yes", "no"):
                raise ValueError(text)
            return key, text.lower() in ("true", "1", "yes")
        return key, type(default)(text)
    except ValueError:
        raise OnnxpipeError(f"--set {item!r}: {key} of model {name!r} must be {_KIND[type(default)]} (default {default})") from None


def build_sparse(name: str, path: str | os.PathLike, **knobs: Knob) -> list[Path]:
    """Build a registered model with its weights in a sparse `<file>.data` beside it (`layers.weights_into`), and
    write it: a full-size model for planning, in seconds and in little memory, as no weight is drawn or held. Not for
    training. Returns the files written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    data = target.with_name(target.name + ".data")
    with weights_into(data):
        model = build(name, **knobs)
    onnx.save(model, str(target))
    return [target, data]


def save(model: onnx.ModelProto, path: str | os.PathLike, external: bool | None = None) -> list[Path]:
    """Write a model; weights go to `<file>.data` beside it when `external` (default: when the model is
    over EXTERNAL_DATA_THRESHOLD). Returns the files written."""
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    if external is None:
        external = model.ByteSize() > EXTERNAL_DATA_THRESHOLD
    if not external:
        onnx.save(model, str(target))
        return [target]
    data = target.with_name(target.name + ".data")
    if data.exists():
        data.unlink()  # onnx appends to an existing data file
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    onnx.save(copy, str(target), save_as_external_data=True, all_tensors_to_one_file=True, location=data.name, size_threshold=1024)
    return [target, data]

