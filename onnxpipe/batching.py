"""One batch convention for every command: a symbolic leading dim of the model's inputs is one micro-batch.

`--batch B` is the global batch of one iteration, `--microbatches M` how many micro-batches it is cut
into, so a symbolic leading (batch) dim is bound to B / M, unless `--dim NAME=V` binds it. A model
whose leading dim is fixed takes B = M x that dim. split, plan, train (and its --check) bind a model
so (`bind_batch`); simulate re-binds a plan's batch the same way (`plan_binding`); a stage directory
(train DIR, run, verify) is bound by its files' shapes, which `--dim` can only confirm (`stage_binding`).
`BatchBinding.describe` says how, in one line, the same for every command.

Reading order: `BatchBinding` -> `bind_batch` -> `plan_binding` -> `stage_binding` -> `stage_dims`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import onnx

from onnxpipe.errors import OnnxpipeError
from onnxpipe.protostream import read_user_model
from onnxpipe.units import plural

__all__ = ["BatchBinding", "bind_batch", "plan_binding", "stage_binding", "stage_dims", "model_inputs"]


@dataclass(frozen=True)
class BatchBinding:
    """How a model's leading dim was bound."""

    #: Every symbolic dim to load the model with: the user's `--dim`s plus the bound batch dim.
    dims: dict[str, int] = field(default_factory=dict)
    #: The micro-batch (the loaded model's leading dim), when known.
    microbatch: int | None = None
    #: Micro-batches per iteration, when given.
    microbatches: int | None = None
    #: The symbolic leading dim's name, when the model has one.
    symbol: str | None = None
    #: True when `--dim` bound it rather than `--batch / --microbatches`.
    from_dim: bool = False
    #: Where the micro-batch came from when no flag bound a symbolic dim ("the stage files' batch", "the plan's batch").
    origin: str = ""

    def describe(self, batch: int, microbatches: int) -> str:
        """'batch 8 per iteration = 4 micro-batches of 2 (symbolic dim 'batch' bound to 2 by --batch / --microbatches ...)'."""
        if self.origin:
            source = self.origin
        elif self.symbol is not None:
            how = f"--dim {self.symbol}" if self.from_dim else "--batch / --microbatches (--dim overrides)"
            source = f"symbolic dim '{self.symbol}' bound to {batch // microbatches} by {how}"
        else:
            source = "the model's batch"
        return f"batch {batch} per iteration = {plural(microbatches, 'micro-batch')} of {batch // microbatches} ({source})"


def model_inputs(source: str | os.PathLike | onnx.ModelProto) -> Sequence[onnx.ValueInfoProto]:
    """The graph inputs fed by the user (initializers left out), read without the weights' bytes."""
    model = source if isinstance(source, onnx.ModelProto) else _header(Path(source))
    inits = {t.name for t in model.graph.initializer}
    return [vi for vi in model.graph.input if vi.name not in inits]


def _header(path: Path) -> onnx.ModelProto:
    return read_user_model(path, "pass the path of an .onnx model", "re-export it or check the file is complete", weights=False)


def _leading(inputs: Sequence[onnx.ValueInfoProto]) -> tuple[str, str | None, int | None]:
    """The first input with a leading dim: (input, symbol, None) or (input, None, fixed size); ("", None, None) without one."""
    for vi in inputs:
        dims = vi.type.tensor_type.shape.dim if vi.type.HasField("tensor_type") else ()
        if not dims:
            continue
        d = dims[0]
        if d.HasField("dim_value"):
            return vi.name, None, int(d.dim_value)
        return vi.name, d.dim_param or None, None
    return "", None, None


def bind_batch(source: str | os.PathLike | onnx.ModelProto, dims: Mapping[str, int] | None, batch: int | None,
               microbatches: int | None) -> BatchBinding:
    """Bind the model's symbolic leading dim to `batch / microbatches` (unless `dims` binds it) and
    check a fixed one against them; one-line errors name the flags that fix a mismatch."""
    dims = dict(dims or {})
    m = microbatches
    if batch is not None and batch < 1:
        raise OnnxpipeError(f"--batch {batch}: must be at least 1")
    first, symbol, fixed = _leading(model_inputs(source))
    if symbol is not None and symbol in dims:
        micro = dims[symbol]
        if batch is not None and m and batch != micro * m:
            raise OnnxpipeError(f"--batch {batch} is not {plural(m, 'micro-batch')} of --dim {symbol}={micro}; pass --batch {micro * m} or drop --dim {symbol}")
        return BatchBinding(dims, micro, m, symbol, True)
    if symbol is not None:
        if batch is None:
            raise OnnxpipeError(f"dim '{symbol}' of input '{first}' is unbound; pass --batch B (the global batch, cut into --microbatches) "
                                f"or --dim {symbol}=VALUE (one micro-batch)")
        if not m:
            raise OnnxpipeError(f"--batch {batch} binds the symbolic batch dim '{symbol}' to batch / micro-batches: pass --microbatches M too, or --dim {symbol}=V")
        if batch % m:
            raise OnnxpipeError(f"--batch {batch} does not split into {plural(m, 'micro-batch')}; pick a --batch that --microbatches divides")
        dims[symbol] = batch // m
        return BatchBinding(dims, batch // m, m, symbol, False)
    if fixed is not None and batch is not None and m and batch != fixed * m:
        raise OnnxpipeError(f"--batch {batch} with {plural(m, 'micro-batch')} needs micro-batches of {batch / m:g}, but the model's batch is fixed at {fixed}: "
                            f"pass --batch {fixed * m}, or re-export the model with a symbolic batch dim")
    return BatchBinding(dims, fixed, m, None, False)


def plan_binding(source: str | os.PathLike | onnx.ModelProto | None, plan_dims: Mapping[str, int], plan_batch: int, plan_microbatches: int,
                 dims: Mapping[str, int] | None, batch: int | None, microbatches: int | None) -> tuple[BatchBinding, int, int]:
    """A plan's batch, re-bound by the flags as `bind_batch` binds a model: `--dim BATCH_DIM=V` is the
    micro-batch, `--batch` the global batch, `--microbatches` the count (each defaulting to the plan's).
    `source`: the plan's model, read for the name of its symbolic batch dim (None when it cannot be found:
    a `--dim` must then name a dim the plan recorded at its micro-batch). Returns (binding, batch, micro-batches)."""
    dims = dict(dims or {})
    m = microbatches or plan_microbatches
    if batch is not None and batch < 1:
        raise OnnxpipeError(f"--batch {batch}: must be at least 1")
    symbol = _leading(model_inputs(source))[1] if source is not None else None
    if symbol is None and source is None:  # the model is not at hand: the recorded dim at the plan's micro-batch
        at_micro = [k for k, v in plan_dims.items() if v == plan_batch // plan_microbatches]
        symbol = at_micro[0] if len(at_micro) == 1 else None
    other = next((k for k in dims if k != symbol), None)
    if other is not None:
        known = f"its batch dim is '{symbol}'" if symbol else "its model has no symbolic batch dim"
        raise OnnxpipeError(f"--dim {other}: a plan's costs are re-priced for another batch only ({known}); "
                            f"re-plan the model with --dim {other}={dims[other]} for other shapes")
    if symbol is not None and symbol in dims:
        micro = dims[symbol]
        total = batch if batch is not None else micro * m
        if total != micro * m:
            raise OnnxpipeError(f"--batch {total} is not {plural(m, 'micro-batch')} of --dim {symbol}={micro}; pass --batch {micro * m} or drop --dim {symbol}")
        return BatchBinding({**plan_dims, symbol: micro}, micro, m, symbol, True), total, m
    total = batch if batch is not None else plan_batch
    if total % m:
        raise OnnxpipeError(f"--batch {total} does not split into {plural(m, 'micro-batch')}; pick a --batch that --microbatches divides")
    if (total, m) == (plan_batch, plan_microbatches):
        origin = "the plan's batch"
    elif symbol is None:  # a fixed (or unknown) batch dim: the simulator scales the plan's costs, the model would refuse it
        origin = f"the plan's micro-batches of {plan_batch // plan_microbatches} with costs scaled: the model itself takes only those"
    else:
        origin = ""
    bound = {**plan_dims, symbol: total // m} if symbol is not None else dict(plan_dims)
    return BatchBinding(bound, total // m, m, symbol, False, origin), total, m


def stage_binding(source: str | os.PathLike | onnx.ModelProto | None, shapes: Mapping[str, Sequence[int]], dims: Mapping[str, int] | None,
                  recorded: Mapping[str, int] | None = None) -> BatchBinding:
    """A stage directory's binding: its files' shapes (`shapes`: model input name -> shape) fix every dim,
    read off the model (`source`) or, without it, as the directory's plan recorded them (`recorded`).
    `dims` (the user's `--dim`s) can only confirm them: re-binding needs another split."""
    bound = stage_dims(source, shapes) if source is not None else dict(recorded or {})
    for name, value in (dims or {}).items():
        if name in bound and bound[name] != value:
            raise OnnxpipeError(f"--dim {name}={value}: the stages were split with {name}={bound[name]}; "
                                f"pass --dim {name}={bound[name]}, or split again with --dim {name}={value}")
        if name not in bound:
            have = ", ".join(f"{k}={v}" for k, v in bound.items()) or "none"
            raise OnnxpipeError(f"--dim {name}: the stages have no symbolic dim of that name (bound: {have})")
    first = next(iter(shapes.values()), ())
    symbol = _leading(model_inputs(source))[1] if source is not None else None
    return BatchBinding(bound, int(first[0]) if len(first) else None, None, symbol, False, "the stage files' batch")


def stage_dims(source: str | os.PathLike | onnx.ModelProto, shapes: Mapping[str, Sequence[int]]) -> dict[str, int]:
    """The symbolic dims a stage directory was cut with, read off its manifest's input shapes
    (`shapes`: model input name -> shape), so the model loads again exactly as it was split."""
    dims: dict[str, int] = {}
    for vi in model_inputs(source):
        shape = shapes.get(vi.name)
        if shape is None or not vi.type.HasField("tensor_type"):
            continue
        for d, size in zip(vi.type.tensor_type.shape.dim, shape):
            if d.dim_param and not d.HasField("dim_value"):
                dims.setdefault(d.dim_param, int(size))
    return dims
