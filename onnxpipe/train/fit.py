"""The training loop behind `onnxpipe train`: data source, steps, checkpoints, resume, and the
check against unpartitioned training."""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import numpy as np

from onnxpipe.train.checkpoint import hold_checkpoint_dir
from onnxpipe import feeds
from onnxpipe.errors import OnnxpipeError
from onnxpipe.feeds import IndexRange
from onnxpipe.train.data import BatchSource, SyntheticData, open_data
from onnxpipe.train.loss import classes
from onnxpipe.train.pipeline import Pipeline

__all__ = ["data_source", "index_ranges", "fit", "check"]


def index_ranges(pipeline: Pipeline) -> dict[str, IndexRange]:
    """The range of every integer model input: the table a Gather indexes or the classes a loss scores
    (the loss `--loss` appends included)."""
    ranges = feeds.index_ranges(pipeline.directory, pipeline.manifest)
    loss = pipeline.config.loss
    if loss is not None and loss.kind == "cross_entropy":
        out = next(o for o in pipeline.manifest.outputs if o.name == loss.output)
        ranges[loss.labels] = IndexRange(classes(loss, tuple(out.shape)), f"classes of output '{loss.output}' --loss cross_entropy scores")
    return ranges


def data_source(pipeline: Pipeline, data: str, seed: int = 0) -> BatchSource:
    """`synthetic` (seeded, right shapes, labels in range) or an .npz file cut into batches."""
    if data == "synthetic":
        return SyntheticData(pipeline.inputs, pipeline.config.microbatches, {k: r.high for k, r in index_ranges(pipeline).items()}, seed)
    return open_data(data, pipeline.inputs, pipeline.batch, index_ranges(pipeline))


def fit(pipeline: Pipeline, source: BatchSource, steps: int, *, checkpoint_dir: str | None = None, every: int = 0,
        resume: bool = False, on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train until `steps` steps are done (continuing a checkpoint with `resume`); returns every step's loss.
    The checkpoint directory is held for the whole run (`hold_checkpoint_dir`): a second run fails at once."""
    with hold_checkpoint_dir(checkpoint_dir) if checkpoint_dir else contextlib.nullcontext():
        if resume and checkpoint_dir:  # a missing checkpoint is an error, never a silent start at step 0
            pipeline.load(checkpoint_dir)
        while pipeline.step < steps:
            loss = pipeline.train_step(source.batch(pipeline.step))
            if not np.isfinite(loss):
                raise OnnxpipeError(f"step {pipeline.step}: the loss is {loss}, training diverged; lower --lr{_narrow_hint(pipeline)}")
            if on_step:
                on_step(pipeline.step, loss)
            if checkpoint_dir and every and (pipeline.step % every == 0 or pipeline.step == steps):
                pipeline.save(checkpoint_dir)
    return list(pipeline.losses)


def _narrow_hint(pipeline: Pipeline) -> str:
    """Why float16 weights diverge under AdamW, where they do: as in torch.optim, its state is kept in the weights'
    type, where eps (1e-8) and small squared gradients are 0."""
    if pipeline.config.optimizer.name != "adamw" or not any(v.dtype == np.float16 for v in pipeline.parameters().values()):
        return ""
    if pipeline.config.optimizer.master_weights:
        return ""
    return (", or add --master-weights (float32 copies of the float16 weights, AdamW's state in float32: without them its state is "
            "float16, as in torch, where its eps 1e-8 is 0)")


def check(pipeline: Pipeline, source: BatchSource, steps: int) -> dict[str, float]:
    """Train the unpartitioned model on the same batches; max relative loss and absolute weight differences."""
    ref = pipeline.reference()
    ref_losses = [ref.train_step(pipeline.microbatches(source.batch(s))) for s in range(steps)]
    got, want = pipeline.parameters(), ref.parameters()
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(pipeline.losses, ref_losses))
    weight_diff = max(float(np.max(np.abs(got[k] - v))) for k, v in want.items() if k in got)
    return {"max_loss_rel_diff": loss_diff, "max_weight_abs_diff": weight_diff, "reference_losses": ref_losses}  # type: ignore[dict-item]
